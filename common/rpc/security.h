// Transport security and peer identity for every gRPC endpoint.
//
// Cluster members (coordinator, servers, workers) hold certificates from the
// cluster's CA whose subject alternative name carries a SPIFFE ID naming the
// member's role: spiffe://fulcrum/<role>/<name>, e.g.
// spiffe://fulcrum/server/server-0 (deploy/tls/gen-certs.sh makes them).
// Servers require such a certificate from every caller (mutual TLS); the
// coordinator asks for one and requires it on the cluster service, while
// users reach its job service with a bearer token (server/coordinator/rpc/auth.h).
//
// The transport is process-wide: each binary's main calls
// ConfigureTransportFromFlags (security_flags.h) once, before it opens a
// channel or a port. A process that never configures it (unit tests that run
// everything in one process) speaks plaintext.
#ifndef FULCRUM_COMMON_RPC_SECURITY_H_
#define FULCRUM_COMMON_RPC_SECURITY_H_

#include <initializer_list>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_context.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace fulcrum::security {

enum class Role { kUnknown, kCoordinator, kServer, kWorker };
absl::string_view RoleName(Role role);

inline constexpr absl::string_view kSpiffePrefix = "spiffe://fulcrum/";

// Parses spiffe://fulcrum/<role>[/<name>]; kUnknown for anything else.
Role RoleOfSpiffeId(absl::string_view id, std::string* name = nullptr);

struct TlsFiles {
  std::string ca_file;    // PEM: the cluster CA (trust anchor for peers)
  std::string cert_file;  // PEM: this process's certificate (chain)
  std::string key_file;   // PEM: its private key
  std::string crl_dir;    // optional: hashed CRL files (c_rehash) to enforce
};

// What a certificate says about its holder.
struct Identity {
  Role role = Role::kUnknown;
  std::string name;       // after the role in the SPIFFE ID; may be empty
  std::string spiffe_id;  // empty when the certificate carries none
  std::string subject;    // the certificate's subject, for logs
  absl::Time not_after;
};

// Reads and checks `files` the way a handshake would, so a bad file fails at
// startup with its name rather than at the first connection: the CA and the
// certificate parse, the key matches the certificate, the certificate chains
// to the CA and is within its validity period.
absl::StatusOr<Identity> LoadIdentity(const TlsFiles& files);

// Turns TLS on for this process, after checking the files as LoadIdentity
// does; returns the identity they hold. Certificates and the CA are re-read
// every `refresh` (rotation: replace the files; see docs/security.md).
absl::StatusOr<Identity> ConfigureTls(const TlsFiles& files, absl::Duration refresh = absl::Seconds(60));
// Explicit plaintext (--insecure).
void ConfigureInsecure();
// For clients without a certificate of their own (fulcrumctl): TLS that
// verifies the server against `ca_file`, or against the system's roots when
// it is empty. Servers are not started in such a process.
absl::Status ConfigureClientTls(const std::string& ca_file);
bool TlsEnabled();

// Credentials for channels to cluster members: our certificate plus the CA
// (plaintext when TLS is off).
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials();

enum class ClientCerts {
  kRequired,  // mutual TLS: parameter servers
  kOptional,  // asked for and verified when sent: the coordinator
};
std::shared_ptr<grpc::ServerCredentials> ServerCredentials(ClientCerts client_certs);

// Who is calling, by the certificate the peer presented and gRPC verified.
struct Peer {
  bool verified = false;  // presented a certificate that chains to our CA
  Role role = Role::kUnknown;
  std::string name;
  std::string spiffe_id;
};
Peer PeerOf(const grpc::ServerContextBase& ctx);
Peer PeerOf(const grpc::AuthContext& auth);

// OK when TLS is off (every caller is trusted) or the caller presented a
// verified certificate of one of `roles`; otherwise UNAUTHENTICATED (no
// certificate) or PERMISSION_DENIED (wrong role), naming `what`.
absl::Status RequireRole(const grpc::ServerContextBase& ctx, std::initializer_list<Role> roles,
                         absl::string_view what);

}  // namespace fulcrum::security

#endif  // FULCRUM_COMMON_RPC_SECURITY_H_
