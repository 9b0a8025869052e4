// Backend: the device a worker computes on. One interface, two
// implementations chosen at run time: the CPU (OpenBLAS GEMMs, loops for the
// rest, threads where they pay) and CUDA (cuBLAS GEMMs, cuda/ kernels).
//
// Conventions: matrices are row-major and dense; every pointer passed to a
// math call is device memory of this backend (host memory for the CPU
// backend). Math calls are queued on the backend's stream in call order and
// may return before the work is done; SumSquares and AllFinite wait for it.
// A backend is used by one thread at a time.
//
// Errors are Statuses naming the call ("cublasSgemm: ..."); a missing GPU is
// not an error of CreateBackend("auto"), which then picks the CPU.
#ifndef FULCRUM_WORKER_COMPUTE_BACKEND_H_
#define FULCRUM_WORKER_COMPUTE_BACKEND_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"

namespace fulcrum::compute {

class Backend;

// Sigmoid and tanh are element-wise only (model graphs); the fused dense
// layers take none, relu or gelu.
enum class Activation { kNone, kRelu, kGelu, kSigmoid, kTanh };
const char* ActivationName(Activation a);
absl::StatusOr<Activation> ActivationFromName(absl::string_view name);

// Device (or pinned host) memory returned to its backend on destruction.
class Buffer {
 public:
  Buffer() = default;
  Buffer(Backend* owner, void* data, size_t bytes, bool host) : owner_(owner), data_(data), bytes_(bytes), host_(host) {}
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { Reset(); }

  void Reset();
  void* data() const { return data_; }
  template <typename T>
  T* as() const { return static_cast<T*>(data_); }
  size_t bytes() const { return bytes_; }

 private:
  Backend* owner_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  bool host_ = false;
};

// A worker-side optimizer (local steps' inner optimizer), with the
// servers' formulas (server/optimizer.cc): weight_decay is L2 added to the
// gradient except for AdamW, where it is decoupled.
struct InnerOptimizer {
  enum class Kind { kSgd, kMomentum, kAdam, kAdamW };
  Kind kind = Kind::kSgd;
  float learning_rate = 0.01f;
  float momentum = 0;
  bool nesterov = false;
  float beta1 = 0.9f, beta2 = 0.999f, epsilon = 1e-8f;
  float weight_decay = 0;
  // State buffers it needs per weight: 0 (SGD), 1 (momentum), 2 (Adam).
  int slots() const { return kind == Kind::kSgd ? 0 : kind == Kind::kMomentum ? 1 : 2; }

  // Adam's and AdamW's per-update scalars for update t (from 1): w = w *
  // decay - step_size * m / (sqrt(v) * inv_bc2_sqrt + epsilon), the
  // gradient plus l2 * w.
  struct AdamScalars {
    float step_size, inv_bc2_sqrt, decay, l2;
  };
  AdamScalars Adam(uint64_t t) const;
};

// An upload's completion (Backend::UploadAsync): a CUDA event on a GPU.
struct UploadEvent {
  std::shared_ptr<void> handle;
};

// Time spent per kind of work, filled only while profiling is on (each call
// then waits for its work so the time is attributable).
struct ComputeProfile {
  double gemm_seconds = 0;
  double other_seconds = 0;
  double copy_seconds = 0;
  uint64_t gemm_flops = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;

  // "cpu (OpenBLAS 0.3.21, 2 threads)", "cuda:0 (NVIDIA H100 80GB HBM3, sm_90)".
  virtual std::string name() const = 0;
  virtual bool is_gpu() const = 0;
  // The device's memory in bytes (the host's for the CPU backend).
  virtual size_t memory_bytes() const = 0;

