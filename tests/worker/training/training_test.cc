// Training the built-in models in one process on real data (no network):
// the CPU backend, the prefetching pipeline, the Trainer, and a real
// ParameterServer core behind LocalPsClient applying the optimizers.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <catch2/catch.hpp>

#include "common/config/model_graph.h"
#include "tests/testing/data_dir.h"
#include "tests/testing/test_util.h"
#include "worker/data/dataset.h"
#include "worker/local_ps_client.h"
#include "worker/training/trainer.h"

namespace fulcrum::training {
namespace {

namespace fs = std::filesystem;

std::string Data(const std::string& name) { return testing::DataDir(name); }

v1::OptimizerSpec Optimizer(v1::OptimizerSpec::Kind kind, float lr) {
  v1::OptimizerSpec o;
  o.set_kind(kind);
  o.set_learning_rate(lr);
  if (kind == v1::OptimizerSpec::ADAM) {
    o.set_beta1(0.9f);
    o.set_beta2(0.999f);
    o.set_epsilon(1e-8f);
  }
  return o;
}

struct Run {
  std::shared_ptr<ParameterServer> server;
  std::unique_ptr<LocalPsClient> client;
  std::unique_ptr<compute::Backend> backend;
  std::unique_ptr<models::Model> model;
  std::unique_ptr<Trainer> trainer;
};

v1::ConsistencySpec Bsp() {
  v1::ConsistencySpec c;
  c.set_model(v1::ConsistencySpec::BSP);
  return c;
}

// Rank `rank` of `workers` on `server` (a new one when null).
Run Start(const models::ModelConfig& config, const v1::OptimizerSpec& opt, TrainerOptions options,
          const v1::ConsistencySpec& consistency = Bsp(), std::shared_ptr<ParameterServer> server = nullptr,
          int rank = 0, int workers = 1) {
  Run r;
  if (server == nullptr) {
    auto created = LocalPsClient::NewServer();
    REQUIRE_OK(created.status());
    server = *created;
  }
  r.server = server;
  r.client = std::make_unique<LocalPsClient>(r.server, "worker-" + std::to_string(rank), rank);
  r.backend = compute::NewCpuBackend(0);
  auto model = models::CreateModel(config, r.backend.get());
  REQUIRE_OK(model.status());
  r.model = std::move(*model);
  REQUIRE_OK(r.client->CreateJob(JobSpecFor(*r.model, options.job_id, opt, consistency, workers)));
  r.trainer = std::make_unique<Trainer>(r.model.get(), r.client.get(), std::move(options));
  return r;
}

void Report(const char* what, const EpochResult& e, const EvalResult& test) {
  std::printf("%s: epoch %d, %lld steps in %.2f s (%.0f samples/s, %.3f s waiting for data), train loss %.4f "
              "acc %.4f, test loss %.4f acc %.4f rmse %.4f\n",
              what, e.epoch, static_cast<long long>(e.steps), e.seconds, e.samples_per_second, e.data_wait_seconds,
              e.train.loss, e.train.accuracy, test.loss, test.accuracy, test.rmse);
}

std::vector<float> Pull(Run& r, const std::string& job, const std::string& table, size_t n) {
  std::vector<float> w(n);
  PullBatch p;
  p.step = 0;
  p.dense.push_back({table, w.data(), n});
  REQUIRE_OK(r.client->Pull(job, p));
  return w;
}

TEST_CASE("softmax regression on sklearn digits reaches >= 0.90 test accuracy", "[data]") {
  data::CsvOptions csv;
  csv.scale = 1.0f / 16;
  csv.num_classes = 10;
  REQUIRE_OK_AND_ASSIGN(auto all, data::ReadCsv(Data("digits") + "/digits.csv.gz", csv));
  REQUIRE(all->size() == 1797);
  auto [train_idx, test_idx] = data::SplitIndices(all->size(), 0.2, 1);
  auto train = data::Subset(all.get(), train_idx), test = data::Subset(all.get(), test_idx);
  models::ModelConfig c;
  c.type = "softmax";
  c.num_features = 64;
  c.num_classes = 10;
  TrainerOptions o;
  o.job_id = "digits";
  o.batch_size = 32;
  Run r = Start(c, Optimizer(v1::OptimizerSpec::ADAM, 0.01f), o);
  EvalResult test_result;
  for (int epoch = 0; epoch < 10; ++epoch) {
    REQUIRE_OK_AND_ASSIGN(EpochResult e, r.trainer->TrainEpoch(*train, epoch));
    REQUIRE(e.steps == 45);  // ceil(1438 / 32)
    REQUIRE(e.data_wait_seconds <= e.seconds);
    REQUIRE_OK_AND_ASSIGN(test_result, r.trainer->Evaluate(*test));
    Report("digits softmax", e, test_result);
  }
  REQUIRE(test_result.examples == 359);
  CHECK(test_result.accuracy >= 0.90);
}

// The first layer's weights of a 64-16-10 MLP trained on sklearn's digits
// (batches of 50, Adam) for `epochs` epochs with `o`.
std::vector<float> DigitsMlpWeights(TrainerOptions o, int epochs) {
  data::CsvOptions csv;
  csv.scale = 1.0f / 16;
  REQUIRE_OK_AND_ASSIGN(auto all, data::ReadCsv(Data("digits") + "/digits.csv.gz", csv));
  models::ModelConfig c;
  c.type = "mlp";
  c.num_features = 64;
  c.num_classes = 10;
  c.hidden = {16};
  o.batch_size = 50;
  Run r = Start(c, Optimizer(v1::OptimizerSpec::ADAM, 0.01f), o);
  for (int epoch = 0; epoch < epochs; ++epoch) {
    REQUIRE_OK_AND_ASSIGN(EpochResult e, r.trainer->TrainEpoch(*all, epoch));
    REQUIRE(e.steps == 36);  // ceil(1797 / 50)
  }
  return Pull(r, o.job_id, "dense0.weight", 64 * 16);
}

TEST_CASE("the same seed trains the same weights bit for bit", "[data]") {
  TrainerOptions o;
  o.job_id = "repro";
  o.seed = 99;
  const std::vector<float> first = DigitsMlpWeights(o, 1);
  REQUIRE(first == DigitsMlpWeights(o, 1));
}

TEST_CASE("under BSP prefetching the next step's parameters trains the weights of pulling after each push", "[data]") {
  // The real server core holds a BSP pull of step s+1 until step s is
  // applied; were it answered at once, the prefetching run would train on
  // parameters one step old and end with other weights.
  TrainerOptions o;
  o.job_id = "prefetch";
  o.seed = 7;
  o.prefetch_parameters = false;
  const std::vector<float> after_push = DigitsMlpWeights(o, 2);
  o.prefetch_parameters = true;
  REQUIRE(DigitsMlpWeights(o, 2) == after_push);
}

TEST_CASE("an MLP on MNIST reaches >= 0.95 test accuracy in one epoch on the CPU", "[data]") {
  const std::string dir = Data("mnist");
  REQUIRE_OK_AND_ASSIGN(auto train,
                        data::ReadIdx(dir + "/train-images-idx3-ubyte", dir + "/train-labels-idx1-ubyte"));
  REQUIRE_OK_AND_ASSIGN(auto test, data::ReadIdx(dir + "/t10k-images-idx3-ubyte", dir + "/t10k-labels-idx1-ubyte"));
  REQUIRE(train->size() == 60000);
  REQUIRE(test->size() == 10000);
  models::ModelConfig c;
  c.type = "mlp";
  c.num_features = 784;
  c.num_classes = 10;
  c.hidden = {128};
  TrainerOptions o;
  o.job_id = "mnist";
  o.batch_size = 32;
  Run r = Start(c, Optimizer(v1::OptimizerSpec::ADAM, 0.001f), o);
  REQUIRE_OK_AND_ASSIGN(EpochResult e, r.trainer->TrainEpoch(*train, 0));
  REQUIRE_OK_AND_ASSIGN(EvalResult t, r.trainer->Evaluate(*test));
  Report("mnist mlp", e, t);
  REQUIRE(e.steps == 1875);
  REQUIRE(t.examples == 10000);
  CHECK(t.accuracy >= 0.95);
}

// MNIST batches built on the device (here the CPU backend's memory) or
// decoded on the host by one or several threads: the same weights and test
// figures, bit for bit. A subset of the training file, as a train/test
// split makes, checks that rows map into the file's bytes.
TEST_CASE("batches built on the device, or uploaded on their own stream, train the weights of host-decoded batches, "
          "bit for bit", "[data]") {
  const std::string dir = Data("mnist");
  REQUIRE_OK_AND_ASSIGN(auto base,
                        data::ReadIdx(dir + "/train-images-idx3-ubyte", dir + "/train-labels-idx1-ubyte"));
  REQUIRE_OK_AND_ASSIGN(auto test, data::ReadIdx(dir + "/t10k-images-idx3-ubyte", dir + "/t10k-labels-idx1-ubyte"));
  std::vector<int64_t> thirds;
  for (int64_t i = 0; i < 60000; i += 3) thirds.push_back(i);
  auto train = data::Subset(base.get(), thirds);
  struct Outcome {
    std::vector<float> weights;
    double loss, accuracy;
  };
  auto run = [&](data::DeviceDataMode mode, int threads,
                 data::PrefetchOptions::Upload upload = data::PrefetchOptions::Upload::kOff) {
    models::ModelConfig c;
    c.type = "mlp";
    c.num_features = 784;
    c.num_classes = 10;
    c.hidden = {32};
    TrainerOptions o;
    o.job_id = "device-data";
    o.batch_size = 64;
    o.seed = 5;
    o.max_steps_per_epoch = 120;
    o.device_data = mode;
    o.decode_threads = threads;
    o.upload = upload;
    Run r = Start(c, Optimizer(v1::OptimizerSpec::ADAM, 0.001f), o);
    for (int epoch = 0; epoch < 2; ++epoch) {
      REQUIRE_OK_AND_ASSIGN(EpochResult e, r.trainer->TrainEpoch(*train, epoch));
      REQUIRE(e.steps == 120);
    }
    REQUIRE_OK_AND_ASSIGN(EvalResult t, r.trainer->Evaluate(*test));
    return Outcome{Pull(r, "device-data", "dense0.weight", 784 * 32), t.loss, t.accuracy};
  };
  const Outcome host = run(data::DeviceDataMode::kOff, 1);
  CHECK(host.accuracy >= 0.85);
  for (const auto& [mode, threads] : {std::pair{data::DeviceDataMode::kOn, 1}, std::pair{data::DeviceDataMode::kOn, 3},
                                      std::pair{data::DeviceDataMode::kOff, 3}}) {
    INFO("device data " << (mode == data::DeviceDataMode::kOn) << ", " << threads << " decoding threads");
    const Outcome other = run(mode, threads);
    CHECK(other.weights == host.weights);
    CHECK(other.loss == host.loss);
    CHECK(other.accuracy == host.accuracy);
  }
  // Batches that stream: uploaded on the backend's upload stream as soon as
  // they are staged, the step waiting on its batch's upload event.
  const Outcome uploaded = run(data::DeviceDataMode::kOff, 3, data::PrefetchOptions::Upload::kOn);
  CHECK(uploaded.weights == host.weights);
  CHECK(uploaded.loss == host.loss);
}

TEST_CASE("softmax regression reads gzipped Fashion-MNIST and learns it", "[data]") {
  const std::string dir = Data("fashion-mnist");
  REQUIRE_OK_AND_ASSIGN(auto train, data::ReadIdx(dir + "/train-images-idx3-ubyte.gz",
                                                  dir + "/train-labels-idx1-ubyte.gz"));
  REQUIRE_OK_AND_ASSIGN(auto test, data::ReadIdx(dir + "/t10k-images-idx3-ubyte.gz", dir + "/t10k-labels-idx1-ubyte.gz"));
  REQUIRE(train->size() == 60000);
  models::ModelConfig c;
  c.type = "softmax";
  c.num_features = 784;
  c.num_classes = 10;
  TrainerOptions o;
  o.job_id = "fashion";
  o.batch_size = 128;
  Run r = Start(c, Optimizer(v1::OptimizerSpec::ADAM, 0.002f), o);
  REQUIRE_OK_AND_ASSIGN(EpochResult e, r.trainer->TrainEpoch(*train, 0));
  REQUIRE_OK_AND_ASSIGN(EvalResult t, r.trainer->Evaluate(*test));
  Report("fashion-mnist softmax", e, t);
  CHECK(t.accuracy >= 0.78);  // softmax regression tops out near 0.84
}

// SpamAssassin mails hashed to LibSVM by the fulcrum-text2libsvm binary.
struct Spam {
  std::unique_ptr<data::Dataset> train, test;
};
Spam SpamData() {
  const std::string out = (fs::temp_directory_path() / ("fulcrum_spam_" + std::to_string(::getpid()))).string();
  const std::string cmd = std::string(FULCRUM_TEXT2LIBSVM) + " --input=" + Data("spam-assassin") +
                          " --positive=spam --extension=.txt --bits=18 --train=" + out + ".train --test=" + out +
                          ".test";
  REQUIRE(std::system(cmd.c_str()) == 0);
  Spam s;
  auto train = data::ReadLibSvm(out + ".train");
  auto test = data::ReadLibSvm(out + ".test");
  REQUIRE_OK(train.status());
  REQUIRE_OK(test.status());
  s.train = std::move(*train);
  s.test = std::move(*test);
  fs::remove(out + ".train");
  fs::remove(out + ".test");
  REQUIRE(s.train->size() + s.test->size() == 6046);
  return s;
}

TEST_CASE("sparse logistic regression and a factorization machine classify SpamAssassin mails", "[data]") {
  Spam spam = SpamData();
  for (const char* type : {"sparse_lr", "fm"}) {
    models::ModelConfig c;
    c.type = type;
    c.factors = 8;
    TrainerOptions o;
    o.job_id = type;
    o.batch_size = 32;
    Run r = Start(c, Optimizer(v1::OptimizerSpec::ADAGRAD, 1.0f), o);
    EvalResult t;
    const int epochs = c.type == "fm" ? 3 : 5;
    for (int epoch = 0; epoch < epochs; ++epoch) {
      REQUIRE_OK_AND_ASSIGN(EpochResult e, r.trainer->TrainEpoch(*spam.train, epoch));
      REQUIRE_OK_AND_ASSIGN(t, r.trainer->Evaluate(*spam.test));
      Report(type, e, t);
    }
    // Only the rows the mails touched exist on the server.
    REQUIRE_OK_AND_ASSIGN(auto job, r.server->GetJob(type));
    CHECK(job.sparse_rows() > 1000);
    CHECK(job.sparse_rows() < (type == std::string("fm") ? 2 : 1) * (1u << 18));
    CHECK(t.accuracy >= 0.95);
  }
}

TEST_CASE("matrix factorization recovers low-rank ratings", "[data]") {
  // Synthetic ratings (no ratings dataset is packaged): 300 users x 200
  // items, rank 3, plus biases and noise 0.1; 20% of pairs observed.
  std::mt19937 rng(5);
  std::normal_distribution<float> n(0, 1);
  const int users = 300, items = 200, rank = 3;
  std::vector<float> U(users * rank), V(items * rank), bu(users), bi(items);
  for (auto& x : U) x = n(rng) * 0.7f;
  for (auto& x : V) x = n(rng) * 0.7f;
  for (auto& x : bu) x = n(rng) * 0.3f;
  for (auto& x : bi) x = n(rng) * 0.3f;
  const fs::path file = fs::temp_directory_path() / ("fulcrum_mf_" + std::to_string(::getpid()) + ".svm");
  double sum = 0, sum2 = 0;
  int count = 0;
  {
    std::ofstream out(file);
    for (int u = 0; u < users; ++u) {
      for (int i = 0; i < items; ++i) {
        if (rng() % 5 != 0) continue;
        float r = 3 + bu[u] + bi[i] + 0.1f * n(rng);
        for (int k = 0; k < rank; ++k) r += U[u * rank + k] * V[i * rank + k];
        out << r << " " << u << ":1 " << (1000 + i) << ":1\n";
        sum += r;
        sum2 += double{r} * r;
        ++count;
      }
    }
  }
  data::LibSvmOptions lo;
  lo.labels = data::LabelKind::kValue;
  REQUIRE_OK_AND_ASSIGN(auto all, data::ReadLibSvm(file.string(), lo));
  fs::remove(file);
  auto [train_idx, test_idx] = data::SplitIndices(all->size(), 0.1, 3);
  auto train = data::Subset(all.get(), train_idx), test = data::Subset(all.get(), test_idx);
  const double mean = sum / count, stddev = std::sqrt(sum2 / count - mean * mean);
  models::ModelConfig c;
  c.type = "mf";
  c.factors = 4;
  c.init_stddev = 0.1f;
  c.global_mean = static_cast<float>(mean);
  // The built-in model, then its preset graph (config::PresetGraph); both
  // start their global bias at the ratings' mean (workers take it from the
  // training data: ModelConfigFor).
  v1::ModelSpec mf;
  mf.set_type("mf");
  mf.set_factors(c.factors);
  mf.set_init_stddev(c.init_stddev);
  REQUIRE_OK_AND_ASSIGN(v1::ModelSpec graph, config::PresetGraph(mf, 0, 0));
  double rmse[2] = {0, 0};
  for (int g = 0; g < 2; ++g) {
    if (g == 1) {
      c.type = "graph";
      c.graph = graph;
    }
    TrainerOptions o;
    o.job_id = g == 0 ? "mf" : "mf-graph";
    o.batch_size = 64;
    Run r = Start(c, Optimizer(v1::OptimizerSpec::ADAM, 0.02f), o);
    // Raw ratings (mean 3): untrained, the predictions are the mean, so the
    // test RMSE is about the ratings' stddev (from 0 it was about 3.2).
    REQUIRE_OK_AND_ASSIGN(EvalResult t, r.trainer->Evaluate(*test));
    std::printf("%s untrained: rating mean %.3f stddev %.3f, test RMSE %.3f\n", o.job_id.c_str(), mean, stddev, t.rmse);
    CHECK(t.rmse < 1.1 * stddev);
    for (int epoch = 0; epoch < 15; ++epoch) {
      REQUIRE_OK_AND_ASSIGN(EpochResult e, r.trainer->TrainEpoch(*train, epoch));
      REQUIRE_OK_AND_ASSIGN(t, r.trainer->Evaluate(*test));
      if (epoch % 5 == 4) Report(o.job_id.c_str(), e, t);
    }
    std::printf("%s: rating stddev %.3f, test RMSE %.3f\n", o.job_id.c_str(), stddev, t.rmse);
    CHECK(t.rmse < 0.5 * stddev);
    rmse[g] = t.rmse;
  }
  CHECK(std::abs(rmse[1] - rmse[0]) < 0.05 * stddev);  // the preset holds the built-in's accuracy
}

}  // namespace
}  // namespace fulcrum::training

