#include "server/coordinator/placement.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace fulcrum::placement {

namespace {

int WorkersWithRoom(const FreeSlots& free) {
  return static_cast<int>(std::count_if(free.begin(), free.end(), [](const auto& kv) { return kv.second > 0; }));
}

}  // namespace

std::string TakeSlot(FreeSlots& free, const std::set<std::string>& avoid) {
  std::string best;
  int best_free = 0;
  for (const auto& [id, f] : free) {
    if (f > best_free && !avoid.count(id)) {
      best = id;
      best_free = f;
    }
  }
  if (best.empty()) {  // a worker already in the job, if it has room
    for (const auto& [id, f] : free) {
      if (f > best_free) {
        best = id;
        best_free = f;
      }
    }
  }
  if (!best.empty()) --free[best];
  return best;
}

std::vector<std::string> PlaceRanks(FreeSlots& free, uint32_t need) {
  if (WorkersWithRoom(free) < static_cast<int>(need)) return {};
  std::vector<std::string> nodes;
  std::set<std::string> used;
  for (uint32_t rank = 0; rank < need; ++rank) {
    nodes.push_back(TakeSlot(free, used));
    used.insert(nodes.back());
  }
  return nodes;
}

Verdict ConsiderPending(const PendingInput& in) {
  Verdict v;
  const int free_workers = in.free != nullptr ? WorkersWithRoom(*in.free) : 0;
  const uint32_t min_servers = std::max<uint32_t>(1, in.min_servers);
  if (in.live_servers < min_servers) {
    v.reason = "ServersNotReady";
    v.message = absl::StrCat("waiting for parameter servers: ", in.live_servers, " of ", min_servers, " live");
    return v;
  }
  if (!in.map_held) {
    v.reason = "ShardMapNotReady";
    if (in.running) {
      v.message = "the shard map changes when the running jobs end (a server joined or left)";
    } else {
      // Say which server does not take it, and why (its address is wrong,
      // a firewall, mismatched TLS), rather than wait without a word.
      v.message = "installing the shard map on the servers";
      if (!in.install_failure.empty()) absl::StrAppend(&v.message, "; ", in.install_failure);
    }
    return v;
  }
  if (in.blocked) {
    v.reason = "Queued";
    v.message = "an earlier job is waiting for workers";
    return v;
  }
  v.reason = "WorkersNotReady";
  if (free_workers >= static_cast<int>(in.need)) {
    v.start = true;
    v.reason.clear();
    return v;
  }
  if (in.user_workers) {
    v.message = absl::StrCat("needs ", in.need, " user processes registered for this job (fulcrum.Worker); ",
                             free_workers, " so far");
    return v;
  }
  v.message = absl::StrCat("needs ", in.need, " workers with a free slot; ", free_workers, " free of ",
                           in.live_workers, " live");
  if (in.unheard_workers > 0) {
    absl::StrAppend(&v.message, "; ", in.unheard_workers,
                    " known from before the coordinator restarted, not heard from since");
  }
  return v;
}

}  // namespace fulcrum::placement
