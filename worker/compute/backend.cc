#include "worker/compute/backend.h"

#include <cmath>
#include <cstring>
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
    case Activation::kSigmoid: return "sigmoid";
    case Activation::kTanh: return "tanh";
  }
  return "?";
}

absl::StatusOr<Activation> ActivationFromName(absl::string_view name) {
  if (name == "relu") return Activation::kRelu;
  if (name == "gelu") return Activation::kGelu;
  if (name == "sigmoid") return Activation::kSigmoid;
  if (name == "tanh") return Activation::kTanh;
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

InnerOptimizer::AdamScalars InnerOptimizer::Adam(uint64_t t) const {
  const bool decoupled = kind == Kind::kAdamW;
  const double td = static_cast<double>(t);
  const float bc1 = static_cast<float>(1.0 - std::pow(static_cast<double>(beta1), td));
  AdamScalars s;
  s.inv_bc2_sqrt = 1.0f / static_cast<float>(std::sqrt(1.0 - std::pow(static_cast<double>(beta2), td)));
  s.step_size = learning_rate / bc1;
  s.l2 = decoupled ? 0.0f : weight_decay;
  s.decay = decoupled ? 1.0f - learning_rate * weight_decay : 1.0f;
  return s;
}

absl::Status Backend::UploadAsync(void* dst, const void* pinned_src, size_t bytes, UploadEvent* ready) {
  if (bytes > 0) std::memcpy(dst, pinned_src, bytes);
  ready->handle.reset();
  return absl::OkStatus();
}

absl::Status Backend::WaitForUpload(const UploadEvent&) { return absl::OkStatus(); }

absl::Status Backend::DownloadAsync(void* pinned_dst, const void* src, size_t bytes, UploadEvent* done) {
  RETURN_IF_ERROR(CopyToHost(pinned_dst, src, bytes));
  done->handle.reset();
  return Synchronize();
}

absl::Status Backend::WaitForDownload(const UploadEvent&) { return absl::OkStatus(); }

size_t Backend::DenseAuxBytes(DType, Activation act, int M, int N) const {
  return act == Activation::kNone ? 0 : size_t{4} * M * N;  // the pre-activation, fp32
}

absl::Status Backend::DenseForward(DType input, int M, int N, int K, const void* x, const void* w, const float* bias,
                                   Activation act, void* aux, float* y, uint16_t* y16) {
  float* pre = act == Activation::kNone ? y : static_cast<float*>(aux);
  if (input == DType::kFp32) {
    RETURN_IF_ERROR(Gemm(false, false, M, N, K, 1.0f, static_cast<const float*>(x), static_cast<const float*>(w), 0.0f, pre));
  } else {
    RETURN_IF_ERROR(GemmLowp(input, false, false, M, N, K, 1.0f, static_cast<const uint16_t*>(x),
                             static_cast<const uint16_t*>(w), 0.0f, pre));
  }
  RETURN_IF_ERROR(BiasAdd(M, N, bias, pre));
  if (act != Activation::kNone) RETURN_IF_ERROR(Activate(act, size_t{1} * M * N, pre, y));
  if (input != DType::kFp32 && y16 != nullptr) RETURN_IF_ERROR(Cast(DType::kFp32, input, size_t{1} * M * N, y, y16));
  return absl::OkStatus();
}

absl::Status Backend::DenseWeightGrad(DType input, int M, int N, int K, const void* x, const void* dz,
                                      const float* dz_f32, float* dw, float* db) {
  if (input == DType::kFp32) {
    RETURN_IF_ERROR(Gemm(true, false, K, N, M, 1.0f, static_cast<const float*>(x), static_cast<const float*>(dz), 0.0f, dw));
  } else {
    RETURN_IF_ERROR(GemmLowp(input, true, false, K, N, M, 1.0f, static_cast<const uint16_t*>(x),
                             static_cast<const uint16_t*>(dz), 0.0f, dw));
  }
  if (db != nullptr) RETURN_IF_ERROR(ColumnSum(M, N, dz_f32, db));
  return absl::OkStatus();
}

absl::Status Backend::DenseInputGrad(DType input, int M, int N, int K, const void* dz, const void* w, Activation act,
                                     const void* aux, float* dx, uint16_t* dx16, float* db_below) {
  if (input == DType::kFp32) {
    RETURN_IF_ERROR(Gemm(false, true, M, K, N, 1.0f, static_cast<const float*>(dz), static_cast<const float*>(w), 0.0f, dx));
  } else {
    RETURN_IF_ERROR(GemmLowp(input, false, true, M, K, N, 1.0f, static_cast<const uint16_t*>(dz),
                             static_cast<const uint16_t*>(w), 0.0f, dx));
  }
  if (act != Activation::kNone) {
    RETURN_IF_ERROR(ActivateGrad(act, size_t{1} * M * K, static_cast<const float*>(aux), dx, dx));
  }
  if (db_below != nullptr) RETURN_IF_ERROR(ColumnSum(M, K, dx, db_below));
  if (input != DType::kFp32 && dx16 != nullptr) RETURN_IF_ERROR(Cast(DType::kFp32, input, size_t{1} * M * K, dx, dx16));
  return absl::OkStatus();
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
