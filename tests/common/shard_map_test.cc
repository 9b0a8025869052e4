#include <set>

#include <catch2/catch.hpp>

#include "common/shard_map.h"

namespace fulcrum {
namespace {

TEST_CASE("round-robin map spreads virtual shards and describes ranges", "[shard_map]") {
  auto m = ShardMap::FromServerList("a:1, b:2", 8);
  REQUIRE(m.ok());
  REQUIRE(m->version() == 1);
  REQUIRE(m->num_servers() == 2);
  REQUIRE(m->owner(0) == 0);
  REQUIRE(m->owner(1) == 1);
  REQUIRE(m->DescribeOwned(0) == "0-6 step 2");
  REQUIRE(m->DescribeOwned(1) == "1-7 step 2");
  REQUIRE(m->DescribeOwned(2) == "none");
  auto one = ShardMap::FromServerList("a:1", 4);
  REQUIRE(one->DescribeOwned(0) == "0-3");
  // After servers left: contiguous runs, strided runs and lone shards.
  v1::ShardMap p;
  p.set_version(2);
  p.set_num_virtual_shards(16);
  p.add_servers("a:1");
  p.add_servers("b:1");
  for (uint32_t owner : {0, 0, 0, 1, 0, 1, 0, 1, 0, 1, 1, 0, 1, 1, 0, 1}) p.add_owner(owner);
  auto mixed = ShardMap::FromProto(p);
  REQUIRE(mixed.ok());
  REQUIRE(mixed->DescribeOwned(0) == "0-2,4-8 step 2,11,14");
  REQUIRE(mixed->DescribeOwned(1) == "3-9 step 2,10,12-13,15");
}

TEST_CASE("shard map validation names what is wrong", "[shard_map]") {
  v1::ShardMap p;
  p.set_version(3);
  p.set_num_virtual_shards(4);
  p.add_servers("a:1");
  p.add_owner(0);
  auto m = ShardMap::FromProto(p);
  REQUIRE_FALSE(m.ok());
  REQUIRE(std::string(m.status().message()).find("1 owners for 4") != std::string::npos);
  p.add_owner(0);
  p.add_owner(0);
  p.add_owner(5);
  m = ShardMap::FromProto(p);
  REQUIRE_FALSE(m.ok());
  REQUIRE(std::string(m.status().message()).find("owned by server 5") != std::string::npos);
  REQUIRE_FALSE(ShardMap::FromServerList("", 4).ok());
}

TEST_CASE("placement is stable and spreads keys and chunks", "[shard_map]") {
  auto m = ShardMap::FromServerList("a:1,b:2,c:3", 64);
  std::set<uint32_t> servers;
  for (uint64_t k = 0; k < 1000; ++k) {
    const uint32_t s = m->ServerOfKey("emb", k);
    REQUIRE(s == m->ServerOfKey("emb", k));
    servers.insert(s);
  }
  REQUIRE(servers.size() == 3);
  // Consecutive chunks land on consecutive virtual shards.
  REQUIRE((m->VShardOfChunk("w", 1) + 64 - m->VShardOfChunk("w", 0)) % 64 == 1);
}

}  // namespace
}  // namespace fulcrum
