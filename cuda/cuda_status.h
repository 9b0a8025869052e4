// Status for the CUDA library. cuda/ builds from the CUDA toolkit alone (it
// must build on GPU machines that lack our Debian libraries), so it carries
// its own small status type; callers convert at the boundary.
#ifndef FULCRUM_CUDA_CUDA_STATUS_H_
#define FULCRUM_CUDA_CUDA_STATUS_H_

#include <string>

namespace fulcrum::cuda {

struct CudaStatus {
  bool ok = true;
  std::string message;  // names the failing call, e.g. "cudaMalloc(4096 bytes): out of memory"
  static CudaStatus Ok() { return {}; }
  static CudaStatus Error(std::string m) { return {false, std::move(m)}; }
};

}  // namespace fulcrum::cuda

// Turns a cudaError_t into a CudaStatus naming the call at the call site.
#define FULCRUM_CUDA_RETURN_IF_ERROR(call)                                            \
  do {                                                                               \
    const cudaError_t fulcrum_err_ = (call);                                          \
    if (fulcrum_err_ != cudaSuccess) {                                                \
      return ::fulcrum::cuda::CudaStatus::Error(std::string(#call) + ": " +           \
                                                cudaGetErrorString(fulcrum_err_));    \
    }                                                                                \
  } while (0)

#endif  // FULCRUM_CUDA_CUDA_STATUS_H_
