// A cluster's certificates and tokens for tests, made by
// deploy/tls/gen-certs.sh as an operator would, and the transports built
// from them.
#ifndef FULCRUM_TESTS_TESTING_PKI_H_
#define FULCRUM_TESTS_TESTING_PKI_H_

#include <sys/wait.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <grpcpp/grpcpp.h>

#include "absl/strings/ascii.h"
#include "common/rpc/grpc_util.h"
#include "common/rpc/security.h"
#include "fulcrum/v1/ps.grpc.pb.h"
#include "tests/testing/process_util.h"
#include "tests/testing/source_dir.h"
#include "tests/testing/test_util.h"

namespace fulcrum::testing {

// Runs deploy/tls/gen-certs.sh DIR ARGS...
inline void GenCerts(const std::string& dir, std::vector<std::string> args = {}) {
  std::vector<std::string> argv = {SourceDir() + "/deploy/tls/gen-certs.sh", dir};
  argv.insert(argv.end(), args.begin(), args.end());
  const auto p = Spawn(argv, dir + ".log");
  int status = 0;
  REQUIRE(waitpid(p.pid, &status, 0) == p.pid);
  INFO(ReadFile(dir + ".log"));
  REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
}

inline security::TlsFiles Files(const std::string& dir, const std::string& name) {
  return {dir + "/ca.crt", dir + "/" + name + ".crt", dir + "/" + name + ".key", ""};
}

// A user's token file as gen-certs.sh writes it: the token alone, with no
// newline (grpcio refuses a metadata value that ends in one).
inline std::string Token(const std::string& dir, const std::string& user) {
  const std::string raw = ReadFile(dir + "/token-" + user);
  REQUIRE(raw.size() == 64);
  REQUIRE(std::string(absl::StripAsciiWhitespace(raw)) == raw);
  return raw;
}

// One CA ("a") with a coordinator, two servers and two workers, and an
// unrelated CA ("b") with the same names, made once per test binary.
struct Pki {
  std::string root = MakeTempDir("fulcrum-security");
  std::string a = root + "/a", b = root + "/b";
  Pki() {
    GenCerts(a, {"--servers", "2", "--workers", "2", "--user", "demo", "--user", "bob"});
    GenCerts(b, {"--servers", "1", "--workers", "1"});
  }
};
inline Pki& Certs() {
  static Pki* pki = new Pki();
  return *pki;
}

// A member's mutual TLS from `dir`'s certificate for `name`.
inline std::shared_ptr<const security::Transport> MemberTls(const std::string& dir, const std::string& name,
                                                            absl::Duration refresh = absl::Seconds(60)) {
  auto t = security::Transport::Member(Files(dir, name), refresh);
  REQUIRE(t.ok());
  return *std::move(t);
}
// A user's TLS: the server checked against the CA in `dir`, no certificate.
inline std::shared_ptr<const security::Transport> UserTls(const std::string& dir) {
  auto t = security::Transport::Client(dir + "/ca.crt");
  REQUIRE(t.ok());
  return *std::move(t);
}

// A unary call on the parameter service over `transport`; `server_cert`
// receives the PEM certificate the server showed.
template <typename Req, typename Resp>
absl::Status PsCall(const security::Transport& transport, const std::string& address, int index,
                    grpc::Status (v1::ParameterService::Stub::*method)(grpc::ClientContext*, const Req&, Resp*),
                    const Req& req, std::string* server_cert = nullptr) {
  auto stub = v1::ParameterService::NewStub(CreateFulcrumChannel(address, index, transport));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  Resp resp;
  const grpc::Status s = ((*stub).*method)(&ctx, req, &resp);
  if (server_cert != nullptr && ctx.auth_context() != nullptr) {
    for (const auto& v : ctx.auth_context()->FindPropertyValues("x509_pem_cert")) server_cert->assign(v.data(), v.size());
  }
  return FromGrpcStatus(s);
}

}  // namespace fulcrum::testing

#endif  // FULCRUM_TESTS_TESTING_PKI_H_
