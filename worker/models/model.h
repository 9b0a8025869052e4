// The built-in models, forward and backward written by hand against the
// compute backend:
//   softmax  softmax regression (an MLP without hidden layers)
//   mlp      dense layers with ReLU or GELU, softmax cross-entropy
//   sparse_lr  logistic regression over sparse (hashed) features
//   fm       factorization machine over sparse features (Rendle 2010)
//   mf       matrix factorization with user and item biases, for ratings
//
// A model declares its parameter tables (Model::tables(), each a
// v1::TableSpec the parameter servers create). Each step:
//   1. Prepare(batch): sparse models list the distinct keys the batch
//      touches per sparse table (Table::keys) and size the buffers.
//   2. The caller fills every Table::value on the device (dense tables
//      whole, sparse tables the rows of `keys` in order): from the servers,
//      or from anywhere in tests.
//   3. Run(batch, train): forward, and with train the backward pass, which
//      overwrites every Table::grad (mean over the batch's examples).
//      Models that compute gradients layer by layer (mlp, softmax) report
//      each table whose gradient is final through the on_gradient callback
//      while the rest of backward still runs, so the caller can push it.
//
// Mixed precision: with precision bf16 or fp16 the dense layers' GEMMs take
// 16-bit inputs with fp32 accumulation; weights stay fp32 (the servers keep
// fp32 masters). fp16 uses dynamic loss scaling: a step whose gradients
// overflow is skipped (its gradients are zeros, Metrics::skipped) and the
// scale halves; after 1000 good steps it doubles.
#ifndef FULCRUM_WORKER_MODELS_MODEL_H_
#define FULCRUM_WORKER_MODELS_MODEL_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/config/model_graph.h"
#include "common/dtype.h"
#include "fulcrum/v1/cluster.pb.h"
#include "fulcrum/v1/common.pb.h"
#include "worker/compute/backend.h"
#include "worker/data/dataset.h"

namespace fulcrum::models {

enum class Task { kClassification, kBinary, kRegression };

struct ModelConfig {
  std::string type;              // softmax | mlp | sparse_lr | fm | mf | graph
  int num_features = 0;          // softmax, mlp: input width
  int num_classes = 0;           // softmax, mlp
  std::vector<int> hidden;       // mlp: hidden layer widths
  compute::Activation activation = compute::Activation::kRelu;
  int factors = 8;               // fm, mf: latent dimension
  float init_stddev = 0.01f;     // fm, mf: N(0, stddev) embeddings
  float global_mean = 0;         // mf: initial global bias
  // Every sparse table's admission and eviction (ModelSpec.admission and
  // .eviction); a graph's embedding node may set its own.
  v1::TableSpec lifecycle;
  DType precision = DType::kFp32;  // GEMM inputs: fp32, bf16 or fp16
  uint64_t seed = 1;
  // graph: the spec's nodes (graph_model.h), and how sparse rows split into
  // its inputs: keys below dense_keys are dense features (Criteo: the 13
  // integers); a key k above is a categorical value of field (k -
  // dense_keys) >> field_bits (Criteo: hash_bits), or of field 0 when
  // field_bits is 0 (LibSVM).
  v1::ModelSpec graph;
  // `graph` built (config::BuildModelGraph), once, by the job's setup
  // (worker/setup): the model takes it as it is. Null: the model builds it.
  std::shared_ptr<const config::ModelGraph> built_graph;
  int dense_keys = 0;
  int field_bits = 0;
};

struct Table {
  v1::TableSpec spec;             // name, kind, shape or dim, initializer
  bool sparse = false;
  uint32_t dim = 0;               // sparse row width
  size_t elements = 0;            // this step: dense size, or keys.size() * dim
  std::vector<uint64_t> keys;     // sparse: the batch's distinct keys
  compute::Buffer value, grad;    // device memory, `elements` floats used
};

struct Metrics {
  double loss_sum = 0;    // summed over examples
  int64_t examples = 0;
  int64_t correct = 0;    // classification and binary tasks
  bool skipped = false;   // fp16 overflow: gradients are zeros
  float loss_scale = 1;
  // Set by the trainer when it clips (TrainerOptions::clip_global_norm):
  // the global L2 norm of the step's gradients before clipping, and
  // whether they were scaled down.
  double grad_norm = -1;
  bool clipped = false;
  // Binary tasks: each example's predicted probability of the positive
  // class, in batch order (AUC is computed from them); empty otherwise.
  std::vector<float> scores;
};

// fp16's dynamic loss scaling (the built-in MLP, model graphs): the loss
// gradient is multiplied by scale(), 65 536 at first. After backward,
// Unscale drops gradients that overflowed (zeroed, Metrics::skipped) and
// halves the scale, or divides them by it, doubling the scale after 1 000
// good steps in a row (at most 2^24). Off (scale 1, Unscale not called)
// for other precisions.
class LossScaler {
 public:
  explicit LossScaler(bool on) : scale_(on ? 65536.0f : 1.0f) {}
  float scale() const { return scale_; }
  absl::Status Unscale(compute::Backend* be, std::vector<Table>& tables, Metrics* m);

