// Helpers for tests that run Fulcrum's binaries as separate processes.
#ifndef FULCRUM_TESTS_TESTING_PROCESS_UTIL_H_
#define FULCRUM_TESTS_TESTING_PROCESS_UTIL_H_

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

#include "tests/testing/subprocess.h"

namespace fulcrum::testing {

// A base port such that base .. base+n-1 are all free now, taken below the
// kernel's ephemeral range (net.ipv4.ip_local_port_range): ports in that
// range are the source ports of outgoing connections, and one picked there
// may be taken by another test's connection before a server binds it. Fails
// the test when no such block is found. tests/testing/free_ports.py is the
// same for scripts.
int FreePortBlock(int n);
// FreePortBlock(1).
int FreePort();

struct Process {
  pid_t pid = -1;
  std::string log;  // stdout and stderr
};
// Starts args[0] (a path) with args, its output going to `log`.
Process Spawn(std::vector<std::string> args, const std::string& log);

// A fresh directory under /tmp named after `prefix`, removed with all it
// holds when the test process exits normally (a crashed run leaves it for
// a look).
std::string MakeTempDir(const std::string& prefix);
std::string ReadFile(const std::string& path);
// Resident memory of process `pid` in KiB (VmRSS), or -1.
int64_t RssKiB(pid_t pid);
// Threads of process `pid` (/proc/PID/status), or -1.
int64_t ThreadCount(pid_t pid);

}  // namespace fulcrum::testing

#endif  // FULCRUM_TESTS_TESTING_PROCESS_UTIL_H_