  // ---- memory
  absl::StatusOr<Buffer> Allocate(size_t bytes);
  // Device memory held in Buffers now, and the most held since
  // ResetPeakAllocated (batch_size auto's measure of a step's footprint).
  size_t allocated_bytes() const { return allocated_.load(std::memory_order_relaxed); }
  size_t peak_allocated_bytes() const { return peak_.load(std::memory_order_relaxed); }
  void ResetPeakAllocated() { peak_.store(allocated_bytes(), std::memory_order_relaxed); }
  // Host memory for staging transfers: page-locked on a GPU backend so copies
  // are asynchronous, aligned plain memory on the CPU.
  absl::StatusOr<Buffer> AllocateHost(size_t bytes);
  // Copies are queued on the stream; the host side must stay valid until
  // Synchronize (with pinned host memory the host thread does not wait).
  virtual absl::Status CopyToDevice(void* dst, const void* host_src, size_t bytes) = 0;
  virtual absl::Status CopyToHost(void* host_dst, const void* src, size_t bytes) = 0;
  virtual absl::Status Copy(void* dst, const void* src, size_t bytes) = 0;
  virtual absl::Status Zero(void* dst, size_t bytes) = 0;
  virtual absl::Status Synchronize() = 0;
  // Uploads on a stream of their own, for the data pipeline's threads: the
  // one part of a backend that may be called from any thread at any time.
  // UploadAsync queues a copy from page-locked host memory (AllocateHost)
  // and records *ready when it is done; WaitForUpload makes this backend's
  // stream wait for *ready before its later work (the host does not wait).
  // So a batch's upload overlaps the step before it. The CPU copies at once.
  virtual absl::Status UploadAsync(void* dst, const void* pinned_src, size_t bytes, UploadEvent* ready);
  virtual absl::Status WaitForUpload(const UploadEvent& ready);
  // Downloads on a stream of their own, so a large copy to the host runs
  // beside the compute that follows it (local rounds' pseudo-gradients):
  // DownloadAsync, called from the thread that drives this backend, queues a
  // copy of device memory `src` into page-locked host memory (AllocateHost)
  // after the work queued so far and records *done when it has landed;
  // WaitForDownload, from any thread, blocks until then. `src` must not be
  // written until *done. The CPU copies at once.
  virtual absl::Status DownloadAsync(void* pinned_dst, const void* src, size_t bytes, UploadEvent* done);
  virtual absl::Status WaitForDownload(const UploadEvent& done);

  // ---- GEMM: C[M,N] = alpha * op(A) * op(B) + beta * C, op(A) is M x K and
  // op(B) K x N; A is stored K x M when trans_a, B N x K when trans_b.
  virtual absl::Status Gemm(bool trans_a, bool trans_b, int M, int N, int K, float alpha,
                            const float* A, const float* B, float beta, float* C) = 0;
  // The same with A and B in bf16 or fp16 (16-bit patterns), fp32
  // accumulation and fp32 C. The CPU backend rounds to the type and runs fp32.
  virtual absl::Status GemmLowp(DType type, bool trans_a, bool trans_b, int M, int N, int K,
                                float alpha, const uint16_t* A, const uint16_t* B, float beta,
                                float* C) = 0;
  // fp32 <-> bf16/fp16, round to nearest even.
  virtual absl::Status Cast(DType from, DType to, size_t n, const void* in, void* out) = 0;

  // ---- element-wise and reductions
  virtual absl::Status BiasAdd(int M, int N, const float* bias, float* y) = 0;       // y[i,:] += bias
  virtual absl::Status ColumnSum(int M, int N, const float* x, float* out) = 0;     // out[j] = sum_i x[i,j]
  virtual absl::Status Activate(Activation a, size_t n, const float* x, float* y) = 0;
  // dx = dy * act'(x), x the pre-activation.
  virtual absl::Status ActivateGrad(Activation a, size_t n, const float* x, const float* dy,
                                    float* dx) = 0;
  virtual absl::Status Axpy(size_t n, float alpha, const float* x, float* y) = 0;   // y += alpha x
  virtual absl::Status Scale(size_t n, float alpha, float* x) = 0;                   // x *= alpha
  // out[i] = sum_k a[i*lda+k] * b[i*ldb+k], k < K.
  virtual absl::Status RowDot(int M, int K, const float* a, int lda, const float* b, int ldb,
                              float* out) = 0;
  // y[i*ldy+k] = s[i] * x[i*ldx+k] (x null: = s[i]), k < K.
  virtual absl::Status ScaleRows(int M, int K, const float* s, const float* x, int ldx, float* y,
                                 int ldy) = 0;
  // Sum of squares (for gradient norms) and finiteness; both wait for the stream.
  virtual absl::StatusOr<double> SumSquares(size_t n, const float* x) = 0;
  virtual absl::StatusOr<bool> AllFinite(size_t n, const float* x) = 0;

