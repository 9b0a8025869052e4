// A job's data and model as its spec names them: data paths resolved and
// confined to the worker's roots, datasets read and summarized, the model's
// configuration completed from the data.
#include "worker/setup/job_data.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/config/model_graph.h"
#include "common/status_macros.h"

namespace fulcrum {
namespace {

std::string Resolve(const std::string& path, const std::string& dir) {
  if (path.empty() || path[0] == '/' || dir.empty()) return path;
  return (std::filesystem::path(dir) / path).string();
}

data::LabelKind LabelKindOf(const std::string& s, data::LabelKind fallback) {
  if (s == "class") return data::LabelKind::kClass;
  if (s == "binary") return data::LabelKind::kBinary;
  if (s == "real") return data::LabelKind::kValue;
  return fallback;
}

}  // namespace

DType DTypeOf(v1::DType d) {
  auto t = DTypeFromWire(d);
  return t.ok() && *t != DType::kUnspecified ? *t : DType::kFp32;
}

std::string DefaultDataDir() {
  if (const char* env = std::getenv("FULCRUM_DATA_DIR"); env != nullptr && *env != 0) return env;
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr ? home : ".") + "/.cache/fulcrum/data";
}

absl::StatusOr<std::string> ConfinedDataPath(const std::string& path, const std::string& dir,
                                             const std::vector<std::string>& roots) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path resolved = fs::weakly_canonical(Resolve(path, dir), ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("data path '", path, "': ", ec.message()));
  for (const std::string& root : roots) {
    const fs::path r = fs::weakly_canonical(root, ec);
    if (ec) continue;
    // Inside when every component of the root starts the path.
    if (std::mismatch(r.begin(), r.end(), resolved.begin(), resolved.end()).first == r.end()) return resolved.string();
  }
  return absl::PermissionDeniedError(absl::StrCat("data path '", path, "' resolves to ", resolved.string(),
                                                  ", outside this worker's data roots (", absl::StrJoin(roots, ", "),
                                                  "); place the data there or add a root with --data_roots"));
}

absl::StatusOr<std::unique_ptr<data::Dataset>> LoadDataSource(const v1::DataSource& s, const std::string& dir,
                                                              const std::vector<std::string>* roots) {
  auto resolve = [&](const std::string& p) -> absl::StatusOr<std::string> {
    if (roots == nullptr || p.empty()) return Resolve(p, dir);
    return ConfinedDataPath(p, dir, *roots);
  };
  ASSIGN_OR_RETURN(const std::string path, resolve(s.path()));
  if (s.format() == "idx") {
    data::IdxOptions o;
    if (s.scale() > 0) o.scale = s.scale();
    ASSIGN_OR_RETURN(const std::string labels, resolve(s.labels()));
    return data::ReadIdx(path, labels, o);
  }
  if (s.format() == "libsvm") {
    data::LibSvmOptions o;
    o.labels = LabelKindOf(s.label_kind(), data::LabelKind::kBinary);
    return data::ReadLibSvm(path, o);
  }
  if (s.format() == "criteo") {
    data::CriteoOptions o;
    if (s.hash_bits() > 0) o.hash_bits = static_cast<int>(s.hash_bits());
    o.raw_integers = s.raw_integers();
    return data::ReadCriteo(path, o);
  }
  if (s.format() == "csv") {
    data::CsvOptions o;
    o.labels = LabelKindOf(s.label_kind(), data::LabelKind::kClass);
    o.header = s.header();
    // Counted from 0; unset and -1 name the last column.
    if (s.has_label_column()) o.label_column = s.label_column();
    if (s.scale() > 0) o.scale = s.scale();
    return data::ReadCsv(path, o);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("data format '", s.format(), "' is not one of: idx, libsvm, csv, criteo"));
}

