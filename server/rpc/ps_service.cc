#include "server/rpc/ps_service.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <thread>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server_builder.h>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "common/bounded_executor.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/metrics/metrics.h"
#include "common/rpc/grpc_util.h"
#include "common/rpc/malformed.h"
#include "common/rpc/reflection.h"
#include "common/rpc/security.h"
#include "common/rpc/shared_memory.h"
#include "common/rpc/wire_codec.h"
#include "common/status_macros.h"
#include "fulcrum/v1/ps.grpc.pb.h"

namespace fulcrum {
namespace {

using ServiceBase = v1::ParameterService::WithCallbackMethod_OpenSharedMemory<
    v1::ParameterService::WithCallbackMethod_ReadCheckpoint<
    v1::ParameterService::WithCallbackMethod_Checkpoint<
    v1::ParameterService::WithCallbackMethod_ListCheckpoints<
    v1::ParameterService::WithCallbackMethod_Restore<
    v1::ParameterService::WithCallbackMethod_DeleteCheckpoint<
    v1::ParameterService::WithCallbackMethod_CreateJob<
    v1::ParameterService::WithCallbackMethod_DeleteJob<
        v1::ParameterService::WithCallbackMethod_GetJob<
            v1::ParameterService::WithCallbackMethod_GetShardMap<
                v1::ParameterService::WithCallbackMethod_SetShardMap<
                    v1::ParameterService::WithRawCallbackMethod_Push<
                        v1::ParameterService::WithRawCallbackMethod_Pull<
                            v1::ParameterService::WithRawCallbackMethod_Stream<
                                v1::ParameterService::Service>>>>>>>>>>>>>>;

absl::Time DeadlineOf(const grpc::CallbackServerContext* ctx) {
  const auto d = ctx->deadline();
  // gRPC reports "no deadline" as a time point centuries away.
  if (d > std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(d);
}

absl::Status DecodePushBuffer(const grpc::ByteBuffer& buf, PushMessage* m) {
  Payload p;
  RETURN_IF_ERROR(wire::ViewByteBuffer(buf, &p, &m->keepalive));
  return wire::DecodePush(p, m);
}

absl::Status DecodePullBuffer(const grpc::ByteBuffer& buf, PullMessage* m) {
  Payload p;
  RETURN_IF_ERROR(wire::ViewByteBuffer(buf, &p, &m->keepalive));
  return wire::DecodePull(p, m);
}

using Responder = std::function<void(uint64_t id, const absl::Status& s, bool is_push, wire::Writer body)>;

// Decodes one StreamRequest (from a Stream call or a shared-memory slot) and
// answers it through `respond`: at once for a push or an error, when the
// wait ends for a pull. `in_shared_memory`: `p` lies in a worker's
// shared-memory slot, which the worker can still write. Pushes are decoded
// in place: the parameter server copies every gradient into its own memory
// before it checks or applies one (PushMessage::volatile_payload), so this
// saves copying the whole request first. A pull's keys are copied, as a
// parked pull outlives this call.
void HandleStreamRequest(ParameterServer* ps, const Payload& p, std::shared_ptr<const void> keepalive,
                         Responder respond, const std::string& caller, bool in_shared_memory = false) {
  wire::StreamRequestView req;
  absl::Status s = wire::DecodeStreamRequest(p, &req);
  if (s.ok() && !req.has_body) s = absl::InvalidArgumentError("stream request has neither push nor pull");
  if (!s.ok()) {
    respond(req.id, s, false, wire::Writer());
    return;
  }
  if (req.is_push) {
    PushMessage m;
    m.keepalive = std::move(keepalive);
    m.volatile_payload = in_shared_memory;
    m.caller = caller;
    PushResult result;
    s = wire::DecodePush(req.body, &m);
    if (s.ok()) s = ps->Push(m, &result);
    respond(req.id, s, true, wire::EncodePushResult(result));
    return;
  }
  Payload body = req.body;
  if (in_shared_memory) {
    std::shared_ptr<uint8_t[]> copy(new uint8_t[req.body.size()]);
    req.body.CopyTo(copy.get());
    body = Payload(copy.get(), req.body.size());
    keepalive = std::move(copy);
  }
  auto m = std::make_shared<PullMessage>();
  m->keepalive = std::move(keepalive);
  s = wire::DecodePull(body, m.get());
  if (!s.ok()) {
    respond(req.id, s, false, wire::Writer());
    return;
  }
  m->caller = caller;
  const uint64_t id = req.id;
  ps->Pull(std::move(m), absl::InfiniteFuture(), [respond = std::move(respond), id](absl::StatusOr<PullResult> r) {
    if (!r.ok()) {
      respond(id, r.status(), false, wire::Writer());
    } else {
      respond(id, absl::OkStatus(), false, wire::EncodePullResult(*std::move(r)));
    }
  });
}

// One Stream call. Requests are handled as they arrive; responses are queued
// and written one at a time (gRPC allows one outstanding write). The reactor
// deletes itself once gRPC is done with it and no pull is still waiting.
class StreamReactor final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // `caller`: the certificate identity of the stream's peer (security::Transport::CallerId).
  StreamReactor(ParameterServer* ps, std::string caller) : ps_(ps), caller_(std::move(caller)) { StartRead(&in_); }

  void OnReadDone(bool ok) override {
    if (!ok) {
      absl::MutexLock lock(&mu_);
      reads_done_ = true;
      MaybeFinishLocked();
      return;
    }
    grpc::ByteBuffer buf;
    buf.Swap(&in_);
    {
      absl::MutexLock lock(&mu_);
      ++pending_;
    }
    Handle(buf);
    absl::MutexLock lock(&mu_);
    if (!finished_) StartRead(&in_);
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    out_.pop_front();
    if (!ok) write_failed_ = true;
    if (!out_.empty() && !finished_ && !write_failed_) {
      StartWrite(&out_.front());
    } else {
      writing_ = false;
      MaybeFinishLocked();
    }
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    if (!finished_) {
      finished_ = true;
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled"));
    }
  }

  void OnDone() override {
    bool del;
    {
      absl::MutexLock lock(&mu_);
      done_ = true;
      del = pending_ == 0;
    }
    if (del) delete this;
  }

 private:
  void Handle(const grpc::ByteBuffer& buf) {
    Payload p;
    std::shared_ptr<const void> keepalive;
    absl::Status s = wire::ViewByteBuffer(buf, &p, &keepalive);
    if (!s.ok()) {
      Respond(0, s, false, wire::Writer());
      return;
    }
    HandleStreamRequest(ps_, p, std::move(keepalive),
                        [this](uint64_t id, const absl::Status& st, bool is_push, wire::Writer body) {
                          Respond(id, st, is_push, std::move(body));
                        },
                        caller_);
  }

  void Respond(uint64_t id, const absl::Status& s, bool is_push, wire::Writer body) {
    const uint64_t version = WrongShardVersion(s).value_or(0);
    grpc::ByteBuffer out =
        wire::EncodeStreamResponse(id, s, version, is_push, std::move(body)).Finish();
    bool del = false;
    {
      absl::MutexLock lock(&mu_);
      --pending_;
      if (!finished_ && !write_failed_) {
        out_.push_back(std::move(out));
        if (!writing_) {
          writing_ = true;
          StartWrite(&out_.front());
        }
      }
      MaybeFinishLocked();
      del = done_ && pending_ == 0;
    }
    if (del) delete this;
  }

  void MaybeFinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_ || pending_ != 0) return;
    if (reads_done_ || write_failed_) {
      finished_ = true;
      Finish(write_failed_ ? grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed")
                           : grpc::Status::OK);
    }
  }

