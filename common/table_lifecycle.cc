#include "common/table_lifecycle.h"

#include "absl/strings/str_cat.h"

namespace fulcrum {

std::vector<std::pair<std::string, std::string>> TableLifecycleProblems(const v1::AdmissionSpec* a,
                                                                        const v1::EvictionSpec* e,
                                                                        const v1::StorageSpec* st,
                                                                        uint64_t row_bytes) {
  std::vector<std::pair<std::string, std::string>> out;
  auto bad = [&](const char* field, std::string what) { out.emplace_back(field, std::move(what)); };
  // A byte budget must hold one row (one float where the row is unknown).
  const uint64_t least = row_bytes != 0 ? row_bytes : sizeof(float);
  auto below_one_row = [&](const char* field, uint64_t bytes) {
    bad(field, absl::StrCat(bytes, " is below one row (", least,
                            row_bytes != 0 ? " bytes of weights and optimizer state)" : " bytes at the least)"));
  };
  if (a != nullptr) {
    if (a->min_count() > 65535) {
      bad("admission.min_count", absl::StrCat(a->min_count(), " is over 65535 (the sketch counts to 65535)"));
    }
    if (!(a->probability() >= 0 && a->probability() <= 1)) {
      bad("admission.probability", absl::StrCat(a->probability(), " must be in (0, 1], or 0 for none"));
    }
    if (a->min_count() == 0 && a->probability() == 0) {
      bad("admission", "needs min_count (at least 1) or probability (in (0, 1])");
    }
    if (a->sketch_width() != 0 && (a->sketch_width() < 64 || a->sketch_width() > (1u << 20))) {
      bad("admission.sketch_width", absl::StrCat(a->sketch_width(), " must be 64 to 1048576, or 0 for 4096"));
    }
  }
  if (e != nullptr) {
    if (e->policy() != v1::EvictionSpec::POLICY_UNSPECIFIED && e->policy() != v1::EvictionSpec::LRU &&
        e->policy() != v1::EvictionSpec::LFU) {
      bad("eviction.policy", absl::StrCat(static_cast<int>(e->policy()), " is not LRU or LFU"));
    }
    if (e->max_rows() != 0 && e->max_bytes() != 0) bad("eviction", "takes max_rows or max_bytes, not both");
    if (e->max_bytes() != 0 && e->max_bytes() < least) below_one_row("eviction.max_bytes", e->max_bytes());
    if (st != nullptr) {
      // Beside a disk tier, eviction only orders the rows that move there.
      if (e->max_rows() != 0 || e->max_bytes() != 0 || e->ttl_steps() != 0) {
        bad("eviction", "with storage takes only policy and lfu_decay (which rows move to disk): rows on disk are "
                        "never dropped, and storage.memory_bytes is the cap on rows in memory");
      }
    } else if (e->max_rows() == 0 && e->max_bytes() == 0 && e->ttl_steps() == 0) {
      bad("eviction", "needs max_rows, max_bytes or ttl_steps");
    }
    if (e->max_rows() > (uint64_t{1} << 40)) {
      bad("eviction.max_rows", absl::StrCat(e->max_rows(), " exceeds 2^40 rows"));
    }
    if (!(e->lfu_decay() >= 0 && e->lfu_decay() <= 1)) {
      bad("eviction.lfu_decay", absl::StrCat(e->lfu_decay(), " must be in (0, 1], or 0 for 0.99"));
    }
  }
  if (st != nullptr) {
    if (st->spill() != v1::StorageSpec::ROCKSDB) {
      bad("storage.spill", st->spill() == v1::StorageSpec::SPILL_UNSPECIFIED
                               ? std::string("must name the tier rows past memory_bytes move to: ROCKSDB")
                               : absl::StrCat(static_cast<int>(st->spill()), " is not ROCKSDB"));
    }
    if (st->memory_bytes() < least) below_one_row("storage.memory_bytes", st->memory_bytes());
  }
  return out;
}

}  // namespace fulcrum