namespace fulcrum::training {
namespace {

TEST_CASE("sparse logistic regression fits LibSVM's heart_scale fixture", "[data]") {
  REQUIRE_OK_AND_ASSIGN(auto data, data::ReadLibSvm(Data("heart_scale") + "/heart_scale"));
  REQUIRE(data->size() == 270);
  REQUIRE(data->num_features() == 14);  // indices 1..13
  models::ModelConfig c;
  c.type = "sparse_lr";
  TrainerOptions o;
  o.job_id = "heart";
  o.batch_size = 16;
  o.progressive_window = 800;  // 8 chunks of 100
  Run r = Start(c, Optimizer(v1::OptimizerSpec::ADAGRAD, 0.5f), o);
  EvalResult t;
  // Progressive validation: the first epoch's batches, each scored before
  // it was trained on, are the window; its figures are the epoch's.
  REQUIRE_OK_AND_ASSIGN(const EpochResult first, r.trainer->TrainEpoch(*data, 0));
  REQUIRE(first.train.auc > 0);
  ProgressiveWindow::Figures f = r.trainer->progressive().Now();
  CHECK(f.examples == 270);
  CHECK(std::abs(f.auc - first.train.auc) < 0.002);
  CHECK(std::abs(f.log_loss - first.train.loss) < 1e-3);
  for (int epoch = 1; epoch < 20; ++epoch) {
    REQUIRE_OK(r.trainer->TrainEpoch(*data, epoch).status());
  }
  REQUIRE_OK_AND_ASSIGN(t, r.trainer->Evaluate(*data));
  std::printf("heart_scale sparse_lr: training accuracy %.4f, loss %.4f\n", t.accuracy, t.loss);
  CHECK(t.accuracy >= 0.80);  // linear models reach ~0.84 on it
  // The window slid: the last 700-800 examples, scored by a better model.
  f = r.trainer->progressive().Now();
  std::printf("heart_scale sparse_lr: progressive AUC %.4f over the first epoch, %.4f over the last %llu examples\n",
              first.train.auc, f.auc, static_cast<unsigned long long>(f.examples));
  CHECK(f.examples >= 700);
  CHECK(f.examples <= 800);
  CHECK(f.auc > first.train.auc);
  CHECK(f.log_loss < first.train.loss);
}


// ---- local steps with sparse tables: rows pulled and pushed by every step
// (unclocked), dense tables in rounds.

v1::ConsistencySpec Local(int sync_every, const v1::OptimizerSpec& inner) {
  v1::ConsistencySpec c;
  c.set_model(v1::ConsistencySpec::LOCAL);
  c.set_sync_every_steps(sync_every);
  *c.mutable_inner_optimizer() = inner;
  return c;
}

TrainerOptions LocalOptions(const std::string& job, int batch, int sync_every, const v1::OptimizerSpec& inner) {
  TrainerOptions o;
  o.job_id = job;
  o.batch_size = batch;
  o.sync_every = sync_every;
  auto in = InnerOptimizerFromSpec(inner);
  REQUIRE_OK(in.status());
  o.inner = *in;
  return o;
}

// The bias and the linear rows of heart_scale's 13 features.
std::vector<float> HeartWeights(Run& r, const std::string& job) {
  std::vector<float> w = Pull(r, job, "bias", 1);
  std::vector<uint64_t> keys;
  for (uint64_t k = 1; k <= 13; ++k) keys.push_back(k);
  std::vector<float> rows(keys.size());
  PullBatch p;
  p.step = r.trainer->clock();
  p.sparse.push_back({"linear", keys.data(), keys.size(), rows.data()});
  REQUIRE_OK(r.client->Pull(job, p));
  w.insert(w.end(), rows.begin(), rows.end());
  return w;
}

TEST_CASE("local steps with sparse tables and H = 1 train the weights of per-step BSP", "[local]") {
  // Inner SGD on the dense bias and on the servers' rows, outer SGD at rate
  // 1: a round of one step is a per-step SGD step.
  REQUIRE_OK_AND_ASSIGN(auto data, data::ReadLibSvm(Data("heart_scale") + "/heart_scale"));
  models::ModelConfig c;
  c.type = "sparse_lr";
  const auto sgd = Optimizer(v1::OptimizerSpec::SGD, 0.1f);
  TrainerOptions po;
  po.job_id = "per-step";
  po.batch_size = 16;
  Run per_step = Start(c, sgd, po);
  Run local = Start(c, Optimizer(v1::OptimizerSpec::SGD, 1.0f), LocalOptions("local", 16, 1, sgd), Local(1, sgd));
  for (int epoch = 0; epoch < 3; ++epoch) {
    REQUIRE_OK(per_step.trainer->TrainEpoch(*data, epoch).status());
    REQUIRE_OK(local.trainer->TrainEpoch(*data, epoch).status());
  }
  REQUIRE_OK(local.trainer->Flush());
  const std::vector<float> a = HeartWeights(per_step, "per-step"), b = HeartWeights(local, "local");
  double worst = 0, size = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, static_cast<double>(std::fabs(a[i] - b[i])));
    size = std::max(size, static_cast<double>(std::fabs(a[i])));
  }
  INFO("largest difference " << worst << " among weights up to " << size);
  CHECK(size > 0.05);  // trained, not zeros
  CHECK(worst < 1e-5);
  CHECK(local.trainer->clock() == 3 * 17);  // ceil(270 / 16) rounds of one step, 3 epochs
  REQUIRE_OK_AND_ASSIGN(auto job, local.server->GetJob("local"));
  CHECK(job.unclocked_pushes() == 3 * 17);   // one push of rows per step
  CHECK(job.pushes_applied() == 2 * 3 * 17);  // and one round push
}

