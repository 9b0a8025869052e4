#include "common/rpc/shared_memory.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <new>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "common/spare_core.h"

namespace fulcrum::shm {
namespace {

constexpr uint64_t kMagic = 0x314d485343524c46ull;  // "FLRCSHM1" little-endian
constexpr uint64_t kPage = 4096;

// The first page of the file.
struct Header {
  uint64_t magic;
  uint64_t slots;
  uint64_t slot_bytes;
  uint8_t nonce[kNonceBytes];
  alignas(64) Doorbell server_bell;
  Doorbell client_bell;
};
static_assert(sizeof(Header) <= kPage);
static_assert(sizeof(SlotControl) == 64);
static_assert(std::atomic<uint32_t>::is_always_lock_free && sizeof(std::atomic<uint32_t>) == 4,
              "futexes need plain 32-bit atomics");

uint64_t RoundUp(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }
uint64_t ControlBytes(uint32_t slots) { return RoundUp(uint64_t{slots} * sizeof(SlotControl), kPage); }

absl::Status Errno(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(errno)));
}

uint32_t* FutexWord(std::atomic<uint32_t>& a) { return reinterpret_cast<uint32_t*>(&a); }

}  // namespace

uint64_t Segment::FileBytes(uint32_t slots, uint64_t slot_bytes) {
  return kPage + ControlBytes(slots) + 2 * uint64_t{slots} * slot_bytes;
}

absl::StatusOr<std::shared_ptr<Segment>> Segment::Create(uint32_t slots, uint64_t slot_bytes) {
  if (slots == 0 || slots > kMaxSlots) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory: ", slots, " slots; allowed 1 to ", kMaxSlots));
  }
  slot_bytes = RoundUp(slot_bytes, kPage);
  if (slot_bytes == 0 || slot_bytes > kMaxSlotBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory: slots of ", slot_bytes, " bytes; allowed up to ", kMaxSlotBytes));
  }
  std::shared_ptr<Segment> s(new Segment());
  s->slots_ = slots;
  s->slot_bytes_ = slot_bytes;
  s->file_bytes_ = FileBytes(slots, slot_bytes);
  s->fd_ = static_cast<int>(memfd_create("fulcrum-shm", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (s->fd_ < 0) return Errno("memfd_create");
  if (ftruncate(s->fd_, static_cast<off_t>(s->file_bytes_)) != 0) return Errno("ftruncate of the memory file");
  // Neither side may shrink (a mapping past the end faults) or grow it.
  if (fcntl(s->fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return Errno("sealing the memory file");
  }
  void* p = mmap(nullptr, s->file_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd_, 0);
  if (p == MAP_FAILED) return Errno("mmap of the memory file");
  s->base_ = static_cast<uint8_t*>(p);
  s->nonce_.resize(kNonceBytes);
  if (getrandom(s->nonce_.data(), kNonceBytes, 0) != static_cast<ssize_t>(kNonceBytes)) {
    return Errno("getrandom");
  }
  auto* h = new (s->base_) Header();
  h->magic = kMagic;
  h->slots = slots;
  h->slot_bytes = slot_bytes;
  std::memcpy(h->nonce, s->nonce_.data(), kNonceBytes);
  for (uint32_t i = 0; i < slots; ++i) new (&s->slot(i)) SlotControl();
  return s;
}

absl::StatusOr<std::shared_ptr<Segment>> Segment::Attach(uint32_t pid, int fd, const std::string& nonce,
                                                         uint32_t slots, uint64_t slot_bytes, uint64_t file_bytes) {
  if (slots == 0 || slots > kMaxSlots || slot_bytes == 0 || slot_bytes > kMaxSlotBytes ||
      slot_bytes % kPage != 0 || file_bytes != FileBytes(slots, slot_bytes) || nonce.size() != kNonceBytes) {
    return absl::InvalidArgumentError(absl::StrCat("shared memory: the server described ", slots, " slots of ",
                                                   slot_bytes, " bytes in ", file_bytes,
                                                   " bytes; that is not a layout this worker knows"));
  }
  std::shared_ptr<Segment> s(new Segment());
  const std::string path = absl::StrCat("/proc/", pid, "/fd/", fd);
  s->fd_ = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (s->fd_ < 0) return Errno(absl::StrCat("opening ", path));
  struct stat st;
  if (fstat(s->fd_, &st) != 0) return Errno(absl::StrCat("fstat of ", path));
  const int seals = fcntl(s->fd_, F_GET_SEALS);
  if (static_cast<uint64_t>(st.st_size) != file_bytes || seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, " is not the server's sealed memory file (size ", st.st_size, ", seals ", seals, ")"));
  }
  void* p = mmap(nullptr, file_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd_, 0);
  if (p == MAP_FAILED) return Errno(absl::StrCat("mmap of ", path));
  s->base_ = static_cast<uint8_t*>(p);
  s->slots_ = slots;
  s->slot_bytes_ = slot_bytes;
  s->file_bytes_ = file_bytes;
  s->nonce_ = nonce;
  const auto* h = reinterpret_cast<const Header*>(s->base_);
  if (h->magic != kMagic || h->slots != slots || h->slot_bytes != slot_bytes ||
      std::memcmp(h->nonce, nonce.data(), kNonceBytes) != 0) {
    return absl::FailedPreconditionError(absl::StrCat(path, " is another memory file (header or nonce differ)"));
  }
  return s;
}

