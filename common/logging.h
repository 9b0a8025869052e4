// Minimal leveled logging to stderr (Debian's Abseil predates absl/log).
// FLOG(INFO) << "listening on " << addr;
#ifndef FULCRUM_COMMON_LOGGING_H_
#define FULCRUM_COMMON_LOGGING_H_

#include <cstdint>
#include <sstream>
#include <string>

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
};

// Messages below this severity are dropped (tests raise it to kWarning).
void SetMinLogSeverity(LogSeverity severity);

// A size for people, in binary units: "812 B", "30.7 KiB", "9.5 MiB", "8.0 GiB".
std::string HumanBytes(uint64_t n);

}  // namespace fulcrum

#define FULCRUM_LOG_INFO ::fulcrum::LogSeverity::kInfo
#define FULCRUM_LOG_WARNING ::fulcrum::LogSeverity::kWarning
#define FULCRUM_LOG_ERROR ::fulcrum::LogSeverity::kError
#define FLOG(sev) ::fulcrum::LogMessage(FULCRUM_LOG_##sev, __FILE__, __LINE__).stream()

#endif  // FULCRUM_COMMON_LOGGING_H_
