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
#include "tests/testing/pki.h"
#include "tests/testing/process_util.h"
#include "tests/testing/test_util.h"

namespace fulcrum {
namespace {

namespace fs = std::filesystem;
using security::Role;
using security::TlsFiles;

using testing::Certs;
using testing::Files;
using testing::GenCerts;
using testing::MemberTls;
using testing::Pki;
using testing::PsCall;
using testing::Token;
using testing::UserTls;

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
  // Outside input is echoed cut to 64 bytes (docs/security.md, "Limits").
  s = bob.Get(std::string(20000, 'j')).status();
  REQUIRE(s.code() == absl::StatusCode::kNotFound);
  REQUIRE(s.message() == "no job '" + std::string(64, 'j') + "' (cut: 20000 bytes)");
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

namespace fulcrum {
namespace {

// The cluster API as one member's certificate calls it.
class Member {
 public:
  Member(const std::string& address, const std::string& name)
      : stub_(v1::ClusterService::NewStub(CreateFulcrumChannel(address, next_index_++, *MemberTls(Certs().a, name)))) {}
  absl::StatusOr<std::string> Register(v1::NodeInfo node) {
    v1::RegisterNodeRequest req;
    *req.mutable_node() = std::move(node);
    v1::RegisterNodeResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    absl::Status s = FromGrpcStatus(stub_->RegisterNode(&ctx, req, &resp));
    if (!s.ok()) return s;
    return resp.node_id();
  }
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const std::string& node_id, bool leaving = false) {
    v1::HeartbeatRequest req;
    req.set_node_id(node_id);
    req.set_leaving(leaving);
    v1::HeartbeatResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    absl::Status s = FromGrpcStatus(stub_->Heartbeat(&ctx, req, &resp));
    if (!s.ok()) return s;
    return resp;
  }
  absl::StatusOr<v1::ReportProgressResponse> Report(const v1::ReportProgressRequest& req) {
    v1::ReportProgressResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    absl::Status s = FromGrpcStatus(stub_->ReportProgress(&ctx, req, &resp));
    if (!s.ok()) return s;
    return resp;
  }
  absl::StatusOr<v1::ClusterState> Cluster() {
    v1::ClusterState resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    absl::Status s = FromGrpcStatus(stub_->GetCluster(&ctx, v1::GetClusterRequest(), &resp));
    if (!s.ok()) return s;
    return resp;
  }

