#include "server/coordinator/shard_map_state.h"

#include <algorithm>
#include <set>

#include "common/shard_map.h"

namespace fulcrum {

std::optional<v1::ShardMap> ShardMapState::map() const {
  absl::MutexLock lock(&mu_);
  return map_;
}

uint64_t ShardMapState::version() const {
  absl::MutexLock lock(&mu_);
  return map_ ? map_->version() : 0;
}

std::vector<std::string> ShardMapState::servers() const {
  absl::MutexLock lock(&mu_);
  if (!map_) return {};
  return {map_->servers().begin(), map_->servers().end()};
}

bool ShardMapState::Lists(const std::string& address) const {
  absl::MutexLock lock(&mu_);
  return map_ && std::count(map_->servers().begin(), map_->servers().end(), address) > 0;
}

bool ShardMapState::ListsExactly(const std::vector<std::string>& servers) const {
  absl::MutexLock lock(&mu_);
  return ListsExactlyLocked(servers);
}

bool ShardMapState::ListsExactlyLocked(const std::vector<std::string>& servers) const {
  if (!map_) return false;
  return std::set<std::string>(map_->servers().begin(), map_->servers().end()) ==
         std::set<std::string>(servers.begin(), servers.end());
}

bool ShardMapState::HeldBy(const std::vector<std::string>& live) const {
  absl::MutexLock lock(&mu_);
  if (!ListsExactlyLocked(live)) return false;
  return std::all_of(live.begin(), live.end(), [&](const std::string& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = installed_.find(s);
    return it != installed_.end() && it->second == map_->version();
  });
}

bool ShardMapState::HeldByItsServers(const std::vector<std::string>& live) const {
  absl::MutexLock lock(&mu_);
  if (!map_ || map_->servers().empty()) return false;
  return std::all_of(map_->servers().begin(), map_->servers().end(),
                     [&](const std::string& s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                       auto it = installed_.find(s);
                       return std::count(live.begin(), live.end(), s) > 0 && it != installed_.end() &&
                              it->second == map_->version();
                     });
}

void ShardMapState::Restore(v1::ShardMap map) {
  absl::MutexLock lock(&mu_);
  map_ = std::move(map);
  installed_.clear();
}

std::optional<v1::ShardMap> ShardMapState::Follow(const std::vector<std::string>& live) {
  absl::MutexLock lock(&mu_);
  if (live.empty() || ListsExactlyLocked(live)) return std::nullopt;
  auto m = ShardMap::RoundRobin(map_ ? map_->version() + 1 : 1, map_ ? map_->num_virtual_shards() : virtual_shards_,
                                live);
  if (!m.ok()) return std::nullopt;
  map_ = m->ToProto();
  installed_.clear();
  return map_;
}

std::vector<std::string> ShardMapState::BeginInstall(const std::vector<std::string>& live, v1::ShardMap* map) {
  absl::MutexLock lock(&mu_);
  if (!map_ || install_in_flight_) return {};
  std::vector<std::string> to_install;
  for (const std::string& s : map_->servers()) {
    auto it = installed_.find(s);
    if ((it == installed_.end() || it->second != map_->version()) && std::count(live.begin(), live.end(), s)) {
      to_install.push_back(s);
    }
  }
  if (to_install.empty()) return {};
  install_in_flight_ = true;
  *map = *map_;
  return to_install;
}

bool ShardMapState::EndInstall(uint64_t version, const std::vector<std::string>& servers, const std::vector<bool>& took) {
  absl::MutexLock lock(&mu_);
  install_in_flight_ = false;
  // A map replaced meanwhile is no longer wanted: a server that refused it
  // for having the newer one (from its heartbeat) did right.
  if (!map_ || map_->version() != version) return false;
  for (size_t i = 0; i < servers.size() && i < took.size(); ++i) {
    if (took[i]) installed_[servers[i]] = version;
  }
  return true;
}

void ShardMapState::Forget(const std::string& address) {
  absl::MutexLock lock(&mu_);
  installed_.erase(address);
}

}  // namespace fulcrum
