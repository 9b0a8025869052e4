#include "worker/models/graph_model.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/config/model_graph.h"
#include "common/status_macros.h"
#include "worker/data/device_data.h"
#include "worker/models/graph_bags.h"

namespace fulcrum::models {
namespace {

using compute::Activation;
using compute::Buffer;
using config::GraphLoss;
using config::GraphNodeInfo;
using config::GraphOp;

Activation ActivationOf(GraphOp op) {
  switch (op) {
    case GraphOp::kRelu: return Activation::kRelu;
    case GraphOp::kGelu: return Activation::kGelu;
    case GraphOp::kSigmoid: return Activation::kSigmoid;
    case GraphOp::kTanh: return Activation::kTanh;
    default: return Activation::kNone;
  }
}

v1::InitializerSpec Constant(float a) {
  v1::InitializerSpec s;
  s.set_kind(v1::InitializerSpec::CONSTANT);
  s.set_a(a);
  return s;
}

// One node's buffers and tables.
struct NodeState {
  Buffer out, grad;
  Buffer stack, stack_grad;  // dot_interaction, fm: the inputs side by side
  Buffer mean, rstd;         // layer_norm
  Buffer fm_s, fm_q, fm_t;   // embedding with pooling fm: sum_j x_j v_j, sum_j x_j^2 v_j^2, a row scratch
  Buffer x16, w16, g16;      // linear in bf16: its input, weights and output gradient
  int table = -1;            // linear: weight (bias next); layer_norm: gamma (beta next); embedding
  bool grad_written = false;
  // sparse_input, cross and field: the batch's bags on the device.
  Buffer d_offsets, d_example_offsets, d_index, d_index_shared, d_values, d_mean_values;
};

class GraphModel final : public Model {
 public:
  GraphModel(ModelConfig c, compute::Backend* be, config::ModelGraph g)
      : Model(std::move(c), be),
        plan_(MakeGraphHostPlan(std::move(g), config_.dense_keys, config_.field_bits)),
        g_(plan_->graph) {
    nodes_.resize(g_.nodes.size());
    for (size_t i = 0; i < g_.nodes.size(); ++i) {
      const GraphNodeInfo& n = g_.nodes[i];
      const uint64_t seed = config_.seed + 2 * i;
      if (n.op == GraphOp::kLinear) {
        const int64_t K = g_.nodes[n.inputs[0]].width();
        const float r = 1.0f / std::sqrt(static_cast<float>(K));
        nodes_[i].table = static_cast<int>(tables_.size());
        AddDense(n.name + ".weight", {K, n.cols}, Uniform(-r, r, seed));
        AddDense(n.name + ".bias", {n.cols}, Zeros());
      } else if (n.op == GraphOp::kLayerNorm) {
        nodes_[i].table = static_cast<int>(tables_.size());
        AddDense(n.name + ".gamma", {n.width()}, Constant(1.0f));
        AddDense(n.name + ".beta", {n.width()}, Zeros());
      } else if (n.op == GraphOp::kBias) {
        nodes_[i].table = static_cast<int>(tables_.size());
        // A bias the squared-error loss reads directly is the prediction's
        // offset: it starts at the mean label (ModelConfig::global_mean), as
        // the built-in mf's global bias does.
        const GraphNodeInfo& last = g_.nodes.back();
        const bool offset = last.op == GraphOp::kLoss && last.loss == config::GraphLoss::kSquaredError &&
                            !last.inputs.empty() && last.inputs[0] == static_cast<int>(i);
        AddDense(n.name, {n.width()}, offset ? Constant(config_.global_mean) : Zeros());
      } else if (n.op == GraphOp::kEmbedding) {
        nodes_[i].table = static_cast<int>(tables_.size());
        Table& t = AddSparse(n.name, static_cast<uint32_t>(n.dim),
                             n.init_stddev > 0 ? Normal(0, n.init_stddev, seed) : Zeros());
        // The node's own admission, eviction and storage over the model's.
        if (n.lifecycle.has_admission()) *t.spec.mutable_admission() = n.lifecycle.admission();
        if (n.lifecycle.has_eviction()) *t.spec.mutable_eviction() = n.lifecycle.eviction();
        if (n.lifecycle.has_storage()) *t.spec.mutable_storage() = n.lifecycle.storage();
      }
    }
    loss_ = &g_.nodes.back();
  }

