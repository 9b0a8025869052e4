#include "cuda/device.h"

#include <cuda_runtime_api.h>

namespace fulcrum::cuda {

std::vector<DeviceInfo> ListDevices(std::string* why_none) {
  std::vector<DeviceInfo> out;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    // cudaErrorInsufficientDriver / cudaErrorNoDevice on machines without a GPU.
    if (why_none) *why_none = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
    cudaGetLastError();  // clear the sticky error
    return out;
  }
  if (count == 0) {
    if (why_none) *why_none = "cudaGetDeviceCount: no CUDA devices";
    return out;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    out.push_back({i, prop.name, prop.major, prop.minor, prop.totalGlobalMem});
  }
  return out;
}

}  // namespace fulcrum::cuda
