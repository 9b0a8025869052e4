#include "server/coordinator/rpc/auth.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/constant_time.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/rpc/security.h"
#include "common/status_macros.h"

namespace fulcrum {
namespace {

// Splits a CSV line into fields; a field may be double-quoted (the groups
// list, which holds commas).
absl::StatusOr<std::vector<std::string>> SplitCsv(absl::string_view line) {
  std::vector<std::string> fields(1);
  bool quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"') quoted = false;
      else fields.back() += c;
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.emplace_back();
    } else {
      fields.back() += c;
    }
  }
  if (quoted) return absl::InvalidArgumentError("unterminated quote");
  for (auto& f : fields) f = std::string(absl::StripAsciiWhitespace(f));
  return fields;
}


}  // namespace

absl::StatusOr<std::vector<TokenEntry>> ParseTokenFile(const std::string& text, const std::string& path) {
  std::vector<TokenEntry> entries;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    auto where = [&] { return absl::StrCat(path, ":", line_no, ": "); };
    auto fields = SplitCsv(line);
    if (!fields.ok()) return absl::InvalidArgumentError(absl::StrCat(where(), fields.status().message()));
    if (fields->size() < 3 || fields->size() > 4) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), "want token,user,uid[,\"group1,group2\"], got ", fields->size(), " fields"));
    }
    TokenEntry e{(*fields)[0], (*fields)[1], (*fields)[2], {}};
    if (e.token.size() < 16) {
      return absl::InvalidArgumentError(absl::StrCat(where(), "the token of user '", e.user,
                                                     "' is shorter than 16 characters (openssl rand -hex 32 makes one)"));
    }
    for (char c : e.token) {
      if (c <= ' ' || c > '~') return absl::InvalidArgumentError(absl::StrCat(where(), "token has a non-printable character"));
    }
    if (e.user.empty()) return absl::InvalidArgumentError(absl::StrCat(where(), "empty user name"));
    if (fields->size() == 4) {
      for (absl::string_view g : absl::StrSplit((*fields)[3], ',', absl::SkipWhitespace())) {
        e.groups.emplace_back(absl::StripAsciiWhitespace(g));
      }
    }
    for (const TokenEntry& other : entries) {
      if (other.token == e.token) {
        return absl::InvalidArgumentError(
            absl::StrCat(where(), "user '", e.user, "' has the same token as user '", other.user, "'"));
      }
    }
    entries.push_back(std::move(e));
  }
  return entries;
}

absl::StatusOr<std::unique_ptr<TokenAuthenticator>> TokenAuthenticator::Open(const std::string& path) {
  std::unique_ptr<TokenAuthenticator> a(new TokenAuthenticator(path));
  absl::MutexLock lock(&a->mu_);
  if (auto s = a->Load(); !s.ok()) return s;
  a->next_check_ = absl::Now() + absl::Seconds(1);
  return a;
}

absl::Status TokenAuthenticator::Load() {
  const FileVersion version = FileVersion::Of(path_);
  if ((version.mode & 0007) != 0) {
    FLOG(WARNING) << "the token file " << path_ << " is readable by others (mode "
                  << absl::StrFormat("%03o", version.mode) << "); chmod 600 it";
  }
  ASSIGN_OR_RETURN(const std::string text, ReadFileToString(path_, "token"));
  ASSIGN_OR_RETURN(entries_, ParseTokenFile(text, path_));
  version_ = version;
  return absl::OkStatus();
}

void TokenAuthenticator::MaybeReload() {
  const absl::Time now = absl::Now();
  if (now < next_check_) return;
  next_check_ = now + absl::Seconds(1);
  const FileVersion version = FileVersion::Of(path_);
  if (!version.exists() || version == version_) return;  // gone: keep the last good tokens
  const size_t before = entries_.size();
  if (auto s = Load(); !s.ok()) {
    FLOG(ERROR) << "token file changed but does not parse; keeping the " << before << " tokens loaded before: " << s;
    version_ = version;  // do not log again until it changes again
    return;
  }
  FLOG(INFO) << "token file " << path_ << " reloaded: " << entries_.size() << " token(s)";
}

