#include "tests/testing/subprocess.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>

extern char** environ;

namespace fulcrum::testing {

sockaddr_in LoopbackAddress(int port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(port));
  return a;
}

int FreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a = LoopbackAddress(0);
  socklen_t len = sizeof(a);
  const bool bound = bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                     getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  close(fd);
  return bound ? ntohs(a.sin_port) : 0;
}

bool WaitForListening(int port, int timeout_ms, pid_t pid, const std::string& ip) {
  sockaddr_in a = LoopbackAddress(port);
  if (inet_pton(AF_INET, ip.c_str(), &a.sin_addr) != 1) return false;
  for (int waited = 0;; waited += 50) {
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    const bool up = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
    close(fd);
    if (up) return true;
    if (waited >= timeout_ms) return false;
    if (pid > 0 && waitpid(pid, nullptr, WNOHANG) == pid) return false;
    usleep(50 * 1000);
  }
}

pid_t StartProcess(std::vector<std::string> args, const std::string& log) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) {
    errno = rc;
    return -1;
  }
  return pid;
}

}  // namespace fulcrum::testing
