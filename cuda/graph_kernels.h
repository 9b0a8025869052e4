// Kernels for the model-graph ops (worker/compute/backend.h, "model-graph
// ops"): DLRM's dot interaction, the factorization machine's pairwise term
// and layer normalization, forward and backward. Row-major fp32 device
// arrays, queued on the caller's stream; the CPU backend defines the
// results and gpu_test compares the two.
#ifndef FULCRUM_CUDA_GRAPH_KERNELS_H_
#define FULCRUM_CUDA_GRAPH_KERNELS_H_

#include <cuda_runtime_api.h>

#include "cuda/cuda_status.h"

namespace fulcrum::cuda {

CudaStatus DotInteraction(int B, int n, int d, const float* x, float* out, cudaStream_t s);
CudaStatus DotInteractionGrad(int B, int n, int d, const float* x, const float* dout, float* dx, cudaStream_t s);
CudaStatus FmInteraction(int B, int n, int d, const float* x, float* out, cudaStream_t s);
CudaStatus FmInteractionGrad(int B, int n, int d, const float* x, const float* dout, float* dx, cudaStream_t s);
CudaStatus LayerNorm(int M, int N, const float* x, const float* gamma, const float* beta, float eps, float* y,
                     float* mean, float* rstd, cudaStream_t s);
CudaStatus LayerNormGrad(int M, int N, const float* x, const float* gamma, const float* mean, const float* rstd,
                         const float* dy, float* dx, float* dgamma, float* dbeta, cudaStream_t s);

}  // namespace fulcrum::cuda

#endif  // FULCRUM_CUDA_GRAPH_KERNELS_H_
