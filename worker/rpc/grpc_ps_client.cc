#include "worker/rpc/grpc_ps_client.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <memory>

#include <grpcpp/client_context.h>
#include <grpcpp/generic/generic_stub.h>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/bounded_executor.h"
#include "common/deadline_timer.h"
#include "common/errors.h"
#include "common/rpc/grpc_util.h"
#include "common/rpc/wire_codec.h"
#include "common/shard_map.h"
#include "common/status_macros.h"
#include "common/logging.h"
#include "fulcrum/v1/ps.grpc.pb.h"
#include "worker/rpc/routing.h"
#include "worker/rpc/server_conn.h"
#include "worker/rpc/shm_conn.h"

namespace fulcrum {
namespace {

using conn::ResponseCallback;
using conn::ServerConn;
using conn::ShmSessions;
using conn::StreamConn;
using routing::JobInfo;
using routing::MakeJobInfo;
using routing::PullPart;
using routing::PushPart;

constexpr char kPushMethod[] = "/fulcrum.v1.ParameterService/Push";
constexpr char kPullMethod[] = "/fulcrum.v1.ParameterService/Pull";
// Pushes of at least this many fp32 bytes to several servers are sent on
// one thread per server (PushAsync).
constexpr size_t kSpreadPushBytes = size_t{8} << 20;

// Tracks one PushAsync/PullAsync: completes its future when every message
// (including re-routed ones) is answered; keeps the first error.
struct Op {
  Promise<absl::Status> promise;
  absl::Mutex mu;
  int outstanding ABSL_GUARDED_BY(mu) = 1;  // 1 = planning in progress
  absl::Status status ABSL_GUARDED_BY(mu);
  absl::Time retry_until;

  void Add(int n) {
    absl::MutexLock lock(&mu);
    outstanding += n;
  }
  void Done(const absl::Status& s) {
    absl::Status result;
    {
      absl::MutexLock lock(&mu);
      status.Update(s);
      if (--outstanding > 0) return;
      result = status;
    }
    promise.Set(result);
  }
};

}  // namespace

class GrpcPsClient::Impl {
 public:
  explicit Impl(GrpcPsClientOptions options) : options_(std::move(options)) {}

  absl::Status Init() {
    if (options_.worker_id.empty()) {
      return absl::InvalidArgumentError("GrpcPsClientOptions.worker_id must be set");
    }
    if (DTypeSize(options_.wire_dtype) == 0) {
      return absl::InvalidArgumentError("GrpcPsClientOptions.wire_dtype must be fp32, fp16 or bf16");
    }
    options_.channels_per_server = std::max(1, options_.channels_per_server);
    if (options_.shard_map) {
      ASSIGN_OR_RETURN(ShardMap m, ShardMap::FromProto(*options_.shard_map));
      absl::MutexLock lock(&mu_);
      map_ = std::make_shared<const ShardMap>(std::move(m));
      return absl::OkStatus();
    }
    if (options_.bootstrap_servers.empty()) {
      return absl::InvalidArgumentError("give GrpcPsClientOptions a shard_map or bootstrap_servers");
    }
    absl::Status last;
    for (const std::string& s : options_.bootstrap_servers) {
      last = FetchMap(s, 0);
      if (last.ok()) return last;
    }
    return Annotate(last, "fetching the shard map");
  }

  ~Impl() {
    push_senders_.reset();
    // Unary calls still in flight hold their ClientContext, and with it a
    // reference to a channel: wait until each has dropped it, so the last
    // reference goes with conns_ here, never on gRPC's callback thread
    // (destroying a channel there destroys the completion queue that thread
    // is serving: a double free, found by ASan in load_test).
    {
      absl::MutexLock lock(&calls_mu_);
      calls_mu_.Await(absl::Condition(
          +[](int* n) { return *n == 0; }, &calls_in_flight_));
    }
    // Streams cancel in their destructors and wait for gRPC to let go.
    {
      absl::MutexLock lock(&shm_sessions_->mu);
      shm_sessions_->open.clear();
    }
    absl::MutexLock lock(&mu_);
    for (auto& [addr, conn] : conns_) {
      absl::MutexLock conn_lock(&conn->mu);
      conn->streams.clear();
      conn->shm.reset();
    }
  }

  void ExpectPush() { shm_sessions_->Expect(); }
  uint64_t shm_polled() const { return shm_sessions_->polled.load(std::memory_order_relaxed); }
  uint64_t shm_waited() const { return shm_sessions_->Waited(); }

