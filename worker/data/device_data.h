// A dataset kept on the compute device in its stored form.
//
// A GPU computes an MLP step in about a millisecond; decoding a batch on the
// host and copying it over takes longer. When a dataset's features are bytes
// (IDX pixels: StoredBytes) and fit in a share of the device's memory, the
// worker uploads them once, as bytes, and each batch is built on the
// device: the pipeline stages only the batch's row numbers (4 bytes an
// example, from the same ShardOrder, so one seed still gives the same
// batches) and the labels; the model gathers and decodes the rows with one
// kernel (Backend::GatherScaleU8), bit-identical to the host decoder.
//
// Data that does not fit, or is not bytes, takes the host path (decoded by
// the pipeline's threads, staged in page-locked memory). On the CPU backend
// the "device" is host memory and the gather one pass where the host path
// makes three (decode, stage, copy): 2.6x the softmax's samples/s and the
// same for the MLP in fulcrum-compute-bench (docs/benchmarks.md), so it is
// used there too.
#ifndef FULCRUM_WORKER_DATA_DEVICE_DATA_H_
#define FULCRUM_WORKER_DATA_DEVICE_DATA_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "worker/compute/backend.h"
#include "worker/data/dataset.h"

namespace fulcrum::data {

enum class DeviceDataMode {
  kAuto,  // when the data is bytes and fits the share
  kOn,    // the same (kept apart so a future default can differ)
  kOff,
};
absl::StatusOr<DeviceDataMode> DeviceDataModeFromName(const std::string& name);  // auto, on, off

class DeviceData {
 public:
  // The dataset on `backend`, or null with *why saying why not (not bytes,
  // does not fit, mode off). `share`: the part of the device's memory the
  // stored bytes may take. Errors: an allocation or copy failed.
  static absl::StatusOr<std::unique_ptr<DeviceData>> Upload(const Dataset& dataset, compute::Backend* backend,
                                                            DeviceDataMode mode, double share, std::string* why);

  // Decodes the batch's rows into out (batch.size x cols floats, device
  // memory), queued on the backend's stream.
  absl::Status Gather(const Batch& batch, float* out) const;

  int cols() const { return cols_; }
  size_t bytes() const { return table_.bytes(); }

 private:
  DeviceData(compute::Backend* backend, compute::Buffer table, int cols, float scale)
      : backend_(backend), table_(std::move(table)), cols_(cols), scale_(scale) {}

  compute::Backend* backend_;
  compute::Buffer table_;
  mutable compute::Buffer rows_;  // the batch's row numbers on the device
  int cols_;
  float scale_;
};

}  // namespace fulcrum::data

#endif  // FULCRUM_WORKER_DATA_DEVICE_DATA_H_
