#include "cuda/casts.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

namespace fulcrum::cuda {
namespace {

// Plain grid-stride kernels; the hardware intrinsics round to nearest even,
// matching common/dtype.cc bit for bit on finite values.
__global__ void Fp32ToBf16Kernel(const float* in, uint16_t* out, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
  }
}
__global__ void Bf16ToFp32Kernel(const uint16_t* in, float* out, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    out[i] = __bfloat162float(__ushort_as_bfloat16(in[i]));
  }
}
__global__ void Fp32ToFp16Kernel(const float* in, uint16_t* out, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    out[i] = __half_as_ushort(__float2half_rn(in[i]));
  }
}
__global__ void Fp16ToFp32Kernel(const uint16_t* in, float* out, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    out[i] = __half2float(__ushort_as_half(in[i]));
  }
}

constexpr int kThreads = 256;
unsigned Blocks(size_t n) {
  return static_cast<unsigned>(std::min<size_t>((n + kThreads - 1) / kThreads, 65535));
}

template <typename In, typename Out>
CudaStatus Launch(void (*kernel)(const In*, Out*, size_t), const In* in, Out* out, size_t n,
                  cudaStream_t stream, const char* name) {
  if (n == 0) return CudaStatus::Ok();
  kernel<<<Blocks(n), kThreads, 0, stream>>>(in, out, n);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return CudaStatus::Error(std::string(name) + " launch: " + cudaGetErrorString(err));
  }
  return CudaStatus::Ok();
}

}  // namespace

CudaStatus CastFp32ToBf16(const float* in, uint16_t* out, size_t n, cudaStream_t stream) {
  return Launch(Fp32ToBf16Kernel, in, out, n, stream, "Fp32ToBf16Kernel");
}
CudaStatus CastBf16ToFp32(const uint16_t* in, float* out, size_t n, cudaStream_t stream) {
  return Launch(Bf16ToFp32Kernel, in, out, n, stream, "Bf16ToFp32Kernel");
}
CudaStatus CastFp32ToFp16(const float* in, uint16_t* out, size_t n, cudaStream_t stream) {
  return Launch(Fp32ToFp16Kernel, in, out, n, stream, "Fp32ToFp16Kernel");
}
CudaStatus CastFp16ToFp32(const uint16_t* in, float* out, size_t n, cudaStream_t stream) {
  return Launch(Fp16ToFp32Kernel, in, out, n, stream, "Fp16ToFp32Kernel");
}

}  // namespace fulcrum::cuda
