#include "cuda/blas.h"

#include <cublas_v2.h>

#include <string>

namespace fulcrum::cuda {
namespace {

CudaStatus FromCublas(cublasStatus_t s, const char* call) {
  if (s == CUBLAS_STATUS_SUCCESS) return CudaStatus::Ok();
  return CudaStatus::Error(std::string(call) + ": " + cublasGetStatusName(s) + " (" + cublasGetStatusString(s) + ")");
}

}  // namespace

CudaStatus Blas::Create(cudaStream_t stream, std::unique_ptr<Blas>* out) {
  cublasHandle_t h = nullptr;
  if (auto s = FromCublas(cublasCreate(&h), "cublasCreate"); !s.ok) return s;
  if (auto s = FromCublas(cublasSetStream(h, stream), "cublasSetStream"); !s.ok) {
    cublasDestroy(h);
    return s;
  }
  out->reset(new Blas(h));
  return CudaStatus::Ok();
}

Blas::~Blas() { cublasDestroy(static_cast<cublasHandle_t>(handle_)); }

CudaStatus Blas::Gemm(GemmInput input, bool ta, bool tb, int M, int N, int K, float alpha, const void* A,
                      const void* B, float beta, float* C) {
  if (M <= 0 || N <= 0) return CudaStatus::Ok();
  auto h = static_cast<cublasHandle_t>(handle_);
  // Row-major C = op(A) op(B) is column-major C^T = op(B)^T op(A)^T: swap the
  // operands and keep each one's transpose flag.
  const cublasOperation_t op_a = ta ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int lda = ta ? M : K, ldb = tb ? K : N;
  if (input == GemmInput::kFp32) {
    return FromCublas(cublasSgemm(h, op_b, op_a, N, M, K, &alpha, static_cast<const float*>(B), ldb,
                                  static_cast<const float*>(A), lda, &beta, C, N),
                      "cublasSgemm");
  }
  const cudaDataType_t type = input == GemmInput::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
  return FromCublas(cublasGemmEx(h, op_b, op_a, N, M, K, &alpha, B, type, ldb, A, type, lda, &beta, C, CUDA_R_32F, N,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                    "cublasGemmEx");
}

}  // namespace fulcrum::cuda
