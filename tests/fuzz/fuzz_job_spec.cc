// libFuzzer target: the job spec parser (YAML subset and JSON) and the job
// spec validation the coordinator runs on every submission. Any input must
// come back as a status: no crash, no sanitizer report, no unbounded
// allocation.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/config/job_spec.h"
#include "common/config/spec_text.h"
#include "fulcrum/v1/cluster.pb.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  fulcrum::v1::JobSpec spec;
  if (fulcrum::config::ParseSpecText(text, "fuzz.yaml", &spec).ok()) {
    (void)fulcrum::config::ValidateJobSpec(spec);
  }
  return 0;
}
