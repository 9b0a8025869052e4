// Limits and helpers shared by the files of server/job_*.cc (one class,
// Job, in several files: pushes in job.cc, the BSP/SSP bookkeeping in
// job_sync.cc, pulls in job_pull.cc, checkpoints in job_checkpoint.cc,
// statistics and metrics in job_stats.cc). Not for use outside server/.
#ifndef FULCRUM_SERVER_JOB_INTERNAL_H_
#define FULCRUM_SERVER_JOB_INTERNAL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "common/payload.h"

namespace fulcrum::job_internal {

inline constexpr uint32_t kMaxWorkers = 65536;
inline constexpr uint32_t kMaxParts = 4096;
inline constexpr size_t kMaxTables = 1024;
// BSP buffers at most this many steps ahead of the first unapplied one.
inline constexpr uint64_t kMaxPendingSteps = 16;
// A BSP step's dense update is shared among cores from this many elements
// (512 KiB of fp32): below it, waking a helper costs about what it saves.
inline constexpr size_t kParallelApplyElements = size_t{1} << 17;
// Sparse keys in one push or pull: what fits kMaxPayloadBytes (4 MiB) of
// uint64 keys, the most a client that splits requests ever sends.
inline constexpr size_t kMaxKeysPerRequest = size_t{1} << 19;

absl::Status CheckKeyCount(size_t keys, absl::string_view what);
std::string Who(const std::string& worker, uint32_t rank);
absl::Status CheckDType(DType dtype, const std::string& table, absl::string_view field);
// Gathers a possibly multi-piece payload of `n` elements of dtype into fp32.
void DecodePayload(const Payload& p, DType dtype, size_t n, float* out);
std::vector<uint64_t> DecodeKeys(const Payload& p);

}  // namespace fulcrum::job_internal

#endif  // FULCRUM_SERVER_JOB_INTERNAL_H_
