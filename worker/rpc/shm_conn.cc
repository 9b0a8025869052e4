#include "worker/rpc/shm_conn.h"

#include <algorithm>
#include <cstring>
#include <deque>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/errors.h"
#include "common/rpc/grpc_util.h"

namespace fulcrum {

// What the worker knows of each slot, kept in its own memory: the server's
// writes to the file never decide which callback runs. Shared with the
// responses' keepalives, which free their slots after the connection may
// have gone.
struct ShmConn::Slots {
  struct Pending {
    bool in_use = false;  // from the claim until the response's keepalive goes
    uint64_t id = 0;      // the request awaiting a response; 0 when none
    Callback cb;          // null once answered, expired or failed
    uint64_t timer = 0;
  };
  // A request waiting for a slot.
  struct Queued {
    uint64_t qid = 0;
    wire::Writer body;
    absl::Time deadline;
    Callback cb;
    uint64_t timer = 0;
  };
  absl::Mutex mu;
  std::vector<Pending> pending ABSL_GUARDED_BY(mu);
  uint32_t free ABSL_GUARDED_BY(mu) = 0;
  // Pulls leave this many slots free for pushes: a pull may wait in its
  // slot for a step that only a push can complete.
  uint32_t reserve ABSL_GUARDED_BY(mu) = 0;
  std::deque<Queued> queued[2] ABSL_GUARDED_BY(mu);  // [is_push]
  uint64_t next_id ABSL_GUARDED_BY(mu) = 1;
  uint64_t next_qid ABSL_GUARDED_BY(mu) = 1;
  bool dead ABSL_GUARDED_BY(mu) = false;
  std::atomic<uint64_t> requests{0};
  std::atomic<uint64_t> waited{0};
  DeadlineTimer* timer = nullptr;
  std::shared_ptr<shm::Segment> seg;  // set by Open before any request

  // A free slot a push (or pull) may take now, or -1.
  int FreeSlot(bool is_push) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (dead || free == 0 || (!is_push && free <= reserve)) return -1;
    for (uint32_t i = 0; i < pending.size(); ++i) {
      if (!pending[i].in_use) return static_cast<int>(i);
    }
    return -1;
  }
};

