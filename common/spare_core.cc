#include "common/spare_core.h"

#include <fcntl.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace fulcrum {

std::optional<uint32_t> RunnableFromLoadavg(absl::string_view line) {
  // Fields: three load averages, "running/total", the last pid.
  std::vector<absl::string_view> fields = absl::StrSplit(line, ' ', absl::SkipEmpty());
  if (fields.size() < 4) return std::nullopt;
  const size_t slash = fields[3].find('/');
  if (slash == absl::string_view::npos) return std::nullopt;
  uint32_t running = 0;
  if (!absl::SimpleAtoi(fields[3].substr(0, slash), &running)) return std::nullopt;
  return running;
}

uint32_t UsableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return static_cast<uint32_t>(n);
  }
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<uint32_t>(n) : 1;
}

absl::Status CheckPollFlag(absl::Duration poll) {
  if (poll >= absl::ZeroDuration() && poll <= absl::Seconds(1)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--shared_memory_poll must be between 0 and 1s, got ", absl::FormatDuration(poll)));
}

bool SpareCore() {
  // Opened once and kept: /proc files regenerate on a read from offset 0.
  static const int fd = open("/proc/loadavg", O_RDONLY | O_CLOEXEC);
  static const uint32_t cores = UsableCores();
  if (fd < 0) return false;
  char buf[128];
  const ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
  if (n <= 0) return false;
  const std::optional<uint32_t> running = RunnableFromLoadavg(absl::string_view(buf, static_cast<size_t>(n)));
  return running.has_value() && *running <= cores;
}

}  // namespace fulcrum
