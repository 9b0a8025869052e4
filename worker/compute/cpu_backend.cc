// The CPU backend: OpenBLAS for GEMMs, plain loops for the rest, split over
// threads when an array is large enough to pay for it.
#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "worker/compute/backend.h"

extern "C" {
void openblas_set_num_threads(int num_threads);
char* openblas_get_config(void);
}

namespace fulcrum::compute {
namespace {

using Clock = std::chrono::steady_clock;

// Adds the wall time of a scope to a profile counter while profiling.
class Timed {
 public:
  Timed(bool on, double* counter) : counter_(on ? counter : nullptr) {
    if (counter_) start_ = Clock::now();
  }
  ~Timed() {
    if (counter_) *counter_ += std::chrono::duration<double>(Clock::now() - start_).count();
  }

 private:
  double* counter_;
  Clock::time_point start_;
};

absl::Status CheckDims(const char* op, int64_t a, int64_t b = 1, int64_t c = 1) {
  if (a < 0 || b < 0 || c < 0) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": negative dimension (", a, ", ", b, ", ", c, ")"));
  }
  return absl::OkStatus();
}

inline float GeluF(float x) { return 0.5f * x * (1.0f + std::erf(x * 0.70710678118654752f)); }
inline float GeluGradF(float x) {
  const float cdf = 0.5f * (1.0f + std::erf(x * 0.70710678118654752f));
  const float pdf = 0.39894228040143268f * std::exp(-0.5f * x * x);
  return cdf + x * pdf;
}

