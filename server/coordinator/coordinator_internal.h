// What the coordinator's parts (coordinator*.cc) share: record keys and
// names. Not for use outside server/coordinator/.
#ifndef FULCRUM_SERVER_COORDINATOR_COORDINATOR_INTERNAL_H_
#define FULCRUM_SERVER_COORDINATOR_COORDINATOR_INTERNAL_H_

#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "fulcrum/v1/cluster.pb.h"

namespace fulcrum::coordinator_internal {

// NOT_FOUND for a job id the caller gave: quoted and cut as outside input
// is (docs/security.md, "Limits").
inline absl::Status NoJobError(const std::string& job_id) {
  return absl::NotFoundError(absl::StrCat("no job ", QuoteInput(job_id)));
}

// RocksDB keys: job/<id>, node/<id> and the meta record.
inline constexpr char kJobPrefix[] = "job/";
inline constexpr char kNodePrefix[] = "node/";
inline constexpr char kMetaKey[] = "meta";

// What a failing shard-map install is called in the log, and its key in
// failing_calls_ (the waiting jobs' message looks it up).
inline constexpr char kInstallingShardMap[] = "installing the shard map";

// Job ids ("name-N") and node ids ("server-N", "worker-N") end in the
// coordinator's counter: N orders jobs by submission and nodes by
// registration, across restarts.
inline uint64_t Serial(const std::string& id) {
  const size_t dash = id.rfind('-');
  return dash == std::string::npos ? 0 : std::strtoull(id.c_str() + dash + 1, nullptr, 10);
}

// Whether a running job is rolling back, to a committed cut or (none yet)
// to its start: its workers are stopped until every server holds it again.
inline bool RollingBack(const v1::JobStatus& st) { return st.restoring_cut() != 0 || st.restarting(); }

}  // namespace fulcrum::coordinator_internal

#endif  // FULCRUM_SERVER_COORDINATOR_COORDINATOR_INTERNAL_H_