  // An Op whose waiter polls shared memory for a while before it sleeps.
  std::shared_ptr<Op> NewOp() {
    auto op = std::make_shared<Op>();
    if (options_.shared_memory && options_.shared_memory_poll > absl::ZeroDuration()) {
      op->promise.SetHelper([s = shm_sessions_] { return s->Poll(); }, options_.shared_memory_poll,
                            options_.spare_core);
    }
    return op;
  }

  std::shared_ptr<const ShardMap> map() {
    absl::MutexLock lock(&mu_);
    return map_;
  }

  std::shared_ptr<ServerConn> Conn(const std::string& address) {
    absl::MutexLock lock(&mu_);
    auto& conn = conns_[address];
    if (conn == nullptr) {
      conn = std::make_shared<ServerConn>();
      conn->address = address;
      for (int i = 0; i < options_.channels_per_server; ++i) {
        auto channel = CreateFulcrumChannel(address, i, *security::Transport::OrPlaintext(options_.security));
        if (i == 0) conn->admin = v1::ParameterService::NewStub(channel);
        conn->stubs.push_back(std::make_unique<grpc::GenericStub>(channel));
      }
    }
    return conn;
  }

  // Installs the map held by `address` if newer than `min_version` allows.
  absl::Status FetchMap(const std::string& address, uint64_t min_version) {
    absl::MutexLock refresh(&refresh_mu_);
    {
      absl::MutexLock lock(&mu_);
      if (map_ != nullptr && map_->version() >= min_version && min_version != 0) {
        return absl::OkStatus();  // someone else refreshed already
      }
    }
    auto conn = Conn(address);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
    v1::ShardMap proto;
    RETURN_IF_ERROR(FromGrpcStatus(conn->admin->GetShardMap(&ctx, v1::GetShardMapRequest(), &proto)));
    ASSIGN_OR_RETURN(ShardMap m, ShardMap::FromProto(proto));
    absl::MutexLock lock(&mu_);
    if (map_ == nullptr || m.version() > map_->version()) {
      map_ = std::make_shared<const ShardMap>(std::move(m));
    }
    return absl::OkStatus();
  }

  // Runs an admin call on one server. A server still starting (or
  // restarting), or a connection that just broke, is UNAVAILABLE: asked again
  // with backoff until `retry_until`, as pushes and pulls are.
  template <typename Fn>
  absl::Status AdminCall(const std::string& address, absl::Time retry_until, Fn fn) {
    auto conn = Conn(address);
    for (int attempt = 0;; ++attempt) {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
      absl::Status s = FromGrpcStatus(fn(conn->admin.get(), &ctx));
      if (s.code() != absl::StatusCode::kUnavailable || absl::Now() + Backoff(attempt) >= retry_until) return s;
      absl::SleepFor(Backoff(attempt));
    }
  }

  // Runs an admin call on every server in the map.
  template <typename Fn>
  absl::Status ForEachServer(Fn fn) {
    auto m = map();
    absl::Status result;
    const absl::Time retry_until = absl::Now() + options_.retry_budget;
    for (const std::string& address : m->servers()) {
      result.Update(Annotate(AdminCall(address, retry_until, fn), absl::StrCat("server ", address)));
    }
    return result;
  }

  absl::Status CreateJob(const v1::PsJobSpec& spec) {
    v1::CreateJobRequest req;
    *req.mutable_spec() = spec;
    RETURN_IF_ERROR(ForEachServer([&](v1::ParameterService::Stub* stub, grpc::ClientContext* ctx) {
      v1::CreateJobResponse resp;
      return stub->CreateJob(ctx, req, &resp);
    }));
    ASSIGN_OR_RETURN(auto info, MakeJobInfo(spec));
    absl::MutexLock lock(&mu_);
    jobs_[spec.job_id()] = std::move(info);
    return absl::OkStatus();
  }

  absl::Status OpenJob(const std::string& job_id) {
    ASSIGN_OR_RETURN(v1::GetJobResponse resp, GetJobStats(job_id, 0));
    ASSIGN_OR_RETURN(auto info, MakeJobInfo(resp.spec()));
    absl::MutexLock lock(&mu_);
    jobs_[job_id] = std::move(info);
    return absl::OkStatus();
  }

  absl::Status DeleteJob(const std::string& job_id) {
    v1::DeleteJobRequest req;
    req.set_job_id(job_id);
    absl::Status s = ForEachServer([&](v1::ParameterService::Stub* stub, grpc::ClientContext* ctx) {
      v1::DeleteJobResponse resp;
      return stub->DeleteJob(ctx, req, &resp);
    });
    absl::MutexLock lock(&mu_);
    jobs_.erase(job_id);
    return s;
  }

