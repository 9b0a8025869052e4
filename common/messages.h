// Domain form of the parameter service's hot messages (Push, Pull). Payloads
// are views into the received gRPC slices, kept alive by `keepalive`; see
// common/rpc/wire_codec.h for the encoding.
#ifndef FULCRUM_COMMON_MESSAGES_H_
#define FULCRUM_COMMON_MESSAGES_H_

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/payload.h"

namespace fulcrum {

// A malloc'ed buffer, so it can be handed to gRPC as a slice freed with free().
struct OwnedBuffer {
  struct FreeDeleter {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, FreeDeleter> data;
  size_t size = 0;

  static OwnedBuffer Allocate(size_t size) {
    OwnedBuffer b;
    b.data.reset(static_cast<uint8_t*>(std::malloc(size == 0 ? 1 : size)));
    b.size = size;
    return b;
  }
};

struct DenseSliceView {
  std::string table;
  uint32_t chunk = 0;
  DType dtype = DType::kUnspecified;
  Payload data;
};

struct SparseSliceView {
  std::string table;
  DType dtype = DType::kUnspecified;
  Payload keys;    // uint64 little-endian
  Payload values;  // keys x dim elements of dtype
};

struct PushMessage {
  std::string job_id;
  std::string worker_id;
  uint64_t seq = 0;
  uint32_t rank = 0;
  uint64_t step = 0;
  uint32_t num_parts = 1;
  bool more_parts = false;  // num_parts 0: the total comes with a later part
  uint32_t incarnation = 0;
  // The job's learning rate times this for this push's update (batch_size
  // auto's scaling and warm-up); a BSP step uses its ranks' mean.
  float lr_scale = 1.0f;
  // The samples this gradient covers; 0 when not given (PushRequest.samples).
  uint64_t samples = 0;
  // Sparse rows of a step inside a local-steps round: applied on arrival,
  // counted toward no step (PushRequest.unclocked).
  bool unclocked = false;
  uint64_t shard_map_version = 0;
  std::vector<DenseSliceView> dense;
  std::vector<SparseSliceView> sparse;
  std::shared_ptr<const void> keepalive;  // owns the bytes the payloads view
  // The payloads lie in memory the sender can still write (a shared-memory
  // slot): every gradient is copied out before it is checked or applied.
  bool volatile_payload = false;
  // The SPIFFE ID of the certificate the request came with (set by the
  // transport, never by the sender); empty in plaintext and in-process.
  std::string caller;
};

struct PushResult {
  bool duplicate = false;
  uint64_t applied_step = 0;
};

struct DenseChunkRef {
  std::string table;
  uint32_t chunk = 0;
};

struct SparseKeysView {
  std::string table;
  Payload keys;
};

struct PullMessage {
  std::string job_id;
  std::string worker_id;
  uint32_t rank = 0;
  uint64_t step = 0;
  uint64_t shard_map_version = 0;
  DType dtype = DType::kFp32;
  uint32_t wait_timeout_ms = 0;
  uint32_t incarnation = 0;
  bool unclocked = false;  // served without waiting (PullRequest.unclocked)
  bool prefetch = false;   // a hint: rows read ahead, none returned (PullRequest.prefetch)
  std::vector<DenseChunkRef> dense;
  std::vector<SparseKeysView> sparse;
  std::shared_ptr<const void> keepalive;
  std::string caller;  // as PushMessage::caller
};

struct PullResult {
  struct Dense {
    std::string table;
    uint32_t chunk = 0;
    DType dtype = DType::kFp32;
    OwnedBuffer data;
    // Instead of `data`: bytes [shared, shared + shared_size) kept alive by
    // `owner` (a chunk's weights served without a copy).
    std::shared_ptr<const void> owner;
    const void* shared = nullptr;
    size_t shared_size = 0;
  };
  struct Sparse {
    std::string table;
    DType dtype = DType::kFp32;
    OwnedBuffer values;  // in request key order
  };
  std::vector<Dense> dense;
  std::vector<Sparse> sparse;
  uint64_t applied_step = 0;
};

// A decoded pull response on the client side: views into received slices.
struct PullResponseView {
  std::vector<DenseSliceView> dense;
  std::vector<SparseSliceView> sparse;  // keys empty
  uint64_t applied_step = 0;
  std::shared_ptr<const void> keepalive;
};

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_MESSAGES_H_
