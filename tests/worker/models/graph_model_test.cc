// The graph model (worker/models/graph_model.h) on the CPU backend: every
// op's backward pass, and that of DLRM, Wide & Deep and DeepFM as the
// examples in deploy/examples define them, against central finite
// differences of the forward pass; and the model's errors.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "common/config/model_graph.h"
#include "common/config/spec_text.h"
#include "worker/models/graph_bags.h"
#include "worker/models/model.h"

namespace fulcrum::models {
namespace {

constexpr int kDense = 5;     // dense features (keys 0..4 of a sparse row)
constexpr int kFields = 3;    // categorical fields
constexpr int kFieldBits = 3; // 8 ids per field

v1::ModelSpec ParseGraph(const std::string& yaml) {
  v1::ModelSpec m;
  const absl::Status s = config::ParseSpecText(yaml, "test", &m);
  INFO(s.message());
  REQUIRE(s.ok());
  m.set_type("graph");
  return m;
}

// Sparse rows in the layout ModelConfig::dense_keys/field_bits describe:
// kDense dense features, then per field 0 to 2 ids from a small range so
// rows repeat within the batch (and fields are sometimes absent).
data::Batch CtrBatch(int B, uint32_t seed, int classes = 2) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0, 1);
  data::Batch b;
  b.size = B;
  b.offsets.push_back(0);
  for (int i = 0; i < B; ++i) {
    for (int k = 0; k < kDense; ++k) {
      if (rng() % 5 == 0) continue;
      b.keys.push_back(k);
      b.values.push_back(n(rng));
    }
    for (int f = 0; f < kFields; ++f) {
      const int count = static_cast<int>(rng() % 3);
      for (int j = 0; j < count; ++j) {
        b.keys.push_back(kDense + (uint64_t{static_cast<uint32_t>(f)} << kFieldBits) + rng() % 4);
        b.values.push_back(1.0f);
      }
    }
    b.offsets.push_back(static_cast<int32_t>(b.keys.size()));
    b.labels.push_back(classes == 0 ? n(rng) : static_cast<float>(rng() % classes));
  }
  return b;
}

// Ratings: per example a user key (0-5) and an item key (0-5, overlapping
// the users'), by position, and a real label.
data::Batch RatingBatch(int B, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0, 1);
  data::Batch b;
  b.size = B;
  b.offsets.push_back(0);
  for (int i = 0; i < B; ++i) {
    b.keys.push_back(rng() % 6);
    b.keys.push_back(rng() % 6);
    b.values.insert(b.values.end(), {1.0f, 1.0f});
    b.offsets.push_back(static_cast<int32_t>(b.keys.size()));
    b.labels.push_back(n(rng));
  }
  return b;
}

struct Fixture {
  std::unique_ptr<compute::Backend> be = compute::NewCpuBackend(1);
  std::unique_ptr<Model> model;
};

std::unique_ptr<Model> MakeModel(compute::Backend* be, const v1::ModelSpec& spec) {
  ModelConfig c;
  c.type = "graph";
  c.graph = spec;
  c.dense_keys = kDense;
  c.field_bits = kFieldBits;
  auto m = CreateModel(c, be);
  INFO(m.status().message());
  REQUIRE(m.ok());
  return std::move(*m);
}

double Loss(Model& m, const data::Batch& b) {
  auto r = m.Run(b, false);
  REQUIRE(r.ok());
  return r->loss_sum / r->examples;
}

// Every table's gradient (Run's mean over the batch) against central
// differences, on up to `per_table` elements of each.
void CheckGradients(const v1::ModelSpec& spec, int classes = 2, int per_table = 12,
                    const data::Batch* batch = nullptr) {
  auto be = compute::NewCpuBackend(1);
  std::unique_ptr<Model> m = MakeModel(be.get(), spec);
  const data::Batch ctr = CtrBatch(16, 7, classes);
  const data::Batch& b = batch != nullptr ? *batch : ctr;
  REQUIRE(m->Prepare(b).ok());
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0, 0.5f);
  for (Table& t : m->tables()) {
    for (size_t i = 0; i < t.elements; ++i) t.value.as<float>()[i] = n(rng);
  }
  auto r = m->Run(b, true);
  INFO(r.status().message());
  REQUIRE(r.ok());
  std::vector<std::vector<float>> grads;
  for (Table& t : m->tables()) grads.emplace_back(t.grad.as<float>(), t.grad.as<float>() + t.elements);
  const float eps = 2e-3f;
  int checked = 0;
  for (size_t ti = 0; ti < m->tables().size(); ++ti) {
    Table& t = m->tables()[ti];
    REQUIRE(t.elements > 0);
    const size_t step = std::max<size_t>(1, t.elements / per_table);
    for (size_t i = 0; i < t.elements; i += step) {
      float* w = t.value.as<float>() + i;
      const float orig = *w;
      *w = orig + eps;
      const double up = Loss(*m, b);
      *w = orig - eps;
      const double down = Loss(*m, b);
      *w = orig;
      const double fd = (up - down) / (2 * eps);
      INFO("table " << t.spec.name() << " element " << i << ": finite difference " << fd << ", backward "
                    << grads[ti][i]);
      CHECK(std::abs(fd - grads[ti][i]) <= 2e-3 + 2e-2 * std::abs(fd));
      ++checked;
    }
  }
  CHECK(checked >= static_cast<int>(m->tables().size()));
}

