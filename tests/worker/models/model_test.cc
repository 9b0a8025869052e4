// Every model's backward pass against central finite differences of its
// forward pass, on the CPU backend; and the model contract (tables, keys,
// errors).
#include <cmath>
#include <random>
#include <set>
#include <vector>

#include <catch2/catch.hpp>

#include "tests/testing/test_util.h"
#include "worker/models/model.h"

namespace fulcrum::models {
namespace {

using compute::Activation;

data::Batch DenseBatch(int B, int features, int classes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0, 1);
  data::Batch b;
  b.size = B;
  b.num_features = features;
  b.dense.resize(size_t{1} * B * features);
  for (auto& x : b.dense) x = n(rng);
  for (int i = 0; i < B; ++i) b.labels.push_back(static_cast<float>(rng() % classes));
  return b;
}

// Sparse examples over a small key space so keys repeat within the batch.
data::Batch SparseBatch(int B, uint32_t seed, bool binary = true) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(0.2f, 1.5f);
  data::Batch b;
  b.size = B;
  b.offsets.push_back(0);
  for (int i = 0; i < B; ++i) {
    const int nnz = 1 + rng() % 4;
    uint64_t key = rng() % 3;
    for (int j = 0; j < nnz; ++j) {
      b.keys.push_back(1000 + key);
      b.values.push_back(u(rng));
      key += 1 + rng() % 3;
    }
    b.offsets.push_back(static_cast<int32_t>(b.keys.size()));
    b.labels.push_back(binary ? static_cast<float>(rng() % 2) : u(rng) * 3);
  }
  return b;
}

data::Batch RatingsBatch(int B, uint32_t seed) {
  std::mt19937 rng(seed);
  data::Batch b;
  b.size = B;
  b.offsets.push_back(0);
  for (int i = 0; i < B; ++i) {
    b.keys.push_back(rng() % 3);        // user (repeats)
    b.keys.push_back(100 + rng() % 3);  // item (repeats)
    b.values.push_back(1);
    b.values.push_back(1);
    b.offsets.push_back(static_cast<int32_t>(b.keys.size()));
    b.labels.push_back(1.0f + rng() % 5);
  }
  return b;
}

// Fills every table with small random values (CPU memory is host memory).
void RandomValues(Model& m, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0, scale);
  for (Table& t : m.tables()) {
    float* v = t.value.as<float>();
    for (size_t i = 0; i < t.elements; ++i) v[i] = n(rng);
  }
}

double MeanLoss(Model& m, const data::Batch& b) {
  auto r = m.Run(b, /*train=*/false);
  REQUIRE(r.ok());
  return r->loss_sum / b.size;
}

// Central differences of the mean loss against the analytic gradient, for
// every parameter. The forward runs in fp32, so eps is 1e-2 (truncation
// error ~eps^2 * f''' is below 1e-4 here) and the tolerance is checked two
// ways: relative 2e-2 or absolute 2e-4, whichever is looser.
void CheckGradients(Model& m, const data::Batch& b) {
  REQUIRE_OK(m.Prepare(b));
  RandomValues(m, 42, 0.5f);
  auto r = m.Run(b, /*train=*/true);
  REQUIRE_OK(r.status());
  std::vector<std::vector<float>> grads;
  for (Table& t : m.tables()) grads.emplace_back(t.grad.as<float>(), t.grad.as<float>() + t.elements);
  const double eps = 1e-2;
  int checked = 0;
  for (size_t ti = 0; ti < m.tables().size(); ++ti) {
    Table& t = m.tables()[ti];
    REQUIRE(t.elements > 0);
    for (size_t i = 0; i < t.elements; ++i) {
      float* v = t.value.as<float>() + i;
      const float saved = *v;
      *v = saved + eps;
      const double up = MeanLoss(m, b);
      *v = saved - eps;
      const double down = MeanLoss(m, b);
      *v = saved;
      const double numeric = (up - down) / (2 * eps);
      INFO("table " << t.spec.name() << " element " << i);
      REQUIRE(grads[ti][i] == Approx(numeric).epsilon(2e-2).margin(2e-4));
      ++checked;
    }
  }
  REQUIRE(checked > 0);
}

std::unique_ptr<compute::Backend> Cpu() { return compute::NewCpuBackend(1); }

