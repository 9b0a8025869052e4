// The CUDA backend (built only when nvcc is found at configure time).
#ifndef FULCRUM_WORKER_COMPUTE_CUDA_BACKEND_H_
#define FULCRUM_WORKER_COMPUTE_CUDA_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/compute/backend.h"

namespace fulcrum::compute {

// ordinal -1: the first usable GPU. Fails (FAILED_PRECONDITION, saying why)
// when there is none: no driver, no device, or the ordinal is out of range.
absl::StatusOr<std::unique_ptr<Backend>> NewCudaBackend(int ordinal);

}  // namespace fulcrum::compute

#endif  // FULCRUM_WORKER_COMPUTE_CUDA_BACKEND_H_
