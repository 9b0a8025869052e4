#include "common/checkpoint_export.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "common/status_macros.h"

namespace fulcrum {
namespace {

size_t ChunkElements(const v1::TableSpec& t) { return t.chunk_elements() == 0 ? 65536 : t.chunk_elements(); }

}  // namespace

absl::Status CutExport::Begin(const v1::ShardCutMeta& meta) {
  if (!KnownFormat(meta.format())) {
    return absl::DataLossError(absl::StrCat("the checkpoint has format ", meta.format(),
                                            ", which this build cannot read; use a newer one"));
  }
  decoder_.emplace(meta.format());
  for (const auto& t : meta.spec().tables()) {
    Table& out = tables_.emplace_back();
    out.spec = t;
    if (t.kind() == v1::TableSpec::DENSE) {
      int64_t n = 1;
      for (int64_t d : t.shape()) n *= d;
      out.dense.assign(static_cast<size_t>(n), 0.0f);
      const int64_t chunk = static_cast<int64_t>(ChunkElements(t));
      out.chunks_seen.assign(static_cast<size_t>((n + chunk - 1) / chunk), false);
    }
    index_[t.name()] = tables_.size() - 1;
  }
  visit_.dense = [this](const std::string& table, uint32_t chunk, uint64_t, uint32_t length, uint32_t,
                        const void* block) { return AddDense(table, chunk, length, block); };
  visit_.sparse = [this](const std::string& table, uint32_t, uint32_t dim, uint32_t slots, size_t n,
                         const uint64_t* keys, const uint32_t*, const float* rows, const SparseShardLife*) {
    return AddSparse(table, dim, slots, n, keys, rows);
  };
  return absl::OkStatus();
}

absl::Status CutExport::AddDense(const std::string& table, uint32_t chunk, uint32_t length, const void* block) {
  auto it = index_.find(table);
  if (it == index_.end() || tables_[it->second].spec.kind() != v1::TableSpec::DENSE) {
    return absl::DataLossError(absl::StrCat("checkpoint has a dense record for unknown table '", table, "'"));
  }
  Table& t = tables_[it->second];
  const size_t begin = size_t{chunk} * ChunkElements(t.spec);
  if (chunk >= t.chunks_seen.size() || begin + length > t.dense.size()) {
    return absl::DataLossError(absl::StrCat("checkpoint chunk ", chunk, " of table '", table, "' is out of range"));
  }
  std::memcpy(t.dense.data() + begin, block, size_t{length} * sizeof(float));  // weights; slots follow
  t.chunks_seen[chunk] = true;
  return absl::OkStatus();
}

absl::Status CutExport::AddSparse(const std::string& table, uint32_t dim, uint32_t slots, size_t n,
                                  const uint64_t* keys, const float* rows) {
  auto it = index_.find(table);
  if (it == index_.end() || tables_[it->second].spec.kind() != v1::TableSpec::SPARSE) {
    return absl::DataLossError(absl::StrCat("checkpoint has a sparse record for unknown table '", table, "'"));
  }
  Table& t = tables_[it->second];
  if (dim != t.spec.dim()) {
    return absl::DataLossError(
        absl::StrCat("checkpoint has rows of dim ", dim, " for table '", table, "', whose dim is ", t.spec.dim()));
  }
  for (size_t i = 0; i < n; ++i) {
    const float* row = rows + i * size_t{dim} * (size_t{1} + slots);
    t.rows.emplace_back(keys[i], std::vector<float>(row, row + dim));
  }
  return absl::OkStatus();
}

absl::Status CutExport::Add(const v1::CheckpointRecord& record) {
  if (!decoder_) return absl::FailedPreconditionError("CutExport::Add before Begin");
  uint32_t crc = 0;
  return decoder_->Decode("", record.key(), record.value(), visit_, &crc, " of the exported checkpoint");
}

absl::Status CutExport::Write(const std::string& path, const std::map<std::string, std::string>& metadata) {
  std::vector<safetensors::Tensor> tensors;
  std::vector<std::vector<int64_t>> key_store;
  std::vector<std::vector<float>> value_store;
  key_store.reserve(tables_.size());
  value_store.reserve(tables_.size());
  for (Table& t : tables_) {
    if (t.spec.kind() == v1::TableSpec::DENSE) {
      for (size_t c = 0; c < t.chunks_seen.size(); ++c) {
        if (!t.chunks_seen[c]) {
          return absl::DataLossError(absl::StrCat("the checkpoint has no chunk ", c, " of table '", t.spec.name(), "'"));
        }
      }
      tensors.push_back({t.spec.name(), "F32", {t.spec.shape().begin(), t.spec.shape().end()}, t.dense.data(),
                         t.dense.size() * sizeof(float)});
      continue;
    }
    std::sort(t.rows.begin(), t.rows.end());
    auto& keys = key_store.emplace_back();
    auto& values = value_store.emplace_back();
    for (const auto& [k, row] : t.rows) {
      keys.push_back(static_cast<int64_t>(k));
      values.insert(values.end(), row.begin(), row.end());
    }
    const int64_t n = static_cast<int64_t>(keys.size());
    tensors.push_back({t.spec.name() + ".keys", "I64", {n}, keys.data(), keys.size() * 8});
    tensors.push_back({t.spec.name() + ".values", "F32", {n, static_cast<int64_t>(t.spec.dim())}, values.data(),
                       values.size() * sizeof(float)});
  }
  RETURN_IF_ERROR(safetensors::Write(path, tensors, metadata, &bytes_));
  tensors_ = tensors.size();
  return absl::OkStatus();
}

}  // namespace fulcrum