size_t TokenAuthenticator::users() const {
  absl::MutexLock lock(&mu_);
  return entries_.size();
}

absl::StatusOr<Caller> TokenAuthenticator::AuthenticateToken(absl::string_view token) {
  absl::MutexLock lock(&mu_);
  MaybeReload();
  const TokenEntry* found = nullptr;
  for (const TokenEntry& e : entries_) {
    if (ConstantTimeEquals(e.token, token)) found = &e;
  }
  if (found == nullptr) return absl::UnauthenticatedError("the bearer token is not known to this coordinator");
  Caller c{found->user, false};
  for (const auto& g : found->groups) c.admin |= g == kAdminGroup;
  return c;
}

absl::StatusOr<Caller> TokenAuthenticator::Authenticate(const grpc::ServerContextBase& ctx) {
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return AuthenticateHeader(nullptr);
  const absl::string_view value(it->second.data(), it->second.size());
  return AuthenticateHeader(&value);
}

absl::StatusOr<Caller> TokenAuthenticator::AuthenticateHeader(const absl::string_view* authorization) {
  if (authorization == nullptr) {
    return absl::UnauthenticatedError(
        "no credentials: the job API needs 'authorization: Bearer <token>' (fulcrumctl: --token_file, "
        "$FULCRUM_TOKEN or $FULCRUM_TOKEN_FILE)");
  }
  absl::string_view value = *authorization;
  if (!absl::ConsumePrefix(&value, "Bearer ") && !absl::ConsumePrefix(&value, "bearer ")) {
    return absl::UnauthenticatedError("the authorization header is not 'Bearer <token>'");
  }
  return AuthenticateToken(absl::StripAsciiWhitespace(value));
}

namespace {

class TokenCheckBeforeParse final : public grpc::AuthMetadataProcessor {
 public:
  explicit TokenCheckBeforeParse(std::shared_ptr<TokenAuthenticator> tokens) : tokens_(std::move(tokens)) {}

  // A constant-time comparison under a mutex (and a re-read of the token
  // file at most once a second): cheap enough for gRPC's own thread.
  bool IsBlocking() const override { return false; }

  grpc::Status Process(const InputMetadata& md, grpc::AuthContext* context, OutputMetadata* /*consumed*/,
                       OutputMetadata* /*response*/) override {
    auto path = md.find(":path");
    if (path == md.end()) return grpc::Status::OK;  // gRPC answers a call without one itself
    const absl::string_view method(path->second.data(), path->second.size());
    if (absl::StartsWith(method, "/fulcrum.v1.ClusterService/")) {
      if (context != nullptr && security::PeerOf(*context).role != security::Role::kUnknown) return grpc::Status::OK;
    } else if (!absl::StartsWith(method, "/fulcrum.v1.JobService/")) {
      return grpc::Status::OK;
    }
    auto it = md.find("authorization");
    absl::string_view value;
    if (it != md.end()) value = absl::string_view(it->second.data(), it->second.size());
    const absl::StatusOr<Caller> caller = tokens_->AuthenticateHeader(it == md.end() ? nullptr : &value);
    if (caller.ok()) return grpc::Status::OK;
    return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, std::string(caller.status().message()));
  }

 private:
  std::shared_ptr<TokenAuthenticator> tokens_;
};

}  // namespace

std::shared_ptr<grpc::AuthMetadataProcessor> NewTokenCheckBeforeParse(std::shared_ptr<TokenAuthenticator> tokens) {
  return std::make_shared<TokenCheckBeforeParse>(std::move(tokens));
}

absl::Status CheckJobAccess(const Caller& caller, const std::string& job_id, const std::string& owner) {
  if (caller.admin || caller.user == owner) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat("job '", job_id, "' belongs to ",
                                                  owner.empty() ? std::string("no user") : "another user",
                                                  "; user '", caller.user, "' may act only on their own jobs"));
}

}  // namespace fulcrum