  ParameterServer* const ps_;
  const std::string caller_;
  grpc::ByteBuffer in_;
  absl::Mutex mu_;
  std::deque<grpc::ByteBuffer> out_ ABSL_GUARDED_BY(mu_);
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool reads_done_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
};

// A shared-memory session with a worker on this host: a thread that takes
// requests from the segment's slots and answers into them.
//
// The thread sleeps on the server bell between requests. A ring that brings
// no request is the worker saying one is coming (GrpcPsClient::ExpectPush,
// rung as its backward pass starts): the thread then polls for up to `poll`
// instead of sleeping again, so the push finds it awake. On a virtual
// machine a sleeping thread takes 50-100 us to wake, a fifth of a small
// model's step.
class ShmSession {
 public:
  // Counts requests in `*served` too, and in `*polled` those it found
  // polling for an announced push (every session's, for the metrics).
  ShmSession(ParameterServer* ps, std::shared_ptr<shm::Segment> seg, std::atomic<uint64_t>* served,
             std::atomic<uint64_t>* polled, absl::Duration poll, SpareCoreProbe spare, std::string caller)
      : ps_(ps),
        seg_(std::move(seg)),
        served_(served),
        polled_(polled),
        poll_(poll),
        spare_(spare),
        caller_(std::move(caller)) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~ShmSession() {
    stop_.store(true);
    shm::Ring(seg_->server_bell());
    thread_.join();
  }
  uint64_t requests() const { return requests_.load(std::memory_order_relaxed); }