  absl::StatusOr<v1::GetJobResponse> GetJobStats(const std::string& job_id, size_t server) {
    auto m = map();
    if (server >= m->num_servers()) return absl::InvalidArgumentError("no such server");
    v1::GetJobRequest req;
    req.set_job_id(job_id);
    v1::GetJobResponse resp;
    RETURN_IF_ERROR(AdminCall(m->servers()[server], absl::Now() + options_.retry_budget,
                              [&](v1::ParameterService::Stub* stub, grpc::ClientContext* ctx) {
                                return stub->GetJob(ctx, req, &resp);
                              }));
    return resp;
  }

  absl::StatusOr<std::shared_ptr<const JobInfo>> Job(const std::string& job_id) {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job '", job_id, "' is unknown to this client: call CreateJob or OpenJob first"));
    }
    return it->second;
  }

  // ---------------------------------------------------------------- sending

  // The shared-memory session with `conn`'s server: opened on first use,
  // reopened after it ended; null while the server refuses it.
  std::shared_ptr<ShmConn> SharedMemory(ServerConn& conn) {
    absl::MutexLock lock(&conn.mu);
    if (conn.shm != nullptr && !conn.shm->dead()) return conn.shm;
    if (conn.shm != nullptr) {
      {
        absl::MutexLock lock(&shm_sessions_->mu);
        std::erase(shm_sessions_->open, conn.shm);
      }
      // Not destroyed here: this may be one of its own threads, calling back.
      timer_.Schedule(absl::Now(), [old = std::move(conn.shm)] {});
    }
    if (absl::Now() < conn.shm_retry_at) return nullptr;
    auto opened = ShmConn::Open(conn.admin.get(), &timer_, options_.shared_memory_slots,
                                options_.max_payload_bytes + (64 << 10), absl::Seconds(5));
    if (!opened.ok()) {
      if (!conn.shm_logged) {
        FLOG(INFO) << "no shared memory with " << conn.address << " (" << opened.status() << "); using gRPC";
      }
      conn.shm_logged = true;
      conn.shm_retry_at = absl::Now() + absl::Seconds(30);
      return nullptr;
    }
    if (!conn.shm_logged) {
      FLOG(INFO) << "shared memory with " << conn.address << ": " << options_.shared_memory_slots << " slots of "
                 << HumanBytes((*opened)->slot_bytes());
    }
    conn.shm_logged = true;
    conn.shm = *std::move(opened);
    absl::MutexLock sessions_lock(&shm_sessions_->mu);
    shm_sessions_->open.push_back(conn.shm);
    return conn.shm;
  }

  // Sends one encoded request to `address` and calls back with the body,
  // whose encoding takes at most `max_response_bytes`.
  void Send(const std::string& address, bool is_push, wire::Writer body, size_t max_response_bytes,
            absl::Duration timeout, ResponseCallback cb) {
    auto conn = Conn(address);
    if (options_.shared_memory) {
      std::shared_ptr<ShmConn> shm = SharedMemory(*conn);
      if (shm != nullptr && shm->Send(is_push, &body, max_response_bytes, absl::Now() + timeout, &cb)) {
        shm_requests_.fetch_add(1, std::memory_order_relaxed);
        return;
      }
    }
    const uint32_t i = conn->next.fetch_add(1, std::memory_order_relaxed) % conn->stubs.size();
    if (options_.transport == GrpcPsClientOptions::Transport::kStream) {
      std::shared_ptr<StreamConn> stream;
      {
        absl::MutexLock lock(&conn->mu);
        if (conn->streams.empty()) conn->streams.resize(conn->stubs.size());
        if (conn->streams[i] == nullptr || conn->streams[i]->dead()) {
          conn->streams[i] = std::make_shared<StreamConn>(conn->stubs[i].get(), &timer_);
        }
        stream = conn->streams[i];
      }
      // The ServerConn owns its streams; a stream's destructor waits for
      // OnDone, which fails whatever is still pending, so no callback needs
      // to hold the stream (holding it could drop the last reference inside
      // the stream's own reaction).
      stream->Send(is_push, std::move(body), absl::Now() + timeout, std::move(cb));
      return;
    }
    struct Call {
      grpc::ClientContext ctx;
      grpc::ByteBuffer request;
      grpc::ByteBuffer response;
    };
    auto call = std::make_shared<Call>();
    call->request = body.Finish();
    call->ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    {
      absl::MutexLock lock(&calls_mu_);
      ++calls_in_flight_;
    }
    conn->stubs[i]->UnaryCall(&call->ctx, is_push ? kPushMethod : kPullMethod, grpc::StubOptions(),
                              &call->request, &call->response,
                              [this, call, cb = std::move(cb)](grpc::Status gs) mutable {
                                absl::Status s = FromGrpcStatus(gs);
                                Payload p;
                                std::shared_ptr<const void> keepalive;
                                if (s.ok()) s = wire::ViewByteBuffer(call->response, &p, &keepalive);
                                cb(s, p, keepalive);
                                // Let go of everything while this client
                                // (and its channels) still exists; see ~Impl.
                                cb = nullptr;
                                keepalive.reset();
                                call.reset();
                                absl::MutexLock lock(&calls_mu_);
                                --calls_in_flight_;
                              });
  }