// dense -> linear(4) -> OP -> linear(1) -> binary cross-entropy.
std::string Around(const std::string& op) {
  return "graph:\n"
         "  - {name: x, op: dense_input, width: 5}\n"
         "  - {name: h, op: linear, inputs: [x], width: 4}\n"
         "  - {name: a, op: " + op + ", inputs: [h]}\n"
         "  - {name: logit, op: linear, inputs: [a], width: 1}\n"
         "  - {name: loss, op: loss, inputs: [logit], loss: binary_cross_entropy}\n";
}

TEST_CASE("graph: element-wise ops and layer_norm match finite differences", "[graph]") {
  for (const char* op : {"relu", "gelu", "sigmoid", "tanh", "layer_norm"}) {
    INFO(op);
    CheckGradients(ParseGraph(Around(op)));
  }
}

TEST_CASE("graph: embeddings with sum and mean and fm pooling and shared rows match finite differences", "[graph]") {
  for (const char* options : {"", ", pooling: mean", ", shared: true", ", sum_fields: true, pooling: mean",
                              ", pooling: fm", ", pooling: fm, shared: true"}) {
    INFO(options);
    CheckGradients(ParseGraph(std::string("graph:\n"
                                          "  - {name: cat, op: sparse_input, fields: 3}\n"
                                          "  - {name: emb, op: embedding, inputs: [cat], dim: 2") +
                              options +
                              "}\n"
                              "  - {name: logit, op: linear, inputs: [emb], width: 1}\n"
                              "  - {name: loss, op: loss, inputs: [logit], loss: binary_cross_entropy}\n"));
  }
}

TEST_CASE("graph: embeddings of pairwise field crosses match finite differences", "[graph]") {
  for (const char* options : {"fields: 0", "fields: 2"}) {
    for (const char* pooling : {"sum", "mean"}) {
      INFO(options << " " << pooling);
      CheckGradients(ParseGraph(std::string("graph:\n"
                                            "  - {name: cat, op: sparse_input, fields: 3}\n"
                                            "  - {name: x, op: cross, inputs: [cat], ") +
                                options +
                                "}\n"
                                "  - {name: wide, op: embedding, inputs: [x], dim: 2, pooling: " +
                                pooling +
                                "}\n"
                                "  - {name: logit, op: linear, inputs: [wide], width: 1}\n"
                                "  - {name: loss, op: loss, inputs: [logit], loss: binary_cross_entropy}\n"));
    }
  }
}