 private:
  void Loop() {
    bool expecting = false;  // rung without a request: one is on its way
    bool polled = false;     // the last wait ended while polling
    while (!stop_.load()) {
      const uint32_t seen = seg_->server_bell().count.load(std::memory_order_acquire);
      bool any = false;
      for (uint32_t i = 0; i < seg_->slots(); ++i) {
        uint32_t expect = shm::kRequest;
        if (seg_->slot(i).state.compare_exchange_strong(expect, shm::kBusy, std::memory_order_acq_rel)) {
          if (polled) polled_->fetch_add(1, std::memory_order_relaxed);
          polled = false;
          Take(i);
          any = true;
        }
      }
      if (any) {
        expecting = false;
        continue;
      }
      polled = shm::Wait(seg_->server_bell(), seen, absl::Milliseconds(50), stop_,
                         expecting ? poll_ : absl::ZeroDuration(), spare_) == shm::Waited::kPolling;
      expecting = seg_->server_bell().count.load(std::memory_order_acquire) != seen;
    }
  }

  // Handles request `i` where it lies: HandleStreamRequest copies what it
  // keeps or checks out of the slot (the worker can still write there).
  void Take(uint32_t i) {
    requests_.fetch_add(1, std::memory_order_relaxed);
    served_->fetch_add(1, std::memory_order_relaxed);
    const uint64_t n = seg_->slot(i).request_bytes.load(std::memory_order_acquire);
    std::shared_ptr<shm::Segment> seg = seg_;
    Responder respond = [seg, i](uint64_t id, const absl::Status& st, bool is_push, wire::Writer body) {
      Answer(*seg, i, id, st, is_push, std::move(body));
    };
    if (n > seg_->slot_bytes()) {
      respond(0, absl::InvalidArgumentError(absl::StrCat("shared-memory request of ", n, " bytes in a slot of ",
                                                         seg_->slot_bytes())),
              false, wire::Writer());
      return;
    }
    HandleStreamRequest(ps_, Payload(seg_->request(i), n), nullptr, std::move(respond), caller_,
                        /*in_shared_memory=*/true);
  }

  static void Answer(const shm::Segment& seg, uint32_t i, uint64_t id, const absl::Status& s, bool is_push,
                     wire::Writer body) {
    wire::Writer w = wire::EncodeStreamResponse(id, s, WrongShardVersion(s).value_or(0), is_push, std::move(body));
    if (w.size() > seg.slot_bytes()) {
      w = wire::EncodeStreamResponse(
          id,
          absl::InternalError(absl::StrCat("response of ", w.size(), " bytes does not fit the shared-memory slot of ",
                                           seg.slot_bytes(), " bytes")),
          0, is_push, wire::Writer());
    }
    const size_t n = w.FinishInto(seg.response(i));
    seg.slot(i).response_bytes.store(static_cast<uint32_t>(n), std::memory_order_relaxed);
    seg.slot(i).state.store(shm::kResponse, std::memory_order_release);
    shm::Ring(seg.client_bell());
  }

