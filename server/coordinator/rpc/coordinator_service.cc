#include "server/coordinator/rpc/coordinator_service.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include <map>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/config/job_spec.h"
#include "common/config/spec_text.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/rpc/grpc_util.h"
#include "common/rpc/malformed.h"
#include "common/rpc/reflection.h"
#include "common/rpc/security.h"
#include "fulcrum/v1/cluster.grpc.pb.h"

namespace fulcrum {

namespace {

// Long calls (WatchJob streams, CheckpointJobs waiting for their cut,
// ExportCheckpoint streams) open per caller, bounded by CoordinatorOptions::max_long_calls_per_user.
class LongCallCounter {
 public:
  static constexpr const char* kLongCalls = "WatchJob, CheckpointJob and ExportCheckpoint calls";
  explicit LongCallCounter(uint32_t limit) : limit_(limit) {}

  // Counts one more call for `who` ("user 'bob'", "caller ipv4:10.0.0.7"),
  // or RESOURCE_EXHAUSTED at the limit.
  absl::Status Take(const std::string& who) {
    if (limit_ == 0) return absl::OkStatus();
    absl::MutexLock lock(&mu_);
    uint32_t& open = open_[who];
    if (open >= limit_) {
      const absl::Time now = absl::Now();
      if (now - last_logged_ >= absl::Minutes(1)) {
        last_logged_ = now;
        FLOG(WARNING) << who << " has " << open << " " << kLongCalls << " open, the limit "
                      << "(--max_long_calls_per_user); refusing more (logged at most once a minute)";
      }
      return absl::ResourceExhaustedError(absl::StrCat(who, " has ", open, " ", kLongCalls,
                                                       " open, the limit (--max_long_calls_per_user ", limit_,
                                                       "); end some first (a client that never hangs up leaks them)"));
    }
    ++open;
    return absl::OkStatus();
  }
  void Give(const std::string& who) {
    if (limit_ == 0) return;
    absl::MutexLock lock(&mu_);
    auto it = open_.find(who);
    if (it != open_.end() && --it->second == 0) open_.erase(it);
  }

 private:
  const uint32_t limit_;
  absl::Mutex mu_;
  std::map<std::string, uint32_t> open_ ABSL_GUARDED_BY(mu_);
  absl::Time last_logged_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

// One place of a LongCallCounter, held for as long as this lives (by the
// reactor of the call, deleted in OnDone).
class LongCallSlot {
 public:
  LongCallSlot(LongCallCounter* counter, std::string who) : counter_(counter), who_(std::move(who)) {}
  LongCallSlot(const LongCallSlot&) = delete;
  LongCallSlot& operator=(const LongCallSlot&) = delete;
  ~LongCallSlot() { counter_->Give(who_); }

 private:
  LongCallCounter* const counter_;
  const std::string who_;
};

// A WatchJob refused before it started.
class RefusedWatch : public grpc::ServerWriteReactor<v1::JobEvent> {
 public:
  void OnDone() override { delete this; }
};

// One WatchJob stream: a parked Coordinator::WaitJobAsync between events,
// so an open watch holds no thread. At any time the stream is either
// parked (ticket_), writing an event, or finishing; a hang-up finishes it at
// once only while it is parked (CancelWait is true exactly then). gRPC calls
// are made outside mu_: the last one (Finish) may delete the reactor.
class WatchReactor : public grpc::ServerWriteReactor<v1::JobEvent> {
 public:
  WatchReactor(Coordinator* c, std::string job_id, std::unique_ptr<LongCallSlot> slot)
      : c_(c), job_id_(std::move(job_id)), slot_(std::move(slot)) {
    absl::MutexLock lock(&mu_);
    ParkLocked();
  }
  void OnWriteDone(bool ok) override {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      if (!ok || cancelled_) {
        finish = grpc::Status(grpc::StatusCode::CANCELLED, "watcher went away");
      } else if (config::JobEnded(last_state_)) {
        finish = grpc::Status::OK;
      } else {
        ParkLocked();
      }
    }
    if (finish) Finish(*finish);
  }
  void OnCancel() override {
    bool finish = false;
    {
      absl::MutexLock lock(&mu_);
      cancelled_ = true;
      // Else a write is in flight (OnWriteDone follows), the answer is on
      // its way (OnJob sees cancelled_), or the stream is finishing.
      finish = c_->CancelWait(ticket_);
    }
    if (finish) Finish(grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled"));
  }
  void OnDone() override { delete this; }

 private:
  void ParkLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    ticket_ = c_->WaitJobAsync(job_id_, version_, [this](absl::StatusOr<v1::Job> job, uint64_t version) {
      OnJob(std::move(job), version);
    });
  }
  void OnJob(absl::StatusOr<v1::Job> job, uint64_t version) {
    std::optional<grpc::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      if (cancelled_) {
        finish = grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled");
      } else if (!job.ok()) {
        finish = ToGrpcStatus(job.status());
      } else {
        event_.Clear();
        if (version_ == 0) {
          event_.set_kind("snapshot");
        } else if (job->status().state() != last_state_) {
          event_.set_kind("state");
        } else if (static_cast<size_t>(job->status().epochs_size()) != last_epochs_) {
          event_.set_kind("epoch");
        } else {
          event_.set_kind("progress");
        }
        version_ = version;
        last_state_ = job->status().state();
        last_epochs_ = job->status().epochs_size();
        *event_.mutable_job() = *std::move(job);
      }
    }
    if (finish) {
      Finish(*finish);
    } else {
      StartWrite(&event_);
    }
  }