  bool ShouldRetry(const absl::Status& s, const Op& op) {
    return s.code() == absl::StatusCode::kUnavailable && absl::Now() < op.retry_until;
  }

  absl::Duration Backoff(int attempt) {
    return std::min(absl::Milliseconds(20) * (1 << std::min(attempt, 6)), absl::Seconds(1));
  }

  // ---------------------------------------------------------------- push

  Future<absl::Status> PushAsync(const std::string& job_id, const PushBatch& batch) {
    auto op = NewOp();
    op->retry_until = absl::Now() + options_.retry_budget;
    Future<absl::Status> f = op->promise.future();
    auto job = Job(job_id);
    if (!job.ok()) {
      op->Done(job.status());
      return f;
    }
    auto m = map();
    auto planned = routing::PlanPush(*m, **job, batch, options_.wire_dtype, options_.max_payload_bytes);
    if (!planned.ok()) {
      op->Done(planned.status());
      return f;
    }
    auto& parts = *planned;
    const size_t n = m->num_servers();
    std::vector<uint32_t> count(n, 0);
    for (auto& [s, p] : parts) ++count[s];
    // A step pushed in groups: earlier groups' messages say "more follow"
    // (num_parts 0); the last group's carry each server's total, and a
    // server with earlier parts but nothing now gets an empty part with it.
    std::vector<uint32_t> earlier;
    if (!batch.unclocked) {
      absl::MutexLock lock(&open_mu_);
      auto key = std::make_pair(job_id, batch.step);
      if (!batch.last) {
        std::vector<uint32_t>& e = open_steps_[key];
        e.resize(std::max(e.size(), n), 0);
        for (size_t s = 0; s < n; ++s) e[s] += count[s];
      } else if (auto it = open_steps_.find(key); it != open_steps_.end()) {
        earlier = std::move(it->second);
        open_steps_.erase(it);
      }
    }
    earlier.resize(std::max(earlier.size(), n), 0);
    for (uint32_t s = 0; s < n && !batch.unclocked; ++s) {
      if (batch.last && earlier[s] > 0 && count[s] == 0) {
        parts.emplace_back(s, std::make_shared<PushPart>());
        ++count[s];
      }
    }
    op->Add(static_cast<int>(parts.size()));
    size_t bytes = 0;
    for (const DenseGradient& g : batch.dense) bytes += g.size * 4;
    // A large push to several servers (a local round's pseudo-gradient):
    // each server's parts are encoded and sent on a thread of their own, in
    // order. On one thread, converting 20M parameters to bf16 and copying
    // them into shared memory took longer than a GPU's round of 16 steps.
    const bool spread = n > 1 && bytes >= kSpreadPushBytes;
    std::vector<std::vector<std::function<void()>>> per_server(spread ? n : 0);
    for (auto& [s, p] : parts) {
      p->lr_scale = batch.lr_scale;
      p->samples = batch.samples;
      p->unclocked = batch.unclocked;
      auto send = [this, op, job = *job, m, s = s, job_id, step = batch.step,
                   num_parts = batch.last ? earlier[s] + count[s] : 0, p = std::move(p),
                   seq = next_seq_.fetch_add(1, std::memory_order_relaxed)]() mutable {
        SendPush(op, job, m, s, job_id, step, num_parts, std::move(p), seq, 0);
      };
      if (spread) {
        per_server[s].push_back(std::move(send));
      } else {
        send();
      }
    }
    for (auto& sends : per_server) {
      if (sends.empty()) continue;
      auto run = [sends = std::move(sends)]() mutable {
        for (auto& send : sends) send();
      };
      if (!push_senders_->Submit(run).ok()) run();  // every sender busy and its queue full: on this thread
    }
    op->Done(absl::OkStatus());
    return f;
  }

