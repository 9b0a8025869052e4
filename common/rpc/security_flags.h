// The transport flags every Fulcrum daemon shares:
//   --tls_ca_file, --tls_cert_file, --tls_key_file  (TLS, the default)
//   --tls_crl_dir, --tls_refresh_s
//   --insecure                                      (plaintext, with a warning)
//   --metrics_tls_cert_file, --metrics_tls_key_file, --metrics_basic_auth_file
//                                                   (the metrics endpoint)
#ifndef FULCRUM_COMMON_RPC_SECURITY_FLAGS_H_
#define FULCRUM_COMMON_RPC_SECURITY_FLAGS_H_

#include "absl/strings/string_view.h"

#include <memory>

#include "absl/status/statusor.h"
#include "common/metrics/endpoint_security.h"
#include "common/rpc/security.h"

namespace fulcrum::security {

// The process's transport from the flags; logs what it chose. TLS is on
// unless --insecure: without certificate files it is an error that says how
// to get them. `role` is what this program's certificate must say (its
// SPIFFE ID), so a worker's certificate cannot run a server.
absl::StatusOr<std::shared_ptr<const Transport>> TransportFromFlags(absl::string_view program, Role role);

// --metrics_tls_cert_file, --metrics_tls_key_file, --metrics_basic_auth_file.
metrics::EndpointSecurity MetricsSecurityFromFlags();

// True when --insecure was given.
bool InsecureFlag();

}  // namespace fulcrum::security

#endif  // FULCRUM_COMMON_RPC_SECURITY_FLAGS_H_
