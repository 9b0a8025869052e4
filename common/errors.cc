#include "common/errors.h"

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fulcrum {
namespace {
constexpr char kShardMapVersionUrl[] = "type.fulcrum.dev/shard-map-version";
constexpr char kNotOnServer[] = "' is not on this server";
}  // namespace

absl::Status WrongShardError(const std::string& message, uint64_t server_map_version) {
  absl::Status s = absl::AbortedError(message);
  s.SetPayload(kShardMapVersionUrl, absl::Cord(absl::StrCat(server_map_version)));
  return s;
}

std::optional<uint64_t> WrongShardVersion(const absl::Status& status) {
  if (status.code() != absl::StatusCode::kAborted) return std::nullopt;
  auto payload = status.GetPayload(kShardMapVersionUrl);
  if (!payload) return std::nullopt;
  uint64_t v = 0;
  if (!absl::SimpleAtoi(std::string(*payload), &v)) return std::nullopt;
  return v;
}

absl::Status JobNotOnServerError(const std::string& job_id) {
  return absl::NotFoundError(absl::StrCat("job '", job_id, kNotOnServer));
}

bool IsJobNotOnServer(const absl::Status& status) {
  return status.code() == absl::StatusCode::kNotFound && absl::EndsWith(status.message(), kNotOnServer);
}

absl::Status Annotate(const absl::Status& status, const std::string& context) {
  if (status.ok()) return status;
  absl::Status out(status.code(), absl::StrCat(context, ": ", status.message()));
  status.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
    out.SetPayload(url, payload);
  });
  return out;
}

}  // namespace fulcrum
