// HTTPS and HTTP basic auth for the metrics endpoint (MetricsServer), in the
// shape Prometheus' own exporters use: a certificate and key for TLS, and a
// file of users with bcrypt password hashes (htpasswd -B, or Python's
// crypt with METHOD_BLOWFISH). Both files are re-read when they change.
#ifndef FULCRUM_COMMON_METRICS_ENDPOINT_SECURITY_H_
#define FULCRUM_COMMON_METRICS_ENDPOINT_SECURITY_H_

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/file_util.h"

typedef struct ssl_ctx_st SSL_CTX;

namespace fulcrum::metrics {

struct EndpointSecurity {
  std::string tls_cert_file;    // PEM certificate (chain); HTTPS when set
  std::string tls_key_file;     // its PEM private key
  std::string basic_auth_file;  // "user:hash" lines (bcrypt $2y$/$2b$, or $6$ SHA-512 crypt)
  bool tls() const { return !tls_cert_file.empty(); }
};

// The TLS server context, rebuilt when the certificate or key file changes
// (a broken new pair keeps the old one, logged).
class TlsContext {
 public:
  static absl::StatusOr<std::unique_ptr<TlsContext>> Open(const std::string& cert_file, const std::string& key_file);
  ~TlsContext();
  // Holds a reference the caller frees with SSL_CTX_free.
  SSL_CTX* Acquire();

 private:
  TlsContext(std::string cert, std::string key) : cert_(std::move(cert)), key_(std::move(key)) {}
  absl::StatusOr<SSL_CTX*> Build() const;
  std::pair<FileVersion, FileVersion> Version() const;  // of the certificate and the key
  const std::string cert_, key_;
  absl::Mutex mu_;
  SSL_CTX* ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::pair<FileVersion, FileVersion> version_ ABSL_GUARDED_BY(mu_);
};

// Users and password hashes for HTTP basic auth.
class BasicAuth {
 public:
  static absl::StatusOr<std::unique_ptr<BasicAuth>> Open(const std::string& path);
  // True when `authorization` (the header's value) is "Basic <base64
  // user:password>" of a listed user with the right password.
  bool Check(absl::string_view authorization);

 private:
  struct User {
    std::string name, hash;
  };
  explicit BasicAuth(std::string path) : path_(std::move(path)) {}
  absl::Status Load() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const std::string path_;
  absl::Mutex mu_;
  std::vector<User> users_ ABSL_GUARDED_BY(mu_);
  FileVersion version_ ABSL_GUARDED_BY(mu_);  // of the file last read
  // Header values that verified, so a scrape every few seconds does not pay
  // for bcrypt each time; cleared when the file changes.
  std::vector<std::string> verified_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fulcrum::metrics

#endif  // FULCRUM_COMMON_METRICS_ENDPOINT_SECURITY_H_
