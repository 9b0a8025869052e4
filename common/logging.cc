#include "common/logging.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace fulcrum {
namespace {
std::atomic<int> g_min_severity{0};
std::atomic<LogSink> g_sink{nullptr};
}  // namespace

void SetMinLogSeverity(LogSeverity severity) { g_min_severity = static_cast<int>(severity); }

void SetLogSink(LogSink sink) { g_sink.store(sink); }

LogMessage::LogMessage(LogSeverity severity, const char* file, int line) : severity_(severity) {
  const auto now = std::chrono::system_clock::now();
  const std::time_t secs = std::chrono::system_clock::to_time_t(now);
  const auto micros =
      std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000;
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  const char* base = std::strrchr(file, '/');
  static constexpr char kLetters[] = {'I', 'W', 'E'};
  char frac[16];
  std::snprintf(frac, sizeof(frac), ".%06ldZ", static_cast<long>(micros));
  stream_ << kLetters[static_cast<int>(severity)] << ' ' << buf << frac << ' ';
  prefix_ = static_cast<size_t>(stream_.tellp());
  stream_ << (base ? base + 1 : file) << ':' << line << "] ";
}

LogMessage::~LogMessage() {
  if (static_cast<int>(severity_) < g_min_severity.load(std::memory_order_relaxed)) return;
  if (LogSink sink = g_sink.load(); sink != nullptr) {
    sink(severity_, stream_.str().substr(prefix_));
    return;
  }
  stream_ << '\n';
  const std::string s = stream_.str();
  std::fwrite(s.data(), 1, s.size(), stderr);
}

std::string HumanBytes(uint64_t n) {
  if (n < 1024) return absl::StrCat(n, " B");
  if (n < (uint64_t{1} << 20)) return absl::StrFormat("%.1f KiB", n / 1024.0);
  if (n < (uint64_t{1} << 30)) return absl::StrFormat("%.1f MiB", n / 1048576.0);
  return absl::StrFormat("%.1f GiB", n / 1073741824.0);
}

bool LogLimiter::Allow(absl::Time now, uint64_t* dropped) {
  absl::MutexLock lock(&mu_);
  if (now - window_start_ >= window_) {
    window_start_ = now;
    in_window_ = 0;
  }
  if (in_window_ >= burst_) {
    ++dropped_;
    return false;
  }
  ++in_window_;
  *dropped = dropped_;
  dropped_ = 0;
  return true;
}

}  // namespace fulcrum
