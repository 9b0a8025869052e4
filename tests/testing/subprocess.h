// Starting Fulcrum's binaries as child processes, without a test framework
// (the benchmarks use these too; tests/testing/process_util.h wraps them
// with Catch2 assertions).
#ifndef FULCRUM_TESTS_TESTING_SUBPROCESS_H_
#define FULCRUM_TESTS_TESTING_SUBPROCESS_H_

#include <netinet/in.h>
#include <sys/types.h>

#include <string>
#include <vector>

namespace fulcrum::testing {

// 127.0.0.1:`port` as a socket address.
sockaddr_in LoopbackAddress(int port);
// A 127.0.0.1 port free at the time of the call; 0 when none could be bound.
int FreeLoopbackPort();
// Whether something accepts TCP connections on `ip`:`port` (an IPv4
// address in dotted form) within `timeout_ms` (a process just spawned may
// take seconds to listen, longer under sanitizers). With `pid`, false as
// soon as that child exits (it is reaped then).
bool WaitForListening(int port, int timeout_ms, pid_t pid = -1, const std::string& ip = "127.0.0.1");
// Starts args[0] (a path) with args, stdout and stderr going to `log`.
// Returns its pid, or -1 with errno set.
pid_t StartProcess(std::vector<std::string> args, const std::string& log);

}  // namespace fulcrum::testing

#endif  // FULCRUM_TESTS_TESTING_SUBPROCESS_H_
