// CheckpointManager: the coordinator's checkpoint work (docs/checkpoints.md).
//
// It keeps, per job, what is not part of the job's record: the cut or
// restore in flight, when the last cut committed, the CheckpointJob calls
// waiting and their answer, and what earlier tries taught the cut schedule
// (a backoff after a failure, a longer lead after a cut that came too
// late). Its own lock is a leaf: the coordinator calls it while holding its
// own, so the order is the coordinator's lock, then this one. Nothing here
// is persisted: a cut in flight when the coordinator stops is never
// committed, and its parts are deleted once a later one commits.
//
// It also runs the calls to the servers that take, restore, delete and read
// cuts, every server at once, outside every lock. What a cut means for the
// job's record (its list of checkpoints, its state, the ranks) stays the
// coordinator's.
#ifndef FULCRUM_SERVER_COORDINATOR_CHECKPOINT_MANAGER_H_
#define FULCRUM_SERVER_COORDINATOR_CHECKPOINT_MANAGER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "fulcrum/v1/cluster.pb.h"
#include "fulcrum/v1/ps.pb.h"
#include "server/coordinator/cut_schedule.h"
#include "server/coordinator/server_control.h"

namespace fulcrum {

// A committed cut of the job (0: the latest), or nullptr.
const v1::CheckpointInfo* FindCut(const v1::JobStatus& st, uint64_t cut_id);
// NOT_FOUND naming the job's checkpoints, for a cut FindCut does not find.
absl::Status NoCutError(const std::string& job_id, const v1::JobStatus& st, uint64_t cut_id);
// "1, 2, 3", or "none".
std::string CutIds(const v1::JobStatus& st);

// Cuts to delete: (cut id, the servers holding its parts).
using CutList = std::vector<std::pair<uint64_t, std::vector<std::string>>>;

// A cut to take, set up under the coordinator's lock and run outside it.
struct CutTask {
  std::string job_id;
  uint64_t cut_id = 0;
  uint64_t at_step = 0;
  std::string trigger;               // final, manual, first, steps, seconds
  std::vector<std::string> servers;  // the map's, in order
  uint64_t map_version = 0;
  uint64_t manual_ticket = 0;  // the CheckpointJob calls it answers
  uint64_t steps_per_epoch = 0;
  v1::JobSpec spec;        // the job's (local steps: clocks count rounds)
  uint32_t rollbacks = 0;  // the job's count when the cut started
};

// A rollback to a cut (cut_id 0: the job's start) onto `targets`.
struct RestoreTask {
  std::string job_id;
  v1::CheckpointInfo cut;
  std::vector<std::string> targets;
  uint32_t min_incarnation = 0;
};

class CheckpointManager {
 public:
  // `checkpoint_wait`: how long a server may wait for a BSP cut's step.
  CheckpointManager(ServerControl* servers, const Clock* clock, absl::Duration checkpoint_wait);

  // ---- per-job bookkeeping
  struct Book {
    bool cut_in_flight = false;
    bool restore_in_flight = false;
    absl::Time last_cut = absl::InfinitePast();       // the last commit
    absl::Time restore_since = absl::InfinitePast();  // the rollback's start
    uint64_t manual_requested = 0;  // tickets of CheckpointJob calls
    uint64_t manual_served = 0;
    absl::StatusOr<v1::CheckpointInfo> manual_result = absl::UnknownError("no checkpoint yet");
    absl::Time backoff_until = absl::InfinitePast();  // after a failed cut
    // Steps added to a BSP cut's lead after its step was passed before the
    // servers were asked (progress reports lag); doubles on each miss.
    uint64_t extra_lead = 0;
    bool first_cut_failed = false;  // the early "first" cut failed: not retried
    // SSP/ASP: the highest every_steps boundary a cut was asked for. Their
    // cuts record the slowest rank's clock, which can stay below the
    // boundary the fastest rank crossed.
    uint64_t steps_boundary_asked = 0;
  };
  // A copy of the job's book (a fresh one for a job it has not seen).
  Book Of(const std::string& job_id) const;
  // A job read back at start: its last cut's time; a rollback in progress
  // counts from `now`.
  void Loaded(const std::string& job_id, absl::Time last_cut, absl::Time now);
  void Forget(const std::string& job_id);
  // Whether a cut of the job is in flight; Busy: a cut or a restore.
  bool CutInFlight(const std::string& job_id) const;
  bool Busy(const std::string& job_id) const;

  // The schedule's view of the job's earlier tries (cut_schedule::JobView).
  void FillView(const std::string& job_id, cut_schedule::JobView* view) const;
  void SetBoundaryAsked(const std::string& job_id, uint64_t boundary);
  void CutStarted(const std::string& job_id);
  enum class Outcome {
    kCommitted,  // every server wrote its part; the record holds it
    kTooLate,    // the step went by before a server was asked: asked again, further ahead
    kFailed,     // retried after a backoff (a failed "first" cut is not)
  };
  // The cut `t` ended. CheckpointJob tickets up to `answers` get `result`
  // (not after kTooLate: the request stays pending). Returns the lead a
  // cut that came too late asks with next.
  uint64_t CutEnded(const CutTask& t, Outcome outcome, const absl::StatusOr<v1::CheckpointInfo>& result,
                    uint64_t answers);
  // A CheckpointJob call: its ticket.
  uint64_t RequestManual(const std::string& job_id);
  // The answer to `ticket`, once a cut has given one.
  std::optional<absl::StatusOr<v1::CheckpointInfo>> ManualAnswer(const std::string& job_id, uint64_t ticket) const;
  void RollbackBegan(const std::string& job_id, absl::Time now);
  void SetRestoreInFlight(const std::string& job_id, bool in_flight);

  // ---- calls to the servers (outside every lock)
  // Every server's part of the cut, in the servers' order; or the first
  // failure, naming its server.
  absl::StatusOr<std::vector<v1::ShardCutMeta>> TakeCut(const CutTask& t);
  // Every target restores the cut (reading the sources' parts).
  absl::Status Restore(const RestoreTask& t);
  // The record of a cut every server wrote: its step (the lowest), each
  // rank's position (in the ranks' steps under local steps), sizes and the
  // longest pause.
  v1::CheckpointInfo Committed(const CutTask& t, const std::vector<v1::ShardCutMeta>& metas) const;
  // Appends `info` to the status's checkpoints and moves the oldest past
  // `keep` (0: 3) to *to_delete; returns the ids still recorded.
  static std::set<uint64_t> Record(const v1::CheckpointInfo& info, uint32_t keep, v1::JobStatus* st,
                                   CutList* to_delete);
  // Best effort: failures are logged.
  void DeleteCuts(const std::string& job_id, const CutList& cuts);
  // Parts of cuts below t.cut_id on t's servers that no record keeps (the
  // coordinator stopped mid-cut, or a server failed one).
  void DeleteStrayCuts(const CutTask& t, const std::set<uint64_t>& kept);
  // Hands `write` the cut's info and meta, then its records, server by
  // server, page by page; stops early when `write` returns false.
  absl::Status Export(const std::string& job_id, const v1::CheckpointInfo& info,
                      const std::function<bool(const v1::ExportCheckpointChunk&)>& write);

 private:
  ServerControl* const servers_;
  const Clock* const clock_;
  const absl::Duration checkpoint_wait_;
  mutable absl::Mutex mu_;
  std::map<std::string, Book> books_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_COORDINATOR_CHECKPOINT_MANAGER_H_
