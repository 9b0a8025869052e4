// The coordinator's shard map (docs/architecture.md): the current version,
// rebuilt round-robin when the live servers change; which servers are known
// to hold it; and the one installation on servers that may run at a time.
// Its own lock: the coordinator calls it while holding its own, so the
// order is the coordinator's lock, then this one. No I/O: installing on
// servers is the caller's (BeginInstall, then EndInstall with the results).
#ifndef FULCRUM_SERVER_COORDINATOR_SHARD_MAP_STATE_H_
#define FULCRUM_SERVER_COORDINATOR_SHARD_MAP_STATE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "fulcrum/v1/cluster.pb.h"

namespace fulcrum {

class ShardMapState {
 public:
  // A first map spreads `virtual_shards` over its servers; later versions
  // keep the count.
  explicit ShardMapState(uint32_t virtual_shards) : virtual_shards_(virtual_shards) {}

  // The current map (a copy), none before the first live server.
  std::optional<v1::ShardMap> map() const;
  uint64_t version() const;  // 0: no map yet
  std::vector<std::string> servers() const;
  bool Lists(const std::string& address) const;
  // Whether the map lists exactly `servers`, in any order (a server
  // restarted at its address keeps its place and its checkpoints' shards).
  bool ListsExactly(const std::vector<std::string>& servers) const;
  // ListsExactly(live), and every one of them holds the current version.
  bool HeldBy(const std::vector<std::string>& live) const;
  // Whether every server of the map is live and holds it; live servers the
  // map does not list do not matter (a running job's cuts, which a server
  // joining meanwhile must not hold up).
  bool HeldByItsServers(const std::vector<std::string>& live) const;

  // The map saved before a restart; no server is known to hold it.
  void Restore(v1::ShardMap map);
  // When `live` (not empty) is not exactly the map's servers: a new
  // version round-robin over them, held by none yet, which is returned.
  std::optional<v1::ShardMap> Follow(const std::vector<std::string>& live);
  // The servers of `live` the map lists that lack its current version,
  // unless an installation is in flight; when there are any, one now is,
  // and *map is what to install.
  std::vector<std::string> BeginInstall(const std::vector<std::string>& live, v1::ShardMap* map);
  // BeginInstall's installation of `version` ended; servers[i] took it when
  // took[i]. False (and nothing recorded) when the map changed meanwhile.
  bool EndInstall(uint64_t version, const std::vector<std::string>& servers, const std::vector<bool>& took);
  // A new process at `address`: it holds no map.
  void Forget(const std::string& address);

 private:
  bool ListsExactlyLocked(const std::vector<std::string>& servers) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint32_t virtual_shards_;
  mutable absl::Mutex mu_;
  std::optional<v1::ShardMap> map_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> installed_ ABSL_GUARDED_BY(mu_);  // server -> version it holds
  bool install_in_flight_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_COORDINATOR_SHARD_MAP_STATE_H_
