#include "common/checkpoint_record.h"

#include <zlib.h>

#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace fulcrum {
namespace {

// Reads fixed-size fields from a record value, refusing to run past its end.
class Cursor {
 public:
  Cursor(const char* data, size_t size) : p_(data), end_(data + size) {}
  template <typename T>
  bool Read(T* out) {
    return Bytes(out, sizeof(T));
  }
  bool Bytes(void* out, size_t n) {
    if (static_cast<size_t>(end_ - p_) < n) return false;
    if (n == 0) return true;  // `out` may be an empty vector's null data()
    std::memcpy(out, p_, n);
    p_ += n;
    return true;
  }
  size_t left() const { return static_cast<size_t>(end_ - p_); }

 private:
  const char* p_;
  const char* end_;
};

}  // namespace

namespace {

struct Crc32cTable {
  uint32_t t[256];
  Crc32cTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
  }
};

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t c = ~crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
  return ~c32;
}
#endif

}  // namespace

uint32_t Crc32cPortable(const void* data, size_t n, uint32_t crc) {
  static const Crc32cTable table;
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
  for (size_t i = 0; i < n; ++i) c = table.t[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return ~c;
}

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  if (hw) return Crc32cSse42(data, n, crc);
#endif
  return Crc32cPortable(data, n, crc);
}

bool KnownFormat(uint32_t format) { return format <= kFormatColdLinked; }

uint32_t CheckpointCrc(uint32_t format, const void* data, size_t n, uint32_t crc) {
  if (format >= kFormatCrc32c) return Crc32c(data, n, crc);
  return static_cast<uint32_t>(crc32_z(crc, static_cast<const Bytef*>(data), n));
}

absl::Status ParseRecordKey(std::string_view rest, RecordKey* k, std::string_view where) {
  const bool dense = rest.starts_with("dense/");
  const size_t slash = rest.rfind('/');
  const size_t kind_end = rest.find('/');
  if ((!dense && !rest.starts_with("sparse/")) || slash == std::string_view::npos || slash <= kind_end ||
      rest.size() - slash - 1 != 8) {
    return absl::DataLossError(absl::StrCat("checkpoint record key '", std::string(rest), "' is malformed", std::string(where)));
  }
  k->dense = dense;
  k->table = rest.substr(kind_end + 1, slash - kind_end - 1);
  k->index = static_cast<uint32_t>(std::strtoul(std::string(rest.substr(slash + 1)).c_str(), nullptr, 16));
  return absl::OkStatus();
}


