// The scheduler's decisions on their own: which worker takes a rank, and
// why a pending job waits.
#include "server/coordinator/placement.h"

#include <catch2/catch.hpp>

namespace fulcrum::placement {
namespace {

TEST_CASE("a rank goes to the worker with the most free slots, away from the job's others", "[placement]") {
  FreeSlots free{{"w1", 1}, {"w2", 3}, {"w3", 3}};
  CHECK(TakeSlot(free, {}) == "w2");  // most free; ties to the smallest id
  CHECK(free["w2"] == 2);
  CHECK(TakeSlot(free, {"w2"}) == "w3");
  CHECK(TakeSlot(free, {"w2", "w3"}) == "w1");
  // Every worker is in the job: one with room is shared.
  CHECK(TakeSlot(free, {"w1", "w2", "w3"}) == "w2");
  FreeSlots none{{"w1", 0}};
  CHECK(TakeSlot(none, {}).empty());
  CHECK(none["w1"] == 0);
}

TEST_CASE("a job's ranks are placed on distinct workers or not at all", "[placement]") {
  FreeSlots free{{"w1", 2}, {"w2", 1}, {"w3", 0}};
  CHECK(PlaceRanks(free, 3).empty());  // two workers have room
  CHECK(free == FreeSlots{{"w1", 2}, {"w2", 1}, {"w3", 0}});
  CHECK(PlaceRanks(free, 2) == std::vector<std::string>{"w1", "w2"});
  CHECK(free == FreeSlots{{"w1", 1}, {"w2", 0}, {"w3", 0}});
  CHECK(PlaceRanks(free, 1) == std::vector<std::string>{"w1"});
  CHECK(PlaceRanks(free, 0).empty());
}

TEST_CASE("a pending job says what it waits for, servers first", "[placement]") {
  const FreeSlots two{{"w1", 1}, {"w2", 2}};
  PendingInput in;
  in.need = 2;
  in.free = &two;
  in.live_servers = 1;
  in.min_servers = 2;
  in.live_workers = 2;
  Verdict v = ConsiderPending(in);
  CHECK_FALSE(v.start);
  CHECK(v.reason == "ServersNotReady");
  CHECK(v.message == "waiting for parameter servers: 1 of 2 live");

  in.live_servers = 2;
  in.install_failure = "h:1 fails: UNAVAILABLE: refused";
  v = ConsiderPending(in);
  CHECK(v.reason == "ShardMapNotReady");
  CHECK(v.message == "installing the shard map on the servers; h:1 fails: UNAVAILABLE: refused");
  in.running = true;
  CHECK(ConsiderPending(in).message == "the shard map changes when the running jobs end (a server joined or left)");

  in.map_held = true;
  in.blocked = true;
  v = ConsiderPending(in);
  CHECK(v.reason == "Queued");
  CHECK(v.message == "an earlier job is waiting for workers");

  in.blocked = false;
  v = ConsiderPending(in);
  CHECK(v.start);
  CHECK(v.message.empty());

  in.need = 3;
  in.unheard_workers = 1;
  v = ConsiderPending(in);
  CHECK_FALSE(v.start);
  CHECK(v.reason == "WorkersNotReady");
  CHECK(v.message ==
        "needs 3 workers with a free slot; 2 free of 2 live; 1 known from before the coordinator restarted, not heard "
        "from since");
  in.user_workers = true;
  CHECK(ConsiderPending(in).message == "needs 3 user processes registered for this job (fulcrum.Worker); 2 so far");
}

TEST_CASE("min_servers 0 still waits for one server", "[placement]") {
  const FreeSlots one{{"w1", 1}};
  PendingInput in;
  in.free = &one;
  in.min_servers = 0;
  CHECK(ConsiderPending(in).message == "waiting for parameter servers: 0 of 1 live");
  in.live_servers = 1;
  in.map_held = true;
  CHECK(ConsiderPending(in).start);
}

}  // namespace
}  // namespace fulcrum::placement
