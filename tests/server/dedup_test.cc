// RecentRequestIds (server/dedup.h): a retried push is taken once, a
// refused one may be retried, each worker has its own window, and of two
// concurrent deliveries of one push exactly one is taken.
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "server/dedup.h"

namespace fulcrum {
namespace {

TEST_CASE("a push's (worker, seq) is taken once until it falls out of the worker's window") {
  RecentRequestIds ids(3);
  CHECK(ids.Begin("w0", 1));
  CHECK(!ids.Begin("w0", 1));  // the retry
  CHECK(ids.Begin("w0", 2));
  CHECK(ids.Begin("w0", 3));
  CHECK(!ids.Begin("w0", 1));  // still remembered: 3 in the window
  CHECK(ids.Begin("w0", 4));   // pushes 1 out
  CHECK(ids.Begin("w0", 1));   // forgotten, so taken again
  CHECK(!ids.Begin("w0", 4));
}

TEST_CASE("each worker's sequence numbers are its own") {
  RecentRequestIds ids(2);
  CHECK(ids.Begin("w0", 7));
  CHECK(ids.Begin("w1", 7));
  CHECK(!ids.Begin("w1", 7));
  // w1's traffic does not push w0's entries out.
  CHECK(ids.Begin("w1", 8));
  CHECK(ids.Begin("w1", 9));
  CHECK(!ids.Begin("w0", 7));
}

TEST_CASE("an aborted push is judged anew on retry, and others stay remembered") {
  RecentRequestIds ids(4);
  CHECK(ids.Begin("w0", 1));
  CHECK(ids.Begin("w0", 2));
  ids.Abort("w0", 2);
  CHECK(ids.Begin("w0", 2));
  CHECK(!ids.Begin("w0", 2));
  CHECK(!ids.Begin("w0", 1));
  ids.Abort("nobody", 5);  // a worker never seen: nothing to forget
  CHECK(ids.Begin("nobody", 5));
}

TEST_CASE("of concurrent deliveries of one push exactly one is taken") {
  RecentRequestIds ids;
  for (uint64_t seq = 0; seq < 200; ++seq) {
    std::atomic<int> taken{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&] {
        if (ids.Begin("w", seq)) taken.fetch_add(1);
      });
    }
    for (auto& t : threads) t.join();
    REQUIRE(taken.load() == 1);
  }
}

}  // namespace
}  // namespace fulcrum
