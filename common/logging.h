// Minimal leveled logging to stderr (Debian's Abseil predates absl/log).
// FLOG(INFO) << "listening on " << addr;
#ifndef FULCRUM_COMMON_LOGGING_H_
#define FULCRUM_COMMON_LOGGING_H_

#include <cstdint>
#include <sstream>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace fulcrum {

enum class LogSeverity { kInfo, kWarning, kError };

class LogMessage {
 public:
  LogMessage(LogSeverity severity, const char* file, int line);
  ~LogMessage();
  std::ostream& stream() { return stream_; }

 private:
  LogSeverity severity_;
  std::ostringstream stream_;
  size_t prefix_ = 0;  // bytes of the time stamp before the file name
};

// Messages below this severity are dropped (tests raise it to kWarning).
void SetMinLogSeverity(LogSeverity severity);

// Where messages go instead of stderr: a library loaded into another
// program (the Python package's C++ client) hands them to that program's
// logging. `sink` gets the severity and the line without its prefix or
// newline ("file.cc:12] text"), from any thread, and must not log itself.
// nullptr: stderr again.
using LogSink = void (*)(LogSeverity severity, const std::string& line);
void SetLogSink(LogSink sink);

// Lets at most `burst` events through per `window`; counts the rest.
// Thread-safe. Allow() says whether this one may be logged, and in
// *dropped how many were held back since the last one let through.
class LogLimiter {
 public:
  LogLimiter(int burst, absl::Duration window) : burst_(burst), window_(window) {}
  bool Allow(absl::Time now, uint64_t* dropped);

 private:
  const int burst_;
  const absl::Duration window_;
  absl::Mutex mu_;
  absl::Time window_start_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int in_window_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t dropped_ ABSL_GUARDED_BY(mu_) = 0;
};

// A size for people, in binary units: "812 B", "30.7 KiB", "9.5 MiB", "8.0 GiB".
std::string HumanBytes(uint64_t n);

}  // namespace fulcrum

#define FULCRUM_LOG_INFO ::fulcrum::LogSeverity::kInfo
#define FULCRUM_LOG_WARNING ::fulcrum::LogSeverity::kWarning
#define FULCRUM_LOG_ERROR ::fulcrum::LogSeverity::kError
#define FLOG(sev) ::fulcrum::LogMessage(FULCRUM_LOG_##sev, __FILE__, __LINE__).stream()

#endif  // FULCRUM_COMMON_LOGGING_H_
