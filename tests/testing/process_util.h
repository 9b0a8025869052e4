// Helpers for tests that run Fulcrum's binaries as separate processes.
#ifndef FULCRUM_TESTS_TESTING_PROCESS_UTIL_H_
#define FULCRUM_TESTS_TESTING_PROCESS_UTIL_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tests/testing/subprocess.h"

namespace fulcrum::testing {

// FreeLoopbackPort, failing the test when no port could be bound.
int FreePort();

struct Process {
  pid_t pid = -1;
  std::string log;  // stdout and stderr
};
// Starts args[0] (a path) with args, its output going to `log`.
Process Spawn(std::vector<std::string> args, const std::string& log);

// A fresh directory under /tmp named after `prefix`.
std::string MakeTempDir(const std::string& prefix);
std::string ReadFile(const std::string& path);
// Resident memory of process `pid` in KiB (VmRSS), or -1.
int64_t RssKiB(pid_t pid);

}  // namespace fulcrum::testing

#endif  // FULCRUM_TESTS_TESTING_PROCESS_UTIL_H_