  // ---- dense layers (the MLP's), fused where the device can. A GPU runs
  // each as one cuBLASLt GEMM with an epilogue: bias and activation in the
  // forward GEMM, the activation's gradient and the bias gradient in the
  // backward ones, 16-bit outputs written by the GEMM itself. Elsewhere
  // (the CPU, or a GPU whose cuBLASLt fails the startup check) they are the
  // composition of the calls above, which defines their results; gpu_test
  // checks the two agree.
  //
  // `input` is the GEMMs' input type. fp32: x, w and dz are fp32. bf16 or
  // fp16: they are 16-bit patterns of that type, and the layer's outputs
  // for the next GEMM (y16, dx16) are written in it.
  //
  // Forward of a layer: pre = x w + bias (x M x K, w K x N), y = act(pre).
  // `aux` (DenseAuxBytes) receives what DenseInputGrad needs to
  // differentiate act; unused when act is kNone. fp32: y is written. 16-bit:
  // y16 is written (the next layer's x, and its weight gradient's), and y
  // only when y16 is null or the layer is the last (act kNone: the logits,
  // always fp32).
  virtual size_t DenseAuxBytes(DType input, Activation act, int M, int N) const;
  virtual absl::Status DenseForward(DType input, int M, int N, int K, const void* x, const void* w,
                                    const float* bias, Activation act, void* aux, float* y, uint16_t* y16);
  // The layer's weight gradient dw = x^T dz (K x N); with db, also db =
  // column sums of dz_f32 (fp32 dz; a GPU may sum the 16-bit dz instead).
  virtual absl::Status DenseWeightGrad(DType input, int M, int N, int K, const void* x, const void* dz,
                                       const float* dz_f32, float* dw, float* db);
  // The gradient into the layer below: dx = (dz w^T) * act'(pre_below) (M x
  // K), `act` and `aux` the layer below's. With db_below, also its bias
  // gradient (column sums of dx). fp32: dx is written; 16-bit: dx16 (the
  // next weight and input gradients' dz), and dx only on the composed path.
  virtual absl::Status DenseInputGrad(DType input, int M, int N, int K, const void* dz, const void* w,
                                      Activation act, const void* aux, float* dx, uint16_t* dx16, float* db_below);

  // ---- optimizer on the device: one update of w (n floats) by gradient g
  // with `o`; m and v its state (o.slots() of them, zeros at first), t the
  // update's count from 1 (Adam's bias correction).
  virtual absl::Status OptimizerUpdate(const InnerOptimizer& o, size_t n, float* w, const float* g, float* m,
                                       float* v, uint64_t t) = 0;

  // ---- losses (per-row loss out; gradients scaled by `scale`, null to skip)
  // Fused softmax + cross-entropy over rows of N logits: loss[i] =
  // -log softmax(logits_i)[labels_i], pred[i] = argmax, dlogits = scale * (p - onehot).
  virtual absl::Status SoftmaxCrossEntropy(int M, int N, const float* logits, const int32_t* labels,
                                           float scale, float* loss, int32_t* pred,
                                           float* dlogits) = 0;
  // Sigmoid + binary cross-entropy; labels 0/1; prob = sigmoid(logit).
  virtual absl::Status SigmoidCrossEntropy(int M, const float* logits, const float* labels,
                                           float scale, float* loss, float* prob,
                                           float* dlogits) = 0;
  // loss = (pred - target)^2 / 2, dpred = scale * (pred - target).
  virtual absl::Status SquaredError(int M, const float* pred, const float* target, float scale,
                                    float* loss, float* dpred) = 0;

