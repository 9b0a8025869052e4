#include "cuda/graph_kernels.h"

#include "cuda/launch.cuh"

#include <algorithm>
#include <string>

namespace fulcrum::cuda {
namespace {

using launch::Blocks;
using launch::kThreads;
using launch::Launched;
using launch::WarpBlocks;
using launch::WarpSum;

#define GRID_STRIDE FULCRUM_GRID_STRIDE

// The index of pair (i, j), i < j, in the order (0,1), (0,2), ..., (1,2), ...
__device__ __forceinline__ size_t PairIndex(int n, int i, int j) {
  return size_t{1} * i * n - size_t{1} * i * (i + 1) / 2 + (j - i - 1);
}

// One thread per (example, pair).
__global__ void DotInteractionKernel(int B, int n, int d, const float* x, float* out) {
  const size_t P = size_t{1} * n * (n - 1) / 2;
  GRID_STRIDE(t, B * P) {
    const size_t b = t / P;
    size_t p = t % P;
    int i = 0;
    while (p >= static_cast<size_t>(n - 1 - i)) {
      p -= n - 1 - i;
      ++i;
    }
    const int j = i + 1 + static_cast<int>(p);
    const float* xi = x + (b * n + i) * d;
    const float* xj = x + (b * n + j) * d;
    float s = 0;
    for (int k = 0; k < d; ++k) s += xi[k] * xj[k];
    out[t] = s;
  }
}

// One thread per (example, vector, component).
__global__ void DotInteractionGradKernel(int B, int n, int d, const float* x, const float* dout, float* dx) {
  const size_t P = size_t{1} * n * (n - 1) / 2;
  GRID_STRIDE(t, size_t{1} * B * n * d) {
    const size_t b = t / (size_t{1} * n * d);
    const int i = static_cast<int>((t / d) % n), k = static_cast<int>(t % d);
    const float* xb = x + b * n * d;
    const float* o = dout + b * P;
    float g = 0;
    for (int j = 0; j < n; ++j) {
      if (j == i) continue;
      g += o[j > i ? PairIndex(n, i, j) : PairIndex(n, j, i)] * xb[size_t{1} * j * d + k];
    }
    dx[t] = g;
  }
}

// One warp per example.
__global__ void FmInteractionKernel(int B, int n, int d, const float* x, float* out) {
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (warp >= B) return;
  const float* xb = x + size_t{1} * warp * n * d;
  float total = 0;
  for (int k = lane; k < d; k += 32) {
    float s = 0, q = 0;
    for (int i = 0; i < n; ++i) {
      const float v = xb[size_t{1} * i * d + k];
      s += v;
      q += v * v;
    }
    total += s * s - q;
  }
  total = WarpSum(total);
  if (lane == 0) out[warp] = 0.5f * total;
}

// One thread per (example, component).
__global__ void FmInteractionGradKernel(int B, int n, int d, const float* x, const float* dout, float* dx) {
  GRID_STRIDE(t, size_t{1} * B * d) {
    const size_t b = t / d;
    const int k = static_cast<int>(t % d);
    const float* xb = x + b * n * d;
    float s = 0;
    for (int i = 0; i < n; ++i) s += xb[size_t{1} * i * d + k];
    for (int i = 0; i < n; ++i) dx[b * n * d + size_t{1} * i * d + k] = dout[b] * (s - xb[size_t{1} * i * d + k]);
  }
}

// One warp per row.
__global__ void LayerNormKernel(int M, int N, const float* x, const float* gamma, const float* beta, float eps,
                                float* y, float* mean, float* rstd) {
  const int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (row >= M) return;
  const float* r = x + size_t{1} * row * N;
  float s = 0;
  for (int j = lane; j < N; j += 32) s += r[j];
  const float mu = WarpSum(s) / N;
  float q = 0;
  for (int j = lane; j < N; j += 32) q += (r[j] - mu) * (r[j] - mu);
  const float rs = rsqrtf(WarpSum(q) / N + eps);
  float* o = y + size_t{1} * row * N;
  for (int j = lane; j < N; j += 32) o[j] = (r[j] - mu) * rs * gamma[j] + beta[j];
  if (lane == 0) {
    mean[row] = mu;
    rstd[row] = rs;
  }
}

__global__ void LayerNormInputGradKernel(int M, int N, const float* x, const float* gamma, const float* mean,
                                         const float* rstd, const float* dy, float* dx) {
  const int row = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
  if (row >= M) return;
  const float* r = x + size_t{1} * row * N;
  const float* g = dy + size_t{1} * row * N;
  const float mu = mean[row], rs = rstd[row];
  float a = 0, c = 0;
  for (int j = lane; j < N; j += 32) {
    const float dh = g[j] * gamma[j];
    a += dh;
    c += dh * (r[j] - mu) * rs;
  }
  const float ma = WarpSum(a) / N, mc = WarpSum(c) / N;
  float* o = dx + size_t{1} * row * N;
  for (int j = lane; j < N; j += 32) o[j] = rs * (g[j] * gamma[j] - ma - (r[j] - mu) * rs * mc);
}

// One thread per column.
__global__ void LayerNormParamGradKernel(int M, int N, const float* x, const float* mean, const float* rstd,
                                         const float* dy, float* dgamma, float* dbeta) {
  GRID_STRIDE(j, static_cast<size_t>(N)) {
    float sg = 0, sb = 0;
    for (int i = 0; i < M; ++i) {
      const size_t at = size_t{1} * i * N + j;
      sg += dy[at] * (x[at] - mean[i]) * rstd[i];
      sb += dy[at];
    }
    dgamma[j] = sg;
    dbeta[j] = sb;
  }
}

}  // namespace

CudaStatus DotInteraction(int B, int n, int d, const float* x, float* out, cudaStream_t s) {
  if (B <= 0 || n < 2) return CudaStatus::Ok();
  DotInteractionKernel<<<Blocks(size_t{1} * B * n * (n - 1) / 2), kThreads, 0, s>>>(B, n, d, x, out);
  return Launched("DotInteractionKernel");
}
CudaStatus DotInteractionGrad(int B, int n, int d, const float* x, const float* dout, float* dx, cudaStream_t s) {
  if (B <= 0 || n <= 0 || d <= 0) return CudaStatus::Ok();
  DotInteractionGradKernel<<<Blocks(size_t{1} * B * n * d), kThreads, 0, s>>>(B, n, d, x, dout, dx);
  return Launched("DotInteractionGradKernel");
}
CudaStatus FmInteraction(int B, int n, int d, const float* x, float* out, cudaStream_t s) {
  if (B <= 0) return CudaStatus::Ok();
  FmInteractionKernel<<<WarpBlocks(B), kThreads, 0, s>>>(B, n, d, x, out);
  return Launched("FmInteractionKernel");
}
CudaStatus FmInteractionGrad(int B, int n, int d, const float* x, const float* dout, float* dx, cudaStream_t s) {
  if (B <= 0 || d <= 0) return CudaStatus::Ok();
  FmInteractionGradKernel<<<Blocks(size_t{1} * B * d), kThreads, 0, s>>>(B, n, d, x, dout, dx);
  return Launched("FmInteractionGradKernel");
}
CudaStatus LayerNorm(int M, int N, const float* x, const float* gamma, const float* beta, float eps, float* y,
                     float* mean, float* rstd, cudaStream_t s) {
  if (M <= 0 || N <= 0) return CudaStatus::Ok();
  LayerNormKernel<<<WarpBlocks(M), kThreads, 0, s>>>(M, N, x, gamma, beta, eps, y, mean, rstd);
  return Launched("LayerNormKernel");
}
CudaStatus LayerNormGrad(int M, int N, const float* x, const float* gamma, const float* mean, const float* rstd,
                         const float* dy, float* dx, float* dgamma, float* dbeta, cudaStream_t s) {
  if (M <= 0 || N <= 0) return CudaStatus::Ok();
  LayerNormInputGradKernel<<<WarpBlocks(M), kThreads, 0, s>>>(M, N, x, gamma, mean, rstd, dy, dx);
  if (CudaStatus st = Launched("LayerNormInputGradKernel"); !st.ok) return st;
  LayerNormParamGradKernel<<<Blocks(N), kThreads, 0, s>>>(M, N, x, mean, rstd, dy, dgamma, dbeta);
  return Launched("LayerNormParamGradKernel");
}

}  // namespace fulcrum::cuda
