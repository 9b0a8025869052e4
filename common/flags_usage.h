// --help for Fulcrum's binaries. Abseil's --help lists only the flags of a
// source file named after the program (fulcrumctl.cc for fulcrumctl); the
// daemons define theirs in main.cc and in common/ (TLS, metrics), so their
// --help said "No flags matched". This lists every flag that is not
// Abseil's own (those stay under --helpfull).
#ifndef FULCRUM_COMMON_FLAGS_USAGE_H_
#define FULCRUM_COMMON_FLAGS_USAGE_H_

#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace fulcrum {

inline bool IsFulcrumFlagFile(absl::string_view file) { return !absl::StrContains(file, "absl/"); }

// Call first in main(), before absl::ParseCommandLine.
inline void SetUsage(absl::string_view usage) {
  absl::SetProgramUsageMessage(usage);
  absl::FlagsUsageConfig config;
  config.contains_helpshort_flags = IsFulcrumFlagFile;
  config.contains_help_flags = IsFulcrumFlagFile;
  absl::SetFlagsUsageConfig(config);
}

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_FLAGS_USAGE_H_