  Coordinator* const c_;
  const std::string job_id_;
  const std::unique_ptr<LongCallSlot> slot_;
  absl::Mutex mu_;
  uint64_t version_ ABSL_GUARDED_BY(mu_) = 0;  // of the last event written; 0: none yet
  v1::JobState last_state_ ABSL_GUARDED_BY(mu_) = v1::JOB_STATE_UNSPECIFIED;
  size_t last_epochs_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t ticket_ ABSL_GUARDED_BY(mu_) = 0;  // of the latest park; stale once answered
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  v1::JobEvent event_;  // written by OnJob, read by gRPC until OnWriteDone
};

// A unary call answered by a parked poll of the coordinator (Heartbeat,
// CheckpointJob), so a waiting one holds no thread. Finish is called once:
// by the answer, or by OnCancel when it withdrew the poll before the answer
// came (CancelWait is true then, and the answer never runs). gRPC calls
// OnCancel only after the constructor.
template <typename Resp>
class ParkedUnaryReactor : public grpc::ServerUnaryReactor {
 public:
  using Done = std::function<void(absl::StatusOr<Resp>)>;
  // `park` parks the poll answered through the Done it is given and returns
  // its ticket; `what` names the call in the CANCELLED status; `slot`, if
  // any, is held until the call ends.
  ParkedUnaryReactor(Coordinator* c, Resp* resp, const char* what, const std::function<uint64_t(Done)>& park,
                     std::unique_ptr<LongCallSlot> slot = nullptr)
      : c_(c), what_(what), slot_(std::move(slot)), ticket_(park([this, resp](absl::StatusOr<Resp> r) {
          if (r.ok()) *resp = *std::move(r);
          Finish(ToGrpcStatus(r.status()));
        })) {}
  void OnCancel() override {
    if (c_->CancelWait(ticket_)) Finish(grpc::Status(grpc::StatusCode::CANCELLED, absl::StrCat(what_, " cancelled")));
  }
  void OnDone() override { delete this; }

 private:
  Coordinator* const c_;
  const char* const what_;
  const std::unique_ptr<LongCallSlot> slot_;  // before ticket_: held before the call parks
  const uint64_t ticket_;
};

}  // namespace

