#include "common/rpc/security_flags.h"

#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"

ABSL_FLAG(std::string, tls_ca_file, "", "PEM file of the cluster CA that peers' certificates must chain to");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM certificate (chain) of this process; its SAN carries spiffe://fulcrum/<role>/<name>");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_crl_dir, "", "optional directory of hashed CRL files (openssl rehash) to enforce");
ABSL_FLAG(int32_t, tls_refresh_s, 60, "how often the certificate, key and CA files are re-read (rotation)");
ABSL_FLAG(bool, insecure, false, "serve and connect in plaintext, without TLS or client certificates (not for "
                                 "shared networks: anyone who can reach a port can read and change parameters)");

ABSL_FLAG(std::string, metrics_tls_cert_file, "",
          "serve --metrics_addr over HTTPS with this PEM certificate (chain); re-read when it changes");
ABSL_FLAG(std::string, metrics_tls_key_file, "", "the private key of --metrics_tls_cert_file");
ABSL_FLAG(std::string, metrics_basic_auth_file, "",
          "require HTTP basic auth on /metrics: 'user:bcrypt-hash' lines (htpasswd -nB USER); re-read when it "
          "changes");

namespace fulcrum::security {

metrics::EndpointSecurity MetricsSecurityFromFlags() {
  return {absl::GetFlag(FLAGS_metrics_tls_cert_file), absl::GetFlag(FLAGS_metrics_tls_key_file),
          absl::GetFlag(FLAGS_metrics_basic_auth_file)};
}

bool InsecureFlag() { return absl::GetFlag(FLAGS_insecure); }

absl::StatusOr<std::shared_ptr<const Transport>> TransportFromFlags(absl::string_view program, Role role) {
  TlsFiles files{absl::GetFlag(FLAGS_tls_ca_file), absl::GetFlag(FLAGS_tls_cert_file),
                 absl::GetFlag(FLAGS_tls_key_file), absl::GetFlag(FLAGS_tls_crl_dir)};
  if (absl::GetFlag(FLAGS_insecure)) {
    if (!files.ca_file.empty() || !files.cert_file.empty() || !files.key_file.empty()) {
      return absl::InvalidArgumentError("--insecure and --tls_* files contradict each other: pass one or the other");
    }
    FLOG(WARNING) << program << " runs WITHOUT TLS (--insecure): traffic is plaintext and callers are not "
                  << "authenticated by certificate; use this only on a network you trust";
    return Transport::Plaintext();
  }
  if (files.ca_file.empty() || files.cert_file.empty() || files.key_file.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        program, " serves TLS by default and needs --tls_ca_file, --tls_cert_file and --tls_key_file (",
        "deploy/tls/gen-certs.sh makes a CA and a ", RoleName(role),
        " certificate); pass --insecure to run in plaintext instead"));
  }
  const int32_t refresh = absl::GetFlag(FLAGS_tls_refresh_s);
  if (refresh < 1) return absl::InvalidArgumentError("--tls_refresh_s must be at least 1");
  Identity identity;
  auto transport = Transport::Member(files, absl::Seconds(refresh), &identity);
  if (!transport.ok()) return transport.status();
  const Identity* id = &identity;
  if (id->role != role) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the certificate in ", files.cert_file, " names ",
        id->spiffe_id.empty() ? std::string("no Fulcrum SPIFFE ID") : id->spiffe_id, "; ", program,
        " needs a ", RoleName(role), " certificate (SAN URI ", kSpiffePrefix, RoleName(role), "/<name>)"));
  }
  const absl::Duration left = id->not_after - absl::Now();
  FLOG(INFO) << "TLS on: identity " << id->spiffe_id << " (" << id->subject << "), CA " << files.ca_file
             << ", certificate valid for " << absl::FormatDuration(absl::Trunc(left, absl::Hours(1)))
             << ", files re-read every " << refresh << "s" << (files.crl_dir.empty() ? "" : ", CRLs from ")
             << files.crl_dir;
  if (left < absl::Hours(24 * 7)) {
    FLOG(WARNING) << "the certificate in " << files.cert_file << " expires in "
                  << absl::FormatDuration(absl::Trunc(left, absl::Minutes(1))) << "; rotate it (docs/security.md)";
  }
  return transport;
}

}  // namespace fulcrum::security
