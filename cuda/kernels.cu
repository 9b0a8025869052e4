#include "cuda/kernels.h"

#include "cuda/launch.cuh"

#include <algorithm>
#include <cmath>
#include <string>

namespace fulcrum::cuda {
namespace {

using launch::Blocks;
using launch::kThreads;
using launch::Launched;
using launch::WarpBlocks;
using launch::WarpSum;

#define GRID_STRIDE FULCRUM_GRID_STRIDE

__device__ __forceinline__ float Gelu(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
__device__ __forceinline__ float GeluGrad(float x) {
  const float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
  return cdf + x * 0.39894228040143268f * expf(-0.5f * x * x);
}

__global__ void BiasAddKernel(size_t M, int N, const float* bias, float* y) {
  GRID_STRIDE(i, M * N) { y[i] += bias[i % N]; }
}

// One thread per column; rows are walked in order (adjacent threads read
// adjacent addresses).
__global__ void ColumnSumKernel(int M, int N, const float* x, float* out) {
  GRID_STRIDE(j, static_cast<size_t>(N)) {
    float s = 0;
    for (int i = 0; i < M; ++i) s += x[size_t{1} * i * N + j];
    out[j] = s;
  }
}

__global__ void ActivateKernel(int a, size_t n, const float* x, float* y) {
  GRID_STRIDE(i, n) {
    const float v = x[i];
    y[i] = a == 1 ? fmaxf(v, 0.0f) : a == 2 ? Gelu(v) : a == 3 ? 1.0f / (1.0f + expf(-v)) : a == 4 ? tanhf(v) : v;
  }
}

__global__ void ActivateGradKernel(int a, size_t n, const float* x, const float* dy, float* dx) {
  GRID_STRIDE(i, n) {
    const float v = x[i];
    float g = 1.0f;
    if (a == 1) {
      g = v > 0 ? 1.0f : 0.0f;
    } else if (a == 2) {
      g = GeluGrad(v);
    } else if (a == 3) {
      const float sg = 1.0f / (1.0f + expf(-v));
      g = sg * (1.0f - sg);
    } else if (a == 4) {
      const float t = tanhf(v);
      g = 1.0f - t * t;
    }
    dx[i] = dy[i] * g;
  }
}

__global__ void AxpyKernel(size_t n, float alpha, const float* x, float* y) {
  GRID_STRIDE(i, n) { y[i] += alpha * x[i]; }
}
__global__ void ScaleKernel(size_t n, float alpha, float* x) {
  GRID_STRIDE(i, n) { x[i] *= alpha; }
}

__device__ __forceinline__ double WarpSumD(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// One warp per row.
__global__ void RowDotKernel(int M, int K, const float* a, int lda, const float* b, int ldb, float* out) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (warp >= M) return;
  float s = 0;
  for (int k = lane; k < K; k += 32) s += a[size_t{1} * warp * lda + k] * b[size_t{1} * warp * ldb + k];
  s = WarpSum(s);
  if (lane == 0) out[warp] = s;
}

__global__ void ScaleRowsKernel(int M, int K, const float* scale, const float* x, int ldx, float* y, int ldy) {
  GRID_STRIDE(t, size_t{1} * M * K) {
    const size_t i = t / K, k = t % K;
    y[i * ldy + k] = x ? scale[i] * x[i * ldx + k] : scale[i];
  }
}

__global__ void SumSquaresKernel(size_t n, const float* x, double* out) {
  double s = 0;
  GRID_STRIDE(i, n) { s += double{x[i]} * x[i]; }
  s = WarpSumD(s);
  __shared__ double partial[kThreads / 32];
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = s;
  __syncthreads();
  if (threadIdx.x < 32) {
    s = threadIdx.x < kThreads / 32 ? partial[threadIdx.x] : 0.0;
    s = WarpSumD(s);
    if (threadIdx.x == 0) atomicAdd(out, s);
  }
}

__global__ void NonFiniteKernel(size_t n, const float* x, int* flag) {
  GRID_STRIDE(i, n) {
    if (!isfinite(x[i])) *flag = 1;
  }
}

// One warp per row: max, sum of exponentials, then the gradient.
__global__ void SoftmaxXentKernel(int M, int N, const float* logits, const int32_t* labels, float scale, float* loss,
                                  int32_t* pred, float* dlogits) {
  const int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (row >= M) return;
  const float* z = logits + size_t{1} * row * N;
  float mx = -INFINITY;
  int arg = 0;
  for (int j = lane; j < N; j += 32) {
    if (z[j] > mx) { mx = z[j]; arg = j; }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float om = __shfl_xor_sync(0xffffffffu, mx, o);
    const int oa = __shfl_xor_sync(0xffffffffu, arg, o);
    if (om > mx || (om == mx && oa < arg)) { mx = om; arg = oa; }
  }
  float sum = 0;
  for (int j = lane; j < N; j += 32) sum += expf(z[j] - mx);
  sum = WarpSum(sum);
  const float log_sum = logf(sum);
  const int y = labels[row];
  const bool valid = y >= 0 && y < N;
  if (lane == 0) {
    if (loss) loss[row] = valid ? log_sum - (z[y] - mx) : NAN;
    if (pred) pred[row] = arg;
  }
  if (dlogits) {
    float* d = dlogits + size_t{1} * row * N;
    for (int j = lane; j < N; j += 32) d[j] = scale * (expf(z[j] - mx - log_sum) - (j == y ? 1.0f : 0.0f));
  }
}

__global__ void SigmoidXentKernel(int M, const float* logits, const float* labels, float scale, float* loss,
                                  float* prob, float* dlogits) {
  GRID_STRIDE(i, static_cast<size_t>(M)) {
    const float z = logits[i], y = labels[i];
    const float p = 1.0f / (1.0f + expf(-z));
    if (loss) loss[i] = fmaxf(z, 0.0f) - z * y + log1pf(expf(-fabsf(z)));
    if (prob) prob[i] = p;
    if (dlogits) dlogits[i] = scale * (p - y);
  }
}

__global__ void SquaredErrorKernel(int M, const float* pred, const float* target, float scale, float* loss,
                                   float* dpred) {
  GRID_STRIDE(i, static_cast<size_t>(M)) {
    const float d = pred[i] - target[i];
    if (loss) loss[i] = 0.5f * d * d;
    if (dpred) dpred[i] = scale * d;
  }
}

__global__ void GatherKernel(int n, int dim, const float* rows, const int32_t* idx, float* out) {
  GRID_STRIDE(t, size_t{1} * n * dim) {
    const size_t i = t / dim, k = t % dim;
    out[t] = rows[size_t{1} * idx[i] * dim + k];
  }
}

// One thread per output float; consecutive threads read consecutive bytes
// of one row, so a warp's loads coalesce. The multiply is the one the host
// decoder does (byte to float, times scale): the same bits.
__global__ void GatherScaleU8Kernel(int n, int cols, const uint8_t* table, const int32_t* idx, float scale,
                                    float* out) {
  GRID_STRIDE(t, size_t{1} * n * cols) {
    const size_t i = t / cols, k = t % cols;
    out[t] = static_cast<float>(table[size_t{1} * idx[i] * cols + k]) * scale;
  }
}

// Duplicate indices add up through atomics.
__global__ void ScatterAddKernel(int n, int dim, const float* src, const int32_t* idx, float* rows) {
  GRID_STRIDE(t, size_t{1} * n * dim) {
    const size_t i = t / dim, k = t % dim;
    atomicAdd(&rows[size_t{1} * idx[i] * dim + k], src[t]);
  }
}

__global__ void EmbeddingBagKernel(int B, int dim, const float* rows, const int32_t* offsets, const int32_t* idx,
                                   const float* vals, bool square, float* out) {
  GRID_STRIDE(t, size_t{1} * B * dim) {
    const size_t b = t / dim, k = t % dim;
    float s = 0;
    for (int j = offsets[b]; j < offsets[b + 1]; ++j) {
      const float v = vals ? vals[j] : 1.0f;
      const float r = rows[size_t{1} * idx[j] * dim + k];
      s += square ? v * v * r * r : v * r;
    }
    out[t] = s;
  }
}

__global__ void EmbeddingBagGradKernel(int B, int dim, const float* dout, const int32_t* offsets,
                                       const int32_t* idx, const float* vals, bool square, const float* rows,
                                       float* grad) {
  GRID_STRIDE(t, size_t{1} * B * dim) {
    const size_t b = t / dim, k = t % dim;
    const float d = dout[t];
    for (int j = offsets[b]; j < offsets[b + 1]; ++j) {
      const float v = vals ? vals[j] : 1.0f;
      const size_t at = size_t{1} * idx[j] * dim + k;
      atomicAdd(&grad[at], square ? 2.0f * v * v * rows[at] * d : v * d);
    }
  }
}


}  // namespace

CudaStatus BiasAdd(int M, int N, const float* bias, float* y, cudaStream_t s) {
  if (M <= 0 || N <= 0) return CudaStatus::Ok();
  BiasAddKernel<<<Blocks(size_t{1} * M * N), kThreads, 0, s>>>(M, N, bias, y);
  return Launched("BiasAddKernel");
}
CudaStatus ColumnSum(int M, int N, const float* x, float* out, cudaStream_t s) {
  if (N <= 0) return CudaStatus::Ok();
  ColumnSumKernel<<<Blocks(N), kThreads, 0, s>>>(M, N, x, out);
  return Launched("ColumnSumKernel");
}
CudaStatus Activate(Act a, size_t n, const float* x, float* y, cudaStream_t s) {
  if (n == 0) return CudaStatus::Ok();
  ActivateKernel<<<Blocks(n), kThreads, 0, s>>>(static_cast<int>(a), n, x, y);
  return Launched("ActivateKernel");
}
CudaStatus ActivateGrad(Act a, size_t n, const float* x, const float* dy, float* dx, cudaStream_t s) {
  if (n == 0) return CudaStatus::Ok();
  ActivateGradKernel<<<Blocks(n), kThreads, 0, s>>>(static_cast<int>(a), n, x, dy, dx);
  return Launched("ActivateGradKernel");
}
CudaStatus Axpy(size_t n, float alpha, const float* x, float* y, cudaStream_t s) {
  if (n == 0) return CudaStatus::Ok();
  AxpyKernel<<<Blocks(n), kThreads, 0, s>>>(n, alpha, x, y);
  return Launched("AxpyKernel");
}
__global__ void OptimizerUpdateKernel(UpdateParams p, size_t n, float* w, const float* g, float* m, float* v) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{blockDim.x} * gridDim.x) {
    if (p.kind == 0) {
      w[i] -= p.lr * (g[i] + p.weight_decay * w[i]);
    } else if (p.kind == 1) {
      const float gi = g[i] + p.weight_decay * w[i];
      m[i] = p.momentum * m[i] + gi;
      w[i] -= p.nesterov ? p.lr * (gi + p.momentum * m[i]) : p.lr * m[i];
    } else {
      const float gi = g[i] + p.l2 * w[i];
      m[i] = p.beta1 * m[i] + (1.0f - p.beta1) * gi;
      v[i] = p.beta2 * v[i] + (1.0f - p.beta2) * gi * gi;
      const float denom = sqrtf(v[i]) * p.inv_bc2_sqrt + p.epsilon;
      w[i] = w[i] * p.decay - p.step_size * m[i] / denom;
    }
  }
}

