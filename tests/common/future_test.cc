#include "common/future.h"

#include <atomic>
#include <thread>

#include <catch2/catch.hpp>

#include "absl/time/clock.h"

namespace fulcrum {
namespace {

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
      absl::Seconds(10));
  Future<int> f = p.future();
  CHECK(f.Wait() == 42);
  CHECK(calls.load() == 5);
  CHECK(helped_on == std::this_thread::get_id());
}

TEST_CASE("Future::Wait stops helping after the helper's time and sleeps until the value comes", "[future]") {
  Promise<int> p;
  std::atomic<int> calls{0};
  p.SetHelper([&] { return ++calls, false; }, absl::Milliseconds(20));
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
  p.SetHelper([&] { return ++calls, false; }, absl::Seconds(10));
  p.Set(3);
  CHECK(p.future().Wait() == 3);
  CHECK(calls.load() == 0);
}

}  // namespace
}  // namespace fulcrum
