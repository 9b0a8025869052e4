#include "worker/models/model.h"

#include <cmath>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/data/device_data.h"
#include "worker/models/graph_model.h"

namespace fulcrum::models {

v1::InitializerSpec Zeros() {
  v1::InitializerSpec s;
  s.set_kind(v1::InitializerSpec::ZEROS);
  return s;
}
v1::InitializerSpec Uniform(float a, float b, uint64_t seed) {
  v1::InitializerSpec s;
  s.set_kind(v1::InitializerSpec::UNIFORM);
  s.set_a(a);
  s.set_b(b);
  s.set_seed(seed);
  return s;
}
v1::InitializerSpec Normal(float mean, float stddev, uint64_t seed) {
  v1::InitializerSpec s;
  s.set_kind(v1::InitializerSpec::NORMAL);
  s.set_a(mean);
  s.set_b(stddev);
  s.set_seed(seed);
  return s;
}

absl::Status Model::Reserve(compute::Buffer* b, size_t bytes) {
  if (b->data() != nullptr && b->bytes() >= bytes) return absl::OkStatus();
  b->Reset();
  ASSIGN_OR_RETURN(*b, be_->Allocate(std::max<size_t>(bytes, 64)));
  return absl::OkStatus();
}

absl::StatusOr<const float*> Model::Ones(int n) {
  if (n > ones_n_) {
    RETURN_IF_ERROR(Reserve(&ones_, size_t{4} * n));
    const std::vector<float> ones(n, 1.0f);
    RETURN_IF_ERROR(be_->CopyToDevice(ones_.data(), ones.data(), size_t{4} * n));
    RETURN_IF_ERROR(be_->Synchronize());  // `ones` dies here
    ones_n_ = n;
  }
  return ones_.as<float>();
}

Table& Model::AddDense(const std::string& name, std::vector<int64_t> shape, v1::InitializerSpec init) {
  Table t;
  t.spec.set_name(name);
  t.spec.set_kind(v1::TableSpec::DENSE);
  size_t n = 1;
  for (int64_t d : shape) {
    t.spec.add_shape(d);
    n *= static_cast<size_t>(d);
  }
  *t.spec.mutable_initializer() = std::move(init);
  t.elements = n;
  tables_.push_back(std::move(t));
  return tables_.back();
}

Table& Model::AddSparse(const std::string& name, uint32_t dim, v1::InitializerSpec init) {
  Table t;
  t.spec.set_name(name);
  t.spec.set_kind(v1::TableSpec::SPARSE);
  t.spec.set_dim(dim);
  *t.spec.mutable_initializer() = std::move(init);
  if (config_.lifecycle.has_admission()) *t.spec.mutable_admission() = config_.lifecycle.admission();
  if (config_.lifecycle.has_eviction()) *t.spec.mutable_eviction() = config_.lifecycle.eviction();
  if (config_.lifecycle.has_storage()) *t.spec.mutable_storage() = config_.lifecycle.storage();
  t.sparse = true;
  t.dim = dim;
  tables_.push_back(std::move(t));
  return tables_.back();
}

absl::Status Model::Prepare(const data::Batch& batch) {
  RETURN_IF_ERROR(PrepareKeys(batch));
  for (Table& t : tables_) {
    if (t.sparse) t.elements = t.keys.size() * t.dim;
    RETURN_IF_ERROR(Reserve(&t.value, t.elements * sizeof(float)));
    RETURN_IF_ERROR(Reserve(&t.grad, t.elements * sizeof(float)));
  }
  return absl::OkStatus();
}

// Checks classification labels on the host and converts them to int32.
absl::Status ClassLabels(const data::Batch& batch, int classes, std::vector<int32_t>* out) {
  out->resize(batch.size);
  const float* y = batch.label_data();
  for (int i = 0; i < batch.size; ++i) {
    const float v = y[i];
    if (!(v >= 0) || v >= classes || v != std::floor(v)) {
      return absl::InvalidArgumentError(absl::StrCat("example ", i, " of batch ", batch.index, ": label ", v,
                                                     " is not a class in [0, ", classes, ")"));
    }
    (*out)[i] = static_cast<int32_t>(v);
  }
  return absl::OkStatus();
}

namespace {

using compute::Activation;
using compute::Buffer;

// ---------------------------------------------------------------- MLP

class Mlp final : public Model {
 public:
  Mlp(ModelConfig c, compute::Backend* be) : Model(std::move(c), be) {
    dims_.push_back(config_.num_features);
    for (int h : config_.hidden) dims_.push_back(h);
    dims_.push_back(config_.num_classes);
    for (size_t l = 0; l + 1 < dims_.size(); ++l) {
      // Glorot-uniform weights, zero biases; each table its own seed.
      const float r = std::sqrt(6.0f / (dims_[l] + dims_[l + 1]));
      AddDense(absl::StrCat("dense", l, ".weight"), {dims_[l], dims_[l + 1]}, Uniform(-r, r, config_.seed + 2 * l));
      AddDense(absl::StrCat("dense", l, ".bias"), {dims_[l + 1]}, Zeros());
    }
    acts_.resize(dims_.size());
    acts16_.resize(dims_.size());
    aux_.resize(dims_.size());
    half_w_.resize(dims_.size());
  }

