// PsClient: how a worker talks to the parameter servers.
//
// Push and Pull take whole tables (dense) or key lists (sparse); the client
// slices them by the shard map, sends to all servers in parallel and returns
// a future that completes when every server answered. Synchronous wrappers
// wait on that future. Memory passed in (gradients, keys, outputs) must stay
// valid until the future completes. Thread-safe.
//
// Errors: NOT_FOUND (unknown job), INVALID_ARGUMENT (shape, dtype, NaN/Inf;
// the message names the table), RESOURCE_EXHAUSTED (quota),
// DEADLINE_EXCEEDED (a consistency wait ran out; the message says what it
// waited for), UNAVAILABLE (a server could not be reached in time).
#ifndef FULCRUM_WORKER_PS_CLIENT_H_
#define FULCRUM_WORKER_PS_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/future.h"
#include "fulcrum/v1/common.pb.h"
#include "fulcrum/v1/ps.pb.h"

namespace fulcrum {

struct DenseGradient {
  std::string table;
  const float* data = nullptr;  // the whole table's gradient
  size_t size = 0;              // must equal the table's element count
};

struct SparseGradient {
  std::string table;
  const uint64_t* keys = nullptr;
  size_t num_keys = 0;
  const float* values = nullptr;  // num_keys x dim
};

struct PushBatch {
  uint64_t step = 0;  // the worker's clock: 0 for the first step
  std::vector<DenseGradient> dense;
  std::vector<SparseGradient> sparse;
  // A step's gradients may be pushed in several groups as they become ready
  // (a layer's while earlier layers' backward runs): every group but the
  // step's last has last = false. Each table of a step goes in one group.
  bool last = true;
  // The job's learning rate is multiplied by this for this step's update:
  // batch_size auto's linear scaling and warm-up (PushRequest.lr_scale).
  float lr_scale = 1.0f;
  // The training samples this gradient covers, 0 when not given
  // (PushRequest.samples): local steps' rounds weigh their pseudo-gradients
  // by it.
  uint64_t samples = 0;
  // Sparse rows of a step inside a local-steps round: applied on arrival,
  // counted toward no step (PushRequest.unclocked); `step` then only picks
  // the learning-rate schedule. Sparse gradients only.
  bool unclocked = false;
};

struct DenseTarget {
  std::string table;
  float* out = nullptr;  // the whole table
  size_t size = 0;
};

struct SparseTarget {
  std::string table;
  const uint64_t* keys = nullptr;
  size_t num_keys = 0;
  float* out = nullptr;  // num_keys x dim; rows are created on first pull
};

struct PullBatch {
  // The caller's clock: BSP returns weights with steps < step applied; SSP
  // waits while the slowest worker is more than the bound behind.
  uint64_t step = 0;
  std::vector<DenseTarget> dense;
  std::vector<SparseTarget> sparse;
  // Sparse rows for a step inside a local-steps round: served as they are,
  // without waiting (PullRequest.unclocked). Sparse targets only.
  bool unclocked = false;
  // The weights of exactly `step` (BSP): a server that has applied step
  // `step` already would answer with newer ones, and the pull fails with a
  // TornStepError (common/errors.h) instead. A replacement's first step.
  bool exact = false;
};

class PsClient {
 public:
  virtual ~PsClient() = default;

  // Creates the job's tables on every server (idempotent for the same spec)
  // and remembers them for routing.
  virtual absl::Status CreateJob(const v1::PsJobSpec& spec) = 0;
  // Learns the tables of a job created elsewhere.
  virtual absl::Status OpenJob(const std::string& job_id) = 0;
  // Deletes the job on every server, freeing its tables.
  virtual absl::Status DeleteJob(const std::string& job_id) = 0;

  virtual Future<absl::Status> PushAsync(const std::string& job_id, const PushBatch& batch) = 0;
  virtual Future<absl::Status> PullAsync(const std::string& job_id, const PullBatch& batch) = 0;
  // The job's statistics as server `server` (an index into the shard map's
  // servers) holds them: its step, each rank's clock. UNIMPLEMENTED where
  // the client has no servers to ask.
  virtual absl::StatusOr<v1::GetJobResponse> GetJobStats(const std::string& job_id, size_t server) {
    (void)job_id;
    (void)server;
    return absl::UnimplementedError("this client does not report job statistics");
  }
  // A hint that a push follows shortly (the worker's backward pass has
  // begun): a transport whose servers sleep between requests may wake them
  // now, so the push finds them awake. Optional; does nothing by default.
  virtual void ExpectPush() {}
  // A hint that a coming pull names these sparse keys (each target's `out`
  // is not used): servers whose tables keep rows on disk read those rows
  // ahead (PullRequest.prefetch), so the pull finds them in memory. Sent and
  // forgotten: a hint that fails costs nothing but its read-ahead. The keys
  // are copied before this returns. Does nothing by default.
  virtual void Prefetch(const std::string& job_id, const std::vector<SparseTarget>& keys) {
    (void)job_id;
    (void)keys;
  }

  absl::Status Push(const std::string& job_id, const PushBatch& batch) {
    return PushAsync(job_id, batch).Wait();
  }
  absl::Status Pull(const std::string& job_id, const PullBatch& batch) {
    return PullAsync(job_id, batch).Wait();
  }
};

}  // namespace fulcrum

#endif  // FULCRUM_WORKER_PS_CLIENT_H_
