// What a worker makes of a job's data before it trains (worker/setup/
// job_data.h): data paths from job specs (which arrive over the network)
// stay inside the worker's data roots (relative paths, absolute paths, "..",
// and symlinks that lead out); the label column the spec names (counted
// from 0, the first included), the summary it logs and reports, and classes
// that disagree with the model; the model's configuration from the data.
#include "worker/setup/job_data.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include <catch2/catch.hpp>

#include "common/config/job_spec.h"
#include "common/config/model_graph.h"
#include "tests/testing/process_util.h"
#include "worker/compute/backend.h"
#include "worker/models/graph_model.h"
#include "worker/models/model.h"
#include "worker/training/trainer.h"

namespace fulcrum {
namespace {

namespace fs = std::filesystem;

TEST_CASE("data paths resolve only inside the worker's data roots", "[data][security]") {
  const fs::path base = testing::MakeTempDir("fulcrum-roots");
  const fs::path root = base / "data", other = base / "more", outside = base / "secret";
  fs::create_directories(root / "mnist");
  fs::create_directories(other);
  fs::create_directories(outside);
  std::ofstream(root / "mnist" / "train.csv") << "0.5,1\n0.25,0\n";
  std::ofstream(other / "x.csv") << "0.5,1\n";
  std::ofstream(outside / "s.csv") << "0.5,1\n";
  fs::create_symlink(outside, root / "escape");
  const std::vector<std::string> one = {root.string()}, two = {root.string(), other.string()};

  auto ok = ConfinedDataPath("mnist/train.csv", root.string(), one);
  REQUIRE(ok.ok());
  REQUIRE(*ok == (fs::canonical(root) / "mnist" / "train.csv").string());
  REQUIRE(ConfinedDataPath((root / "mnist/train.csv").string(), root.string(), one).ok());  // absolute, inside

  for (const std::string& bad : {std::string("../secret/s.csv"), (outside / "s.csv").string(),
                                 std::string("escape/s.csv"), std::string("/etc/passwd"),
                                 std::string("mnist/../../secret/s.csv")}) {
    auto r = ConfinedDataPath(bad, root.string(), one);
    INFO(bad << " -> " << r.status());
    REQUIRE(r.status().code() == absl::StatusCode::kPermissionDenied);
    REQUIRE(r.status().message().find("outside this worker's data roots (" + root.string() + ")") !=
            std::string::npos);
  }
  // A root's name as a prefix of a sibling is not inside it.
  fs::create_directories(base / "data2");
  std::ofstream(base / "data2" / "y.csv") << "0.5,1\n";
  REQUIRE_FALSE(ConfinedDataPath((base / "data2" / "y.csv").string(), root.string(), one).ok());
  // A second root.
  REQUIRE(ConfinedDataPath((other / "x.csv").string(), root.string(), two).ok());

  // LoadDataSource refuses before opening anything; without roots (the
  // local tool) the same path loads.
  v1::DataSource src;
  src.set_format("csv");
  src.set_path((outside / "s.csv").string());
  auto refused = LoadDataSource(src, root.string(), &one);
  REQUIRE(refused.status().code() == absl::StatusCode::kPermissionDenied);
  auto loaded = LoadDataSource(src, root.string(), nullptr);
  INFO(loaded.status());
  REQUIRE(loaded.ok());
  src.set_path("mnist/train.csv");
  auto inside = LoadDataSource(src, root.string(), &one);
  REQUIRE(inside.ok());
  REQUIRE((*inside)->size() == 2);
  fs::remove_all(base);
}


// Three rows whose first column is a class of 0-3 and whose last is a class
// of 0-1: reading the wrong one gives other labels and another class count.
constexpr char kLabelFirst[] = "3,0.5,0.25,1\n0,0.75,0.5,0\n2,0.25,1,1\n";

TEST_CASE("label_column 0 reads the first column, unset and -1 read the last", "[data]") {
  const fs::path dir = testing::MakeTempDir("fulcrum-label-column");
  std::ofstream(dir / "a.csv") << kLabelFirst;
  v1::DataSource src;
  src.set_format("csv");
  src.set_path("a.csv");

  src.set_label_column(0);
  auto first = LoadDataSource(src, dir.string(), nullptr);
  REQUIRE(first.ok());
  CHECK((*first)->label(0) == 3);
  CHECK((*first)->label(1) == 0);
  CHECK((*first)->label(2) == 2);
  CHECK((*first)->num_classes() == 4);
  v1::DataSummary s = SummarizeData(src, **first);
  CHECK(s.label_column() == 0);
  CHECK(s.examples() == 3);
  CHECK(s.features() == 3);
  CHECK(s.classes() == 4);
  CHECK(s.label_kind() == "class");

  for (int column : {-2, -1}) {  // -2: the field unset
    if (column == -2) {
      src.clear_label_column();
    } else {
      src.set_label_column(column);
    }
    auto last = LoadDataSource(src, dir.string(), nullptr);
    REQUIRE(last.ok());
    CHECK((*last)->label(0) == 1);
    CHECK((*last)->num_classes() == 2);
    CHECK(SummarizeData(src, **last).label_column() == 3);
  }

  src.set_label_column(4);
  auto missing = LoadDataSource(src, dir.string(), nullptr);
  REQUIRE(missing.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(missing.status().message().find("label_column 4 does not exist: rows have 4 columns, 0 to 3") !=
        std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("classes in the data that disagree with the model's are refused, naming the column", "[data]") {
  v1::JobSpec spec;
  spec.mutable_model()->set_type("softmax");
  models::ModelConfig mc;
  mc.type = "softmax";
  v1::DataSummary train;
  train.set_source("letters.csv");
  train.set_label_kind("class");
  train.set_classes(16);
  train.set_label_column(16);

  // The model's count from the data: nothing to disagree with.
  mc.num_classes = 16;
  CHECK(CheckClasses(spec, mc, train, nullptr).ok());
  // The spec says 26; the column read gives 16.
  spec.mutable_model()->set_num_classes(26);
  mc.num_classes = 26;
  absl::Status s = CheckClasses(spec, mc, train, nullptr);
  REQUIRE(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.message().find("data.train (letters.csv, labels in column 16 counted from 0) has labels 0 to 15 (16 "
                         "classes), but model.num_classes is 26") != std::string::npos);
  CHECK(s.message().find("data.train.label_column (counted from 0") != std::string::npos);
  train.set_classes(26);
  CHECK(CheckClasses(spec, mc, train, nullptr).ok());

  // Test labels beyond the model's classes; fewer are fine (a small test set).
  v1::DataSummary test = train;
  test.set_source("letters-test.csv");
  test.set_classes(30);
  s = CheckClasses(spec, mc, train, &test);
  REQUIRE(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(s.message().find("data.test (letters-test.csv, labels in column 16 counted from 0) has labels up to 29, "
                         "beyond the model's 26 classes") != std::string::npos);
  test.set_classes(20);
  CHECK(CheckClasses(spec, mc, train, &test).ok());

  // Models without classes are not checked.
  mc.type = "mf";
  test.set_classes(30);
  CHECK(CheckClasses(spec, mc, train, &test).ok());
}

TEST_CASE("a graph reading libsvm rows by position takes their keys as fields, and no other format", "[data]") {
  const fs::path dir = testing::MakeTempDir("fulcrum-by-position");
  std::ofstream(dir / "r.svm") << "4.5 3:1 1007:1\n2 1:1 1007:1\n3 3:1 1002:1\n";  // user, then item
  v1::JobSpec spec;
  spec.mutable_model()->set_type("mf");
  spec.mutable_model()->set_factors(3);
  auto graph = config::PresetGraph(spec.model(), 0, 0);
  REQUIRE(graph.ok());
  *spec.mutable_model() = *graph;
  spec.mutable_data()->mutable_train()->set_format("libsvm");
  spec.mutable_data()->mutable_train()->set_path("r.svm");
  spec.mutable_data()->mutable_train()->set_label_kind("real");
  auto data = LoadDataSource(spec.data().train(), dir.string(), nullptr);
  INFO(data.status().message());
  REQUIRE(data.ok());
  auto mc = ModelConfigFor(spec, **data);
  INFO(mc.status().message());
  REQUIRE(mc.ok());
  CHECK(mc->dense_keys == 0);
  // The setup built the graph, once: the model takes that one, not the
  // proto (here emptied, which would not build).
  REQUIRE(mc->built_graph != nullptr);
  CHECK(mc->built_graph->nodes.size() == static_cast<size_t>(spec.model().graph_size()));
  {
    models::ModelConfig taken = *mc;
    taken.graph.clear_graph();
    CHECK_FALSE(config::BuildModelGraph(taken.graph).ok());
    std::unique_ptr<compute::Backend> cpu = compute::NewCpuBackend(1);
    auto model = models::CreateGraphModel(taken, cpu.get());
    INFO(model.status().message());
    CHECK(model.ok());
  }
  // A sparse_input of two fields without by_position: libsvm rows have one.
  spec.mutable_model()->mutable_graph(0)->set_by_position(false);
  mc = ModelConfigFor(spec, **data);
  REQUIRE(mc.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(mc.status().message().find("node 'rating': 2 fields, but libsvm rows have one") != std::string::npos);
  spec.mutable_model()->mutable_graph(0)->set_by_position(true);
  spec.mutable_data()->mutable_train()->set_format("criteo");
  mc = ModelConfigFor(spec, **data);
  REQUIRE(mc.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(mc.status().message().find("by_position takes the keys of libsvm rows") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("a criteo source is summarized as its 39 fields, whatever its hash_bits", "[data]") {
  const fs::path dir = testing::MakeTempDir("fulcrum-criteo-summary");
  std::string row = "1";
  for (int i = 0; i < 13; ++i) row += "\t" + std::to_string(i);
  for (int i = 0; i < 26; ++i) row += "\t68fd1e64";
  std::ofstream(dir / "c.txt") << row << "\n" << row << "\n";
  v1::DataSource src;
  src.set_format("criteo");
  src.set_path("c.txt");
  src.set_hash_bits(32);
  auto data = LoadDataSource(src, dir.string(), nullptr);
  INFO(data.status().message());
  REQUIRE(data.ok());
  const v1::DataSummary summary = SummarizeData(src, **data);
  CHECK(summary.features() == 39);
  CHECK(config::DataSummaryLine(summary).find("2 examples, 39 features, binary labels") != std::string::npos);
  fs::remove_all(dir);
}

TEST_CASE("rank 0 resuming at the end of an epoch evaluates that epoch first, so no epoch stays untested",
          "[data]") {
  constexpr uint64_t kSpe = 100, kTotal = 300;  // 3 epochs
  // A replacement (incarnation 1) of rank 0 at the end of epochs 0 and 1.
  CHECK(EpochToEvaluateOnResume(0, 1, 100, kSpe, kTotal, true) == std::optional<uint32_t>(0));
  CHECK(EpochToEvaluateOnResume(0, 3, 200, kSpe, kTotal, true) == std::optional<uint32_t>(1));
  // Not at an epoch's end, not a replacement, not rank 0, no test data, or
  // past the last step (FinishTraining evaluates the final weights).
  CHECK_FALSE(EpochToEvaluateOnResume(0, 1, 150, kSpe, kTotal, true).has_value());
  CHECK_FALSE(EpochToEvaluateOnResume(0, 0, 100, kSpe, kTotal, true).has_value());
  CHECK_FALSE(EpochToEvaluateOnResume(1, 1, 100, kSpe, kTotal, true).has_value());
  CHECK_FALSE(EpochToEvaluateOnResume(0, 1, 100, kSpe, kTotal, false).has_value());
  CHECK_FALSE(EpochToEvaluateOnResume(0, 1, 0, kSpe, kTotal, true).has_value());
  CHECK_FALSE(EpochToEvaluateOnResume(0, 1, 300, kSpe, kTotal, true).has_value());
}

TEST_CASE("mf starts its global bias at the mean training rating, as a built-in model and as a graph", "[data]") {
  const fs::path dir = testing::MakeTempDir("fulcrum-mf-mean");
  // Raw ratings (user key, then item key), mean 3.625: from 0 the first
  // epochs would be spent learning the mean.
  std::ofstream(dir / "r.svm") << "4.5 3:1 1007:1\n2 1:1 1007:1\n3 3:1 1002:1\n5 1:1 1002:1\n";
  for (const bool graph : {false, true}) {
    INFO((graph ? "preset graph" : "built-in mf"));
    v1::JobSpec spec;
    spec.mutable_model()->set_type("mf");
    spec.mutable_model()->set_factors(3);
    if (graph) {
      auto g = config::PresetGraph(spec.model(), 0, 0);
      REQUIRE(g.ok());
      *spec.mutable_model() = *g;
    }
    spec.mutable_data()->mutable_train()->set_format("libsvm");
    spec.mutable_data()->mutable_train()->set_path("r.svm");
    spec.mutable_data()->mutable_train()->set_label_kind("real");
    auto data = LoadDataSource(spec.data().train(), dir.string(), nullptr);
    REQUIRE(data.ok());
    auto mc = ModelConfigFor(spec, **data);
    INFO(mc.status().message());
    REQUIRE(mc.ok());
    CHECK(mc->global_mean == Approx(3.625));
    std::string why;
    auto backend = compute::CreateBackend("cpu", &why, 1);
    REQUIRE(backend.ok());
    auto model = models::CreateModel(*mc, backend->get());
    REQUIRE(model.ok());
    v1::OptimizerSpec sgd;
    sgd.set_kind(v1::OptimizerSpec::SGD);
    const v1::PsJobSpec ps = training::JobSpecFor(**model, "j", sgd, v1::ConsistencySpec(), 1);
    bool found = false;
    for (const v1::TableSpec& t : ps.tables()) {
      if (t.name() != "global_bias") continue;
      found = true;
      CHECK(t.initializer().kind() == v1::InitializerSpec::CONSTANT);
      CHECK(t.initializer().a() == Approx(3.625));
    }
    CHECK(found);
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace fulcrum
