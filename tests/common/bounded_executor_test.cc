// BoundedExecutor: tasks run on at most N threads with at most Q waiting;
// the next is refused with RESOURCE_EXHAUSTED; shutdown runs what was
// accepted.
#include "common/bounded_executor.h"

#include <atomic>
#include <set>
#include <thread>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace fulcrum {
namespace {

TEST_CASE("a bounded executor runs N at once, queues Q, refuses the next and names its limits", "[executor]") {
  absl::Notification release;
  std::atomic<int> done{0}, started{0};
  absl::Mutex mu;
  std::set<std::thread::id> threads;
  {
    BoundedExecutor exec("checkpoint calls", 2, 1);
    auto blocked = [&] {
      ++started;
      {
        absl::MutexLock lock(&mu);
        threads.insert(std::this_thread::get_id());
      }
      release.WaitForNotification();
      ++done;
    };
    REQUIRE(exec.Submit(blocked).ok());
    REQUIRE(exec.Submit(blocked).ok());
    // Both threads busy: one more waits, the one after is refused.
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (started.load() < 2 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
    REQUIRE(started.load() == 2);
    REQUIRE(exec.Submit(blocked).ok());
    CHECK(exec.queued() == 1);
    const absl::Status refused = exec.Submit(blocked);
    CHECK(refused.code() == absl::StatusCode::kResourceExhausted);
    CHECK(absl::StrContains(refused.message(), "checkpoint calls: 2 running on all 2 threads and 1 waiting"));
    CHECK(exec.running() == 2);
    release.Notify();
    // Once the threads are free again, new tasks are taken.
    while (done.load() < 3 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(1));
    REQUIRE(done.load() == 3);
    REQUIRE(exec.Submit(blocked).ok());
  }  // the destructor ran the last one before returning
  CHECK(done.load() == 4);
  CHECK(threads.size() == 2);  // never more threads than allowed
}

TEST_CASE("a bounded executor's destructor runs every task it accepted",
          "[executor]") {
  std::atomic<int> done{0};
  {
    BoundedExecutor exec("reads", 1, 100);
    for (int i = 0; i < 50; ++i) {
      REQUIRE(exec.Submit([&] {
                    absl::SleepFor(absl::Microseconds(100));
                    ++done;
                  }).ok());
    }
  }
  CHECK(done.load() == 50);
}

}  // namespace
}  // namespace fulcrum