// The job API is synchronous but for WatchJob, whose streams stay open for
// as long as a job runs, and CheckpointJob, which waits for a cut to commit:
// each is a reactor over a parked poll, not a thread.
class CoordinatorGrpcServer::JobImpl final
    : public v1::JobService::WithCallbackMethod_CheckpointJob<
          v1::JobService::WithCallbackMethod_WatchJob<v1::JobService::Service>> {
 public:
  JobImpl(Coordinator* c, std::shared_ptr<TokenAuthenticator> tokens)
      : c_(c), tokens_(std::move(tokens)), long_calls_(c->options().max_long_calls_per_user) {}

  grpc::Status SubmitJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                         v1::SubmitJobResponse* resp) override {
    auto caller = Who(*ctx);
    if (!caller.ok()) return ToGrpcStatus(caller.status());
    auto id = c_->SubmitJob(req->spec(), req->validate_only(), caller->user);
    if (!id.ok()) return ToGrpcStatus(id.status());
    resp->set_job_id(*id);
    return grpc::Status::OK;
  }
  grpc::Status ParseJobSpec(grpc::ServerContext* ctx, const v1::ParseJobSpecRequest* req,
                            v1::JobSpec* resp) override {
    auto caller = Who(*ctx);
    if (!caller.ok()) return ToGrpcStatus(caller.status());
    const std::string source = req->source().empty() ? "spec" : req->source();
    return ToGrpcStatus(config::ParseSpecText(req->text(), source, resp));
  }
  grpc::Status GetJob(grpc::ServerContext* ctx, const v1::JobRef* req, v1::Job* resp) override {
    auto j = Access(*ctx, req->job_id());
    if (!j.ok()) return ToGrpcStatus(j.status());
    *resp = *std::move(j);
    return grpc::Status::OK;
  }
  grpc::Status ListJobs(grpc::ServerContext* ctx, const v1::ListJobsRequest* req, v1::ListJobsResponse* resp) override {
    auto caller = Who(*ctx);
    if (!caller.ok()) return ToGrpcStatus(caller.status());
    auto page = c_->ListJobs(req->page_size(), req->page_token(),
                             [&](const v1::Job& j) { return caller->admin || j.owner() == caller->user; });
    if (!page.ok()) return ToGrpcStatus(page.status());
    for (v1::Job& j : page->jobs) *resp->add_jobs() = std::move(j);
    resp->set_next_page_token(page->next_page_token);
    return grpc::Status::OK;
  }
  grpc::Status CancelJob(grpc::ServerContext* ctx, const v1::JobRef* req, v1::Job* resp) override {
    if (auto a = Access(*ctx, req->job_id()); !a.ok()) return ToGrpcStatus(a.status());
    auto j = c_->CancelJob(req->job_id());
    if (!j.ok()) return ToGrpcStatus(j.status());
    *resp = *std::move(j);
    return grpc::Status::OK;
  }
  grpc::ServerWriteReactor<v1::JobEvent>* WatchJob(grpc::CallbackServerContext* ctx, const v1::JobRef* req) override {
    auto slot = AccessLong(*ctx, req->job_id());
    if (!slot.ok()) {
      auto* refused = new RefusedWatch();
      refused->Finish(ToGrpcStatus(slot.status()));
      return refused;
    }
    return new WatchReactor(c_, req->job_id(), *std::move(slot));
  }
  grpc::ServerUnaryReactor* CheckpointJob(grpc::CallbackServerContext* ctx, const v1::JobRef* req,
                                          v1::CheckpointInfo* resp) override {
    auto slot = AccessLong(*ctx, req->job_id());
    if (!slot.ok()) {
      auto* reactor = ctx->DefaultReactor();
      reactor->Finish(ToGrpcStatus(slot.status()));
      return reactor;
    }
    // At most 5 minutes, and an answer before the caller's deadline.
    absl::Duration timeout = absl::Minutes(5);
    const auto d = ctx->deadline();
    if (d < std::chrono::system_clock::now() + std::chrono::hours(24)) {
      timeout = std::min(timeout, absl::FromChrono(d) - absl::Now() - absl::Milliseconds(200));
    }
    return new ParkedUnaryReactor<v1::CheckpointInfo>(
        c_, resp, "checkpoint request",
        [&](auto done) { return c_->CheckpointJobAsync(req->job_id(), timeout, std::move(done)); }, *std::move(slot));
  }
  grpc::Status RestoreJob(grpc::ServerContext* ctx, const v1::RestoreJobRequest* req, v1::Job* resp) override {
    if (auto a = Access(*ctx, req->job_id()); !a.ok()) return ToGrpcStatus(a.status());
    auto j = c_->RestoreJob(req->job_id(), req->cut_id());
    if (!j.ok()) return ToGrpcStatus(j.status());
    *resp = *std::move(j);
    return grpc::Status::OK;
  }
  grpc::Status ExportCheckpoint(grpc::ServerContext* ctx, const v1::ExportCheckpointRequest* req,
                                grpc::ServerWriter<v1::ExportCheckpointChunk>* writer) override {
    // An export holds a thread of the synchronous pool while it streams:
    // it takes a place among the caller's long calls.
    auto slot = AccessLong(*ctx, req->job_id());
    if (!slot.ok()) return ToGrpcStatus(slot.status());
    return ToGrpcStatus(c_->ExportCheckpoint(req->job_id(), req->cut_id(), [&](const v1::ExportCheckpointChunk& c) {
      return !ctx->IsCancelled() && writer->Write(c);
    }));
  }

  const std::shared_ptr<TokenAuthenticator>& tokens() const { return tokens_; }

  // The caller by bearer token; without a token file every caller is an
  // anonymous admin (--insecure development clusters and in-process tests).
  absl::StatusOr<Caller> Who(const grpc::ServerContextBase& ctx) {
    if (tokens_ == nullptr) return Caller{"", true};
    return tokens_->Authenticate(ctx);
  }

 private:
  // The job, when the caller may act on it: UNAUTHENTICATED before NOT_FOUND
  // before PERMISSION_DENIED, so nobody learns which jobs exist without a
  // valid token.
  absl::StatusOr<v1::Job> Access(const grpc::ServerContextBase& ctx, const std::string& job_id) {
    auto caller = Who(ctx);
    if (!caller.ok()) return caller.status();
    return AccessAs(*caller, job_id);
  }
  absl::StatusOr<v1::Job> AccessAs(const Caller& caller, const std::string& job_id) {
    auto j = c_->GetJob(job_id);
    if (!j.ok()) return j.status();
    if (auto s = CheckJobAccess(caller, job_id, j->owner()); !s.ok()) return s;
    return j;
  }

  // Access, for a long call: also a place among the caller's long calls.
  absl::StatusOr<std::unique_ptr<LongCallSlot>> AccessLong(const grpc::ServerContextBase& ctx,
                                                           const std::string& job_id) {
    auto caller = Who(ctx);
    if (!caller.ok()) return caller.status();
    if (auto a = AccessAs(*caller, job_id); !a.ok()) return a.status();
    std::string who;
    if (caller->user.empty()) {
      // Anonymous (no tokens): by the caller's address, without its port.
      const std::string peer = ctx.peer();
      who = absl::StrCat("caller ", peer.substr(0, peer.rfind(':')));
    } else {
      who = absl::StrCat("user '", caller->user, "'");
    }
    RETURN_IF_ERROR(long_calls_.Take(who));
    return std::make_unique<LongCallSlot>(&long_calls_, std::move(who));
  }

  Coordinator* c_;
  std::shared_ptr<TokenAuthenticator> tokens_;
  LongCallCounter long_calls_;
};

