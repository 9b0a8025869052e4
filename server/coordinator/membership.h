// The coordinator's membership (docs/architecture.md): the nodes it knows,
// servers and workers, when each was last heard from, and which are alive.
// It decides liveness (a node silent for node_timeout is dead, a scheduler
// that could not run for a while spares them, the dead are forgotten after
// dead_node_retention); what follows from a death (ranks moving, jobs
// rolling back) is the coordinator's. Times are given by the caller (its
// Clock), so tests move them by hand. Its own lock: the coordinator calls
// it while holding its own, so the order is the coordinator's lock, then
// this one. No I/O: saving a node is the caller's.
#ifndef FULCRUM_SERVER_COORDINATOR_MEMBERSHIP_H_
#define FULCRUM_SERVER_COORDINATOR_MEMBERSHIP_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "fulcrum/v1/cluster.pb.h"

namespace fulcrum {

// A certificate identity for messages: the SPIFFE ID, or "none (plaintext)".
std::string CertificateName(const std::string& certificate);

class Membership {
 public:
  struct Options {
    absl::Duration node_timeout = absl::Seconds(5);
    absl::Duration dead_node_retention = absl::Minutes(10);
    // The scheduler's period: a gap in its runs past max(node_timeout / 2,
    // 5 ticks) is a stall.
    absl::Duration tick = absl::Milliseconds(100);
  };
  struct Node {
    v1::NodeInfo info;
    absl::Time last_heard;
    absl::Time dead_since;  // when declared dead
    bool alive = true;
    // False for a node known only from the state a restarted coordinator
    // loaded, until it registers, heartbeats or reports: it keeps the ranks
    // it had for its grace period, but gets no new ones (it may be gone).
    bool heard = true;
    // It said it is going (HeartbeatRequest.leaving): gone at the next pass.
    bool leaving = false;
  };

  Membership(Options options, absl::Time now) : options_(options), last_pass_(now) {}

  // ---- ids: "server-N" / "worker-N", N never given twice
  uint64_t next_serial() const;
  void set_next_serial(uint64_t next);

  // A node from the state a restarted coordinator loaded: alive, not heard
  // yet, with a fresh node_timeout from `now` to heartbeat again.
  void Restore(const v1::NodeInfo& info, absl::Time now);
  struct Registered {
    std::string node_id;
    bool fresh = false;  // a new id (not a node re-registering after our restart)
    // Live servers at the same address (an older process there): overdue,
    // declared dead at the next liveness pass.
    std::vector<std::string> displaced;
  };
  // Registers `info` as alive and heard at `now`: under its node_id when
  // known with the same role and certificate (info.certificate, the
  // caller's, set by the coordinator), else under a new id. slots 0 becomes
  // 1. PERMISSION_DENIED for a server at the address of a live server that
  // registered with another certificate.
  absl::StatusOr<Registered> Register(v1::NodeInfo info, absl::Time now);
  // OK when `node_id` is unknown or registered with `certificate` (the
  // caller's); PERMISSION_DENIED naming both when it registered with
  // another, NOT_FOUND (register again) when it has none on record. `what`
  // names the call.
  absl::Status CheckCaller(const std::string& node_id, const std::string& certificate, absl::string_view what) const;
  // Undoes a fresh registration (one that could not be saved). Its id is
  // not given again.
  void Unregister(const std::string& node_id);

  enum class Heard { kOk, kUnknown, kDead };
  // The node spoke to us (heartbeat, report) at `now`. Only an alive node
  // is marked; a dead one must register again.
  Heard Hear(const std::string& node_id, absl::Time now);
  // It said it is going: declared gone at the next pass.
  void MarkLeaving(const std::string& node_id);

  std::optional<Node> Get(const std::string& node_id) const;
  // Every node known, alive or dead, by id.
  std::vector<std::pair<std::string, Node>> All() const;
  size_t size() const;

  // ---- the scheduler's liveness pass at `now`
  struct Pass {
    absl::Duration stall = absl::ZeroDuration();  // > 0: the passes stopped this long; nodes were spared
    size_t spared = 0;                            // nodes given a fresh node_timeout after the stall
    size_t forgotten = 0;                         // dead nodes dropped after their retention
    // Declared dead in this pass (alive false), in id order: silent for
    // node_timeout (last_heard says since when), or leaving.
    std::vector<std::pair<std::string, Node>> died;
  };
  Pass CheckLiveness(absl::Time now);

  // ---- what the scheduler reads
  // The live servers' addresses, oldest registration first.
  std::vector<std::string> LiveServerAddresses() const;
  // Slots of the live, heard workers of a pool: the daemons (job_id ""), or
  // the user processes registered for job `job_id`.
  std::map<std::string, int> WorkerSlots(const std::string& job_id) const;
  struct WorkerCount {
    int heard = 0;
    int unheard = 0;  // known from before a restart, not heard from since
  };
  WorkerCount LiveWorkers() const;

 private:
  const Options options_;
  mutable absl::Mutex mu_;
  std::map<std::string, Node> nodes_ ABSL_GUARDED_BY(mu_);
  uint64_t next_serial_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Time last_pass_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_COORDINATOR_MEMBERSHIP_H_
