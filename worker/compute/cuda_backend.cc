#include "worker/compute/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <chrono>
#include <cmath>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "cuda/blas.h"
#include "cuda/casts.h"
#include "cuda/device.h"
#include "cuda/graph_kernels.h"
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
    case Activation::kSigmoid: return cuda::Act::kSigmoid;
    case Activation::kTanh: return cuda::Act::kTanh;
    case Activation::kNone: break;
  }
  return cuda::Act::kNone;
}

// cuBLASLt has epilogues for these (and none).
bool Fusable(Activation a) { return a == Activation::kNone || a == Activation::kRelu || a == Activation::kGelu; }

cuda::GemmInput GemmTypeOf(DType t) {
  return t == DType::kBf16 ? cuda::GemmInput::kBf16 : t == DType::kFp16 ? cuda::GemmInput::kFp16 : cuda::GemmInput::kFp32;
}

cuda::Epilogue ForwardEpilogue(Activation a) {
  return a == Activation::kRelu ? cuda::Epilogue::kReluAuxBias
                                : a == Activation::kGelu ? cuda::Epilogue::kGeluAuxBias : cuda::Epilogue::kBias;
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(cuda::DeviceInfo info, cudaStream_t stream, std::unique_ptr<cuda::Blas> blas, double* scratch_sum,
              int* scratch_flag)
      : info_(std::move(info)), stream_(stream), blas_(std::move(blas)), sum_(scratch_sum), flag_(scratch_flag) {}

  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    for (cudaStream_t s : {upload_, download_}) {
      if (s == nullptr) continue;
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    }
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

  absl::Status UploadAsync(void* dst, const void* src, size_t bytes, UploadEvent* ready) override {
    cudaStream_t up;
    {
      absl::MutexLock lock(&upload_mu_);
      if (upload_ == nullptr) {
        RETURN_IF_ERROR(CudaCall(cudaSetDevice(info_.ordinal), "cudaSetDevice"));
        RETURN_IF_ERROR(CudaCall(cudaStreamCreateWithFlags(&upload_, cudaStreamNonBlocking), "cudaStreamCreate(upload)"));
      }
      up = upload_;
    }
    RETURN_IF_ERROR(CudaCall(cudaSetDevice(info_.ordinal), "cudaSetDevice"));
    if (ready->handle == nullptr) {
      cudaEvent_t ev = nullptr;
      RETURN_IF_ERROR(CudaCall(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate"));
      ready->handle = std::shared_ptr<void>(ev, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
    }
    RETURN_IF_ERROR(CudaCall(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, up), "cudaMemcpyAsync(upload)"));
    return CudaCall(cudaEventRecord(static_cast<cudaEvent_t>(ready->handle.get()), up), "cudaEventRecord(upload)");
  }
  absl::Status WaitForUpload(const UploadEvent& ready) override {
    if (ready.handle == nullptr) return absl::OkStatus();
    return CudaCall(cudaStreamWaitEvent(stream_, static_cast<cudaEvent_t>(ready.handle.get()), 0),
                    "cudaStreamWaitEvent(upload)");
  }

  absl::Status DownloadAsync(void* dst, const void* src, size_t bytes, UploadEvent* done) override {
    RETURN_IF_ERROR(CudaCall(cudaSetDevice(info_.ordinal), "cudaSetDevice"));
    if (download_ == nullptr) {
      RETURN_IF_ERROR(
          CudaCall(cudaStreamCreateWithFlags(&download_, cudaStreamNonBlocking), "cudaStreamCreate(download)"));
    }
    if (done->handle == nullptr) {
      cudaEvent_t ev = nullptr;
      RETURN_IF_ERROR(CudaCall(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate"));
      done->handle = std::shared_ptr<void>(ev, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
    }
    auto ev = static_cast<cudaEvent_t>(done->handle.get());
    // The copy waits for the work queued so far (the event as recorded now),
    // then the same event marks the copy's end.
    RETURN_IF_ERROR(CudaCall(cudaEventRecord(ev, stream_), "cudaEventRecord(compute)"));
    RETURN_IF_ERROR(CudaCall(cudaStreamWaitEvent(download_, ev, 0), "cudaStreamWaitEvent(download)"));
    RETURN_IF_ERROR(
        CudaCall(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, download_), "cudaMemcpyAsync(download)"));
    return CudaCall(cudaEventRecord(ev, download_), "cudaEventRecord(download)");
  }
  absl::Status WaitForDownload(const UploadEvent& done) override {
    if (done.handle == nullptr) return absl::OkStatus();
    RETURN_IF_ERROR(CudaCall(cudaSetDevice(info_.ordinal), "cudaSetDevice"));
    return CudaCall(cudaEventSynchronize(static_cast<cudaEvent_t>(done.handle.get())), "cudaEventSynchronize(download)");
  }

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

  // ---- dense layers: one cuBLASLt GEMM with its epilogue each (backend.h),
  // unless the startup check found the fused path wrong or missing here.
  size_t DenseAuxBytes(DType input, Activation act, int M, int N) const override {
    if (!fused_ || act == Activation::kNone || !Fusable(act)) return Backend::DenseAuxBytes(input, act, M, N);
    // GELU's input is kept in D's type: fp32 bounds both.
    return cuda::Blas::AuxBytes(ForwardEpilogue(act), cuda::GemmInput::kFp32, M, N);
  }
  absl::Status DenseForward(DType input, int M, int N, int K, const void* x, const void* w, const float* bias,
                            Activation act, void* aux, float* y, uint16_t* y16) override {
    if (!fused_ || !Fusable(act)) return Backend::DenseForward(input, M, N, K, x, w, bias, act, aux, y, y16);
    // 16-bit hidden layers: the GEMM writes the next layer's 16-bit input
    // (and GELU's input) itself; the bias then has that type too.
    const bool half_out = input != DType::kFp32 && act != Activation::kNone && y16 != nullptr;
    const cuda::GemmInput in = GemmTypeOf(input), out = half_out ? in : cuda::GemmInput::kFp32;
    const void* b = bias;
    if (half_out) {
      RETURN_IF_ERROR(Scratch(&bias16_, size_t{2} * N));
      RETURN_IF_ERROR(Cast(DType::kFp32, input, N, bias, bias16_.data()));
      b = bias16_.data();
    }
    cuda::EpilogueArgs e;
    e.kind = ForwardEpilogue(act);
    e.bias = b;
    e.aux = act == Activation::kNone ? nullptr : aux;
    if (profiling_) profile_.gemm_flops += 2ull * M * N * K;
    RETURN_IF_ERROR(Timed(&profile_.gemm_seconds, [&] {
      return ToStatus(blas_->GemmEpilogue(in, out, false, false, M, N, K, x, w, half_out ? static_cast<void*>(y16) : y, e));
    }));
    if (input != DType::kFp32 && y16 != nullptr && !half_out) {
      RETURN_IF_ERROR(Cast(DType::kFp32, input, size_t{1} * M * N, y, y16));
    }
    return absl::OkStatus();
  }
  absl::Status DenseWeightGrad(DType input, int M, int N, int K, const void* x, const void* dz, const float* dz_f32,
                               float* dw, float* db) override {
    if (!fused_ || !fused_bgrad_ || db == nullptr) {
      return Backend::DenseWeightGrad(input, M, N, K, x, dz, dz_f32, dw, db);
    }
    cuda::EpilogueArgs e;
    e.kind = cuda::Epilogue::kBgradB;  // db = column sums of dz, in the same GEMM
    e.bias_grad = db;
    if (profiling_) profile_.gemm_flops += 2ull * M * N * K;
    return Timed(&profile_.gemm_seconds, [&] {
      return ToStatus(blas_->GemmEpilogue(GemmTypeOf(input), cuda::GemmInput::kFp32, true, false, K, N, M, x, dz, dw, e));
    });
  }
  absl::Status DenseInputGrad(DType input, int M, int N, int K, const void* dz, const void* w, Activation act,
                              const void* aux, float* dx, uint16_t* dx16, float* db_below) override {
    if (!fused_ || act == Activation::kNone || !Fusable(act)) {
      return Backend::DenseInputGrad(input, M, N, K, dz, w, act, aux, dx, dx16, db_below);
    }
    const bool half_out = input != DType::kFp32 && dx16 != nullptr;
    const cuda::GemmInput in = GemmTypeOf(input), out = half_out ? in : cuda::GemmInput::kFp32;
    // The epilogue writes the bias gradient in D's type: 16-bit into scratch,
    // widened after; and somewhere even when the caller does not want it.
    void* bias_grad = db_below;
    if (half_out || db_below == nullptr) {
      RETURN_IF_ERROR(Scratch(&dbias_, size_t{4} * K));
      bias_grad = dbias_.data();
    }
    cuda::EpilogueArgs e;
    e.kind = act == Activation::kRelu ? cuda::Epilogue::kDRelu : cuda::Epilogue::kDGelu;
    e.bias_grad = bias_grad;
    e.aux = const_cast<void*>(aux);
    if (profiling_) profile_.gemm_flops += 2ull * M * N * K;
    RETURN_IF_ERROR(Timed(&profile_.gemm_seconds, [&] {
      return ToStatus(
          blas_->GemmEpilogue(in, out, false, true, M, K, N, dz, w, half_out ? static_cast<void*>(dx16) : dx, e));
    }));
    if (half_out && db_below != nullptr) RETURN_IF_ERROR(Cast(input, DType::kFp32, K, bias_grad, db_below));
    if (input != DType::kFp32 && dx16 != nullptr && !half_out) {
      RETURN_IF_ERROR(Cast(DType::kFp32, input, size_t{1} * M * K, dx, dx16));
    }
    return absl::OkStatus();
  }

  // Runs every fused layer call against the composed one on small shapes
  // (widths that need padded aux rows included) and keeps the fused path
  // only when all agree: a cuBLASLt without an algorithm for an epilogue,
  // or one that computes it differently, costs speed, never correctness.
  void CheckFusedLayers() {
    auto check = [&]() -> std::string {
      for (DType t : {DType::kFp32, DType::kBf16}) {
        for (Activation a : {Activation::kRelu, Activation::kGelu}) {
          absl::Status s = CompareFused(t, a);
          if (!s.ok()) return absl::StrCat(DTypeName(t), " ", ActivationName(a), ": ", s.message());
        }
      }
      return "";
    };
    fused_bgrad_ = true;
    std::string why = check();
    if (!why.empty()) {
      // The bias-gradient epilogue is the least widely supported: try the
      // others without it.
      fused_bgrad_ = false;
      const std::string without = check();
      if (!without.empty()) why += absl::StrCat("; without the bias-gradient epilogue: ", without);
      else why.clear();
    }
    fused_ = why.empty();
    if (fused_) {
      FLOG(INFO) << name() << ": dense layers fused into cuBLASLt epilogues"
                 << (fused_bgrad_ ? "" : " (the top layer's bias gradient as a kernel of its own)")
                 << ", checked against the unfused kernels";
    } else {
      FLOG(WARNING) << name() << ": dense layers run unfused (bias, activation and casts as kernels of their own): "
                    << why;
    }
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
  absl::Status OptimizerUpdate(const InnerOptimizer& o, size_t n, float* w, const float* g, float* m, float* v,
                               uint64_t t) override {
    cuda::UpdateParams p;
    p.kind = static_cast<int>(o.kind);
    p.lr = o.learning_rate;
    p.momentum = o.momentum;
    p.nesterov = o.nesterov;
    p.weight_decay = o.weight_decay;
    p.beta1 = o.beta1;
    p.beta2 = o.beta2;
    p.epsilon = o.epsilon;
    if (o.slots() == 2) {
      const InnerOptimizer::AdamScalars a = o.Adam(t);
      p.step_size = a.step_size;
      p.inv_bc2_sqrt = a.inv_bc2_sqrt;
      p.l2 = a.l2;
      p.decay = a.decay;
    }
    return Other([&] { return cuda::OptimizerUpdate(p, n, w, g, m, v, stream_); });
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

  // ---- model-graph ops (cuda/graph_kernels.h)
  absl::Status DotInteraction(int B, int n, int d, const float* x, float* out) override {
    return Other([&] { return cuda::DotInteraction(B, n, d, x, out, stream_); });
  }
  absl::Status DotInteractionGrad(int B, int n, int d, const float* x, const float* dout, float* dx) override {
    return Other([&] { return cuda::DotInteractionGrad(B, n, d, x, dout, dx, stream_); });
  }
  absl::Status FmInteraction(int B, int n, int d, const float* x, float* out) override {
    return Other([&] { return cuda::FmInteraction(B, n, d, x, out, stream_); });
  }
  absl::Status FmInteractionGrad(int B, int n, int d, const float* x, const float* dout, float* dx) override {
    return Other([&] { return cuda::FmInteractionGrad(B, n, d, x, dout, dx, stream_); });
  }
  absl::Status LayerNorm(int M, int N, const float* x, const float* gamma, const float* beta, float eps, float* y,
                         float* mean, float* rstd) override {
    return Other([&] { return cuda::LayerNorm(M, N, x, gamma, beta, eps, y, mean, rstd, stream_); });
  }
  absl::Status LayerNormGrad(int M, int N, const float* x, const float* gamma, const float* mean, const float* rstd,
                             const float* dy, float* dx, float* dgamma, float* dbeta) override {
    return Other([&] { return cuda::LayerNormGrad(M, N, x, gamma, mean, rstd, dy, dx, dgamma, dbeta, stream_); });
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

  absl::Status Scratch(Buffer* b, size_t bytes) {
    if (b->bytes() >= bytes) return absl::OkStatus();
    ASSIGN_OR_RETURN(*b, Allocate(bytes));
    return absl::OkStatus();
  }

  // One layer forward, input gradient and weight gradient, fused and
  // composed; INTERNAL naming the first output that differs.
  absl::Status CompareFused(DType t, Activation act) {
    const int M = 64, N = 100, K = 72;
    const bool lowp = t != DType::kFp32;
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-1, 1);
    auto host = [&](size_t n) {
      std::vector<float> v(n);
      for (float& f : v) f = u(rng);
      return v;
    };
    const std::vector<float> x = host(size_t{1} * M * K), w = host(size_t{1} * K * N), bias = host(N),
                             dz = host(size_t{1} * M * N);
    auto up = [&](const std::vector<float>& v, Buffer* out) -> absl::Status {
      ASSIGN_OR_RETURN(Buffer f, Allocate(v.size() * 4));
      RETURN_IF_ERROR(CopyToDevice(f.data(), v.data(), v.size() * 4));
      if (!lowp) {
        *out = std::move(f);
        RETURN_IF_ERROR(Synchronize());
        return absl::OkStatus();
      }
      ASSIGN_OR_RETURN(*out, Allocate(v.size() * 2));
      RETURN_IF_ERROR(Cast(DType::kFp32, t, v.size(), f.data(), out->data()));
      return Synchronize();
    };
    Buffer dx_in, dw_in, db_in, dzf;
    RETURN_IF_ERROR(up(x, &dx_in));
    RETURN_IF_ERROR(up(w, &dw_in));
    RETURN_IF_ERROR(up(dz, &dzf));
    ASSIGN_OR_RETURN(Buffer bias_d, Allocate(size_t{4} * N));
    RETURN_IF_ERROR(CopyToDevice(bias_d.data(), bias.data(), size_t{4} * N));
    ASSIGN_OR_RETURN(Buffer dz32, Allocate(size_t{4} * M * N));
    RETURN_IF_ERROR(CopyToDevice(dz32.data(), dz.data(), size_t{4} * M * N));
    // Outputs, read back as fp32: y (or y16), dx (or dx16), db_below, dw, db.
    auto run = [&](bool fused, std::vector<std::vector<float>>* outs) -> absl::Status {
      fused_ = fused;
      ASSIGN_OR_RETURN(Buffer aux, Allocate(std::max<size_t>(1, DenseAuxBytes(t, act, M, N))));
      ASSIGN_OR_RETURN(Buffer y, Allocate(size_t{4} * M * N));
      ASSIGN_OR_RETURN(Buffer y16, Allocate(size_t{2} * M * N));
      ASSIGN_OR_RETURN(Buffer dx, Allocate(size_t{4} * M * N));
      ASSIGN_OR_RETURN(Buffer dx16, Allocate(size_t{2} * M * N));
      ASSIGN_OR_RETURN(Buffer dbb, Allocate(size_t{4} * N));
      ASSIGN_OR_RETURN(Buffer dwo, Allocate(size_t{4} * K * N));
      ASSIGN_OR_RETURN(Buffer dbo, Allocate(size_t{4} * N));
      // Layer F (K -> N): forward. Then the gradient into F's output from
      // a layer G (N -> K) above it, through F's activation (F's aux):
      // dz_G is M x K (x's values), w_G is N x K (w's values). Then F's
      // weight gradient from dz (M x N).
      RETURN_IF_ERROR(DenseForward(t, M, N, K, dx_in.data(), dw_in.data(), bias_d.as<float>(), act, aux.data(),
                                   y.as<float>(), lowp ? y16.as<uint16_t>() : nullptr));
      RETURN_IF_ERROR(DenseInputGrad(t, M, K, N, dx_in.data(), dw_in.data(), act, aux.data(), dx.as<float>(),
                                     lowp ? dx16.as<uint16_t>() : nullptr, dbb.as<float>()));
      RETURN_IF_ERROR(DenseWeightGrad(t, M, N, K, dx_in.data(), dzf.data(), dz32.as<float>(), dwo.as<float>(),
                                      dbo.as<float>()));
      auto down = [&](const Buffer& b, size_t n, bool half) { return ReadBack(b, n, half ? t : DType::kFp32); };
      outs->clear();
      ASSIGN_OR_RETURN(auto oy, down(lowp ? y16 : y, size_t{1} * M * N, lowp));
      ASSIGN_OR_RETURN(auto odx, down(lowp ? dx16 : dx, size_t{1} * M * N, lowp));
      ASSIGN_OR_RETURN(auto odb, down(dbb, N, false));
      ASSIGN_OR_RETURN(auto odw, down(dwo, size_t{1} * K * N, false));
      ASSIGN_OR_RETURN(auto obo, down(dbo, N, false));
      *outs = {oy, odx, odb, odw, obo};
      return absl::OkStatus();
    };
    std::vector<std::vector<float>> fused, plain;
    absl::Status s = run(true, &fused);
    if (s.ok()) s = run(false, &plain);
    fused_ = true;
    if (!s.ok()) return s;
    if (act == Activation::kRelu) RETURN_IF_ERROR(SetKinksAside(N, plain, &fused));
    return SameOutputs(fused, plain, lowp ? 3e-2 : 2e-3);
  }

  // ReLU's kink: where the two paths' pre-activations fall on opposite
  // sides of 0 (in 16 bits the fused GEMM adds the bias rounded to that
  // type), one passes the whole upstream gradient and the other none. That
  // is rounding, not the epilogues disagreeing: those elements of dx, and
  // their share of db_below's column sums, are taken as the unfused ones.
  // More than 1% of them is a real disagreement.
  static absl::Status SetKinksAside(int N, const std::vector<std::vector<float>>& plain,
                                    std::vector<std::vector<float>>* fused) {
    std::vector<float>& y = (*fused)[0];
    std::vector<float>& dx = (*fused)[1];
    std::vector<float>& db_below = (*fused)[2];
    size_t kinks = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      if ((y[i] > 0) == (plain[0][i] > 0)) continue;
      ++kinks;
      db_below[i % N] -= dx[i] - plain[1][i];
      dx[i] = plain[1][i];
    }
    if (kinks * 100 > y.size()) {
      return absl::InternalError(absl::StrCat(kinks, " of ", y.size(), " ReLU outputs are zero on one path only"));
    }
    return absl::OkStatus();
  }

  // `n` elements of `b` (of type `t`) as fp32 on the host.
  absl::StatusOr<std::vector<float>> ReadBack(const Buffer& b, size_t n, DType t) {
    std::vector<float> v(n);
    if (t == DType::kFp32) {
      RETURN_IF_ERROR(CopyToHost(v.data(), b.data(), n * 4));
      RETURN_IF_ERROR(Synchronize());
      return v;
    }
    ASSIGN_OR_RETURN(Buffer f, Allocate(n * 4));
    RETURN_IF_ERROR(Cast(t, DType::kFp32, n, b.data(), f.data()));
    RETURN_IF_ERROR(CopyToHost(v.data(), f.data(), n * 4));
    RETURN_IF_ERROR(Synchronize());
    return v;
  }

  // CompareFused's verdict: each output within `tol` of the unfused one,
  // relative to the unfused output's largest magnitude.
  static absl::Status SameOutputs(const std::vector<std::vector<float>>& fused,
                                  const std::vector<std::vector<float>>& plain, double tol) {
    const char* names[] = {"y", "dx", "db_below", "dw", "db"};
    for (size_t o = 0; o < plain.size(); ++o) {
      double scale = 1e-3;
      for (float v : plain[o]) scale = std::max(scale, static_cast<double>(std::fabs(v)));
      for (size_t i = 0; i < plain[o].size(); ++i) {
        if (!(std::fabs(fused[o][i] - plain[o][i]) <= tol * scale)) {
          return absl::InternalError(absl::StrCat(names[o], "[", i, "] is ", fused[o][i], " fused, ", plain[o][i],
                                                  " unfused"));
        }
      }
    }
    return absl::OkStatus();
  }

  cuda::DeviceInfo info_;
  cudaStream_t stream_;
  std::unique_ptr<cuda::Blas> blas_;
  double* sum_;
  int* flag_;
  bool fused_ = false;
  bool fused_bgrad_ = false;
  absl::Mutex upload_mu_;
  cudaStream_t upload_ = nullptr;  // the data pipeline's uploads (UploadAsync)
  cudaStream_t download_ = nullptr;  // DownloadAsync's copies, queued from the training thread
  Buffer bias16_, dbias_;  // scratch for the fused dense layers
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
  auto backend = std::make_unique<CudaBackend>(*info, stream, std::move(blas), sum, flag);
  backend->CheckFusedLayers();
  return std::unique_ptr<Backend>(std::move(backend));
}

}  // namespace fulcrum::compute
