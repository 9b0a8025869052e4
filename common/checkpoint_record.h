// The records of a checkpoint cut (docs/checkpoint-format.md): parsing
// their keys and decoding their values, checksums verified. Shared by the
// server's store, a server restoring from its peers, and fulcrumctl export.
#ifndef FULCRUM_COMMON_CHECKPOINT_RECORD_H_
#define FULCRUM_COMMON_CHECKPOINT_RECORD_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace fulcrum {

// Record checksums, by ShardCutMeta.format: 0 and 1, zlib's crc32 (cuts
// written before format 2); 2, CRC-32C (Castagnoli), which SSE4.2 computes
// in hardware at several times zlib's speed.
inline constexpr uint32_t kFormatZlibCrc32 = 1;
inline constexpr uint32_t kFormatCrc32c = 2;
// Format 3: CRC-32C, and a sparse record's header word may carry
// kSparseRecordLifecycle (its shard's lifecycle follows its rows).
inline constexpr uint32_t kFormatLifecycle = 3;
// Format 4: format 3, and a lifecycle row may name slot kColdSlot: the row
// lies in the server's cold tier (server/cold_tier.h), not in memory.
inline constexpr uint32_t kFormatColdRows = 4;
// Format 5: format 4, and a lifecycle record's header word may carry
// kSparseRecordColdLinked: its shard's rows on disk are not in the record
// but in the cut's linked copy of the cold tier (ShardCutMeta.cold_cut),
// and a count of them ends the record. Only the store that wrote the cut
// reads such a record whole (server/cold_cut.h); what it sends its peers
// has the rows in it.
inline constexpr uint32_t kFormatColdLinked = 5;
inline constexpr uint32_t kCurrentFormat = kFormatColdLinked;
inline constexpr uint32_t kSparseRecordLifecycle = 1;
inline constexpr uint32_t kSparseRecordColdLinked = 2;
inline constexpr uint32_t kColdSlot = 0xffffffffu;
// More optimizer slots than any optimizer keeps (Adam and FTRL: 2) marks a
// record as malformed before any size is computed from them.
inline constexpr uint32_t kMaxRecordSlots = 8;

// CRC-32C of `n` bytes continuing `crc` (0 to start), in hardware where the
// CPU has SSE4.2; the portable table version gives the same values.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);
uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc = 0);

// The checksum of `format` (DATA_LOSS-worthy formats give false in *known).
uint32_t CheckpointCrc(uint32_t format, const void* data, size_t n, uint32_t crc = 0);
bool KnownFormat(uint32_t format);

// A sparse shard's lifecycle, as a format-3 record carries it
// (docs/checkpoint-format.md): per row (in the record's key order) its slot
// (kColdSlot: the row lies in the cold tier),
// the step of its last push and its decayed push count; the shard's slot
// count, its victim and TTL cursors, its freed slots (in the order they
// are reused, last first) and its admission sketch (empty: none yet).
struct SparseShardLife {
  const uint32_t* slot = nullptr;
  const uint64_t* last_step = nullptr;
  const float* freq = nullptr;
  uint32_t slots = 0;
  uint32_t victim_cursor = 0;
  uint32_t ttl_cursor = 0;
  const uint32_t* free_slots = nullptr;
  uint32_t num_free = 0;
  const uint16_t* sketch = nullptr;
  uint32_t sketch_len = 0;
  // Format 5: the shard's rows on disk lie in the cut's linked copy of the
  // cold tier, `linked_cold_rows` of them (keys not among the record's).
  bool cold_linked = false;
  uint64_t linked_cold_rows = 0;
};

// A sparse shard record's value before its checksum (docs/checkpoint-format.md):
// `n` rows of `dim` weights and `slots` optimizer slots each, and `life`
// (nullptr: none).
void EncodeSparseRecord(uint32_t dim, uint32_t slots, size_t n, const uint64_t* keys, const uint32_t* updates,
                        const float* rows, const SparseShardLife* life, std::string* out);

struct CheckpointVisitor {
  // `block`: length * (1 + slots) floats, not necessarily aligned (copy it).
  std::function<absl::Status(const std::string& table, uint32_t chunk, uint64_t updates, uint32_t length,
                             uint32_t slots, const void* block)>
      dense;
  // `life`: the shard's lifecycle, or nullptr when the record has none.
  std::function<absl::Status(const std::string& table, uint32_t vshard, uint32_t dim, uint32_t slots, size_t n,
                             const uint64_t* keys, const uint32_t* updates, const float* rows,
                             const SparseShardLife* life)>
      sparse;
};

// A record key after the cut's prefix: dense/<table>/<chunk, 8 hex> or
// sparse/<table>/<virtual shard, 8 hex>.
struct RecordKey {
  bool dense = false;
  std::string_view table;
  uint32_t index = 0;
};
// DATA_LOSS naming the key and `where` when it has another shape.
absl::Status ParseRecordKey(std::string_view rest, RecordKey* k, std::string_view where);

// Decodes one stored record (`rest`: its key after the cut's prefix),
// verifying its checksum (returned in *crc), and hands it to the visitor.
// DATA_LOSS, naming the record (`prefix` + `rest`) and `where` (e.g.
// " in DIR"), when it is malformed. Reuses its buffers across records.
class RecordDecoder {
 public:
  explicit RecordDecoder(uint32_t format) : format_(format) {}

  absl::Status Decode(std::string_view prefix, std::string_view rest, std::string_view value,
                      const CheckpointVisitor& visit, uint32_t* crc, std::string_view where);

 private:
  std::vector<float> floats_;
  std::vector<uint64_t> keys_;
  std::vector<uint32_t> updates_;
  std::vector<uint32_t> slot_, free_;
  std::vector<uint64_t> last_step_;
  std::vector<float> freq_;
  std::vector<uint16_t> sketch_;
  uint32_t format_;
};

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_CHECKPOINT_RECORD_H_