  // Splitting the rows into bags and finding their keys, on the decoding
  // threads: on a GPU this host work would otherwise hold up every step.
  std::function<void(data::Batch*)> HostWork() const override {
    if (g_.sparse_input < 0) return nullptr;
    std::shared_ptr<const GraphHostPlan> plan = plan_;
    return [plan](data::Batch* b) {
      if (!b->sparse()) return;
      auto work = std::make_shared<GraphHostBatch>();
      BuildGraphHostBatch(*plan, *b, work.get());
      b->host_work = std::move(work);
      b->host_work_by = plan.get();
    };
  }

  void AheadKeys(const data::Batch& batch,
                 std::vector<std::pair<size_t, const std::vector<uint64_t>*>>* out) const override {
    if (batch.host_work_by != plan_.get() || batch.host_work == nullptr) return;
    const auto* host = static_cast<const GraphHostBatch*>(batch.host_work.get());
    if (!host->status.ok()) return;
    for (size_t i = 0; i < g_.nodes.size(); ++i) {
      if (g_.nodes[i].op != GraphOp::kEmbedding) continue;
      const Bags& b = host->bags[g_.nodes[i].inputs[0]];
      out->emplace_back(static_cast<size_t>(nodes_[i].table), g_.nodes[i].shared ? &b.distinct_shared : &b.distinct);
    }
  }

  Task task() const override {
    switch (loss_->loss) {
      case GraphLoss::kSoftmaxCrossEntropy: return Task::kClassification;
      case GraphLoss::kBinaryCrossEntropy: return Task::kBinary;
      case GraphLoss::kSquaredError: return Task::kRegression;
    }
    return Task::kBinary;
  }

  absl::StatusOr<Metrics> Run(const data::Batch& batch, bool train) override {
    const int B = batch.size;
    RETURN_IF_ERROR(Labels(batch));
    for (size_t i = 0; i < g_.nodes.size(); ++i) RETURN_IF_ERROR(Forward(batch, static_cast<int>(i)));
    Metrics m;
    m.examples = B;
    m.loss_scale = loss_scaler_.scale();
    if (train) {
      for (NodeState& s : nodes_) s.grad_written = false;
      for (size_t i = g_.nodes.size(); i-- > 0;) RETURN_IF_ERROR(Backward(static_cast<int>(i)));
      if (fp16()) RETURN_IF_ERROR(loss_scaler_.Unscale(be_, tables_, &m));
    }
    loss_host_.resize(B);
    RETURN_IF_ERROR(be_->CopyToHost(loss_host_.data(), loss_buf_.data(), size_t{4} * B));
    const Task t = task();
    if (t == Task::kClassification) {
      pred_host_.resize(B);
      RETURN_IF_ERROR(be_->CopyToHost(pred_host_.data(), pred_.data(), size_t{4} * B));
    } else if (t == Task::kBinary) {
      prob_host_.resize(B);
      RETURN_IF_ERROR(be_->CopyToHost(prob_host_.data(), prob_.data(), size_t{4} * B));
    }
    RETURN_IF_ERROR(be_->Synchronize());
    const float* y = batch.label_data();
    for (int i = 0; i < B; ++i) {
      m.loss_sum += loss_host_[i];
      if (t == Task::kClassification) m.correct += pred_host_[i] == class_host_[i];
      if (t == Task::kBinary) m.correct += (prob_host_[i] > 0.5f) == (y[i] > 0.5f);
    }
    if (t == Task::kBinary) m.scores.assign(prob_host_.begin(), prob_host_.end());
    return m;
  }

 private:
  const GraphNodeInfo& node(int i) const { return g_.nodes[i]; }
  const float* out(int i) const { return nodes_[i].out.as<float>(); }
  float* grad(int i) { return nodes_[i].grad.as<float>(); }
  const float* value(int t) const { return tables_[t].value.as<float>(); }

  absl::Status Labels(const data::Batch& batch) {
    const int B = batch.size;
    RETURN_IF_ERROR(Reserve(&labels_, size_t{4} * std::max(B, 1)));
    if (loss_->loss == GraphLoss::kSoftmaxCrossEntropy) {
      RETURN_IF_ERROR(ClassLabels(batch, static_cast<int>(g_.nodes[loss_->inputs[0]].width()), &class_host_));
      return be_->CopyToDevice(labels_.data(), class_host_.data(), size_t{4} * B);
    }
    return be_->CopyToDevice(labels_.data(), batch.label_data(), size_t{4} * B);
  }

