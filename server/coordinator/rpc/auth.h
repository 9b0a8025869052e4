// Bearer-token authentication for the job API.
//
// The token file uses the Kubernetes static token file format, one user per
// line:
//   token,user,uid[,"group1,group2"]
// Blank lines and lines starting with '#' are skipped. Members of the group
// `fulcrum:admins` see and act on every job; other users only their own.
// The file is re-read when it changes (checked at most once a second), so
// tokens are added, rotated and revoked without a restart.
#ifndef FULCRUM_SERVER_COORDINATOR_RPC_AUTH_H_
#define FULCRUM_SERVER_COORDINATOR_RPC_AUTH_H_

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/security/auth_metadata_processor.h>
#include <grpcpp/server_context.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/file_util.h"

namespace fulcrum {

inline constexpr char kAdminGroup[] = "fulcrum:admins";

struct Caller {
  std::string user;    // empty: anonymous (a coordinator without tokens)
  bool admin = false;
};

struct TokenEntry {
  std::string token;
  std::string user;
  std::string uid;
  std::vector<std::string> groups;
};

// Parses a token file's text; errors name the line and what is wrong.
absl::StatusOr<std::vector<TokenEntry>> ParseTokenFile(const std::string& text, const std::string& path);

class TokenAuthenticator {
 public:
  static absl::StatusOr<std::unique_ptr<TokenAuthenticator>> Open(const std::string& path);

  // The caller behind the request's `authorization: Bearer <token>` header:
  // UNAUTHENTICATED when it is missing, malformed or unknown.
  absl::StatusOr<Caller> Authenticate(const grpc::ServerContextBase& ctx);
  // The same for the header's value; nullptr when the header is missing.
  absl::StatusOr<Caller> AuthenticateHeader(const absl::string_view* authorization);
  absl::StatusOr<Caller> AuthenticateToken(absl::string_view token);

  size_t users() const;

 private:
  explicit TokenAuthenticator(std::string path) : path_(std::move(path)) {}
  absl::Status Load() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeReload() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  mutable absl::Mutex mu_;
  std::vector<TokenEntry> entries_ ABSL_GUARDED_BY(mu_);
  FileVersion version_ ABSL_GUARDED_BY(mu_);  // of the file last read
  absl::Time next_check_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

// The job API's credentials, checked when a call's headers arrive, before
// gRPC reads its request into a message: a caller without a valid bearer
// token costs no parsing, and no protobuf error is logged on its behalf.
// JobService calls need a token; ClusterService calls a member's
// certificate or a token; other services (health, reflection) pass. The
// handlers check again as before (they need the caller). gRPC runs such a
// processor only on TLS ports: with --insecure the handlers' check, after
// parsing, is the only one.
std::shared_ptr<grpc::AuthMetadataProcessor> NewTokenCheckBeforeParse(std::shared_ptr<TokenAuthenticator> tokens);

// Who may act on a job: its owner and admins; everyone when the coordinator
// has no tokens. PERMISSION_DENIED names the job and the caller.
absl::Status CheckJobAccess(const Caller& caller, const std::string& job_id, const std::string& owner);

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_COORDINATOR_RPC_AUTH_H_
