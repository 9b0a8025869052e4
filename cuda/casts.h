// fp32 <-> bf16/fp16 conversion kernels (round to nearest even), the GPU
// side of common/dtype.h's wire conversions. Launch on the caller's stream;
// pointers are device memory.
#ifndef FULCRUM_CUDA_CASTS_H_
#define FULCRUM_CUDA_CASTS_H_

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "cuda/cuda_status.h"

namespace fulcrum::cuda {

CudaStatus CastFp32ToBf16(const float* in, uint16_t* out, size_t n, cudaStream_t stream);
CudaStatus CastBf16ToFp32(const uint16_t* in, float* out, size_t n, cudaStream_t stream);
CudaStatus CastFp32ToFp16(const float* in, uint16_t* out, size_t n, cudaStream_t stream);
CudaStatus CastFp16ToFp32(const uint16_t* in, float* out, size_t n, cudaStream_t stream);

}  // namespace fulcrum::cuda

#endif  // FULCRUM_CUDA_CASTS_H_