  void SendPush(std::shared_ptr<Op> op, std::shared_ptr<const JobInfo> job,
                std::shared_ptr<const ShardMap> m, uint32_t server, const std::string& job_id,
                uint64_t step, uint32_t num_parts, std::shared_ptr<PushPart> part, uint64_t seq,
                int attempt) {
    PushMessage msg;
    msg.job_id = job_id;
    msg.worker_id = options_.worker_id;
    msg.incarnation = options_.incarnation;
    msg.seq = seq;
    msg.rank = options_.rank;
    msg.step = step;
    msg.lr_scale = part->lr_scale;
    msg.samples = part->samples;
    msg.unclocked = part->unclocked;
    msg.num_parts = num_parts;
    msg.more_parts = num_parts == 0;
    msg.shard_map_version = m->version();
    const DType dt = options_.wire_dtype;
    // Converted payloads live in `encoded` until the call completes.
    auto encoded = std::make_shared<std::vector<OwnedBuffer>>();
    auto view = [&](const float* data, size_t n) {
      if (dt == DType::kFp32) return Payload(data, n * 4);
      OwnedBuffer& buf = encoded->emplace_back(OwnedBuffer::Allocate(n * DTypeSize(dt)));
      EncodeFloats(data, n, dt, buf.data.get());
      return Payload(buf.data.get(), buf.size);
    };
    for (const PushPart::Dense& d : part->dense) {
      msg.dense.push_back({d.table->name, d.chunk, dt, view(d.data, d.table->ChunkLength(d.chunk))});
    }
    for (const PushPart::Sparse& s : part->sparse) {
      SparseSliceView v;
      v.table = s.table->name;
      v.dtype = dt;
      v.keys = Payload(s.keys.data(), s.keys.size() * 8);
      v.values = view(s.values.data(), s.values.size());
      msg.sparse.push_back(std::move(v));
    }
    const std::string address = m->servers()[server];
    Send(address, true, wire::EncodePush(msg), kPushResponseBytes, options_.rpc_timeout,
         [=, this](absl::Status s, Payload body, std::shared_ptr<const void>) {
           (void)encoded;  // held until the response arrives
           if (s.ok()) {
             PushResult r;
             s = wire::DecodePushResult(body, &r);
             op->Done(s);
             return;
           }
           if (ShouldRetry(s, *op)) {
             timer_.Schedule(absl::Now() + Backoff(attempt), [=, this] {
               SendPush(op, job, m, server, job_id, step, num_parts, part, seq, attempt + 1);
             });
             return;
           }
           // Parts applied on arrival are independent: re-sliced under a
           // new map. A synchronous step's are not (they count toward it).
           if (auto version = WrongShardVersion(s); version && (!job->synchronous || part->unclocked)) {
             timer_.Schedule(absl::Now(),
                             [=, this] { ReroutePush(op, job, address, *version, job_id, step, num_parts, part); });
             return;
           }
           op->Done(Annotate(s, absl::StrCat("push to ", address)));
         });
  }

  void ReroutePush(std::shared_ptr<Op> op, std::shared_ptr<const JobInfo> job,
                   const std::string& address, uint64_t version, const std::string& job_id,
                   uint64_t step, uint32_t num_parts, std::shared_ptr<PushPart> part) {
    absl::Status s = FetchMap(address, version);
    if (!s.ok()) {
      op->Done(Annotate(s, "refreshing the shard map"));
      return;
    }
    auto m = map();
    // Re-slice the rejected part under the new map (ASP: parts are independent).
    auto parts = routing::ReslicePush(*m, *part, options_.wire_dtype, options_.max_payload_bytes);
    op->Add(static_cast<int>(parts.size()));
    for (auto& [srv, p] : parts) {
      p->lr_scale = part->lr_scale;
      p->samples = part->samples;
      p->unclocked = part->unclocked;
      SendPush(op, job, m, srv, job_id, step, num_parts == 0 ? 0 : 1, std::move(p),
               next_seq_.fetch_add(1, std::memory_order_relaxed), 0);
    }
    op->Done(absl::OkStatus());  // the rejected part is replaced by the new ones
  }

  // ---------------------------------------------------------------- pull

  routing::Parts<PullPart> PlanPull(const ShardMap& m, const std::vector<PullPart::Dense>& dense,
                                    const std::vector<PullPart::Sparse>& sparse) {
    return routing::PlanPull(m, dense, sparse, options_.wire_dtype, options_.max_payload_bytes);
  }

