// ParkedPolls: the coordinator's long calls (heartbeats, WatchJob streams,
// CheckpointJob calls) parked without a thread each, and answered from one
// wake-up thread as soon as there is something to answer, at their deadline,
// or when withdrawn.
//
// A parked poll holds an `answer`: called with the state lock held (the
// coordinator's, given at construction), it returns what delivers the answer
// (run outside every lock), or nothing when there is nothing to answer yet:
// the poll then stays parked until its deadline or its next wake. Whoever
// removes a poll (the wake-up thread to answer it, Cancel to withdraw it)
// decides whether its answer runs: exactly once, or never.
//
// The bookkeeping has a lock of its own, taken inside the state lock and
// never around it, so Cancel and Counts need only it.
#ifndef FULCRUM_SERVER_COORDINATOR_PARKED_POLLS_H_
#define FULCRUM_SERVER_COORDINATOR_PARKED_POLLS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/deadline_timer.h"

namespace fulcrum {

class ParkedPolls {
 public:
  enum class Kind {
    kHeartbeat,   // woken together by WakeHeartbeats
    kWatch,       // woken by their job's WakeJob
    kCheckpoint,  // likewise
  };
  using Answer = std::function<std::function<void()>()>;

  // `state_mu`: the lock answers read their state under; it outlives this.
  explicit ParkedPolls(absl::Mutex* state_mu);
  // Waits until every poll was answered or withdrawn (WaitIdle); wake them
  // all first.
  ~ParkedPolls();
  ParkedPolls(const ParkedPolls&) = delete;
  ParkedPolls& operator=(const ParkedPolls&) = delete;

  // Park and the Wakes are called with the state lock held, as the answers
  // run under it: a wake then never slips in between an answer that found
  // nothing and its parking again.
  //
  // Parks a poll answered by `deadline` at the latest; with `now` its answer
  // is asked for right away (it stays parked if it has none yet). Returns
  // its ticket. `job_id`: the job a watch or checkpoint poll follows.
  uint64_t Park(Kind kind, const std::string& job_id, bool now, absl::Time deadline, Answer answer);
  // Asks a poll for its answer now (nothing when it is gone).
  void Wake(uint64_t ticket);
  void WakeJob(const std::string& job_id);
  void WakeHeartbeats();
  void WakeAll();
  // Withdraws a poll: true when its answer will not run, false when it ran
  // or is about to.
  bool Cancel(uint64_t ticket);

  struct Counts {
    size_t heartbeats = 0, watches = 0, checkpoints = 0;
  };
  Counts counts() const;
  // Blocks until no poll is parked and no answer is being delivered. Call
  // without the state lock (answers need it).
  void WaitIdle();

 private:
  struct Poll {
    Kind kind = Kind::kHeartbeat;
    std::string job_id;
    absl::Time deadline;
    uint64_t timer = 0;
    Answer answer;
  };
  void WakeLocked(uint64_t ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ForgetLocked(std::map<uint64_t, Poll>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // On the wake-up thread: the poll's answer, delivered, or parked again.
  void Run(uint64_t ticket);

  absl::Mutex* const state_mu_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Poll> polls_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::set<uint64_t>> job_polls_ ABSL_GUARDED_BY(mu_);
  std::set<uint64_t> heartbeat_polls_ ABSL_GUARDED_BY(mu_);
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 1;
  int answering_ ABSL_GUARDED_BY(mu_) = 0;  // answers taken by Run, not yet delivered
  // Last: its thread stops first, while everything its callbacks use is alive.
  DeadlineTimer waker_;
};

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_COORDINATOR_PARKED_POLLS_H_
