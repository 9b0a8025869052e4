#include "worker/compute/backend.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

#ifdef FULCRUM_HAVE_CUDA
#include "worker/compute/cuda_backend.h"
#endif

namespace fulcrum::compute {

const char* ActivationName(Activation a) {
  switch (a) {
    case Activation::kNone: return "none";
    case Activation::kRelu: return "relu";
    case Activation::kGelu: return "gelu";
  }
  return "?";
}

absl::StatusOr<Activation> ActivationFromName(absl::string_view name) {
  if (name == "relu") return Activation::kRelu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "none" || name.empty()) return Activation::kNone;
  return absl::InvalidArgumentError(absl::StrCat("unknown activation \"", name, "\" (allowed: relu, gelu, none)"));
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    Reset();
    owner_ = std::exchange(o.owner_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    host_ = o.host_;
  }
  return *this;
}

void Buffer::Reset() {
  if (owner_ != nullptr && data_ != nullptr) {
    if (host_) {
      owner_->RawFreeHost(data_);
    } else {
      owner_->RawFree(data_);
      owner_->Track(bytes_ == 0 ? 1 : bytes_, /*add=*/false);
    }
  }
  owner_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

absl::StatusOr<Buffer> Backend::Allocate(size_t bytes) {
  absl::StatusOr<void*> p = RawAllocate(bytes == 0 ? 1 : bytes);
  if (!p.ok()) return p.status();
  Track(bytes == 0 ? 1 : bytes, /*add=*/true);
  return Buffer(this, *p, bytes, /*host=*/false);
}

void Backend::Track(size_t bytes, bool add) {
  if (!add) {
    allocated_.fetch_sub(bytes, std::memory_order_relaxed);
    return;
  }
  const size_t now = allocated_.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  size_t peak = peak_.load(std::memory_order_relaxed);
  while (now > peak && !peak_.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

absl::StatusOr<Buffer> Backend::AllocateHost(size_t bytes) {
  absl::StatusOr<void*> p = RawAllocateHost(bytes == 0 ? 1 : bytes);
  if (!p.ok()) return p.status();
  return Buffer(this, *p, bytes, /*host=*/true);
}

bool CudaBackendBuilt() {
#ifdef FULCRUM_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

absl::Status CheckDeviceName(absl::string_view device) {
  if (device == "auto" || device == "cpu" || device == "cuda") return absl::OkStatus();
  int ordinal = 0;
  if (absl::StartsWith(device, "cuda:")) {
    if (absl::SimpleAtoi(device.substr(5), &ordinal) && ordinal >= 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("--device=", device, ": expected cuda:N with N a GPU index"));
  }
  return absl::InvalidArgumentError(absl::StrCat("--device=", device, ": allowed values are auto, cpu, cuda:N"));
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view device, std::string* why,
                                                       int cpu_threads) {
  RETURN_IF_ERROR(CheckDeviceName(device));
  std::string ignored;
  if (why == nullptr) why = &ignored;
  if (device == "cpu") {
    *why = "--device=cpu";
    return NewCpuBackend(cpu_threads);
  }
  if (device == "auto") {
#ifdef FULCRUM_HAVE_CUDA
    auto gpu = NewCudaBackend(-1);
    if (gpu.ok()) {
      *why = "auto: a usable GPU was found";
      return std::move(*gpu);
    }
    *why = absl::StrCat("auto: ", gpu.status().message(), "; using the CPU");
#else
    *why = "auto: this build has no CUDA backend (built without nvcc), using the CPU";
#endif
    return NewCpuBackend(cpu_threads);
  }
  if (absl::StartsWith(device, "cuda:") || device == "cuda") {
    int ordinal = 0;
    if (device != "cuda") (void)absl::SimpleAtoi(device.substr(5), &ordinal);  // checked above
#ifdef FULCRUM_HAVE_CUDA
    auto gpu = NewCudaBackend(ordinal);
    if (!gpu.ok()) return gpu.status();
    *why = absl::StrCat("--device=", device);
    return std::move(*gpu);
#else
    return absl::FailedPreconditionError(
        absl::StrCat("--device=", device, ": this build has no CUDA backend (configure with nvcc present)"));
#endif
  }
  return absl::InvalidArgumentError(absl::StrCat("--device=", device, ": unhandled"));  // CheckDeviceName
}

}  // namespace fulcrum::compute
