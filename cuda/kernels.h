// The worker's CUDA kernels (everything but GEMMs, which are cuBLAS's: see
// blas.h). Row-major fp32 device arrays; every call is queued on the
// caller's stream and returns at once. Semantics match the CPU backend's
// (worker/compute/backend.h) call for call, which the GPU tests check.
// Builds from the CUDA toolkit alone.
#ifndef FULCRUM_CUDA_KERNELS_H_
#define FULCRUM_CUDA_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "cuda/cuda_status.h"

namespace fulcrum::cuda {

enum class Act : int { kNone = 0, kRelu = 1, kGelu = 2, kSigmoid = 3, kTanh = 4 };

CudaStatus BiasAdd(int M, int N, const float* bias, float* y, cudaStream_t s);
CudaStatus ColumnSum(int M, int N, const float* x, float* out, cudaStream_t s);
CudaStatus Activate(Act a, size_t n, const float* x, float* y, cudaStream_t s);
CudaStatus ActivateGrad(Act a, size_t n, const float* x, const float* dy, float* dx, cudaStream_t s);
CudaStatus Axpy(size_t n, float alpha, const float* x, float* y, cudaStream_t s);
CudaStatus Scale(size_t n, float alpha, float* x, cudaStream_t s);
CudaStatus RowDot(int M, int K, const float* a, int lda, const float* b, int ldb, float* out, cudaStream_t s);
CudaStatus ScaleRows(int M, int K, const float* scale, const float* x, int ldx, float* y, int ldy,
                     cudaStream_t s);
// *out (device) += sum of squares; *flag (device int) set to 1 on any Inf/NaN.
CudaStatus SumSquares(size_t n, const float* x, double* out, cudaStream_t s);
CudaStatus NonFinite(size_t n, const float* x, int* flag, cudaStream_t s);

CudaStatus SoftmaxCrossEntropy(int M, int N, const float* logits, const int32_t* labels, float scale,
                               float* loss, int32_t* pred, float* dlogits, cudaStream_t s);
CudaStatus SigmoidCrossEntropy(int M, const float* logits, const float* labels, float scale, float* loss,
                               float* prob, float* dlogits, cudaStream_t s);
CudaStatus SquaredError(int M, const float* pred, const float* target, float scale, float* loss,
                        float* dpred, cudaStream_t s);

// One optimizer update per element (local steps' inner optimizer): kind 0
// SGD, 1 momentum (nesterov), 2 Adam, 3 AdamW; the server's formulas
// (server/optimizer.cc). Adam's bias corrections come precomputed.
struct UpdateParams {
  int kind = 0;
  float lr = 0, momentum = 0, weight_decay = 0, beta1 = 0.9f, beta2 = 0.999f, epsilon = 1e-8f;
  float step_size = 0, inv_bc2_sqrt = 1, decay = 1, l2 = 0;
  bool nesterov = false;
};
CudaStatus OptimizerUpdate(const UpdateParams& p, size_t n, float* w, const float* g, float* m, float* v,
                           cudaStream_t s);

CudaStatus Gather(int n, int dim, const float* rows, const int32_t* idx, float* out, cudaStream_t s);
// out[i, k] = scale * table[idx[i], k], table rows of `cols` bytes: a
// dataset's stored pixels gathered and decoded into a batch on the device.
CudaStatus GatherScaleU8(int n, int cols, const uint8_t* table, const int32_t* idx, float scale, float* out,
                         cudaStream_t s);
CudaStatus ScatterAdd(int n, int dim, const float* src, const int32_t* idx, float* rows, cudaStream_t s);
CudaStatus EmbeddingBag(int B, int dim, const float* rows, const int32_t* offsets, const int32_t* idx,
                        const float* vals, bool square, float* out, cudaStream_t s);
CudaStatus EmbeddingBagGrad(int B, int dim, const float* dout, const int32_t* offsets, const int32_t* idx,
                            const float* vals, bool square, const float* rows, float* grad, cudaStream_t s);

}  // namespace fulcrum::cuda

#endif  // FULCRUM_CUDA_KERNELS_H_