// Likewise Heartbeat: every node keeps one parked here.
class CoordinatorGrpcServer::ClusterImpl final
    : public v1::ClusterService::WithCallbackMethod_Heartbeat<v1::ClusterService::Service> {
 public:
  ClusterImpl(Coordinator* c, JobImpl* jobs, const security::Transport& transport)
      : c_(c), jobs_(jobs), transport_(transport) {}

  grpc::Status RegisterNode(grpc::ServerContext* ctx, const v1::RegisterNodeRequest* req,
                            v1::RegisterNodeResponse* resp) override {
    // A node registers in the role its certificate names: a worker's
    // certificate cannot join as a parameter server.
    const v1::NodeRole asked = req->node().role();
    if (asked != v1::SERVER && asked != v1::WORKER) {
      return ToGrpcStatus(absl::InvalidArgumentError(
          absl::StrCat("register: role must be SERVER or WORKER; got ", static_cast<int>(asked))));
    }
    const security::Role role = asked == v1::SERVER ? security::Role::kServer : security::Role::kWorker;
    if (auto s = transport_.RequireRole(*ctx, {role}, absl::StrCat("registering as ", v1::NodeRole_Name(asked)));
        !s.ok()) {
      return ToGrpcStatus(s);
    }
    auto r = c_->RegisterNode(req->node(), transport_.CallerId(*ctx));
    if (!r.ok()) return ToGrpcStatus(r.status());
    *resp = *std::move(r);
    return grpc::Status::OK;
  }
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse* resp) override {
    if (auto s = transport_.RequireRole(*ctx, {security::Role::kServer, security::Role::kWorker}, "Heartbeat");
        !s.ok()) {
      auto* reactor = ctx->DefaultReactor();
      reactor->Finish(ToGrpcStatus(s));
      return reactor;
    }
    const std::string certificate = transport_.CallerId(*ctx);
    return new ParkedUnaryReactor<v1::HeartbeatResponse>(c_, resp, "heartbeat", [&](auto done) {
      return c_->HeartbeatAsync(*req, std::move(done), certificate);
    });
  }
  grpc::Status ReportProgress(grpc::ServerContext* ctx, const v1::ReportProgressRequest* req,
                              v1::ReportProgressResponse* resp) override {
    if (auto s = transport_.RequireRole(*ctx, {security::Role::kWorker}, "ReportProgress"); !s.ok()) {
      return ToGrpcStatus(s);
    }
    auto r = c_->ReportProgress(*req, transport_.CallerId(*ctx));
    if (!r.ok()) return ToGrpcStatus(r.status());
    *resp = *std::move(r);
    return grpc::Status::OK;
  }
  // Cluster members and authenticated users (fulcrumctl cluster).
  grpc::Status GetCluster(grpc::ServerContext* ctx, const v1::GetClusterRequest*, v1::ClusterState* resp) override {
    if (!transport_.tls() || security::PeerOf(*ctx).role == security::Role::kUnknown) {
      if (auto caller = jobs_->Who(*ctx); !caller.ok()) return ToGrpcStatus(caller.status());
    }
    *resp = c_->GetCluster();
    return grpc::Status::OK;
  }

 private:
  Coordinator* c_;
  JobImpl* jobs_;
  const security::Transport& transport_;
};

