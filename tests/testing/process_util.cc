#include "tests/testing/process_util.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <mutex>
#include <random>
#include <sstream>
#include <utility>
#include <vector>

#include <catch2/catch.hpp>

namespace fulcrum::testing {

namespace {

int EphemeralLow() {
  std::ifstream in("/proc/sys/net/ipv4/ip_local_port_range");
  int low = 0;
  return in >> low && low > 11000 ? low : 32768;
}

bool Bindable(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  close(fd);
  return ok;
}

}  // namespace

int FreePortBlock(int n) {
  static std::mt19937 rng{std::random_device{}()};
  const int low = EphemeralLow();
  for (int tries = 0; tries < 500; ++tries) {
    const int base = std::uniform_int_distribution<int>(10000, low - n - 1)(rng);
    bool ok = true;
    for (int i = 0; i < n && ok; ++i) ok = Bindable(base + i);
    if (ok) return base;
  }
  FAIL("no block of " << n << " free ports below " << low);
  return 0;
}

int FreePort() { return FreePortBlock(1); }

Process Spawn(std::vector<std::string> args, const std::string& log) {
  Process p;
  p.log = log;
  p.pid = StartProcess(std::move(args), log);
  REQUIRE(p.pid > 0);
  return p;
}

namespace {

// The directories MakeTempDir made, removed when static objects are
// destroyed at exit (spawned processes are exec'd, never forked copies that
// could exit with this list).
class TempDirs {
 public:
  ~TempDirs() {
    for (const std::string& d : dirs_) {
      std::error_code ignored;
      std::filesystem::remove_all(d, ignored);
    }
  }
  void Add(std::string dir) {
    std::lock_guard<std::mutex> lock(mu_);
    dirs_.push_back(std::move(dir));
  }

 private:
  std::mutex mu_;
  std::vector<std::string> dirs_;
};

}  // namespace

std::string MakeTempDir(const std::string& prefix) {
  static TempDirs made;
  std::string tmpl = "/tmp/" + prefix + "-XXXXXX";
  const char* dir = mkdtemp(tmpl.data());
  REQUIRE(dir != nullptr);
  made.Add(dir);
  return dir;
}

std::string ReadFile(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

namespace {

// A number field ("VmRSS:", "Threads:") of /proc/PID/status, or -1.
int64_t StatusField(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field, 0) == 0) return std::atoll(line.c_str() + field.size());
  }
  return -1;
}

}  // namespace

int64_t RssKiB(pid_t pid) { return StatusField(pid, "VmRSS:"); }

int64_t ThreadCount(pid_t pid) { return StatusField(pid, "Threads:"); }

}  // namespace fulcrum::testing