  Task task() const override { return Task::kClassification; }

  absl::StatusOr<Metrics> Run(const data::Batch& batch, bool train) override {
    const int B = batch.size, L = static_cast<int>(dims_.size()) - 1;
    if (batch.sparse() || batch.num_features != dims_[0]) {
      return absl::InvalidArgumentError(absl::StrCat("model ", config_.type, " expects dense examples of ", dims_[0],
                                                     " features, the batch has ",
                                                     batch.sparse() ? "sparse features" : absl::StrCat(batch.num_features)));
    }
    RETURN_IF_ERROR(ClassLabels(batch, dims_[L], &labels_host_));
    const bool lowp = config_.precision != DType::kFp32;
    // Activations: acts_[0] is the input, acts_[l+1] = act(acts_[l] W_l +
    // b_l) (no activation on the last layer: the logits); aux_[l+1] keeps
    // what backward needs of the activation.
    RETURN_IF_ERROR(Reserve(&acts_[0], size_t{4} * B * dims_[0]));
    if (batch.device != nullptr) {
      // The dataset is on the device: gather and decode the batch's rows there.
      RETURN_IF_ERROR(batch.device->Gather(batch, acts_[0].as<float>()));
    } else if (batch.features_uploaded) {
      // Uploaded on the pipeline's stream while earlier steps computed.
      RETURN_IF_ERROR(be_->WaitForUpload(batch.upload));
      RETURN_IF_ERROR(be_->Copy(acts_[0].data(), batch.uploaded.data(), size_t{4} * B * dims_[0]));
    } else {
      RETURN_IF_ERROR(be_->CopyToDevice(acts_[0].data(), batch.dense_data(), size_t{4} * B * dims_[0]));
    }
    RETURN_IF_ERROR(Reserve(&labels_, size_t{4} * B));
    RETURN_IF_ERROR(be_->CopyToDevice(labels_.data(), labels_host_.data(), size_t{4} * B));
    const DType in = config_.precision;
    if (lowp) RETURN_IF_ERROR(ToHalf(acts_[0].as<float>(), size_t{1} * B * dims_[0], &acts16_[0]));
    for (int l = 0; l < L; ++l) {
      // One fused call per layer (backend.h): GEMM, bias, activation and,
      // in 16 bits, the next layer's input, written by the GEMM itself.
      const bool last = l + 1 == L;
      const compute::Activation act = last ? compute::Activation::kNone : config_.activation;
      const size_t out = size_t{1} * B * dims_[l + 1];
      RETURN_IF_ERROR(Reserve(&acts_[l + 1], 4 * out));
      RETURN_IF_ERROR(Reserve(&aux_[l + 1], std::max<size_t>(1, be_->DenseAuxBytes(in, act, B, dims_[l + 1]))));
      if (lowp && !last) RETURN_IF_ERROR(Reserve(&acts16_[l + 1], 2 * out));
      const void* W = tables_[2 * l].value.data();
      if (lowp) {
        RETURN_IF_ERROR(ToHalf(static_cast<const float*>(W), tables_[2 * l].elements, &half_w_[l]));
        W = half_w_[l].data();
      }
      RETURN_IF_ERROR(be_->DenseForward(in, B, dims_[l + 1], dims_[l], lowp ? acts16_[l].data() : acts_[l].data(), W,
                                        tables_[2 * l + 1].value.as<float>(), act, aux_[l + 1].data(),
                                        acts_[l + 1].as<float>(),
                                        lowp && !last ? acts16_[l + 1].as<uint16_t>() : nullptr));
    }
    const int C = dims_[L];
    RETURN_IF_ERROR(Reserve(&loss_, size_t{4} * B));
    RETURN_IF_ERROR(Reserve(&pred_, size_t{4} * B));
    RETURN_IF_ERROR(Reserve(&delta_, size_t{4} * B * *std::max_element(dims_.begin() + 1, dims_.end())));
    const float scale = loss_scaler_.scale() / B;
    RETURN_IF_ERROR(be_->SoftmaxCrossEntropy(B, C, acts_[L].as<float>(), labels_.as<int32_t>(), scale,
                                             loss_.as<float>(), pred_.as<int32_t>(),
                                             train ? delta_.as<float>() : nullptr));
    Metrics m;
    m.examples = B;
    m.loss_scale = loss_scaler_.scale();
    if (train) RETURN_IF_ERROR(Backward(B, &m));
    RETURN_IF_ERROR(Summarize(B, &m));
    return m;
  }

