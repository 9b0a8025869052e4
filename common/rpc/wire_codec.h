// Hand-rolled protobuf wire encoding of the hot messages (PushRequest,
// PullRequest, PullResponse, StreamRequest, StreamResponse) to and from
// grpc::ByteBuffer, so tensor bytes are never copied into protobuf strings:
// encoders reference payload memory as slices, decoders return views into the
// received slices. The bytes on the wire are exactly what protoc-generated
// code produces and accepts, so any gRPC client can use proto/fulcrum/v1.
#ifndef FULCRUM_COMMON_RPC_WIRE_CODEC_H_
#define FULCRUM_COMMON_RPC_WIRE_CODEC_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include "absl/status/status.h"
#include "common/messages.h"
#include "common/payload.h"

namespace fulcrum::wire {

// Builds a message as a list of slices: small fields are coalesced into
// owned buffers, big payloads are appended as slices without copying.
class Writer {
 public:
  void Varint(uint32_t field, uint64_t value);  // omitted when 0 (proto3 default)
  void String(uint32_t field, std::string_view bytes);  // omitted when empty
  void Float(uint32_t field, float value);              // omitted when 0
  // A bytes field whose content references `data` without copying; the
  // memory must outlive the RPC.
  void External(uint32_t field, const Payload& data);
  // A bytes field that takes ownership of `buffer` (freed by gRPC).
  void Owned(uint32_t field, OwnedBuffer buffer);
  // A bytes field referencing `data` without copying; gRPC holds `owner`
  // until it has sent the bytes.
  void Shared(uint32_t field, const void* data, size_t size, std::shared_ptr<const void> owner);
  void Message(uint32_t field, Writer&& inner);
  size_t size() const { return size_; }
  grpc::ByteBuffer Finish();
  // Finishes the message into `dst` (room for size() bytes) instead of a
  // ByteBuffer, e.g. a shared-memory slot; returns the bytes written.
  size_t FinishInto(uint8_t* dst);

 private:
  void Tag(uint32_t field, uint32_t wire_type);
  void RawVarint(uint64_t value);
  void AppendSlice(grpc::Slice slice);
  void FlushSmall();

  std::vector<grpc::Slice> slices_;
  std::string small_;
  size_t size_ = 0;
};

// Reads protobuf fields from a (possibly multi-piece) payload.
class Reader {
 public:
  explicit Reader(const Payload& payload);
  bool done() const { return remaining_ == 0; }
  absl::Status Next(uint32_t* field, uint32_t* wire_type);
  absl::Status Varint(uint64_t* value);
  absl::Status Fixed32(uint32_t* value);  // little-endian
  absl::Status Bytes(Payload* out);  // a view, no copy
  absl::Status String(std::string* out);
  absl::Status Skip(uint32_t wire_type);

 private:
  absl::Status Byte(uint8_t* b);
  absl::Status Advance(size_t n, Payload* out);

  std::vector<ByteSpan> pieces_;
  size_t piece_ = 0;
  size_t offset_ = 0;
  size_t remaining_ = 0;
};

// Views a received ByteBuffer; the returned keepalive owns its slices.
absl::Status ViewByteBuffer(const grpc::ByteBuffer& buffer, Payload* payload,
                            std::shared_ptr<const void>* keepalive);

// --- Encoders. Payload views in the messages must outlive the RPC. ---
Writer EncodePush(const PushMessage& m);
Writer EncodePull(const PullMessage& m);
Writer EncodePushResult(const PushResult& r);
Writer EncodePullResult(PullResult&& r);  // moves the buffers into slices
Writer EncodeStreamRequest(uint64_t id, bool is_push, Writer&& body);
Writer EncodeStreamResponse(uint64_t id, const absl::Status& status, uint64_t shard_map_version,
                            bool is_push, Writer&& body);

// --- Decoders. Errors are INVALID_ARGUMENT naming the malformed field. ---
absl::Status DecodePush(const Payload& p, PushMessage* m);
absl::Status DecodePull(const Payload& p, PullMessage* m);
absl::Status DecodePushResult(const Payload& p, PushResult* r);
absl::Status DecodePullResponse(const Payload& p, PullResponseView* r);

struct StreamRequestView {
  uint64_t id = 0;
  bool is_push = false;
  bool has_body = false;
  Payload body;
};
absl::Status DecodeStreamRequest(const Payload& p, StreamRequestView* r);

struct StreamResponseView {
  uint64_t id = 0;
  int32_t code = 0;
  std::string message;
  uint64_t shard_map_version = 0;
  bool is_push = false;
  Payload body;
};
absl::Status DecodeStreamResponse(const Payload& p, StreamResponseView* r);
// The status a decoded StreamResponse carries (a shard-map mismatch as
// WrongShardError, so callers can re-route).
absl::Status StatusOf(const StreamResponseView& r);

}  // namespace fulcrum::wire

#endif  // FULCRUM_COMMON_RPC_WIRE_CODEC_H_
