#include "server/dedup.h"

namespace fulcrum {

bool RecentRequestIds::Begin(const std::string& worker, uint64_t seq) {
  absl::MutexLock lock(&mu_);
  PerWorker& w = workers_[worker];
  if (!w.seen.insert(seq).second) return false;
  w.order.push_back(seq);
  while (w.order.size() > window_) {
    w.seen.erase(w.order.front());
    w.order.pop_front();
  }
  return true;
}

void RecentRequestIds::Abort(const std::string& worker, uint64_t seq) {
  absl::MutexLock lock(&mu_);
  auto it = workers_.find(worker);
  if (it == workers_.end()) return;
  it->second.seen.erase(seq);
  // The stale entry left in `order` is harmless: erasing it later from `seen`
  // is a no-op unless the seq was reused, which Begin would have refused.
}

}  // namespace fulcrum