 private:
  absl::Status PrepareKeys(const data::Batch&) override { return absl::OkStatus(); }

  absl::Status ToHalf(const float* x, size_t n, Buffer* out) {
    RETURN_IF_ERROR(Reserve(out, n * 2));
    return be_->Cast(DType::kFp32, config_.precision, n, x, out->data());
  }

  absl::Status Backward(int B, Metrics* m) {
    const int L = static_cast<int>(dims_.size()) - 1;
    const bool lowp = config_.precision != DType::kFp32;
    const DType in = config_.precision;
    const size_t widest = size_t{1} * B * *std::max_element(dims_.begin() + 1, dims_.end());
    // dZ of the layer being differentiated, fp32 (delta_: the softmax's, then
    // dx_ and delta_ in turn) and in 16 bits (d16_[0], d16_[1] in turn).
    Buffer* dz = &delta_;
    Buffer* dx = &dx_;
    RETURN_IF_ERROR(Reserve(&dx_, 4 * widest));
    int cur = 0;
    if (lowp) {
      RETURN_IF_ERROR(Reserve(&d16_[0], 2 * widest));
      RETURN_IF_ERROR(Reserve(&d16_[1], 2 * widest));
      RETURN_IF_ERROR(be_->Cast(DType::kFp32, in, size_t{1} * B * dims_[L], delta_.data(), d16_[0].data()));
    }
    for (int l = L - 1; l >= 0; --l) {
      const void* dz_in = lowp ? d16_[cur].data() : dz->data();
      float* dW = tables_[2 * l].grad.as<float>();
      // The top layer's bias gradient comes with its weight gradient; each
      // lower layer's came with the input gradient of the layer above.
      float* db = l == L - 1 ? tables_[2 * l + 1].grad.as<float>() : nullptr;
      RETURN_IF_ERROR(be_->DenseWeightGrad(in, B, dims_[l + 1], dims_[l], lowp ? acts16_[l].data() : acts_[l].data(),
                                           dz_in, dz->as<float>(), dW, db));
      // fp16's loss scaling may still zero or rescale every gradient.
      if (config_.precision != DType::kFp16) {
        RETURN_IF_ERROR(GradientReady(2 * l + 1));  // the bias first: the weight completes the layer
        RETURN_IF_ERROR(GradientReady(2 * l));
      }
      if (l == 0) break;
      RETURN_IF_ERROR(be_->DenseInputGrad(in, B, dims_[l + 1], dims_[l], dz_in,
                                          lowp ? half_w_[l].data() : tables_[2 * l].value.data(), config_.activation,
                                          aux_[l].data(), dx->as<float>(), lowp ? d16_[1 - cur].as<uint16_t>() : nullptr,
                                          tables_[2 * l - 1].grad.as<float>()));
      std::swap(dz, dx);
      cur = 1 - cur;
    }
    if (config_.precision != DType::kFp16) return absl::OkStatus();
    return loss_scaler_.Unscale(be_, tables_, m);
  }

