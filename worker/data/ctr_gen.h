// Click-through data in the Criteo layout (dataset.h, ReadCriteo) drawn from
// a planted model, so the best AUC and log loss any model can reach on it
// are known: `fulcrum-datagen ctr` and the CTR benchmarks use it.
//
// Each row: 13 integer features, counts drawn as floor(exp(N(mu_i, 1))) - 1
// (mu_i = 1 + i mod 4); 26 categorical fields whose ids follow a Zipf law
// over a per-field vocabulary, written as 8 hexadecimal digits; each field
// absent with probability `missing`. The label is drawn with probability
// sigmoid(logit), where logit = bias + sum_i w_i (log(1 + x_i) - mu_i)
// + sum_j e_j(id_j) + sum over pairs j < k of the first 8 fields of
// <v_j(id_j), v_k(id_k)>: a logistic term over the dense features, a
// weight per categorical value and pairwise interactions of `dim`-wide
// field embeddings (a factorization machine's form, as DeepFM's). Weights
// and embeddings are functions of (seed, field, id); every row's draws are
// functions of (seed, split, row), so the files are the same for any
// number of threads.
#ifndef FULCRUM_WORKER_DATA_CTR_GEN_H_
#define FULCRUM_WORKER_DATA_CTR_GEN_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace fulcrum::data {

struct CtrGenOptions {
  std::string train_path;  // a path ending in .gz is written gzip-compressed
  std::string test_path;   // empty: no test file
  int64_t train_rows = 100000;
  int64_t test_rows = 20000;
  uint64_t seed = 1;
  int threads = 0;         // 0: one per core
  int64_t vocab = 100000;  // the largest field's ids; field j has vocab >> (j mod 8), at least 4
  double zipf = 1.1;       // the ids' Zipf exponent
  int dim = 4;             // the planted embeddings' width
  double missing = 0.03;
  double bias = -1.2;      // the planted logit's constant
  // Ids that keep arriving: new ids per row in the largest field (field j:
  // drift x its vocabulary / the largest). A field's Zipf ranks map to ids
  // that move on with the row (test rows come after the training rows): the
  // most popular id at row r is one born at r, and an id's popularity decays
  // as newer ids take the first ranks, until it leaves the vocabulary.
  // 0: a fixed vocabulary.
  double drift = 0;
};

struct CtrGenStats {
  int64_t train_rows = 0, test_rows = 0;
  int64_t bytes = 0;            // written, before compression
  double positive_rate = 0;     // over the training rows
  // The planted model's own figures on the test rows (on the training rows
  // without a test file): what no model can beat but by chance.
  double best_auc = 0;
  double best_log_loss = 0;
  double base_log_loss = 0;     // a constant prediction of the positive rate
};

absl::StatusOr<CtrGenStats> GenerateCtr(const CtrGenOptions& options);

}  // namespace fulcrum::data

#endif  // FULCRUM_WORKER_DATA_CTR_GEN_H_
