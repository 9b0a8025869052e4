// fulcrum-train-local: trains a job spec in this one process, with the
// parameter-server core in-process (LocalPsClient: the same tables,
// optimizers and initializers, no network, no coordinator). For quick
// experiments with a spec, and the baseline of the cluster benchmark
// (tests/bench/cluster_bench.sh).
//
//   fulcrum-train-local --spec=deploy/examples/mnist-mlp.yaml [--epochs=1] [--device=cpu]
//
// Prints one line per epoch and, last, "samples_per_second=N test_accuracy=A".
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/config/job_spec.h"
#include "common/config/spec_text.h"
#include "common/flags_usage.h"
#include "common/status_macros.h"
#include "worker/compute/backend.h"
#include "worker/data/pipeline.h"
#include "worker/local_ps_client.h"
#include "worker/setup/job_data.h"
#include "worker/setup/trainer_options.h"
#include "worker/training/auto_batch.h"
#include "worker/training/trainer.h"

ABSL_FLAG(std::string, spec, "", "job spec file (YAML or JSON)");
ABSL_FLAG(std::string, data_dir, "", "where relative data paths resolve (default $FULCRUM_DATA_DIR or ~/.cache/fulcrum/data)");
ABSL_FLAG(std::string, device, "auto", "auto, cpu or cuda:N");
ABSL_FLAG(int32_t, epochs, 0, "override the spec's epochs (0: the spec's)");
ABSL_FLAG(int32_t, cpu_threads, 0, "CPU backend threads (0: all cores)");
ABSL_FLAG(int32_t, decode_threads, 0, "threads decoding batches (0: chosen for the device, as fulcrum-worker does)");
ABSL_FLAG(std::string, device_data, "auto", "datasets on the device: auto, on or off (as fulcrum-worker)");