  absl::Status Summarize(int B, Metrics* m) {
    loss_host_.resize(B);
    pred_host_.resize(B);
    RETURN_IF_ERROR(be_->CopyToHost(loss_host_.data(), loss_.data(), size_t{4} * B));
    RETURN_IF_ERROR(be_->CopyToHost(pred_host_.data(), pred_.data(), size_t{4} * B));
    RETURN_IF_ERROR(be_->Synchronize());
    for (int i = 0; i < B; ++i) {
      m->loss_sum += loss_host_[i];
      m->correct += pred_host_[i] == labels_host_[i];
    }
    return absl::OkStatus();
  }

  std::vector<int> dims_;
  // Per layer: outputs (acts_[0] the input, acts_[L] the logits), their
  // 16-bit copies, what backward needs of each activation, 16-bit weights.
  std::vector<Buffer> acts_, acts16_, aux_, half_w_;
  Buffer labels_, loss_, pred_, delta_, dx_;
  Buffer d16_[2];
  std::vector<int32_t> labels_host_, pred_host_;
  std::vector<float> loss_host_;
  LossScaler loss_scaler_{config_.precision == DType::kFp16};
};

// ---------------------------------------------------------------- sparse LR and FM

class SparseLinear final : public Model {
 public:
  SparseLinear(ModelConfig c, compute::Backend* be, bool fm) : Model(std::move(c), be), fm_(fm) {
    AddSparse("linear", 1, Zeros());
    AddDense("bias", {1}, Zeros());
    if (fm_) AddSparse("factors", config_.factors, Normal(0, config_.init_stddev, config_.seed));
  }

  Task task() const override { return Task::kBinary; }
  bool wants_distinct_keys() const override { return true; }
  void AheadKeys(const data::Batch& batch,
                 std::vector<std::pair<size_t, const std::vector<uint64_t>*>>* out) const override {
    if (!batch.sparse() || batch.key_index.size() != batch.keys.size()) return;
    out->emplace_back(0, &batch.distinct_keys);
    if (fm_) out->emplace_back(2, &batch.distinct_keys);
  }

