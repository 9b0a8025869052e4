// The host side of a graph model's categorical inputs (graph_model.h):
// a batch's sparse rows split into dense features and bags of values per
// (example, field), and the bags of a `cross` node built from them. Each
// embedding pools one source's bags (EmbeddingBag on the device).
#ifndef FULCRUM_WORKER_MODELS_GRAPH_BAGS_H_
#define FULCRUM_WORKER_MODELS_GRAPH_BAGS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "common/config/model_graph.h"
#include "worker/data/dataset.h"

namespace fulcrum::models {

// One source's values, bag b * fields + f holding example b's values of
// field f in [offsets[bag], offsets[bag + 1]).
struct Bags {
  int fields = 0;
  std::vector<int32_t> offsets;          // batch x fields + 1
  std::vector<int32_t> example_offsets;  // batch + 1: every field of an example, for sum_fields
  std::vector<uint64_t> keys;
  std::vector<float> values;
  std::vector<float> mean_values;        // values / their bag's count (mean pooling)
  // The distinct keys in first-seen order and each value's index among them:
  // as they are, and within their field (shared tables).
  std::vector<uint64_t> distinct, distinct_shared;
  std::vector<int32_t> index, index_shared;

  // Fills example_offsets from offsets, the distinct keys, and what
  // `mean` and `shared` (keys within fields: (key - first) & mask) need.
  void Finish(int batch, bool mean, bool shared, uint64_t first, uint64_t mask);
};

// Splits sparse rows: keys below `first` with index < dense_width go to
// *dense (batch x dense_width, zeros elsewhere); the others, when `bags` is
// not null, to field (key - first) >> field_bits (0 when field_bits is 0)
// of `bags->fields`. A key of a field past them is INVALID_ARGUMENT naming
// the example and `node`.
absl::Status SplitRows(const data::Batch& batch, uint64_t first, int field_bits, int dense_width,
                       const std::string& node, std::vector<float>* dense, Bags* bags);

// Sparse rows by position (a sparse_input by_position): field f of example
// b holds its f-th key, as it is, with its value. An example with other
// than `bags->fields` keys is INVALID_ARGUMENT naming it and `node`.
absl::Status SplitByPosition(const data::Batch& batch, const std::string& node, Bags* bags);

// Field `f` of `in`'s bags, as a source of one field (a `field` node).
void SelectField(const Bags& in, int batch, int f, Bags* out);

// The pairwise crosses of the first `crossed` fields of `in`: bag (b, p)
// for pair p = (i, j), i < j, holds one value per pair of example b's
// values of fields i and j, keyed CrossKey(i, j, key_i, key_j), valued
// value_i * value_j.
void Cross(const Bags& in, int batch, int crossed, Bags* out);
uint64_t CrossKey(int i, int j, uint64_t a, uint64_t b);

// What a graph's host work on a batch needs, fixed when the model is made:
// the graph, the sparse rows' layout (keys below `first` are dense
// features, fields of `field_bits` bits above it) and, per node, what the
// embeddings reading it want (mean values, keys within their field).
struct GraphHostPlan {
  config::ModelGraph graph;
  uint64_t first = 0, mask = ~uint64_t{0};
  int field_bits = 0, dense_width = 0;
  std::vector<bool> wants_mean, wants_shared;  // per node
};
std::shared_ptr<const GraphHostPlan> MakeGraphHostPlan(config::ModelGraph graph, int dense_keys, int field_bits);

// A batch's host side: the dense features of its sparse rows and the bags
// of every categorical source (sparse_input, cross, field; by node),
// finished with their distinct keys, or the batch's error.
struct GraphHostBatch {
  absl::Status status;
  std::vector<float> dense;
  std::vector<Bags> bags;
};

// Builds *out from a sparse batch; reads nothing but `plan` and `batch`, so
// decoding threads can run it ahead of the step (Model::HostWork).
void BuildGraphHostBatch(const GraphHostPlan& plan, const data::Batch& batch, GraphHostBatch* out);

}  // namespace fulcrum::models

#endif  // FULCRUM_WORKER_MODELS_GRAPH_BAGS_H_
