// GPU discovery. Having no GPU (or no driver) is a normal condition.
#ifndef FULCRUM_CUDA_DEVICE_H_
#define FULCRUM_CUDA_DEVICE_H_

#include <string>
#include <vector>

#include "cuda/cuda_status.h"

namespace fulcrum::cuda {

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  int compute_major = 0, compute_minor = 0;
  size_t memory_bytes = 0;
};

// Lists usable GPUs. Returns an empty list and sets *why_none when there
// are none (no driver, no device, insufficient driver), never fails hard.
std::vector<DeviceInfo> ListDevices(std::string* why_none);

}  // namespace fulcrum::cuda

#endif  // FULCRUM_CUDA_DEVICE_H_
