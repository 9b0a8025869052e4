// A checkpoint cut's parameters as safetensors (common/safetensors.h),
// from the records the coordinator streams (ExportCheckpoint). Dense tables
// are F32 tensors of their shape, named as the table; a sparse table is
// `<table>.keys` (I64: the uint64 keys' bits, ascending) and
// `<table>.values` (F32, keys x dim). Optimizer slots are not exported.
#ifndef FULCRUM_COMMON_CHECKPOINT_EXPORT_H_
#define FULCRUM_COMMON_CHECKPOINT_EXPORT_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "common/checkpoint_record.h"
#include "fulcrum/v1/cluster.pb.h"

namespace fulcrum {

class CutExport {
 public:
  // The cut's description (its tables and record format), first.
  // DATA_LOSS when the format is one this build cannot read.
  absl::Status Begin(const v1::ShardCutMeta& meta);
  // Each record, in any order. DATA_LOSS naming the record or table when
  // one is malformed or names a table the cut lacks.
  absl::Status Add(const v1::CheckpointRecord& record);
  // Writes the file (common/safetensors.h's Write). DATA_LOSS naming the
  // table and chunk when a dense table's chunk never arrived.
  absl::Status Write(const std::string& path, const std::map<std::string, std::string>& metadata);

  size_t tensors() const { return tensors_; }
  uint64_t bytes() const { return bytes_; }

 private:
  struct Table {
    v1::TableSpec spec;
    std::vector<float> dense;
    std::vector<bool> chunks_seen;
    std::vector<std::pair<uint64_t, std::vector<float>>> rows;
  };
  absl::Status AddDense(const std::string& table, uint32_t chunk, uint32_t length, const void* block);
  absl::Status AddSparse(const std::string& table, uint32_t dim, uint32_t slots, size_t n, const uint64_t* keys,
                         const float* rows);

  std::vector<Table> tables_;
  std::map<std::string, size_t> index_;
  CheckpointVisitor visit_;
  std::optional<RecordDecoder> decoder_;
  size_t tensors_ = 0;
  uint64_t bytes_ = 0;
};

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_CHECKPOINT_EXPORT_H_
