#include "server/coordinator/parked_polls.h"

#include <utility>
#include <vector>

namespace fulcrum {

ParkedPolls::ParkedPolls(absl::Mutex* state_mu) : state_mu_(state_mu) {}

ParkedPolls::~ParkedPolls() { WaitIdle(); }

void ParkedPolls::WaitIdle() {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return polls_.empty() && answering_ == 0; };
  mu_.Await(absl::Condition(&idle));
}

uint64_t ParkedPolls::Park(Kind kind, const std::string& job_id, bool now, absl::Time deadline, Answer answer) {
  absl::MutexLock lock(&mu_);
  const uint64_t ticket = next_++;
  Poll& p = polls_[ticket];
  p.kind = kind;
  p.job_id = job_id;
  p.deadline = deadline;
  p.answer = std::move(answer);
  p.timer = waker_.Schedule(now ? absl::InfinitePast() : deadline, [this, ticket] { Run(ticket); });
  if (kind == Kind::kHeartbeat) {
    heartbeat_polls_.insert(ticket);
  } else {
    job_polls_[job_id].insert(ticket);
  }
  return ticket;
}

void ParkedPolls::WakeLocked(uint64_t ticket) {
  auto it = polls_.find(ticket);
  if (it == polls_.end()) return;
  // A failed Cancel means Run is already on its way.
  if (waker_.Cancel(it->second.timer)) {
    it->second.timer = waker_.Schedule(absl::InfinitePast(), [this, ticket] { Run(ticket); });
  }
}

void ParkedPolls::Wake(uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  WakeLocked(ticket);
}

void ParkedPolls::WakeJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  auto it = job_polls_.find(job_id);
  if (it == job_polls_.end()) return;
  for (uint64_t ticket : it->second) WakeLocked(ticket);
}

void ParkedPolls::WakeHeartbeats() {
  absl::MutexLock lock(&mu_);
  for (uint64_t ticket : heartbeat_polls_) WakeLocked(ticket);
}

void ParkedPolls::WakeAll() {
  absl::MutexLock lock(&mu_);
  for (const auto& [ticket, poll] : polls_) WakeLocked(ticket);
}

void ParkedPolls::ForgetLocked(std::map<uint64_t, Poll>::iterator it) {
  if (it->second.kind == Kind::kHeartbeat) {
    heartbeat_polls_.erase(it->first);
  } else if (auto j = job_polls_.find(it->second.job_id); j != job_polls_.end()) {
    j->second.erase(it->first);
    if (j->second.empty()) job_polls_.erase(j);
  }
  polls_.erase(it);
}

void ParkedPolls::Run(uint64_t ticket) {
  std::function<void()> deliver;
  {
    absl::MutexLock state(state_mu_);
    Answer answer;
    {
      absl::MutexLock lock(&mu_);
      auto it = polls_.find(ticket);
      if (it == polls_.end()) return;  // withdrawn
      answer = it->second.answer;
    }
    // The answer reads the state (held) but not the bookkeeping, so a
    // Cancel may come meanwhile: looked up again below.
    deliver = answer();
    absl::MutexLock lock(&mu_);
    auto it = polls_.find(ticket);
    if (it == polls_.end()) return;  // withdrawn while it was asked
    if (!deliver) {
      // Nothing to answer yet: parked again until the deadline or a wake.
      it->second.timer = waker_.Schedule(it->second.deadline, [this, ticket] { Run(ticket); });
      return;
    }
    ForgetLocked(it);
    ++answering_;
  }
  deliver();
  absl::MutexLock lock(&mu_);
  --answering_;
}

bool ParkedPolls::Cancel(uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  auto it = polls_.find(ticket);
  if (it == polls_.end()) return false;
  waker_.Cancel(it->second.timer);  // or Run finds nothing
  ForgetLocked(it);
  return true;
}

ParkedPolls::Counts ParkedPolls::counts() const {
  absl::MutexLock lock(&mu_);
  Counts c;
  c.heartbeats = heartbeat_polls_.size();
  for (const auto& [ticket, poll] : polls_) {
    c.watches += poll.kind == Kind::kWatch;
    c.checkpoints += poll.kind == Kind::kCheckpoint;
  }
  return c;
}

}  // namespace fulcrum