namespace {

using Slots = ShmConn::Slots;

// Takes free slot `i` for a request answered to `cb` by `deadline`; returns
// the request's id.
uint64_t Claim(const std::shared_ptr<Slots>& slots, uint32_t i, ShmConn::Callback cb, absl::Time deadline)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(slots->mu) {
  Slots::Pending& p = slots->pending[i];
  p.in_use = true;
  --slots->free;
  const uint64_t id = slots->next_id++;
  p.id = id;
  p.cb = std::move(cb);
  p.timer = slots->timer->Schedule(deadline, [slots, i, id, deadline] {
    ShmConn::Callback expired;
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
  return id;
}

// Writes request `id` into its claimed slot `i` and rings the server.
void Write(Slots& slots, uint32_t i, uint64_t id, bool is_push, wire::Writer body) {
  shm::Segment& seg = *slots.seg;
  const size_t n = wire::EncodeStreamRequest(id, is_push, std::move(body)).FinishInto(seg.request(i));
  shm::SlotControl& slot = seg.slot(i);
  slot.request_bytes.store(static_cast<uint32_t>(n), std::memory_order_relaxed);
  slot.state.store(shm::kRequest, std::memory_order_release);
  shm::Ring(seg.server_bell());
  slots.requests.fetch_add(1, std::memory_order_relaxed);
}

// Frees slot `i` (its response has been read) and moves waiting requests
// into free slots, pushes first.
void Release(const std::shared_ptr<Slots>& slots, uint32_t i) {
  slots->seg->slot(i).state.store(shm::kFree, std::memory_order_release);
  slots->mu.Lock();
  slots->pending[i].in_use = false;
  ++slots->free;
  for (;;) {
    int slot = -1;
    bool is_push = true;
    for (bool kind : {true, false}) {
      if (!slots->queued[kind].empty() && (slot = slots->FreeSlot(kind)) >= 0) {
        is_push = kind;
        break;
      }
    }
    if (slot < 0) break;
    Slots::Queued q = std::move(slots->queued[is_push].front());
    slots->queued[is_push].pop_front();
    slots->timer->Cancel(q.timer);
    const uint64_t id = Claim(slots, static_cast<uint32_t>(slot), std::move(q.cb), q.deadline);
    // Written with the lock released: the claimed slot is this thread's.
    slots->mu.Unlock();
    Write(*slots, static_cast<uint32_t>(slot), id, is_push, std::move(q.body));
    slots->mu.Lock();
  }
  slots->mu.Unlock();
}

}  // namespace

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
    c->slots_->seg = c->seg_;
    c->slots_->timer = timer;
    c->slots_->pending.resize(c->seg_->slots());
    c->slots_->free = c->seg_->slots();
    c->slots_->reserve = c->seg_->slots() < 2 ? 0 : std::max<uint32_t>(1, c->seg_->slots() / 4);
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

bool ShmConn::Send(bool is_push, wire::Writer* body, size_t max_response_bytes, absl::Time deadline, Callback* cb) {
  // A StreamRequest adds at most 23 bytes (id, tags, length) to its body.
  if (dead() || max_response_bytes > seg_->slot_bytes() || body->size() + 32 > seg_->slot_bytes()) return false;
  int i = -1;
  uint64_t id = 0;
  {
    absl::MutexLock lock(&slots_->mu);
    if (slots_->dead) return false;
    // Pulls keep their order; a push passes waiting pulls.
    if (slots_->queued[is_push].empty()) i = slots_->FreeSlot(is_push);
    if (i < 0) {
      if (slots_->reserve == 0 && slots_->free == 0) return false;  // one slot: never wait behind a parked pull
      const uint64_t qid = slots_->next_qid++;
      Slots::Queued& q = slots_->queued[is_push].emplace_back();
      q.qid = qid;
      q.body = std::move(*body);
      q.deadline = deadline;
      q.cb = std::move(*cb);
      q.timer = slots_->timer->Schedule(deadline, [slots = slots_, is_push, qid, deadline] {
        Callback expired;
        {
          absl::MutexLock lock(&slots->mu);
          auto& queue = slots->queued[is_push];
          auto it = std::find_if(queue.begin(), queue.end(), [&](const Slots::Queued& x) { return x.qid == qid; });
          if (it == queue.end()) return;
          expired = std::move(it->cb);
          queue.erase(it);
        }
        expired(absl::DeadlineExceededError(absl::StrCat("no shared-memory slot free by the request's deadline (",
                                                         absl::FormatTime(deadline), ")")),
                Payload(), nullptr);
      });
      slots_->waited.fetch_add(1, std::memory_order_relaxed);
      return true;
    }
    id = Claim(slots_, static_cast<uint32_t>(i), std::move(*cb), deadline);
  }
  Write(*slots_, static_cast<uint32_t>(i), id, is_push, std::move(*body));
  return true;
}

uint64_t ShmConn::requests() const { return slots_->requests.load(std::memory_order_relaxed); }
uint64_t ShmConn::waited() const { return slots_->waited.load(std::memory_order_relaxed); }

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
  std::shared_ptr<const void> keepalive(seg_.get(), [slots = slots_, i](const void*) { Release(slots, i); });
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
    for (auto& queue : slots_->queued) {
      for (Slots::Queued& q : queue) {
        timer_->Cancel(q.timer);
        failed.push_back(std::move(q.cb));
      }
      queue.clear();
    }
  }
  dead_.store(true, std::memory_order_release);
  stop_.store(true);
  if (seg != nullptr) shm::Ring(seg->client_bell());
  for (Callback& cb : failed) cb(why, Payload(), nullptr);
}

}  // namespace fulcrum