TEST_CASE("2 workers with local steps (H = 8) train a factorization machine on SpamAssassin, rows per step",
          "[local]") {
  Spam spam = SpamData();
  auto server = LocalPsClient::NewServer();
  REQUIRE_OK(server.status());
  models::ModelConfig c;
  c.type = "fm";
  c.factors = 8;
  const auto inner = Optimizer(v1::OptimizerSpec::ADAM, 0.01f);
  const v1::ConsistencySpec local = Local(8, inner);
  std::vector<Run> ranks;
  for (int r = 0; r < 2; ++r) {
    TrainerOptions o = LocalOptions("fm", 32, 8, inner);
    o.rank = r;
    o.world_size = 2;
    ranks.push_back(Start(c, Optimizer(v1::OptimizerSpec::SGD, 1.0f), o, local, *server, r, 2));
  }
  std::vector<absl::Status> status(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      for (int e = 0; e < 2 && status[r].ok(); ++e) status[r] = ranks[r].trainer->TrainEpoch(*spam.train, e).status();
      if (status[r].ok()) status[r] = ranks[r].trainer->Flush();
    });
  }
  for (auto& t : threads) t.join();
  REQUIRE_OK(status[0]);
  REQUIRE_OK(status[1]);
  REQUIRE_OK_AND_ASSIGN(EvalResult t, ranks[0].trainer->Evaluate(*spam.test));
  const int64_t steps = ranks[0].trainer->StepsPerEpoch(*spam.train);
  std::printf("fm on SpamAssassin, 2 workers, local steps H=8 (inner Adam 1e-2, rows per step): test accuracy "
              "%.4f, loss %.4f\n",
              t.accuracy, t.loss);
  CHECK(t.accuracy >= 0.95);
  CHECK(ranks[0].trainer->clock() == 2 * static_cast<uint64_t>((steps + 7) / 8));
  REQUIRE_OK_AND_ASSIGN(auto job, (*server)->GetJob("fm"));
  CHECK(job.unclocked_pushes() == 2 * 2 * static_cast<uint64_t>(steps));
  CHECK(job.sparse_rows() > 1000);
  // The dense bias moved by rounds.
  CHECK(Pull(ranks[0], "fm", "bias", 1)[0] != 0.0f);
}

}  // namespace
}  // namespace fulcrum::training