  // ---- host side: the batch's sparse rows into bags per (example, field)
  absl::Status PrepareKeys(const data::Batch& batch) override {
    const int B = batch.size;
    batch_ = B;
    const bool has_sparse = g_.sparse_input >= 0;
    if (!batch.sparse()) {
      if (has_sparse && B > 0) {
        return absl::InvalidArgumentError(absl::StrCat("model graph: node '", node(g_.sparse_input).name,
                                                       "' reads categorical fields, but the batch is dense; use "
                                                       "criteo or libsvm data"));
      }
      if (g_.dense_input >= 0 && B > 0 && batch.num_features != node(g_.dense_input).width()) {
        return absl::InvalidArgumentError(absl::StrCat("model graph: node '", node(g_.dense_input).name, "' has width ",
                                                       node(g_.dense_input).width(), " but the batch has ",
                                                       batch.num_features, " features"));
      }
      return absl::OkStatus();
    }
    // The decoding threads' work on this batch, else the same work here.
    const GraphHostBatch* host = batch.host_work_by == plan_.get()
                                     ? static_cast<const GraphHostBatch*>(batch.host_work.get())
                                     : nullptr;
    if (host == nullptr) {
      BuildGraphHostBatch(*plan_, batch, &host_);
      host = &host_;
    }
    RETURN_IF_ERROR(host->status);
    if (plan_->dense_width > 0) RETURN_IF_ERROR(Upload(&d_dense_, host->dense.data(), 4 * host->dense.size()));
    for (size_t i = 0; i < g_.nodes.size(); ++i) {
      if (config::IsSparseSource(node(i).op)) RETURN_IF_ERROR(UploadBags(i, host->bags[i]));
    }
    for (size_t i = 0; i < g_.nodes.size(); ++i) {
      if (node(i).op != GraphOp::kEmbedding) continue;
      const Bags& b = host->bags[node(i).inputs[0]];
      tables_[nodes_[i].table].keys = node(i).shared ? b.distinct_shared : b.distinct;
    }
    // The host vectors (the batch's, or host_) stay untouched until the
    // step's Run has synchronized: the batch goes back to the pipeline after.
    return absl::OkStatus();
  }

  absl::Status UploadBags(size_t i, const Bags& b) {
    NodeState& s = nodes_[i];
    const size_t nnz = b.keys.size();
    RETURN_IF_ERROR(Upload(&s.d_offsets, b.offsets.data(), 4 * b.offsets.size()));
    RETURN_IF_ERROR(Upload(&s.d_example_offsets, b.example_offsets.data(), 4 * b.example_offsets.size()));
    RETURN_IF_ERROR(Upload(&s.d_index, b.index.data(), 4 * nnz));
    RETURN_IF_ERROR(Upload(&s.d_values, b.values.data(), 4 * nnz));
    if (plan_->wants_shared[i]) RETURN_IF_ERROR(Upload(&s.d_index_shared, b.index_shared.data(), 4 * nnz));
    if (plan_->wants_mean[i]) RETURN_IF_ERROR(Upload(&s.d_mean_values, b.mean_values.data(), 4 * nnz));
    return absl::OkStatus();
  }

  bool lowp() const { return config_.precision != DType::kFp32; }
  bool fp16() const { return config_.precision == DType::kFp16; }
  // A table's gradient is final. Under fp16 none is until the loss scaler
  // has seen them all (it may still zero or rescale every one).
  absl::Status Ready(int t) { return fp16() ? absl::OkStatus() : GradientReady(t); }
  // *out = x rounded to the GEMMs' 16-bit type.
  absl::Status Half(const float* x, size_t n, Buffer* out) {
    RETURN_IF_ERROR(Reserve(out, 2 * std::max<size_t>(n, 1)));
    return be_->Cast(DType::kFp32, config_.precision, n, x, out->data());
  }

  absl::Status Upload(Buffer* b, const void* src, size_t bytes) {
    RETURN_IF_ERROR(Reserve(b, std::max<size_t>(bytes, 4)));
    return bytes == 0 ? absl::OkStatus() : be_->CopyToDevice(b->data(), src, bytes);
  }

