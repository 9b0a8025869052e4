// The coordinator's shard map part (server/coordinator/shard_map_state.h):
// versions follow the live servers, installations are tracked per server,
// one at a time, and a stale one records nothing.
#include <catch2/catch.hpp>

#include "server/coordinator/shard_map_state.h"

namespace fulcrum {
namespace {

using Servers = std::vector<std::string>;

TEST_CASE("shard map state: a new version only when the live servers change", "[coordinator]") {
  ShardMapState s(64);
  CHECK(s.version() == 0);
  CHECK_FALSE(s.map().has_value());
  CHECK_FALSE(s.Follow({}).has_value());
  auto m = s.Follow({"a:1", "b:1"});
  REQUIRE(m.has_value());
  CHECK(m->version() == 1);
  CHECK(m->num_virtual_shards() == 64);
  CHECK(s.servers() == Servers{"a:1", "b:1"});
  CHECK(s.Lists("b:1"));
  CHECK_FALSE(s.Lists("c:1"));
  CHECK_FALSE(s.Follow({"b:1", "a:1"}).has_value());  // the same servers in another order
  CHECK(s.ListsExactly({"b:1", "a:1"}));
  CHECK_FALSE(s.HeldBy({"a:1", "b:1"}));  // nobody has it yet
  auto next = s.Follow({"a:1", "b:1", "c:1"});
  REQUIRE(next.has_value());
  CHECK(next->version() == 2);
}

TEST_CASE("shard map state: installations are tracked per server and one runs at a time", "[coordinator]") {
  ShardMapState s(16);
  s.Follow({"a:1", "b:1"});
  v1::ShardMap map;
  CHECK(s.BeginInstall({"a:1", "b:1"}, &map) == Servers{"a:1", "b:1"});
  CHECK(map.version() == 1);
  v1::ShardMap other;
  CHECK(s.BeginInstall({"a:1", "b:1"}, &other).empty());  // one in flight
  CHECK(s.EndInstall(1, {"a:1", "b:1"}, {true, false}));
  CHECK_FALSE(s.HeldBy({"a:1", "b:1"}));
  CHECK(s.BeginInstall({"a:1", "b:1"}, &map) == Servers{"b:1"});  // only the one that failed
  CHECK(s.EndInstall(1, {"b:1"}, {true}));
  CHECK(s.HeldBy({"a:1", "b:1"}));
  CHECK(s.BeginInstall({"a:1", "b:1"}, &map).empty());  // nothing left to do
  // A restarted server holds nothing; a dead one is not installed on.
  s.Forget("a:1");
  CHECK_FALSE(s.HeldBy({"a:1", "b:1"}));
  CHECK(s.BeginInstall({"b:1"}, &map).empty());
  CHECK(s.BeginInstall({"a:1", "b:1"}, &map) == Servers{"a:1"});
}

TEST_CASE("shard map state: held by its servers ignores live servers it does not list, not dead ones it does",
          "[coordinator]") {
  ShardMapState s(16);
  s.Follow({"a:1", "b:1"});
  CHECK_FALSE(s.HeldByItsServers({"a:1", "b:1"}));  // nobody has it yet
  v1::ShardMap map;
  REQUIRE(s.BeginInstall({"a:1", "b:1"}, &map).size() == 2);
  REQUIRE(s.EndInstall(1, {"a:1", "b:1"}, {true, true}));
  // A server that joined (not listed until the map follows again).
  CHECK_FALSE(s.HeldBy({"a:1", "b:1", "c:1"}));
  CHECK(s.HeldByItsServers({"a:1", "b:1", "c:1"}));
  // One of its servers not live.
  CHECK_FALSE(s.HeldByItsServers({"a:1", "c:1"}));
  // One of its servers restarted: it holds nothing yet.
  s.Forget("b:1");
  CHECK_FALSE(s.HeldByItsServers({"a:1", "b:1"}));
}

TEST_CASE("shard map state: an installation of a replaced version records nothing", "[coordinator]") {
  ShardMapState s(16);
  s.Follow({"a:1"});
  v1::ShardMap map;
  REQUIRE(s.BeginInstall({"a:1"}, &map) == Servers{"a:1"});
  s.Follow({"a:1", "b:1"});  // version 2 while version 1 is being installed
  CHECK_FALSE(s.EndInstall(1, {"a:1"}, {true}));
  CHECK_FALSE(s.HeldBy({"a:1", "b:1"}));
  CHECK(s.BeginInstall({"a:1", "b:1"}, &map) == Servers{"a:1", "b:1"});  // the in-flight mark is gone
  CHECK(map.version() == 2);
}

TEST_CASE("shard map state: a restored map keeps its version and shards and is held by nobody", "[coordinator]") {
  ShardMapState s(16);
  ShardMapState before(256);
  before.Follow({"a:1", "b:1"});
  v1::ShardMap saved = *before.map();
  saved.set_version(7);
  s.Restore(saved);
  CHECK(s.version() == 7);
  CHECK_FALSE(s.HeldBy({"a:1", "b:1"}));
  CHECK_FALSE(s.Follow({"a:1", "b:1"}).has_value());
  auto next = s.Follow({"a:1"});
  REQUIRE(next.has_value());
  CHECK(next->version() == 8);
  CHECK(next->num_virtual_shards() == 256);  // the cluster's count, not this process's default
}

}  // namespace
}  // namespace fulcrum
