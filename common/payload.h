// Payload: a read-only view of bytes that may lie in several pieces (a
// message received by gRPC arrives as a list of slices). Viewing instead of
// copying keeps big tensors out of intermediate buffers; CopyTo gathers.
#ifndef FULCRUM_COMMON_PAYLOAD_H_
#define FULCRUM_COMMON_PAYLOAD_H_

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include <vector>

namespace fulcrum {

struct ByteSpan {
  const uint8_t* data = nullptr;
  size_t size = 0;
};

class Payload {
 public:
  Payload() = default;
  Payload(const void* data, size_t size) { Append(data, size); }

  void Append(const void* data, size_t size) {
    if (size == 0) return;
    pieces_.push_back({static_cast<const uint8_t*>(data), size});
    size_ += size;
  }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  const std::vector<ByteSpan>& pieces() const { return pieces_; }
  // Non-null when the payload is one contiguous piece (or empty).
  const uint8_t* contiguous() const {
    if (pieces_.empty()) return reinterpret_cast<const uint8_t*>("");
    return pieces_.size() == 1 ? pieces_[0].data : nullptr;
  }

  // Copies all bytes to dst (which has room for size()).
  void CopyTo(void* dst) const {
    auto* out = static_cast<uint8_t*>(dst);
    for (const ByteSpan& p : pieces_) {
      std::memcpy(out, p.data, p.size);
      out += p.size;
    }
  }
  std::string ToString() const {
    std::string s(size_, '\0');
    CopyTo(s.data());
    return s;
  }

 private:
  std::vector<ByteSpan> pieces_;
  size_t size_ = 0;
};

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_PAYLOAD_H_