absl::Status RecordDecoder::Decode(std::string_view prefix, std::string_view rest, std::string_view v,
                                   const CheckpointVisitor& visit, uint32_t* crc_out, std::string_view where) {
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(
        absl::StrCat("checkpoint record ", std::string(prefix), std::string(rest), std::string(where), ": ", why));
  };
  RecordKey k;
  RETURN_IF_ERROR(ParseRecordKey(rest, &k, absl::StrCat(" in ", std::string(prefix), std::string(where))));
  if (v.size() < 4) return bad("shorter than its checksum");
  uint32_t crc;
  std::memcpy(&crc, v.data() + v.size() - 4, 4);
  if (CheckpointCrc(format_, v.data(), v.size() - 4) != crc) return bad("checksum mismatch");
  *crc_out = crc;
  Cursor c(v.data(), v.size() - 4);
  const std::string table(k.table);
  if (k.dense) {
    uint64_t upd;
    uint32_t length, slots;
    if (!c.Read(&upd) || !c.Read(&length) || !c.Read(&slots)) return bad("truncated header");
    if (slots > kMaxRecordSlots) return bad(absl::StrCat("its header names ", slots, " optimizer slots"));
    const uint64_t n = uint64_t{length} * (1 + uint64_t{slots});  // < 2^36: no overflow
    if (c.left() != n * sizeof(float)) return bad("size does not match its header");
    // The block goes straight from the stored buffer to its chunk (the
    // visitor copies it; no alignment is assumed).
    const char* block = v.data() + (v.size() - 4 - c.left());
    if (visit.dense) RETURN_IF_ERROR(visit.dense(table, k.index, upd, length, slots, block));
    return absl::OkStatus();
  }
  uint32_t n, dim, slots, flags;
  if (!c.Read(&n) || !c.Read(&dim) || !c.Read(&slots) || !c.Read(&flags)) return bad("truncated header");
  if (slots > kMaxRecordSlots) return bad(absl::StrCat("its header names ", slots, " optimizer slots"));
  // Before format 3 the word was written 0 and never read.
  if (format_ < kFormatLifecycle) flags = 0;
  const uint32_t known = kSparseRecordLifecycle | (format_ >= kFormatColdLinked ? kSparseRecordColdLinked : 0);
  if ((flags & ~known) != 0) return bad(absl::StrCat("its header has unknown flags ", flags));
  const bool has_life = (flags & kSparseRecordLifecycle) != 0;
  const bool linked = (flags & kSparseRecordColdLinked) != 0;
  if (linked && !has_life) return bad("its rows on disk are linked, and it has no lifecycle");
  const uint64_t row_floats = uint64_t{dim} * (1 + uint64_t{slots});  // < 2^36
  // Per row: key, update count, floats, and with a lifecycle its slot, last
  // step and count (< 2^39, never 0).
  const uint64_t row_bytes = 8 + 4 + row_floats * sizeof(float) + (has_life ? 4 + 8 + 4 : 0);
  // n rows of row_bytes each, without computing a product that could wrap;
  // a lifecycle's fixed fields (16 bytes) and its lists follow.
  if (!has_life) {
    if (c.left() % row_bytes != 0 || c.left() / row_bytes != n) return bad("size does not match its header");
  } else if (c.left() < 16 || (c.left() - 16) / row_bytes < n) {
    return bad("size does not match its header");
  }
  keys_.resize(n);
  updates_.resize(n);
  floats_.resize(size_t{n} * row_floats);
  c.Bytes(keys_.data(), size_t{n} * 8);
  c.Bytes(updates_.data(), size_t{n} * 4);
  c.Bytes(floats_.data(), floats_.size() * sizeof(float));
  SparseShardLife life;
  if (has_life) {
    slot_.resize(n);
    last_step_.resize(n);
    freq_.resize(n);
    c.Bytes(slot_.data(), size_t{n} * 4);
    c.Bytes(last_step_.data(), size_t{n} * 8);
    c.Bytes(freq_.data(), size_t{n} * 4);
    uint32_t num_free = 0, sketch_len = 0;
    c.Read(&life.slots);
    c.Read(&life.victim_cursor);
    c.Read(&life.ttl_cursor);
    c.Read(&num_free);
    if (c.left() / 4 < num_free) return bad("its freed slots run past its end");
    free_.resize(num_free);
    c.Bytes(free_.data(), size_t{num_free} * 4);
    if (!c.Read(&sketch_len) || c.left() / 2 < sketch_len) return bad("its admission sketch runs past its end");
    sketch_.resize(sketch_len);
    c.Bytes(sketch_.data(), size_t{sketch_len} * 2);
    if (linked && !c.Read(&life.linked_cold_rows)) return bad("its count of linked rows runs past its end");
    life.cold_linked = linked;
    if (c.left() != 0) return bad("size does not match its header");
    life.slot = slot_.data();
    life.last_step = last_step_.data();
    life.freq = freq_.data();
    life.free_slots = free_.data();
    life.num_free = num_free;
    life.sketch = sketch_.data();
    life.sketch_len = sketch_len;
  }
  if (visit.sparse) {
    RETURN_IF_ERROR(visit.sparse(table, k.index, dim, slots, n, keys_.data(), updates_.data(), floats_.data(),
                                 has_life ? &life : nullptr));
  }
  return absl::OkStatus();
}

namespace {
template <typename T>
void AppendValue(std::string* out, const T& v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}
template <typename T>
void AppendArray(std::string* out, const T* v, size_t n) {
  if (n != 0) out->append(reinterpret_cast<const char*>(v), n * sizeof(T));
}
}  // namespace

void EncodeSparseRecord(uint32_t dim, uint32_t slots, size_t n, const uint64_t* keys, const uint32_t* updates,
                        const float* rows, const SparseShardLife* life, std::string* out) {
  out->clear();
  const uint32_t flags = life == nullptr ? 0
                                         : kSparseRecordLifecycle | (life->cold_linked ? kSparseRecordColdLinked : 0);
  AppendValue(out, static_cast<uint32_t>(n));
  AppendValue(out, dim);
  AppendValue(out, slots);
  AppendValue(out, flags);
  AppendArray(out, keys, n);
  AppendArray(out, updates, n);
  AppendArray(out, rows, n * dim * (1 + size_t{slots}));
  if (life == nullptr) return;
  AppendArray(out, life->slot, n);
  AppendArray(out, life->last_step, n);
  AppendArray(out, life->freq, n);
  AppendValue(out, life->slots);
  AppendValue(out, life->victim_cursor);
  AppendValue(out, life->ttl_cursor);
  AppendValue(out, life->num_free);
  AppendArray(out, life->free_slots, life->num_free);
  AppendValue(out, life->sketch_len);
  AppendArray(out, life->sketch, life->sketch_len);
  if (life->cold_linked) AppendValue(out, life->linked_cold_rows);
}

}  // namespace fulcrum