namespace {

// The Trainer's options for `spec` in one process, as fulcrum-worker sets
// them for rank 0 of 1 (TrainerOptionsFor); batch_size auto measured here,
// as rank 0 of a cluster job does.
absl::StatusOr<fulcrum::training::TrainerOptions> LocalTrainerOptions(const fulcrum::v1::JobSpec& spec,
                                                                      fulcrum::compute::Backend* backend,
                                                                      const fulcrum::models::ModelConfig& mc,
                                                                      const fulcrum::data::Dataset& train) {
  fulcrum::RankEnvironment env;
  env.job_id = "local";
  env.batch_size = static_cast<int>(spec.batch_size());
  if (spec.batch_size_auto().enabled() && env.batch_size == 0) {
    const auto o = fulcrum::training::AutoBatchOptionsFromSpec(spec.batch_size_auto());
    std::cout << "batch_size auto: timing batches from " << o.base_batch_size << " on " << backend->name() << "\n";
    auto choice = fulcrum::training::ChooseBatchSize(
        o, backend->memory_bytes(), static_cast<int64_t>(train.size()),
        [&](int b) { return fulcrum::training::MeasureBatch(backend, mc, train, b); });
    if (!choice.ok()) return choice.status();
    std::cout << "batch_size auto: " << choice->summary << "\n";
    env.batch_size = choice->batch;
    env.lr_scaling = choice->lr;
  }
  env.decode_threads = absl::GetFlag(FLAGS_decode_threads);
  env.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  env.gpu = backend->is_gpu();
  env.device_data = absl::GetFlag(FLAGS_device_data);
  return fulcrum::TrainerOptionsFor(spec, env);
}

// The spec's epochs, each evaluated on `test` (when given), with a line of
// figures each and one of totals for scripts.
absl::Status TrainEpochs(fulcrum::training::Trainer& trainer, const fulcrum::v1::JobSpec& spec,
                         const fulcrum::data::Dataset& train, const fulcrum::data::Dataset* test) {
  double examples = 0, seconds = 0, accuracy = 0;
  for (uint32_t e = 0; e < spec.epochs(); ++e) {
    auto r = trainer.TrainEpoch(train, static_cast<int>(e));
    if (!r.ok()) return r.status();
    examples += r->train.examples;
    seconds += r->seconds;
    if (test != nullptr) {
      auto t = trainer.Evaluate(*test);
      if (!t.ok()) return t.status();
      accuracy = t->accuracy;
      if (t->auc > 0) std::printf("epoch %u: test AUC %.4f, log loss %.4f\n", e + 1, t->auc, t->loss);
      if (t->rmse > 0) std::printf("epoch %u: test RMSE %.4f\n", e + 1, t->rmse);
    }
    std::printf("epoch %u: %.0f samples/s, train loss %.4f, test accuracy %.4f\n", e + 1, r->samples_per_second,
                r->train.loss, accuracy);
    std::printf("  %.3f s: pull %.3f s, compute %.3f s, push %.3f s, data %.3f s, prepare %.3f s\n", r->seconds,
                r->pull_wait_seconds, r->compute_seconds, r->push_wait_seconds, r->data_wait_seconds,
                r->prepare_seconds);
    if (r->sparse_rows_pulled > 0 && r->seconds > 0) {
      std::printf("  sparse rows pulled: %.0f/s, %.1f per example\n", r->sparse_rows_pulled / r->seconds,
                  static_cast<double>(r->sparse_rows_pulled) / std::max<int64_t>(r->train.examples, 1));
    }
  }
  RETURN_IF_ERROR(trainer.Flush());
  std::printf("samples_per_second=%.0f test_accuracy=%.4f\n", seconds > 0 ? examples / seconds : 0, accuracy);
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  fulcrum::SetUsage("Train a Fulcrum job spec in one process");
  absl::ParseCommandLine(argc, argv);
  fulcrum::v1::JobSpec spec;
  absl::Status s = fulcrum::config::ParseSpecFile(absl::GetFlag(FLAGS_spec), &spec);
  fulcrum::config::NormalizeJobSpec(&spec);
  if (s.ok()) s = fulcrum::config::ValidateJobSpec(spec);
  if (!s.ok()) {
    std::cerr << "fulcrum-train-local: " << s.message() << "\n";
    return 2;
  }
  if (absl::GetFlag(FLAGS_epochs) > 0) spec.set_epochs(static_cast<uint32_t>(absl::GetFlag(FLAGS_epochs)));
  if (spec.seed() == 0) spec.set_seed(1);
  std::string dir = absl::GetFlag(FLAGS_data_dir);
  if (dir.empty()) dir = fulcrum::DefaultDataDir();
  auto fail = [](const absl::Status& st) {
    std::cerr << "fulcrum-train-local: " << st << "\n";
    return 1;
  };
  auto train_all = fulcrum::LoadDataSource(spec.data().train(), dir);
  if (!train_all.ok()) return fail(train_all.status());
  std::shared_ptr<const fulcrum::data::Dataset> test_source;
  if (spec.data().has_test()) {
    auto t = fulcrum::LoadDataSource(spec.data().test(), dir);
    if (!t.ok()) return fail(t.status());
    test_source = *std::move(t);
  }
  // The test source, or test_fraction of the training rows, as fulcrum-worker splits them.
  auto split = fulcrum::SplitJobData(spec, *std::move(train_all), std::move(test_source));
  if (!split.ok()) return fail(split.status());
  const fulcrum::data::Dataset& train = *split->train;
  const fulcrum::data::Dataset* test = split->test.get();
  std::string why;
  auto backend = fulcrum::compute::CreateBackend(absl::GetFlag(FLAGS_device), &why, absl::GetFlag(FLAGS_cpu_threads));
  if (!backend.ok()) return fail(backend.status());
  auto mc = fulcrum::ModelConfigFor(spec, train);
  if (!mc.ok()) return fail(mc.status());
  // What was read, and whether it fits the model, as fulcrum-worker says it.
  const fulcrum::v1::DataSummary train_data = fulcrum::SummarizeData(spec.data().train(), train);
  std::cout << "train data " << fulcrum::config::DataSummaryLine(train_data) << "\n";
  fulcrum::v1::DataSummary test_data;
  if (test != nullptr) {
    test_data = fulcrum::SummarizeData(spec.data().has_test() ? spec.data().test() : spec.data().train(), *test);
    std::cout << "test data " << fulcrum::config::DataSummaryLine(test_data) << "\n";
  }
  s = fulcrum::CheckClasses(spec, *mc, train_data, test != nullptr ? &test_data : nullptr);
  if (!s.ok()) return fail(s);
  auto model = fulcrum::models::CreateModel(*mc, backend->get());
  if (!model.ok()) return fail(model.status());
  auto server = fulcrum::LocalPsClient::NewServer();
  if (!server.ok()) return fail(server.status());
  fulcrum::LocalPsClient client(*server, "local", 0);
  fulcrum::v1::ConsistencySpec bsp;
  bsp.set_model(fulcrum::v1::ConsistencySpec::BSP);
  // One worker: BSP, unless the spec asks for local steps (rounds then).
  const bool local = spec.consistency().model() == fulcrum::v1::ConsistencySpec::LOCAL;
  s = client.CreateJob(fulcrum::training::JobSpecFor(**model, "local", spec.optimizer(), local ? spec.consistency() : bsp, 1));
  if (!s.ok()) return fail(s);
  auto to = LocalTrainerOptions(spec, backend->get(), *mc, train);
  if (!to.ok()) return fail(to.status());
  fulcrum::training::Trainer trainer(model->get(), &client, *to);
  std::cout << "training " << spec.name() << " in one process on " << (*backend)->name() << "\n";
  if (s = TrainEpochs(trainer, spec, train, test); !s.ok()) return fail(s);
  return 0;
}