// A graph model's view of the data: which keys of a sparse row are dense
// features and how the rest split into fields (models::ModelConfig).
static absl::Status GraphLayout(const v1::JobSpec& spec, models::ModelConfig* mc) {
  // Built here, once for the job: the model takes this one (ModelConfig::built_graph).
  ASSIGN_OR_RETURN(config::ModelGraph built, config::BuildModelGraph(spec.model()));
  mc->built_graph = std::make_shared<const config::ModelGraph>(std::move(built));
  const config::ModelGraph& g = *mc->built_graph;
  mc->graph = spec.model();
  const std::string& format = spec.data().train().format();
  const config::GraphNodeInfo* dense = g.dense_input >= 0 ? &g.nodes[g.dense_input] : nullptr;
  const config::GraphNodeInfo* sparse = g.sparse_input >= 0 ? &g.nodes[g.sparse_input] : nullptr;
  if (sparse != nullptr && sparse->by_position && format != "libsvm") {
    return absl::InvalidArgumentError(absl::StrCat("model.graph node '", sparse->name, "': by_position takes the keys "
                                                   "of libsvm rows (\"rating user:1 item:1\"), not ", format, " rows"));
  }
  if (format == "criteo") {
    mc->dense_keys = data::kCriteoIntegers;
    mc->field_bits = spec.data().train().hash_bits() > 0 ? static_cast<int>(spec.data().train().hash_bits()) : 20;
    if (dense != nullptr && dense->width() != data::kCriteoIntegers) {
      return absl::InvalidArgumentError(absl::StrCat("model.graph node '", dense->name, "': width ", dense->width(),
                                                     ", but criteo rows have ", data::kCriteoIntegers, " integer features"));
    }
    if (sparse != nullptr && sparse->fields != data::kCriteoCategoricals) {
      return absl::InvalidArgumentError(absl::StrCat("model.graph node '", sparse->name, "': ", sparse->fields,
                                                     " fields, but criteo rows have ", data::kCriteoCategoricals,
                                                     " categorical fields"));
    }
  } else if (format == "libsvm") {
    mc->dense_keys = dense != nullptr ? static_cast<int>(dense->width()) : 0;
    if (sparse != nullptr && !sparse->by_position && sparse->fields != 1) {
      return absl::InvalidArgumentError(absl::StrCat("model.graph node '", sparse->name, "': ", sparse->fields,
                                                     " fields, but libsvm rows have one (keys at and above the "
                                                     "dense_input's width)"));
    }
  }
  const config::GraphNodeInfo& loss = g.nodes.back();
  if (loss.loss == config::GraphLoss::kSoftmaxCrossEntropy) {
    mc->num_classes = static_cast<int>(g.nodes[loss.inputs[0]].width());
  }
  return absl::OkStatus();
}

std::optional<uint32_t> EpochToEvaluateOnResume(uint32_t rank, uint32_t incarnation, uint64_t start,
                                                uint64_t steps_per_epoch, uint64_t total_steps, bool has_test) {
  if (rank != 0 || incarnation == 0 || !has_test || steps_per_epoch == 0) return std::nullopt;
  if (start == 0 || start >= total_steps || start % steps_per_epoch != 0) return std::nullopt;
  return static_cast<uint32_t>(start / steps_per_epoch - 1);
}

float MeanLabel(const data::Dataset& d) {
  if (d.size() == 0) return 0;
  double sum = 0;
  for (size_t i = 0; i < d.size(); ++i) sum += d.label(i);
  return static_cast<float>(sum / static_cast<double>(d.size()));
}

absl::StatusOr<models::ModelConfig> ModelConfigFor(const v1::JobSpec& spec, const data::Dataset& train) {
  models::ModelConfig mc;
  mc.type = spec.model().type();
  mc.num_features = spec.model().num_features() > 0 ? spec.model().num_features() : train.num_features();
  mc.num_classes = spec.model().num_classes() > 0 ? spec.model().num_classes() : train.num_classes();
  if (!train.sparse() && spec.model().num_features() > 0 && spec.model().num_features() != train.num_features()) {
    return absl::InvalidArgumentError(absl::StrCat("model.num_features is ", spec.model().num_features(),
                                                   " but the training data has ", train.num_features()));
  }
  for (int h : spec.model().hidden()) mc.hidden.push_back(h);
  if (!spec.model().activation().empty()) {
    ASSIGN_OR_RETURN(mc.activation, compute::ActivationFromName(spec.model().activation()));
  }
  if (spec.model().factors() > 0) mc.factors = spec.model().factors();
  if (spec.model().init_stddev() > 0) mc.init_stddev = spec.model().init_stddev();
  if (spec.model().has_admission()) *mc.lifecycle.mutable_admission() = spec.model().admission();
  if (spec.model().has_eviction()) *mc.lifecycle.mutable_eviction() = spec.model().eviction();
  if (spec.model().has_storage()) *mc.lifecycle.mutable_storage() = spec.model().storage();
  mc.precision = DTypeOf(spec.precision());
  mc.seed = spec.seed();
  if (mc.type == "graph") RETURN_IF_ERROR(GraphLayout(spec, &mc));
  // Regression (mf, a graph under squared error) starts its global bias at
  // the mean training label: from 0, the first epochs are spent learning the
  // mean (MovieLens: test RMSE 3.7 after a step at a small rate).
  bool regression = mc.type == "mf";
  for (const v1::GraphNode& n : spec.model().graph()) regression |= n.op() == "loss" && n.loss() == "squared_error";
  if (regression) mc.global_mean = MeanLabel(train);
  return mc;
}