TEST_CASE("graph: field and slice ops over a sparse_input by position match finite differences", "[graph]") {
  const data::Batch ratings = RatingBatch(16, 9);
  CheckGradients(ParseGraph("graph:\n"
                            "  - {name: r, op: sparse_input, fields: 2, by_position: true}\n"
                            "  - {name: u, op: field, inputs: [r]}\n"
                            "  - {name: i, op: field, inputs: [r], index: 1}\n"
                            "  - {name: ue, op: embedding, inputs: [u], dim: 4}\n"
                            "  - {name: ie, op: embedding, inputs: [i], dim: 4}\n"
                            "  - {name: uf, op: slice, inputs: [ue], width: 3}\n"
                            "  - {name: ub, op: slice, inputs: [ue], begin: 3, width: 1}\n"
                            "  - {name: if, op: slice, inputs: [ie], begin: 1, width: 3}\n"
                            "  - {name: dot, op: dot_interaction, inputs: [uf, if]}\n"
                            "  - {name: sum, op: add, inputs: [dot, ub]}\n"
                            "  - {name: loss, op: loss, inputs: [sum], loss: squared_error}\n"),
                 0, 12, &ratings);
  // The same rows, where the same key is a user and an item: two tables.
  auto be = compute::NewCpuBackend(1);
  std::unique_ptr<Model> m =
      MakeModel(be.get(), ParseGraph("graph:\n"
                                     "  - {name: r, op: sparse_input, fields: 2, by_position: true}\n"
                                     "  - {name: u, op: field, inputs: [r]}\n"
                                     "  - {name: i, op: field, inputs: [r], index: 1}\n"
                                     "  - {name: ue, op: embedding, inputs: [u], dim: 1}\n"
                                     "  - {name: ie, op: embedding, inputs: [i], dim: 1}\n"
                                     "  - {name: sum, op: add, inputs: [ue, ie]}\n"
                                     "  - {name: loss, op: loss, inputs: [sum], loss: squared_error}\n"));
  REQUIRE(m->Prepare(ratings).ok());
  REQUIRE(m->tables().size() == 2);
  std::vector<uint64_t> users, items;
  for (size_t b = 0; b < static_cast<size_t>(ratings.size); ++b) {
    users.push_back(ratings.keys[2 * b]);
    items.push_back(ratings.keys[2 * b + 1]);
  }
  for (const auto& [t, want] : {std::pair{0, users}, std::pair{1, items}}) {
    std::vector<uint64_t> distinct;
    for (uint64_t k : want) {
      if (std::find(distinct.begin(), distinct.end(), k) == distinct.end()) distinct.push_back(k);
    }
    CHECK(m->tables()[t].keys == distinct);
  }
  data::Batch three = RatingBatch(16, 9);
  three.keys.insert(three.keys.begin() + 2, 4);  // example 1 gets a third key
  three.values.insert(three.values.begin() + 2, 1.0f);
  for (size_t k = 2; k < three.offsets.size(); ++k) ++three.offsets[k];
  const absl::Status s = m->Prepare(three);
  CHECK(absl::IsInvalidArgument(s));
  CHECK_THAT(std::string(s.message()), Catch::Contains("example 1 of batch 0 has 3 keys; node 'r' takes exactly 2"));
}

TEST_CASE("graph: a cross holds one key per pair of its fields' values", "[graph]") {
  Bags in;
  in.fields = 3;
  // One example: field 0 has keys 10 and 11, field 1 key 20, field 2 none.
  in.offsets = {0, 2, 3, 3};
  in.keys = {10, 11, 20};
  in.values = {1.0f, 0.5f, 2.0f};
  Bags out;
  Cross(in, 1, 3, &out);
  CHECK(out.fields == 3);
  CHECK(out.offsets == std::vector<int32_t>{0, 2, 2, 2});  // (0,1): two keys; (0,2), (1,2): none
  CHECK(out.keys == std::vector<uint64_t>{CrossKey(0, 1, 10, 20), CrossKey(0, 1, 11, 20)});
  CHECK(out.values == std::vector<float>{2.0f, 1.0f});
  CHECK(CrossKey(0, 1, 10, 20) != CrossKey(0, 2, 10, 20));
  CHECK(CrossKey(0, 1, 10, 20) != CrossKey(0, 1, 20, 10));
}

