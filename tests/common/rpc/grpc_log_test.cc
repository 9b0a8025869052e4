// gRPC's own log lines go through Fulcrum's rate limit: per kind (gRPC's
// source location), a burst per window, then one line saying how many were
// dropped.
#include "common/rpc/grpc_log.h"

#include <grpc/grpc.h>
#include <grpc/support/log.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"

namespace fulcrum {
namespace {

// What the calls in `f` write to stderr.
template <typename F>
std::string CaptureStderr(F f) {
  char path[] = "/tmp/fulcrum-grpc-log-XXXXXX";
  const int fd = mkstemp(path);
  REQUIRE(fd >= 0);
  std::fflush(stderr);
  const int saved = dup(2);
  dup2(fd, 2);
  f();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(fd);
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  unlink(path);
  return text.str();
}

int Count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) n += absl::StrContains(line, needle) ? 1 : 0;
  return n;
}

TEST_CASE("gRPC's log lines are limited per kind, and the next one let through counts those dropped",
          "[logging][security]") {
  // gRPC prints nothing before it is initialized (a daemon's first channel
  // or port does it); the limit set before stays in force.
  LimitGrpcLogs(/*burst=*/5, absl::Milliseconds(300));
  grpc_init();
  const std::string text = CaptureStderr([] {
    // 2 000 handshake failures from one place, as a loop of bad clients
    // causes, and a line of another kind among them.
    for (int i = 0; i < 2000; ++i) gpr_log("handshaker.cc", 100, GPR_LOG_SEVERITY_ERROR, "Handshake failed %d", i);
    gpr_log("other.cc", 7, GPR_LOG_SEVERITY_ERROR, "another kind");
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    gpr_log("handshaker.cc", 100, GPR_LOG_SEVERITY_ERROR, "Handshake failed again");
  });
  INFO(text.substr(0, 2000));
  CHECK(Count(text, "grpc: Handshake failed") == 6);  // 5, then 1 in the next window
  CHECK(Count(text, "grpc: another kind") == 1);
  CHECK(Count(text, "Handshake failed again (1995 more lines of this kind dropped before this one)") == 1);
  LimitGrpcLogs();  // the defaults again
  grpc_shutdown();
}

}  // namespace
}  // namespace fulcrum
