// Transport security and authorization, in one process over 127.0.0.1 with
// certificates made by deploy/tls/gen-certs.sh: certificate checks at
// startup, mutual TLS on the parameter service (who may connect, which role
// may call what, certificate rotation), bearer tokens and per-user job
// visibility on the coordinator, and the per-user job limit.
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include <grpcpp/grpcpp.h>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/config/spec_text.h"
#include "common/rpc/grpc_util.h"
#include "common/rpc/security.h"
#include "fulcrum/v1/cluster.grpc.pb.h"
#include "fulcrum/v1/ps.grpc.pb.h"
#include "server/coordinator/rpc/auth.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/rpc/grpc_server_control.h"
#include "server/coordinator/rpc/coordinator_service.h"
#include "tests/testing/process_util.h"
#include "tests/testing/test_util.h"

namespace fulcrum {
namespace {

namespace fs = std::filesystem;
using security::Role;
using security::TlsFiles;

// Runs deploy/tls/gen-certs.sh DIR ARGS...
void GenCerts(const std::string& dir, std::vector<std::string> args = {}) {
  std::vector<std::string> argv = {std::string(FULCRUM_SOURCE_DIR) + "/deploy/tls/gen-certs.sh", dir};
  argv.insert(argv.end(), args.begin(), args.end());
  const auto p = testing::Spawn(argv, dir + ".log");
  int status = 0;
  REQUIRE(waitpid(p.pid, &status, 0) == p.pid);
  INFO(testing::ReadFile(dir + ".log"));
  REQUIRE((WIFEXITED(status) && WEXITSTATUS(status) == 0));
}

TlsFiles Files(const std::string& dir, const std::string& name) {
  return {dir + "/ca.crt", dir + "/" + name + ".crt", dir + "/" + name + ".key", ""};
}

// A user's token file as gen-certs.sh writes it: the token alone, with no
// newline (grpcio refuses a metadata value that ends in one).
std::string Token(const std::string& dir, const std::string& user) {
  const std::string raw = testing::ReadFile(dir + "/token-" + user);
  REQUIRE(raw.size() == 64);
  REQUIRE(std::string(absl::StripAsciiWhitespace(raw)) == raw);
  return raw;
}

// One CA ("a") with a coordinator, one server and one worker, and an
// unrelated CA ("b") with the same names, made once for every test here.
struct Pki {
  std::string root = testing::MakeTempDir("fulcrum-security");
  std::string a = root + "/a", b = root + "/b";
  Pki() {
    GenCerts(a, {"--servers", "1", "--workers", "1", "--user", "demo", "--user", "bob"});
    GenCerts(b, {"--servers", "1", "--workers", "1"});
  }
};
Pki& Certs() {
  static Pki* pki = new Pki();
  return *pki;
}

// A member's mutual TLS from `dir`'s certificate for `name`.
std::shared_ptr<const security::Transport> MemberTls(const std::string& dir, const std::string& name,
                                                     absl::Duration refresh = absl::Seconds(60)) {
  auto t = security::Transport::Member(Files(dir, name), refresh);
  REQUIRE_OK(t.status());
  return *std::move(t);
}
// A user's TLS: the server checked against the CA in `dir`, no certificate.
std::shared_ptr<const security::Transport> UserTls(const std::string& dir) {
  auto t = security::Transport::Client(dir + "/ca.crt");
  REQUIRE_OK(t.status());
  return *std::move(t);
}

TEST_CASE("LoadIdentity reads a member's SPIFFE role and names what is wrong with bad files", "[security]") {
  const Pki& pki = Certs();
  REQUIRE_OK_AND_ASSIGN(auto id, security::LoadIdentity(Files(pki.a, "server-0")));
  REQUIRE(id.role == Role::kServer);
  REQUIRE(id.name == "server-0");
  REQUIRE(id.spiffe_id == "spiffe://fulcrum/server/server-0");
  REQUIRE(id.not_after > absl::Now() + absl::Hours(24 * 300));
  REQUIRE_OK_AND_ASSIGN(auto w, security::LoadIdentity(Files(pki.a, "worker-0")));
  REQUIRE(w.role == Role::kWorker);

  TlsFiles mismatched = Files(pki.a, "server-0");
  mismatched.key_file = pki.a + "/worker-0.key";
  auto s = security::LoadIdentity(mismatched);
  REQUIRE(s.status().code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(s.status().message().find("does not belong to the certificate") != std::string::npos);

  TlsFiles other_ca = Files(pki.a, "server-0");
  other_ca.ca_file = pki.b + "/ca.crt";
  s = security::LoadIdentity(other_ca);
  REQUIRE(s.status().code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(s.status().message().find("does not verify against the CA in " + pki.b + "/ca.crt") != std::string::npos);

  TlsFiles missing = Files(pki.a, "server-7");
  s = security::LoadIdentity(missing);
  REQUIRE(s.status().code() == absl::StatusCode::kNotFound);
  REQUIRE(s.status().message().find(pki.a + "/server-7.crt") != std::string::npos);

  const std::string garbage = pki.root + "/garbage.crt";
  std::ofstream(garbage) << "-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n";
  TlsFiles bad = Files(pki.a, "server-0");
  bad.cert_file = garbage;
  s = security::LoadIdentity(bad);
  REQUIRE(s.status().message().find("holds no PEM certificate") != std::string::npos);

  std::string name;
  REQUIRE(security::RoleOfSpiffeId("spiffe://fulcrum/coordinator", &name) == Role::kCoordinator);
  REQUIRE(name.empty());
  REQUIRE(security::RoleOfSpiffeId("spiffe://fulcrum/worker/w/1", &name) == Role::kWorker);
  REQUIRE(name == "w/1");
  REQUIRE(security::RoleOfSpiffeId("spiffe://other/server/s", nullptr) == Role::kUnknown);
  REQUIRE(security::RoleOfSpiffeId("spiffe://fulcrum/admin/x", nullptr) == Role::kUnknown);
}

TEST_CASE("token files: errors name the line, tokens map to users, the admin group, changes are picked up",
          "[security]") {
  auto bad = ParseTokenFile("# users\n0123456789abcdef0123,alice,1\nshort,bob,2\n", "t.csv");
  REQUIRE(bad.status().code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(bad.status().message().find("t.csv:3: the token of user 'bob' is shorter than 16") != std::string::npos);
  bad = ParseTokenFile("0123456789abcdef0123,alice\n", "t.csv");
  REQUIRE(bad.status().message().find("t.csv:1: want token,user,uid") != std::string::npos);
  bad = ParseTokenFile("0123456789abcdef0123,alice,1\n0123456789abcdef0123,bob,2\n", "t.csv");
  REQUIRE(bad.status().message().find("same token as user 'alice'") != std::string::npos);
  bad = ParseTokenFile("0123456789abcdef0123,alice,1,\"a,b\n", "t.csv");
  REQUIRE(bad.status().message().find("unterminated quote") != std::string::npos);
  REQUIRE_OK_AND_ASSIGN(auto ok, ParseTokenFile("0123456789abcdef0123,alice,1,\"team, fulcrum:admins\"\n", "t.csv"));
  REQUIRE(ok.size() == 1);
  REQUIRE(ok[0].groups == std::vector<std::string>{"team", "fulcrum:admins"});

  const std::string path = testing::MakeTempDir("fulcrum-tokens") + "/tokens.csv";
  std::ofstream(path) << "aaaaaaaaaaaaaaaaaaaa,alice,1,\"fulcrum:admins\"\nbbbbbbbbbbbbbbbbbbbb,bob,2\n";
  REQUIRE_OK_AND_ASSIGN(auto auth, TokenAuthenticator::Open(path));
  REQUIRE_OK_AND_ASSIGN(Caller alice, auth->AuthenticateToken("aaaaaaaaaaaaaaaaaaaa"));
  REQUIRE(alice.user == "alice");
  REQUIRE(alice.admin);
  REQUIRE_OK_AND_ASSIGN(Caller bob, auth->AuthenticateToken("bbbbbbbbbbbbbbbbbbbb"));
  REQUIRE(bob.user == "bob");
  REQUIRE_FALSE(bob.admin);
  REQUIRE(auth->AuthenticateToken("bbbbbbbbbbbbbbbbbbbX").status().code() == absl::StatusCode::kUnauthenticated);
  REQUIRE(auth->AuthenticateToken("").status().code() == absl::StatusCode::kUnauthenticated);

  // Rotation: bob's token replaced; a broken file keeps the last good tokens.
  std::ofstream(path) << "aaaaaaaaaaaaaaaaaaaa,alice,1,\"fulcrum:admins\"\ncccccccccccccccccccc,bob,2\n";
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  REQUIRE(auth->AuthenticateToken("bbbbbbbbbbbbbbbbbbbb").status().code() == absl::StatusCode::kUnauthenticated);
  REQUIRE_OK_AND_ASSIGN(bob, auth->AuthenticateToken("cccccccccccccccccccc"));
  REQUIRE(bob.user == "bob");
  std::ofstream(path) << "broken\n";
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  REQUIRE(auth->AuthenticateToken("cccccccccccccccccccc").ok());

  REQUIRE(CheckJobAccess({"bob", false}, "j-1", "bob").ok());
  REQUIRE(CheckJobAccess({"alice", true}, "j-1", "bob").ok());
  const absl::Status denied = CheckJobAccess({"carol", false}, "j-1", "bob");
  REQUIRE(denied.code() == absl::StatusCode::kPermissionDenied);
  REQUIRE(denied.message().find("user 'carol' may act only on their own jobs") != std::string::npos);
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

TEST_CASE("mutual TLS on the parameter service: only cluster certificates connect, roles limit what they call, "
          "and renewed certificates are picked up",
          "[security][grpc]") {
  const Pki& pki = Certs();
  // A CA of this test's own, since it renews certificates.
  const std::string dir = testing::MakeTempDir("fulcrum-mtls") + "/pki";
  GenCerts(dir, {"--servers", "1", "--workers", "1"});
  testing::TestCluster::Options o;
  o.num_servers = 1;
  o.security = MemberTls(dir, "server-0", absl::Seconds(1));
  auto cluster = testing::TestCluster::Start(o);
  const std::string addr = cluster->address(0);
  int index = 1000;

  const v1::GetShardMapRequest get_map;
  // Plaintext, TLS without a client certificate, and a certificate of
  // another CA: the handshake fails, nothing reaches the service.
  REQUIRE(PsCall(*security::Transport::Plaintext(), addr, ++index, &v1::ParameterService::Stub::GetShardMap, get_map).code() ==
          absl::StatusCode::kUnavailable);
  REQUIRE(PsCall(*UserTls(dir), addr, ++index, &v1::ParameterService::Stub::GetShardMap, get_map).code() ==
          absl::StatusCode::kUnavailable);
  REQUIRE(PsCall(*MemberTls(pki.b, "worker-0"), addr, ++index, &v1::ParameterService::Stub::GetShardMap, get_map).code() ==
          absl::StatusCode::kUnavailable);

  // A worker's certificate: creates its job, pushes and pulls (the real
  // client, over mutual TLS), but cannot change shard maps, delete jobs or
  // read checkpoints.
  const auto worker = MemberTls(dir, "worker-0");
  std::string first_cert;
  REQUIRE_OK(PsCall(*worker, addr, ++index, &v1::ParameterService::Stub::GetShardMap, get_map, &first_cert));
  REQUIRE(first_cert.find("BEGIN CERTIFICATE") != std::string::npos);
  GrpcPsClientOptions client_options;
  client_options.security = worker;
  auto client = cluster->Client(0, client_options);
  REQUIRE_OK(client->CreateJob(testing::JobSpec("mtls", {testing::DenseTableSpec("w", 64)}, 1)));
  std::vector<float> g(64, 1.0f), w(64, 0.0f);
  PushBatch push;
  push.dense.push_back({"w", g.data(), g.size()});
  REQUIRE_OK(client->Push("mtls", push));
  REQUIRE_OK(client->Pull("mtls", {1, {{"w", w.data(), w.size()}}, {}}));
  REQUIRE(w[0] == -1.0f);  // SGD, learning rate 1

  v1::SetShardMapRequest set_map;
  *set_map.mutable_map() = cluster->shard_map();
  absl::Status s = PsCall(*worker, addr, ++index, &v1::ParameterService::Stub::SetShardMap, set_map);
  REQUIRE(s.code() == absl::StatusCode::kPermissionDenied);
  REQUIRE(s.message().find("ParameterService.SetShardMap is for cluster members with a coordinator or server "
                           "certificate; the caller's is spiffe://fulcrum/worker/worker-0") != std::string::npos);
  v1::DeleteJobRequest del;
  del.set_job_id("mtls");
  REQUIRE(PsCall(*worker, addr, ++index, &v1::ParameterService::Stub::DeleteJob, del).code() ==
          absl::StatusCode::kPermissionDenied);
  v1::ReadCheckpointRequest read;
  read.set_job_id("mtls");
  REQUIRE(PsCall(*worker, addr, ++index, &v1::ParameterService::Stub::ReadCheckpoint, read).code() ==
          absl::StatusCode::kPermissionDenied);
  REQUIRE(cluster->server(0)->GetJob("mtls").ok());  // still there

  // The coordinator's certificate may.
  REQUIRE_OK(PsCall(*MemberTls(dir, "coordinator"), addr, ++index, &v1::ParameterService::Stub::DeleteJob, del));
  REQUIRE_FALSE(cluster->server(0)->GetJob("mtls").ok());

  // Rotation: every member certificate issued again from the same CA. The
  // server re-reads its files (every second here) and shows the new one
  // on new connections, without a restart.
  GenCerts(dir, {"--servers", "1", "--workers", "1", "--renew"});
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  std::string second_cert;
  REQUIRE_OK(PsCall(*worker, addr, ++index, &v1::ParameterService::Stub::GetShardMap, get_map, &second_cert));
  REQUIRE(second_cert.find("BEGIN CERTIFICATE") != std::string::npos);
  REQUIRE(second_cert != first_cert);
  REQUIRE(second_cert == testing::ReadFile(dir + "/server-0.crt"));
}

v1::JobSpec DigitsSpec() {
  v1::JobSpec spec;
  REQUIRE_OK(config::ParseSpecFile(std::string(FULCRUM_SOURCE_DIR) + "/deploy/examples/digits-softmax.yaml", &spec));
  return spec;
}

class CoordinatorClient {
 public:
  CoordinatorClient(const security::Transport& transport, const std::string& address, std::string token)
      : token_(std::move(token)) {
    auto channel = CreateFulcrumChannel(address, next_index_++, transport);
    jobs_ = v1::JobService::NewStub(channel);
    cluster_ = v1::ClusterService::NewStub(channel);
  }
  template <typename Stub, typename Req, typename Resp>
  absl::Status Call(Stub* stub, grpc::Status (Stub::*method)(grpc::ClientContext*, const Req&, Resp*), const Req& req,
                    Resp* resp) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (!token_.empty()) ctx.AddMetadata("authorization", "Bearer " + token_);
    return FromGrpcStatus(((*stub).*method)(&ctx, req, resp));
  }
  absl::StatusOr<std::string> Submit(const v1::JobSpec& spec) {
    v1::SubmitJobRequest req;
    *req.mutable_spec() = spec;
    v1::SubmitJobResponse resp;
    absl::Status s = Call(jobs_.get(), &v1::JobService::Stub::SubmitJob, req, &resp);
    if (!s.ok()) return s;
    return resp.job_id();
  }
  absl::StatusOr<v1::Job> Get(const std::string& id) {
    v1::JobRef ref;
    ref.set_job_id(id);
    v1::Job j;
    absl::Status s = Call(jobs_.get(), &v1::JobService::Stub::GetJob, ref, &j);
    if (!s.ok()) return s;
    return j;
  }
  absl::Status Cancel(const std::string& id) {
    v1::JobRef ref;
    ref.set_job_id(id);
    v1::Job j;
    return Call(jobs_.get(), &v1::JobService::Stub::CancelJob, ref, &j);
  }
  // One page of the caller's jobs (page_size 0: the default); `token` is
  // set to the next page's token.
  absl::StatusOr<std::vector<std::string>> List(int page_size = 0, std::string* token = nullptr) {
    v1::ListJobsRequest req;
    req.set_page_size(page_size);
    if (token != nullptr) req.set_page_token(*token);
    v1::ListJobsResponse resp;
    absl::Status s = Call(jobs_.get(), &v1::JobService::Stub::ListJobs, req, &resp);
    if (!s.ok()) return s;
    std::vector<std::string> ids;
    for (const auto& j : resp.jobs()) ids.push_back(j.id());
    if (token != nullptr) *token = resp.next_page_token();
    return ids;
  }
  absl::Status Register(v1::NodeRole role) {
    v1::RegisterNodeRequest req;
    req.mutable_node()->set_role(role);
    req.mutable_node()->set_address("127.0.0.1:1");
    req.mutable_node()->set_hostname("test");
    req.mutable_node()->set_slots(1);
    v1::RegisterNodeResponse resp;
    return Call(cluster_.get(), &v1::ClusterService::Stub::RegisterNode, req, &resp);
  }
  absl::Status Cluster() {
    v1::ClusterState resp;
    return Call(cluster_.get(), &v1::ClusterService::Stub::GetCluster, v1::GetClusterRequest(), &resp);
  }
  // A WatchJob stream past its first event; the error it ended with otherwise.
  struct Watch {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReader<v1::JobEvent>> reader;
    bool finished = false;
    ~Watch() {
      if (finished) return;
      ctx.TryCancel();
      (void)reader->Finish();
    }
  };
  absl::StatusOr<std::unique_ptr<Watch>> OpenWatch(const std::string& id) {
    auto w = std::make_unique<Watch>();
    if (!token_.empty()) w->ctx.AddMetadata("authorization", "Bearer " + token_);
    v1::JobRef ref;
    ref.set_job_id(id);
    w->reader = jobs_->WatchJob(&w->ctx, ref);
    v1::JobEvent e;
    if (!w->reader->Read(&e)) {
      w->finished = true;
      return FromGrpcStatus(w->reader->Finish());
    }
    return w;
  }
  absl::Status Checkpoint(const std::string& id) {
    v1::JobRef ref;
    ref.set_job_id(id);
    v1::CheckpointInfo info;
    return Call(jobs_.get(), &v1::JobService::Stub::CheckpointJob, ref, &info);
  }
  // How an ExportCheckpoint stream of the job's latest cut ends.
  absl::Status Export(const std::string& id) {
    grpc::ClientContext ctx;
    if (!token_.empty()) ctx.AddMetadata("authorization", "Bearer " + token_);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ExportCheckpointRequest req;
    req.set_job_id(id);
    auto reader = jobs_->ExportCheckpoint(&ctx, req);
    v1::ExportCheckpointChunk chunk;
    while (reader->Read(&chunk)) {
    }
    return FromGrpcStatus(reader->Finish());
  }

 private:
  static inline int next_index_ = 2000;
  std::string token_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::ClusterService::Stub> cluster_;
};

// A coordinator with the test PKI's certificate and its users' bearer
// tokens, on a free port.
std::unique_ptr<CoordinatorGrpcServer> StartSecureCoordinator(const Pki& pki, const std::string& name,
                                                              const std::function<void(CoordinatorOptions&)>& tweak,
                                                              std::unique_ptr<Coordinator>* coordinator) {
  const auto transport = MemberTls(pki.a, "coordinator");
  CoordinatorOptions o;
  o.data_dir = testing::MakeTempDir(name);
  tweak(o);
  REQUIRE_OK_AND_ASSIGN(*coordinator, Coordinator::Open(o, NewGrpcServerControl(absl::Seconds(5), transport)));
  REQUIRE_OK_AND_ASSIGN(std::shared_ptr<TokenAuthenticator> tokens, TokenAuthenticator::Open(pki.a + "/tokens.csv"));
  REQUIRE_OK_AND_ASSIGN(auto server, CoordinatorGrpcServer::Start(coordinator->get(), "127.0.0.1:0", tokens, transport));
  return server;
}

TEST_CASE("the coordinator bounds each user's open WatchJob streams and CheckpointJob and ExportCheckpoint calls",
          "[security][grpc]") {
  const Pki& pki = Certs();
  std::unique_ptr<Coordinator> coordinator;
  auto server = StartSecureCoordinator(
      pki, "fulcrum-coord-long-calls", [](CoordinatorOptions& o) { o.max_long_calls_per_user = 3; }, &coordinator);
  const auto user = UserTls(pki.a);
  CoordinatorClient demo(*user, server->address(), Token(pki.a, "demo")),
      bob(*user, server->address(), Token(pki.a, "bob"));
  REQUIRE_OK_AND_ASSIGN(std::string id, demo.Submit(DigitsSpec()));  // stays pending: no server
  REQUIRE_OK_AND_ASSIGN(std::string bob_id, bob.Submit(DigitsSpec()));

  std::vector<std::unique_ptr<CoordinatorClient::Watch>> open;
  for (int i = 0; i < 3; ++i) {
    REQUIRE_OK_AND_ASSIGN(auto w, demo.OpenWatch(id));
    open.push_back(std::move(w));
  }
  absl::Status s = demo.OpenWatch(id).status();
  REQUIRE(s.code() == absl::StatusCode::kResourceExhausted);
  REQUIRE(s.message().find("user 'demo' has 3 WatchJob, CheckpointJob and ExportCheckpoint calls open, "
                           "the limit (--max_long_calls_per_user 3)") != std::string::npos);
  // A CheckpointJob and an ExportCheckpoint draw from the same count:
  // refused before they are asked whether the job runs or has a cut (they
  // would be FAILED_PRECONDITION and NOT_FOUND).
  REQUIRE(demo.Checkpoint(id).code() == absl::StatusCode::kResourceExhausted);
  s = demo.Export(id);
  REQUIRE(s.code() == absl::StatusCode::kResourceExhausted);
  REQUIRE(s.message().find("user 'demo' has 3 ") != std::string::npos);
  // Bob's count is his own.
  REQUIRE_OK_AND_ASSIGN(auto bobs, bob.OpenWatch(bob_id));
  REQUIRE(bob.Checkpoint(bob_id).code() == absl::StatusCode::kFailedPrecondition);
  s = bob.Export(bob_id);
  REQUIRE(s.code() == absl::StatusCode::kNotFound);
  REQUIRE(s.message().find("has no committed checkpoint") != std::string::npos);
  // A stream that ends gives its place back.
  open.pop_back();
  absl::StatusOr<std::unique_ptr<CoordinatorClient::Watch>> again;
  for (int tries = 0; tries < 500; ++tries) {
    again = demo.OpenWatch(id);
    if (again.ok()) break;
    REQUIRE(again.status().code() == absl::StatusCode::kResourceExhausted);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE_OK(again.status());
  open.clear();
  bobs.reset();
  again->reset();
  server->Shutdown();
}

TEST_CASE("the coordinator: bearer tokens on the job API, users see only their own jobs, member certificates on "
          "the cluster API, and a per-user job limit",
          "[security][grpc]") {
  const Pki& pki = Certs();
  std::unique_ptr<Coordinator> coordinator;
  auto server = StartSecureCoordinator(
      pki, "fulcrum-coord-auth", [](CoordinatorOptions& o) { o.max_active_jobs_per_user = 2; }, &coordinator);
  const std::string addr = server->address();

  // Users: TLS that checks the coordinator against the CA, no certificate.
  const auto user = UserTls(pki.a);
  CoordinatorClient nobody(*user, addr, ""), wrong(*user, addr, "f00f00f00f00f00f00f00f00"),
      demo(*user, addr, Token(pki.a, "demo")), bob(*user, addr, Token(pki.a, "bob")),
      admin(*user, addr, Token(pki.a, "admin"));
  absl::Status s = nobody.Submit(DigitsSpec()).status();
  REQUIRE(s.code() == absl::StatusCode::kUnauthenticated);
  REQUIRE(s.message().find("no credentials") != std::string::npos);
  REQUIRE(wrong.List().status().code() == absl::StatusCode::kUnauthenticated);
  REQUIRE(nobody.Cluster().code() == absl::StatusCode::kUnauthenticated);
  REQUIRE_OK(demo.Cluster());

  REQUIRE_OK_AND_ASSIGN(std::string id, demo.Submit(DigitsSpec()));
  REQUIRE_OK_AND_ASSIGN(v1::Job job, demo.Get(id));
  REQUIRE(job.owner() == "demo");
  REQUIRE(wrong.Get(id).status().code() == absl::StatusCode::kUnauthenticated);
  s = bob.Get(id).status();
  REQUIRE(s.code() == absl::StatusCode::kPermissionDenied);
  REQUIRE(s.message().find("user 'bob' may act only on their own jobs") != std::string::npos);
  REQUIRE(bob.Cancel(id).code() == absl::StatusCode::kPermissionDenied);
  REQUIRE(bob.Get("no-such-job").status().code() == absl::StatusCode::kNotFound);
  REQUIRE_OK_AND_ASSIGN(auto bobs, bob.List());
  REQUIRE(bobs.empty());
  REQUIRE_OK_AND_ASSIGN(auto demos, demo.List());
  REQUIRE(demos == std::vector<std::string>{id});
  REQUIRE_OK_AND_ASSIGN(std::string bob_id, bob.Submit(DigitsSpec()));
  REQUIRE_OK_AND_ASSIGN(auto all, admin.List());
  REQUIRE(all.size() == 2);
  REQUIRE_OK_AND_ASSIGN(v1::Job seen_by_admin, admin.Get(bob_id));
  REQUIRE(seen_by_admin.owner() == "bob");

  // The limit: demo's jobs wait for servers (none here), so they stay
  // pending; the third is refused, naming the limit; cancelling one frees
  // a place.
  REQUIRE_OK(demo.Submit(DigitsSpec()).status());
  s = demo.Submit(DigitsSpec()).status();
  REQUIRE(s.code() == absl::StatusCode::kResourceExhausted);
  REQUIRE(s.message().find("user 'demo' has 2 jobs pending or running; the limit is 2") != std::string::npos);
  REQUIRE_OK(bob.Submit(DigitsSpec()).status());  // bob's count is his own
  REQUIRE_OK(demo.Cancel(id));
  REQUIRE_OK(demo.Submit(DigitsSpec()).status());
  // Pages hold only the caller's jobs: bob's 2 come one per page though
  // demo's lie between them; demo's 3 come 2 and 1.
  std::string token;
  REQUIRE_OK_AND_ASSIGN(auto page, bob.List(1, &token));
  REQUIRE(page == std::vector<std::string>{bob_id});
  REQUIRE(!token.empty());
  REQUIRE_OK_AND_ASSIGN(page, bob.List(1, &token));
  REQUIRE(page.size() == 1);
  REQUIRE(page[0] != bob_id);
  REQUIRE(token.empty());
  token.clear();
  REQUIRE_OK_AND_ASSIGN(page, demo.List(2, &token));
  REQUIRE(page.size() == 2);
  REQUIRE(page[0] == id);
  REQUIRE_OK_AND_ASSIGN(page, demo.List(2, &token));
  REQUIRE(page.size() == 1);
  REQUIRE(token.empty());

  // The cluster API: a certificate of the right role. Users cannot register
  // nodes; a worker's certificate cannot join as a server.
  s = demo.Register(v1::WORKER);
  REQUIRE(s.code() == absl::StatusCode::kUnauthenticated);
  REQUIRE(s.message().find("needs a cluster certificate (worker)") != std::string::npos);
  CoordinatorClient worker(*MemberTls(pki.a, "worker-0"), addr, "");
  s = worker.Register(v1::SERVER);
  REQUIRE(s.code() == absl::StatusCode::kPermissionDenied);
  REQUIRE(s.message().find("spiffe://fulcrum/worker/worker-0") != std::string::npos);
  REQUIRE_OK(worker.Register(v1::WORKER));
  REQUIRE_OK(worker.Cluster());  // members see the cluster without a token
  REQUIRE(worker.List().status().code() == absl::StatusCode::kUnauthenticated);  // but not the jobs
  server->Shutdown();
}

}  // namespace
}  // namespace fulcrum
