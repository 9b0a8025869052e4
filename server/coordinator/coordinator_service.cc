#include "server/coordinator/coordinator_service.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "common/config/job_spec.h"
#include "common/rpc/grpc_util.h"
#include "common/rpc/security.h"
#include "fulcrum/v1/cluster.grpc.pb.h"

namespace fulcrum {

class CoordinatorGrpcServer::JobImpl final : public v1::JobService::Service {
 public:
  JobImpl(Coordinator* c, std::shared_ptr<TokenAuthenticator> tokens) : c_(c), tokens_(std::move(tokens)) {}

  grpc::Status SubmitJob(grpc::ServerContext* ctx, const v1::SubmitJobRequest* req,
                         v1::SubmitJobResponse* resp) override {
    auto caller = Who(*ctx);
    if (!caller.ok()) return ToGrpcStatus(caller.status());
    auto id = c_->SubmitJob(req->spec(), req->validate_only(), caller->user);
    if (!id.ok()) return ToGrpcStatus(id.status());
    resp->set_job_id(*id);
    return grpc::Status::OK;
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
  grpc::Status WatchJob(grpc::ServerContext* ctx, const v1::JobRef* req,
                        grpc::ServerWriter<v1::JobEvent>* writer) override {
    if (auto a = Access(*ctx, req->job_id()); !a.ok()) return ToGrpcStatus(a.status());
    uint64_t version = 0;
    v1::JobState last_state = v1::JOB_STATE_UNSPECIFIED;
    size_t last_epochs = 0;
    for (bool first = true;; first = false) {
      if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled");
      const uint64_t before = version;
      auto j = c_->WaitJob(req->job_id(), &version, absl::Seconds(1));
      if (!j.ok()) return ToGrpcStatus(j.status());
      if (!first && version == before) continue;  // nothing new; check the client is still there
      v1::JobEvent e;
      if (first) e.set_kind("snapshot");
      else if (j->status().state() != last_state) e.set_kind("state");
      else if (static_cast<size_t>(j->status().epochs_size()) != last_epochs) e.set_kind("epoch");
      else e.set_kind("progress");
      last_state = j->status().state();
      last_epochs = j->status().epochs_size();
      *e.mutable_job() = *std::move(j);
      if (!writer->Write(e)) return grpc::Status(grpc::StatusCode::CANCELLED, "watcher went away");
      if (config::JobEnded(last_state)) return grpc::Status::OK;
    }
  }
  grpc::Status CheckpointJob(grpc::ServerContext* ctx, const v1::JobRef* req, v1::CheckpointInfo* resp) override {
    if (auto a = Access(*ctx, req->job_id()); !a.ok()) return ToGrpcStatus(a.status());
    absl::Duration timeout = absl::Minutes(5);
    const auto d = ctx->deadline();
    if (d < std::chrono::system_clock::now() + std::chrono::hours(24)) {
      timeout = std::min(timeout, absl::FromChrono(d) - absl::Now() - absl::Milliseconds(200));
    }
    auto r = c_->CheckpointJob(req->job_id(), timeout);
    if (!r.ok()) return ToGrpcStatus(r.status());
    *resp = *std::move(r);
    return grpc::Status::OK;
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
    if (auto a = Access(*ctx, req->job_id()); !a.ok()) return ToGrpcStatus(a.status());
    return ToGrpcStatus(c_->ExportCheckpoint(req->job_id(), req->cut_id(), [&](const v1::ExportCheckpointChunk& c) {
      return !ctx->IsCancelled() && writer->Write(c);
    }));
  }

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
    auto j = c_->GetJob(job_id);
    if (!j.ok()) return j.status();
    if (auto s = CheckJobAccess(*caller, job_id, j->owner()); !s.ok()) return s;
    return j;
  }

  Coordinator* c_;
  std::shared_ptr<TokenAuthenticator> tokens_;
};

class CoordinatorGrpcServer::ClusterImpl final : public v1::ClusterService::Service {
 public:
  ClusterImpl(Coordinator* c, JobImpl* jobs) : c_(c), jobs_(jobs) {}

  grpc::Status RegisterNode(grpc::ServerContext* ctx, const v1::RegisterNodeRequest* req,
                            v1::RegisterNodeResponse* resp) override {
    // A node registers in the role its certificate names: a worker's
    // certificate cannot join as a parameter server.
    const security::Role role = req->node().role() == v1::SERVER   ? security::Role::kServer
                                : req->node().role() == v1::WORKER ? security::Role::kWorker
                                                                    : security::Role::kUnknown;
    if (auto s = security::RequireRole(*ctx, {role}, absl::StrCat("registering as ", v1::NodeRole_Name(req->node().role())));
        !s.ok()) {
      return ToGrpcStatus(s);
    }
    auto r = c_->RegisterNode(req->node());
    if (!r.ok()) return ToGrpcStatus(r.status());
    *resp = *std::move(r);
    return grpc::Status::OK;
  }
  grpc::Status Heartbeat(grpc::ServerContext* ctx, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override {
    if (auto s = security::RequireRole(*ctx, {security::Role::kServer, security::Role::kWorker}, "Heartbeat");
        !s.ok()) {
      return ToGrpcStatus(s);
    }
    auto r = c_->Heartbeat(*req);
    if (!r.ok()) return ToGrpcStatus(r.status());
    *resp = *std::move(r);
    return grpc::Status::OK;
  }
  grpc::Status ReportProgress(grpc::ServerContext* ctx, const v1::ReportProgressRequest* req,
                              v1::ReportProgressResponse* resp) override {
    if (auto s = security::RequireRole(*ctx, {security::Role::kWorker}, "ReportProgress"); !s.ok()) {
      return ToGrpcStatus(s);
    }
    auto r = c_->ReportProgress(*req);
    if (!r.ok()) return ToGrpcStatus(r.status());
    *resp = *std::move(r);
    return grpc::Status::OK;
  }
  // Cluster members and authenticated users (fulcrumctl cluster).
  grpc::Status GetCluster(grpc::ServerContext* ctx, const v1::GetClusterRequest*, v1::ClusterState* resp) override {
    if (!security::TlsEnabled() || security::PeerOf(*ctx).role == security::Role::kUnknown) {
      if (auto caller = jobs_->Who(*ctx); !caller.ok()) return ToGrpcStatus(caller.status());
    }
    *resp = c_->GetCluster();
    return grpc::Status::OK;
  }

 private:
  Coordinator* c_;
  JobImpl* jobs_;
};

absl::StatusOr<std::unique_ptr<CoordinatorGrpcServer>> CoordinatorGrpcServer::Start(
    Coordinator* coordinator, const std::string& listen_address, std::shared_ptr<TokenAuthenticator> tokens) {
  std::unique_ptr<CoordinatorGrpcServer> s(new CoordinatorGrpcServer());
  s->coordinator_ = coordinator;
  s->jobs_ = std::make_unique<JobImpl>(coordinator, std::move(tokens));
  s->cluster_ = std::make_unique<ClusterImpl>(coordinator, s->jobs_.get());
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  ConfigureServerBuilder(builder);
  int port = 0;
  // Cluster members present certificates (checked on ClusterService); users
  // come without one and present bearer tokens on JobService.
  builder.AddListeningPort(listen_address, security::ServerCredentials(security::ClientCerts::kOptional), &port);
  builder.RegisterService(s->jobs_.get());
  builder.RegisterService(s->cluster_.get());
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", listen_address, " (address in use or invalid)"));
  }
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