inline float SigmoidF(float x) { return 1.0f / (1.0f + std::exp(-x)); }

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) : threads_(threads > 0 ? threads : std::max(1u, std::thread::hardware_concurrency())) {
    openblas_set_num_threads(threads_);
  }

  std::string name() const override {
    const char* config = openblas_get_config();
    return absl::StrCat("cpu (", config ? config : "OpenBLAS", ", ", threads_, " threads)");
  }
  bool is_gpu() const override { return false; }
  size_t memory_bytes() const override {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : 0;
  }

  absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) override { return Copy(dst, src, bytes); }
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override { return Copy(dst, src, bytes); }
  absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    Timed t(profiling_, &profile_.copy_seconds);
    if (bytes > 0 && dst != src) std::memmove(dst, src, bytes);
    return absl::OkStatus();
  }
  absl::Status Zero(void* dst, size_t bytes) override {
    if (bytes > 0) std::memset(dst, 0, bytes);
    return absl::OkStatus();
  }
  absl::Status Synchronize() override { return absl::OkStatus(); }

  absl::Status Gemm(bool ta, bool tb, int M, int N, int K, float alpha, const float* A, const float* B,
                    float beta, float* C) override {
    if (auto s = CheckDims("Gemm", M, N, K); !s.ok()) return s;
    if (M == 0 || N == 0) return absl::OkStatus();
    Timed t(profiling_, &profile_.gemm_seconds);
    if (profiling_) profile_.gemm_flops += 2ull * M * N * K;
    if (K == 0) {  // BLAS leaves C alone when K == 0; C = beta * C is what we promise.
      for (size_t i = 0; i < size_t{1} * M * N; ++i) C[i] = beta == 0 ? 0.0f : beta * C[i];
      return absl::OkStatus();
    }
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, M, N, K,
                alpha, A, ta ? M : K, B, tb ? K : N, beta, C, N);
    return absl::OkStatus();
  }

  absl::Status GemmLowp(DType type, bool ta, bool tb, int M, int N, int K, float alpha, const uint16_t* A,
                        const uint16_t* B, float beta, float* C) override {
    if (type != DType::kBf16 && type != DType::kFp16) {
      return absl::InvalidArgumentError(absl::StrCat("GemmLowp: inputs must be bf16 or fp16, not ", DTypeName(type)));
    }
    a_tmp_.resize(size_t{1} * M * K);
    b_tmp_.resize(size_t{1} * K * N);
    DecodeFloats(A, a_tmp_.size(), type, a_tmp_.data());
    DecodeFloats(B, b_tmp_.size(), type, b_tmp_.data());
    return Gemm(ta, tb, M, N, K, alpha, a_tmp_.data(), b_tmp_.data(), beta, C);
  }

  absl::Status Cast(DType from, DType to, size_t n, const void* in, void* out) override {
    Timed t(profiling_, &profile_.other_seconds);
    if (from == DType::kFp32 && (to == DType::kBf16 || to == DType::kFp16)) {
      EncodeFloats(static_cast<const float*>(in), n, to, out);
    } else if (to == DType::kFp32 && (from == DType::kBf16 || from == DType::kFp16)) {
      DecodeFloats(in, n, from, static_cast<float*>(out));
    } else if (from == to && from == DType::kFp32) {
      std::memmove(out, in, n * 4);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("Cast: ", DTypeName(from), " to ", DTypeName(to), " is not supported"));
    }
    return absl::OkStatus();
  }

  absl::Status BiasAdd(int M, int N, const float* bias, float* y) override {
    Timed t(profiling_, &profile_.other_seconds);
    Rows(M, size_t{1} * N, [&](int b, int e) {
      for (int i = b; i < e; ++i) {
        float* row = y + size_t{1} * i * N;
        for (int j = 0; j < N; ++j) row[j] += bias[j];
      }
    });
    return absl::OkStatus();
  }

  absl::Status ColumnSum(int M, int N, const float* x, float* out) override {
    Timed t(profiling_, &profile_.other_seconds);
    std::fill(out, out + N, 0.0f);
    for (int i = 0; i < M; ++i) {
      const float* row = x + size_t{1} * i * N;
      for (int j = 0; j < N; ++j) out[j] += row[j];
    }
    return absl::OkStatus();
  }

  absl::Status Activate(Activation a, size_t n, const float* x, float* y) override {
    Timed t(profiling_, &profile_.other_seconds);
    Elements(n, [&](size_t b, size_t e) {
      switch (a) {
        case Activation::kNone: if (x != y) std::memmove(y + b, x + b, (e - b) * 4); break;
        case Activation::kRelu: for (size_t i = b; i < e; ++i) y[i] = x[i] > 0 ? x[i] : 0.0f; break;
        case Activation::kGelu: for (size_t i = b; i < e; ++i) y[i] = GeluF(x[i]); break;
        case Activation::kSigmoid: for (size_t i = b; i < e; ++i) y[i] = SigmoidF(x[i]); break;
        case Activation::kTanh: for (size_t i = b; i < e; ++i) y[i] = std::tanh(x[i]); break;
      }
    });
    return absl::OkStatus();
  }

  absl::Status ActivateGrad(Activation a, size_t n, const float* x, const float* dy, float* dx) override {
    Timed t(profiling_, &profile_.other_seconds);
    Elements(n, [&](size_t b, size_t e) {
      switch (a) {
        case Activation::kNone: if (dx != dy) std::memmove(dx + b, dy + b, (e - b) * 4); break;
        case Activation::kRelu: for (size_t i = b; i < e; ++i) dx[i] = x[i] > 0 ? dy[i] : 0.0f; break;
        case Activation::kGelu: for (size_t i = b; i < e; ++i) dx[i] = dy[i] * GeluGradF(x[i]); break;
        case Activation::kSigmoid:
          for (size_t i = b; i < e; ++i) {
            const float s = SigmoidF(x[i]);
            dx[i] = dy[i] * s * (1.0f - s);
          }
          break;
        case Activation::kTanh:
          for (size_t i = b; i < e; ++i) {
            const float t = std::tanh(x[i]);
            dx[i] = dy[i] * (1.0f - t * t);
          }
          break;
      }
    });
    return absl::OkStatus();
  }

  absl::Status Axpy(size_t n, float alpha, const float* x, float* y) override {
    Timed t(profiling_, &profile_.other_seconds);
    for (size_t i = 0; i < n; ++i) y[i] += alpha * x[i];
    return absl::OkStatus();
  }
  absl::Status OptimizerUpdate(const InnerOptimizer& o, size_t n, float* w, const float* g, float* m, float* v,
                               uint64_t t) override {
    Timed timed(profiling_, &profile_.other_seconds);
    const float lr = o.learning_rate, wd = o.weight_decay, mu = o.momentum;
    switch (o.kind) {
      case InnerOptimizer::Kind::kSgd:
        Elements(n, [&](size_t b, size_t e) {
          for (size_t i = b; i < e; ++i) w[i] -= lr * (g[i] + wd * w[i]);
        });
        break;
      case InnerOptimizer::Kind::kMomentum:
        Elements(n, [&](size_t b, size_t e) {
          for (size_t i = b; i < e; ++i) {
            const float gi = g[i] + wd * w[i];
            m[i] = mu * m[i] + gi;
            w[i] -= o.nesterov ? lr * (gi + mu * m[i]) : lr * m[i];
          }
        });
        break;
      case InnerOptimizer::Kind::kAdam:
      case InnerOptimizer::Kind::kAdamW: {
        const InnerOptimizer::AdamScalars a = o.Adam(t);
        Elements(n, [&](size_t b, size_t e) {
          for (size_t i = b; i < e; ++i) {
            const float gi = g[i] + a.l2 * w[i];
            m[i] = o.beta1 * m[i] + (1.0f - o.beta1) * gi;
            v[i] = o.beta2 * v[i] + (1.0f - o.beta2) * gi * gi;
            const float denom = std::sqrt(v[i]) * a.inv_bc2_sqrt + o.epsilon;
            w[i] = w[i] * a.decay - a.step_size * m[i] / denom;
          }
        });
        break;
      }
    }
    return absl::OkStatus();
  }

  absl::Status Scale(size_t n, float alpha, float* x) override {
    Timed t(profiling_, &profile_.other_seconds);
    for (size_t i = 0; i < n; ++i) x[i] *= alpha;
    return absl::OkStatus();
  }

  absl::Status RowDot(int M, int K, const float* a, int lda, const float* b, int ldb, float* out) override {
    Timed t(profiling_, &profile_.other_seconds);
    for (int i = 0; i < M; ++i) {
      const float* ra = a + size_t{1} * i * lda;
      const float* rb = b + size_t{1} * i * ldb;
      float s = 0;
      for (int k = 0; k < K; ++k) s += ra[k] * rb[k];
      out[i] = s;
    }
    return absl::OkStatus();
  }

  absl::Status ScaleRows(int M, int K, const float* s, const float* x, int ldx, float* y, int ldy) override {
    Timed t(profiling_, &profile_.other_seconds);
    for (int i = 0; i < M; ++i) {
      float* ry = y + size_t{1} * i * ldy;
      if (x == nullptr) {
        std::fill(ry, ry + K, s[i]);
      } else {
        const float* rx = x + size_t{1} * i * ldx;
        for (int k = 0; k < K; ++k) ry[k] = s[i] * rx[k];
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<double> SumSquares(size_t n, const float* x) override {
    Timed t(profiling_, &profile_.other_seconds);
    double s = 0;
    for (size_t i = 0; i < n; ++i) s += double{x[i]} * x[i];
    return s;
  }
  absl::StatusOr<bool> AllFinite(size_t n, const float* x) override { return fulcrum::AllFinite(x, n); }

  absl::Status SoftmaxCrossEntropy(int M, int N, const float* logits, const int32_t* labels, float scale,
                                   float* loss, int32_t* pred, float* dlogits) override {
    Timed t(profiling_, &profile_.other_seconds);
    for (int i = 0; i < M; ++i) {
      if (labels[i] < 0 || labels[i] >= N) {
        return absl::InvalidArgumentError(absl::StrCat("SoftmaxCrossEntropy: label ", labels[i], " of row ", i,
                                                       " is outside [0, ", N, ")"));
      }
    }
    Rows(M, size_t{8} * N, [&](int b, int e) {
      for (int i = b; i < e; ++i) {
        const float* z = logits + size_t{1} * i * N;
        int arg = 0;
        float mx = z[0];
        for (int j = 1; j < N; ++j) {
          if (z[j] > mx) { mx = z[j]; arg = j; }
        }
        double sum = 0;
        for (int j = 0; j < N; ++j) sum += std::exp(double{z[j]} - mx);
        const double log_sum = std::log(sum);
        if (loss) loss[i] = static_cast<float>(log_sum - (z[labels[i]] - mx));
        if (pred) pred[i] = arg;
        if (dlogits) {
          float* d = dlogits + size_t{1} * i * N;
          for (int j = 0; j < N; ++j) {
            const double p = std::exp(double{z[j]} - mx - log_sum);
            d[j] = static_cast<float>(scale * (p - (j == labels[i] ? 1.0 : 0.0)));
          }
        }
      }
    });
    return absl::OkStatus();
  }

  absl::Status SigmoidCrossEntropy(int M, const float* logits, const float* labels, float scale, float* loss,
                                   float* prob, float* dlogits) override {
    Timed t(profiling_, &profile_.other_seconds);
    for (int i = 0; i < M; ++i) {
      const double z = logits[i], y = labels[i];
      const double p = 1.0 / (1.0 + std::exp(-z));
      // Stable log(1 + e^-|z|) form of -[y log p + (1-y) log(1-p)].
      if (loss) loss[i] = static_cast<float>(std::max(z, 0.0) - z * y + std::log1p(std::exp(-std::fabs(z))));
      if (prob) prob[i] = static_cast<float>(p);
      if (dlogits) dlogits[i] = static_cast<float>(scale * (p - y));
    }
    return absl::OkStatus();
  }

  absl::Status SquaredError(int M, const float* pred, const float* target, float scale, float* loss,
                            float* dpred) override {
    Timed t(profiling_, &profile_.other_seconds);
    for (int i = 0; i < M; ++i) {
      const float d = pred[i] - target[i];
      if (loss) loss[i] = 0.5f * d * d;
      if (dpred) dpred[i] = scale * d;
    }
    return absl::OkStatus();
  }

  absl::Status Gather(int n, int dim, const float* rows, const int32_t* idx, float* out) override {
    Timed t(profiling_, &profile_.other_seconds);
    for (int i = 0; i < n; ++i) std::memcpy(out + size_t{1} * i * dim, rows + size_t{1} * idx[i] * dim, dim * 4);
    return absl::OkStatus();
  }

  absl::Status GatherScaleU8(int n, int cols, const uint8_t* table, const int32_t* idx, float scale,
                             float* out) override {
    Timed t(profiling_, &profile_.other_seconds);
    for (int i = 0; i < n; ++i) {
      const uint8_t* src = table + size_t{1} * idx[i] * cols;
      float* dst = out + size_t{1} * i * cols;
      for (int k = 0; k < cols; ++k) dst[k] = src[k] * scale;
    }
    return absl::OkStatus();
  }

  absl::Status ScatterAdd(int n, int dim, const float* src, const int32_t* idx, float* rows) override {
    Timed t(profiling_, &profile_.other_seconds);
    for (int i = 0; i < n; ++i) {
      float* r = rows + size_t{1} * idx[i] * dim;
      const float* s = src + size_t{1} * i * dim;
      for (int k = 0; k < dim; ++k) r[k] += s[k];
    }
    return absl::OkStatus();
  }

  absl::Status EmbeddingBag(int B, int dim, const float* rows, const int32_t* offsets, const int32_t* idx,
                            const float* vals, bool square, float* out) override {
    Timed t(profiling_, &profile_.other_seconds);
    const size_t work = (B > 0 ? static_cast<size_t>(offsets[B]) : 0) * dim;
    // Bags are independent: split them over threads.
    Split(static_cast<size_t>(std::max(B, 0)), work, [&](size_t bb, size_t be) {
      for (size_t b = bb; b < be; ++b) {
        float* o = out + b * dim;
        std::fill(o, o + dim, 0.0f);
        for (int j = offsets[b]; j < offsets[b + 1]; ++j) {
          const float v = vals ? vals[j] : 1.0f;
          const float* r = rows + size_t{1} * idx[j] * dim;
          if (square) {
            for (int k = 0; k < dim; ++k) o[k] += v * v * r[k] * r[k];
          } else {
            for (int k = 0; k < dim; ++k) o[k] += v * r[k];
          }
        }
      }
    });
    return absl::OkStatus();
  }

  absl::Status EmbeddingBagGrad(int B, int dim, const float* dout, const int32_t* offsets, const int32_t* idx,
                                const float* vals, bool square, const float* rows, float* grad) override {
    Timed t(profiling_, &profile_.other_seconds);
    if (B <= 0) return absl::OkStatus();
    const int nnz = offsets[B];
    int32_t rows_used = 0;
    for (int j = 0; j < nnz; ++j) rows_used = std::max(rows_used, idx[j] + 1);
    // Several bags may add into one row: each thread owns a range of rows
    // and applies only the features that land in it, so no two threads
    // write the same row and the sums keep the sequential order per row.
    Split(static_cast<size_t>(rows_used), size_t{1} * nnz * dim, [&](size_t lo, size_t hi) {
      for (int b = 0; b < B; ++b) {
        const float* d = dout + size_t{1} * b * dim;
        for (int j = offsets[b]; j < offsets[b + 1]; ++j) {
          const size_t row = static_cast<size_t>(idx[j]);
          if (row < lo || row >= hi) continue;
          const float v = vals ? vals[j] : 1.0f;
          float* g = grad + row * dim;
          if (square) {
            const float* r = rows + row * dim;
            for (int k = 0; k < dim; ++k) g[k] += 2.0f * v * v * r[k] * d[k];
          } else {
            for (int k = 0; k < dim; ++k) g[k] += v * d[k];
          }
        }
      }
    });
    return absl::OkStatus();
  }

  // ---- model-graph ops: examples split over threads.
  absl::Status DotInteraction(int B, int n, int d, const float* x, float* out) override {
    Timed t(profiling_, &profile_.other_seconds);
    const size_t P = size_t{1} * n * (n - 1) / 2;
    Split(static_cast<size_t>(std::max(B, 0)), size_t{1} * B * P * d, [&](size_t lo, size_t hi) {
      for (size_t b = lo; b < hi; ++b) {
        const float* xb = x + b * n * d;
        float* o = out + b * P;
        for (int i = 0; i < n; ++i) {
          for (int j = i + 1; j < n; ++j) {
            float s = 0;
            for (int k = 0; k < d; ++k) s += xb[size_t{1} * i * d + k] * xb[size_t{1} * j * d + k];
            *o++ = s;
          }
        }
      }
    });
    return absl::OkStatus();
  }
  absl::Status DotInteractionGrad(int B, int n, int d, const float* x, const float* dout, float* dx) override {
    Timed t(profiling_, &profile_.other_seconds);
    const size_t P = size_t{1} * n * (n - 1) / 2;
    Split(static_cast<size_t>(std::max(B, 0)), size_t{1} * B * P * d, [&](size_t lo, size_t hi) {
      for (size_t b = lo; b < hi; ++b) {
        const float* xb = x + b * n * d;
        float* g = dx + b * n * d;
        std::fill(g, g + size_t{1} * n * d, 0.0f);
        const float* o = dout + b * P;
        for (int i = 0; i < n; ++i) {
          for (int j = i + 1; j < n; ++j) {
            const float c = *o++;
            for (int k = 0; k < d; ++k) {
              g[size_t{1} * i * d + k] += c * xb[size_t{1} * j * d + k];
              g[size_t{1} * j * d + k] += c * xb[size_t{1} * i * d + k];
            }
          }
        }
      }
    });
    return absl::OkStatus();
  }
  absl::Status FmInteraction(int B, int n, int d, const float* x, float* out) override {
    Timed t(profiling_, &profile_.other_seconds);
    for (int b = 0; b < B; ++b) {
      const float* xb = x + size_t{1} * b * n * d;
      float total = 0;
      for (int k = 0; k < d; ++k) {
        float s = 0, q = 0;
        for (int i = 0; i < n; ++i) {
          const float v = xb[size_t{1} * i * d + k];
          s += v;
          q += v * v;
        }
        total += s * s - q;
      }
      out[b] = 0.5f * total;
    }
    return absl::OkStatus();
  }
  absl::Status FmInteractionGrad(int B, int n, int d, const float* x, const float* dout, float* dx) override {
    Timed t(profiling_, &profile_.other_seconds);
    for (int b = 0; b < B; ++b) {
      const float* xb = x + size_t{1} * b * n * d;
      float* g = dx + size_t{1} * b * n * d;
      for (int k = 0; k < d; ++k) {
        float s = 0;
        for (int i = 0; i < n; ++i) s += xb[size_t{1} * i * d + k];
        for (int i = 0; i < n; ++i) g[size_t{1} * i * d + k] = dout[b] * (s - xb[size_t{1} * i * d + k]);
      }
    }
    return absl::OkStatus();
  }
  absl::Status LayerNorm(int M, int N, const float* x, const float* gamma, const float* beta, float eps, float* y,
                         float* mean, float* rstd) override {
    Timed t(profiling_, &profile_.other_seconds);
    for (int i = 0; i < M; ++i) {
      const float* r = x + size_t{1} * i * N;
      double s = 0, q = 0;
      for (int j = 0; j < N; ++j) s += r[j];
      const double mu = s / N;
      for (int j = 0; j < N; ++j) q += (r[j] - mu) * (r[j] - mu);
      const float rs = static_cast<float>(1.0 / std::sqrt(q / N + eps));
      mean[i] = static_cast<float>(mu);
      rstd[i] = rs;
      float* o = y + size_t{1} * i * N;
      for (int j = 0; j < N; ++j) o[j] = (r[j] - mean[i]) * rs * gamma[j] + beta[j];
    }
    return absl::OkStatus();
  }
  absl::Status LayerNormGrad(int M, int N, const float* x, const float* gamma, const float* mean, const float* rstd,
                             const float* dy, float* dx, float* dgamma, float* dbeta) override {
    Timed t(profiling_, &profile_.other_seconds);
    std::fill(dgamma, dgamma + N, 0.0f);
    std::fill(dbeta, dbeta + N, 0.0f);
    for (int i = 0; i < M; ++i) {
      const float* r = x + size_t{1} * i * N;
      const float* g = dy + size_t{1} * i * N;
      float* o = dx + size_t{1} * i * N;
      // dxhat = dy * gamma; dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)).
      double a = 0, c = 0;
      for (int j = 0; j < N; ++j) {
        const float xhat = (r[j] - mean[i]) * rstd[i];
        const float dh = g[j] * gamma[j];
        a += dh;
        c += dh * xhat;
        dgamma[j] += g[j] * xhat;
        dbeta[j] += g[j];
      }
      const float ma = static_cast<float>(a / N), mc = static_cast<float>(c / N);
      for (int j = 0; j < N; ++j) {
        const float xhat = (r[j] - mean[i]) * rstd[i];
        o[j] = rstd[i] * (g[j] * gamma[j] - ma - xhat * mc);
      }
    }
    return absl::OkStatus();
  }

 protected:
  absl::StatusOr<void*> RawAllocate(size_t bytes) override {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (p == nullptr) return absl::ResourceExhaustedError(absl::StrCat("cpu: cannot allocate ", bytes, " bytes"));
    return p;
  }
  void RawFree(void* p) override { std::free(p); }
  absl::StatusOr<void*> RawAllocateHost(size_t bytes) override { return RawAllocate(bytes); }
  void RawFreeHost(void* p) override { std::free(p); }

 private:
  // Runs f(begin, end) over [0, n) on up to threads_ threads when the work
  // (n * cost elements) is big enough to pay for starting them.
  template <typename F>
  void Split(size_t n, size_t work, F&& f) {
    const int parts = work < (size_t{1} << 18) ? 1 : static_cast<int>(std::min<size_t>(threads_, n));
    if (parts <= 1) {
      f(size_t{0}, n);
      return;
    }
    std::vector<std::thread> ts;
    for (int p = 1; p < parts; ++p) ts.emplace_back([&, p] { f(n * p / parts, n * (p + 1) / parts); });
    f(size_t{0}, n / parts);
    for (auto& t : ts) t.join();
  }
  template <typename F>
  void Elements(size_t n, F&& f) { Split(n, n, f); }
  template <typename F>
  void Rows(int m, size_t row_cost, F&& f) {
    Split(static_cast<size_t>(m), m * row_cost, [&](size_t b, size_t e) { f(static_cast<int>(b), static_cast<int>(e)); });
  }

  const int threads_;
  std::vector<float> a_tmp_, b_tmp_;
};

}  // namespace

std::unique_ptr<Backend> NewCpuBackend(int threads) { return std::make_unique<CpuBackend>(threads); }

}  // namespace fulcrum::compute
