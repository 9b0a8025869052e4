#include "cuda/blas.h"

#include <cublasLt.h>
#include <cublas_v2.h>

#include <string>

namespace fulcrum::cuda {
namespace {

CudaStatus FromCublas(cublasStatus_t s, const char* call) {
  if (s == CUBLAS_STATUS_SUCCESS) return CudaStatus::Ok();
  return CudaStatus::Error(std::string(call) + ": " + cublasGetStatusName(s) + " (" + cublasGetStatusString(s) + ")");
}

}  // namespace

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

CudaStatus Blas::Create(cudaStream_t stream, std::unique_ptr<Blas>* out) {
  cublasHandle_t h = nullptr;
  if (auto s = FromCublas(cublasCreate(&h), "cublasCreate"); !s.ok) return s;
  if (auto s = FromCublas(cublasSetStream(h, stream), "cublasSetStream"); !s.ok) {
    cublasDestroy(h);
    return s;
  }
  cublasLtHandle_t lt = nullptr;
  if (auto s = FromCublas(cublasLtCreate(&lt), "cublasLtCreate"); !s.ok) {
    cublasDestroy(h);
    return s;
  }
  void* workspace = nullptr;
  if (cudaMalloc(&workspace, kWorkspaceBytes) != cudaSuccess) {
    cublasLtDestroy(lt);
    cublasDestroy(h);
    return CudaStatus::Error("cudaMalloc(cuBLASLt workspace) failed");
  }
  out->reset(new Blas(h, lt, workspace, kWorkspaceBytes, stream));
  return CudaStatus::Ok();
}

struct Blas::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

Blas::Blas(void* handle, void* lt, void* workspace, size_t workspace_bytes, cudaStream_t stream)
    : handle_(handle), lt_(lt), workspace_(workspace), workspace_bytes_(workspace_bytes), stream_(stream) {}

Blas::~Blas() {
  plans_.clear();
  cudaFree(workspace_);
  cublasLtDestroy(static_cast<cublasLtHandle_t>(lt_));
  cublasDestroy(static_cast<cublasHandle_t>(handle_));
}

namespace {

cudaDataType_t TypeOf(GemmInput t) {
  switch (t) {
    case GemmInput::kBf16: return CUDA_R_16BF;
    case GemmInput::kFp16: return CUDA_R_16F;
    case GemmInput::kFp32: break;
  }
  return CUDA_R_32F;
}

size_t SizeOf(GemmInput t) { return t == GemmInput::kFp32 ? 4 : 2; }

cublasLtEpilogue_t LtEpilogue(Epilogue e) {
  switch (e) {
    case Epilogue::kBias: return CUBLASLT_EPILOGUE_BIAS;
    case Epilogue::kReluAuxBias: return CUBLASLT_EPILOGUE_RELU_AUX_BIAS;
    case Epilogue::kGeluAuxBias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case Epilogue::kDRelu: return CUBLASLT_EPILOGUE_DRELU_BGRAD;
    case Epilogue::kDGelu: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    // Row-major B is the column-major call's A (the operands swap).
    case Epilogue::kBgradB: return CUBLASLT_EPILOGUE_BGRADA;
    case Epilogue::kNone: break;
  }
  return CUBLASLT_EPILOGUE_DEFAULT;
}

bool HasAux(Epilogue e) {
  return e == Epilogue::kReluAuxBias || e == Epilogue::kGeluAuxBias || e == Epilogue::kDRelu || e == Epilogue::kDGelu;
}

}  // namespace

int64_t Blas::AuxLd(Epilogue kind, int N) {
  const bool relu = kind == Epilogue::kReluAuxBias || kind == Epilogue::kDRelu;
  const int64_t round = relu ? 128 : 8;
  return (int64_t{N} + round - 1) / round * round;
}

size_t Blas::AuxBytes(Epilogue kind, GemmInput output, int rows, int N) {
  if (!HasAux(kind)) return 0;
  const bool relu = kind == Epilogue::kReluAuxBias || kind == Epilogue::kDRelu;
  const size_t ld = static_cast<size_t>(AuxLd(kind, N));
  return relu ? size_t(rows) * ld / 8 : size_t(rows) * ld * SizeOf(output);
}

CudaStatus Blas::GemmEpilogue(GemmInput input, GemmInput output, bool ta, bool tb, int M, int N, int K, const void* A,
                              const void* B, void* D, const EpilogueArgs& e) {
  if (M <= 0 || N <= 0) return CudaStatus::Ok();
  auto lt = static_cast<cublasLtHandle_t>(lt_);
  // Row-major D = op(A) op(B) is column-major D^T (N x M) = op(B)^T op(A)^T:
  // the column-major call's first operand is B.
  const PlanKey key{static_cast<int>(input), static_cast<int>(output), ta, tb, M, N, K, static_cast<int>(e.kind)};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    auto p = std::make_unique<Plan>();
    const cudaDataType_t in = TypeOf(input), out = TypeOf(output);
    if (auto s = FromCublas(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
        !s.ok) {
      return s;
    }
    const cublasOperation_t op_first = tb ? CUBLAS_OP_T : CUBLAS_OP_N, op_second = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first));
    cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second));
    const cublasLtEpilogue_t epi = LtEpilogue(e.kind);
    if (auto s = FromCublas(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)),
                            "cublasLtMatmulDescSetAttribute(EPILOGUE)");
        !s.ok) {
      return s;
    }
    if (HasAux(e.kind)) {
      const int64_t ld = AuxLd(e.kind, N);
      cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ld, sizeof(ld));
    }
    // Stored shapes, column-major: B is N x K (ld N) or, transposed, K x N
    // (ld K); A is K x M (ld K) or M x K (ld M); D is N x M (ld N).
    const uint64_t b_rows = tb ? K : N, b_cols = tb ? N : K, a_rows = ta ? M : K, a_cols = ta ? K : M;
    auto s = FromCublas(cublasLtMatrixLayoutCreate(&p->a, in, b_rows, b_cols, static_cast<int64_t>(b_rows)),
                        "cublasLtMatrixLayoutCreate(A)");
    if (s.ok) {
      s = FromCublas(cublasLtMatrixLayoutCreate(&p->b, in, a_rows, a_cols, static_cast<int64_t>(a_rows)),
                     "cublasLtMatrixLayoutCreate(B)");
    }
    if (s.ok) s = FromCublas(cublasLtMatrixLayoutCreate(&p->d, out, N, M, N), "cublasLtMatrixLayoutCreate(D)");
    if (!s.ok) return s;
    cublasLtMatmulPreference_t pref = nullptr;
    s = FromCublas(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate");
    if (!s.ok) return s;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_,
                                         sizeof(workspace_bytes_));
    // The heuristic checks pointer alignment: ask with the real pointers.
    if (e.bias != nullptr || e.bias_grad != nullptr) {
      const void* bias = e.bias != nullptr ? e.bias : e.bias_grad;
      cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
    }
    if (e.aux != nullptr) cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &e.aux, sizeof(e.aux));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    s = FromCublas(cublasLtMatmulAlgoGetHeuristic(lt, p->desc, p->a, p->b, p->d, p->d, pref, 1, &result, &found),
                   "cublasLtMatmulAlgoGetHeuristic");
    cublasLtMatmulPreferenceDestroy(pref);
    if (!s.ok) return s;
    if (found == 0) return CudaStatus::Error("cublasLtMatmulAlgoGetHeuristic: no algorithm for this GEMM and epilogue");
    p->algo = result.algo;
    it = plans_.emplace(key, std::move(p)).first;
  }
  Plan& p = *it->second;
  if (e.bias != nullptr || e.bias_grad != nullptr) {
    const void* bias = e.bias != nullptr ? e.bias : e.bias_grad;
    cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
  }
  if (HasAux(e.kind)) {
    cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &e.aux, sizeof(e.aux));
  }
  const float alpha = 1.0f, beta = 0.0f;
  return FromCublas(cublasLtMatmul(lt, p.desc, &alpha, B, p.a, A, p.b, &beta, D, p.d, D, p.d, &p.algo, workspace_,
                                   workspace_bytes_, stream_),
                    "cublasLtMatmul");
}

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
