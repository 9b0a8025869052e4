#include "tests/testing/mnist_training.h"

#include <algorithm>
#include <thread>

#include <catch2/catch.hpp>

#include "tests/testing/data_dir.h"
#include "tests/testing/test_util.h"
#include "worker/local_ps_client.h"
#include "worker/training/trainer.h"

namespace fulcrum::testing {

Mnist LoadMnist(int every) {
  const std::string dir = DataDir("mnist");
  Mnist m;
  auto tr = data::ReadIdx(dir + "/train-images-idx3-ubyte", dir + "/train-labels-idx1-ubyte");
  REQUIRE_OK(tr.status());
  auto te = data::ReadIdx(dir + "/t10k-images-idx3-ubyte", dir + "/t10k-labels-idx1-ubyte");
  REQUIRE_OK(te.status());
  m.train_all = std::move(*tr);
  m.test = std::move(*te);
  std::vector<int64_t> rows;
  for (int64_t i = 0; i < 60000; i += every) rows.push_back(i);
  m.train = data::Subset(m.train_all.get(), rows);
  return m;
}

v1::OptimizerSpec Opt(v1::OptimizerSpec::Kind kind, float lr, float momentum, bool nesterov) {
  v1::OptimizerSpec o;
  o.set_kind(kind);
  o.set_learning_rate(lr);
  o.set_momentum(momentum);
  o.set_nesterov(nesterov);
  return o;
}

absl::Status ShapedClient::Send(const std::string& job_id, const PushBatch& batch) {
  if (log_ != nullptr) {
    // Counted as pushed when it starts: a rank waiting on the bound is
    // released once the push has been applied, by which time it counts.
    absl::MutexLock lock(&log_->mu);
    const int64_t slowest = *std::min_element(log_->pushed.begin(), log_->pushed.end());
    log_->max_lead[rank_] = std::max(log_->max_lead[rank_], log_->pushed[rank_] - slowest);
    log_->samples[rank_].push_back(batch.samples);
    ++log_->pushed[rank_];
  }
  return inner_->Push(job_id, batch);
}

Future<absl::Status> ShapedClient::PushAsync(const std::string& job_id, const PushBatch& batch) {
  absl::SleepFor(delay_);
  Promise<absl::Status> done;
  if (lag_ == 0) {
    done.Set(Send(job_id, batch));
    return done.future();
  }
  absl::Status s;
  absl::MutexLock lock(&mu_);
  Held& h = held_.emplace_back();
  h.batch = batch;
  for (DenseGradient& g : h.batch.dense) {
    h.dense.emplace_back(g.data, g.data + g.size);
    g.data = h.dense.back().data();
  }
  while (!held_.empty() && held_.front().batch.step + lag_ <= batch.step) {
    s.Update(Send(job_id, held_.front().batch));
    held_.pop_front();
  }
  done.Set(s);  // the trainer moves on as if the push were in flight
  return done.future();
}

absl::Status ShapedClient::Flush(const std::string& job_id) {
  absl::Status s;
  absl::MutexLock lock(&mu_);
  for (; !held_.empty(); held_.pop_front()) s.Update(Send(job_id, held_.front().batch));
  return s;
}

Outcome Train(const Mnist& d, int workers, int epochs, int batch, const v1::OptimizerSpec& outer, int sync_every,
              const v1::OptimizerSpec& inner, int64_t max_steps, bool overlap, const Mixed& mixed, int hidden) {
  auto server = LocalPsClient::NewServer();
  REQUIRE_OK(server.status());
  struct Rank {
    std::unique_ptr<LocalPsClient> client;
    std::unique_ptr<ShapedClient> shaped;
    std::unique_ptr<compute::Backend> backend;
    std::unique_ptr<models::Model> model;
    std::unique_ptr<training::Trainer> trainer;
    absl::Status status;
  };
  std::vector<Rank> ranks(workers);
  v1::ConsistencySpec c;
  c.set_model(sync_every > 0 ? v1::ConsistencySpec::LOCAL : mixed.per_step);
  c.set_sync_every_steps(sync_every);
  c.set_staleness(mixed.staleness);
  c.set_staleness_aware_lr(mixed.staleness_aware_lr);
  if (mixed.log != nullptr) {
    absl::MutexLock lock(&mixed.log->mu);
    mixed.log->pushed.assign(workers, 0);
    mixed.log->samples.assign(workers, {});
    mixed.log->max_lead.assign(workers, 0);
  }
  models::ModelConfig mlp;
  mlp.type = "mlp";
  mlp.num_features = 784;
  mlp.num_classes = 10;
  mlp.hidden = {hidden};
  mlp.seed = 3;
  for (int r = 0; r < workers; ++r) {
    Rank& k = ranks[r];
    k.client = std::make_unique<LocalPsClient>(*server, "w" + std::to_string(r), r);
    k.backend = compute::NewCpuBackend(1);
    auto model = models::CreateModel(mlp, k.backend.get());
    REQUIRE_OK(model.status());
    k.model = std::move(*model);
    REQUIRE_OK(k.client->CreateJob(training::JobSpecFor(*k.model, "j", outer, c, workers)));
    training::TrainerOptions o;
    o.job_id = "j";
    o.batch_size = batch;
    o.seed = 11;
    o.rank = r;
    o.world_size = workers;
    o.max_steps_per_epoch = max_steps;
    o.sync_every = sync_every;
    o.overlap_rounds = overlap;
    if (sync_every > 0) {
      auto in = training::InnerOptimizerFromSpec(inner);
      REQUIRE_OK(in.status());
      o.inner = *in;
    }
    PsClient* client = k.client.get();
    const absl::Duration delay = r == mixed.slow_rank ? mixed.slow_delay : absl::ZeroDuration();
    if (mixed.log != nullptr || delay > absl::ZeroDuration() || mixed.lag_steps > 0) {
      k.shaped = std::make_unique<ShapedClient>(client, r, delay, mixed.lag_steps, mixed.log);
      client = k.shaped.get();
    }
    k.trainer = std::make_unique<training::Trainer>(k.model.get(), client, o);
  }
  const absl::Time t0 = absl::Now();
  std::vector<std::thread> threads;
  for (int r = 0; r < workers; ++r) {
    threads.emplace_back([&, r] {
      for (int e = 0; e < epochs && ranks[r].status.ok(); ++e) {
        ranks[r].status = ranks[r].trainer->TrainEpoch(*d.train, e).status();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (Rank& k : ranks) {
    if (k.status.ok()) k.status = k.trainer->Flush();
    if (k.shaped != nullptr) REQUIRE_OK(k.shaped->Flush("j"));
  }
  Outcome out;
  out.seconds = absl::ToDoubleSeconds(absl::Now() - t0);
  for (Rank& k : ranks) REQUIRE_OK(k.status);
  auto eval = ranks[0].trainer->Evaluate(*d.test);
  REQUIRE_OK(eval.status());
  out.test_accuracy = eval->accuracy;
  out.clock = ranks[0].trainer->clock();
  out.weights.resize(size_t{784} * hidden);
  PullBatch p;
  p.step = 0;
  p.dense.push_back({"dense0.weight", out.weights.data(), out.weights.size()});
  REQUIRE_OK(ranks[0].client->Pull("j", p));
  return out;
}

}  // namespace fulcrum::testing
