// Launch helpers shared by the .cu files of cuda/: grid sizes, the launch
// check, a grid-stride loop and a warp's sum. Internal to cuda/.
#ifndef FULCRUM_CUDA_LAUNCH_CUH_
#define FULCRUM_CUDA_LAUNCH_CUH_

#include <algorithm>
#include <cstddef>
#include <string>

#include <cuda_runtime_api.h>

#include "cuda/cuda_status.h"

namespace fulcrum::cuda::launch {

constexpr int kThreads = 256;

// Blocks of kThreads for n elements (grid-stride loops cover the rest).
inline unsigned Blocks(size_t n) {
  return static_cast<unsigned>(std::max<size_t>(1, std::min<size_t>((n + kThreads - 1) / kThreads, 65535)));
}
// Blocks for one warp per row.
inline unsigned WarpBlocks(int rows) { return static_cast<unsigned>(std::max(1, (rows * 32 + kThreads - 1) / kThreads)); }

inline CudaStatus Launched(const char* name) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return CudaStatus::Error(std::string(name) + " launch: " + cudaGetErrorString(err));
  return CudaStatus::Ok();
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace fulcrum::cuda::launch

#define FULCRUM_GRID_STRIDE(i, n) \
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < (n); i += size_t{gridDim.x} * blockDim.x)

#endif  // FULCRUM_CUDA_LAUNCH_CUH_
