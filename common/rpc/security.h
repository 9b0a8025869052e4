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
// A Transport is the security of a process's gRPC endpoints: plaintext,
// mutual TLS for a cluster member, or server-verifying TLS for a client
// without a certificate. Each binary's main makes one from its flags
// (TransportFromFlags, security_flags.h) and passes it in the options of
// every component that opens a channel or a port; nothing is process-wide,
// so one process can hold members of different roles (tests do).
#ifndef FULCRUM_COMMON_RPC_SECURITY_H_
#define FULCRUM_COMMON_RPC_SECURITY_H_

#include <initializer_list>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
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

enum class ClientCerts {
  kRequired,  // mutual TLS: parameter servers
  kOptional,  // asked for and verified when sent: the coordinator
};

class Transport {
 public:
  // Plaintext (--insecure, and tests that run a cluster in one process).
  static std::shared_ptr<const Transport> Plaintext();
  // `transport`, or Plaintext() when it is null (an option left unset).
  static std::shared_ptr<const Transport> OrPlaintext(std::shared_ptr<const Transport> transport) {
    return transport != nullptr ? std::move(transport) : Plaintext();
  }
  // Mutual TLS for a cluster member, after checking the files as
  // LoadIdentity does; `identity` receives what they hold. Certificates and
  // the CA are re-read every `refresh` (rotation: replace the files; see
  // docs/security.md).
  static absl::StatusOr<std::shared_ptr<const Transport>> Member(const TlsFiles& files,
                                                                 absl::Duration refresh = absl::Seconds(60),
                                                                 Identity* identity = nullptr);
  // For clients without a certificate of their own (fulcrumctl): TLS that
  // verifies the server against `ca_file`, or against the system's roots
  // when it is empty. It cannot serve.
  static absl::StatusOr<std::shared_ptr<const Transport>> Client(const std::string& ca_file);

  bool tls() const { return provider_ != nullptr || client_ != nullptr; }
  // Credentials for channels to cluster members: our certificate plus the
  // CA (plaintext when TLS is off).
  std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials() const;
  // nullptr for a client-only transport, which has no identity to serve with.
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials(ClientCerts client_certs) const;
  // OK when TLS is off (every caller is trusted) or the caller presented a
  // verified certificate of one of `roles`; otherwise UNAUTHENTICATED (no
  // certificate) or PERMISSION_DENIED (wrong role), naming `what`.
  absl::Status RequireRole(const grpc::ServerContextBase& ctx, std::initializer_list<Role> roles,
                           absl::string_view what) const;
  // The SPIFFE ID of the caller's verified certificate, which binds the
  // node it registers and the ranks it pushes for; empty when TLS is off
  // (every caller trusted) or the caller showed none.
  std::string CallerId(const grpc::ServerContextBase& ctx) const;

 private:
  Transport() = default;

  TlsFiles files_;
  std::shared_ptr<grpc::experimental::CertificateProviderInterface> provider_;
  // Set for a client-only transport: used for channels instead of provider_.
  std::shared_ptr<grpc::ChannelCredentials> client_;
};

// Who is calling, by the certificate the peer presented and gRPC verified.
struct Peer {
  bool verified = false;  // presented a certificate that chains to our CA
  Role role = Role::kUnknown;
  std::string name;
  std::string spiffe_id;
};
Peer PeerOf(const grpc::ServerContextBase& ctx);
Peer PeerOf(const grpc::AuthContext& auth);

}  // namespace fulcrum::security

#endif  // FULCRUM_COMMON_RPC_SECURITY_H_
