// Semantic checks of a JobSpec: every mistake at once, each naming its field
// path and what is allowed. The coordinator runs them on SubmitJob (and
// answers INVALID_ARGUMENT); fulcrumctl runs them before sending.
#ifndef FULCRUM_COMMON_CONFIG_JOB_SPEC_H_
#define FULCRUM_COMMON_CONFIG_JOB_SPEC_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "fulcrum/v1/cluster.pb.h"

namespace fulcrum::config {

// SUCCEEDED, FAILED or CANCELLED.
inline bool JobEnded(v1::JobState s) { return s == v1::SUCCEEDED || s == v1::FAILED || s == v1::CANCELLED; }

// A worker's report that carries a result (an epoch's summary, the end, a
// failure): the worker sends it until the coordinator takes it, and the
// coordinator takes it only once it is saved.
inline bool CarriesResult(const v1::ReportProgressRequest& r) {
  return r.has_epoch_done() || r.finished() || !r.error().empty();
}

// The most workers (ranks) a job may have.
inline constexpr uint32_t kMaxWorkers = 1024;
inline constexpr int32_t kMaxClasses = 100000;          // model.num_classes
inline constexpr uint32_t kMaxCheckpointsKept = 1000;  // checkpoint.keep
inline constexpr uint32_t kMaxBackoffLimit = 1000;     // run_policy.backoff_limit

// What a worker read, for logs and fulcrumctl: "digits.csv.gz: 1438
// examples, 64 features, class labels (10 classes) from column 64 (counted
// from 0)".
std::string DataSummaryLine(const v1::DataSummary& d);

// Spells the spec's names as Fulcrum stores them: the words users may write
// in any case (model.type, model.activation, data formats and label kinds,
// as enum values) in lower case. Run before JobSpecProblems.
void NormalizeJobSpec(v1::JobSpec* spec);

std::vector<std::string> JobSpecProblems(const v1::JobSpec& spec);
// OK, or INVALID_ARGUMENT listing JobSpecProblems one per line.
absl::Status ValidateJobSpec(const v1::JobSpec& spec);

}  // namespace fulcrum::config

#endif  // FULCRUM_COMMON_CONFIG_JOB_SPEC_H_
