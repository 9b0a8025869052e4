#include "common/shard_map.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"

namespace fulcrum {

uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t HashTableName(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a, then mixed
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return Mix64(h);
}

namespace {

absl::Status CheckBound(uint32_t num_virtual_shards) {
  if (num_virtual_shards <= ShardMap::kMaxVirtualShards) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("shard map num_virtual_shards ", num_virtual_shards,
                                                 " exceeds the limit of ", ShardMap::kMaxVirtualShards));
}

}  // namespace

absl::StatusOr<ShardMap> ShardMap::FromProto(const v1::ShardMap& proto) {
  if (proto.servers_size() == 0) return absl::InvalidArgumentError("shard map lists no servers");
  if (proto.num_virtual_shards() == 0) {
    return absl::InvalidArgumentError("shard map has num_virtual_shards = 0");
  }
  RETURN_IF_ERROR(CheckBound(proto.num_virtual_shards()));
  if (static_cast<uint32_t>(proto.owner_size()) != proto.num_virtual_shards()) {
    return absl::InvalidArgumentError(absl::StrCat("shard map has ", proto.owner_size(),
                                                   " owners for ", proto.num_virtual_shards(),
                                                   " virtual shards"));
  }
  ShardMap map;
  map.version_ = proto.version();
  map.servers_.assign(proto.servers().begin(), proto.servers().end());
  map.owner_.reserve(proto.owner_size());
  for (int v = 0; v < proto.owner_size(); ++v) {
    if (proto.owner(v) >= map.servers_.size()) {
      return absl::InvalidArgumentError(absl::StrCat("shard map: virtual shard ", v,
                                                     " is owned by server ", proto.owner(v),
                                                     " but only ", map.servers_.size(),
                                                     " servers are listed"));
    }
    map.owner_.push_back(proto.owner(v));
  }
  return map;
}

absl::StatusOr<ShardMap> ShardMap::RoundRobin(uint64_t version, uint32_t num_virtual_shards,
                                              std::vector<std::string> servers) {
  // Before the owners are listed (FromProto checks again): 4 billion of
  // them would be 16 GB.
  RETURN_IF_ERROR(CheckBound(num_virtual_shards));
  v1::ShardMap proto;
  proto.set_version(version);
  proto.set_num_virtual_shards(num_virtual_shards);
  for (auto& s : servers) proto.add_servers(std::move(s));
  for (uint32_t v = 0; v < num_virtual_shards && proto.servers_size() > 0; ++v) {
    proto.add_owner(v % proto.servers_size());
  }
  return FromProto(proto);
}

absl::StatusOr<ShardMap> ShardMap::FromServerList(std::string_view servers,
                                                  uint32_t num_virtual_shards) {
  std::vector<std::string> list;
  for (absl::string_view s : absl::StrSplit(absl::string_view(servers.data(), servers.size()), ',',
                                           absl::SkipWhitespace())) {
    list.emplace_back(absl::StripAsciiWhitespace(s));
  }
  return RoundRobin(1, num_virtual_shards, std::move(list));
}

v1::ShardMap ShardMap::ToProto() const {
  v1::ShardMap proto;
  proto.set_version(version_);
  proto.set_num_virtual_shards(num_virtual_shards());
  for (const auto& s : servers_) proto.add_servers(s);
  for (uint32_t o : owner_) proto.add_owner(o);
  return proto;
}

uint32_t VShardOfKey(uint64_t table_hash, uint64_t key, uint32_t num_virtual_shards) {
  return static_cast<uint32_t>(Mix64(table_hash ^ Mix64(key)) % num_virtual_shards);
}

uint32_t VShardOfChunk(uint64_t table_hash, uint32_t chunk, uint32_t num_virtual_shards) {
  // Consecutive chunks go to consecutive virtual shards, so a table's chunks
  // spread evenly over servers under round-robin placement.
  return static_cast<uint32_t>((table_hash + chunk) % num_virtual_shards);
}

uint32_t ShardMap::VShardOfKey(std::string_view table, uint64_t key) const {
  return fulcrum::VShardOfKey(HashTableName(table), key, num_virtual_shards());
}

uint32_t ShardMap::VShardOfChunk(std::string_view table, uint32_t chunk) const {
  return fulcrum::VShardOfChunk(HashTableName(table), chunk, num_virtual_shards());
}

std::string ShardMap::DescribeOwned(uint32_t server) const {
  std::vector<uint32_t> owned;
  for (uint32_t v = 0; v < num_virtual_shards(); ++v) {
    if (owner_[v] == server) owned.push_back(v);
  }
  // Runs of a constant stride: "4-9" (stride 1, two or more), "0-254 step 2"
  // (a round-robin map's share; three or more), else single shards.
  std::string out;
  for (size_t i = 0; i < owned.size();) {
    size_t j = i;
    const uint32_t stride = i + 1 < owned.size() ? owned[i + 1] - owned[i] : 1;
    while (j + 1 < owned.size() && owned[j + 1] - owned[j] == stride) ++j;
    if (stride > 1 && j - i < 2) j = i;  // two shards apart: list them
    absl::StrAppend(&out, out.empty() ? "" : ",", owned[i]);
    if (j > i) absl::StrAppend(&out, "-", owned[j], stride > 1 ? absl::StrCat(" step ", stride) : "");
    i = j + 1;
  }
  return out.empty() ? "none" : out;
}

}  // namespace fulcrum
