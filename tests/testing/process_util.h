// Helpers for tests that run Fulcrum's binaries as separate processes.
#ifndef FULCRUM_TESTS_TESTING_PROCESS_UTIL_H_
#define FULCRUM_TESTS_TESTING_PROCESS_UTIL_H_

#include <netinet/in.h>
#include <sys/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fulcrum::testing {

// 127.0.0.1:`port` as a socket address.
sockaddr_in LoopbackAddress(int port);
// A 127.0.0.1 port free at the time of the call.
int FreePort();
// Whether something accepts TCP connections on 127.0.0.1:`port` within
// `timeout_ms` (a process just spawned may take seconds to listen,
// longer under sanitizers).
bool WaitForListening(int port, int timeout_ms);

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
