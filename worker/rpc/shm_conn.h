// ShmConn: the worker's end of a shared-memory session with a server on the
// same host (common/rpc/shared_memory.h, docs/wire-protocol.md "Shared
// memory"). Requests go into free slots of the server's memory file and
// responses come back in the same slots; an OpenSharedMemory call stays open
// for the session's life, so either side notices when the other goes away.
//
// A request that finds no free slot waits for one, in order. Pulls leave a
// quarter of the slots (at least one) free for pushes, so pulls parked by
// BSP or SSP never keep out the push that completes their step. A request
// that does not fit a slot is not taken: the caller sends it over gRPC.
#ifndef FULCRUM_WORKER_RPC_SHM_CONN_H_
#define FULCRUM_WORKER_RPC_SHM_CONN_H_

#include <atomic>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include <grpcpp/client_context.h>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/deadline_timer.h"
#include "common/payload.h"
#include "common/rpc/shared_memory.h"
#include "common/rpc/wire_codec.h"
#include "fulcrum/v1/ps.grpc.pb.h"

namespace fulcrum {

class ShmConn {
 public:
  using Callback = std::function<void(absl::Status, Payload body, std::shared_ptr<const void> keepalive)>;

  // Opens a session through `stub`'s server. An error when the server
  // refuses (not on this host, --shared_memory=false, too many sessions) or
  // its memory file cannot be opened from here.
  static absl::StatusOr<std::unique_ptr<ShmConn>> Open(v1::ParameterService::Stub* stub, DeadlineTimer* timer,
                                                       uint32_t slots, uint64_t slot_bytes, absl::Duration timeout);
  // Ends the call and fails what is still pending UNAVAILABLE.
  ~ShmConn();

  bool dead() const { return dead_.load(std::memory_order_acquire); }
  uint64_t slot_bytes() const { return seg_->slot_bytes(); }
  // Requests written into slots so far, and of those how many waited for a
  // slot first.
  uint64_t requests() const;
  uint64_t waited() const;

  // Sends `body` through a slot, now or when one frees, and returns true;
  // `cb` runs with the response (DEADLINE_EXCEEDED if no slot frees by
  // `deadline`). Returns false, leaving `body` and `cb` alone, when the
  // session is dead, the request or a response of `max_response_bytes`
  // would not fit a slot, or (with a single slot) the slot is busy.
  bool Send(bool is_push, wire::Writer* body, size_t max_response_bytes, absl::Time deadline, Callback* cb);

  // Delivers the responses that have landed, on the calling thread, and
  // returns how many: a thread waiting for an answer polls
  // instead of sleeping until the dispatcher wakes it (Promise::SetHelper).
  // Never blocks; does nothing on the session's own threads.
  uint32_t Poll();
  // Rings the server without a request: its session thread wakes and polls
  // for the request this announces (PsGrpcServer::Options::shared_memory_poll).
  void Expect();

  // The slots' bookkeeping (shm_conn.cc); shared with responses' keepalives.
  struct Slots;

 private:
  ShmConn() = default;
  void Dispatch();
  // Runs slot `i`'s callback unless another thread took the response first.
  bool Deliver(uint32_t i);
  // Delivers every response that has landed; returns how many.
  uint32_t DeliverLanded();
  bool OwnThread() const;
  void Expire(uint32_t i, uint64_t id, absl::Time deadline);
  void Die(const absl::Status& why);

  std::shared_ptr<shm::Segment> seg_;
  std::shared_ptr<Slots> slots_;
  DeadlineTimer* timer_ = nullptr;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReader<v1::SharedMemoryEvent>> reader_;
  std::thread reader_thread_;
  std::thread dispatcher_;
  std::atomic<bool> dead_{false};
  std::atomic<bool> stop_{false};
};

}  // namespace fulcrum

#endif  // FULCRUM_WORKER_RPC_SHM_CONN_H_
