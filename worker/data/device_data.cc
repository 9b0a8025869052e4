#include "worker/data/device_data.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace fulcrum::data {

absl::StatusOr<DeviceDataMode> DeviceDataModeFromName(const std::string& name) {
  if (name == "auto") return DeviceDataMode::kAuto;
  if (name == "on") return DeviceDataMode::kOn;
  if (name == "off") return DeviceDataMode::kOff;
  return absl::InvalidArgumentError(absl::StrCat("device data mode '", name, "': expected auto, on or off"));
}

absl::StatusOr<std::unique_ptr<DeviceData>> DeviceData::Upload(const Dataset& dataset, compute::Backend* backend,
                                                              DeviceDataMode mode, double share, std::string* why) {
  if (mode == DeviceDataMode::kOff) {
    *why = "off";
    return std::unique_ptr<DeviceData>();
  }
  const StoredBytes* stored = dataset.stored_bytes();
  if (stored == nullptr || dataset.sparse()) {
    *why = "its features are not stored as bytes";
    return std::unique_ptr<DeviceData>();
  }
  const size_t bytes = stored->rows * static_cast<size_t>(stored->cols);
  const double budget = share * static_cast<double>(backend->memory_bytes());
  if (static_cast<double>(bytes) > budget) {
    *why = absl::StrFormat("%.1f MiB does not fit in %.2f of the device's %.0f MiB", bytes / 1048576.0, share,
                           backend->memory_bytes() / 1048576.0);
    return std::unique_ptr<DeviceData>();
  }
  ASSIGN_OR_RETURN(compute::Buffer table, backend->Allocate(bytes));
  RETURN_IF_ERROR(backend->CopyToDevice(table.data(), stored->data, bytes));
  RETURN_IF_ERROR(backend->Synchronize());  // the source is the dataset's own memory
  *why = absl::StrFormat("%.1f MiB of bytes, %.2f%% of the device's memory", bytes / 1048576.0,
                         100.0 * bytes / std::max<size_t>(1, backend->memory_bytes()));
  return std::unique_ptr<DeviceData>(new DeviceData(backend, std::move(table), stored->cols, stored->scale));
}

absl::Status DeviceData::Gather(const Batch& batch, float* out) const {
  const size_t need = sizeof(int32_t) * static_cast<size_t>(batch.size);
  if (rows_.bytes() < need) {
    rows_.Reset();
    ASSIGN_OR_RETURN(rows_, backend_->Allocate(need));
  }
  RETURN_IF_ERROR(backend_->CopyToDevice(rows_.data(), batch.row_data(), need));
  return backend_->GatherScaleU8(batch.size, cols_, table_.as<uint8_t>(), rows_.as<int32_t>(), scale_, out);
}

}  // namespace fulcrum::data
