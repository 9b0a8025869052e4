#include "server/cold_cut.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace fulcrum {

CheckpointVisitor LinkedCutVisitor(LinkedCut cut, CheckpointVisitor inner) {
  CheckpointVisitor v;
  v.dense = inner.dense;
  v.sparse = [cut = std::move(cut), sparse = std::move(inner.sparse)](
                 const std::string& table, uint32_t vshard, uint32_t dim, uint32_t slots, size_t n,
                 const uint64_t* keys, const uint32_t* updates, const float* rows,
                 const SparseShardLife* life) -> absl::Status {
    if (life == nullptr || !life->cold_linked) {
      return sparse ? sparse(table, vshard, dim, slots, n, keys, updates, rows, life) : absl::OkStatus();
    }
    auto bad = [&](const std::string& why) {
      return absl::DataLossError(absl::StrCat("checkpoint record of table '", table, "' virtual shard ", vshard,
                                              " of job '", cut.job_id, "': ", why));
    };
    if (cut.tier == nullptr) return bad("its rows on disk are linked, and the cut names no linked cold tier");
    const auto space = cut.spaces.find(table);
    if (space == cut.spaces.end()) {
      return bad(absl::StrCat("its rows on disk are linked, and the cut names no space of the table in ",
                              cut.tier->dir()));
    }
    const uint32_t row_floats = dim * (1 + slots);
    ColdRows cold;
    cold.row_floats = row_floats;
    RETURN_IF_ERROR(cut.tier->Scan(space->second, vshard, row_floats, size_t{1} << 16, [&](const ColdRows& batch) {
      for (size_t i = 0; i < batch.size(); ++i) {
        cold.Add(batch.keys[i], batch.updates[i], batch.last_step[i], batch.freq[i], batch.row(i));
      }
      return absl::OkStatus();
    }));
    MergedRows m;
    const size_t taken =
        MergeTiers(row_floats, n, keys, updates, rows, life->slot, life->last_step, life->freq, cold, &m);
    if (taken != life->linked_cold_rows) {
      return bad(absl::StrCat("it counts ", life->linked_cold_rows, " rows in the linked cold tier ", cut.tier->dir(),
                              ", which holds ", taken));
    }
    SparseShardLife merged = *life;
    merged.slot = m.slot.data();
    merged.last_step = m.last_step.data();
    merged.freq = m.freq.data();
    merged.cold_linked = false;
    merged.linked_cold_rows = 0;
    if (!sparse) return absl::OkStatus();
    return sparse(table, vshard, dim, slots, m.keys.size(), m.keys.data(), m.updates.data(), m.rows.data(), &merged);
  };
  return v;
}

absl::Status ExpandLinkedRecord(const LinkedCut& cut, uint32_t format, std::string_view prefix,
                                std::string_view rest, std::string_view value, std::string* out) {
  out->clear();
  // Only a sparse record's header word can say so: n, dim, slots, flags.
  if (!rest.starts_with("sparse/") || value.size() < 20) return absl::OkStatus();
  uint32_t flags;
  std::memcpy(&flags, value.data() + 12, 4);
  if (format < kFormatColdLinked || (flags & kSparseRecordColdLinked) == 0) return absl::OkStatus();
  CheckpointVisitor encode;
  encode.sparse = [&](const std::string&, uint32_t, uint32_t dim, uint32_t slots, size_t n, const uint64_t* keys,
                      const uint32_t* updates, const float* rows, const SparseShardLife* life) {
    EncodeSparseRecord(dim, slots, n, keys, updates, rows, life, out);
    const uint32_t crc = CheckpointCrc(format, out->data(), out->size());
    out->append(reinterpret_cast<const char*>(&crc), sizeof(crc));
    return absl::OkStatus();
  };
  RecordDecoder decoder(format);
  uint32_t crc = 0;
  return decoder.Decode(prefix, rest, value, LinkedCutVisitor(cut, std::move(encode)), &crc, "");
}

}  // namespace fulcrum