  Future<absl::Status> PullAsync(const std::string& job_id, const PullBatch& batch) {
    auto op = NewOp();
    op->retry_until = absl::Now() + options_.retry_budget + options_.pull_wait_timeout;
    Future<absl::Status> f = op->promise.future();
    auto job = Job(job_id);
    if (!job.ok()) {
      op->Done(job.status());
      return f;
    }
    std::vector<PullPart::Dense> dense;
    std::vector<PullPart::Sparse> sparse;
    for (const DenseTarget& d : batch.dense) {
      auto it = (*job)->tables.find(d.table);
      if (it == (*job)->tables.end() || !it->second.dense) {
        op->Done(absl::InvalidArgumentError(
            absl::StrCat("job '", job_id, "' has no dense table '", d.table, "'")));
        return f;
      }
      if (d.size != it->second.num_elements) {
        op->Done(absl::InvalidArgumentError(absl::StrCat("table '", d.table, "' has ",
                                                         it->second.num_elements,
                                                         " elements; pull target has ", d.size)));
        return f;
      }
      for (uint32_t c = 0; c < it->second.num_chunks; ++c) {
        dense.push_back({&it->second, c, d.out + uint64_t{c} * it->second.chunk_elements});
      }
    }
    for (const SparseTarget& t : batch.sparse) {
      auto it = (*job)->tables.find(t.table);
      if (it == (*job)->tables.end() || it->second.dense) {
        op->Done(absl::InvalidArgumentError(
            absl::StrCat("job '", job_id, "' has no sparse table '", t.table, "'")));
        return f;
      }
      PullPart::Sparse& sp = sparse.emplace_back();
      sp.table = &it->second;
      sp.keys.assign(t.keys, t.keys + t.num_keys);
      for (size_t k = 0; k < t.num_keys; ++k) sp.out.push_back(t.out + k * it->second.dim);
    }
    auto m = map();
    auto parts = PlanPull(*m, dense, sparse);
    op->Add(static_cast<int>(parts.size()));
    for (auto& [s, p] : parts) {
      p->unclocked = batch.unclocked;
      p->exact = batch.exact;
      SendPull(op, *job, m, s, job_id, batch.step, std::move(p), 0);
    }
    op->Done(absl::OkStatus());
    return f;
  }

  void Prefetch(const std::string& job_id, const std::vector<SparseTarget>& keys) {
    auto job = Job(job_id);
    if (!job.ok()) return;
    std::vector<PullPart::Sparse> sparse;
    for (const SparseTarget& t : keys) {
      auto it = (*job)->tables.find(t.table);
      if (it == (*job)->tables.end() || it->second.dense || t.num_keys == 0) continue;
      PullPart::Sparse& sp = sparse.emplace_back();
      sp.table = &it->second;
      sp.keys.assign(t.keys, t.keys + t.num_keys);
      sp.out.assign(t.num_keys, nullptr);
    }
    if (sparse.empty()) return;
    auto op = NewOp();
    op->retry_until = absl::Now();  // a hint is not retried
    auto m = map();
    auto parts = PlanPull(*m, {}, sparse);
    op->Add(static_cast<int>(parts.size()));
    for (auto& [s, p] : parts) {
      p->prefetch = true;
      SendPull(op, *job, m, s, job_id, 0, std::move(p), 0);
    }
    op->Done(absl::OkStatus());
  }