  // ---- forward
  absl::Status Forward(const data::Batch& batch, int i) {
    const GraphNodeInfo& n = node(i);
    NodeState& s = nodes_[i];
    const int B = batch.size;
    const size_t W = static_cast<size_t>(n.width());
    if (config::IsSparseSource(n.op)) return absl::OkStatus();
    RETURN_IF_ERROR(Reserve(&s.out, 4 * W * std::max(B, 1)));
    RETURN_IF_ERROR(Reserve(&s.grad, 4 * W * std::max(B, 1)));
    float* y = s.out.as<float>();
    const float* x = n.inputs.empty() ? nullptr : out(n.inputs[0]);
    const size_t K = n.inputs.empty() ? 0 : static_cast<size_t>(node(n.inputs[0]).width());
    switch (n.op) {
      case GraphOp::kDenseInput:
        return DenseInput(batch, W, y);
      case GraphOp::kSparseInput:
      case GraphOp::kCross:
      case GraphOp::kField:
        return absl::OkStatus();
      case GraphOp::kEmbedding: {
        if (n.fm) return FmPool(n, s, B, y);
        const NodeState& src = nodes_[n.inputs[0]];
        const bool sum = n.sum_fields;
        return be_->EmbeddingBag(sum ? B : B * n.fields, n.dim, value(s.table),
                                 (sum ? src.d_example_offsets : src.d_offsets).as<int32_t>(),
                                 (n.shared ? src.d_index_shared : src.d_index).as<int32_t>(),
                                 (n.mean ? src.d_mean_values : src.d_values).as<float>(), false, y);
      }
      case GraphOp::kLinear:
        if (lowp()) {
          // 16-bit GEMM inputs, fp32 accumulation and output (model.h).
          RETURN_IF_ERROR(Half(x, K * B, &s.x16));
          RETURN_IF_ERROR(Half(value(s.table), K * n.cols, &s.w16));
          RETURN_IF_ERROR(be_->GemmLowp(config_.precision, false, false, B, n.cols, static_cast<int>(K), 1.0f,
                                        s.x16.as<uint16_t>(), s.w16.as<uint16_t>(), 0.0f, y));
        } else {
          RETURN_IF_ERROR(be_->Gemm(false, false, B, n.cols, static_cast<int>(K), 1.0f, x, value(s.table), 0.0f, y));
        }
        return be_->BiasAdd(B, n.cols, value(s.table + 1), y);
      case GraphOp::kRelu:
      case GraphOp::kGelu:
      case GraphOp::kSigmoid:
      case GraphOp::kTanh:
        return be_->Activate(ActivationOf(n.op), W * B, x, y);
      case GraphOp::kConcat:
        return Concat(n, B, y);
      case GraphOp::kSlice: {
        ASSIGN_OR_RETURN(const float* ones, Ones(std::max(B, 1)));
        return be_->ScaleRows(B, n.cols, ones, x + n.begin, static_cast<int>(K), y, n.cols);
      }
      case GraphOp::kBias:
        RETURN_IF_ERROR(be_->Copy(y, x, 4 * W * B));
        return be_->BiasAdd(B, static_cast<int>(W), value(s.table), y);
      case GraphOp::kAdd:
        RETURN_IF_ERROR(be_->Copy(y, x, 4 * W * B));
        for (size_t k = 1; k < n.inputs.size(); ++k) RETURN_IF_ERROR(be_->Axpy(W * B, 1.0f, out(n.inputs[k]), y));
        return absl::OkStatus();
      case GraphOp::kMul:
        return Product(W * B, x, out(n.inputs[1]), y);
      case GraphOp::kDotInteraction:
      case GraphOp::kFm: {
        ASSIGN_OR_RETURN(const float* v, Stacked(n, s, B));
        const int d = node(n.inputs[0]).cols;
        return n.op == GraphOp::kFm ? be_->FmInteraction(B, n.fields, d, v, y)
                                    : be_->DotInteraction(B, n.fields, d, v, y);
      }
      case GraphOp::kLayerNorm:
        RETURN_IF_ERROR(Reserve(&s.mean, 4 * std::max(B, 1)));
        RETURN_IF_ERROR(Reserve(&s.rstd, 4 * std::max(B, 1)));
        return be_->LayerNorm(B, static_cast<int>(W), x, value(s.table), value(s.table + 1), n.epsilon, y,
                              s.mean.as<float>(), s.rstd.as<float>());
      case GraphOp::kLoss:
        return Loss(n, B, x);
    }
    return absl::OkStatus();
  }