 private:
  float scale_;
  int good_steps_ = 0;
};

class Model {
 public:
  virtual ~Model() = default;
  virtual Task task() const = 0;
  // Whether Prepare uses Batch::distinct_keys (one key space over all the
  // batch's features), so the pipeline should find them ahead of the step.
  virtual bool wants_distinct_keys() const { return false; }
  // Host work on a batch that Prepare would otherwise do on the training
  // thread, for the pipeline's decoding threads to do ahead of the step
  // (data::PrefetchOptions::host_work); null when there is none. Safe to
  // call from several threads at once, and after the model is gone.
  virtual std::function<void(data::Batch*)> HostWork() const { return nullptr; }
  // The distinct keys `batch` will pull per sparse table (index into
  // tables()), where the batch holds them already (found on the decoding
  // threads), so they can be sent ahead as a prefetch hint before Prepare;
  // the vectors are the batch's. None by default.
  virtual void AheadKeys(const data::Batch& batch,
                         std::vector<std::pair<size_t, const std::vector<uint64_t>*>>* out) const {
    (void)batch;
    (void)out;
  }
  const ModelConfig& config() const { return config_; }
  std::vector<Table>& tables() { return tables_; }
  compute::Backend* backend() const { return be_; }

  absl::Status Prepare(const data::Batch& batch);
  virtual absl::StatusOr<Metrics> Run(const data::Batch& batch, bool train) = 0;

  // Called during Run's backward with the index of a table whose gradient
  // is final (issued on the backend; not yet synchronized). Tables never
  // reported are final when Run returns. An error aborts Run with it.
  using GradientCallback = std::function<absl::Status(size_t table)>;
  void set_on_gradient(GradientCallback f) { on_gradient_ = std::move(f); }

 protected:
  Model(ModelConfig config, compute::Backend* backend) : config_(std::move(config)), be_(backend) {}
  // Sparse models: fill the sparse tables' keys and upload their indices.
  virtual absl::Status PrepareKeys(const data::Batch& batch) = 0;
  // Grows *b to at least `bytes`.
  absl::Status Reserve(compute::Buffer* b, size_t bytes);
  // A device vector of at least n ones (uploaded when it grows, else reused).
  absl::StatusOr<const float*> Ones(int n);
  Table& AddDense(const std::string& name, std::vector<int64_t> shape, v1::InitializerSpec init);
  Table& AddSparse(const std::string& name, uint32_t dim, v1::InitializerSpec init);

  // Reports table i's gradient as final (see set_on_gradient).
  absl::Status GradientReady(size_t i) { return on_gradient_ ? on_gradient_(i) : absl::OkStatus(); }

  ModelConfig config_;
  compute::Backend* be_;
  GradientCallback on_gradient_;
  std::vector<Table> tables_;

 private:
  compute::Buffer ones_;
  int ones_n_ = 0;
};

absl::StatusOr<std::unique_ptr<Model>> CreateModel(const ModelConfig& config, compute::Backend* backend);

// Checks classification labels on the host (integers in [0, classes)) and
// converts them to int32.
absl::Status ClassLabels(const data::Batch& batch, int classes, std::vector<int32_t>* out);

using data::DistinctKeys;  // data/dataset.h

v1::InitializerSpec Zeros();
v1::InitializerSpec Uniform(float a, float b, uint64_t seed);
v1::InitializerSpec Normal(float mean, float stddev, uint64_t seed);

}  // namespace fulcrum::models

#endif  // FULCRUM_WORKER_MODELS_MODEL_H_