  // ---- embeddings: rows is U x dim, idx index rows.
  virtual absl::Status Gather(int n, int dim, const float* rows, const int32_t* idx, float* out) = 0;
  // out[i, k] = scale * table[idx[i], k] for rows of `cols` bytes: a
  // dataset's stored pixels gathered and decoded on the device
  // (data/device_data.h); bit-identical to the host decoder.
  virtual absl::Status GatherScaleU8(int n, int cols, const uint8_t* table, const int32_t* idx, float scale,
                                     float* out) = 0;
  // rows[idx[i]] += src[i]; duplicate indices add up.
  virtual absl::Status ScatterAdd(int n, int dim, const float* src, const int32_t* idx,
                                  float* rows) = 0;
  // out[b] = sum_{j in [offsets[b], offsets[b+1])} v_j * rows[idx_j]
  //   (square: v_j^2 * rows[idx_j]^2 element-wise); vals null means 1.
  virtual absl::Status EmbeddingBag(int B, int dim, const float* rows, const int32_t* offsets,
                                    const int32_t* idx, const float* vals, bool square,
                                    float* out) = 0;
  // The gradient of EmbeddingBag added into grad (U x dim): grad[idx_j] +=
  // v_j * dout[b] (square: 2 v_j^2 rows[idx_j] * dout[b]).
  virtual absl::Status EmbeddingBagGrad(int B, int dim, const float* dout, const int32_t* offsets,
                                        const int32_t* idx, const float* vals, bool square,
                                        const float* rows, float* grad) = 0;

  // ---- model-graph ops (models/graph_model.h). x holds B examples of n
  // vectors of width d, B x n x d row-major.
  // DLRM's interaction: out[b, p] = <x[b,i], x[b,j]> over the pairs i < j
  // in the order (0,1), (0,2), ..., (0,n-1), (1,2), ...: B x n(n-1)/2.
  virtual absl::Status DotInteraction(int B, int n, int d, const float* x, float* out) = 0;
  // dx[b,i] = sum over j != i of dout[b, pair(i,j)] * x[b,j] (written).
  virtual absl::Status DotInteractionGrad(int B, int n, int d, const float* x, const float* dout, float* dx) = 0;
  // The factorization machine's pairwise term: out[b] = 1/2 sum_k
  // ((sum_i x[b,i,k])^2 - sum_i x[b,i,k]^2), the sum of <x_i, x_j>, i < j.
  virtual absl::Status FmInteraction(int B, int n, int d, const float* x, float* out) = 0;
  // dx[b,i,k] = dout[b] * (sum_j x[b,j,k] - x[b,i,k]) (written).
  virtual absl::Status FmInteractionGrad(int B, int n, int d, const float* x, const float* dout, float* dx) = 0;
  // Layer normalization of each row of N: y = (x - mean) * rstd * gamma +
  // beta, rstd = 1 / sqrt(variance + eps) (the biased variance); mean and
  // rstd (M each) are kept for the gradient.
  virtual absl::Status LayerNorm(int M, int N, const float* x, const float* gamma, const float* beta, float eps,
                                 float* y, float* mean, float* rstd) = 0;
  // dx (written), and dgamma and dbeta (written: sums over the rows).
  virtual absl::Status LayerNormGrad(int M, int N, const float* x, const float* gamma, const float* mean,
                                     const float* rstd, const float* dy, float* dx, float* dgamma, float* dbeta) = 0;

  // ---- profiling
  void set_profiling(bool on) { profiling_ = on; }
  bool profiling() const { return profiling_; }
  const ComputeProfile& profile() const { return profile_; }
  void ResetProfile() { profile_ = {}; }

 protected:
  friend class Buffer;
  virtual absl::StatusOr<void*> RawAllocate(size_t bytes) = 0;
  virtual void RawFree(void* p) = 0;
  virtual absl::StatusOr<void*> RawAllocateHost(size_t bytes) = 0;
  virtual void RawFreeHost(void* p) = 0;

  bool profiling_ = false;
  ComputeProfile profile_;

 private:
  void Track(size_t bytes, bool add);
  std::atomic<size_t> allocated_{0}, peak_{0};
};

// Picks the backend for `device`: "cpu", "cuda:N", or "auto" (the first
// usable GPU, else the CPU). *why says which was picked and why ("no GPU:
// CUDA driver not found"), for the startup log. `cpu_threads` 0 = all cores.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(absl::string_view device, std::string* why,
                                                       int cpu_threads = 0);

// OK when `device` is a value CreateBackend understands (auto, cpu, cuda,
// cuda:N), whether or not that device is present; INVALID_ARGUMENT naming
// the allowed values otherwise. Cheap: touches no device.
absl::Status CheckDeviceName(absl::string_view device);

std::unique_ptr<Backend> NewCpuBackend(int threads);
// True when this build has the CUDA backend (built with nvcc).
bool CudaBackendBuilt();

}  // namespace fulcrum::compute

#endif  // FULCRUM_WORKER_COMPUTE_BACKEND_H_