  // y = a * b element-wise over n values: ScaleRows over n rows of one
  // value, on every backend.
  absl::Status Product(size_t n, const float* a, const float* b, float* y) {
    if (n > static_cast<size_t>(INT32_MAX)) return absl::InvalidArgumentError("mul: over 2^31 values in a batch");
    return be_->ScaleRows(static_cast<int>(n), 1, a, b, 1, y, 1);
  }

  absl::Status DenseInput(const data::Batch& batch, size_t W, float* y) {
    const size_t bytes = 4 * W * batch.size;
    if (batch.sparse()) return be_->Copy(y, d_dense_.data(), bytes);
    if (batch.device != nullptr) return batch.device->Gather(batch, y);
    if (batch.features_uploaded) {
      RETURN_IF_ERROR(be_->WaitForUpload(batch.upload));
      return be_->Copy(y, batch.uploaded.data(), bytes);
    }
    return be_->CopyToDevice(y, batch.dense_data(), bytes);
  }

  // y's columns are the inputs' side by side.
  absl::Status Concat(const GraphNodeInfo& n, int B, float* y) {
    ASSIGN_OR_RETURN(const float* ones, Ones(std::max(B, 1)));
    int off = 0;
    for (int k : n.inputs) {
      const int w = static_cast<int>(node(k).width());
      RETURN_IF_ERROR(be_->ScaleRows(B, w, ones, out(k), w, y + off, static_cast<int>(n.width())));
      off += w;
    }
    return absl::OkStatus();
  }

  // dot_interaction and fm: the vectors of all inputs, B x n x d.
  absl::StatusOr<const float*> Stacked(const GraphNodeInfo& n, NodeState& s, int B) {
    if (n.inputs.size() == 1) return out(n.inputs[0]);
    const int d = node(n.inputs[0]).cols;
    RETURN_IF_ERROR(Reserve(&s.stack, size_t{4} * n.fields * d * std::max(B, 1)));
    RETURN_IF_ERROR(Reserve(&s.stack_grad, size_t{4} * n.fields * d * std::max(B, 1)));
    ASSIGN_OR_RETURN(const float* ones, Ones(std::max(B, 1)));
    int off = 0;
    for (int k : n.inputs) {
      const int w = static_cast<int>(node(k).width());
      RETURN_IF_ERROR(be_->ScaleRows(B, w, ones, out(k), w, s.stack.as<float>() + off, n.fields * d));
      off += w;
    }
    return s.stack.as<const float>();
  }

  // Embedding with pooling fm: per (example, field) bag of values x_j with
  // rows v_j, y = 1/2 (|sum_j x_j v_j|^2 - sum_j x_j^2 |v_j|^2), as the
  // built-in fm model computes its second-order term.
  absl::Status FmPool(const GraphNodeInfo& n, NodeState& s, int B, float* y) {
    const NodeState& src = nodes_[n.inputs[0]];
    const int bags = B * n.fields, k = n.dim;
    const int32_t* index = (n.shared ? src.d_index_shared : src.d_index).as<int32_t>();
    RETURN_IF_ERROR(Reserve(&s.fm_s, size_t{4} * std::max(bags, 1) * k));
    RETURN_IF_ERROR(Reserve(&s.fm_q, size_t{4} * std::max(bags, 1) * k));
    RETURN_IF_ERROR(Reserve(&s.fm_t, size_t{4} * std::max(bags, 1)));
    const float* V = value(s.table);
    RETURN_IF_ERROR(be_->EmbeddingBag(bags, k, V, src.d_offsets.as<int32_t>(), index, src.d_values.as<float>(), false,
                                      s.fm_s.as<float>()));
    RETURN_IF_ERROR(be_->EmbeddingBag(bags, k, V, src.d_offsets.as<int32_t>(), index, src.d_values.as<float>(), true,
                                      s.fm_q.as<float>()));
    RETURN_IF_ERROR(be_->Zero(y, size_t{4} * bags));
    RETURN_IF_ERROR(be_->RowDot(bags, k, s.fm_s.as<float>(), k, s.fm_s.as<float>(), k, s.fm_t.as<float>()));
    RETURN_IF_ERROR(be_->Axpy(bags, 0.5f, s.fm_t.as<float>(), y));
    ASSIGN_OR_RETURN(const float* ones, Ones(k));
    RETURN_IF_ERROR(be_->RowDot(bags, k, s.fm_q.as<float>(), k, ones, 0, s.fm_t.as<float>()));
    return be_->Axpy(bags, -0.5f, s.fm_t.as<float>(), y);
  }
  absl::Status FmPoolBackward(const GraphNodeInfo& n, NodeState& s, int B, const float* g) {
    const NodeState& src = nodes_[n.inputs[0]];
    const int bags = B * n.fields, k = n.dim;
    const int32_t* index = (n.shared ? src.d_index_shared : src.d_index).as<int32_t>();
    const int32_t* offsets = src.d_offsets.as<int32_t>();
    Table& t = tables_[s.table];
    float* gV = t.grad.as<float>();
    float* tmp = s.fm_q.as<float>();  // forward's sum of squares is not needed again
    RETURN_IF_ERROR(be_->Zero(t.grad.data(), t.elements * 4));
    // d/dv_j of 1/2 |s|^2: x_j g s.
    RETURN_IF_ERROR(be_->ScaleRows(bags, k, g, s.fm_s.as<float>(), k, tmp, k));
    RETURN_IF_ERROR(be_->EmbeddingBagGrad(bags, k, tmp, offsets, index, src.d_values.as<float>(), false, nullptr, gV));
    // d/dv_j of -1/2 sum x_j^2 |v_j|^2: through the square bag with -g/2.
    RETURN_IF_ERROR(be_->ScaleRows(bags, k, g, nullptr, 0, tmp, k));
    RETURN_IF_ERROR(be_->Scale(size_t{1} * bags * k, -0.5f, tmp));
    RETURN_IF_ERROR(be_->EmbeddingBagGrad(bags, k, tmp, offsets, index, src.d_values.as<float>(), true, value(s.table),
                                          gV));
    return Ready(s.table);
  }

