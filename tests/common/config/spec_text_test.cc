// Job specs from YAML and JSON: what parses, and that every mistake is
// reported with its field path and line.
#include <filesystem>
#include <string>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "common/config/job_spec.h"
#include "common/config/spec_text.h"
#include "fulcrum/v1/cluster.pb.h"

namespace fulcrum::config {
namespace {

constexpr char kYaml[] = R"(---
# a comment
name: mnist-mlp
model:
  type: mlp
  hidden: [256, 128]   # two layers
  activation: "gelu"
data:
  train: {format: idx, path: mnist/train-images-idx3-ubyte, labels: 'mnist/train-labels-idx1-ubyte'}
  test:
    format: idx
    path: mnist/t10k-images-idx3-ubyte
    labels: mnist/t10k-labels-idx1-ubyte
optimizer:
  kind: adam
  learningRate: 1e-3
  schedule: {kind: cosine, warmupSteps: 100, decay_steps: 2000, min_learning_rate: 1e-5}
consistency: {model: ssp, staleness: 2}
num_workers: 2
batch_size: 32
epochs: 3
precision: bf16
wire_dtype: DTYPE_FP16
runPolicy:
  backoffLimit: 2
)";

TEST_CASE("a YAML job spec fills every field, camelCase keys and enum short names included", "[spec]") {
  v1::JobSpec s;
  REQUIRE(ParseSpecText(kYaml, "mnist.yaml", &s).ok());
  CHECK(s.name() == "mnist-mlp");
  CHECK(s.model().type() == "mlp");
  REQUIRE(s.model().hidden_size() == 2);
  CHECK(s.model().hidden(1) == 128);
  CHECK(s.model().activation() == "gelu");
  CHECK(s.data().train().labels() == "mnist/train-labels-idx1-ubyte");
  CHECK(s.data().test().path() == "mnist/t10k-images-idx3-ubyte");
  CHECK(s.optimizer().kind() == v1::OptimizerSpec::ADAM);
  CHECK(s.optimizer().learning_rate() == Approx(1e-3));
  CHECK(s.optimizer().schedule().kind() == v1::LearningRateSchedule::COSINE);
  CHECK(s.optimizer().schedule().warmup_steps() == 100);
  CHECK(s.optimizer().schedule().decay_steps() == 2000);
  CHECK(s.optimizer().schedule().min_learning_rate() == Approx(1e-5));
  CHECK(s.consistency().model() == v1::ConsistencySpec::SSP);
  CHECK(s.consistency().staleness() == 2);
  CHECK(s.precision() == v1::DTYPE_BF16);
  CHECK(s.wire_dtype() == v1::DTYPE_FP16);
  CHECK(s.run_policy().backoff_limit() == 2);
  CHECK(ValidateJobSpec(s).ok());
}

TEST_CASE("JSON parses to the same spec as YAML", "[spec]") {
  v1::JobSpec y, j;
  REQUIRE(ParseSpecText("name: x\nnum_workers: 3\nmodel: {type: softmax}\nhidden: []\n", "a", &y).code() ==
          absl::StatusCode::kInvalidArgument);  // 'hidden' at the top level is unknown
  REQUIRE(ParseSpecText("name: x\nnum_workers: 3\nmodel:\n  type: softmax\n", "a.yaml", &y).ok());
  REQUIRE(ParseSpecText(R"({"name": "x", "num_workers": 3, "model": {"type": "softmax"}})", "a.json", &j).ok());
  CHECK(y.SerializeAsString() == j.SerializeAsString());
}

TEST_CASE("block lists of mappings parse", "[spec]") {
  v1::ListJobsResponse r;  // a message with a repeated message field
  REQUIRE(ParseSpecText("jobs:\n  - id: a\n    spec: {name: one}\n  - id: b\n", "l.yaml", &r).ok());
  REQUIRE(r.jobs_size() == 2);
  CHECK(r.jobs(0).id() == "a");
  CHECK(r.jobs(0).spec().name() == "one");
  CHECK(r.jobs(1).id() == "b");
}

TEST_CASE("every binding mistake is reported with its path and line", "[spec]") {
  v1::JobSpec s;
  const absl::Status st = ParseSpecText(
      "name: x\nmodel:\n  type: mlp\n  hiden: [1]\nnum_workers: -2\noptimizer: {kind: adamax}\nbatch_size: many\n",
      "bad.yaml", &s);
  REQUIRE(st.code() == absl::StatusCode::kInvalidArgument);
  const std::string m(st.message());
  CHECK(m.find("4 problems") != std::string::npos);
  CHECK(m.find("model.hiden: unknown field; ModelSpec has: type, hidden,") != std::string::npos);
  CHECK(m.find("(line 4)") != std::string::npos);
  CHECK(m.find("num_workers: '-2' is not a non-negative whole number") != std::string::npos);
  CHECK(m.find("optimizer.kind: 'adamax' is not one of: sgd, momentum, adagrad, adam, adamw, ftrl") != std::string::npos);
  CHECK(m.find("batch_size: 'many' is not a non-negative whole number") != std::string::npos);
}

TEST_CASE("syntax errors name the file and line", "[spec]") {
  v1::JobSpec s;
  absl::Status st = ParseSpecText("name: x\nmodel:\n  type: [mlp\n", "s.yaml", &s);
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(st.message()).find("s.yaml:3:") == 0);
  st = ParseSpecText("name: x\n\tepochs: 2\n", "t.yaml", &s);
  CHECK(std::string(st.message()) == "t.yaml:2: tabs cannot indent YAML; use spaces");
  st = ParseSpecText("name: &anchor x\n", "a.yaml", &s);
  CHECK(std::string(st.message()).find("not supported") != std::string::npos);
  st = ParseSpecText("name: x\nname: y\n", "d.yaml", &s);
  CHECK(std::string(st.message()) == "d.yaml:2: key 'name' appears twice");
  CHECK(ParseSpecFile("/nonexistent/spec.yaml", &s).code() == absl::StatusCode::kNotFound);
}

