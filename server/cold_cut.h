// Reading a cut whose sparse records leave their shards' rows on disk in
// the cut's linked copy of the server's cold tier (format 5,
// docs/checkpoint-format.md): the records' rows in memory and the copy's
// rows, merged back into whole records, as a cut that copied them holds.
#ifndef FULCRUM_SERVER_COLD_CUT_H_
#define FULCRUM_SERVER_COLD_CUT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/checkpoint_record.h"
#include "server/cold_tier.h"

namespace fulcrum {

// A cut's linked copy of the cold tier: the copy (ColdTier::OpenCut; null
// when the cut links none), the job, and each table's space in it
// (ShardCutMeta.cold_spaces).
struct LinkedCut {
  std::shared_ptr<ColdTier> tier;
  std::string job_id;
  std::map<std::string, uint32_t> spaces;
};

// A visitor that hands `inner` whole records: a sparse record whose rows
// on disk are linked (SparseShardLife::cold_linked) has the rows of its
// table's space and shard in the copy merged in first, slot kColdSlot, in
// key order. DATA_LOSS naming the table, shard and directory when the copy
// holds another number of them than the record counts, or a row of
// another size, or when the cut links no copy or no space for the table.
// Thread-safe when `inner` is.
CheckpointVisitor LinkedCutVisitor(LinkedCut cut, CheckpointVisitor inner);

// The same for one stored record `value` (its key `rest` after the cut's
// prefix): a linked sparse record is rewritten whole into *out, with its
// checksum of `format`; *out is left empty for any other record (send it
// as stored). DATA_LOSS as above, or when the stored record is malformed.
absl::Status ExpandLinkedRecord(const LinkedCut& cut, uint32_t format, std::string_view prefix,
                                std::string_view rest, std::string_view value, std::string* out);

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_COLD_CUT_H_
