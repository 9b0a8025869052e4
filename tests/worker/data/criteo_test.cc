// The Criteo-layout reader (worker/data/readers.cc), the planted-model CTR
// generator behind fulcrum-datagen (worker/data/ctr_gen.h), the AUC and
// log-loss functions (common/binary_metrics.h), and a factorization machine
// trained on generated data through the Trainer and a real server core.
#include <zlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/binary_metrics.h"
#include "tests/testing/test_util.h"
#include "worker/data/ctr_gen.h"
#include "worker/data/dataset.h"
#include "worker/local_ps_client.h"
#include "worker/training/trainer.h"

namespace fulcrum::data {
namespace {

namespace fs = std::filesystem;

std::string TempPath(const std::string& name) {
  return (fs::temp_directory_path() / absl::StrCat("fulcrum-criteo-", getpid(), "-", name)).string();
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::string ReadAll(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  REQUIRE(f != nullptr);
  std::string out;
  char buf[1 << 16];
  for (int n; (n = gzread(f, buf, sizeof(buf))) > 0;) out.append(buf, static_cast<size_t>(n));
  gzclose(f);
  return out;
}

// A line of the layout: label, 13 integers, 26 categoricals.
std::string Line(const std::string& label, const std::vector<std::string>& ints, const std::vector<std::string>& cats) {
  std::string s = label;
  for (int i = 0; i < kCriteoIntegers; ++i) s += "\t" + (i < static_cast<int>(ints.size()) ? ints[i] : "");
  for (int j = 0; j < kCriteoCategoricals; ++j) s += "\t" + (j < static_cast<int>(cats.size()) ? cats[j] : "");
  return s + "\n";
}

TEST_CASE("a Criteo line becomes log-transformed integer keys and hashed categorical keys, empty fields absent",
          "[criteo]") {
  const std::string path = TempPath("one.tsv");
  WriteFile(path, Line("1", {"0", "3", "", "-2"}, {"68fd1e64", "", "05db9164"}) + Line("0", {}, {}));
  REQUIRE_OK_AND_ASSIGN(auto ds, ReadCriteo(path));
  REQUIRE(ds->size() == 2);
  CHECK(ds->sparse());
  CHECK(ds->num_classes() == 2);
  CHECK(ds->label(0) == 1.0f);
  CHECK(ds->label(1) == 0.0f);
  Batch b;
  const int64_t rows[] = {0, 1};
  ds->Fill(rows, 2, &b);
  REQUIRE(b.offsets == std::vector<int32_t>{0, 5, 5});
  CHECK(b.keys[0] == 0);
  CHECK(b.values[0] == 0.0f);  // log(1 + 0)
  CHECK(b.keys[1] == 1);
  CHECK(b.values[1] == Approx(std::log(4.0)));
  CHECK(b.keys[2] == 3);
  CHECK(b.values[2] == 0.0f);  // negative counts clamp to 0
  CHECK(b.keys[3] == CriteoKey(0, 0x68fd1e64, 20));
  CHECK(b.keys[4] == CriteoKey(2, 0x05db9164, 20));
  CHECK(b.values[3] == 1.0f);
  // Each field has its own bucket space past the 13 integer keys.
  for (int field : {0, 2, 25}) {
    const uint64_t k = CriteoKey(field, 0x68fd1e64, 20);
    CHECK(k >= 13 + static_cast<uint64_t>(field) * (1u << 20));
    CHECK(k < 13 + static_cast<uint64_t>(field + 1) * (1u << 20));
  }
  // raw_integers keeps the counts as they are.
  CriteoOptions raw;
  raw.raw_integers = true;
  REQUIRE_OK_AND_ASSIGN(auto r, ReadCriteo(path, raw));
  Batch rb;
  r->Fill(rows, 1, &rb);
  CHECK(rb.values[1] == 3.0f);
  CHECK(rb.values[2] == -2.0f);
  fs::remove(path);
}

TEST_CASE("bad Criteo lines are refused naming the file, the line and the field", "[criteo]") {
  const std::string path = TempPath("bad.tsv");
  auto refused = [&](const std::string& text, const std::string& want) {
    WriteFile(path, text);
    const absl::Status s = ReadCriteo(path).status();
    INFO(s);
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(absl::StrContains(s.message(), path));
    CHECK(absl::StrContains(s.message(), want));
  };
  const std::string good = Line("0", {"1"}, {"ab"});
  refused(good + "1\t2\t3\n", "line 2: 3 tab-separated fields; the Criteo layout has 40");
  refused(good + Line("0", {"1", "x7"}, {}), "line 2: I2 \"x7\" is not an integer");
  refused(Line("1", {}, {"", "", "zz"}), "line 1: C3 \"zz\" is not a hexadecimal value");
  refused(Line("2", {}, {}), "line 1: label 2 is not binary");
  refused("", "no examples");
  CriteoOptions wide;
  wide.hash_bits = 40;
  CHECK(ReadCriteo(path, wide).status().code() == absl::StatusCode::kInvalidArgument);
  fs::remove(path);
}

TEST_CASE("AUC and log loss of known rankings", "[criteo]") {
  const std::vector<float> labels = {0, 0, 1, 1};
  CHECK(Auc({0.1, 0.2, 0.8, 0.9}, labels) == 1.0);
  CHECK(Auc({0.9, 0.8, 0.2, 0.1}, labels) == 0.0);
  CHECK(Auc({0.5, 0.5, 0.5, 0.5}, labels) == 0.5);
  CHECK(Auc({0.1, 0.6, 0.5, 0.9}, labels) == 0.75);  // one of four pairs misordered
  CHECK(Auc({0.1, 0.2}, {1, 1}) == 0.5);               // one class only
  CHECK(LogLoss({0.5, 0.5}, {0, 1}) == Approx(std::log(2.0)));
  CHECK(LogLoss({0.0, 1.0}, {0, 1}) < 1e-12);
}

TEST_CASE("fulcrum-datagen's CTR data with drift: ids keep arriving and fade, the test rows come after", "[criteo]") {
  CtrGenOptions o;
  o.train_path = TempPath("drift.tsv");
  o.test_path = TempPath("drift.test.tsv");
  o.train_rows = 40000;
  o.test_rows = 10000;
  o.vocab = 2000;
  o.drift = 0.2;  // 8 000 new ids of field 0 over the training rows
  o.threads = 2;
  REQUIRE_OK_AND_ASSIGN(const CtrGenStats st, GenerateCtr(o));
  // Field 0's values (column 14) in each quarter of the training rows, and
  // in the test rows.
  auto values = [](const std::string& path, size_t from, size_t to) {
    std::set<std::string> out;
    std::istringstream in(ReadAll(path));
    std::string line;
    for (size_t row = 0; std::getline(in, line); ++row) {
      if (row < from || row >= to) continue;
      std::vector<std::string> cols = absl::StrSplit(line, '\t');
      REQUIRE(cols.size() == 40);
      if (!cols[14].empty()) out.insert(cols[14]);
    }
    return out;
  };
  const auto first = values(o.train_path, 0, 10000), last = values(o.train_path, 30000, 40000);
  const auto test = values(o.test_path, 0, 10000);
  std::set<std::string> all = values(o.train_path, 0, 40000);
  auto shared = [](const std::set<std::string>& a, const std::set<std::string>& b) {
    size_t n = 0;
    for (const auto& v : a) n += b.count(v);
    return static_cast<double>(n) / static_cast<double>(a.size());
  };
  INFO("distinct field-0 ids over the training rows " << all.size() << "; the first quarter's shared with the last "
                                                      << shared(first, last) << ", the test rows' with the last "
                                                      << shared(test, last) << ", with the first " << shared(test, first));
  CHECK(all.size() > 2 * 2000);               // more ids than one vocabulary: they keep arriving
  CHECK(shared(first, last) < 0.2);           // the early ids have faded by the end
  // The test rows follow on from the training rows: they share ids with the
  // last quarter (the popular ones, about a quarter of their distinct ids)
  // and none with the first.
  CHECK(shared(test, last) > 0.15);
  CHECK(shared(test, first) < 0.02);
  CHECK(st.best_auc > 0.7);                   // the planted model still scores
}

TEST_CASE("fulcrum-datagen's CTR data: the same bytes for any thread count, readable, with its planted figures",
          "[criteo]") {
  CtrGenOptions o;
  o.train_path = TempPath("gen1.tsv.gz");
  o.test_path = TempPath("gen1.test.tsv");
  o.train_rows = 40000;
  o.test_rows = 10000;
  o.vocab = 2000;
  o.threads = 1;
  REQUIRE_OK_AND_ASSIGN(const CtrGenStats one, GenerateCtr(o));
  CtrGenOptions p = o;
  p.train_path = TempPath("gen3.tsv.gz");
  p.test_path = TempPath("gen3.test.tsv");
  p.threads = 3;
  REQUIRE_OK_AND_ASSIGN(const CtrGenStats three, GenerateCtr(p));
  CHECK(ReadAll(o.train_path) == ReadAll(p.train_path));
  CHECK(ReadAll(o.test_path) == ReadAll(p.test_path));
  CHECK(one.best_auc == three.best_auc);
  std::printf("generated CTR data: positive rate %.4f, planted AUC %.4f, log loss %.4f (constant: %.4f)\n",
              one.positive_rate, one.best_auc, one.best_log_loss, one.base_log_loss);
  CHECK(one.positive_rate > 0.1);
  CHECK(one.positive_rate < 0.6);
  CHECK(one.best_auc > 0.7);
  CHECK(one.best_auc < 0.95);
  CHECK(one.best_log_loss < one.base_log_loss - 0.05);
  REQUIRE_OK_AND_ASSIGN(auto train, ReadCriteo(o.train_path));
  REQUIRE_OK_AND_ASSIGN(auto test, ReadCriteo(o.test_path));
  CHECK(train->size() == 40000);
  CHECK(test->size() == 10000);
  // Another seed, other data.
  p.seed = 2;
  REQUIRE_OK(GenerateCtr(p).status());
  CHECK(ReadAll(o.train_path) != ReadAll(p.train_path));

  // A factorization machine closes a good part of the gap between a
  // constant prediction and the planted model (about half in 3 epochs of
  // 40 000 rows; the rest needs more data per id).
  auto server = LocalPsClient::NewServer();
  REQUIRE_OK(server.status());
  LocalPsClient client(*server, "w0");
  auto backend = compute::NewCpuBackend(1);
  models::ModelConfig mc;
  mc.type = "fm";
  mc.factors = 4;
  mc.num_features = train->num_features();
  mc.num_classes = 2;
  REQUIRE_OK_AND_ASSIGN(auto model, models::CreateModel(mc, backend.get()));
  v1::OptimizerSpec adagrad;
  adagrad.set_kind(v1::OptimizerSpec::ADAGRAD);
  adagrad.set_learning_rate(0.03f);
  v1::ConsistencySpec bsp;
  bsp.set_model(v1::ConsistencySpec::BSP);
  REQUIRE_OK(client.CreateJob(training::JobSpecFor(*model, "ctr", adagrad, bsp, 1)));
  training::TrainerOptions to;
  to.job_id = "ctr";
  to.batch_size = 64;
  training::Trainer trainer(model.get(), &client, to);
  training::EvalResult t;
  training::EpochResult e;
  for (int epoch = 0; epoch < 3; ++epoch) {
    REQUIRE_OK_AND_ASSIGN(e, trainer.TrainEpoch(*train, epoch));
    REQUIRE_OK_AND_ASSIGN(t, trainer.Evaluate(*test));
  }
  std::printf("fm on generated CTR data: test log loss %.4f (planted %.4f, constant %.4f), accuracy %.4f, AUC %.4f "
              "(planted %.4f), train AUC %.4f\n",
              t.loss, one.best_log_loss, one.base_log_loss, t.accuracy, t.auc, one.best_auc, e.train.auc);
  // The AUC the trainer reports is the one of its predictions: between
  // chance and the planted model's.
  CHECK(t.auc > 0.7);
  CHECK(t.auc < one.best_auc);
  CHECK(e.train.auc > 0.7);
  CHECK(t.loss < one.base_log_loss - 0.33 * (one.base_log_loss - one.best_log_loss));
  for (const std::string& f : {o.train_path, o.test_path, p.train_path, p.test_path}) fs::remove(f);
}

}  // namespace
}  // namespace fulcrum::data
