#include "worker/compute/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "cuda/blas.h"
#include "cuda/casts.h"
#include "cuda/device.h"
#include "cuda/kernels.h"

namespace fulcrum::compute {
namespace {

absl::Status ToStatus(const cuda::CudaStatus& s) {
  if (s.ok) return absl::OkStatus();
  return absl::InternalError(s.message);
}

absl::Status CudaCall(cudaError_t err, const char* call) {
  if (err == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(call, ": ", cudaGetErrorString(err)));
}

cuda::Act ToAct(Activation a) {
  switch (a) {
    case Activation::kRelu: return cuda::Act::kRelu;
    case Activation::kGelu: return cuda::Act::kGelu;
    case Activation::kNone: break;
  }
  return cuda::Act::kNone;
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(cuda::DeviceInfo info, cudaStream_t stream, std::unique_ptr<cuda::Blas> blas, double* scratch_sum,
              int* scratch_flag)
      : info_(std::move(info)), stream_(stream), blas_(std::move(blas)), sum_(scratch_sum), flag_(scratch_flag) {}

  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    blas_.reset();
    cudaFree(sum_);
    cudaFree(flag_);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override {
    return absl::StrCat("cuda:", info_.ordinal, " (", info_.name, ", sm_", info_.compute_major, info_.compute_minor,
                        ", ", info_.memory_bytes >> 20, " MiB)");
  }
  bool is_gpu() const override { return true; }
  size_t memory_bytes() const override { return info_.memory_bytes; }

  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override {
    return Timed(&profile_.copy_seconds, [&] {
      return CudaCall(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpyAsync(H2D)");
    });
  }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override {
    return Timed(&profile_.copy_seconds, [&] {
      return CudaCall(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpyAsync(D2H)");
    });
  }
  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    return Timed(&profile_.copy_seconds, [&] {
      return CudaCall(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpyAsync(D2D)");
    });
  }
  absl::Status Zero(void* dst, size_t bytes) override {
    return CudaCall(cudaMemsetAsync(dst, 0, bytes, stream_), "cudaMemsetAsync");
  }
  absl::Status Synchronize() override { return CudaCall(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

  absl::Status Gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, const float* B, float beta,
                    float* C) override {
    if (profiling_) profile_.gemm_flops += 2ull * M * N * K;
    return Timed(&profile_.gemm_seconds, [&] {
      return ToStatus(blas_->Gemm(cuda::GemmInput::kFp32, ta, tb, M, N, K, alpha, A, B, beta, C));
    });
  }
  absl::Status GemmLowp(DType type, bool ta, bool tb, int M, int N, int K, float alpha, const uint16_t* A,
                        const uint16_t* B, float beta, float* C) override {
    if (type != DType::kBf16 && type != DType::kFp16) {
      return absl::InvalidArgumentError(absl::StrCat("GemmLowp: inputs must be bf16 or fp16, not ", DTypeName(type)));
    }
    if (profiling_) profile_.gemm_flops += 2ull * M * N * K;
    const auto input = type == DType::kBf16 ? cuda::GemmInput::kBf16 : cuda::GemmInput::kFp16;
    return Timed(&profile_.gemm_seconds,
                 [&] { return ToStatus(blas_->Gemm(input, ta, tb, M, N, K, alpha, A, B, beta, C)); });
  }
  absl::Status Cast(DType from, DType to, size_t n, const void* in, void* out) override {
    return Other([&]() -> cuda::CudaStatus {
      if (from == DType::kFp32 && to == DType::kBf16)
        return cuda::CastFp32ToBf16(static_cast<const float*>(in), static_cast<uint16_t*>(out), n, stream_);
      if (from == DType::kFp32 && to == DType::kFp16)
        return cuda::CastFp32ToFp16(static_cast<const float*>(in), static_cast<uint16_t*>(out), n, stream_);
      if (from == DType::kBf16 && to == DType::kFp32)
        return cuda::CastBf16ToFp32(static_cast<const uint16_t*>(in), static_cast<float*>(out), n, stream_);
      if (from == DType::kFp16 && to == DType::kFp32)
        return cuda::CastFp16ToFp32(static_cast<const uint16_t*>(in), static_cast<float*>(out), n, stream_);
      return cuda::CudaStatus::Error(std::string("Cast: ") + DTypeName(from) + " to " + DTypeName(to) +
                                     " is not supported");
    });
  }
  absl::Status BiasAdd(int M, int N, const float* bias, float* y) override {
    return Other([&] { return cuda::BiasAdd(M, N, bias, y, stream_); });
  }
  absl::Status ColumnSum(int M, int N, const float* x, float* out) override {
    return Other([&] { return cuda::ColumnSum(M, N, x, out, stream_); });
  }
  absl::Status Activate(Activation a, size_t n, const float* x, float* y) override {
    return Other([&] { return cuda::Activate(ToAct(a), n, x, y, stream_); });
  }
  absl::Status ActivateGrad(Activation a, size_t n, const float* x, const float* dy, float* dx) override {
    return Other([&] { return cuda::ActivateGrad(ToAct(a), n, x, dy, dx, stream_); });
  }
  absl::Status Axpy(size_t n, float alpha, const float* x, float* y) override {
    return Other([&] { return cuda::Axpy(n, alpha, x, y, stream_); });
  }
  absl::Status Scale(size_t n, float alpha, float* x) override {
    return Other([&] { return cuda::Scale(n, alpha, x, stream_); });
  }
  absl::Status RowDot(int M, int K, const float* a, int lda, const float* b, int ldb, float* out) override {
    return Other([&] { return cuda::RowDot(M, K, a, lda, b, ldb, out, stream_); });
  }
  absl::Status ScaleRows(int M, int K, const float* s, const float* x, int ldx, float* y, int ldy) override {
    return Other([&] { return cuda::ScaleRows(M, K, s, x, ldx, y, ldy, stream_); });
  }
  absl::StatusOr<double> SumSquares(size_t n, const float* x) override {
    double host = 0;
    absl::Status s = Other([&]() -> cuda::CudaStatus {
      FULCRUM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(sum_, 0, sizeof(double), stream_));
      if (auto st = cuda::SumSquares(n, x, sum_, stream_); !st.ok) return st;
      FULCRUM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&host, sum_, sizeof(double), cudaMemcpyDeviceToHost, stream_));
      FULCRUM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      return cuda::CudaStatus::Ok();
    });
    if (!s.ok()) return s;
    return host;
  }
  absl::StatusOr<bool> AllFinite(size_t n, const float* x) override {
    int host = 0;
    absl::Status s = Other([&]() -> cuda::CudaStatus {
      FULCRUM_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(flag_, 0, sizeof(int), stream_));
      if (auto st = cuda::NonFinite(n, x, flag_, stream_); !st.ok) return st;
      FULCRUM_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&host, flag_, sizeof(int), cudaMemcpyDeviceToHost, stream_));
      FULCRUM_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
      return cuda::CudaStatus::Ok();
    });
    if (!s.ok()) return s;
    return host == 0;
  }
  absl::Status SoftmaxCrossEntropy(int M, int N, const float* logits, const int32_t* labels, float scale, float* loss,
                                   int32_t* pred, float* dlogits) override {
    return Other([&] { return cuda::SoftmaxCrossEntropy(M, N, logits, labels, scale, loss, pred, dlogits, stream_); });
  }
  absl::Status SigmoidCrossEntropy(int M, const float* logits, const float* labels, float scale, float* loss,
                                   float* prob, float* dlogits) override {
    return Other([&] { return cuda::SigmoidCrossEntropy(M, logits, labels, scale, loss, prob, dlogits, stream_); });
  }
  absl::Status SquaredError(int M, const float* pred, const float* target, float scale, float* loss,
                            float* dpred) override {
    return Other([&] { return cuda::SquaredError(M, pred, target, scale, loss, dpred, stream_); });
  }
  absl::Status Gather(int n, int dim, const float* rows, const int32_t* idx, float* out) override {
    return Other([&] { return cuda::Gather(n, dim, rows, idx, out, stream_); });
  }
  absl::Status GatherScaleU8(int n, int cols, const uint8_t* table, const int32_t* idx, float scale,
                             float* out) override {
    return Other([&] { return cuda::GatherScaleU8(n, cols, table, idx, scale, out, stream_); });
  }
  absl::Status ScatterAdd(int n, int dim, const float* src, const int32_t* idx, float* rows) override {
    return Other([&] { return cuda::ScatterAdd(n, dim, src, idx, rows, stream_); });
  }
  absl::Status EmbeddingBag(int B, int dim, const float* rows, const int32_t* offsets, const int32_t* idx,
                            const float* vals, bool square, float* out) override {
    return Other([&] { return cuda::EmbeddingBag(B, dim, rows, offsets, idx, vals, square, out, stream_); });
  }
  absl::Status EmbeddingBagGrad(int B, int dim, const float* dout, const int32_t* offsets, const int32_t* idx,
                                const float* vals, bool square, const float* rows, float* grad) override {
    return Other(
        [&] { return cuda::EmbeddingBagGrad(B, dim, dout, offsets, idx, vals, square, rows, grad, stream_); });
  }

 protected:
  absl::StatusOr<void*> RawAllocate(size_t bytes) override {
    void* p = nullptr;
    if (auto s = CudaCall(cudaMalloc(&p, bytes), "cudaMalloc"); !s.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat("cudaMalloc(", bytes, " bytes) on ", name(), ": ", s.message()));
    }
    return p;
  }
  void RawFree(void* p) override { cudaFree(p); }
  absl::StatusOr<void*> RawAllocateHost(size_t bytes) override {
    void* p = nullptr;
    if (auto s = CudaCall(cudaMallocHost(&p, bytes), "cudaMallocHost"); !s.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat("cudaMallocHost(", bytes, " bytes): ", s.message()));
    }
    return p;
  }
  void RawFreeHost(void* p) override { cudaFreeHost(p); }

 private:
  // While profiling, waits for the work so its time can be attributed.
  template <typename F>
  absl::Status Timed(double* counter, F&& f) {
    if (!profiling_) return f();
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = f();
    if (s.ok()) s = Synchronize();
    *counter += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return s;
  }
  template <typename F>
  absl::Status Other(F&& f) {
    return Timed(&profile_.other_seconds, [&] { return ToStatus(f()); });
  }

  cuda::DeviceInfo info_;
  cudaStream_t stream_;
  std::unique_ptr<cuda::Blas> blas_;
  double* sum_;
  int* flag_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(int ordinal) {
  std::string none;
  std::vector<cuda::DeviceInfo> devices = cuda::ListDevices(&none);
  if (devices.empty()) return absl::FailedPreconditionError(absl::StrCat("no usable GPU: ", none));
  if (ordinal < 0) ordinal = devices.front().ordinal;
  const cuda::DeviceInfo* info = nullptr;
  for (const auto& d : devices) {
    if (d.ordinal == ordinal) info = &d;
  }
  if (info == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cuda:", ordinal, " does not exist: this machine has ", devices.size(), " usable GPU(s)"));
  }
  if (auto s = CudaCall(cudaSetDevice(ordinal), "cudaSetDevice"); !s.ok()) return s;
  // Scratch scalars first: nothing else to release when they fail.
  double* sum = nullptr;
  int* flag = nullptr;
  absl::Status s = CudaCall(cudaMalloc(reinterpret_cast<void**>(&sum), sizeof(double)), "cudaMalloc(scratch)");
  if (s.ok()) s = CudaCall(cudaMalloc(reinterpret_cast<void**>(&flag), sizeof(int)), "cudaMalloc(scratch)");
  cudaStream_t stream = nullptr;
  if (s.ok()) s = CudaCall(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  std::unique_ptr<cuda::Blas> blas;
  if (s.ok()) s = ToStatus(cuda::Blas::Create(stream, &blas));
  if (!s.ok()) {
    if (stream != nullptr) cudaStreamDestroy(stream);
    cudaFree(sum);
    cudaFree(flag);
    return s;
  }
  return std::unique_ptr<Backend>(new CudaBackend(*info, stream, std::move(blas), sum, flag));
}

}  // namespace fulcrum::compute
