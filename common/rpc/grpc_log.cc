#include "common/rpc/grpc_log.h"

#include <grpc/support/log.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/errors.h"
#include "common/logging.h"

namespace fulcrum {
namespace {

// A limiter per kind of line. gRPC has a few hundred log statements; past
// kMaxKinds distinct ones (which no run reaches), the rest share one.
class GrpcLogLimits {
 public:
  static constexpr size_t kMaxKinds = 512;

  void Set(int burst, absl::Duration window) {
    absl::MutexLock lock(&mu_);
    burst_ = burst;
    window_ = window;
    kinds_.clear();
    other_ = std::make_unique<LogLimiter>(burst, window);
  }

  bool Allow(const char* file, int line, uint64_t* dropped) {
    LogLimiter* limiter;
    {
      absl::MutexLock lock(&mu_);
      auto key = std::make_pair(std::string(file != nullptr ? file : "?"), line);
      auto it = kinds_.find(key);
      if (it == kinds_.end()) {
        if (kinds_.size() >= kMaxKinds) {
          limiter = other_.get();
        } else {
          it = kinds_.emplace(std::move(key), std::make_unique<LogLimiter>(burst_, window_)).first;
          limiter = it->second.get();
        }
      } else {
        limiter = it->second.get();
      }
    }
    return limiter->Allow(absl::Now(), dropped);
  }

 private:
  absl::Mutex mu_;
  int burst_ ABSL_GUARDED_BY(mu_) = 10;
  absl::Duration window_ ABSL_GUARDED_BY(mu_) = absl::Minutes(1);
  std::map<std::pair<std::string, int>, std::unique_ptr<LogLimiter>> kinds_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<LogLimiter> other_ ABSL_GUARDED_BY(mu_) = std::make_unique<LogLimiter>(10, absl::Minutes(1));
};

GrpcLogLimits& Limits() {
  static GrpcLogLimits* limits = new GrpcLogLimits();
  return *limits;
}

void LimitedGrpcLog(gpr_log_func_args* args) {
  uint64_t dropped = 0;
  if (!Limits().Allow(args->file, args->line, &dropped)) return;
  const LogSeverity severity = args->severity == GPR_LOG_SEVERITY_ERROR ? LogSeverity::kError
                               : args->severity == GPR_LOG_SEVERITY_INFO ? LogSeverity::kInfo
                                                                         : LogSeverity::kInfo;
  LogMessage(severity, args->file, args->line).stream()
      << "grpc: " << SafeStatusMessage(args->message != nullptr ? args->message : "")
      << (dropped > 0 ? absl::StrCat(" (", dropped, " more lines of this kind dropped before this one)") : "");
}

}  // namespace

void LimitGrpcLogs(int burst, absl::Duration window) {
  Limits().Set(burst, window);
  gpr_set_log_function(&LimitedGrpcLog);
}

}  // namespace fulcrum