TEST_CASE("graph: concat add mul cross_net dot_interaction and fm match finite differences", "[graph]") {
  const std::string dense =
      "graph:\n"
      "  - {name: x, op: dense_input, width: 5}\n"
      "  - {name: bot, op: linear, inputs: [x], width: 3}\n";
  const std::string inputs = dense +
      "  - {name: cat, op: sparse_input, fields: 3}\n"
      "  - {name: emb, op: embedding, inputs: [cat], dim: 3}\n";
  SECTION("concat of unequal widths") {
    CheckGradients(ParseGraph(inputs + "  - {name: c, op: concat, inputs: [x, emb, bot]}\n"
                                       "  - {name: logit, op: linear, inputs: [c], width: 1}\n"
                                       "  - {name: loss, op: loss, inputs: [logit], loss: binary_cross_entropy}\n"));
  }
  SECTION("add, with a node read twice") {
    CheckGradients(ParseGraph(dense + "  - {name: s, op: add, inputs: [bot, bot]}\n"
                                       "  - {name: t, op: tanh, inputs: [bot]}\n"
                                       "  - {name: u, op: add, inputs: [s, t]}\n"
                                       "  - {name: logit, op: linear, inputs: [u], width: 1}\n"
                                       "  - {name: loss, op: loss, inputs: [logit], loss: binary_cross_entropy}\n"));
  }
  SECTION("mul, of two nodes and of a node by itself") {
    CheckGradients(ParseGraph(dense + "  - {name: t, op: tanh, inputs: [bot]}\n"
                                       "  - {name: m, op: mul, inputs: [bot, t]}\n"
                                       "  - {name: q, op: mul, inputs: [m, m]}\n"
                                       "  - {name: logit, op: linear, inputs: [q], width: 1}\n"
                                       "  - {name: loss, op: loss, inputs: [logit], loss: binary_cross_entropy}\n"));
  }
  SECTION("cross_net, full rank and low rank, over embeddings and a dense layer") {
    CheckGradients(ParseGraph(inputs + "  - {name: x0, op: concat, inputs: [bot, emb]}\n"
                                       "  - {name: c, op: cross_net, inputs: [x0], layers: [0, 2]}\n"
                                       "  - {name: logit, op: linear, inputs: [c], width: 1}\n"
                                       "  - {name: loss, op: loss, inputs: [logit], loss: binary_cross_entropy}\n"));
  }
  SECTION("dot_interaction over two inputs") {
    CheckGradients(ParseGraph(inputs + "  - {name: i, op: dot_interaction, inputs: [bot, emb]}\n"
                                       "  - {name: logit, op: linear, inputs: [i], width: 1}\n"
                                       "  - {name: loss, op: loss, inputs: [logit], loss: binary_cross_entropy}\n"));
  }
  SECTION("fm of one input and of two") {
    CheckGradients(ParseGraph("graph:\n"
                              "  - {name: cat, op: sparse_input, fields: 3}\n"
                              "  - {name: emb, op: embedding, inputs: [cat], dim: 3}\n"
                              "  - {name: f, op: fm, inputs: [emb]}\n"
                                       "  - {name: loss, op: loss, inputs: [f], loss: binary_cross_entropy}\n"));
    CheckGradients(ParseGraph(inputs + "  - {name: f, op: fm, inputs: [emb, bot]}\n"
                                       "  - {name: loss, op: loss, inputs: [f], loss: binary_cross_entropy}\n"));
  }
}

TEST_CASE("graph: softmax cross-entropy and squared error losses match finite differences", "[graph]") {
  CheckGradients(ParseGraph("graph:\n"
                            "  - {name: x, op: dense_input, width: 5}\n"
                            "  - {name: m, op: mlp, inputs: [x], layers: [6, 3]}\n"
                            "  - {name: loss, op: loss, inputs: [m], loss: softmax_cross_entropy}\n"),
                 3);
  CheckGradients(ParseGraph("graph:\n"
                            "  - {name: x, op: dense_input, width: 5}\n"
                            "  - {name: m, op: mlp, inputs: [x], layers: [6, 1], activation: gelu}\n"
                            "  - {name: loss, op: loss, inputs: [m], loss: squared_error}\n"),
                 0);
}

// The examples' model sections, with the widths cut down to the test's data.
v1::ModelSpec Example(const std::string& file) {
  std::ifstream in(std::string(FULCRUM_SOURCE_DIR) + "/deploy/examples/" + file);
  REQUIRE(in.good());
  std::stringstream ss;
  ss << in.rdbuf();
  v1::JobSpec spec;
  const absl::Status s = config::ParseSpecText(ss.str(), file, &spec);
  INFO(s.message());
  REQUIRE(s.ok());
  v1::ModelSpec m = spec.model();
  // Vectors of 4 (1 stays 1), hidden layers of at most 8.
  auto narrow = [](int w) { return w == 1 ? 1 : 4; };
  for (v1::GraphNode& n : *m.mutable_graph()) {
    if (n.op() == "dense_input") n.set_width(kDense);
    if (n.op() == "sparse_input") n.set_fields(kFields);
    if (n.op() == "cross") n.set_fields(std::min(n.fields(), kFields));
    if (n.op() == "linear") n.set_width(narrow(n.width()));
    n.set_dim(n.dim() > 0 ? narrow(n.dim()) : 0);
    for (int l = 0; l < n.layers_size(); ++l) {
      n.set_layers(l, l + 1 < n.layers_size() ? std::min(n.layers(l), 8) : narrow(n.layers(l)));
    }
  }
  return m;
}

