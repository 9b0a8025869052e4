// Error helpers shared by servers and clients.
#ifndef FULCRUM_COMMON_ERRORS_H_
#define FULCRUM_COMMON_ERRORS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

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

// Whether `status` is a parameter server's refusal to grow a job past its
// memory quota (quota_bytes) or the server past its memory limit
// (--memory_limit_bytes): RESOURCE_EXHAUSTED naming that quota or limit,
// possibly with context in front. Rolling back to a checkpoint does not
// cure it (the same rows come back), so workers report it as
// "QuotaExceeded" and the coordinator fails the job at once.
bool IsParameterMemoryExhausted(const absl::Status& status);

// What a lost BSP rank's replacement meets when its predecessor died between
// its pushes of one step to different servers: a server that already
// applied step `step` (it had every rank's part) answers a pull for it with
// newer weights, so the step's gradient for the servers still waiting for
// it cannot be computed again. FAILED_PRECONDITION; workers report it as
// "TornStep" and the coordinator rolls the job back to its last cut, where
// every server agrees (docs/cluster.md, "A step torn by a lost worker").
absl::Status TornStepError(uint64_t step, uint64_t applied_step, const std::string& server);
// Whether `status` is that error, possibly with context added in front.
bool IsTornStep(const absl::Status& status);

// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or code
// points past U+10FFFF), as proto3 string fields must be.
bool IsValidUtf8(std::string_view s);

// Outside input as an error message may quote it: in single quotes, bytes
// that are not printable ASCII escaped (\xff), cut to `max` bytes of input
// with the full length said. Never echo raw input: a proto3 string with
// invalid UTF-8 breaks the client's decoder, and a long one its metadata.
std::string QuoteInput(std::string_view s, size_t max = 64);

// The most bytes of a status message sent to a client.
inline constexpr size_t kMaxStatusMessageBytes = 2048;
// `message` as it may go on the wire: valid UTF-8 (invalid bytes escaped)
// and at most kMaxStatusMessageBytes (cut at a character, saying how much).
std::string SafeStatusMessage(std::string_view message);

// Adds context in front of a status message, keeping code and payloads.
absl::Status Annotate(const absl::Status& status, const std::string& context);

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_ERRORS_H_