 private:
  static inline int next_index_ = 3000;
  std::unique_ptr<v1::ClusterService::Stub> stub_;
};

v1::NodeInfo Node(v1::NodeRole role, const std::string& address = "", const std::string& node_id = "") {
  v1::NodeInfo n;
  n.set_role(role);
  n.set_address(address);
  n.set_node_id(node_id);
  n.set_hostname("test");
  n.set_slots(1);
  return n;
}

const v1::NodeStatus* FindNode(const v1::ClusterState& state, const std::string& id) {
  for (const v1::NodeStatus& n : state.nodes()) {
    if (n.info().node_id() == id) return &n;
  }
  return nullptr;
}

TEST_CASE("the cluster API: a certificate registers, heartbeats, leaves and reports only as the node it "
          "registered, in its role, and only for that node's ranks",
          "[security][grpc]") {
  const Pki& pki = Certs();
  // A real parameter server (server-0's certificate) for the coordinator to
  // install its shard map on.
  testing::TestCluster::Options po;
  po.num_servers = 1;
  po.security = MemberTls(pki.a, "server-0");
  auto servers = testing::TestCluster::Start(po);
  std::unique_ptr<Coordinator> coordinator;
  auto grpc_server = StartSecureCoordinator(
      pki, "fulcrum-coord-identity", [](CoordinatorOptions& o) { o.node_timeout = absl::Seconds(60); },
      &coordinator);
  const std::string addr = grpc_server->address();
  Member server0(addr, "server-0"), server1(addr, "server-1"), worker0(addr, "worker-0"), worker1(addr, "worker-1");

  REQUIRE_OK_AND_ASSIGN(const std::string s0, server0.Register(Node(v1::SERVER, servers->address(0))));
  REQUIRE_OK_AND_ASSIGN(const std::string w0, worker0.Register(Node(v1::WORKER)));
  CoordinatorClient demo(*UserTls(pki.a), addr, Token(pki.a, "demo"));
  v1::JobSpec spec = DigitsSpec();
  spec.set_num_workers(1);
  REQUIRE_OK_AND_ASSIGN(const std::string job_id, demo.Submit(spec));
  v1::Job job;
  for (int i = 0; i < 100; ++i) {
    REQUIRE_OK_AND_ASSIGN(job, demo.Get(job_id));
    if (job.status().state() == v1::RUNNING) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  INFO(job.status().message());
  REQUIRE(job.status().state() == v1::RUNNING);
  REQUIRE(job.status().workers(0).worker_id() == w0);
  // worker-1 joins too, with a node of its own.
  REQUIRE_OK_AND_ASSIGN(const std::string w1, worker1.Register(Node(v1::WORKER)));
  REQUIRE(w1 != w0);

  // RegisterNode. Under another node's id: a node of its own, not that one.
  REQUIRE_OK_AND_ASSIGN(const std::string taken, worker1.Register(Node(v1::WORKER, "", w0)));
  CHECK(taken != w0);
  // At a live server's address, with another server's certificate: refused
  // (it would push server-0 out of the shard map).
  REQUIRE_STATUS(server1.Register(Node(v1::SERVER, servers->address(0))).status(), absl::StatusCode::kPermissionDenied,
                 absl::StrCat("address ", servers->address(0), " belongs to live server ", s0));
  // In another role (a worker's certificate as a server), an unknown role,
  // an oversized string.
  REQUIRE_STATUS(worker1.Register(Node(v1::SERVER, "127.0.0.1:9")).status(), absl::StatusCode::kPermissionDenied,
                 "spiffe://fulcrum/worker/worker-1");
  REQUIRE_STATUS(worker1.Register(Node(static_cast<v1::NodeRole>(99))).status(), absl::StatusCode::kInvalidArgument,
                 "register: role must be SERVER or WORKER; got 99");
  v1::NodeInfo long_job = Node(v1::WORKER);
  long_job.set_job_id(std::string(20000, 'j'));
  REQUIRE_STATUS(worker1.Register(long_job).status(), absl::StatusCode::kInvalidArgument,
                 "register: job_id is 20000 bytes; at most 256 allowed");

  // Heartbeat. As another node: refused, with nothing of that node's (its
  // assignment carries the job's spec).
  REQUIRE_STATUS(worker1.Heartbeat(w0).status(), absl::StatusCode::kPermissionDenied,
                 absl::StrCat("heartbeat as node '", w0,
                              "', which registered with certificate spiffe://fulcrum/worker/worker-0; the caller's is "
                              "spiffe://fulcrum/worker/worker-1"));
  REQUIRE_STATUS(server1.Heartbeat(w0).status(), absl::StatusCode::kPermissionDenied,
                 "the caller's is spiffe://fulcrum/server/server-1");  // another role
  // Leaving as another node: refused, and that node stays.
  REQUIRE_STATUS(worker1.Heartbeat(s0, /*leaving=*/true).status(), absl::StatusCode::kPermissionDenied,
                 absl::StrCat("heartbeat as node '", s0, "'"));
  REQUIRE_STATUS(server1.Heartbeat(s0, /*leaving=*/true).status(), absl::StatusCode::kPermissionDenied,
                 "spiffe://fulcrum/server/server-0");
  // As itself: its assignment, and for the server the rank's owner.
  REQUIRE_OK_AND_ASSIGN(v1::HeartbeatResponse mine, worker0.Heartbeat(w0));
  REQUIRE(mine.assignments_size() == 1);
  CHECK(mine.assignments(0).job_id() == job_id);
  REQUIRE_OK_AND_ASSIGN(v1::HeartbeatResponse admitted, server0.Heartbeat(s0));
  REQUIRE(admitted.admitted_jobs_size() == 1);
  REQUIRE(admitted.admitted_jobs(0).ranks_size() == 1);
  CHECK(admitted.admitted_jobs(0).ranks(0).node_id() == w0);
  CHECK(admitted.admitted_jobs(0).ranks(0).certificate() == "spiffe://fulcrum/worker/worker-0");

  // ReportProgress. A failure reported for worker-0's rank by another
  // certificate is refused; by worker-1 as itself it is not its rank: stop.
  v1::ReportProgressRequest fail;
  fail.set_node_id(w0);
  fail.set_job_id(job_id);
  fail.set_rank(0);
  fail.set_incarnation(job.status().workers(0).incarnation());
  fail.set_error("injected by another certificate");
  fail.set_error_reason("BadData");
  REQUIRE_STATUS(worker1.Report(fail).status(), absl::StatusCode::kPermissionDenied,
                 "progress report as node '" + w0 + "'");
  REQUIRE_STATUS(server0.Report(fail).status(), absl::StatusCode::kPermissionDenied,
                 "ReportProgress is for cluster members with a worker certificate");
  fail.set_node_id(w1);
  REQUIRE_OK_AND_ASSIGN(v1::ReportProgressResponse not_yours, worker1.Report(fail));
  CHECK(not_yours.stop());

  // None of it touched the job or the cluster: still running on worker-0
  // over server-0, which is alive.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // a few scheduler ticks
  REQUIRE_OK_AND_ASSIGN(job, demo.Get(job_id));
  CHECK(job.status().state() == v1::RUNNING);
  CHECK(job.status().restarts() == 0);
  CHECK(job.status().workers(0).worker_id() == w0);
  REQUIRE_OK_AND_ASSIGN(v1::ClusterState cluster, worker0.Cluster());
  REQUIRE(FindNode(cluster, s0) != nullptr);
  CHECK(FindNode(cluster, s0)->alive());
  CHECK(FindNode(cluster, s0)->info().certificate() == "spiffe://fulcrum/server/server-0");
  CHECK(FindNode(cluster, w0)->info().certificate() == "spiffe://fulcrum/worker/worker-0");

  // The owner's own report is taken.
  v1::ReportProgressRequest progress;
  progress.set_node_id(w0);
  progress.set_job_id(job_id);
  progress.set_rank(0);
  progress.set_incarnation(job.status().workers(0).incarnation());
  progress.mutable_progress()->set_state("training");
  REQUIRE_OK_AND_ASSIGN(v1::ReportProgressResponse taken_report, worker0.Report(progress));
  CHECK_FALSE(taken_report.stop());
  grpc_server->Shutdown();
}

// A job admitted on `cluster`'s server with rank 0 on worker-0's node
// (incarnation 1) and rank 1 waiting for a worker.
void AdmitWithOwners(testing::TestCluster& cluster, const std::string& job_id, uint64_t quota) {
  v1::AdmittedJob j;
  j.set_job_id(job_id);
  j.set_quota_bytes(quota);
  v1::RankOwner* r0 = j.add_ranks();
  r0->set_rank(0);
  r0->set_incarnation(1);
  r0->set_node_id("worker-7");
  r0->set_certificate("spiffe://fulcrum/worker/worker-0");
  v1::RankOwner* r1 = j.add_ranks();
  r1->set_rank(1);
  r1->set_incarnation(1);
  cluster.server(0)->SetAdmittedJobs({j}, absl::Now());
}

TEST_CASE("the parameter service: with a coordinator, a certificate pushes and pulls only as the ranks given to "
          "its node, over unary calls, streams and shared memory",
          "[security][grpc]") {
  const Pki& pki = Certs();
  testing::TestCluster::Options o;
  o.num_servers = 1;
  o.security = MemberTls(pki.a, "server-0");
  o.require_admission = true;
  auto cluster = testing::TestCluster::Start(o);
  const auto spec = testing::JobSpec("owned", {testing::DenseTableSpec("w", 64)}, 2);
  AdmitWithOwners(*cluster, "owned", spec.quota_bytes());

  struct Path {
    const char* name;
    GrpcPsClientOptions::Transport transport;
    bool shared_memory;
  };
  const Path paths[] = {{"unary", GrpcPsClientOptions::Transport::kUnary, false},
                        {"stream", GrpcPsClientOptions::Transport::kStream, false},
                        {"shared memory", GrpcPsClientOptions::Transport::kStream, true}};
  for (const Path& path : paths) {
    INFO(path.name);
    auto make = [&](const std::string& cert, uint32_t rank, uint32_t incarnation) {
      GrpcPsClientOptions c;
      c.security = MemberTls(pki.a, cert);
      c.transport = path.transport;
      c.shared_memory = path.shared_memory;
      c.incarnation = incarnation;
      c.retry_budget = absl::Milliseconds(300);
      return cluster->Client(rank, c);
    };
    auto client = [&](const std::string& cert, uint32_t rank, uint32_t incarnation) {
      auto c = make(cert, rank, incarnation);
      REQUIRE_OK(c->OpenJob("owned"));
      return c;
    };
    std::vector<float> g(64, 1.0f), w(64, 0.0f);
    PushBatch push;
    push.dense.push_back({"w", g.data(), g.size()});
    auto push_and_pull = [&](PsClient& c) -> absl::Status {
      absl::Status s = c.Push("owned", push);
      if (!s.ok()) return s;
      return c.Pull("owned", {0, {{"w", w.data(), w.size()}}, {}, /*unclocked=*/false});
    };
    auto owner = make("worker-0", 0, 1);
    REQUIRE_OK(owner->CreateJob(spec));  // any member may (the job is admitted)
    // Another worker's certificate, and a server's, as rank 0: refused.
    REQUIRE_STATUS(client("worker-1", 0, 1)->Push("owned", push), absl::StatusCode::kPermissionDenied,
                   "push as rank 0 (incarnation 1) of job 'owned' with certificate spiffe://fulcrum/worker/worker-1: "
                   "the rank belongs to node worker-7, whose certificate is spiffe://fulcrum/worker/worker-0");
    REQUIRE_STATUS(client("server-1", 0, 1)->Push("owned", push), absl::StatusCode::kPermissionDenied,
                   "with certificate spiffe://fulcrum/server/server-1");
    REQUIRE_STATUS(client("worker-1", 0, 1)->Pull("owned", {0, {{"w", w.data(), w.size()}}, {}, false}),
                   absl::StatusCode::kPermissionDenied, "pull as rank 0");
    // The owner's certificate, in another incarnation: one the server has
    // not heard of (retried, then UNAVAILABLE), one the rank has left.
    REQUIRE_STATUS(client("worker-0", 0, 2)->Push("owned", push), absl::StatusCode::kUnavailable,
                   "this server knows the rank up to incarnation 1");
    REQUIRE_STATUS(client("worker-0", 0, 0)->Push("owned", push), absl::StatusCode::kFailedPrecondition,
                   "the rank moved on to incarnation 1 on node worker-7");
    // A rank with no worker now.
    REQUIRE_STATUS(client("worker-0", 1, 1)->Push("owned", push), absl::StatusCode::kFailedPrecondition,
                   "the rank has no worker now");
    // Nothing of those reached the table: the owner's own step is the first.
    REQUIRE_OK(cluster->server(0)->GetJob("owned").status());
    REQUIRE_OK(push_and_pull(*owner));
    CHECK(cluster->server(0)->GetJob("owned")->rank_clock(0) == 1);
    // The job ended (the coordinator lists it no more) and its tables wait
    // for their release: no rank may touch them, its owner neither.
    cluster->server(0)->SetAdmittedJobs({}, absl::Now());
    REQUIRE_STATUS(owner->Push("owned", push), absl::StatusCode::kUnavailable,
                   "the coordinator does not list the job as running on this server");
    REQUIRE_STATUS(client("worker-1", 0, 1)->Pull("owned", {1, {{"w", w.data(), w.size()}}, {}, false}),
                   absl::StatusCode::kUnavailable, "does not list the job as running");
    CHECK(cluster->server(0)->GetJob("owned")->rank_clock(0) == 1);
    REQUIRE_OK(cluster->server(0)->DeleteJob("owned").status());
    AdmitWithOwners(*cluster, "owned", spec.quota_bytes());
  }

  // The parameter service's other calls, by role: the control calls refuse
  // a worker's certificate (the rank's owner's too); the read-only ones and
  // CreateJob (of an admitted job) take any member's.
  GrpcPsClientOptions creator;
  creator.security = MemberTls(pki.a, "worker-0");
  REQUIRE_OK(cluster->Client(0, creator)->CreateJob(spec));
  const std::string addr = cluster->address(0);
  int index = 4000;
  for (const char* cert : {"worker-0", "worker-1"}) {
    INFO(cert);
    const auto worker = MemberTls(pki.a, cert);
    v1::CheckpointRequest cut;
    cut.set_job_id("owned");
    cut.set_cut_id(1);
    v1::RestoreRequest restore;
    restore.set_job_id("owned");
    restore.set_cut_id(1);
    v1::ListCheckpointsRequest list;
    list.set_job_id("owned");
    v1::DeleteCheckpointRequest delete_cut;
    delete_cut.set_job_id("owned");
    delete_cut.set_cut_id(1);
    v1::SetShardMapRequest set_map;
    *set_map.mutable_map() = cluster->shard_map();
    v1::DeleteJobRequest delete_job;
    delete_job.set_job_id("owned");
    v1::ReadCheckpointRequest read;
    read.set_job_id("owned");
    const absl::StatusCode denied = absl::StatusCode::kPermissionDenied;
    CHECK(PsCall(*worker, addr, ++index, &v1::ParameterService::Stub::Checkpoint, cut).code() == denied);
    CHECK(PsCall(*worker, addr, ++index, &v1::ParameterService::Stub::Restore, restore).code() == denied);
    CHECK(PsCall(*worker, addr, ++index, &v1::ParameterService::Stub::ListCheckpoints, list).code() == denied);
    CHECK(PsCall(*worker, addr, ++index, &v1::ParameterService::Stub::DeleteCheckpoint, delete_cut).code() == denied);
    CHECK(PsCall(*worker, addr, ++index, &v1::ParameterService::Stub::SetShardMap, set_map).code() == denied);
    CHECK(PsCall(*worker, addr, ++index, &v1::ParameterService::Stub::DeleteJob, delete_job).code() == denied);
    CHECK(PsCall(*worker, addr, ++index, &v1::ParameterService::Stub::ReadCheckpoint, read).code() == denied);
  }
  for (const char* cert : {"worker-1", "server-1", "coordinator"}) {
    INFO(cert);
    const auto member = MemberTls(pki.a, cert);
    v1::GetJobRequest get;
    get.set_job_id("owned");
    CHECK(PsCall(*member, addr, ++index, &v1::ParameterService::Stub::GetJob, get).ok());
    CHECK(PsCall(*member, addr, ++index, &v1::ParameterService::Stub::GetShardMap, v1::GetShardMapRequest()).ok());
  }
  REQUIRE_OK(cluster->server(0)->GetJob("owned").status());  // none of it touched the job
}

}  // namespace
}  // namespace fulcrum
