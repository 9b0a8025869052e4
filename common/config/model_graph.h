// Model graphs (ModelSpec.graph): the checked, expanded form of the nodes a
// job spec lists. BuildModelGraph resolves names, expands `mlp` shorthands
// into linear and activation nodes and `cross_net` shorthands (DCN-v2)
// into linear, mul and add nodes, orders the nodes so every input comes
// before its reader, infers each node's per-example shape and parameter
// count, and reports every mistake at once, each naming the node and field
// ("model.graph[3] 'top'.inputs: unknown node 'bottm'"). The coordinator
// runs it on submit, fulcrumctl --validate prints its table, and the
// worker's graph model (worker/models/graph_model.cc) computes it.
//
// Shapes: each example's value at a node is `rows` vectors of `cols`
// floats, stored row-major, so every node's output is a matrix of batch x
// (rows * cols). A sparse_input, and a cross of its fields, have no values
// of their own (cols 0): only an embedding reads them.
#ifndef FULCRUM_COMMON_CONFIG_MODEL_GRAPH_H_
#define FULCRUM_COMMON_CONFIG_MODEL_GRAPH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "fulcrum/v1/cluster.pb.h"

namespace fulcrum::config {

enum class GraphOp {
  kDenseInput, kSparseInput, kEmbedding, kLinear, kRelu, kGelu, kSigmoid, kTanh,
  kConcat, kAdd, kDotInteraction, kFm, kLayerNorm, kLoss, kCross, kBias, kField, kSlice, kMul,
};
// sparse_input, cross and field: categorical fields, read by embeddings only.
inline bool IsSparseSource(GraphOp op) {
  return op == GraphOp::kSparseInput || op == GraphOp::kCross || op == GraphOp::kField;
}
const char* GraphOpName(GraphOp op);

enum class GraphLoss { kSoftmaxCrossEntropy, kBinaryCrossEntropy, kSquaredError };

struct GraphNodeInfo {
  std::string name;
  GraphOp op = GraphOp::kDenseInput;
  std::vector<int> inputs;  // indices of earlier nodes
  int rows = 1, cols = 0;   // per-example output shape
  int64_t width() const { return int64_t{rows} * cols; }
  int fields = 0;                   // sparse_input, cross, field: fields given (cross: pairs of crossed fields)
  bool by_position = false;         // sparse_input: field f is the f-th key, exactly `fields` keys an example
  int index = 0;                    // field: the input's field it takes
  int begin = 0;                    // slice: the first value it takes (cols: how many)
  int crossed = 0;                  // cross: the leading fields of its input it crosses
  int dim = 0;                      // embedding
  bool mean = false, shared = false, sum_fields = false;
  bool fm = false;                  // embedding: pooling fm (one value per field)
  float init_stddev = 0.01f;        // embedding; 0 with zero_init
  v1::TableSpec lifecycle;          // embedding: its table's admission, eviction and storage, where set
  float epsilon = 1e-5f;            // layer_norm
  GraphLoss loss = GraphLoss::kBinaryCrossEntropy;
  int64_t dense_parameters = 0;     // linear: in x out + out; layer_norm: 2 x width; bias: width
  std::string from;                 // the mlp or cross_net node a node was expanded from
  // linear: as wide as the node this many steps up its first inputs (a
  // cross_net's: 1, its input x_l; 2 when low rank, x_l through NAME.down<l>)
  int input_width = 0;
};

struct ModelGraph {
  std::vector<GraphNodeInfo> nodes;  // inputs before readers; the loss last
  int dense_input = -1, sparse_input = -1;  // node indices, -1: none
  int64_t dense_parameters() const;
  // Sparse tables' rows are created as keys arrive: floats per row.
  int64_t floats_per_sparse_key() const;
};

// The graph of `model` (type graph). INVALID_ARGUMENT listing every problem,
// one per line, each prefixed with the node's path.
absl::StatusOr<ModelGraph> BuildModelGraph(const v1::ModelSpec& model);
std::vector<std::string> ModelGraphProblems(const v1::ModelSpec& model);

// The graph a built-in dense model is: `softmax` and `mlp` as linear nodes
// dense0, dense1, ... (so their tables are the built-in model's,
// "dense<l>.weight" and "dense<l>.bias") with the model's activation
// between them, and softmax cross-entropy; sparse_lr and fm over one
// field of all an example's features, with tables "linear", "bias" and
// "factors"; mf over the two keys of a rating by position, with tables
// "user", "item" (k factors, then the bias) and "global_bias".
absl::StatusOr<v1::ModelSpec> PresetGraph(const v1::ModelSpec& model, int num_features, int num_classes);

// A table of the nodes: name, op, inputs, shape and parameters, and totals.
std::string ModelGraphText(const ModelGraph& graph);

}  // namespace fulcrum::config

#endif  // FULCRUM_COMMON_CONFIG_MODEL_GRAPH_H_