absl::StatusOr<std::unique_ptr<CoordinatorGrpcServer>> CoordinatorGrpcServer::Start(
    Coordinator* coordinator, const std::string& listen_address, std::shared_ptr<TokenAuthenticator> tokens,
    std::shared_ptr<const security::Transport> security) {
  std::unique_ptr<CoordinatorGrpcServer> s(new CoordinatorGrpcServer());
  s->coordinator_ = coordinator;
  s->security_ = security::Transport::OrPlaintext(std::move(security));
  const security::Transport& transport = *s->security_;
  std::shared_ptr<grpc::ServerCredentials> credentials = transport.ServerCredentials(security::ClientCerts::kOptional);
  if (credentials == nullptr) {
    return absl::InvalidArgumentError(
        "a client-only TLS transport cannot serve: give the coordinator a member certificate");
  }
  s->jobs_ = std::make_unique<JobImpl>(coordinator, std::move(tokens));
  s->cluster_ = std::make_unique<ClusterImpl>(coordinator, s->jobs_.get(), transport);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  ConfigureServerBuilder(builder);
  int port = 0;
  // Cluster members present certificates (checked on ClusterService); users
  // come without one and present bearer tokens on JobService.
  if (s->jobs_->tokens() != nullptr && transport.tls()) {
    // Tokens checked before a request is parsed (auth.h).
    credentials->SetAuthMetadataProcessor(NewTokenCheckBeforeParse(s->jobs_->tokens()));
  }
  builder.AddListeningPort(listen_address, credentials, &port);
  builder.RegisterService(s->jobs_.get());
  builder.RegisterService(s->cluster_.get());
  // A request that does not parse: its caller's credentials first, then
  // INVALID_ARGUMENT (common/rpc/malformed.h).
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  JobImpl* jobs = s->jobs_.get();
  interceptors.push_back(
      NewMalformedRequestInterceptor([jobs, tls = transport.tls()](const std::string& method,
                                                                    grpc::ServerContextBase& ctx) -> absl::Status {
        // Members present certificates; users (and fulcrumctl cluster) tokens.
        const bool member = tls && security::PeerOf(ctx).role != security::Role::kUnknown;
        if (absl::StartsWith(method, "/fulcrum.v1.ClusterService/") && member) return absl::OkStatus();
        if (absl::StartsWith(method, "/fulcrum.v1.")) return jobs->Who(ctx).status();
        return absl::OkStatus();
      }));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  s->reflection_v1_ =
      NewReflectionV1Service({v1::JobService::service_full_name(), v1::ClusterService::service_full_name()});
  builder.RegisterService(s->reflection_v1_.get());
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", listen_address, " (address in use or invalid)"));
  }
  ServeHealthOf(s->server_.get(), {v1::JobService::service_full_name(), v1::ClusterService::service_full_name()});
  const size_t colon = listen_address.rfind(':');
  s->address_ = absl::StrCat(colon == std::string::npos ? listen_address : listen_address.substr(0, colon), ":", port);
  return s;
}

CoordinatorGrpcServer::~CoordinatorGrpcServer() { Shutdown(); }

void CoordinatorGrpcServer::Shutdown() {
  // A server that never started (its address was taken) has nothing to stop.
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  if (auto* health = server_->GetHealthCheckService()) health->SetServingStatus(false);
  coordinator_->Shutdown();
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

}  // namespace fulcrum