  absl::Status Loss(const GraphNodeInfo& n, int B, const float* x) {
    const int in = n.inputs[0];
    RETURN_IF_ERROR(Reserve(&loss_buf_, size_t{4} * std::max(B, 1)));
    float* dx = grad(in);  // the loss is the only reader of its input
    const float scale = loss_scaler_.scale() / std::max(B, 1);  // 1 but under fp16
    switch (n.loss) {
      case GraphLoss::kSoftmaxCrossEntropy:
        RETURN_IF_ERROR(Reserve(&pred_, size_t{4} * std::max(B, 1)));
        return be_->SoftmaxCrossEntropy(B, static_cast<int>(node(in).width()), x, labels_.as<int32_t>(), scale,
                                        loss_buf_.as<float>(), pred_.as<int32_t>(), dx);
      case GraphLoss::kBinaryCrossEntropy:
        RETURN_IF_ERROR(Reserve(&prob_, size_t{4} * std::max(B, 1)));
        return be_->SigmoidCrossEntropy(B, x, labels_.as<float>(), scale, loss_buf_.as<float>(), prob_.as<float>(), dx);
      case GraphLoss::kSquaredError:
        return be_->SquaredError(B, x, labels_.as<float>(), scale, loss_buf_.as<float>(), dx);
    }
    return absl::OkStatus();
  }

  // ---- backward
  // Where input k's gradient goes: its buffer when no other reader has
  // written it yet, else scratch that AddGrad then adds in. Null when the
  // input needs no gradient (graph inputs).
  absl::StatusOr<float*> GradTarget(int k, size_t floats) {
    const GraphOp op = node(k).op;
    if (op == GraphOp::kDenseInput || config::IsSparseSource(op)) return nullptr;
    if (!nodes_[k].grad_written) return grad(k);
    RETURN_IF_ERROR(Reserve(&scratch_, 4 * std::max<size_t>(floats, 1)));
    return scratch_.as<float>();
  }
  absl::Status AddGrad(int k, float* target, size_t floats) {
    if (target == nullptr) return absl::OkStatus();
    if (nodes_[k].grad_written) return be_->Axpy(floats, 1.0f, target, grad(k));
    nodes_[k].grad_written = true;
    return absl::OkStatus();
  }
  // Runs write(target) for input k's gradient of `floats` values. When k
  // takes no gradient, write is skipped, unless it `also_writes` tables'
  // gradients: it then writes the input's into scratch, which is dropped.
  template <typename F>
  absl::Status InputGrad(int k, size_t floats, F&& write, bool also_writes = false) {
    ASSIGN_OR_RETURN(float* target, GradTarget(k, floats));
    if (target == nullptr && also_writes) {
      RETURN_IF_ERROR(Reserve(&scratch_, 4 * std::max<size_t>(floats, 1)));
      return write(scratch_.as<float>());
    }
    if (target == nullptr) return absl::OkStatus();
    RETURN_IF_ERROR(write(target));
    return AddGrad(k, target, floats);
  }