  static absl::Status Deliver(const PullPart& part, DType dtype, const PullResponseView& r) {
    if (r.dense.size() != part.dense.size() || r.sparse.size() != part.sparse.size()) {
      return absl::InternalError(absl::StrCat("pull response has ", r.dense.size(), " dense and ",
                                              r.sparse.size(), " sparse slices; asked for ",
                                              part.dense.size(), " and ", part.sparse.size()));
    }
    const size_t esize = DTypeSize(dtype);
    thread_local std::vector<uint8_t> scratch;
    for (size_t i = 0; i < part.dense.size(); ++i) {
      const PullPart::Dense& want = part.dense[i];
      const DenseSliceView& got = r.dense[i];
      const size_t n = want.table->ChunkLength(want.chunk);
      if (got.table != want.table->name || got.chunk != want.chunk || got.dtype != dtype ||
          got.data.size() != n * esize) {
        return absl::InternalError(absl::StrCat("pull response slice ", i, " does not match table '",
                                                want.table->name, "' chunk ", want.chunk));
      }
      // Straight from the received slices into the caller's tensor, piece by
      // piece, unless a piece boundary splits an element.
      bool whole = true;
      for (const ByteSpan& piece : got.data.pieces()) whole = whole && piece.size % esize == 0;
      if (whole) {
        float* out = want.out;
        for (const ByteSpan& piece : got.data.pieces()) {
          DecodeFloats(piece.data, piece.size / esize, dtype, out);
          out += piece.size / esize;
        }
      } else {
        scratch.resize(got.data.size());
        got.data.CopyTo(scratch.data());
        DecodeFloats(scratch.data(), n, dtype, want.out);
      }
    }
    for (size_t i = 0; i < part.sparse.size(); ++i) {
      const PullPart::Sparse& want = part.sparse[i];
      const SparseSliceView& got = r.sparse[i];
      const size_t dim = want.table->dim;
      if (got.values.size() != want.keys.size() * dim * esize) {
        return absl::InternalError(absl::StrCat("pull response for table '", want.table->name,
                                                "' has ", got.values.size(), " bytes; expected ",
                                                want.keys.size() * dim * esize));
      }
      scratch.resize(got.values.size());
      got.values.CopyTo(scratch.data());
      for (size_t k = 0; k < want.keys.size(); ++k) {
        DecodeFloats(scratch.data() + k * dim * esize, dim, dtype, want.out[k]);
      }
    }
    return absl::OkStatus();
  }

  void SendPull(std::shared_ptr<Op> op, std::shared_ptr<const JobInfo> job,
                std::shared_ptr<const ShardMap> m, uint32_t server, const std::string& job_id,
                uint64_t step, std::shared_ptr<PullPart> part, int attempt) {
    PullMessage msg;
    msg.job_id = job_id;
    msg.worker_id = options_.worker_id;
    msg.incarnation = options_.incarnation;
    msg.rank = options_.rank;
    msg.step = step;
    msg.unclocked = part->unclocked;
    msg.prefetch = part->prefetch;
    msg.shard_map_version = m->version();
    msg.dtype = options_.wire_dtype;
    msg.wait_timeout_ms = static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.pull_wait_timeout));
    for (const PullPart::Dense& d : part->dense) msg.dense.push_back({d.table->name, d.chunk});
    for (const PullPart::Sparse& s : part->sparse) {
      msg.sparse.push_back({s.table->name, Payload(s.keys.data(), s.keys.size() * 8)});
    }
    const std::string address = m->servers()[server];
    const DType dtype = options_.wire_dtype;
    // The response's size, bounded from above: each slice's values, its
    // table's name and ~30 bytes of tags, lengths and numbers.
    size_t response_bytes = 256;
    const size_t esize = DTypeSize(dtype);
    for (const PullPart::Dense& d : part->dense) {
      response_bytes += d.table->name.size() + 32 + size_t{d.table->ChunkLength(d.chunk)} * esize;
    }
    for (const PullPart::Sparse& sp : part->sparse) {
      if (part->prefetch) continue;  // answered with no rows
      response_bytes += sp.table->name.size() + 32 + sp.keys.size() * sp.table->dim * esize;
    }
    Send(address, false, wire::EncodePull(msg), response_bytes, options_.pull_wait_timeout + options_.rpc_timeout,
         [=, this](absl::Status s, Payload body, std::shared_ptr<const void> keepalive) {
           if (part->prefetch) {
             // A hint's answer carries no rows; a failed hint is dropped.
             op->Done(s);
             return;
           }
           if (s.ok()) {
             // `body` views the response slices `keepalive` owns until we return.
             PullResponseView r;
             r.keepalive = std::move(keepalive);
             s = wire::DecodePullResponse(body, &r);
             if (s.ok() && part->exact && r.applied_step > step) s = TornStepError(step, r.applied_step, address);
             if (s.ok()) s = Deliver(*part, dtype, r);
             op->Done(Annotate(s, absl::StrCat("pull from ", address)));
             return;
           }
           if (ShouldRetry(s, *op)) {
             timer_.Schedule(absl::Now() + Backoff(attempt), [=, this] {
               SendPull(op, job, m, server, job_id, step, part, attempt + 1);
             });
             return;
           }
           if (auto version = WrongShardVersion(s)) {
             timer_.Schedule(absl::Now(), [=, this] {
               absl::Status fs = FetchMap(address, *version);
               if (!fs.ok()) {
                 op->Done(Annotate(fs, "refreshing the shard map"));
                 return;
               }
               auto nm = map();
               auto parts = PlanPull(*nm, part->dense, part->sparse);
               op->Add(static_cast<int>(parts.size()));
               for (auto& [srv, p] : parts) {
                 p->unclocked = part->unclocked;
                 p->exact = part->exact;
                 SendPull(op, job, nm, srv, job_id, step, p, 0);
               }
               op->Done(absl::OkStatus());
             });
             return;
           }
           op->Done(Annotate(s, absl::StrCat("pull from ", address)));
         });
  }

 private:
  // A PushResponse: a few numbers, and an error message when one fails.
  static constexpr size_t kPushResponseBytes = 8 << 10;

  GrpcPsClientOptions options_;
  std::atomic<uint64_t> next_seq_{1};
 public:
  std::atomic<uint64_t> shm_requests_{0};

 private:
  const std::shared_ptr<ShmSessions> shm_sessions_ = std::make_shared<ShmSessions>();
  absl::Mutex refresh_mu_;
  absl::Mutex mu_;
  std::shared_ptr<const ShardMap> map_ ABSL_GUARDED_BY(mu_);
  absl::Mutex calls_mu_;
  int calls_in_flight_ ABSL_GUARDED_BY(calls_mu_) = 0;  // unary calls not yet finished with
  absl::flat_hash_map<std::string, std::shared_ptr<ServerConn>> conns_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, std::shared_ptr<const JobInfo>> jobs_ ABSL_GUARDED_BY(mu_);
  // Steps pushed in groups whose last group has not gone yet: parts sent so
  // far per server, by (job, step).
  absl::Mutex open_mu_;
  absl::flat_hash_map<std::pair<std::string, uint64_t>, std::vector<uint32_t>> open_steps_
      ABSL_GUARDED_BY(open_mu_);
  // Runs retries and re-routes off gRPC's threads. Declared last so it stops
  // (and drops its pending closures) before the members they use go away.
  DeadlineTimer timer_;
  // Large pushes' per-server sends (PushAsync); the destructor finishes
  // those it accepted before anything else goes.
  std::unique_ptr<BoundedExecutor> push_senders_ = std::make_unique<BoundedExecutor>("push senders", 8, 4096);
};