  ParameterServer* const ps_;
  const std::shared_ptr<shm::Segment> seg_;
  std::atomic<uint64_t>* const served_;
  std::atomic<uint64_t>* const polled_;
  const absl::Duration poll_;
  const SpareCoreProbe spare_;
  const std::string caller_;  // the certificate identity of the call that opened it
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> requests_{0};
  std::thread thread_;
};

class ShmReactor;

// The open shared-memory calls, so shutdown can end them at once.
struct ShmRegistry {
  absl::Mutex mu;
  absl::flat_hash_set<ShmReactor*> open ABSL_GUARDED_BY(mu);
  bool closed ABSL_GUARDED_BY(mu) = false;
  std::atomic<uint64_t> requests{0};  // served by every session so far
  std::atomic<uint64_t> polled{0};    // of those, found polling for an announced push
  absl::Duration poll;                // PsGrpcServer::Options::shared_memory_poll
  SpareCoreProbe spare = &SpareCore;  // PsGrpcServer::Options::spare_core
};

// One OpenSharedMemory call: describes the segment in one event, then stays
// open until the worker ends it or the server shuts down.
class ShmReactor final : public grpc::ServerWriteReactor<v1::SharedMemoryEvent> {
 public:
  // Refuses with `refused` when that is not OK.
  ShmReactor(ParameterServer* ps, ShmRegistry* registry, const std::string& peer, std::string caller,
             const v1::OpenSharedMemoryRequest& req, const absl::Status& refused = absl::OkStatus())
      : registry_(registry), peer_(peer), caller_(std::move(caller)) {
    absl::Status s = refused.ok() ? Open(ps, req) : refused;
    if (!s.ok()) {
      FLOG(INFO) << "shared memory refused to " << peer_ << ": " << s;
      End(ToGrpcStatus(s));
      return;
    }
    StartWrite(&event_);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "write failed"));
  }
  void OnCancel() override { End(grpc::Status(grpc::StatusCode::CANCELLED, "shared memory closed")); }
  void OnDone() override {
    {
      absl::MutexLock lock(&registry_->mu);
      registry_->open.erase(this);
    }
    StopSession();
    delete this;
  }

  // Stops the session's thread, once no request is being handled; then no
  // request reaches the parameter server through this call.
  void StopSession() {
    std::unique_ptr<ShmSession> session;
    {
      absl::MutexLock lock(&mu_);
      session = std::move(session_);
    }
    if (session == nullptr) return;
    const uint64_t served = session->requests();
    session.reset();
    FLOG(INFO) << "shared memory with " << peer_ << " closed after " << served << " requests";
  }

  // Ends the call (idempotent).
  void End(const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    finished_ = true;
    Finish(status);
  }

 private:
  absl::Status Open(ParameterServer* ps, const v1::OpenSharedMemoryRequest& req) {
    if (!shm::PeerOnThisHost(peer_)) {
      return absl::FailedPreconditionError(
          absl::StrCat("shared memory is for workers on this host; ", peer_, " is not an address of this host"));
    }
    const uint32_t slots = std::clamp<uint32_t>(req.slots(), 1, shm::kMaxSlots);
    const uint64_t slot_bytes = std::clamp<uint64_t>(req.slot_bytes(), 4096, shm::kMaxSlotBytes);
    {
      absl::MutexLock lock(&registry_->mu);
      if (registry_->closed) return absl::UnavailableError("server shutting down");
      if (registry_->open.size() >= kMaxSessions) {
        return absl::ResourceExhaustedError(
            absl::StrCat("this server already has ", kMaxSessions, " shared-memory sessions"));
      }
      registry_->open.insert(this);
    }
    ASSIGN_OR_RETURN(std::shared_ptr<shm::Segment> seg, shm::Segment::Create(slots, slot_bytes));
    event_.set_pid(static_cast<uint32_t>(getpid()));
    event_.set_fd(seg->fd());
    event_.set_nonce(seg->nonce());
    event_.set_slots(seg->slots());
    event_.set_slot_bytes(seg->slot_bytes());
    event_.set_file_bytes(seg->file_bytes());
    FLOG(INFO) << "shared memory with " << peer_ << ": " << seg->slots() << " slots of "
               << HumanBytes(seg->slot_bytes()) << " (fd " << seg->fd() << ")";
    absl::MutexLock lock(&mu_);
    session_ = std::make_unique<ShmSession>(ps, std::move(seg), &registry_->requests, &registry_->polled,
                                            registry_->poll, registry_->spare, caller_);
    return absl::OkStatus();
  }

  static constexpr size_t kMaxSessions = 64;
  ShmRegistry* const registry_;
  const std::string peer_;
  const std::string caller_;
  v1::SharedMemoryEvent event_;
  absl::Mutex mu_;
  std::unique_ptr<ShmSession> session_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