TEST_CASE("graph: DLRM and Wide and Deep and DeepFM examples match finite differences", "[graph]") {
  for (const char* file : {"ctr-dlrm.yaml", "ctr-wide-deep.yaml", "ctr-deepfm.yaml"}) {
    INFO(file);
    CheckGradients(Example(file), 2, 6);
  }
}

TEST_CASE("graph: host work done on another thread ahead of Prepare gives the same step as Prepare's own",
          "[graph]") {
  auto be = compute::NewCpuBackend(1);
  std::unique_ptr<Model> m = MakeModel(be.get(), Example("ctr-wide-deep.yaml"));
  auto work = m->HostWork();
  REQUIRE(work != nullptr);
  auto step = [&](const data::Batch& b) {
    REQUIRE(m->Prepare(b).ok());
    for (Table& t : m->tables()) {
      for (size_t i = 0; i < t.elements; ++i) t.value.as<float>()[i] = 0.01f * static_cast<float>(i % 17);
    }
    auto r = m->Run(b, true);
    REQUIRE(r.ok());
    std::vector<float> out{static_cast<float>(r->loss_sum)};
    for (Table& t : m->tables()) out.insert(out.end(), t.grad.as<float>(), t.grad.as<float>() + t.elements);
    return out;
  };
  const data::Batch plain = CtrBatch(24, 13);
  const std::vector<float> want = step(plain);
  data::Batch ahead = CtrBatch(24, 13);
  std::thread([&] { work(&ahead); }).join();
  REQUIRE(ahead.host_work != nullptr);
  // Prepare takes the bags from the host work: rows changed after it are not read again.
  for (uint64_t& k : ahead.keys) k = k >= kDense ? kDense + (k - kDense) % 2 : k;
  CHECK(step(ahead) == want);
  // A batch the work found wrong: its error comes from Prepare.
  data::Batch bad = CtrBatch(4, 1);
  bad.keys.back() = kDense + (uint64_t{kFields} << kFieldBits);
  work(&bad);
  const absl::Status s = m->Prepare(bad);
  CHECK(absl::IsInvalidArgument(s));
  CHECK_THAT(std::string(s.message()), Catch::Contains("of field 3; node 'categorical' has 3 fields"));
}

TEST_CASE("graph: a dense batch feeds a dense_input and a sparse_input needs sparse rows", "[graph]") {
  auto be = compute::NewCpuBackend(1);
  std::unique_ptr<Model> m = MakeModel(be.get(), ParseGraph(Around("relu")));
  data::Batch dense;
  dense.size = 2;
  dense.num_features = 5;
  dense.dense = {1, 2, 3, 4, 5, 5, 4, 3, 2, 1};
  dense.labels = {0, 1};
  REQUIRE(m->Prepare(dense).ok());
  for (Table& t : m->tables()) std::fill(t.value.as<float>(), t.value.as<float>() + t.elements, 0.1f);
  auto r = m->Run(dense, true);
  REQUIRE(r.ok());
  CHECK(r->scores.size() == 2);
  dense.num_features = 4;
  dense.dense.resize(8);
  const absl::Status wrong = m->Prepare(dense);
  CHECK(absl::IsInvalidArgument(wrong));
  CHECK_THAT(std::string(wrong.message()), Catch::Contains("node 'x' has width 5 but the batch has 4 features"));

  std::unique_ptr<Model> sparse = MakeModel(
      be.get(), ParseGraph("graph:\n"
                           "  - {name: cat, op: sparse_input, fields: 3}\n"
                           "  - {name: emb, op: embedding, inputs: [cat], dim: 2, sum_fields: true}\n"
                           "  - {name: logit, op: linear, inputs: [emb], width: 1}\n"
                           "  - {name: loss, op: loss, inputs: [logit], loss: binary_cross_entropy}\n"));
  const absl::Status s = sparse->Prepare(dense);
  CHECK_THAT(std::string(s.message()), Catch::Contains("node 'cat' reads categorical fields, but the batch is dense"));
  data::Batch far = CtrBatch(2, 1);
  far.keys.push_back(kDense + (uint64_t{5} << kFieldBits));
  far.values.push_back(1);
  far.offsets.back() += 1;
  const absl::Status f = sparse->Prepare(far);
  CHECK_THAT(std::string(f.message()), Catch::Contains("of field 5; node 'cat' has 3 fields"));
}