  absl::StatusOr<Metrics> Run(const data::Batch& batch, bool train) override {
    const int B = batch.size, k = config_.factors;
    if (!batch.sparse() && B > 0) {
      return absl::InvalidArgumentError(absl::StrCat("model ", config_.type, " expects sparse examples (LibSVM)"));
    }
    const float* wlin = tables_[0].value.as<float>();
    RETURN_IF_ERROR(Reserve(&logit_, size_t{4} * B));
    RETURN_IF_ERROR(Reserve(&labels_, size_t{4} * B));
    RETURN_IF_ERROR(be_->CopyToDevice(labels_.data(), batch.label_data(), size_t{4} * B));
    RETURN_IF_ERROR(be_->EmbeddingBag(B, 1, wlin, offsets_.as<int32_t>(), idx_.as<int32_t>(), vals_.as<float>(), false,
                                      logit_.as<float>()));
    RETURN_IF_ERROR(be_->BiasAdd(B, 1, tables_[1].value.as<float>(), logit_.as<float>()));
    if (fm_) {
      const float* V = tables_[2].value.as<float>();
      RETURN_IF_ERROR(Reserve(&s_, size_t{4} * B * k));
      RETURN_IF_ERROR(Reserve(&q_, size_t{4} * B * k));
      RETURN_IF_ERROR(Reserve(&t_, size_t{4} * B));
      ASSIGN_OR_RETURN(const float* ones, Ones(k));
      RETURN_IF_ERROR(be_->EmbeddingBag(B, k, V, offsets_.as<int32_t>(), idx_.as<int32_t>(), vals_.as<float>(), false,
                                        s_.as<float>()));
      RETURN_IF_ERROR(be_->EmbeddingBag(B, k, V, offsets_.as<int32_t>(), idx_.as<int32_t>(), vals_.as<float>(), true,
                                        q_.as<float>()));
      // logit += 0.5 * (|s|^2 - sum(q)), the term summed on its own first
      // (as the fm preset's graph computes it: the same bits).
      RETURN_IF_ERROR(Reserve(&f_, size_t{4} * B));
      RETURN_IF_ERROR(be_->Zero(f_.data(), size_t{4} * B));
      RETURN_IF_ERROR(be_->RowDot(B, k, s_.as<float>(), k, s_.as<float>(), k, t_.as<float>()));
      RETURN_IF_ERROR(be_->Axpy(B, 0.5f, t_.as<float>(), f_.as<float>()));
      RETURN_IF_ERROR(be_->RowDot(B, k, q_.as<float>(), k, ones, 0, t_.as<float>()));
      RETURN_IF_ERROR(be_->Axpy(B, -0.5f, t_.as<float>(), f_.as<float>()));
      RETURN_IF_ERROR(be_->Axpy(B, 1.0f, f_.as<float>(), logit_.as<float>()));
    }
    RETURN_IF_ERROR(Reserve(&loss_, size_t{4} * B));
    RETURN_IF_ERROR(Reserve(&prob_, size_t{4} * B));
    RETURN_IF_ERROR(Reserve(&dlogit_, size_t{4} * B));
    RETURN_IF_ERROR(be_->SigmoidCrossEntropy(B, logit_.as<float>(), labels_.as<float>(), 1.0f / std::max(B, 1),
                                             loss_.as<float>(), prob_.as<float>(), train ? dlogit_.as<float>() : nullptr));
    if (train) {
      RETURN_IF_ERROR(be_->ColumnSum(B, 1, dlogit_.as<float>(), tables_[1].grad.as<float>()));
      RETURN_IF_ERROR(be_->Zero(tables_[0].grad.data(), tables_[0].elements * 4));
      RETURN_IF_ERROR(be_->EmbeddingBagGrad(B, 1, dlogit_.as<float>(), offsets_.as<int32_t>(), idx_.as<int32_t>(),
                                            vals_.as<float>(), false, nullptr, tables_[0].grad.as<float>()));
      if (fm_) {
        const float* V = tables_[2].value.as<float>();
        float* gV = tables_[2].grad.as<float>();
        RETURN_IF_ERROR(be_->Zero(gV, tables_[2].elements * 4));
        // d/dV of 0.5|s|^2: x_j * dlogit * s.
        RETURN_IF_ERROR(be_->ScaleRows(B, k, dlogit_.as<float>(), s_.as<float>(), k, q_.as<float>(), k));
        RETURN_IF_ERROR(be_->EmbeddingBagGrad(B, k, q_.as<float>(), offsets_.as<int32_t>(), idx_.as<int32_t>(),
                                              vals_.as<float>(), false, nullptr, gV));
        // d/dV of -0.5 sum x^2 V^2: through the square bag with dout = -0.5 dlogit.
        RETURN_IF_ERROR(be_->ScaleRows(B, k, dlogit_.as<float>(), nullptr, 0, q_.as<float>(), k));
        RETURN_IF_ERROR(be_->Scale(size_t{1} * B * k, -0.5f, q_.as<float>()));
        RETURN_IF_ERROR(be_->EmbeddingBagGrad(B, k, q_.as<float>(), offsets_.as<int32_t>(), idx_.as<int32_t>(),
                                              vals_.as<float>(), true, V, gV));
      }
    }
    Metrics m;
    m.examples = B;
    loss_host_.resize(B);
    prob_host_.resize(B);
    RETURN_IF_ERROR(be_->CopyToHost(loss_host_.data(), loss_.data(), size_t{4} * B));
    RETURN_IF_ERROR(be_->CopyToHost(prob_host_.data(), prob_.data(), size_t{4} * B));
    RETURN_IF_ERROR(be_->Synchronize());
    const float* y = batch.label_data();
    for (int i = 0; i < B; ++i) {
      m.loss_sum += loss_host_[i];
      m.correct += (prob_host_[i] > 0.5f) == (y[i] > 0.5f);
    }
    m.scores.assign(prob_host_.begin(), prob_host_.end());
    return m;
  }