  absl::Status Backward(int i) {
    const GraphNodeInfo& n = node(i);
    NodeState& s = nodes_[i];
    const int B = batch_;
    const size_t W = static_cast<size_t>(n.width());
    if (n.op == GraphOp::kDenseInput || config::IsSparseSource(n.op)) return absl::OkStatus();
    if (n.op == GraphOp::kLoss) {
      nodes_[n.inputs[0]].grad_written = true;  // Loss wrote it in forward
      return absl::OkStatus();
    }
    const float* g = grad(i);
    const int in0 = n.inputs.empty() ? -1 : n.inputs[0];
    const size_t K = in0 < 0 ? 0 : static_cast<size_t>(node(in0).width());
    switch (n.op) {
      case GraphOp::kEmbedding: {
        if (n.fm) return FmPoolBackward(n, s, B, g);
        Table& t = tables_[s.table];
        const NodeState& src = nodes_[in0];
        const bool sum = n.sum_fields;
        RETURN_IF_ERROR(be_->Zero(t.grad.data(), t.elements * 4));
        RETURN_IF_ERROR(be_->EmbeddingBagGrad(sum ? B : B * n.fields, n.dim, g,
                                              (sum ? src.d_example_offsets : src.d_offsets).as<int32_t>(),
                                              (n.shared ? src.d_index_shared : src.d_index).as<int32_t>(),
                                              (n.mean ? src.d_mean_values : src.d_values).as<float>(), false, nullptr,
                                              t.grad.as<float>()));
        return Ready(s.table);
      }
      case GraphOp::kLinear: {
        const float* x = out(in0);
        float* dw = tables_[s.table].grad.as<float>();
        if (lowp()) {
          RETURN_IF_ERROR(Half(g, W * B, &s.g16));
          RETURN_IF_ERROR(be_->GemmLowp(config_.precision, true, false, static_cast<int>(K), n.cols, B, 1.0f,
                                        s.x16.as<uint16_t>(), s.g16.as<uint16_t>(), 0.0f, dw));
        } else {
          RETURN_IF_ERROR(be_->Gemm(true, false, static_cast<int>(K), n.cols, B, 1.0f, x, g, 0.0f, dw));
        }
        RETURN_IF_ERROR(be_->ColumnSum(B, n.cols, g, tables_[s.table + 1].grad.as<float>()));
        RETURN_IF_ERROR(Ready(s.table));
        RETURN_IF_ERROR(Ready(s.table + 1));
        return InputGrad(in0, K * B, [&](float* dx) {
          if (lowp()) {
            return be_->GemmLowp(config_.precision, false, true, B, static_cast<int>(K), n.cols, 1.0f,
                                 s.g16.as<uint16_t>(), s.w16.as<uint16_t>(), 0.0f, dx);
          }
          return be_->Gemm(false, true, B, static_cast<int>(K), n.cols, 1.0f, g, value(s.table), 0.0f, dx);
        });
      }
      case GraphOp::kRelu:
      case GraphOp::kGelu:
      case GraphOp::kSigmoid:
      case GraphOp::kTanh:
        return InputGrad(in0, W * B, [&](float* dx) { return be_->ActivateGrad(ActivationOf(n.op), W * B, out(in0), g, dx); });
      case GraphOp::kConcat:
      case GraphOp::kDotInteraction:
      case GraphOp::kFm:
        return SplitBackward(n, s, B, W, g);
      case GraphOp::kSlice:
        return InputGrad(in0, K * B, [&](float* dx) -> absl::Status {
          ASSIGN_OR_RETURN(const float* ones, Ones(std::max(B, 1)));
          RETURN_IF_ERROR(be_->Zero(dx, 4 * K * B));
          return be_->ScaleRows(B, n.cols, ones, g, n.cols, dx + n.begin, static_cast<int>(K));
        });
      case GraphOp::kBias:
        RETURN_IF_ERROR(be_->ColumnSum(B, static_cast<int>(W), g, tables_[s.table].grad.as<float>()));
        RETURN_IF_ERROR(Ready(s.table));
        return InputGrad(in0, W * B, [&](float* dx) { return be_->Copy(dx, g, 4 * W * B); });
      case GraphOp::kAdd:
        for (int k : n.inputs) {
          RETURN_IF_ERROR(InputGrad(k, W * B, [&](float* dx) { return be_->Copy(dx, g, 4 * W * B); }));
        }
        return absl::OkStatus();
      case GraphOp::kMul:
        // d(a * b) = g * b da + g * a db.
        for (int k = 0; k < 2; ++k) {
          const float* other = out(n.inputs[1 - k]);
          RETURN_IF_ERROR(InputGrad(n.inputs[k], W * B, [&](float* dx) { return Product(W * B, g, other, dx); }));
        }
        return absl::OkStatus();
      case GraphOp::kLayerNorm: {
        RETURN_IF_ERROR(InputGrad(
            in0, W * B,
            [&](float* dx) {
              return be_->LayerNormGrad(B, static_cast<int>(W), out(in0), value(s.table), s.mean.as<float>(),
                                        s.rstd.as<float>(), g, dx, tables_[s.table].grad.as<float>(),
                                        tables_[s.table + 1].grad.as<float>());
            },
            /*also_writes=*/true));
        RETURN_IF_ERROR(Ready(s.table));
        return Ready(s.table + 1);
      }
      default:
        return absl::OkStatus();
    }
  }