TEST_CASE("nesting past 64 levels is a syntax error in flow and block YAML and JSON not a crash", "[spec]") {
  v1::JobSpec s;
  const std::string deep_flow = "checkpoint: " + std::string(30000, '[');
  std::string deep_json;
  for (int i = 0; i < 10000; ++i) deep_json += "{\"k\": ";
  std::string deep_items;
  for (int i = 0; i < 15000; ++i) deep_items += "- ";
  deep_items += "x\n";
  std::string deep_block;
  for (int i = 0; i < 200; ++i) deep_block += std::string(static_cast<size_t>(i), ' ') + "k:\n";
  for (const std::string& text : {deep_flow, deep_json, deep_items, deep_block}) {
    const absl::Status st = ParseSpecText(text, "deep.yaml", &s);
    INFO(st.message().substr(0, 200));
    CHECK(st.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(st.message()).find("nest more than 64 levels deep") != std::string::npos);
  }
  // 64 levels are still fine as far as the parser goes (binding then says
  // what the field takes).
  const absl::Status ok_depth = ParseSpecText("name: " + std::string(63, '[') + std::string(63, ']'), "d.yaml", &s);
  CHECK(std::string(ok_depth.message()).find("levels deep") == std::string::npos);
}

// True when one of `problems` contains `needle`.
bool HasProblem(const std::vector<std::string>& problems, const std::string& needle) {
  for (const auto& x : problems) {
    if (x.find(needle) != std::string::npos) return true;
  }
  return false;
}

