#include "common/errors.h"

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace fulcrum {
namespace {
constexpr char kShardMapVersionUrl[] = "type.fulcrum.dev/shard-map-version";
constexpr char kNotOnServer[] = " is not on this server";
constexpr char kTornStep[] =
    " is still missing on another server: its weights of that step are gone (a torn step; rolling back)";
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

bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;  // a continuation byte first, an overlong 2-byte lead, or past U+10FFFF
    }
    if (i + len > n) return false;
    for (int k = 1; k < len; ++k) {
      const unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += len;
  }
  return true;
}

namespace {
void AppendEscaped(std::string_view s, std::string* out) {
  for (const char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    if (c >= 0x20 && c < 0x7F && c != '\\' && c != '\'') {
      out->push_back(ch);
    } else {
      absl::StrAppend(out, "\\x", absl::Hex(c, absl::kZeroPad2));
    }
  }
}
}  // namespace

std::string QuoteInput(std::string_view s, size_t max) {
  std::string out = "'";
  AppendEscaped(s.substr(0, max), &out);
  out.push_back('\'');
  if (s.size() > max) absl::StrAppend(&out, " (cut: ", s.size(), " bytes)");
  return out;
}

std::string SafeStatusMessage(std::string_view message) {
  std::string out;
  if (IsValidUtf8(message)) {
    out = std::string(message);
  } else {
    // Keep the valid characters, escape the rest byte by byte.
    size_t i = 0;
    while (i < message.size()) {
      size_t len = 1;
      const unsigned char c = static_cast<unsigned char>(message[i]);
      if (c >= 0xC2 && c <= 0xDF) len = 2;
      else if (c >= 0xE0 && c <= 0xEF) len = 3;
      else if (c >= 0xF0 && c <= 0xF4) len = 4;
      const std::string_view ch = message.substr(i, len);
      if (ch.size() == len && IsValidUtf8(ch)) {
        out.append(ch);
        i += len;
      } else {
        AppendEscaped(message.substr(i, 1), &out);
        ++i;
      }
    }
  }
  if (out.size() <= kMaxStatusMessageBytes) return out;
  size_t end = kMaxStatusMessageBytes;
  while (end > 0 && (static_cast<unsigned char>(out[end]) & 0xC0) == 0x80) --end;
  const size_t cut = out.size() - end;
  out.resize(end);
  absl::StrAppend(&out, " ... (", cut, " more bytes)");
  return out;
}

absl::Status JobNotOnServerError(const std::string& job_id) {
  return absl::NotFoundError(absl::StrCat("job ", QuoteInput(job_id), kNotOnServer));
}

bool IsJobNotOnServer(const absl::Status& status) {
  return status.code() == absl::StatusCode::kNotFound && absl::EndsWith(status.message(), kNotOnServer);
}

bool IsParameterMemoryExhausted(const absl::Status& status) {
  return status.code() == absl::StatusCode::kResourceExhausted &&
         (absl::StrContains(status.message(), "parameter memory quota of") ||
          absl::StrContains(status.message(), "parameter memory limit of"));
}

absl::Status TornStepError(uint64_t step, uint64_t applied_step, const std::string& server) {
  return absl::FailedPreconditionError(absl::StrCat(
      "server ", server, " has applied steps up to ", applied_step - 1, " while this rank's step ", step,
      kTornStep));
}

bool IsTornStep(const absl::Status& status) {
  return status.code() == absl::StatusCode::kFailedPrecondition && absl::StrContains(status.message(), kTornStep);
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