 private:
  absl::Status PrepareKeys(const data::Batch& batch) override {
    if (!batch.sparse()) {
      if (batch.size == 0) return absl::OkStatus();
      return absl::InvalidArgumentError(absl::StrCat("model ", config_.type, " expects sparse examples (LibSVM)"));
    }
    // The pipeline's threads found the distinct keys ahead of the step
    // (Batch::distinct_keys); a batch made elsewhere is deduplicated here.
    const std::vector<int32_t>* index = &batch.key_index;
    if (batch.key_index.size() == batch.keys.size()) {
      tables_[0].keys = batch.distinct_keys;
    } else {
      DistinctKeys(batch.keys.data(), batch.keys.size(), &tables_[0].keys, &idx_host_);
      index = &idx_host_;
    }
    if (fm_) tables_[2].keys = tables_[0].keys;
    const size_t nnz = batch.keys.size();
    RETURN_IF_ERROR(Reserve(&idx_, 4 * nnz));
    RETURN_IF_ERROR(Reserve(&vals_, 4 * nnz));
    RETURN_IF_ERROR(Reserve(&offsets_, 4 * batch.offsets.size()));
    RETURN_IF_ERROR(be_->CopyToDevice(idx_.data(), index->data(), 4 * nnz));
    RETURN_IF_ERROR(be_->CopyToDevice(vals_.data(), batch.values.data(), 4 * nnz));
    RETURN_IF_ERROR(be_->CopyToDevice(offsets_.data(), batch.offsets.data(), 4 * batch.offsets.size()));
    return absl::OkStatus();
  }

  const bool fm_;
  Buffer idx_, vals_, offsets_, labels_, logit_, s_, q_, t_, f_, loss_, prob_, dlogit_;
  std::vector<int32_t> idx_host_;
  std::vector<float> loss_host_, prob_host_;
};

// ---------------------------------------------------------------- MF

class MatrixFactorization final : public Model {
 public:
  MatrixFactorization(ModelConfig c, compute::Backend* be) : Model(std::move(c), be) {
    // Rows are the k factors followed by the bias.
    AddSparse("user", config_.factors + 1, Normal(0, config_.init_stddev, config_.seed));
    AddSparse("item", config_.factors + 1, Normal(0, config_.init_stddev, config_.seed + 1));
    v1::InitializerSpec mean;
    mean.set_kind(v1::InitializerSpec::CONSTANT);
    mean.set_a(config_.global_mean);
    AddDense("global_bias", {1}, mean);
  }

  Task task() const override { return Task::kRegression; }