TEST_CASE("data paths with '..' or NUL are refused at validation", "[spec][security]") {
  v1::JobSpec s;
  REQUIRE(ParseSpecText("name: x\nmodel: {type: softmax}\n"
                        "data: {train: {format: idx, path: ../../etc/passwd, labels: mnist/l.idx}, "
                        "test: {format: csv, path: a/..}}\noptimizer: {kind: sgd, learning_rate: 0.1}\n"
                        "num_workers: 1\nbatch_size: 8\nepochs: 1\n",
                        "p.yaml", &s)
              .ok());
  const std::vector<std::string> p = JobSpecProblems(s);
  auto has = [&](const std::string& needle) { return HasProblem(p, needle); };
  CHECK(has("data.train.path: '../../etc/passwd' must not contain '..'"));
  CHECK(has("data.test.path: 'a/..' must not contain '..'"));
  CHECK_FALSE(has("data.train.labels"));
  s.mutable_data()->mutable_train()->set_path(std::string("mnist/a\0b", 9));
  INFO(ValidateJobSpec(s).message());
  CHECK(ValidateJobSpec(s).message().find("data.train.path: 'mnist/a\\x00\\x62' must not contain") != std::string::npos);
}

TEST_CASE("validation lists every semantic mistake with what is allowed", "[spec]") {
  v1::JobSpec s;
  REQUIRE(ParseSpecText("name: Bad_Name\nmodel: {type: mlp}\ndata: {train: {format: parquet}}\n"
                        "optimizer: {kind: sgd, schedule: {kind: step}, clip_global_norm: -1}\n"
                        "consistency: {model: ssp}\nepochs: 0\n",
                        "v.yaml", &s)
              .ok());
  const std::vector<std::string> p = JobSpecProblems(s);
  auto has = [&](const std::string& needle) { return HasProblem(p, needle); };
  CHECK(has("name: 'Bad_Name' must be at most 48 lowercase letters"));
  CHECK(has("model.hidden: mlp needs at least one hidden layer"));
  CHECK(has("data.train.format: 'parquet' is not one of: idx, libsvm, csv, criteo"));
  CHECK(has("data.train.path: required"));
  CHECK(has("optimizer.learning_rate: 0 must be > 0"));
  CHECK(has("optimizer.schedule.decay_steps: required for step; allowed: >= 1"));
  CHECK(has("optimizer.clip_global_norm: -1 must be >= 0"));
  CHECK(has("optimizer.schedule.gamma: 0 (unset) is invalid for step; allowed: 0 < gamma <= 1"));
  CHECK(has("consistency.staleness: ssp needs a bound >= 1"));
  CHECK(has("num_workers: 0 must be 1 to 1024"));
  CHECK(has("batch_size: 0 must be 1 to 65536"));
  CHECK(has("epochs: 0 must be 1 to 100000"));
  const absl::Status st = ValidateJobSpec(s);
  CHECK(st.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(st.message()).find(std::to_string(p.size()) + " problems") != std::string::npos);
}

TEST_CASE("enums outside their values and numbers past their ranges are refused, naming the field", "[spec]") {
  // What a client built from proto/ can send that no YAML would: proto3
  // keeps any number in an enum field.
  v1::JobSpec s;
  REQUIRE(ParseSpecText(kYaml, "a.yaml", &s).ok());
  REQUIRE(JobSpecProblems(s).empty());
  s.set_precision(static_cast<v1::DType>(99));
  s.set_wire_dtype(static_cast<v1::DType>(2147483647));
  s.mutable_consistency()->set_model(static_cast<v1::ConsistencySpec::Model>(77));
  s.mutable_optimizer()->set_kind(static_cast<v1::OptimizerSpec::Kind>(-1));
  s.mutable_model()->set_num_classes(2147483647);
  s.mutable_checkpoint()->set_keep(4294967295u);
  s.mutable_run_policy()->set_backoff_limit(4294967295u);
  const std::vector<std::string> p = JobSpecProblems(s);
  INFO(ValidateJobSpec(s).message());
  auto has = [&](const std::string& needle) { return HasProblem(p, needle); };
  CHECK(has("precision: 99 is not one of: fp32, fp16, bf16"));
  CHECK(has("wire_dtype: 2147483647 is not one of: fp32, fp16, bf16"));
  CHECK(has("consistency.model: 77 is not one of: "));
  CHECK(has("optimizer.kind: -1 is not one of: sgd, momentum, adagrad, adam"));
  CHECK(has("model.num_classes: 2147483647 must be 0 (from the data) or 2 to 100000"));
  CHECK(has("checkpoint.keep: 4294967295 must be 0 (3) to 1000"));
  CHECK(has("run_policy.backoff_limit: 4294967295 must be 0 (6) to 1000"));
  // The bounds themselves pass.
  v1::JobSpec edge;
  REQUIRE(ParseSpecText(kYaml, "a.yaml", &edge).ok());
  edge.mutable_checkpoint()->set_keep(1000);
  edge.mutable_run_policy()->set_backoff_limit(1000);
  edge.mutable_model()->set_num_classes(100000);
  CHECK(JobSpecProblems(edge).empty());
}

