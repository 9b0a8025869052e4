#include "server/coordinator/membership.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "server/coordinator/coordinator_internal.h"

namespace fulcrum {

using coordinator_internal::Serial;

uint64_t Membership::next_serial() const {
  absl::MutexLock lock(&mu_);
  return next_serial_;
}

void Membership::set_next_serial(uint64_t next) {
  absl::MutexLock lock(&mu_);
  next_serial_ = std::max(next_serial_, next);
}

void Membership::Restore(const v1::NodeInfo& info, absl::Time now) {
  absl::MutexLock lock(&mu_);
  Node& n = nodes_[info.node_id()];
  n.info = info;
  n.last_heard = now;
  n.alive = true;
  n.heard = false;
  next_serial_ = std::max(next_serial_, Serial(info.node_id()) + 1);
}

absl::StatusOr<Membership::Registered> Membership::Register(v1::NodeInfo info, absl::Time now) {
  absl::MutexLock lock(&mu_);
  Registered out;
  auto known = info.node_id().empty() ? nodes_.end() : nodes_.find(info.node_id());
  // A node registers again under its id only with the certificate it was
  // bound to; any other caller is a new node (it cannot become this one).
  out.fresh = known == nodes_.end() || known->second.info.role() != info.role() ||
              known->second.info.certificate() != info.certificate();
  if (out.fresh) {
    // A server restarted at an address already known replaces the old entry,
    // but only one with its certificate: another member cannot push a live
    // server out by registering at its address.
    if (info.role() == v1::SERVER) {
      for (const auto& [id, n] : nodes_) {
        // (An entry bound to no certificate comes from state saved before
        // bindings: its own server takes it over.)
        if (n.info.role() == v1::SERVER && n.info.address() == info.address() && n.alive &&
            !n.info.certificate().empty() && n.info.certificate() != info.certificate()) {
          return absl::PermissionDeniedError(absl::StrCat(
              "register: address ", info.address(), " belongs to live server ", id, " (certificate ",
              CertificateName(n.info.certificate()), "); the caller's certificate is ",
              CertificateName(info.certificate()), ": a server may take over only an address its own certificate "
              "registered, or one whose server was declared dead"));
        }
      }
      for (auto& [id, n] : nodes_) {
        if (n.info.role() == v1::SERVER && n.info.address() == info.address() && n.alive) {
          n.last_heard = now - options_.node_timeout;
          out.displaced.push_back(id);
        }
      }
    }
    info.set_node_id(absl::StrCat(info.role() == v1::SERVER ? "server-" : "worker-", next_serial_++));
  }
  if (info.slots() == 0) info.set_slots(1);
  Node& n = nodes_[info.node_id()];
  n.info = std::move(info);
  n.alive = true;
  n.heard = true;
  n.last_heard = now;
  out.node_id = n.info.node_id();
  return out;
}

std::string CertificateName(const std::string& certificate) {
  return certificate.empty() ? std::string("none (plaintext)") : certificate;
}

absl::Status Membership::CheckCaller(const std::string& node_id, const std::string& certificate,
                                     absl::string_view what) const {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return absl::OkStatus();  // unknown: the caller's own answer says so
  const std::string& bound = it->second.info.certificate();
  if (bound == certificate) return absl::OkStatus();
  if (bound.empty()) {
    // Known from state saved before nodes were bound to certificates.
    return absl::NotFoundError(absl::StrCat("node '", node_id, "' is bound to no certificate; register again"));
  }
  return absl::PermissionDeniedError(absl::StrCat(what, " as node '", node_id, "', which registered with certificate ",
                                                  bound, "; the caller's is ", CertificateName(certificate),
                                                  ": a member acts only as the node it registered"));
}

void Membership::Unregister(const std::string& node_id) {
  absl::MutexLock lock(&mu_);
  nodes_.erase(node_id);
}

Membership::Heard Membership::Hear(const std::string& node_id, absl::Time now) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return Heard::kUnknown;
  if (!it->second.alive) return Heard::kDead;
  it->second.last_heard = now;
  it->second.heard = true;
  return Heard::kOk;
}

void Membership::MarkLeaving(const std::string& node_id) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it != nodes_.end()) it->second.leaving = true;
}

std::optional<Membership::Node> Membership::Get(const std::string& node_id) const {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return std::nullopt;
  return it->second;
}

std::vector<std::pair<std::string, Membership::Node>> Membership::All() const {
  absl::MutexLock lock(&mu_);
  return {nodes_.begin(), nodes_.end()};
}

size_t Membership::size() const {
  absl::MutexLock lock(&mu_);
  return nodes_.size();
}

Membership::Pass Membership::CheckLiveness(absl::Time now) {
  absl::MutexLock lock(&mu_);
  Pass pass;
  // A scheduler that itself could not run for a while (the coordinator's
  // lock held by a write stuck on a slow disk, the process or machine
  // paused) cannot tell a node that stopped heartbeating from one whose
  // heartbeats waited behind it: every node then gets a fresh node_timeout
  // instead of being declared dead at once (a 15 s disk stall on a CI
  // machine once failed every job that way). Past half a node_timeout, and
  // past five ticks so that a node_timeout shorter than the tick, as in
  // tests, still declares nodes dead.
  const absl::Duration gap = now - last_pass_;
  last_pass_ = now;
  if (gap > std::max(options_.node_timeout / 2, 5 * options_.tick)) {
    pass.stall = gap;
    for (auto& [id, n] : nodes_) {
      if (n.alive && now - n.last_heard >= options_.node_timeout / 2) {
        n.last_heard = now;
        ++pass.spared;
      }
    }
  }
  pass.forgotten = std::erase_if(nodes_, [&](const auto& kv) {
    return !kv.second.alive && now - kv.second.dead_since > options_.dead_node_retention;
  });
  for (auto& [id, n] : nodes_) {
    if (!n.alive || (!n.leaving && now - n.last_heard < options_.node_timeout)) continue;
    n.alive = false;
    // A node that left is not listed as dead: it is forgotten at the next pass.
    n.dead_since = n.leaving ? now - options_.dead_node_retention - absl::Nanoseconds(1) : now;
    pass.died.emplace_back(id, n);
  }
  return pass;
}

std::vector<std::string> Membership::LiveServerAddresses() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<uint64_t, std::string>> v;
  for (const auto& [id, n] : nodes_) {
    if (n.alive && n.info.role() == v1::SERVER) v.emplace_back(Serial(id), n.info.address());
  }
  std::sort(v.begin(), v.end());
  std::vector<std::string> out;
  for (auto& [serial, address] : v) out.push_back(std::move(address));
  return out;
}

std::map<std::string, int> Membership::WorkerSlots(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  std::map<std::string, int> slots;
  for (const auto& [id, n] : nodes_) {
    if (n.alive && n.heard && n.info.role() == v1::WORKER && n.info.job_id() == job_id) {
      slots[id] = static_cast<int>(n.info.slots());
    }
  }
  return slots;
}

Membership::WorkerCount Membership::LiveWorkers() const {
  absl::MutexLock lock(&mu_);
  WorkerCount c;
  for (const auto& [id, n] : nodes_) {
    if (!n.alive || n.info.role() != v1::WORKER) continue;
    ++(n.heard ? c.heard : c.unheard);
  }
  return c;
}

}  // namespace fulcrum