  absl::StatusOr<Metrics> Run(const data::Batch& batch, bool train) override {
    const int B = batch.size, k = config_.factors, w = k + 1;
    RETURN_IF_ERROR(Reserve(&P_, size_t{4} * B * w));
    RETURN_IF_ERROR(Reserve(&Q_, size_t{4} * B * w));
    RETURN_IF_ERROR(Reserve(&pred_, size_t{4} * B));
    RETURN_IF_ERROR(Reserve(&t_, size_t{4} * B));
    RETURN_IF_ERROR(Reserve(&target_, size_t{4} * B));
    ASSIGN_OR_RETURN(const float* one, Ones(1));
    RETURN_IF_ERROR(be_->CopyToDevice(target_.data(), batch.label_data(), size_t{4} * B));
    RETURN_IF_ERROR(be_->Gather(B, w, tables_[0].value.as<float>(), uidx_.as<int32_t>(), P_.as<float>()));
    RETURN_IF_ERROR(be_->Gather(B, w, tables_[1].value.as<float>(), iidx_.as<int32_t>(), Q_.as<float>()));
    // pred = p.q + b_u + b_i + global
    RETURN_IF_ERROR(be_->RowDot(B, k, P_.as<float>(), w, Q_.as<float>(), w, pred_.as<float>()));
    RETURN_IF_ERROR(be_->RowDot(B, 1, P_.as<float>() + k, w, one, 0, t_.as<float>()));
    RETURN_IF_ERROR(be_->Axpy(B, 1.0f, t_.as<float>(), pred_.as<float>()));
    RETURN_IF_ERROR(be_->RowDot(B, 1, Q_.as<float>() + k, w, one, 0, t_.as<float>()));
    RETURN_IF_ERROR(be_->Axpy(B, 1.0f, t_.as<float>(), pred_.as<float>()));
    RETURN_IF_ERROR(be_->BiasAdd(B, 1, tables_[2].value.as<float>(), pred_.as<float>()));
    RETURN_IF_ERROR(Reserve(&loss_, size_t{4} * B));
    RETURN_IF_ERROR(Reserve(&dpred_, size_t{4} * B));
    RETURN_IF_ERROR(be_->SquaredError(B, pred_.as<float>(), target_.as<float>(), 1.0f / std::max(B, 1),
                                      loss_.as<float>(), train ? dpred_.as<float>() : nullptr));
    if (train) {
      RETURN_IF_ERROR(Reserve(&dP_, size_t{4} * B * w));
      RETURN_IF_ERROR(Reserve(&dQ_, size_t{4} * B * w));
      const float* e = dpred_.as<float>();
      RETURN_IF_ERROR(be_->ScaleRows(B, k, e, Q_.as<float>(), w, dP_.as<float>(), w));
      RETURN_IF_ERROR(be_->ScaleRows(B, 1, e, nullptr, 0, dP_.as<float>() + k, w));
      RETURN_IF_ERROR(be_->ScaleRows(B, k, e, P_.as<float>(), w, dQ_.as<float>(), w));
      RETURN_IF_ERROR(be_->ScaleRows(B, 1, e, nullptr, 0, dQ_.as<float>() + k, w));
      RETURN_IF_ERROR(be_->Zero(tables_[0].grad.data(), tables_[0].elements * 4));
      RETURN_IF_ERROR(be_->Zero(tables_[1].grad.data(), tables_[1].elements * 4));
      RETURN_IF_ERROR(be_->ScatterAdd(B, w, dP_.as<float>(), uidx_.as<int32_t>(), tables_[0].grad.as<float>()));
      RETURN_IF_ERROR(be_->ScatterAdd(B, w, dQ_.as<float>(), iidx_.as<int32_t>(), tables_[1].grad.as<float>()));
      RETURN_IF_ERROR(be_->ColumnSum(B, 1, e, tables_[2].grad.as<float>()));
    }
    Metrics m;
    m.examples = B;
    loss_host_.resize(B);
    RETURN_IF_ERROR(be_->CopyToHost(loss_host_.data(), loss_.data(), size_t{4} * B));
    RETURN_IF_ERROR(be_->Synchronize());
    for (int i = 0; i < B; ++i) m.loss_sum += loss_host_[i];
    return m;
  }

 private:
  // Each example is (user, item): exactly two sparse features, the user's
  // key first (libFM's one-hot encoding of a rating).
  absl::Status PrepareKeys(const data::Batch& batch) override {
    if (batch.size > 0 && !batch.sparse()) {
      return absl::InvalidArgumentError("model mf expects sparse examples: \"rating user:1 item:1\" per line");
    }
    users_.resize(batch.size);
    items_.resize(batch.size);
    for (int i = 0; i < batch.size; ++i) {
      if (batch.offsets[i + 1] - batch.offsets[i] != 2) {
        return absl::InvalidArgumentError(absl::StrCat("model mf: example ", i, " of batch ", batch.index, " has ",
                                                       batch.offsets[i + 1] - batch.offsets[i],
                                                       " features, expected 2 (user, item)"));
      }
      users_[i] = batch.keys[batch.offsets[i]];
      items_[i] = batch.keys[batch.offsets[i] + 1];
    }
    DistinctKeys(users_.data(), users_.size(), &tables_[0].keys, &uidx_host_);
    DistinctKeys(items_.data(), items_.size(), &tables_[1].keys, &iidx_host_);
    RETURN_IF_ERROR(Reserve(&uidx_, size_t{4} * batch.size));
    RETURN_IF_ERROR(Reserve(&iidx_, size_t{4} * batch.size));
    RETURN_IF_ERROR(be_->CopyToDevice(uidx_.data(), uidx_host_.data(), size_t{4} * batch.size));
    RETURN_IF_ERROR(be_->CopyToDevice(iidx_.data(), iidx_host_.data(), size_t{4} * batch.size));
    return absl::OkStatus();
  }