TEST_CASE("staleness_aware_lr is refused outside ssp and asp", "[spec]") {
  for (const char* model : {"bsp", "local", "ssp", "asp"}) {
    v1::JobSpec s;
    REQUIRE(ParseSpecText(absl::StrCat("consistency: {model: ", model, ", staleness_aware_lr: true}\n"), "c.yaml", &s)
                .ok());
    CHECK(s.consistency().staleness_aware_lr());
    const bool refused = HasProblem(JobSpecProblems(s), "consistency.staleness_aware_lr: only ssp and asp");
    INFO("model " << model);
    CHECK(refused == (std::string(model) == "bsp" || std::string(model) == "local"));
  }
}

TEST_CASE("the workers' row cache: rows and staleness parse, and bad values are named", "[spec]") {
  constexpr char kBase[] = R"(name: ctr
model: {type: fm}
data: {train: {format: libsvm, path: ctr.libsvm}}
optimizer: {kind: adagrad, learning_rate: 0.05}
num_workers: 1
batch_size: 512
epochs: 1
)";
  v1::JobSpec s;
  REQUIRE(ParseSpecText(absl::StrCat(kBase, "consistency: {model: ssp, staleness: 4}\ncache: {rows: 10000, max_staleness_steps: 4}\n"),
                        "c.yaml", &s)
              .ok());
  CHECK(s.cache().rows() == 10000);
  CHECK(s.cache().max_staleness_steps() == 4);
  CHECK(JobSpecProblems(s).empty());

  // Under ssp the cache may not be staler than the job's own bound.
  s.mutable_consistency()->set_staleness(2);
  CHECK(HasProblem(JobSpecProblems(s), "cache.max_staleness_steps: 4 exceeds consistency.staleness 2"));
  // bsp and asp take any bound; 0 keeps bsp bit-identical.
  s.mutable_consistency()->set_model(v1::ConsistencySpec::ASP);
  s.mutable_consistency()->set_staleness(0);
  CHECK(JobSpecProblems(s).empty());

  s.mutable_cache()->set_rows(0);
  CHECK(HasProblem(JobSpecProblems(s), "cache.rows: 0 must be 1 to"));
  s.mutable_cache()->set_rows(100);
  s.mutable_model()->set_type("mlp");
  s.mutable_model()->add_hidden(8);
  CHECK(HasProblem(JobSpecProblems(s), "cache: model 'mlp' has no sparse tables to cache"));
}

TEST_CASE("every example spec in deploy/examples parses and validates", "[spec]") {
  namespace fs = std::filesystem;
  int examples = 0;
  for (const auto& entry : fs::directory_iterator(fs::path(FULCRUM_SOURCE_DIR) / "deploy/examples")) {
    const std::string ext = entry.path().extension().string();
    if (ext != ".yaml" && ext != ".json") continue;
    INFO(entry.path().string());
    v1::JobSpec s;
    REQUIRE(ParseSpecFile(entry.path().string(), &s).ok());
    const absl::Status st = ValidateJobSpec(s);
    INFO(st.ToString());
    REQUIRE(st.ok());
    ++examples;
  }
  REQUIRE(examples >= 5);
}

