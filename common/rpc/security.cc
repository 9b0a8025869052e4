#include "common/rpc/security.h"

#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include <ctime>
#include <vector>

#include <grpc/grpc_security_constants.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"

namespace fulcrum::security {
namespace {

std::string OpenSslError() {
  const unsigned long e = ERR_get_error();
  if (e == 0) return "unknown OpenSSL error";
  char buf[256];
  ERR_error_string_n(e, buf, sizeof(buf));
  ERR_clear_error();
  return buf;
}

template <typename T, void (*Free)(T*)>
struct Deleter {
  void operator()(T* p) const { Free(p); }
};
using X509Ptr = std::unique_ptr<X509, Deleter<X509, X509_free>>;
using KeyPtr = std::unique_ptr<EVP_PKEY, Deleter<EVP_PKEY, EVP_PKEY_free>>;
using StorePtr = std::unique_ptr<X509_STORE, Deleter<X509_STORE, X509_STORE_free>>;
using StoreCtxPtr = std::unique_ptr<X509_STORE_CTX, Deleter<X509_STORE_CTX, X509_STORE_CTX_free>>;
void FreeBio(BIO* b) { BIO_free(b); }
using BioPtr = std::unique_ptr<BIO, Deleter<BIO, FreeBio>>;

// Every certificate in a PEM file, in order.
absl::StatusOr<std::vector<X509Ptr>> ParseCerts(const std::string& pem, const std::string& path,
                                                absl::string_view what) {
  BioPtr bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  std::vector<X509Ptr> certs;
  while (X509* c = PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr)) certs.emplace_back(c);
  ERR_clear_error();  // the read that ends the loop leaves "no start line"
  if (certs.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("the ", what, " file ", path, " holds no PEM certificate"));
  }
  return certs;
}

absl::Time ToTime(const ASN1_TIME* t) {
  std::tm tm{};
  if (ASN1_TIME_to_tm(t, &tm) != 1) return absl::InfinitePast();
  return absl::FromTimeT(timegm(&tm));
}

std::string SpiffeIdOf(X509* cert) {
  auto* names = static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr));
  if (names == nullptr) return "";
  std::string id;
  for (int i = 0; i < sk_GENERAL_NAME_num(names); ++i) {
    const GENERAL_NAME* name = sk_GENERAL_NAME_value(names, i);
    if (name->type != GEN_URI) continue;
    const ASN1_IA5STRING* uri = name->d.uniformResourceIdentifier;
    std::string value(reinterpret_cast<const char*>(ASN1_STRING_get0_data(uri)), ASN1_STRING_length(uri));
    if (absl::StartsWith(value, "spiffe://")) {
      id = std::move(value);
      break;
    }
  }
  GENERAL_NAMES_free(names);
  return id;
}

}  // namespace

absl::string_view RoleName(Role role) {
  switch (role) {
    case Role::kCoordinator: return "coordinator";
    case Role::kServer: return "server";
    case Role::kWorker: return "worker";
    case Role::kUnknown: break;
  }
  return "unknown";
}

Role RoleOfSpiffeId(absl::string_view id, std::string* name) {
  if (!absl::StartsWith(id, kSpiffePrefix)) return Role::kUnknown;
  id.remove_prefix(kSpiffePrefix.size());
  const size_t slash = id.find('/');
  const absl::string_view role = id.substr(0, slash);
  if (name != nullptr) *name = slash == absl::string_view::npos ? "" : std::string(id.substr(slash + 1));
  for (Role r : {Role::kCoordinator, Role::kServer, Role::kWorker}) {
    if (role == RoleName(r)) return r;
  }
  return Role::kUnknown;
}

absl::StatusOr<Identity> LoadIdentity(const TlsFiles& files) {
  auto ca_pem = ReadFileToString(files.ca_file, "CA certificate");
  if (!ca_pem.ok()) return ca_pem.status();
  auto cert_pem = ReadFileToString(files.cert_file, "certificate");
  if (!cert_pem.ok()) return cert_pem.status();
  auto key_pem = ReadFileToString(files.key_file, "private key");
  if (!key_pem.ok()) return key_pem.status();

  auto cas = ParseCerts(*ca_pem, files.ca_file, "CA certificate");
  if (!cas.ok()) return cas.status();
  auto chain = ParseCerts(*cert_pem, files.cert_file, "certificate");
  if (!chain.ok()) return chain.status();
  BioPtr key_bio(BIO_new_mem_buf(key_pem->data(), static_cast<int>(key_pem->size())));
  KeyPtr key(PEM_read_bio_PrivateKey(key_bio.get(), nullptr, nullptr, nullptr));
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("the private key file ", files.key_file, " holds no PEM private key: ", OpenSslError()));
  }
  X509* leaf = (*chain)[0].get();
  if (X509_check_private_key(leaf, key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat("the private key in ", files.key_file, " does not belong to the certificate in ", files.cert_file));
  }

  StorePtr store(X509_STORE_new());
  for (auto& ca : *cas) X509_STORE_add_cert(store.get(), ca.get());
  STACK_OF(X509)* untrusted = sk_X509_new_null();
  for (size_t i = 1; i < chain->size(); ++i) sk_X509_push(untrusted, (*chain)[i].get());
  StoreCtxPtr ctx(X509_STORE_CTX_new());
  X509_STORE_CTX_init(ctx.get(), store.get(), leaf, untrusted);
  const int verified = X509_verify_cert(ctx.get());
  const int error = X509_STORE_CTX_get_error(ctx.get());
  sk_X509_free(untrusted);
  if (verified != 1) {
    return absl::InvalidArgumentError(absl::StrCat("the certificate in ", files.cert_file,
                                                   " does not verify against the CA in ", files.ca_file, ": ",
                                                   X509_verify_cert_error_string(error)));
  }

  Identity id;
  id.spiffe_id = SpiffeIdOf(leaf);
  id.role = RoleOfSpiffeId(id.spiffe_id, &id.name);
  char subject[512];
  X509_NAME_oneline(X509_get_subject_name(leaf), subject, sizeof(subject));
  id.subject = subject;
  id.not_after = ToTime(X509_get0_notAfter(leaf));
  return id;
}

