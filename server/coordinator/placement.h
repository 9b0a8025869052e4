// The scheduler's decisions, as pure functions of what it sees (no lock,
// no clock, no I/O): which worker takes a rank, and why a pending job cannot
// start yet. The coordinator's Tick (coordinator_scheduler.cc) gathers the
// inputs from its parts and applies the answers.
#ifndef FULCRUM_SERVER_COORDINATOR_PLACEMENT_H_
#define FULCRUM_SERVER_COORDINATOR_PLACEMENT_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace fulcrum::placement {

// Free assignment slots per live worker, by node id.
using FreeSlots = std::map<std::string, int>;

// The worker with the most free slots, preferring those not in `avoid`
// (ranks of one job spread over workers), else one in `avoid` with room;
// ties go to the smallest id. Takes the slot from `free`; "" when no worker
// has one.
std::string TakeSlot(FreeSlots& free, const std::set<std::string>& avoid);

// A new job's ranks 0..need-1, one slot each, spread as TakeSlot spreads
// them; empty (and `free` untouched) when fewer than `need` workers have a
// free slot.
std::vector<std::string> PlaceRanks(FreeSlots& free, uint32_t need);

// What the scheduler knows when it considers a pending job.
struct PendingInput {
  uint32_t need = 1;            // the job's num_workers
  bool user_workers = false;    // its ranks are user processes of its own
  const FreeSlots* free = nullptr;  // the job's pool
  size_t live_servers = 0;
  uint32_t min_servers = 1;
  bool map_held = false;        // every live server holds the current shard map
  bool running = false;         // a job runs (the map may not change now)
  std::string install_failure;  // "ADDRESS fails: ERROR" of a server not taking the map, if any
  bool blocked = false;         // an earlier daemons' job is waiting for workers
  int live_workers = 0;         // heard from since the coordinator started
  int unheard_workers = 0;      // known from before a restart only
};
struct Verdict {
  bool start = false;
  std::string reason;   // the job's status reason while it waits (CamelCase)
  std::string message;  // what it waits for, in words
};
// Whether the job starts now, and if not, why (checked in this order):
// ServersNotReady, ShardMapNotReady, Queued (first come, first served),
// WorkersNotReady.
Verdict ConsiderPending(const PendingInput& in);

}  // namespace fulcrum::placement

#endif  // FULCRUM_SERVER_COORDINATOR_PLACEMENT_H_
