#include "common/future.h"

#include <atomic>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/time/clock.h"
#include "common/spare_core.h"

namespace fulcrum {
namespace {

// Helpers run only while the host has a core to spare: the tests of what a
// helper does give a probe that says it has (the last tests check SpareCore
// itself, and that a helper does not run when the probe says no).
bool Spare() { return true; }

TEST_CASE("Future::Wait lets the promise's helper complete the value on the waiting thread", "[future]") {
  Promise<int> p;
  std::atomic<int> calls{0};
  std::thread::id helped_on;
  // The helper "finds the answer" on its fifth call, as ShmConn::Poll finds
  // a response once the server wrote it.
  p.SetHelper(
      [&] {
        if (++calls < 5) return false;
        helped_on = std::this_thread::get_id();
        p.Set(42);
        return true;
      },
      absl::Seconds(10), &Spare);
  Future<int> f = p.future();
  CHECK(f.Wait() == 42);
  CHECK(calls.load() == 5);
  CHECK(helped_on == std::this_thread::get_id());
}

TEST_CASE("Future::Wait stops helping after the helper's time and sleeps until the value comes", "[future]") {
  Promise<int> p;
  std::atomic<int> calls{0};
  p.SetHelper([&] { return ++calls, false; }, absl::Milliseconds(20), &Spare);
  Future<int> f = p.future();
  const absl::Time start = absl::Now();
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(300));
    p.Set(7);
  });
  CHECK(f.Wait() == 7);
  setter.join();
  CHECK(absl::Now() - start >= absl::Milliseconds(300));
  // The helper ran, then stopped: it was not called for the whole 300 ms
  // (the last calls may land after the 20 ms mark, within one yield).
  const int after = calls.load();
  CHECK(after > 0);
  absl::SleepFor(absl::Milliseconds(50));
  CHECK(calls.load() == after);
}

TEST_CASE("Future::Wait without a helper, or once the value is set, never calls one", "[future]") {
  Promise<int> plain;
  plain.Set(1);
  CHECK(plain.future().Wait() == 1);

  Promise<int> p;
  std::atomic<int> calls{0};
  p.SetHelper([&] { return ++calls, false; }, absl::Seconds(10), &Spare);
  p.Set(3);
  CHECK(p.future().Wait() == 3);
  CHECK(calls.load() == 0);
}

TEST_CASE("Future::Wait never calls the helper while its probe says no core is spare", "[future]") {
  Promise<int> p;
  std::atomic<int> calls{0};
  p.SetHelper([&] { return ++calls, false; }, absl::Seconds(10), +[] { return false; });
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(50));
    p.Set(9);
  });
  CHECK(p.future().Wait() == 9);
  setter.join();
  CHECK(calls.load() == 0);
}

TEST_CASE("SpareCore reads the host's runnable threads and says no while they outnumber the cores", "[future]") {
  CHECK(RunnableFromLoadavg("0.52 0.58 0.59 3/345 12345\n") == 3u);
  CHECK(RunnableFromLoadavg("0.00 0.01 0.05 1/80 7") == 1u);
  CHECK_FALSE(RunnableFromLoadavg("0.52 0.58 0.59").has_value());
  CHECK_FALSE(RunnableFromLoadavg("0.52 0.58 0.59 x/345 1").has_value());
  CHECK_FALSE(RunnableFromLoadavg("").has_value());
  REQUIRE(UsableCores() >= 1);
  // Twice as many spinning threads as cores: all runnable, so no core is
  // spare, and a helper gives up at once.
  std::atomic<bool> stop{false};
  std::vector<std::thread> spinners;
  for (uint32_t i = 0; i < 2 * UsableCores() + 1; ++i) {
    spinners.emplace_back([&] {
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });
  }
  absl::SleepFor(absl::Milliseconds(50));
  int spare = 0;
  for (int i = 0; i < 20; ++i) spare += SpareCore() ? 1 : 0;
  Promise<int> p;
  std::atomic<int> calls{0};
  p.SetHelper([&] { return ++calls, false; }, absl::Seconds(10));
  std::thread setter([&] {
    absl::SleepFor(absl::Milliseconds(100));
    p.Set(5);
  });
  CHECK(p.future().Wait() == 5);
  setter.join();
  stop.store(true);
  for (std::thread& t : spinners) t.join();
  CHECK(spare == 0);
  CHECK(calls.load() == 0);
}

TEST_CASE("CheckPollFlag takes 0 to 1s and names the flag and the value otherwise", "[future]") {
  CHECK(CheckPollFlag(absl::ZeroDuration()).ok());
  CHECK(CheckPollFlag(absl::Microseconds(500)).ok());
  CHECK(CheckPollFlag(absl::Seconds(1)).ok());
  const absl::Status too_long = CheckPollFlag(absl::Seconds(2));
  CHECK(too_long.code() == absl::StatusCode::kInvalidArgument);
  CHECK(too_long.message() == "--shared_memory_poll must be between 0 and 1s, got 2s");
  CHECK(CheckPollFlag(absl::Milliseconds(-1)).message() == "--shared_memory_poll must be between 0 and 1s, got -1ms");
}

}  // namespace
}  // namespace fulcrum
