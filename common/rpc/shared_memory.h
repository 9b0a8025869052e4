// Shared memory between a worker and a server on the same host: a sealed
// memory file (memfd) of request and response slots, and doorbells that
// wake the other side through a futex in the file (docs/wire-protocol.md,
// "Shared memory").
//
// The server creates the file and keeps it; the worker opens it through
// /proc/<server pid>/fd/<fd>, which works only from the same host and PID
// namespace and only for a process the kernel lets read the server's file
// descriptors (the same user). The file is sealed against shrinking, so the
// worker cannot make the server's mapping fault.
//
// A slot carries one request and its response, encoded exactly as a
// StreamRequest and a StreamResponse. Its state word moves
//   kFree -> kRequest (worker) -> kBusy (server) -> kResponse (server)
//   -> kFree (worker, after reading the response).
// Neither side trusts what the other wrote: sizes are checked against each
// side's own copy of the geometry, and the server copies a request out of
// the slot before decoding it.
#ifndef FULCRUM_COMMON_RPC_SHARED_MEMORY_H_
#define FULCRUM_COMMON_RPC_SHARED_MEMORY_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/spare_core.h"

namespace fulcrum::shm {

enum SlotState : uint32_t { kFree = 0, kRequest = 1, kBusy = 2, kResponse = 3 };

inline constexpr size_t kNonceBytes = 16;
inline constexpr uint32_t kMaxSlots = 64;
inline constexpr uint64_t kMaxSlotBytes = uint64_t{16} << 20;

// A counter one side bumps after posting work, and a flag the other side
// sets before it sleeps on the counter (so a bump wakes it only then).
struct alignas(64) Doorbell {
  std::atomic<uint32_t> count{0};
  std::atomic<uint32_t> sleeping{0};
};

struct alignas(64) SlotControl {
  std::atomic<uint32_t> state{kFree};
  std::atomic<uint32_t> request_bytes{0};
  std::atomic<uint32_t> response_bytes{0};
};

class Segment {
 public:
  // A new sealed memory file of `slots` slots of `slot_bytes` each way.
  static absl::StatusOr<std::shared_ptr<Segment>> Create(uint32_t slots, uint64_t slot_bytes);
  // Maps the file another process created, checking that it is the one the
  // server described (size, header and nonce).
  static absl::StatusOr<std::shared_ptr<Segment>> Attach(uint32_t pid, int fd, const std::string& nonce,
                                                         uint32_t slots, uint64_t slot_bytes, uint64_t file_bytes);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  uint32_t slots() const { return slots_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint64_t file_bytes() const { return file_bytes_; }
  int fd() const { return fd_; }
  const std::string& nonce() const { return nonce_; }

  SlotControl& slot(uint32_t i) const;
  uint8_t* request(uint32_t i) const;
  uint8_t* response(uint32_t i) const;
  Doorbell& server_bell() const;  // rung by the worker after posting a request
  Doorbell& client_bell() const;  // rung by the server after posting a response

 private:
  Segment() = default;
  static uint64_t FileBytes(uint32_t slots, uint64_t slot_bytes);
  uint8_t* base_ = nullptr;
  int fd_ = -1;
  uint32_t slots_ = 0;
  uint64_t slot_bytes_ = 0;
  uint64_t file_bytes_ = 0;
  std::string nonce_;
};

// True when a gRPC peer ("ipv4:10.1.2.3:5000", "ipv6:[::1]:5000",
// "unix:...") is this host: a loopback address, a Unix socket, or an address
// of one of this host's interfaces. Only such peers are offered shared
// memory (whether they can open it is then up to the kernel).
bool PeerOnThisHost(const std::string& grpc_peer);

// Bumps the bell and wakes its sleeper, if any.
void Ring(Doorbell& bell);
// Waits until the bell's count differs from `seen`, `timeout` passes, or
// `stop` (the caller's own flag, never one in the file) is set. Spins
// briefly, then polls the bell for up to `poll` (yielding the core to any
// thread that wants it), then sleeps: a sleeping thread on a virtual
// machine takes 50-100 us to wake.
// Returns the phase in which the wait ended.
enum class Waited { kSpinning, kPolling, kSleeping };
// `spare`: asked before and while polling (PollWhileSpare).
Waited Wait(Doorbell& bell, uint32_t seen, absl::Duration timeout, const std::atomic<bool>& stop,
            absl::Duration poll = absl::ZeroDuration(), SpareCoreProbe spare = &SpareCore);

}  // namespace fulcrum::shm

#endif  // FULCRUM_COMMON_RPC_SHARED_MEMORY_H_
