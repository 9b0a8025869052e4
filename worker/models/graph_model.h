// The model of a job spec's graph (ModelSpec.graph, common/config/
// model_graph.h), computed node by node on the compute backend.
//
// Tables: a linear node N has dense tables "N.weight" (in x out, uniform
// +-1/sqrt(in)) and "N.bias" (zeros); a layer_norm "N.gamma" (ones) and
// "N.beta" (zeros); an embedding N a sparse table "N" of `dim`-wide rows
// (N(0, init_stddev)). An embedding's fields share the table's key space:
// Criteo keys are distinct per field, so each field has rows of its own
// (one table per field, stored as one); with `shared` a key is taken within
// its field, so the fields share rows.
//
// Inputs: a dense_input takes a dense batch's features, or from sparse
// rows the keys below ModelConfig::dense_keys as feature indices; a
// sparse_input's fields are the categorical keys, a field's values pooled
// into one vector per example (sum, or mean), an absent field a zero
// vector. Backward runs the nodes in reverse; a node read by several
// others adds their gradients. Gradients are means over the batch, and each
// table's is reported (Model::set_on_gradient) as soon as it is final.
#ifndef FULCRUM_WORKER_MODELS_GRAPH_MODEL_H_
#define FULCRUM_WORKER_MODELS_GRAPH_MODEL_H_

#include <memory>

#include "absl/status/statusor.h"
#include "worker/models/model.h"

namespace fulcrum::models {

absl::StatusOr<std::unique_ptr<Model>> CreateGraphModel(const ModelConfig& config, compute::Backend* backend);

}  // namespace fulcrum::models

#endif  // FULCRUM_WORKER_MODELS_GRAPH_MODEL_H_