Segment::~Segment() {
  if (base_ != nullptr) munmap(base_, file_bytes_);
  if (fd_ >= 0) close(fd_);
}

SlotControl& Segment::slot(uint32_t i) const {
  return reinterpret_cast<SlotControl*>(base_ + kPage)[i];
}
uint8_t* Segment::request(uint32_t i) const { return base_ + kPage + ControlBytes(slots_) + 2 * uint64_t{i} * slot_bytes_; }
uint8_t* Segment::response(uint32_t i) const { return request(i) + slot_bytes_; }
Doorbell& Segment::server_bell() const { return reinterpret_cast<Header*>(base_)->server_bell; }
Doorbell& Segment::client_bell() const { return reinterpret_cast<Header*>(base_)->client_bell; }

bool PeerOnThisHost(const std::string& grpc_peer) {
  absl::string_view peer = grpc_peer;
  if (absl::StartsWith(peer, "unix:")) return true;
  int family;
  std::string host;
  if (absl::ConsumePrefix(&peer, "ipv4:")) {
    family = AF_INET;
    host = std::string(peer.substr(0, peer.rfind(':')));
  } else if (absl::ConsumePrefix(&peer, "ipv6:")) {
    family = AF_INET6;
    // gRPC writes "[addr]:port", percent-encoded in newer releases.
    const std::string p = absl::StrReplaceAll(peer, {{"%5B", "["}, {"%5D", "]"}, {"%3A", ":"}, {"%25", "%"}});
    const size_t close = p.find(']');
    if (p.empty() || p[0] != '[' || close == std::string::npos) return false;
    host = p.substr(1, close - 1);
    host = host.substr(0, host.find('%'));  // a zone ("fe80::1%eth0")
  } else {
    return false;
  }
  unsigned char want[16] = {};
  if (inet_pton(family, host.c_str(), want) != 1) return false;
  if (family == AF_INET6 && IN6_IS_ADDR_V4MAPPED(reinterpret_cast<const in6_addr*>(want))) {
    std::memmove(want, want + 12, 4);
    family = AF_INET;
  }
  if (family == AF_INET && want[0] == 127) return true;
  if (family == AF_INET6 && IN6_IS_ADDR_LOOPBACK(reinterpret_cast<const in6_addr*>(want))) return true;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return false;
  bool found = false;
  for (const ifaddrs* a = list; a != nullptr && !found; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != family) continue;
    if (family == AF_INET) {
      found = std::memcmp(&reinterpret_cast<const sockaddr_in*>(a->ifa_addr)->sin_addr, want, 4) == 0;
    } else {
      found = std::memcmp(&reinterpret_cast<const sockaddr_in6*>(a->ifa_addr)->sin6_addr, want, 16) == 0;
    }
  }
  freeifaddrs(list);
  return found;
}

void Ring(Doorbell& bell) {
  bell.count.fetch_add(1, std::memory_order_seq_cst);
  if (bell.sleeping.load(std::memory_order_seq_cst) != 0) {
    syscall(SYS_futex, FutexWord(bell.count), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
  }
}

Waited Wait(Doorbell& bell, uint32_t seen, absl::Duration timeout, const std::atomic<bool>& stop,
            absl::Duration poll, SpareCoreProbe spare) {
  // A short spin catches the answer to a request just sent without a
  // sleep and a wake-up; longer would take the core the other side needs.
  auto rung = [&] {
    return bell.count.load(std::memory_order_acquire) != seen || stop.load(std::memory_order_relaxed);
  };
  for (int i = 0; i < 64; ++i) {
    if (rung()) return Waited::kSpinning;
    CpuPause();
  }
  // Polling only takes time no other thread wants (PollWhileSpare).
  if (poll > absl::ZeroDuration() && PollWhileSpare(absl::ToChronoNanoseconds(poll), rung, spare)) {
    return Waited::kPolling;
  }
  bell.sleeping.store(1, std::memory_order_seq_cst);
  if (bell.count.load(std::memory_order_seq_cst) == seen && !stop.load(std::memory_order_relaxed)) {
    const timespec ts = absl::ToTimespec(timeout);
    syscall(SYS_futex, FutexWord(bell.count), FUTEX_WAIT, seen, &ts, nullptr, 0);
  }
  bell.sleeping.store(0, std::memory_order_relaxed);
  return Waited::kSleeping;
}

}  // namespace fulcrum::shm