class PsGrpcServer::Service final : public ServiceBase {
 public:
  Service(ParameterServer* ps, const security::Transport& transport) : ps_(ps), transport_(transport) {}

  grpc::ServerUnaryReactor* CreateJob(grpc::CallbackServerContext* ctx,
                                      const v1::CreateJobRequest* req,
                                      v1::CreateJobResponse* resp) override {
    // Workers create their job's tables (idempotently, with the spec the
    // coordinator assigned them) before the first push.
    if (auto* refused = RefuseUnless(ctx, "CreateJob", {security::Role::kCoordinator, security::Role::kServer,
                                                        security::Role::kWorker})) {
      return refused;
    }
    auto* reactor = ctx->DefaultReactor();
    auto r = ps_->CreateJob(req->spec());
    if (r.ok()) *resp = *std::move(r);
    reactor->Finish(ToGrpcStatus(r.status()));
    return reactor;
  }

  grpc::ServerUnaryReactor* DeleteJob(grpc::CallbackServerContext* ctx,
                                      const v1::DeleteJobRequest* req,
                                      v1::DeleteJobResponse* resp) override {
    if (auto* refused = RefuseUnlessControl(ctx, "DeleteJob")) return refused;
    auto* reactor = ctx->DefaultReactor();
    auto r = ps_->DeleteJob(req->job_id());
    if (r.ok()) resp->set_bytes_freed(*r);
    reactor->Finish(ToGrpcStatus(r.status()));
    return reactor;
  }

  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* ctx, const v1::GetJobRequest* req,
                                   v1::GetJobResponse* resp) override {
    auto* reactor = ctx->DefaultReactor();
    auto r = ps_->GetJob(req->job_id());
    if (r.ok()) *resp = *std::move(r);
    reactor->Finish(ToGrpcStatus(r.status()));
    return reactor;
  }

  // Checkpoint and Restore wait (for a step, for the disk): they run on a
  // bounded pool of threads, not on gRPC's (Options::blocking_threads).
  grpc::ServerUnaryReactor* Checkpoint(grpc::CallbackServerContext* ctx, const v1::CheckpointRequest* req,
                                       v1::ShardCutMeta* resp) override {
    if (auto* refused = RefuseUnlessControl(ctx, "Checkpoint")) return refused;
    const absl::Duration wait = req->wait_timeout_ms() > 0 ? absl::Milliseconds(req->wait_timeout_ms()) : absl::Seconds(60);
    return AnswerBlocking(control_.get(), ctx, resp,
                          [=, this] { return ps_->Checkpoint(req->job_id(), req->cut_id(), req->at_step(), wait); });
  }

  grpc::ServerUnaryReactor* Restore(grpc::CallbackServerContext* ctx, const v1::RestoreRequest* req,
                                    v1::ShardCutMeta* resp) override {
    if (auto* refused = RefuseUnlessControl(ctx, "Restore")) return refused;
    return AnswerBlocking(control_.get(), ctx, resp, [=, this] {
      std::vector<ParameterServer::CutReader> sources;
      for (const std::string& address : req->sources()) sources.push_back(CutReaderAt(address));
      return ps_->Restore(req->job_id(), req->cut_id(), sources, req->min_incarnation());
    });
  }

  grpc::ServerUnaryReactor* ReadCheckpoint(grpc::CallbackServerContext* ctx, const v1::ReadCheckpointRequest* req,
                                           v1::ReadCheckpointResponse* resp) override {
    if (auto* refused = RefuseUnlessControl(ctx, "ReadCheckpoint")) return refused;
    return AnswerBlocking(reads_.get(), ctx, resp, [=, this] { return ps_->ReadCut(*req); });
  }

  grpc::ServerUnaryReactor* ListCheckpoints(grpc::CallbackServerContext* ctx, const v1::ListCheckpointsRequest* req,
                                            v1::ListCheckpointsResponse* resp) override {
    if (auto* refused = RefuseUnlessControl(ctx, "ListCheckpoints")) return refused;
    auto* reactor = ctx->DefaultReactor();
    auto r = ps_->ListCuts(req->job_id());
    if (r.ok()) {
      for (auto& m : *r) *resp->add_cuts() = std::move(m);
    }
    reactor->Finish(ToGrpcStatus(r.status()));
    return reactor;
  }

  grpc::ServerUnaryReactor* DeleteCheckpoint(grpc::CallbackServerContext* ctx, const v1::DeleteCheckpointRequest* req,
                                             v1::DeleteCheckpointResponse*) override {
    if (auto* refused = RefuseUnlessControl(ctx, "DeleteCheckpoint")) return refused;
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(ToGrpcStatus(ps_->DeleteCut(req->job_id(), req->cut_id())));
    return reactor;
  }

  // The pools' destructors run every call they accepted.
  ~Service() override {
    control_.reset();
    reads_.reset();
  }

  void set_blocking(int threads, size_t queue) {
    control_ = std::make_unique<BoundedExecutor>("checkpoint and restore calls", threads, queue);
    reads_ = std::make_unique<BoundedExecutor>("checkpoint reads", threads, queue);
  }

  grpc::ServerUnaryReactor* GetShardMap(grpc::CallbackServerContext* ctx,
                                        const v1::GetShardMapRequest*,
                                        v1::ShardMap* resp) override {
    auto* reactor = ctx->DefaultReactor();
    auto r = ps_->GetShardMap();
    if (r.ok()) *resp = *std::move(r);
    reactor->Finish(ToGrpcStatus(r.status()));
    return reactor;
  }

  grpc::ServerUnaryReactor* SetShardMap(grpc::CallbackServerContext* ctx,
                                        const v1::SetShardMapRequest* req,
                                        v1::SetShardMapResponse*) override {
    if (auto* refused = RefuseUnlessControl(ctx, "SetShardMap")) return refused;
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(ToGrpcStatus(ps_->SetShardMap(req->map())));
    return reactor;
  }

  grpc::ServerUnaryReactor* Push(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                 grpc::ByteBuffer* resp) override {
    auto* reactor = ctx->DefaultReactor();
    PushMessage m;
    PushResult result;
    absl::Status s = DecodePushBuffer(*req, &m);
    m.caller = transport_.CallerId(*ctx);
    if (s.ok()) s = ps_->Push(m, &result);
    if (s.ok()) *resp = wire::EncodePushResult(result).Finish();
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }

  grpc::ServerUnaryReactor* Pull(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                 grpc::ByteBuffer* resp) override {
    auto* reactor = ctx->DefaultReactor();
    auto m = std::make_shared<PullMessage>();
    absl::Status s = DecodePullBuffer(*req, m.get());
    if (!s.ok()) {
      reactor->Finish(ToGrpcStatus(s));
      return reactor;
    }
    m->caller = transport_.CallerId(*ctx);
    ps_->Pull(std::move(m), DeadlineOf(ctx), [reactor, resp](absl::StatusOr<PullResult> r) {
      if (r.ok()) *resp = wire::EncodePullResult(*std::move(r)).Finish();
      reactor->Finish(ToGrpcStatus(r.status()));
    });
    return reactor;
  }

  grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* Stream(
      grpc::CallbackServerContext* ctx) override {
    return new StreamReactor(ps_, transport_.CallerId(*ctx));
  }

  grpc::ServerWriteReactor<v1::SharedMemoryEvent>* OpenSharedMemory(grpc::CallbackServerContext* ctx,
                                                                    const v1::OpenSharedMemoryRequest* req) override {
    absl::Status allowed =
        shared_memory_ ? transport_.RequireRole(*ctx, {security::Role::kCoordinator, security::Role::kServer,
                                                      security::Role::kWorker},
                                               "ParameterService.OpenSharedMemory")
                       : absl::FailedPreconditionError("this server runs with --shared_memory=false");
    return new ShmReactor(ps_, &shm_, ctx->peer(), transport_.CallerId(*ctx), *req, allowed);
  }

  void set_shared_memory(bool on, absl::Duration poll, SpareCoreProbe spare) {
    shared_memory_ = on;
    shm_.poll = poll;
    shm_.spare = spare;
  }
  size_t shared_memory_sessions() {
    absl::MutexLock lock(&shm_.mu);
    return shm_.open.size();
  }
  uint64_t shared_memory_requests() const { return shm_.requests.load(std::memory_order_relaxed); }
  uint64_t shared_memory_polled() const { return shm_.polled.load(std::memory_order_relaxed); }

  // Ends every shared-memory call (their workers go on over gRPC), stops
  // their threads and refuses new ones. A reactor leaves `open` only in
  // OnDone, under the lock held here, so none is deleted meanwhile.
  void EndSharedMemory() {
    absl::MutexLock lock(&shm_.mu);
    shm_.closed = true;
    for (ShmReactor* r : shm_.open) {
      r->End(grpc::Status(grpc::StatusCode::UNAVAILABLE, "server shutting down"));
      r->StopSession();
    }
  }

 private:
  // Deleting jobs, shard maps and checkpoints are the coordinator's; peer
  // servers read checkpoints (Restore from another server's cut). Workers,
  // whose certificates also pass the handshake, create their job's tables,
  // push, pull and read the job and the shard map.
  // Returns the finished reactor of a refused call, or null.
  grpc::ServerUnaryReactor* RefuseUnlessControl(grpc::CallbackServerContext* ctx, absl::string_view what) {
    return RefuseUnless(ctx, what, {security::Role::kCoordinator, security::Role::kServer});
  }
  grpc::ServerUnaryReactor* RefuseUnless(grpc::CallbackServerContext* ctx, absl::string_view what,
                                         std::initializer_list<security::Role> roles) {
    absl::Status s = transport_.RequireRole(*ctx, roles, absl::StrCat("ParameterService.", what));
    if (s.ok()) return nullptr;
    auto* reactor = ctx->DefaultReactor();
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }

  // Answers a unary call with what `f` returns, computed on a thread of
  // `pool`; RESOURCE_EXHAUSTED, naming the pool's limits, when it is full.
  template <typename Response, typename F>
  grpc::ServerUnaryReactor* AnswerBlocking(BoundedExecutor* pool, grpc::CallbackServerContext* ctx, Response* resp,
                                           F f) {
    auto* reactor = ctx->DefaultReactor();
    absl::Status accepted = pool->Submit([reactor, resp, f = std::move(f)] {
      absl::StatusOr<Response> r = f();
      if (r.ok()) *resp = *std::move(r);
      reactor->Finish(ToGrpcStatus(r.status()));
    });
    if (!accepted.ok()) reactor->Finish(ToGrpcStatus(accepted));
    return reactor;
  }

  // Reads pages of a cut from the server at `address`: this one's own store,
  // or a peer's ReadCheckpoint.
  ParameterServer::CutReader CutReaderAt(const std::string& address) {
    if (ps_->IsSelf(address)) {
      return [this](const v1::ReadCheckpointRequest& r) { return ps_->ReadCut(r); };
    }
    std::shared_ptr<v1::ParameterService::Stub> stub = v1::ParameterService::NewStub(CreateCheckpointChannel(address, transport_));
    return [stub, address](const v1::ReadCheckpointRequest& r) -> absl::StatusOr<v1::ReadCheckpointResponse> {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      v1::ReadCheckpointResponse page;
      absl::Status s = FromGrpcStatus(stub->ReadCheckpoint(&ctx, r, &page));
      if (!s.ok()) return absl::Status(s.code(), absl::StrCat(address, ": ", s.message()));
      return page;
    };
  }

  ParameterServer* const ps_;
  const security::Transport& transport_;  // the PsGrpcServer's
  bool shared_memory_ = true;
  ShmRegistry shm_;
  // Set by set_blocking before the service is registered.
  std::unique_ptr<BoundedExecutor> control_;
  std::unique_ptr<BoundedExecutor> reads_;
};