TEST_CASE("label_column counts from 0, keeps an explicit 0, and -1 is the last column", "[spec]") {
  auto parse = [](const std::string& column) {
    v1::JobSpec s;
    const std::string text = "name: x\nnum_workers: 1\nbatch_size: 8\nepochs: 1\nmodel: {type: softmax}\n"
                             "optimizer: {kind: sgd, learning_rate: 0.1}\n"
                             "data: {train: {format: csv, path: a.csv" +
                             (column.empty() ? std::string() : ", label_column: " + column) + "}}\n";
    REQUIRE(ParseSpecText(text, "l.yaml", &s).ok());
    return s;
  };
  v1::JobSpec first = parse("0");
  CHECK(first.data().train().has_label_column());  // 0 is a column, not "unset"
  CHECK(first.data().train().label_column() == 0);
  CHECK(ValidateJobSpec(first).ok());
  // Presence survives the wire (the coordinator stores specs serialized).
  v1::JobSpec copy;
  REQUIRE(copy.ParseFromString(first.SerializeAsString()));
  CHECK(copy.data().train().has_label_column());
  CHECK_FALSE(parse("").data().train().has_label_column());
  CHECK(ValidateJobSpec(parse("-1")).ok());
  const std::vector<std::string> p = JobSpecProblems(parse("-2"));
  CHECK(HasProblem(p, "data.train.label_column: -2 is not a column: columns are counted from 0 (the first), -1 is "
                      "the last"));
  v1::JobSpec idx = parse("3");
  idx.mutable_data()->mutable_train()->set_format("idx");
  idx.mutable_data()->mutable_train()->set_labels("l");
  CHECK(HasProblem(JobSpecProblems(idx), "data.train.label_column: only csv data has a label column"));
}

TEST_CASE("model types and other names are accepted in any case, as enum values are", "[spec]") {
  v1::JobSpec s;
  REQUIRE(ParseSpecText("name: x\nnum_workers: 1\nbatch_size: 8\nepochs: 1\n"
                        "model: {type: MLP, hidden: [4], activation: GeLU}\n"
                        "optimizer: {kind: SGD, learning_rate: 0.1}\n"
                        "data: {train: {format: CSV, path: a.csv, label_kind: Class}}\n",
                        "c.yaml", &s)
              .ok());
  CHECK_FALSE(ValidateJobSpec(s).ok());  // as written
  NormalizeJobSpec(&s);
  CHECK(ValidateJobSpec(s).ok());
  CHECK(s.model().type() == "mlp");
  CHECK(s.model().activation() == "gelu");
  CHECK(s.data().train().format() == "csv");
  CHECK(s.data().train().label_kind() == "class");
  CHECK_FALSE(s.data().has_test());  // normalizing adds no test data
}

TEST_CASE("a sparse model with dense data is refused", "[spec]") {
  v1::JobSpec s;
  REQUIRE(ParseSpecText("name: s\nmodel: {type: sparse_lr}\n"
                        "data: {train: {format: idx, path: a, labels: b}}\n"
                        "optimizer: {kind: adagrad, learning_rate: 1}\nnum_workers: 1\nbatch_size: 8\nepochs: 1\n"
                        "precision: bf16\n",
                        "s.yaml", &s)
              .ok());
  const std::vector<std::string> p = JobSpecProblems(s);
  REQUIRE(p.size() == 2);
  CHECK(p[0] == "data.train.format: model 'sparse_lr' reads sparse features: use libsvm or criteo");
  CHECK(p[1] == "precision: model 'sparse_lr' has no GEMMs to run in 16 bits; use fp32");
}

}  // namespace
}  // namespace fulcrum::config