TEST_CASE("softmax regression gradients match finite differences") {
  auto be = Cpu();
  ModelConfig c;
  c.type = "softmax";
  c.num_features = 6;
  c.num_classes = 4;
  REQUIRE_OK_AND_ASSIGN(auto m, CreateModel(c, be.get()));
  REQUIRE(m->tables().size() == 2);
  REQUIRE(m->tables()[0].spec.shape(0) == 6);
  REQUIRE(m->tables()[0].spec.shape(1) == 4);
  CheckGradients(*m, DenseBatch(5, 6, 4, 1));
}

TEST_CASE("MLP gradients match finite differences (ReLU and GELU, two hidden layers)") {
  for (Activation a : {Activation::kRelu, Activation::kGelu}) {
    auto be = Cpu();
    ModelConfig c;
    c.type = "mlp";
    c.num_features = 5;
    c.num_classes = 3;
    c.hidden = {7, 4};
    c.activation = a;
    REQUIRE_OK_AND_ASSIGN(auto m, CreateModel(c, be.get()));
    REQUIRE(m->tables().size() == 6);
    CheckGradients(*m, DenseBatch(4, 5, 3, 2));
  }
}

TEST_CASE("sparse logistic regression gradients match finite differences, duplicate keys included") {
  auto be = Cpu();
  ModelConfig c;
  c.type = "sparse_lr";
  REQUIRE_OK_AND_ASSIGN(auto m, CreateModel(c, be.get()));
  data::Batch b = SparseBatch(6, 3);
  CheckGradients(*m, b);
  // Keys are distinct and cover the batch.
  std::set<uint64_t> distinct(b.keys.begin(), b.keys.end());
  REQUIRE(m->tables()[0].keys.size() == distinct.size());
  REQUIRE(m->tables()[0].keys.size() < b.keys.size());  // the batch did repeat keys
}

TEST_CASE("factorization machine gradients match finite differences") {
  auto be = Cpu();
  ModelConfig c;
  c.type = "fm";
  c.factors = 3;
  REQUIRE_OK_AND_ASSIGN(auto m, CreateModel(c, be.get()));
  REQUIRE(m->tables().size() == 3);
  CheckGradients(*m, SparseBatch(5, 4));
}

TEST_CASE("a model's admission and eviction go into each of its sparse tables' specs, none into dense ones") {
  auto be = Cpu();
  for (const std::string type : {"fm", "mf", "sparse_lr"}) {
    INFO(type);
    ModelConfig c;
    c.type = type;
    c.lifecycle.mutable_admission()->set_min_count(2);
    c.lifecycle.mutable_eviction()->set_max_rows(1000);
    REQUIRE_OK_AND_ASSIGN(auto m, CreateModel(c, be.get()));
    int sparse = 0;
    for (const auto& t : m->tables()) {
      CHECK(t.spec.has_admission() == t.sparse);
      CHECK(t.spec.eviction().max_rows() == (t.sparse ? 1000u : 0u));
      sparse += t.sparse;
    }
    CHECK(sparse >= 1);
  }
}

TEST_CASE("matrix factorization gradients match finite differences") {
  auto be = Cpu();
  ModelConfig c;
  c.type = "mf";
  c.factors = 2;
  REQUIRE_OK_AND_ASSIGN(auto m, CreateModel(c, be.get()));
  CheckGradients(*m, RatingsBatch(6, 5));
}

TEST_CASE("bf16 and fp16 GEMMs give gradients close to fp32's") {
  auto be = Cpu();
  ModelConfig c;
  c.type = "mlp";
  c.num_features = 32;
  c.num_classes = 10;
  c.hidden = {64};
  data::Batch b = DenseBatch(16, 32, 10, 6);
  std::vector<std::vector<float>> ref;
  for (DType p : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    c.precision = p;
    REQUIRE_OK_AND_ASSIGN(auto m, CreateModel(c, be.get()));
    REQUIRE_OK(m->Prepare(b));
    RandomValues(*m, 7, 0.2f);
    REQUIRE_OK_AND_ASSIGN(Metrics r, m->Run(b, true));
    REQUIRE_FALSE(r.skipped);
    for (size_t ti = 0; ti < m->tables().size(); ++ti) {
      Table& t = m->tables()[ti];
      std::vector<float> g(t.grad.as<float>(), t.grad.as<float>() + t.elements);
      if (p == DType::kFp32) {
        ref.push_back(g);
        continue;
      }
      // Relative error of the whole gradient (L2): bf16 has 8 mantissa bits, fp16 11.
      double num = 0, den = 0;
      for (size_t i = 0; i < g.size(); ++i) {
        num += (g[i] - ref[ti][i]) * (g[i] - ref[ti][i]);
        den += ref[ti][i] * ref[ti][i];
      }
      INFO(DTypeName(p) << " table " << t.spec.name());
      REQUIRE(std::sqrt(num / den) < (p == DType::kBf16 ? 2e-2 : 3e-3));
    }
  }
}