v1::DataSummary SummarizeData(const v1::DataSource& s, const data::Dataset& d) {
  v1::DataSummary out;
  out.set_source(d.source());
  out.set_examples(d.size());
  // Criteo rows are 13 integers and 26 hashed categorical fields: their key
  // space (2^hash_bits a field) is not a count of features.
  out.set_features(s.format() == "criteo" ? static_cast<uint32_t>(data::kCriteoIntegers + data::kCriteoCategoricals)
                                          : static_cast<uint32_t>(d.num_features()));
  const data::LabelKind kind =
      LabelKindOf(s.label_kind(), s.format() == "libsvm" || s.format() == "criteo" ? data::LabelKind::kBinary
                                                                                 : data::LabelKind::kClass);
  out.set_label_kind(kind == data::LabelKind::kClass ? "class" : kind == data::LabelKind::kBinary ? "binary" : "real");
  out.set_classes(kind == data::LabelKind::kClass ? static_cast<uint32_t>(d.num_classes()) : 0);
  // A CSV row is the features and the label: the last column is number
  // num_features, counted from 0.
  int32_t column = -1;
  if (s.format() == "csv") column = s.has_label_column() && s.label_column() >= 0 ? s.label_column() : d.num_features();
  out.set_label_column(column);
  return out;
}

absl::Status CheckClasses(const v1::JobSpec& spec, const models::ModelConfig& model, const v1::DataSummary& train,
                          const v1::DataSummary* test) {
  if (model.type == "graph" && model.num_classes > 0 && train.label_kind() == "class" &&
      train.classes() > static_cast<uint32_t>(model.num_classes)) {
    return absl::InvalidArgumentError(absl::StrCat("data.train (", train.source(), ") has labels 0 to ", train.classes() - 1,
                                                   ", but the graph's softmax_cross_entropy reads ", model.num_classes,
                                                   " logits; make its input that wide"));
  }
  if (model.type != "softmax" && model.type != "mlp") return absl::OkStatus();
  auto where = [](const char* field, const v1::DataSummary& d) {
    return absl::StrCat(field, " (", d.source(),
                        d.label_column() >= 0 ? absl::StrCat(", labels in column ", d.label_column(), " counted from 0")
                                              : std::string(),
                        ")");
  };
  const std::string fix = "; check data.train.label_column (counted from 0; -1 or unset: the last column) "
                          "and model.num_classes (0: from the training data)";
  if (train.label_kind() == "class" && spec.model().num_classes() > 0 &&
      train.classes() != static_cast<uint32_t>(model.num_classes)) {
    return absl::InvalidArgumentError(absl::StrCat(where("data.train", train), " has labels 0 to ",
                                                   train.classes() - 1, " (", train.classes(),
                                                   " classes), but model.num_classes is ", model.num_classes, fix));
  }
  if (test != nullptr && test->label_kind() == "class" && test->classes() > static_cast<uint32_t>(model.num_classes)) {
    return absl::InvalidArgumentError(absl::StrCat(where("data.test", *test), " has labels up to ",
                                                   test->classes() - 1, ", beyond the model's ", model.num_classes,
                                                   " classes (0 to ", model.num_classes - 1, ")", fix));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const data::Dataset>> DataCache::Get(const v1::DataSource& source, const std::string& dir,
                                                                  const std::vector<std::string>& roots) {
  const std::string key = source.SerializeAsString();
  {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
  }
  ASSIGN_OR_RETURN(std::unique_ptr<data::Dataset> d, LoadDataSource(source, dir, &roots));
  std::shared_ptr<const data::Dataset> shared(std::move(d));
  absl::MutexLock lock(&mu_);
  cache_.emplace(key, shared);
  return shared;
}

absl::StatusOr<JobDatasets> SplitJobData(const v1::JobSpec& spec, std::shared_ptr<const data::Dataset> train_all,
                                         std::shared_ptr<const data::Dataset> test) {
  JobDatasets d;
  d.train = train_all;
  d.test = std::move(test);
  if (d.test == nullptr && spec.data().test_fraction() > 0) {
    auto [tr, te] = data::SplitIndices(train_all->size(), spec.data().test_fraction(), spec.seed());
    // Each part keeps the whole alive.
    auto part = [&](const std::vector<int64_t>& idx) {
      return std::shared_ptr<const data::Dataset>(data::Subset(train_all.get(), idx).release(),
                                                  [keep = train_all](const data::Dataset* p) { delete p; });
    };
    d.train = part(tr);
    d.test = part(te);
  }
  if (d.test && d.test->num_features() != d.train->num_features() && !d.train->sparse()) {
    return absl::InvalidArgumentError(absl::StrCat("test data has ", d.test->num_features(), " features, train data ",
                                                   d.train->num_features()));
  }
  return d;
}

}  // namespace fulcrum
