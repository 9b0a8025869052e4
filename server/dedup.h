// Remembers recent (worker id, sequence number) pairs so a retried push is
// applied once (in the manner of TensorFlow's RecentRequestIds). Begin
// records a pair before its push is applied, so two concurrent retries of the
// same push cannot both apply; Abort forgets it when the push was refused.
// Thread-safe.
#ifndef FULCRUM_SERVER_DEDUP_H_
#define FULCRUM_SERVER_DEDUP_H_

#include <cstdint>
#include <deque>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"

namespace fulcrum {

class RecentRequestIds {
 public:
  // Remembers the last `window` sequence numbers of each worker.
  explicit RecentRequestIds(size_t window = 4096) : window_(window) {}
  // False when (worker, seq) was seen (applied or in flight).
  bool Begin(const std::string& worker, uint64_t seq);
  // Forgets an in-flight pair whose push was rejected, so a retry is judged anew.
  void Abort(const std::string& worker, uint64_t seq);

 private:
  struct PerWorker {
    absl::flat_hash_set<uint64_t> seen;
    std::deque<uint64_t> order;
  };
  const size_t window_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, PerWorker> workers_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_DEDUP_H_