absl::StatusOr<std::unique_ptr<PsGrpcServer>> PsGrpcServer::Start(
    ParameterServer* ps, const std::string& listen_address, const Options& options) {
  std::unique_ptr<PsGrpcServer> s(new PsGrpcServer());
  s->ps_ = ps;
  s->security_ = security::Transport::OrPlaintext(options.security);
  auto credentials = s->security_->ServerCredentials(security::ClientCerts::kRequired);
  if (credentials == nullptr) {
    return absl::InvalidArgumentError("a client-only TLS transport cannot serve: give the server a member certificate");
  }
  s->service_ = std::make_unique<Service>(ps, *s->security_);
  s->service_->set_shared_memory(options.shared_memory, options.shared_memory_poll, options.spare_core);
  s->service_->set_blocking(options.blocking_threads, options.blocking_queue);
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  ConfigureServerBuilder(builder);
  // Mutual TLS: every caller holds a certificate from the cluster's CA.
  builder.AddListeningPort(listen_address, credentials, &s->port_);
  builder.RegisterService(s->service_.get());
  // Callers passed mutual TLS already: a request that does not parse is
  // INVALID_ARGUMENT (common/rpc/malformed.h).
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  // Push, Pull and Stream decode their own bytes (common/rpc/wire_codec.h).
  interceptors.push_back(NewMalformedRequestInterceptor(
      nullptr, {"/fulcrum.v1.ParameterService/Push", "/fulcrum.v1.ParameterService/Pull",
                "/fulcrum.v1.ParameterService/Stream"}));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  s->reflection_v1_ = NewReflectionV1Service({v1::ParameterService::service_full_name()});
  builder.RegisterService(s->reflection_v1_.get());
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", listen_address,
                                               " (address in use or invalid)"));
  }
  ServeHealthOf(s->server_.get(), {v1::ParameterService::service_full_name()});
  absl::string_view host = listen_address;
  const size_t colon = host.rfind(':');
  if (colon != absl::string_view::npos) host = host.substr(0, colon);
  s->address_ = absl::StrCat(host, ":", s->port_);
  return s;
}

