// fulcrum-datagen: synthetic training data with known answers.
//   fulcrum-datagen ctr --train=ctr.train.tsv.gz --test=ctr.test.tsv.gz --train_rows=1000000
// writes click-through data in the Criteo layout from a planted model
// (worker/data/ctr_gen.h) and prints the best AUC and log loss a model can
// reach on the test file.
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "common/flags_usage.h"
#include "worker/data/ctr_gen.h"

ABSL_FLAG(std::string, train, "", "ctr: the training file (a name ending in .gz is compressed)");
ABSL_FLAG(std::string, test, "", "ctr: the test file (optional)");
ABSL_FLAG(int64_t, train_rows, 100000, "ctr: training rows");
ABSL_FLAG(int64_t, test_rows, 20000, "ctr: test rows");
ABSL_FLAG(uint64_t, seed, 1, "ctr: the planted model's and the draws' seed");
ABSL_FLAG(int32_t, threads, 0, "ctr: generating threads (0: one per core)");
ABSL_FLAG(int64_t, vocab, 100000, "ctr: ids of the largest categorical field (field j has vocab >> (j mod 8))");
ABSL_FLAG(double, zipf, 1.1, "ctr: the categorical ids' Zipf exponent");
ABSL_FLAG(double, drift, 0,
          "ctr: new ids per row in the largest field (ids that keep arriving, popularity decaying with age; 0: a "
          "fixed vocabulary)");
ABSL_FLAG(int32_t, dim, 4, "ctr: the planted field embeddings' width");
ABSL_FLAG(double, missing, 0.03, "ctr: the probability that a feature is absent");

int main(int argc, char** argv) {
  fulcrum::SetUsage("fulcrum-datagen ctr --train=FILE [--test=FILE] [--train_rows=N]: synthetic data with known answers");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2 || std::string(args[1]) != "ctr") {
    std::fprintf(stderr, "fulcrum-datagen: give the kind of data to write: ctr (see --help)\n");
    return 2;
  }
  fulcrum::data::CtrGenOptions o;
  o.train_path = absl::GetFlag(FLAGS_train);
  o.test_path = absl::GetFlag(FLAGS_test);
  o.train_rows = absl::GetFlag(FLAGS_train_rows);
  o.test_rows = absl::GetFlag(FLAGS_test_rows);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.threads = absl::GetFlag(FLAGS_threads);
  o.vocab = absl::GetFlag(FLAGS_vocab);
  o.zipf = absl::GetFlag(FLAGS_zipf);
  o.drift = absl::GetFlag(FLAGS_drift);
  o.dim = absl::GetFlag(FLAGS_dim);
  o.missing = absl::GetFlag(FLAGS_missing);
  std::printf("fulcrum-datagen ctr: writing %lld training rows to %s%s\n", static_cast<long long>(o.train_rows),
              o.train_path.c_str(),
              o.test_path.empty() ? "" : (" and " + std::to_string(o.test_rows) + " test rows to " + o.test_path).c_str());
  std::fflush(stdout);
  const absl::Time t0 = absl::Now();
  auto stats = fulcrum::data::GenerateCtr(o);
  if (!stats.ok()) {
    std::fprintf(stderr, "fulcrum-datagen: %s\n", std::string(stats.status().message()).c_str());
    return stats.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::printf("wrote %lld + %lld rows, %.1f MB of text, in %.1f s; positive rate %.4f\n",
              static_cast<long long>(stats->train_rows), static_cast<long long>(stats->test_rows),
              static_cast<double>(stats->bytes) / 1e6, absl::ToDoubleSeconds(absl::Now() - t0), stats->positive_rate);
  std::printf("planted model on the %s rows: best AUC %.4f, best log loss %.4f (a constant prediction: %.4f)\n",
              stats->test_rows > 0 ? "test" : "training", stats->best_auc, stats->best_log_loss, stats->base_log_loss);
  return 0;
}