TEST_CASE("graph: tables are named after their nodes with the kinds they need", "[graph]") {
  auto be = compute::NewCpuBackend(1);
  std::unique_ptr<Model> m = MakeModel(be.get(), Example("ctr-dlrm.yaml"));
  std::vector<std::string> names;
  int sparse = 0;
  for (Table& t : m->tables()) {
    names.push_back(t.spec.name());
    sparse += t.sparse;
  }
  CHECK(sparse == 1);
  CHECK(std::find(names.begin(), names.end(), "bottom.linear0.weight") != names.end());
  CHECK(std::find(names.begin(), names.end(), "top.bias") != names.end());
  CHECK(m->task() == Task::kBinary);
}

// One training step of ctr-dlrm.yaml on `b` at `precision`, on weights drawn
// from seed 4 (scaled by `scale`); each table's gradient.
std::vector<std::vector<float>> DlrmGradients(compute::Backend* be, const data::Batch& b, DType precision,
                                              float scale = 1, Metrics* metrics = nullptr) {
  ModelConfig c;
  c.type = "graph";
  c.graph = Example("ctr-dlrm.yaml");
  c.dense_keys = kDense;
  c.field_bits = kFieldBits;
  c.precision = precision;
  auto m = CreateModel(c, be);
  REQUIRE(m.ok());
  REQUIRE((*m)->Prepare(b).ok());
  std::mt19937 rng(4);
  std::normal_distribution<float> n(0, 0.1f * scale);
  for (Table& t : (*m)->tables()) {
    for (size_t i = 0; i < t.elements; ++i) t.value.as<float>()[i] = n(rng);
  }
  auto r = (*m)->Run(b, true);
  REQUIRE(r.ok());
  if (metrics != nullptr) *metrics = *r;
  std::vector<std::vector<float>> grads;
  for (Table& t : (*m)->tables()) grads.emplace_back(t.grad.as<float>(), t.grad.as<float>() + t.elements);
  return grads;
}

TEST_CASE("graph: bf16 and fp16 GEMMs give gradients within their precision of fp32's", "[graph]") {
  auto be = compute::NewCpuBackend(1);
  const data::Batch b = CtrBatch(64, 9);
  const auto exact = DlrmGradients(be.get(), b, DType::kFp32);
  for (const auto& [precision, bound] : {std::pair{DType::kBf16, 3e-2}, std::pair{DType::kFp16, 4e-3}}) {
    Metrics m;
    const auto lowp = DlrmGradients(be.get(), b, precision, 1, &m);
    CHECK_FALSE(m.skipped);
    CHECK(m.loss_scale == (precision == DType::kFp16 ? 65536.0f : 1.0f));
    bool differs = false;
    for (size_t t = 0; t < exact.size(); ++t) {
      double num = 0, den = 0;
      for (size_t i = 0; i < exact[t].size(); ++i) {
        num += (lowp[t][i] - exact[t][i]) * (lowp[t][i] - exact[t][i]);
        den += exact[t][i] * exact[t][i];
      }
      INFO(DTypeName(precision) << " table " << t << ": relative L2 difference " << std::sqrt(num / std::max(den, 1e-30)));
      CHECK(std::sqrt(num / std::max(den, 1e-30)) < bound);
      differs |= num > 0;
    }
    CHECK(differs);  // the 16-bit path ran (and fp16's gradients were unscaled, or they would be 65536x)
  }
}

TEST_CASE("graph: an fp16 step whose gradients overflow is skipped with zero gradients and a halved loss scale",
          "[graph]") {
  auto be = compute::NewCpuBackend(1);
  ModelConfig c;
  c.type = "graph";
  c.graph = Example("ctr-dlrm.yaml");
  c.dense_keys = kDense;
  c.field_bits = kFieldBits;
  c.precision = DType::kFp16;
  auto m = CreateModel(c, be.get());
  REQUIRE(m.ok());
  const data::Batch b = CtrBatch(64, 9);
  REQUIRE((*m)->Prepare(b).ok());
  // Weights of 300 make activations past fp16's 65504: the step overflows.
  for (Table& t : (*m)->tables()) {
    for (size_t i = 0; i < t.elements; ++i) t.value.as<float>()[i] = 300.0f;
  }
  auto first = (*m)->Run(b, true);
  REQUIRE(first.ok());
  CHECK(first->skipped);
  CHECK(first->loss_scale == 65536.0f);
  for (Table& t : (*m)->tables()) {
    CHECK(std::all_of(t.grad.as<float>(), t.grad.as<float>() + t.elements, [](float g) { return g == 0; }));
  }
  REQUIRE((*m)->Prepare(b).ok());
  auto second = (*m)->Run(b, true);
  REQUIRE(second.ok());
  CHECK(second->loss_scale == 32768.0f);
}

