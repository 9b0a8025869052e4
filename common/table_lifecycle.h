// A sparse table's lifecycle knobs (TableSpec.admission, .eviction and
// .storage; docs/embeddings.md, "A row's life" and "Rows on disk"), checked the same way by the spec
// check at submit and by the parameter server that creates the table.
#ifndef FULCRUM_COMMON_TABLE_LIFECYCLE_H_
#define FULCRUM_COMMON_TABLE_LIFECYCLE_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "fulcrum/v1/common.pb.h"

namespace fulcrum {

// Each problem of `admission`, `eviction` and `storage` (any may be null:
// not set) as (field, what is wrong), the field relative to the table
// ("admission.min_count"). `row_bytes`: a row's weights and optimizer
// state, or 0 where unknown (max_bytes and memory_bytes are then checked
// against one float).
std::vector<std::pair<std::string, std::string>> TableLifecycleProblems(const v1::AdmissionSpec* admission,
                                                                        const v1::EvictionSpec* eviction,
                                                                        const v1::StorageSpec* storage,
                                                                        uint64_t row_bytes);

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_TABLE_LIFECYCLE_H_
