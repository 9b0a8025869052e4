#include "tests/testing/process_util.h"

#include <fstream>
#include <sstream>
#include <utility>

#include <catch2/catch.hpp>

namespace fulcrum::testing {

int FreePort() {
  const int port = FreeLoopbackPort();
  REQUIRE(port > 0);
  return port;
}

Process Spawn(std::vector<std::string> args, const std::string& log) {
  Process p;
  p.log = log;
  p.pid = StartProcess(std::move(args), log);
  REQUIRE(p.pid > 0);
  return p;
}

std::string MakeTempDir(const std::string& prefix) {
  std::string tmpl = "/tmp/" + prefix + "-XXXXXX";
  const char* dir = mkdtemp(tmpl.data());
  REQUIRE(dir != nullptr);
  return dir;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

int64_t RssKiB(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6);
  }
  return -1;
}

}  // namespace fulcrum::testing
