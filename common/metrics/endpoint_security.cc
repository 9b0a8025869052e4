#include "common/metrics/endpoint_security.h"

#include <crypt.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/constant_time.h"
#include "common/file_util.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace fulcrum::metrics {
namespace {

std::string SslError() {
  const unsigned long e = ERR_get_error();
  ERR_clear_error();
  if (e == 0) return "unknown OpenSSL error";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  return buf;
}


}  // namespace

absl::StatusOr<std::unique_ptr<TlsContext>> TlsContext::Open(const std::string& cert_file,
                                                             const std::string& key_file) {
  if (cert_file.empty() || key_file.empty()) {
    return absl::InvalidArgumentError("metrics over HTTPS needs both --metrics_tls_cert_file and --metrics_tls_key_file");
  }
  std::unique_ptr<TlsContext> t(new TlsContext(cert_file, key_file));
  auto ctx = t->Build();
  if (!ctx.ok()) return ctx.status();
  absl::MutexLock lock(&t->mu_);
  t->ctx_ = *ctx;
  t->version_ = t->Version();
  return t;
}

TlsContext::~TlsContext() {
  absl::MutexLock lock(&mu_);
  SSL_CTX_free(ctx_);
}

std::pair<FileVersion, FileVersion> TlsContext::Version() const {
  return {FileVersion::Of(cert_), FileVersion::Of(key_)};
}

absl::StatusOr<SSL_CTX*> TlsContext::Build() const {
  SSL_CTX* ctx = SSL_CTX_new(TLS_server_method());
  if (ctx == nullptr) return absl::InternalError(absl::StrCat("SSL_CTX_new: ", SslError()));
  SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
  if (SSL_CTX_use_certificate_chain_file(ctx, cert_.c_str()) != 1) {
    const std::string e = SslError();
    SSL_CTX_free(ctx);
    return absl::InvalidArgumentError(absl::StrCat("metrics certificate ", cert_, ": ", e));
  }
  if (SSL_CTX_use_PrivateKey_file(ctx, key_.c_str(), SSL_FILETYPE_PEM) != 1 || SSL_CTX_check_private_key(ctx) != 1) {
    const std::string e = SslError();
    SSL_CTX_free(ctx);
    return absl::InvalidArgumentError(
        absl::StrCat("metrics key ", key_, " is unreadable or does not belong to ", cert_, ": ", e));
  }
  return ctx;
}

SSL_CTX* TlsContext::Acquire() {
  absl::MutexLock lock(&mu_);
  const auto version = Version();
  if (version != version_) {
    version_ = version;
    auto fresh = Build();
    if (fresh.ok()) {
      SSL_CTX_free(ctx_);
      ctx_ = *fresh;
      FLOG(INFO) << "metrics certificate " << cert_ << " reloaded";
    } else {
      FLOG(ERROR) << "metrics certificate changed but does not load; keeping the old one: " << fresh.status();
    }
  }
  SSL_CTX_up_ref(ctx_);
  return ctx_;
}

absl::StatusOr<std::unique_ptr<BasicAuth>> BasicAuth::Open(const std::string& path) {
  std::unique_ptr<BasicAuth> a(new BasicAuth(path));
  absl::MutexLock lock(&a->mu_);
  if (auto s = a->Load(); !s.ok()) return s;
  return a;
}

absl::Status BasicAuth::Load() {
  const FileVersion version = FileVersion::Of(path_);
  ASSIGN_OR_RETURN(const std::string text, ReadFileToString(path_, "metrics basic auth"));
  std::vector<User> users;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    const size_t colon = line.find(':');
    User u;
    if (colon != absl::string_view::npos) {
      u.name = std::string(line.substr(0, colon));
      u.hash = std::string(line.substr(colon + 1));
    }
    if (u.name.empty() || !(absl::StartsWith(u.hash, "$2y$") || absl::StartsWith(u.hash, "$2b$") ||
                            absl::StartsWith(u.hash, "$2a$") || absl::StartsWith(u.hash, "$6$"))) {
      return absl::InvalidArgumentError(absl::StrCat(
          path_, ":", line_no, ": want user:hash with a bcrypt ($2y$) or SHA-512 crypt ($6$) hash (htpasswd -nB USER)"));
    }
    users.push_back(std::move(u));
  }
  if (users.empty()) return absl::InvalidArgumentError(absl::StrCat(path_, " lists no users"));
  users_ = std::move(users);
  verified_.clear();
  version_ = version;
  return absl::OkStatus();
}

bool BasicAuth::Check(absl::string_view authorization) {
  absl::MutexLock lock(&mu_);
  if (const FileVersion version = FileVersion::Of(path_); version != version_) {
    if (auto s = Load(); !s.ok()) {
      FLOG(ERROR) << "metrics basic auth file changed but does not parse; keeping the old users: " << s;
      version_ = version;
    } else {
      FLOG(INFO) << "metrics basic auth file " << path_ << " reloaded: " << users_.size() << " user(s)";
    }
  }
  for (const std::string& v : verified_) {
    if (ConstantTimeEquals(v, authorization)) return true;
  }
  absl::string_view encoded = authorization;
  if (!absl::ConsumePrefix(&encoded, "Basic ")) return false;
  std::string decoded;
  if (!absl::Base64Unescape(absl::StripAsciiWhitespace(encoded), &decoded)) return false;
  const size_t colon = decoded.find(':');
  if (colon == std::string::npos) return false;
  const std::string user = decoded.substr(0, colon), password = decoded.substr(colon + 1);
  for (const User& u : users_) {
    if (u.name != user) continue;
    crypt_data data;
    std::memset(&data, 0, sizeof(data));
    const char* h = crypt_r(password.c_str(), u.hash.c_str(), &data);
    if (h != nullptr && h[0] != '*' && ConstantTimeEquals(h, u.hash)) {
      if (verified_.size() >= 64) verified_.erase(verified_.begin());
      verified_.emplace_back(authorization);
      return true;
    }
  }
  return false;
}

}  // namespace fulcrum::metrics