std::shared_ptr<const Transport> Transport::Plaintext() {
  static const auto* const plaintext = new std::shared_ptr<const Transport>(new Transport());
  return *plaintext;
}

absl::StatusOr<std::shared_ptr<const Transport>> Transport::Member(const TlsFiles& files, absl::Duration refresh,
                                                                   Identity* identity) {
  auto id = LoadIdentity(files);
  if (!id.ok()) return id.status();
  const auto seconds = static_cast<unsigned>(std::max<int64_t>(1, absl::ToInt64Seconds(refresh)));
  std::shared_ptr<Transport> t(new Transport());
  t->files_ = files;
  t->provider_ = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files.key_file, files.cert_file, files.ca_file, seconds);
  if (identity != nullptr) *identity = *std::move(id);
  return std::shared_ptr<const Transport>(std::move(t));
}

absl::StatusOr<std::shared_ptr<const Transport>> Transport::Client(const std::string& ca_file) {
  grpc::SslCredentialsOptions options;
  if (!ca_file.empty()) {
    auto pem = ReadFileToString(ca_file, "CA certificate");
    if (!pem.ok()) return pem.status();
    if (auto certs = ParseCerts(*pem, ca_file, "CA certificate"); !certs.ok()) return certs.status();
    options.pem_root_certs = *std::move(pem);
  }
  std::shared_ptr<Transport> t(new Transport());
  t->client_ = grpc::SslCredentials(options);
  return std::shared_ptr<const Transport>(std::move(t));
}

std::shared_ptr<grpc::ChannelCredentials> Transport::ChannelCredentials() const {
  if (client_ != nullptr) return client_;
  if (provider_ == nullptr) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider_);
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  if (!files_.crl_dir.empty()) options.set_crl_directory(files_.crl_dir);
  return grpc::experimental::TlsCredentials(options);
}

std::shared_ptr<grpc::ServerCredentials> Transport::ServerCredentials(ClientCerts client_certs) const {
  if (client_ != nullptr) return nullptr;  // client-only TLS has no identity to serve with
  if (provider_ == nullptr) return grpc::InsecureServerCredentials();
  grpc::experimental::TlsServerCredentialsOptions options(provider_);
  options.watch_root_certs();
  options.watch_identity_key_cert_pairs();
  options.set_cert_request_type(client_certs == ClientCerts::kRequired
                                    ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                                    : GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  if (!files_.crl_dir.empty()) options.set_crl_directory(files_.crl_dir);
  return grpc::experimental::TlsServerCredentials(options);
}

Peer PeerOf(const grpc::ServerContextBase& ctx) {
  auto auth = ctx.auth_context();
  if (auth == nullptr) return Peer();
  return PeerOf(*auth);
}

Peer PeerOf(const grpc::AuthContext& auth) {
  Peer peer;
  // A certificate's identity properties exist only once it verified against
  // our CA (both cert request types above verify what is sent).
  for (const char* property : {GRPC_PEER_SPIFFE_ID_PROPERTY_NAME, GRPC_PEER_URI_PROPERTY_NAME,
                               GRPC_X509_SAN_PROPERTY_NAME}) {
    for (const grpc::string_ref& v : auth.FindPropertyValues(property)) {
      std::string value(v.data(), v.size());
      if (!absl::StartsWith(value, "spiffe://")) continue;
      peer.spiffe_id = std::move(value);
      break;
    }
    if (!peer.spiffe_id.empty()) break;
  }
  peer.verified = !auth.FindPropertyValues(GRPC_X509_PEM_CERT_PROPERTY_NAME).empty();
  if (peer.verified) peer.role = RoleOfSpiffeId(peer.spiffe_id, &peer.name);
  return peer;
}

std::string Transport::CallerId(const grpc::ServerContextBase& ctx) const {
  return tls() ? PeerOf(ctx).spiffe_id : std::string();
}

absl::Status Transport::RequireRole(const grpc::ServerContextBase& ctx, std::initializer_list<Role> roles,
                                    absl::string_view what) const {
  if (!tls()) return absl::OkStatus();
  const Peer peer = PeerOf(ctx);
  std::vector<absl::string_view> names;
  for (Role r : roles) {
    if (peer.role == r) return absl::OkStatus();
    names.push_back(RoleName(r));
  }
  if (!peer.verified) {
    return absl::UnauthenticatedError(absl::StrCat(what, " needs a cluster certificate (", absl::StrJoin(names, " or "),
                                                   "); the caller presented none"));
  }
  return absl::PermissionDeniedError(absl::StrCat(
      what, " is for cluster members with a ", absl::StrJoin(names, " or "), " certificate; the caller's is ",
      peer.spiffe_id.empty() ? std::string("a certificate without a Fulcrum SPIFFE ID") : peer.spiffe_id));
}

}  // namespace fulcrum::security