  // concat, dot_interaction, fm: the gradient of the stacked inputs, then
  // each input's columns of it.
  absl::Status SplitBackward(const GraphNodeInfo& n, NodeState& s, int B, size_t W, const float* g) {
    const float* whole = g;  // concat: the node's own gradient
    int ld = static_cast<int>(W);
    if (n.op != GraphOp::kConcat) {
      const int d = node(n.inputs[0]).cols;
      const float* v = n.inputs.size() == 1 ? out(n.inputs[0]) : s.stack.as<float>();
      auto write = [&](float* dv) {
        return n.op == GraphOp::kFm ? be_->FmInteractionGrad(B, n.fields, d, v, g, dv)
                                    : be_->DotInteractionGrad(B, n.fields, d, v, g, dv);
      };
      if (n.inputs.size() == 1) return InputGrad(n.inputs[0], size_t{1} * n.fields * d * B, write);
      RETURN_IF_ERROR(write(s.stack_grad.as<float>()));
      whole = s.stack_grad.as<float>();
      ld = n.fields * d;
    }
    ASSIGN_OR_RETURN(const float* ones, Ones(std::max(B, 1)));
    int off = 0;
    for (int k : n.inputs) {
      const int w = static_cast<int>(node(k).width());
      RETURN_IF_ERROR(InputGrad(k, size_t{1} * w * B, [&](float* dx) {
        return be_->ScaleRows(B, w, ones, whole + off, ld, dx, w);
      }));
      off += w;
    }
    return absl::OkStatus();
  }

  // The graph lives in the host plan the decoding threads share (graph_bags.h).
  std::shared_ptr<const GraphHostPlan> plan_;
  const config::ModelGraph& g_;
  const GraphNodeInfo* loss_ = nullptr;
  std::vector<NodeState> nodes_;
  int batch_ = 0;
  GraphHostBatch host_;  // Prepare's own host work, for batches that come without it
  Buffer d_dense_;
  Buffer labels_, loss_buf_, pred_, prob_, scratch_;
  std::vector<int32_t> class_host_, pred_host_;
  std::vector<float> loss_host_, prob_host_;
  LossScaler loss_scaler_{config_.precision == DType::kFp16};
};

}  // namespace

absl::StatusOr<std::unique_ptr<Model>> CreateGraphModel(const ModelConfig& config, compute::Backend* backend) {
  config::ModelGraph g;
  if (config.built_graph != nullptr) {
    g = *config.built_graph;
  } else {
    ASSIGN_OR_RETURN(g, config::BuildModelGraph(config.graph));
  }
  if (config.precision != DType::kFp32 && config.precision != DType::kBf16 && config.precision != DType::kFp16) {
    return absl::InvalidArgumentError(
        absl::StrCat("model graph: precision must be fp32, bf16 or fp16, not ", DTypeName(config.precision)));
  }
  if (config.dense_keys < 0 || config.field_bits < 0 || config.field_bits > 40) {
    return absl::InvalidArgumentError(absl::StrCat("model graph: dense_keys ", config.dense_keys, " and field_bits ",
                                                   config.field_bits, " are out of range"));
  }
  return std::unique_ptr<Model>(new GraphModel(config, backend, std::move(g)));
}

}  // namespace fulcrum::models