PsGrpcServer::~PsGrpcServer() { Shutdown(); }

size_t PsGrpcServer::shared_memory_sessions() const { return service_->shared_memory_sessions(); }

uint64_t PsGrpcServer::shared_memory_polled() const { return service_->shared_memory_polled(); }

void PsGrpcServer::CollectMetrics(metrics::Scrape* out) const {
  out->Gauge("fulcrum_server_shared_memory_sessions", "Workers on this host talking to this server through shared memory",
             {}, static_cast<double>(service_->shared_memory_sessions()));
  out->Counter("fulcrum_server_shared_memory_requests_total", "Pushes and pulls that came through shared memory", {},
               static_cast<double>(service_->shared_memory_requests()));
  out->Counter("fulcrum_server_shared_memory_polled_total",
               "Shared-memory pushes a session found polling after its worker announced them (no wake-up)", {},
               static_cast<double>(service_->shared_memory_polled()));
}

void PsGrpcServer::Shutdown() {
  // A server that never started (its address was taken) has nothing to stop.
  if (shut_down_ || server_ == nullptr) return;
  shut_down_ = true;
  // Health checks answer NOT_SERVING from here on, so load balancers and
  // Kubernetes stop routing here while pulls drain.
  if (auto* health = server_->GetHealthCheckService()) health->SetServingStatus(false);
  ps_->Drain();
  service_->EndSharedMemory();
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

void PsGrpcServer::Wait() { server_->Wait(); }

}  // namespace fulcrum
