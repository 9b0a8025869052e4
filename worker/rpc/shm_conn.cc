#include "worker/rpc/shm_conn.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/errors.h"
#include "common/rpc/grpc_util.h"

namespace fulcrum {

// What the worker knows of each slot, kept in its own memory: the server's
// writes to the file never decide which callback runs.
struct ShmConn::Slots {
  struct Pending {
    bool in_use = false;  // from TrySend until the response's keepalive goes
    uint64_t id = 0;      // the request awaiting a response; 0 when none
    Callback cb;          // null once answered, expired or failed
    uint64_t timer = 0;
  };
  absl::Mutex mu;
  std::vector<Pending> pending ABSL_GUARDED_BY(mu);
  uint64_t next_id ABSL_GUARDED_BY(mu) = 1;
  bool dead ABSL_GUARDED_BY(mu) = false;
};

absl::StatusOr<std::unique_ptr<ShmConn>> ShmConn::Open(v1::ParameterService::Stub* stub, DeadlineTimer* timer,
                                                       uint32_t slots, uint64_t slot_bytes,
                                                       absl::Duration timeout) {
  std::unique_ptr<ShmConn> c(new ShmConn());
  c->timer_ = timer;
  c->slots_ = std::make_shared<Slots>();
  v1::OpenSharedMemoryRequest req;
  req.set_slots(slots);
  req.set_slot_bytes(slot_bytes);
  c->reader_ = stub->OpenSharedMemory(&c->ctx_, req);
  // The first event describes the file; the call then stays open until one
  // side ends it. Read on a thread of its own, so the wait for the first
  // event can time out.
  struct First {
    absl::Notification got;
    bool ok = false;
    v1::SharedMemoryEvent event;
    grpc::Status status;
  };
  auto first = std::make_shared<First>();
  ShmConn* self = c.get();
  c->reader_thread_ = std::thread([self, first] {
    v1::SharedMemoryEvent ev;
    first->ok = self->reader_->Read(&first->event);
    if (!first->ok) first->status = self->reader_->Finish();
    first->got.Notify();
    if (!first->ok) return;
    while (self->reader_->Read(&ev)) {
    }
    const grpc::Status st = self->reader_->Finish();
    self->Die(absl::UnavailableError(absl::StrCat("the server ended shared memory: ", st.error_message())));
  });
  if (!first->got.WaitForNotificationWithTimeout(timeout)) {
    c->ctx_.TryCancel();
    return absl::DeadlineExceededError("no answer to OpenSharedMemory in time");
  }
  if (!first->ok) return FromGrpcStatus(first->status);
  const v1::SharedMemoryEvent& ev = first->event;
  absl::StatusOr<std::shared_ptr<shm::Segment>> seg =
      shm::Segment::Attach(ev.pid(), ev.fd(), ev.nonce(), ev.slots(), ev.slot_bytes(), ev.file_bytes());
  if (!seg.ok()) {
    c->ctx_.TryCancel();
    return seg.status();
  }
  {
    absl::MutexLock lock(&c->slots_->mu);
    c->seg_ = *std::move(seg);
    c->slots_->pending.resize(c->seg_->slots());
  }
  c->dispatcher_ = std::thread([self] { self->Dispatch(); });
  return c;
}

ShmConn::~ShmConn() {
  stop_.store(true);
  ctx_.TryCancel();
  if (seg_ != nullptr) shm::Ring(seg_->client_bell());
  if (dispatcher_.joinable()) dispatcher_.join();
  if (reader_thread_.joinable()) reader_thread_.join();
  Die(absl::UnavailableError("shared memory with the server closed"));
}

bool ShmConn::TrySend(bool is_push, wire::Writer* body, size_t max_response_bytes, absl::Time deadline,
                      Callback* cb) {
  // A StreamRequest adds at most 23 bytes (id, tags, length) to its body.
  if (dead() || max_response_bytes > seg_->slot_bytes() || body->size() + 32 > seg_->slot_bytes()) return false;
  uint32_t i = 0;
  uint64_t id = 0;
  {
    absl::MutexLock lock(&slots_->mu);
    if (slots_->dead) return false;
    while (i < slots_->pending.size() && slots_->pending[i].in_use) ++i;
    if (i == slots_->pending.size()) return false;
    Slots::Pending& p = slots_->pending[i];
    p.in_use = true;
    p.id = id = slots_->next_id++;
    p.cb = std::move(*cb);
    p.timer = timer_->Schedule(deadline, [slots = slots_, i, id, deadline] {
      Callback expired;
      {
        absl::MutexLock lock(&slots->mu);
        Slots::Pending& q = slots->pending[i];
        if (q.id != id) return;
        // The slot stays taken until the server answers into it.
        expired = std::move(q.cb);
        q.cb = nullptr;
      }
      if (expired) {
        expired(absl::DeadlineExceededError(absl::StrCat("no response through shared memory by its deadline (",
                                                         absl::FormatTime(deadline), ")")),
                Payload(), nullptr);
      }
    });
  }
  const size_t n = wire::EncodeStreamRequest(id, is_push, std::move(*body)).FinishInto(seg_->request(i));
  shm::SlotControl& slot = seg_->slot(i);
  slot.request_bytes.store(static_cast<uint32_t>(n), std::memory_order_relaxed);
  slot.state.store(shm::kRequest, std::memory_order_release);
  shm::Ring(seg_->server_bell());
  requests_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void ShmConn::Dispatch() {
  while (!stop_.load()) {
    const uint32_t seen = seg_->client_bell().count.load(std::memory_order_acquire);
    DeliverLanded();
    shm::Wait(seg_->client_bell(), seen, absl::Milliseconds(50), stop_);
  }
}

bool ShmConn::OwnThread() const {
  const std::thread::id me = std::this_thread::get_id();
  return me == dispatcher_.get_id() || me == reader_thread_.get_id();
}

uint32_t ShmConn::Poll() { return dead() || OwnThread() ? 0 : DeliverLanded(); }

uint32_t ShmConn::DeliverLanded() {
  uint32_t n = 0;
  for (uint32_t i = 0; i < seg_->slots(); ++i) {
    if (seg_->slot(i).state.load(std::memory_order_acquire) == shm::kResponse && Deliver(i)) ++n;
  }
  return n;
}

void ShmConn::Expect() {
  if (!dead()) shm::Ring(seg_->server_bell());
}

bool ShmConn::Deliver(uint32_t i) {
  Callback cb;
  uint64_t id;
  {
    // Whoever clears the pending id first delivers the response. Checked
    // again under the lock: by now another thread may have delivered it,
    // let it go and sent a new request through the slot (the id is then
    // that request's, and the state is no longer RESPONSE until the server
    // answers it).
    absl::MutexLock lock(&slots_->mu);
    Slots::Pending& p = slots_->pending[i];
    if (p.id == 0 || seg_->slot(i).state.load(std::memory_order_acquire) != shm::kResponse) return false;
    id = p.id;
    p.id = 0;
    cb = std::move(p.cb);
    p.cb = nullptr;
    if (cb) timer_->Cancel(p.timer);
  }
  // The slot is free again once the response has been read: when the last
  // holder of this keepalive lets go.
  std::shared_ptr<const void> keepalive(seg_.get(), [seg = seg_, slots = slots_, i](const void*) {
    seg->slot(i).state.store(shm::kFree, std::memory_order_release);
    absl::MutexLock lock(&slots->mu);
    slots->pending[i].in_use = false;
  });
  if (!cb) return true;  // expired or failed already
  const uint64_t n = seg_->slot(i).response_bytes.load(std::memory_order_relaxed);
  absl::Status s;
  wire::StreamResponseView resp;
  if (n > seg_->slot_bytes()) {
    s = absl::InternalError(absl::StrCat("shared-memory response of ", n, " bytes in a slot of ", seg_->slot_bytes()));
  } else {
    s = wire::DecodeStreamResponse(Payload(seg_->response(i), n), &resp);
    if (s.ok() && resp.id != id) {
      s = absl::InternalError(absl::StrCat("shared-memory slot ", i, " answered request ", resp.id, ", not ", id));
    }
  }
  if (!s.ok()) {
    cb(s, Payload(), nullptr);
    return true;
  }
  cb(wire::StatusOf(resp), resp.body, std::move(keepalive));
  return true;
}

void ShmConn::Die(const absl::Status& why) {
  std::vector<Callback> failed;
  std::shared_ptr<shm::Segment> seg;  // set by Open under the lock; Die may run on the reader thread before
  {
    absl::MutexLock lock(&slots_->mu);
    if (slots_->dead) return;
    slots_->dead = true;
    seg = seg_;
    for (Slots::Pending& p : slots_->pending) {
      if (!p.cb) continue;
      timer_->Cancel(p.timer);
      failed.push_back(std::move(p.cb));
      p.cb = nullptr;
    }
  }
  dead_.store(true, std::memory_order_release);
  stop_.store(true);
  if (seg != nullptr) shm::Ring(seg->client_bell());
  for (Callback& cb : failed) cb(why, Payload(), nullptr);
}

}  // namespace fulcrum