TEST_CASE("graph: the softmax and mlp presets give bit-identical gradients and weights to the built-in models",
          "[graph]") {
  auto be = compute::NewCpuBackend(1);
  std::mt19937 rng(12);
  std::normal_distribution<float> n(0, 1);
  data::Batch b;
  b.size = 32;
  b.num_features = 20;
  for (int i = 0; i < 32 * 20; ++i) b.dense.push_back(n(rng));
  for (int i = 0; i < 32; ++i) b.labels.push_back(static_cast<float>(i % 5));
  for (const char* act : {"relu", "gelu"}) {
    for (const char* type : {"softmax", "mlp"}) {
      INFO(type << " " << act);
      v1::ModelSpec spec;
      spec.set_type(type);
      spec.set_activation(act);
      if (std::string(type) == "mlp") {
        spec.add_hidden(16);
        spec.add_hidden(8);
      }
      ModelConfig builtin;
      builtin.type = type;
      builtin.num_features = 20;
      builtin.num_classes = 5;
      builtin.hidden.assign(spec.hidden().begin(), spec.hidden().end());
      builtin.activation = std::string(act) == "gelu" ? compute::Activation::kGelu : compute::Activation::kRelu;
      auto preset = config::PresetGraph(spec, 20, 5);
      REQUIRE(preset.ok());
      ModelConfig graph;
      graph.type = "graph";
      graph.graph = *preset;
      auto a = CreateModel(builtin, be.get());
      auto g = CreateModel(graph, be.get());
      REQUIRE(a.ok());
      INFO(g.status().message());
      REQUIRE(g.ok());
      REQUIRE((*a)->tables().size() == (*g)->tables().size());
      REQUIRE((*a)->Prepare(b).ok());
      REQUIRE((*g)->Prepare(b).ok());
      for (size_t t = 0; t < (*a)->tables().size(); ++t) {
        Table& x = (*a)->tables()[t];
        Table& y = (*g)->tables()[t];
        REQUIRE(x.spec.name() == y.spec.name());
        REQUIRE(x.elements == y.elements);
        for (size_t i = 0; i < x.elements; ++i) x.value.as<float>()[i] = y.value.as<float>()[i] = 0.3f * n(rng);
      }
      // Three SGD steps each: the same weights to the bit.
      for (int step = 0; step < 3; ++step) {
        REQUIRE((*a)->Run(b, true).ok());
        REQUIRE((*g)->Run(b, true).ok());
        for (size_t t = 0; t < (*a)->tables().size(); ++t) {
          Table& x = (*a)->tables()[t];
          Table& y = (*g)->tables()[t];
          CHECK(std::memcmp(x.grad.data(), y.grad.data(), x.elements * 4) == 0);
          for (size_t i = 0; i < x.elements; ++i) {
            x.value.as<float>()[i] -= 0.1f * x.grad.as<float>()[i];
            y.value.as<float>()[i] -= 0.1f * y.grad.as<float>()[i];
          }
          CHECK(std::memcmp(x.value.data(), y.value.data(), x.elements * 4) == 0);
        }
      }
    }
  }
}

// Each key's row of sparse table `t`.
std::map<uint64_t, std::vector<float>> Rows(const Table& t, bool grad) {
  std::map<uint64_t, std::vector<float>> out;
  const float* base = (grad ? t.grad : t.value).as<float>();
  for (size_t k = 0; k < t.keys.size(); ++k) out[t.keys[k]].assign(base + k * t.dim, base + (k + 1) * t.dim);
  return out;
}