absl::StatusOr<std::unique_ptr<PsClient>> NewRemotePsClient(RemotePsClientOptions options) {
  ASSIGN_OR_RETURN(std::unique_ptr<GrpcPsClient> client, GrpcPsClient::Create(std::move(options)));
  return std::unique_ptr<PsClient>(std::move(client));
}

absl::StatusOr<std::unique_ptr<GrpcPsClient>> GrpcPsClient::Create(GrpcPsClientOptions options) {
  auto impl = std::make_unique<Impl>(std::move(options));
  RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<GrpcPsClient>(new GrpcPsClient(std::move(impl)));
}

GrpcPsClient::GrpcPsClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
GrpcPsClient::~GrpcPsClient() = default;

absl::Status GrpcPsClient::CreateJob(const v1::PsJobSpec& spec) { return impl_->CreateJob(spec); }
absl::Status GrpcPsClient::OpenJob(const std::string& job_id) { return impl_->OpenJob(job_id); }
absl::Status GrpcPsClient::DeleteJob(const std::string& job_id) { return impl_->DeleteJob(job_id); }
Future<absl::Status> GrpcPsClient::PushAsync(const std::string& job_id, const PushBatch& batch) {
  return impl_->PushAsync(job_id, batch);
}
Future<absl::Status> GrpcPsClient::PullAsync(const std::string& job_id, const PullBatch& batch) {
  return impl_->PullAsync(job_id, batch);
}
absl::StatusOr<v1::GetJobResponse> GrpcPsClient::GetJobStats(const std::string& job_id,
                                                             size_t server) {
  return impl_->GetJobStats(job_id, server);
}
uint64_t GrpcPsClient::shard_map_version() const { return impl_->map()->version(); }
void GrpcPsClient::ExpectPush() { impl_->ExpectPush(); }

void GrpcPsClient::Prefetch(const std::string& job_id, const std::vector<SparseTarget>& keys) {
  impl_->Prefetch(job_id, keys);
}

uint64_t GrpcPsClient::shared_memory_polled() const { return impl_->shm_polled(); }
uint64_t GrpcPsClient::shared_memory_waited() const { return impl_->shm_waited(); }

uint64_t GrpcPsClient::shared_memory_requests() const {
  return impl_->shm_requests_.load(std::memory_order_relaxed);
}

}  // namespace fulcrum