TEST_CASE("fp16 loss scaling skips a step whose gradients overflow and halves the scale") {
  auto be = Cpu();
  ModelConfig c;
  c.type = "softmax";
  c.num_features = 4;
  c.num_classes = 2;
  c.precision = DType::kFp16;
  REQUIRE_OK_AND_ASSIGN(auto m, CreateModel(c, be.get()));
  // One example the model gets confidently wrong: dlogits = 65536 * (p - 1)
  // rounds to -Inf when cast to fp16 for the weight-gradient GEMM.
  data::Batch b = DenseBatch(1, 4, 2, 8);
  REQUIRE_OK(m->Prepare(b));
  for (Table& t : m->tables()) std::fill(t.value.as<float>(), t.value.as<float>() + t.elements, 0.0f);
  m->tables()[1].value.as<float>()[static_cast<int>(b.labels[0])] = -100.0f;
  REQUIRE_OK_AND_ASSIGN(Metrics r1, m->Run(b, true));
  REQUIRE(r1.skipped);
  for (Table& t : m->tables()) {
    for (size_t i = 0; i < t.elements; ++i) REQUIRE(t.grad.as<float>()[i] == 0.0f);
  }
  REQUIRE_OK_AND_ASSIGN(Metrics r2, m->Run(b, true));
  REQUIRE(r2.loss_scale == r1.loss_scale / 2);
}

TEST_CASE("bad model configs and batches name what is wrong") {
  auto be = Cpu();
  ModelConfig c;
  c.type = "transformer";
  REQUIRE_STATUS(CreateModel(c, be.get()).status(), absl::StatusCode::kInvalidArgument, "allowed: softmax, mlp");
  c.type = "mlp";
  c.num_features = 4;
  c.num_classes = 3;
  REQUIRE_STATUS(CreateModel(c, be.get()).status(), absl::StatusCode::kInvalidArgument, "hidden");
  c.hidden = {8, 0};
  REQUIRE_STATUS(CreateModel(c, be.get()).status(), absl::StatusCode::kInvalidArgument, "hidden[1]");
  c.hidden = {8};
  REQUIRE_OK_AND_ASSIGN(auto m, CreateModel(c, be.get()));
  data::Batch b = DenseBatch(3, 4, 3, 1);
  b.labels[2] = 7;
  REQUIRE_OK(m->Prepare(b));
  REQUIRE_STATUS(m->Run(b, true).status(), absl::StatusCode::kInvalidArgument, "example 2");
  data::Batch wide = DenseBatch(3, 5, 3, 1);
  REQUIRE_STATUS(m->Run(wide, true).status(), absl::StatusCode::kInvalidArgument, "expects dense examples of 4 features");

  c.type = "mf";
  REQUIRE_OK_AND_ASSIGN(auto mf, CreateModel(c, be.get()));
  data::Batch r = RatingsBatch(3, 1);
  r.offsets[3] = r.offsets[2] + 1;  // the last example has one feature
  r.keys.pop_back();
  r.values.pop_back();
  REQUIRE_STATUS(mf->Prepare(r), absl::StatusCode::kInvalidArgument, "example 2");
}

TEST_CASE("DistinctKeys keeps first-seen order and indexes every key") {
  std::vector<uint64_t> keys = {5, 3, 5, 9, 3}, d;
  std::vector<int32_t> idx;
  DistinctKeys(keys.data(), keys.size(), &d, &idx);
  REQUIRE(d == std::vector<uint64_t>{5, 3, 9});
  REQUIRE(idx == std::vector<int32_t>{0, 1, 0, 2, 1});
}

}  // namespace
}  // namespace fulcrum::models
