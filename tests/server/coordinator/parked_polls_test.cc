// ParkedPolls: a parked poll is answered exactly once (on a wake that finds
// news, at its deadline, or never once withdrawn), wakes reach only the polls
// they name, and a poll with nothing to say stays parked.
#include "server/coordinator/parked_polls.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include <catch2/catch.hpp>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace fulcrum {
namespace {

using Kind = ParkedPolls::Kind;

// The state the answers read: a counter under `mu`, and what was delivered.
struct State {
  absl::Mutex mu;
  int news ABSL_GUARDED_BY(mu) = 0;
  std::atomic<int> delivered{0};
};

// An answer that has something to say once state.news >= `wanted`.
ParkedPolls::Answer Once(State* s, int wanted, absl::Notification* done = nullptr) {
  return [s, wanted, done]() -> std::function<void()> {
    s->mu.AssertHeld();
    if (s->news < wanted) return nullptr;
    return [s, done] {
      ++s->delivered;
      if (done != nullptr) done->Notify();
    };
  };
}

TEST_CASE("a poll with nothing to say stays parked until a wake finds news", "[coordinator]") {
  State s;
  ParkedPolls polls(&s.mu);
  absl::Notification done;
  {
    absl::MutexLock lock(&s.mu);
    polls.Park(Kind::kWatch, "job-1", /*now=*/true, absl::InfiniteFuture(), Once(&s, 1, &done));
  }
  // Asked at once, it had nothing: still parked.
  CHECK_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(100)));
  CHECK(polls.counts().watches == 1);
  {
    absl::MutexLock lock(&s.mu);
    s.news = 1;
    polls.WakeJob("job-1");
  }
  REQUIRE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  polls.WaitIdle();
  CHECK(s.delivered == 1);
  CHECK(polls.counts().watches == 0);
}

TEST_CASE("wakes reach only the polls they name", "[coordinator]") {
  State s;
  ParkedPolls polls(&s.mu);
  absl::Notification beat, other_job, cut;
  uint64_t beat_ticket = 0, other_ticket = 0, cut_ticket = 0;
  {
    absl::MutexLock lock(&s.mu);
    s.news = 1;  // every answer has news from now on; only wakes ask for it
    beat_ticket = polls.Park(Kind::kHeartbeat, "", false, absl::InfiniteFuture(), Once(&s, 1, &beat));
    other_ticket = polls.Park(Kind::kWatch, "job-2", false, absl::InfiniteFuture(), Once(&s, 1, &other_job));
    cut_ticket = polls.Park(Kind::kCheckpoint, "job-1", false, absl::InfiniteFuture(), Once(&s, 1, &cut));
  }
  const ParkedPolls::Counts c = polls.counts();
  CHECK((c.heartbeats == 1 && c.watches == 1 && c.checkpoints == 1));
  {
    absl::MutexLock lock(&s.mu);
    polls.WakeHeartbeats();
  }
  REQUIRE(beat.WaitForNotificationWithTimeout(absl::Seconds(10)));
  {
    absl::MutexLock lock(&s.mu);
    polls.WakeJob("job-1");
  }
  // job-1's checkpoint poll answers; job-2's watch does not.
  REQUIRE(cut.WaitForNotificationWithTimeout(absl::Seconds(10)));
  CHECK(polls.counts().checkpoints == 0);
  CHECK_FALSE(other_job.HasBeenNotified());
  CHECK(polls.counts().watches == 1);
  // Withdrawn: its answer never runs; a poll already answered cannot be.
  CHECK(polls.Cancel(other_ticket));
  CHECK_FALSE(polls.Cancel(other_ticket));
  CHECK_FALSE(polls.Cancel(beat_ticket));
  CHECK_FALSE(polls.Cancel(cut_ticket));
  polls.WaitIdle();
  CHECK(s.delivered == 2);
  CHECK_FALSE(other_job.HasBeenNotified());
}

TEST_CASE("a poll is answered at its deadline without a wake", "[coordinator]") {
  State s;
  ParkedPolls polls(&s.mu);
  absl::Notification done;
  const absl::Time parked = absl::Now();
  {
    absl::MutexLock lock(&s.mu);
    // The answer itself decides: news, or its deadline passed.
    polls.Park(Kind::kHeartbeat, "", false, parked + absl::Milliseconds(200),
               [&s, &done, parked]() -> std::function<void()> {
                 s.mu.AssertHeld();
                 if (absl::Now() < parked + absl::Milliseconds(200)) return nullptr;
                 return [&s, &done] {
                   ++s.delivered;
                   done.Notify();
                 };
               });
  }
  REQUIRE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  CHECK(absl::Now() - parked >= absl::Milliseconds(200));
  polls.WaitIdle();
  CHECK(s.delivered == 1);
}

TEST_CASE("WakeAll answers every poll that has something to say and WaitIdle waits for their delivery",
          "[coordinator]") {
  State s;
  ParkedPolls polls(&s.mu);
  absl::Notification release;
  {
    absl::MutexLock lock(&s.mu);
    for (int i = 0; i < 5; ++i) {
      polls.Park(Kind::kWatch, "job-" + std::to_string(i), false, absl::InfiniteFuture(),
                 [&s, &release]() -> std::function<void()> {
                   return [&s, &release] {
                     release.WaitForNotification();  // a slow delivery
                     ++s.delivered;
                   };
                 });
    }
    polls.WakeAll();
  }
  absl::Notification idle;
  std::thread waiter([&] {
    polls.WaitIdle();
    idle.Notify();
  });
  CHECK_FALSE(idle.WaitForNotificationWithTimeout(absl::Milliseconds(100)));  // a delivery is still running
  release.Notify();
  REQUIRE(idle.WaitForNotificationWithTimeout(absl::Seconds(10)));
  waiter.join();
  CHECK(s.delivered == 5);
}

}  // namespace
}  // namespace fulcrum
