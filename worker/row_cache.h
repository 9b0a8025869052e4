// CachingPsClient: a worker's cache of the sparse rows it pulls most
// (JobSpec.cache; docs/embeddings.md "The worker's row cache").
//
// A PsClient that wraps another. Each sparse table the job created through
// it gets a cache of at most `rows` rows in host memory. A pull at clock t
// serves a cached row when it was pulled at a clock f with
// t - max_staleness_steps <= f <= t, and asks the servers for every other
// row; the rows they send are then kept where the cache admits them. Pushes
// pass through untouched: gradients of cached rows reach the servers as
// before, and the cached copy stays as pulled until it is pulled again.
//
// With max_staleness_steps 0 a row is served only at the clock it was pulled
// at, so a BSP job trains exactly as without the cache. Pulls of exactly a
// clock (PullBatch.exact, a replacement's first step) bypass the cache.
//
// Which rows stay: frequency decides (a count-min sketch of each key's
// pulls, halved as it fills). When the cache is full, a row the servers
// sent replaces the clock hand's next unreferenced row only if its key was
// pulled more often; rows served from the cache are marked referenced.
// Thread-safe; one mutex per table.
#ifndef FULCRUM_WORKER_ROW_CACHE_H_
#define FULCRUM_WORKER_ROW_CACHE_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "common/metrics/metrics.h"
#include "worker/ps_client.h"

namespace fulcrum {

// What a worker's caches did, summed over its tables (Prometheus:
// fulcrum_worker_cache_*). Owned by whoever reports it; outlives the client.
struct RowCacheStats {
  std::atomic<uint64_t> hits{0};         // rows served from the cache
  std::atomic<uint64_t> misses{0};       // rows of cached tables asked of the servers
  std::atomic<uint64_t> bytes_saved{0};  // wire bytes of the rows served from the cache
  std::atomic<uint64_t> rows{0};         // rows held now
  std::atomic<uint64_t> bytes{0};        // host memory they take
  std::atomic<uint64_t> max_staleness{0};  // the oldest row served, in steps
  // Each served row's age in steps (the pull's clock minus the clock it was
  // pulled at).
  metrics::Histogram staleness{metrics::StalenessBuckets()};
};

struct RowCacheOptions {
  uint64_t rows = 0;                 // per sparse table; 0: no cache
  uint32_t max_staleness_steps = 0;  // how old a served row may be
  size_t wire_value_bytes = 4;       // bytes per value on the wire (the job's wire_dtype), for bytes_saved
  RowCacheStats* stats = nullptr;    // optional
};

class CachingPsClient final : public PsClient {
 public:
  // `inner` must outlive this client.
  CachingPsClient(PsClient* inner, RowCacheOptions options);
  ~CachingPsClient() override;

  absl::Status CreateJob(const v1::PsJobSpec& spec) override;
  absl::Status OpenJob(const std::string& job_id) override;
  absl::Status DeleteJob(const std::string& job_id) override;
  Future<absl::Status> PushAsync(const std::string& job_id, const PushBatch& batch) override;
  Future<absl::Status> PullAsync(const std::string& job_id, const PullBatch& batch) override;
  absl::StatusOr<v1::GetJobResponse> GetJobStats(const std::string& job_id, size_t server) override;
  void ExpectPush() override;
  // Passed on as it is: a cached row's key may lie on a server's disk too.
  void Prefetch(const std::string& job_id, const std::vector<SparseTarget>& keys) override;

  // Rows held for a table of a job (0 for one without a cache).
  size_t CachedRows(const std::string& job_id, const std::string& table) const;

 private:
  class TableCache;
  struct PendingPull;

  TableCache* Find(const std::string& job_id, const std::string& table) const;
  // Takes a job's cached rows out of the stats.
  void Forget(const absl::flat_hash_map<std::string, std::shared_ptr<TableCache>>& tables)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  PsClient* const inner_;
  const RowCacheOptions options_;
  RowCacheStats own_stats_;
  RowCacheStats* const stats_;
  mutable absl::Mutex mu_;
  // job id -> table -> cache; caches live until the job is deleted or the
  // client goes (pulls in flight hold no pointer past their completion).
  absl::flat_hash_map<std::string, absl::flat_hash_map<std::string, std::shared_ptr<TableCache>>> jobs_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace fulcrum

#endif  // FULCRUM_WORKER_ROW_CACHE_H_
