// A worker's connections to one parameter server, for GrpcPsClient: the
// gRPC stubs and bidirectional streams per channel, and shared memory with
// a server on this host (the sessions every waiting thread may poll).
#ifndef FULCRUM_WORKER_RPC_SERVER_CONN_H_
#define FULCRUM_WORKER_RPC_SERVER_CONN_H_

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/client_callback.h>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/deadline_timer.h"
#include "common/rpc/grpc_util.h"
#include "common/rpc/wire_codec.h"
#include "fulcrum/v1/ps.grpc.pb.h"
#include "worker/rpc/shm_conn.h"

namespace fulcrum::conn {

inline constexpr char kStreamMethod[] = "/fulcrum.v1.ParameterService/Stream";

using ResponseCallback =
    std::function<void(absl::Status, Payload body, std::shared_ptr<const void> keepalive)>;

// One bidirectional stream to a server. Requests carry ids; responses may
// come in any order. Dies (and fails its pending requests UNAVAILABLE) when
// the stream breaks; the owner then opens a new one. Each request has a
// deadline, as a unary call has: one without a response by then fails
// DEADLINE_EXCEEDED (a server that hangs without closing the connection).
//
// Writes start from the caller's thread, outside gRPC's reactions, so the
// stream keeps a hold: without one, gRPC tears the call down as soon as its
// last operation completes - before OnDone runs - and a write started in
// between lands in freed memory (a heap corruption when a server dies under
// a busy worker; tests/server "streams cut again and again"). The hold goes
// when the read fails, which every end of the stream causes, after no
// further write can start.
class StreamConn final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>,
                         public std::enable_shared_from_this<StreamConn> {
 public:
  StreamConn(grpc::GenericStub* stub, DeadlineTimer* timer) : timer_(timer) {
    stub->PrepareBidiStreamingCall(&ctx_, kStreamMethod, grpc::StubOptions(), this);
    AddHold();
    StartRead(&in_);
    StartCall();
  }

  ~StreamConn() override {
    ctx_.TryCancel();
    done_.WaitForNotification();
  }

  bool dead() {
    absl::MutexLock lock(&mu_);
    return dead_;
  }

  void Send(bool is_push, wire::Writer body, absl::Time deadline, ResponseCallback cb) {
    {
      absl::MutexLock lock(&mu_);
      if (!dead_) {
        const uint64_t id = next_id_++;
        Pending& p = pending_[id];
        p.cb = std::move(cb);
        p.timer = timer_->Schedule(deadline, [weak = weak_from_this(), id, deadline] {
          if (auto self = weak.lock()) self->Expire(id, deadline);
        });
        out_.push_back(wire::EncodeStreamRequest(id, is_push, std::move(body)).Finish());
        if (!writing_) {
          writing_ = true;
          StartWrite(&out_.front());
        }
        return;
      }
    }
    cb(absl::UnavailableError("stream to server closed"), Payload(), nullptr);
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    out_.pop_front();
    if (ok && !dead_ && !out_.empty()) {
      StartWrite(&out_.front());
    } else {
      writing_ = false;
    }
  }

  void OnReadDone(bool ok) override {
    if (!ok) {
      // The stream is ending: no write starts from here on, and gRPC may
      // finish it (OnDone fails what is still pending).
      {
        absl::MutexLock lock(&mu_);
        dead_ = true;
      }
      RemoveHold();
      return;
    }
    grpc::ByteBuffer buf;
    buf.Swap(&in_);
    StartRead(&in_);
    Payload p;
    std::shared_ptr<const void> keepalive;
    wire::StreamResponseView resp;
    absl::Status s = wire::ViewByteBuffer(buf, &p, &keepalive);
    if (s.ok()) s = wire::DecodeStreamResponse(p, &resp);
    if (!s.ok()) return;  // a response we cannot read; its request times out with the stream
    Pending done;
    if (!Take(resp.id, &done)) return;  // expired
    timer_->Cancel(done.timer);
    done.cb(wire::StatusOf(resp), resp.body, keepalive);
  }

  void OnDone(const grpc::Status& s) override {
    absl::flat_hash_map<uint64_t, Pending> pending;
    {
      absl::MutexLock lock(&mu_);
      dead_ = true;
      pending.swap(pending_);
    }
    for (auto& [id, p] : pending) {
      timer_->Cancel(p.timer);
      p.cb(absl::UnavailableError(absl::StrCat("stream closed: ", s.error_message())), Payload(),
           nullptr);
    }
    done_.Notify();
  }

 private:
  struct Pending {
    ResponseCallback cb;
    uint64_t timer = 0;
  };

  // Removes request `id` from the pending ones into *out; false when its
  // response or its deadline came first.
  bool Take(uint64_t id, Pending* out) {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return false;
    *out = std::move(it->second);
    pending_.erase(it);
    return true;
  }

  void Expire(uint64_t id, absl::Time deadline) {
    Pending p;
    if (!Take(id, &p)) return;
    p.cb(absl::DeadlineExceededError(absl::StrCat("no response on the stream to the server by its deadline (",
                                                  absl::FormatTime(deadline), ")")),
         Payload(), nullptr);
  }

  DeadlineTimer* const timer_;
  grpc::ClientContext ctx_;
  grpc::ByteBuffer in_;
  absl::Mutex mu_;
  bool dead_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::deque<grpc::ByteBuffer> out_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  absl::Notification done_;
};

struct ServerConn {
  std::string address;
  std::vector<std::unique_ptr<grpc::GenericStub>> stubs;
  std::unique_ptr<v1::ParameterService::Stub> admin;
  std::atomic<uint32_t> next{0};
  absl::Mutex mu;
  // One stream per channel (so per TCP connection), opened on first use.
  std::vector<std::shared_ptr<StreamConn>> streams ABSL_GUARDED_BY(mu);
  // Shared memory with a server on this host, opened on first use; after a
  // refusal, not asked again before shm_retry_at.
  std::shared_ptr<ShmConn> shm ABSL_GUARDED_BY(mu);
  absl::Time shm_retry_at ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  bool shm_logged ABSL_GUARDED_BY(mu) = false;
};

// The open shared-memory sessions, for the helper of every future
// (Promise::SetHelper): the thread waiting for a push or pull reads the
// answers out of shared memory itself. Shared with the futures, which may
// outlive the client.
struct ShmSessions {
  absl::Mutex mu;
  std::vector<std::shared_ptr<ShmConn>> open ABSL_GUARDED_BY(mu);
  std::atomic<uint64_t> polled{0};  // responses a waiting thread took itself

  bool Poll() {
    // Copied so a callback that opens a session does not wait on `mu`; a
    // session is polled only from threads that are not its own (Poll), so
    // the last copy may go here.
    absl::InlinedVector<std::shared_ptr<ShmConn>, 4> conns;
    {
      absl::MutexLock lock(&mu);
      conns.assign(open.begin(), open.end());
    }
    uint64_t n = 0;
    for (const auto& c : conns) n += c->Poll();
    if (n != 0) polled.fetch_add(n, std::memory_order_relaxed);
    return n != 0;
  }

  uint64_t Waited() {
    absl::MutexLock lock(&mu);
    uint64_t n = 0;
    for (const auto& c : open) n += c->waited();
    return n;
  }

  void Expect() {
    absl::MutexLock lock(&mu);
    for (const auto& c : open) c->Expect();
  }
};

}  // namespace fulcrum::conn

#endif  // FULCRUM_WORKER_RPC_SERVER_CONN_H_