CudaStatus OptimizerUpdate(const UpdateParams& p, size_t n, float* w, const float* g, float* m, float* v,
                           cudaStream_t s) {
  if (n == 0) return CudaStatus::Ok();
  OptimizerUpdateKernel<<<Blocks(n), kThreads, 0, s>>>(p, n, w, g, m, v);
  return Launched("OptimizerUpdateKernel");
}

CudaStatus Scale(size_t n, float alpha, float* x, cudaStream_t s) {
  if (n == 0) return CudaStatus::Ok();
  ScaleKernel<<<Blocks(n), kThreads, 0, s>>>(n, alpha, x);
  return Launched("ScaleKernel");
}
CudaStatus RowDot(int M, int K, const float* a, int lda, const float* b, int ldb, float* out, cudaStream_t s) {
  if (M <= 0) return CudaStatus::Ok();
  RowDotKernel<<<WarpBlocks(M), kThreads, 0, s>>>(M, K, a, lda, b, ldb, out);
  return Launched("RowDotKernel");
}
CudaStatus ScaleRows(int M, int K, const float* scale, const float* x, int ldx, float* y, int ldy, cudaStream_t s) {
  if (M <= 0 || K <= 0) return CudaStatus::Ok();
  ScaleRowsKernel<<<Blocks(size_t{1} * M * K), kThreads, 0, s>>>(M, K, scale, x, ldx, y, ldy);
  return Launched("ScaleRowsKernel");
}
CudaStatus SumSquares(size_t n, const float* x, double* out, cudaStream_t s) {
  if (n == 0) return CudaStatus::Ok();
  SumSquaresKernel<<<std::min(Blocks(n), 1024u), kThreads, 0, s>>>(n, x, out);
  return Launched("SumSquaresKernel");
}
CudaStatus NonFinite(size_t n, const float* x, int* flag, cudaStream_t s) {
  if (n == 0) return CudaStatus::Ok();
  NonFiniteKernel<<<Blocks(n), kThreads, 0, s>>>(n, x, flag);
  return Launched("NonFiniteKernel");
}
CudaStatus SoftmaxCrossEntropy(int M, int N, const float* logits, const int32_t* labels, float scale, float* loss,
                               int32_t* pred, float* dlogits, cudaStream_t s) {
  if (M <= 0) return CudaStatus::Ok();
  SoftmaxXentKernel<<<WarpBlocks(M), kThreads, 0, s>>>(M, N, logits, labels, scale, loss, pred, dlogits);
  return Launched("SoftmaxXentKernel");
}
CudaStatus SigmoidCrossEntropy(int M, const float* logits, const float* labels, float scale, float* loss,
                               float* prob, float* dlogits, cudaStream_t s) {
  if (M <= 0) return CudaStatus::Ok();
  SigmoidXentKernel<<<Blocks(M), kThreads, 0, s>>>(M, logits, labels, scale, loss, prob, dlogits);
  return Launched("SigmoidXentKernel");
}
CudaStatus SquaredError(int M, const float* pred, const float* target, float scale, float* loss, float* dpred,
                        cudaStream_t s) {
  if (M <= 0) return CudaStatus::Ok();
  SquaredErrorKernel<<<Blocks(M), kThreads, 0, s>>>(M, pred, target, scale, loss, dpred);
  return Launched("SquaredErrorKernel");
}
CudaStatus Gather(int n, int dim, const float* rows, const int32_t* idx, float* out, cudaStream_t s) {
  if (n <= 0 || dim <= 0) return CudaStatus::Ok();
  GatherKernel<<<Blocks(size_t{1} * n * dim), kThreads, 0, s>>>(n, dim, rows, idx, out);
  return Launched("GatherKernel");
}
CudaStatus GatherScaleU8(int n, int cols, const uint8_t* table, const int32_t* idx, float scale, float* out,
                         cudaStream_t s) {
  if (n <= 0 || cols <= 0) return CudaStatus::Ok();
  GatherScaleU8Kernel<<<Blocks(size_t{1} * n * cols), kThreads, 0, s>>>(n, cols, table, idx, scale, out);
  return Launched("GatherScaleU8Kernel");
}
CudaStatus ScatterAdd(int n, int dim, const float* src, const int32_t* idx, float* rows, cudaStream_t s) {
  if (n <= 0 || dim <= 0) return CudaStatus::Ok();
  ScatterAddKernel<<<Blocks(size_t{1} * n * dim), kThreads, 0, s>>>(n, dim, src, idx, rows);
  return Launched("ScatterAddKernel");
}
CudaStatus EmbeddingBag(int B, int dim, const float* rows, const int32_t* offsets, const int32_t* idx,
                        const float* vals, bool square, float* out, cudaStream_t s) {
  if (B <= 0 || dim <= 0) return CudaStatus::Ok();
  EmbeddingBagKernel<<<Blocks(size_t{1} * B * dim), kThreads, 0, s>>>(B, dim, rows, offsets, idx, vals, square, out);
  return Launched("EmbeddingBagKernel");
}
CudaStatus EmbeddingBagGrad(int B, int dim, const float* dout, const int32_t* offsets, const int32_t* idx,
                            const float* vals, bool square, const float* rows, float* grad, cudaStream_t s) {
  if (B <= 0 || dim <= 0) return CudaStatus::Ok();
  EmbeddingBagGradKernel<<<Blocks(size_t{1} * B * dim), kThreads, 0, s>>>(B, dim, dout, offsets, idx, vals, square,
                                                                           rows, grad);
  return Launched("EmbeddingBagGradKernel");
}

}  // namespace fulcrum::cuda