  std::vector<uint64_t> users_, items_;
  std::vector<int32_t> uidx_host_, iidx_host_;
  std::vector<float> loss_host_;
  Buffer uidx_, iidx_, P_, Q_, dP_, dQ_, pred_, t_, target_, loss_, dpred_;
};

}  // namespace

absl::Status LossScaler::Unscale(compute::Backend* be, std::vector<Table>& tables, Metrics* m) {
  bool finite = true;
  for (Table& t : tables) {
    ASSIGN_OR_RETURN(bool ok, be->AllFinite(t.elements, t.grad.as<float>()));
    finite = finite && ok;
  }
  if (!finite) {
    for (Table& t : tables) RETURN_IF_ERROR(be->Zero(t.grad.data(), t.elements * 4));
    m->skipped = true;
    scale_ = std::max(1.0f, scale_ / 2);
    good_steps_ = 0;
    return absl::OkStatus();
  }
  for (Table& t : tables) RETURN_IF_ERROR(be->Scale(t.elements, 1.0f / scale_, t.grad.as<float>()));
  if (++good_steps_ >= 1000) {
    scale_ = std::min(scale_ * 2, 16777216.0f);
    good_steps_ = 0;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Model>> CreateModel(const ModelConfig& c, compute::Backend* backend) {
  if (backend == nullptr) return absl::InvalidArgumentError("CreateModel: no backend");
  if (c.precision != DType::kFp32 && c.precision != DType::kBf16 && c.precision != DType::kFp16) {
    return absl::InvalidArgumentError("model.precision: allowed values are fp32, bf16, fp16");
  }
  if (c.type == "softmax" || c.type == "mlp") {
    if (c.num_features <= 0) return absl::InvalidArgumentError(absl::StrCat("model ", c.type, ": num_features must be > 0"));
    if (c.num_classes < 2) return absl::InvalidArgumentError(absl::StrCat("model ", c.type, ": num_classes must be >= 2"));
    ModelConfig cc = c;
    if (c.type == "softmax") cc.hidden.clear();
    if (c.type == "mlp" && cc.hidden.empty()) {
      return absl::InvalidArgumentError("model mlp: hidden must list at least one layer width (use softmax for none)");
    }
    for (size_t i = 0; i < cc.hidden.size(); ++i) {
      if (cc.hidden[i] <= 0) return absl::InvalidArgumentError(absl::StrCat("model mlp: hidden[", i, "] must be > 0"));
    }
    return std::unique_ptr<Model>(new Mlp(std::move(cc), backend));
  }
  if (c.type == "sparse_lr" || c.type == "fm") {
    if (c.type == "fm" && c.factors <= 0) return absl::InvalidArgumentError("model fm: factors must be > 0");
    if (c.precision != DType::kFp32) {
      return absl::InvalidArgumentError(absl::StrCat("model ", c.type, ": precision must be fp32 (no GEMMs to speed up)"));
    }
    return std::unique_ptr<Model>(new SparseLinear(c, backend, c.type == "fm"));
  }
  if (c.type == "graph") return CreateGraphModel(c, backend);
  if (c.type == "mf") {
    if (c.factors <= 0) return absl::InvalidArgumentError("model mf: factors must be > 0");
    if (c.precision != DType::kFp32) return absl::InvalidArgumentError("model mf: precision must be fp32");
    return std::unique_ptr<Model>(new MatrixFactorization(c, backend));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("model type \"", c.type, "\" is unknown (allowed: softmax, mlp, sparse_lr, fm, mf, graph)"));
}

}  // namespace fulcrum::models
