// cuBLAS GEMMs in row-major terms, on a caller's stream. Builds from the CUDA
// toolkit alone.
#ifndef FULCRUM_CUDA_BLAS_H_
#define FULCRUM_CUDA_BLAS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <tuple>

#include <cuda_runtime_api.h>

#include "cuda/cuda_status.h"

namespace fulcrum::cuda {

enum class GemmInput { kFp32, kBf16, kFp16 };

// What cuBLASLt does after a GEMM, in row-major terms (D = op(A) op(B) is
// M x N; "per column" means one value per column j < N):
//   kBias          D += bias (per column)
//   kReluAuxBias   D = relu(D + bias); aux <- the ReLU's bit mask
//   kGeluAuxBias   D = gelu(D + bias); aux <- D + bias (GELU's input)
//   kDRelu, kDGelu D = D * act'(aux's pre-activation), aux from the forward;
//                  with bias_grad: also bias_grad = column sums of D
//   kBgradB        bias_grad = column sums of B (B not transposed: B is the
//                  K x N gradient whose sums are the bias gradient)
// Bias and bias gradients have D's type, aux D's type for GELU.
enum class Epilogue { kNone, kBias, kReluAuxBias, kGeluAuxBias, kDRelu, kDGelu, kBgradB };

struct EpilogueArgs {
  Epilogue kind = Epilogue::kNone;
  const void* bias = nullptr;
  void* bias_grad = nullptr;
  void* aux = nullptr;  // M rows of AuxLd(kind, N) elements (bits for ReLU)
};

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

  // D = op(A) op(B) with an epilogue, through cuBLASLt (fp32 accumulation;
  // `output` is D's type). NOT_SUPPORTED-style failures (no algorithm for
  // the shape) come back as errors: callers fall back to unfused kernels.
  CudaStatus GemmEpilogue(GemmInput input, GemmInput output, bool trans_a, bool trans_b, int M, int N, int K,
                          const void* A, const void* B, void* D, const EpilogueArgs& e);
  // The aux buffer's row length for an M x N output: N rounded up to 128
  // (bits) for ReLU's mask, to 8 (elements) for GELU's input.
  static int64_t AuxLd(Epilogue kind, int N);
  // Bytes of that aux buffer for `rows` rows of D's `output` type.
  static size_t AuxBytes(Epilogue kind, GemmInput output, int rows, int N);

 private:
  struct Plan;
  using PlanKey = std::tuple<int, int, bool, bool, int, int, int, int>;
  Blas(void* handle, void* lt, void* workspace, size_t workspace_bytes, cudaStream_t stream);
  void* handle_;     // cublasHandle_t
  void* lt_;         // cublasLtHandle_t
  void* workspace_;  // device memory for cuBLASLt
  size_t workspace_bytes_;
  cudaStream_t stream_;
  // Descriptors and the chosen algorithm per shape and epilogue: the
  // heuristic query costs more than a small GEMM.
  std::map<PlanKey, std::unique_ptr<Plan>> plans_;
};

}  // namespace fulcrum::cuda

#endif  // FULCRUM_CUDA_BLAS_H_
