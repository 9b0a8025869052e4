// cuBLAS GEMMs in row-major terms, on a caller's stream. Builds from the CUDA
// toolkit alone.
#ifndef FULCRUM_CUDA_BLAS_H_
#define FULCRUM_CUDA_BLAS_H_

#include <cstdint>
#include <memory>

#include <cuda_runtime_api.h>

#include "cuda/cuda_status.h"

namespace fulcrum::cuda {

enum class GemmInput { kFp32, kBf16, kFp16 };

class Blas {
 public:
  // A cuBLAS handle bound to `stream`.
  static CudaStatus Create(cudaStream_t stream, std::unique_ptr<Blas>* out);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // C[M,N] = alpha op(A) op(B) + beta C, row-major; A is K x M when trans_a,
  // B is N x K when trans_b. fp32 inputs use cublasSgemm; bf16/fp16 inputs
  // use cublasGemmEx with fp32 accumulation and an fp32 C.
  CudaStatus Gemm(GemmInput input, bool trans_a, bool trans_b, int M, int N, int K, float alpha, const void* A,
                  const void* B, float beta, float* C);

 private:
  explicit Blas(void* handle) : handle_(handle) {}
  void* handle_;  // cublasHandle_t
};

}  // namespace fulcrum::cuda

#endif  // FULCRUM_CUDA_BLAS_H_