// The built-in sparse model `type` (factors 4) and its preset graph on
// the same weights, three SGD steps: the loss, scores and every table's
// gradient bit for bit, sparse rows key by key.
void CheckPresetMatchesBuiltin(const std::string& type, const data::Batch& b, size_t tables, float scale) {
  INFO(type);
  auto be = compute::NewCpuBackend(1);
  std::mt19937 rng(31);
  std::normal_distribution<float> n(0, 1);
  v1::ModelSpec spec;
  spec.set_type(type);
  spec.set_factors(4);
  auto preset = config::PresetGraph(spec, 0, 2);
  INFO(preset.status().message());
  REQUIRE(preset.ok());
  ModelConfig builtin;
  builtin.type = type;
  builtin.factors = 4;
  ModelConfig graph;
  graph.type = "graph";
  graph.graph = *preset;
  auto a = CreateModel(builtin, be.get());
  auto g = CreateModel(graph, be.get());
  INFO(g.status().message());
  REQUIRE((a.ok() && g.ok()));
  CHECK((*g)->task() == (*a)->task());
  REQUIRE((*a)->tables().size() == tables);
  REQUIRE((*g)->tables().size() == tables);
  // The weights of both: sparse rows by (table, key), the dense bias.
  std::map<std::pair<size_t, uint64_t>, std::vector<float>> w;
  float bias = 0.25f;
  for (int step = 0; step < 3; ++step) {
    REQUIRE((*a)->Prepare(b).ok());
    REQUIRE((*g)->Prepare(b).ok());
    for (auto* m : {&**a, &**g}) {
      for (size_t t = 0; t < tables; ++t) {
        Table& x = m->tables()[t];
        REQUIRE(x.spec.name() == (*a)->tables()[t].spec.name());
        REQUIRE(x.dim == (*a)->tables()[t].dim);
        if (!x.sparse) {
          x.value.as<float>()[0] = bias;
          continue;
        }
        for (size_t k = 0; k < x.keys.size(); ++k) {
          std::vector<float>& row = w[{t, x.keys[k]}];
          while (row.size() < x.dim) row.push_back(scale * n(rng));
          std::copy(row.begin(), row.end(), x.value.as<float>() + k * x.dim);
        }
      }
    }
    auto ra = (*a)->Run(b, true);
    auto rg = (*g)->Run(b, true);
    REQUIRE((ra.ok() && rg.ok()));
    CHECK(ra->loss_sum == rg->loss_sum);
    CHECK(ra->scores == rg->scores);
    for (size_t t = 0; t < tables; ++t) {
      Table& x = (*a)->tables()[t];
      INFO("step " << step << " table " << x.spec.name());
      if (!x.sparse) {
        CHECK(std::memcmp(x.grad.data(), (*g)->tables()[t].grad.data(), 4) == 0);
        bias -= 0.5f * x.grad.as<float>()[0];
        continue;
      }
      const auto ga = Rows(x, true);
      CHECK(ga == Rows((*g)->tables()[t], true));
      for (const auto& [key, row] : ga) {  // one SGD step on the shared weights
        for (size_t d = 0; d < row.size(); ++d) w[{t, key}][d] -= 0.5f * row[d];
      }
    }
  }
}

TEST_CASE("graph: the sparse_lr and fm and mf presets give bit-identical gradients and weights to the built-in models",
          "[graph]") {
  std::mt19937 rng(31);
  std::normal_distribution<float> n(0, 1);
  data::Batch b;  // LibSVM rows: 1 to 12 features of 200, with values
  b.size = 48;
  b.offsets.push_back(0);
  for (int i = 0; i < b.size; ++i) {
    const int features = 1 + static_cast<int>(rng() % 12);
    for (int f = 0; f < features; ++f) {
      b.keys.push_back(rng() % 200);
      b.values.push_back(n(rng));
    }
    b.offsets.push_back(static_cast<int32_t>(b.keys.size()));
    b.labels.push_back(static_cast<float>(rng() % 2));
  }
  CheckPresetMatchesBuiltin("sparse_lr", b, 2, 0.1f);
  CheckPresetMatchesBuiltin("fm", b, 3, 0.1f);
  CheckPresetMatchesBuiltin("mf", RatingBatch(40, 41), 3, 0.3f);  // user, item: k factors and the bias; global_bias

  v1::ModelSpec spec;
  spec.set_type("mf");
  spec.set_factors(4);
  auto preset = config::PresetGraph(spec, 0, 0);
  REQUIRE(preset.ok());
  // tests/gpu/graph_mf.yaml, which the torch cross-check runs, is this preset.
  v1::JobSpec file;
  REQUIRE(config::ParseSpecFile(std::string(FULCRUM_SOURCE_DIR) + "/tests/gpu/graph_mf.yaml", &file).ok());
  CHECK(file.model().SerializeAsString() == preset->SerializeAsString());
  spec.set_type("dlrm");
  CHECK(absl::IsInvalidArgument(config::PresetGraph(spec, 0, 0).status()));
}

}  // namespace
}  // namespace fulcrum::models
