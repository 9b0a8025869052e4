#include "server/coordinator/rpc/grpc_server_control.h"

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/rpc/grpc_util.h"
#include "common/rpc/security.h"
#include "common/status_macros.h"
#include "fulcrum/v1/ps.grpc.pb.h"

namespace fulcrum {
namespace {

class GrpcServerControl final : public ServerControl {
 public:
  GrpcServerControl(absl::Duration timeout, std::shared_ptr<const security::Transport> security)
      : timeout_(timeout),
        security_(security::Transport::OrPlaintext(std::move(security))) {}

  void CancelAll() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    for (grpc::ClientContext* c : active_) c->TryCancel();
  }

  absl::Status InstallShardMap(const std::string& address, const v1::ShardMap& map) override {
    Call call(this, timeout_);
    v1::SetShardMapRequest req;
    *req.mutable_map() = map;
    v1::SetShardMapResponse resp;
    absl::Status s = FromGrpcStatus(Stub(address)->SetShardMap(&call.ctx, req, &resp));
    if (s.code() == absl::StatusCode::kFailedPrecondition) {
      // Already installed (or newer): ask which one it has.
      Call again(this, timeout_);
      v1::ShardMap have;
      absl::Status g = FromGrpcStatus(Stub(address)->GetShardMap(&again.ctx, v1::GetShardMapRequest(), &have));
      if (g.ok() && have.version() == map.version()) return absl::OkStatus();
    }
    return s;
  }

  absl::Status DeleteJob(const std::string& address, const std::string& job_id) override {
    Call call(this, timeout_);
    v1::DeleteJobRequest req;
    req.set_job_id(job_id);
    v1::DeleteJobResponse resp;
    absl::Status s = FromGrpcStatus(Stub(address)->DeleteJob(&call.ctx, req, &resp));
    if (s.code() == absl::StatusCode::kNotFound) return absl::OkStatus();
    return s;
  }

  absl::StatusOr<v1::ShardCutMeta> Checkpoint(const std::string& address, const std::string& job_id,
                                              uint64_t cut_id, uint64_t at_step, absl::Duration wait) override {
    Call call(this, wait + timeout_);
    v1::CheckpointRequest req;
    req.set_job_id(job_id);
    req.set_cut_id(cut_id);
    req.set_at_step(at_step);
    req.set_wait_timeout_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(wait)));
    v1::ShardCutMeta meta;
    RETURN_IF_ERROR(FromGrpcStatus(Stub(address)->Checkpoint(&call.ctx, req, &meta)));
    return meta;
  }

  absl::StatusOr<v1::ShardCutMeta> Restore(const std::string& address, const std::string& job_id, uint64_t cut_id,
                                           const std::vector<std::string>& sources,
                                           uint32_t min_incarnation) override {
    // A restore moves the whole cut: give it minutes, not the control timeout.
    Call call(this, absl::Minutes(30));
    v1::RestoreRequest req;
    req.set_job_id(job_id);
    req.set_cut_id(cut_id);
    for (const std::string& s : sources) req.add_sources(s);
    req.set_min_incarnation(min_incarnation);
    v1::ShardCutMeta meta;
    RETURN_IF_ERROR(FromGrpcStatus(Stub(address)->Restore(&call.ctx, req, &meta)));
    return meta;
  }

  absl::Status DeleteCut(const std::string& address, const std::string& job_id, uint64_t cut_id) override {
    Call call(this, timeout_);
    v1::DeleteCheckpointRequest req;
    req.set_job_id(job_id);
    req.set_cut_id(cut_id);
    v1::DeleteCheckpointResponse resp;
    return FromGrpcStatus(Stub(address)->DeleteCheckpoint(&call.ctx, req, &resp));
  }

  absl::StatusOr<std::vector<v1::ShardCutMeta>> ListCuts(const std::string& address,
                                                         const std::string& job_id) override {
    Call call(this, timeout_);
    v1::ListCheckpointsRequest req;
    req.set_job_id(job_id);
    v1::ListCheckpointsResponse resp;
    RETURN_IF_ERROR(FromGrpcStatus(Stub(address)->ListCheckpoints(&call.ctx, req, &resp)));
    return std::vector<v1::ShardCutMeta>(resp.cuts().begin(), resp.cuts().end());
  }

  absl::StatusOr<v1::ReadCheckpointResponse> ReadCut(const std::string& address,
                                                     const v1::ReadCheckpointRequest& req) override {
    Call call(this, absl::Seconds(60));
    v1::ReadCheckpointResponse resp;
    RETURN_IF_ERROR(FromGrpcStatus(Stub(address, /*checkpoint_pages=*/true)->ReadCheckpoint(&call.ctx, req, &resp)));
    return resp;
  }

 private:
  // One call's context, with its deadline, registered so CancelAll reaches it.
  struct Call {
    Call(GrpcServerControl* c, absl::Duration timeout) : control(c) {
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
      absl::MutexLock lock(&control->mu_);
      if (control->cancelled_) ctx.TryCancel();
      control->active_.insert(&ctx);
    }
    ~Call() {
      absl::MutexLock lock(&control->mu_);
      control->active_.erase(&ctx);
    }
    GrpcServerControl* const control;
    grpc::ClientContext ctx;
  };

  // Checkpoint pages travel on channels of their own, which accept
  // messages up to kMaxCheckpointMessageBytes.
  v1::ParameterService::Stub* Stub(const std::string& address, bool checkpoint_pages = false) {
    absl::MutexLock lock(&mu_);
    auto& stub = (checkpoint_pages ? page_stubs_ : stubs_)[address];
    if (stub == nullptr) {
      stub = v1::ParameterService::NewStub(
          checkpoint_pages ? CreateCheckpointChannel(address, *security_)
                           : grpc::CreateChannel(address, security_->ChannelCredentials()));
    }
    return stub.get();
  }

  const absl::Duration timeout_;
  const std::shared_ptr<const security::Transport> security_;
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<v1::ParameterService::Stub>> stubs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<v1::ParameterService::Stub>> page_stubs_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::set<grpc::ClientContext*> active_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::unique_ptr<ServerControl> NewGrpcServerControl(absl::Duration timeout,
                                                    std::shared_ptr<const security::Transport> security) {
  return std::make_unique<GrpcServerControl>(timeout, std::move(security));
}

}  // namespace fulcrum
