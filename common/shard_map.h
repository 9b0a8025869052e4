// ShardMap: the versioned placement of virtual shards on servers.
//
// Sparse keys and dense chunks hash to one of a fixed number of virtual
// shards; the map assigns each virtual shard to a server. Clients route with
// it; servers check ownership with it. Immutable once built; thread-safe.
#ifndef FULCRUM_COMMON_SHARD_MAP_H_
#define FULCRUM_COMMON_SHARD_MAP_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "fulcrum/v1/common.pb.h"

namespace fulcrum {

class ShardMap {
 public:
  static constexpr uint32_t kMaxVirtualShards = 1u << 20;
  // Validates a map received from the network or configuration.
  static absl::StatusOr<ShardMap> FromProto(const v1::ShardMap& proto);
  // Round-robin assignment of `num_virtual_shards` over `servers`.
  static absl::StatusOr<ShardMap> RoundRobin(uint64_t version, uint32_t num_virtual_shards,
                                             std::vector<std::string> servers);
  // Parses "host:port,host:port" (round-robin, version 1).
  static absl::StatusOr<ShardMap> FromServerList(std::string_view servers,
                                                 uint32_t num_virtual_shards);

  v1::ShardMap ToProto() const;

  uint64_t version() const { return version_; }
  uint32_t num_virtual_shards() const { return static_cast<uint32_t>(owner_.size()); }
  const std::vector<std::string>& servers() const { return servers_; }
  size_t num_servers() const { return servers_.size(); }
  uint32_t owner(uint32_t vshard) const { return owner_[vshard]; }

  // Placement functions; stable across versions and processes.
  uint32_t VShardOfKey(std::string_view table, uint64_t key) const;
  uint32_t VShardOfChunk(std::string_view table, uint32_t chunk) const;
  uint32_t ServerOfKey(std::string_view table, uint64_t key) const {
    return owner_[VShardOfKey(table, key)];
  }
  uint32_t ServerOfChunk(std::string_view table, uint32_t chunk) const {
    return owner_[VShardOfChunk(table, chunk)];
  }
  // Virtual shards owned by `server` for logs, as runs: "0-3,8-11", or
  // "1-255 step 2" for the odd shards of a two-server round-robin map.
  std::string DescribeOwned(uint32_t server) const;

 private:
  uint64_t version_ = 0;
  std::vector<std::string> servers_;
  std::vector<uint32_t> owner_;
};

// 64-bit mixer (splitmix64 finalizer); the basis of placement and seeded
// initializers.
uint64_t Mix64(uint64_t x);
// Placement as pure functions of the table-name hash and the shard count.
uint32_t VShardOfKey(uint64_t table_hash, uint64_t key, uint32_t num_virtual_shards);
uint32_t VShardOfChunk(uint64_t table_hash, uint32_t chunk, uint32_t num_virtual_shards);
uint64_t HashTableName(std::string_view name);

// Elements per chunk of a dense table: the spec's chunk_elements, or the
// default of 65536 (256 KiB of fp32: a 1 MiB tensor spreads over 4 chunks and
// servers; the benchmark's sweep found it at least as fast as 1 MiB chunks).
inline constexpr uint32_t kDefaultChunkElements = 65536;
inline uint32_t ChunkElements(const v1::TableSpec& spec) {
  return spec.chunk_elements() == 0 ? kDefaultChunkElements : spec.chunk_elements();
}

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_SHARD_MAP_H_
