// Error helpers shared by servers and clients.
#ifndef FULCRUM_COMMON_ERRORS_H_
#define FULCRUM_COMMON_ERRORS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"

namespace fulcrum {

// The distinct error a server returns for a request routed with a shard map
// it does not agree with: ABORTED, carrying the server's map version so the
// client refreshes its map and retries.
absl::Status WrongShardError(const std::string& message, uint64_t server_map_version);
// The server's map version when `status` is a WrongShardError.
std::optional<uint64_t> WrongShardVersion(const absl::Status& status);

// What a parameter server answers for a job it does not hold: NOT_FOUND,
// "job 'ID' is not on this server". Once a job runs, that means the server
// lost it (it was restarted): workers report the rank's failure as
// "ServerLost", which rolls the job back without counting against its
// backoff limit, as the coordinator's own detection of a lost server does.
absl::Status JobNotOnServerError(const std::string& job_id);
// Whether `status` is that answer, possibly with context added in front.
bool IsJobNotOnServer(const absl::Status& status);

// Adds context in front of a status message, keeping code and payloads.
absl::Status Annotate(const absl::Status& status, const std::string& context);

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_ERRORS_H_
