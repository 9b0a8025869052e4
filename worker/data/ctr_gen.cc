#include "worker/data/ctr_gen.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/binary_metrics.h"
#include "common/shard_map.h"
#include "common/status_macros.h"
#include "worker/data/dataset.h"

namespace fulcrum::data {
namespace {

constexpr int kInteractingFields = 8;
constexpr int64_t kBlockRows = 16384;

// Deterministic draws from a 64-bit state (SplitMix64).
class Draws {
 public:
  explicit Draws(uint64_t seed) : state_(seed) {}
  uint64_t Next() { return Mix64(state_ += 0x9e3779b97f4a7c15ull); }
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  double Normal() {
    const double u = std::max(Uniform(), 1e-300), v = Uniform();
    return std::sqrt(-2 * std::log(u)) * std::cos(6.283185307179586 * v);
  }

 private:
  uint64_t state_;
};

uint64_t Key(uint64_t seed, uint64_t a, uint64_t b, uint64_t c = 0) {
  return Mix64(seed ^ Mix64(a * 0x100000001b3ull ^ Mix64(b ^ Mix64(c + 0x51ed27))));
}

class Planted {
 public:
  explicit Planted(const CtrGenOptions& o) : o_(o) {
    Draws d(Key(o.seed, 1, 0));
    for (double& w : w_) w = 0.3 * d.Normal();
    for (int j = 0; j < kCriteoCategoricals; ++j) {
      const int64_t n = std::max<int64_t>(4, o.vocab >> (j % 8));
      // The Zipf law's cumulative weights, for inverse sampling.
      std::vector<double>& cdf = cdf_[j];
      cdf.resize(static_cast<size_t>(n));
      double sum = 0;
      for (int64_t i = 0; i < n; ++i) cdf[static_cast<size_t>(i)] = sum += std::pow(static_cast<double>(i + 1), -o.zipf);
      for (double& c : cdf) c /= sum;
    }
    // Interactions add up to about unit variance over the 28 pairs.
    emb_scale_ = std::pow(1.0 / (28.0 * o.dim), 0.25);
  }

  // A field's id for a draw at row `at` of the log (training rows first).
  int64_t DrawId(int field, Draws& d, int64_t at) const {
    const std::vector<double>& cdf = cdf_[field];
    const int64_t rank = std::lower_bound(cdf.begin(), cdf.end(), d.Uniform()) - cdf.begin();
    if (o_.drift <= 0) return rank;
    // Ids born so far; rank 0 is the newest.
    const int64_t n = static_cast<int64_t>(cdf.size());
    const double per_row = o_.drift * static_cast<double>(n) / static_cast<double>(cdf_[0].size());
    return static_cast<int64_t>(std::floor(static_cast<double>(at) * per_row)) + n - 1 - rank;
  }
  double FieldWeight(int field, int64_t id) const {
    return 0.2 * Draws(Key(o_.seed, 2, static_cast<uint64_t>(field), static_cast<uint64_t>(id))).Normal();
  }
  void Embedding(int field, int64_t id, double* v) const {
    Draws d(Key(o_.seed, 3, static_cast<uint64_t>(field), static_cast<uint64_t>(id)));
    for (int k = 0; k < o_.dim; ++k) v[k] = emb_scale_ * d.Normal();
  }
  // The value written for a field's id: 8 hexadecimal digits, as Criteo's.
  uint32_t Hex(int field, int64_t id) const {
    return static_cast<uint32_t>(Key(o_.seed, 4, static_cast<uint64_t>(field), static_cast<uint64_t>(id)));
  }
  double w(int i) const { return w_[i]; }

 private:
  const CtrGenOptions& o_;
  double w_[kCriteoIntegers];
  std::vector<double> cdf_[kCriteoCategoricals];
  double emb_scale_;
};

// One row as a text line; returns the planted probability of a click.
double Row(const Planted& m, const CtrGenOptions& o, uint64_t split, int64_t row, std::string* out) {
  Draws d(Key(o.seed, 5 + split, static_cast<uint64_t>(row)));
  double logit = o.bias;
  std::string fields;
  for (int i = 0; i < kCriteoIntegers; ++i) {
    const double mu = 1 + i % 4;
    const double z = d.Normal();
    if (d.Uniform() < o.missing) {
      fields += '\t';
      continue;
    }
    const int64_t x = std::max<int64_t>(0, static_cast<int64_t>(std::floor(std::exp(mu + z))) - 1);
    logit += m.w(i) * (std::log1p(static_cast<double>(x)) - mu);
    absl::StrAppend(&fields, "\t", x);
  }
  std::vector<double> emb(static_cast<size_t>(kInteractingFields * o.dim), 0.0);
  for (int j = 0; j < kCriteoCategoricals; ++j) {
    const int64_t id = m.DrawId(j, d, split == 0 ? row : o.train_rows + row);
    if (d.Uniform() < o.missing) {
      fields += '\t';
      continue;
    }
    logit += m.FieldWeight(j, id);
    if (j < kInteractingFields) m.Embedding(j, id, emb.data() + static_cast<size_t>(j) * o.dim);
    absl::StrAppend(&fields, "\t", absl::Hex(m.Hex(j, id), absl::kZeroPad8));
  }
  for (int j = 0; j < kInteractingFields; ++j) {
    for (int k = j + 1; k < kInteractingFields; ++k) {
      double dot = 0;
      for (int c = 0; c < o.dim; ++c) dot += emb[static_cast<size_t>(j * o.dim + c)] * emb[static_cast<size_t>(k * o.dim + c)];
      logit += dot;
    }
  }
  const double p = 1 / (1 + std::exp(-logit));
  const bool click = d.Uniform() < p;
  absl::StrAppend(out, click ? "1" : "0", fields, "\n");
  return p;
}

class Output {
 public:
  static absl::StatusOr<std::unique_ptr<Output>> Open(const std::string& path) {
    auto out = std::unique_ptr<Output>(new Output());
    out->path_ = path;
    if (absl::EndsWith(path, ".gz")) {
      out->gz_ = gzopen(path.c_str(), "wb1");
      if (out->gz_ == nullptr) return absl::FailedPreconditionError(absl::StrCat(path, ": cannot create: ", std::strerror(errno)));
    } else {
      out->file_ = std::fopen(path.c_str(), "wb");
      if (out->file_ == nullptr) return absl::FailedPreconditionError(absl::StrCat(path, ": cannot create: ", std::strerror(errno)));
    }
    return out;
  }
  ~Output() { (void)Close(); }
  absl::Status Write(const std::string& s) {
    const bool ok = gz_ != nullptr ? gzwrite(gz_, s.data(), static_cast<unsigned>(s.size())) == static_cast<int>(s.size())
                                   : std::fwrite(s.data(), 1, s.size(), file_) == s.size();
    if (!ok) return absl::DataLossError(absl::StrCat(path_, ": write failed (disk full?)"));
    return absl::OkStatus();
  }
  absl::Status Close() {
    bool ok = true;
    if (gz_ != nullptr) ok = gzclose(gz_) == Z_OK;
    if (file_ != nullptr) ok = std::fclose(file_) == 0;
    gz_ = nullptr;
    file_ = nullptr;
    if (!ok) return absl::DataLossError(absl::StrCat(path_, ": closing failed (disk full?)"));
    return absl::OkStatus();
  }

 private:
  Output() = default;
  std::string path_;
  gzFile gz_ = nullptr;
  std::FILE* file_ = nullptr;
};

struct Split {
  std::vector<double> p;     // planted probabilities (kept for the figures)
  std::vector<float> label;
  int64_t bytes = 0;
};

// Writes `rows` rows of `split` to `path`, blocks generated on `threads`
// threads and written in order.
absl::Status WriteSplit(const Planted& m, const CtrGenOptions& o, uint64_t split, int64_t rows, int threads,
                        const std::string& path, bool keep, Split* out) {
  ASSIGN_OR_RETURN(std::unique_ptr<Output> file, Output::Open(path));
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  for (int64_t first = 0; first < blocks; first += threads) {
    const int64_t wave = std::min<int64_t>(threads, blocks - first);
    std::vector<std::string> text(static_cast<size_t>(wave));
    std::vector<std::vector<double>> probs(static_cast<size_t>(wave));
    std::vector<std::thread> pool;
    for (int64_t b = 0; b < wave; ++b) {
      pool.emplace_back([&, b] {
        const int64_t begin = (first + b) * kBlockRows, end = std::min(rows, begin + kBlockRows);
        for (int64_t r = begin; r < end; ++r) probs[static_cast<size_t>(b)].push_back(Row(m, o, split, r, &text[static_cast<size_t>(b)]));
      });
    }
    for (std::thread& t : pool) t.join();
    for (int64_t b = 0; b < wave; ++b) {
      const std::string& t = text[static_cast<size_t>(b)];
      RETURN_IF_ERROR(file->Write(t));
      out->bytes += static_cast<int64_t>(t.size());
      // Labels back from the text: the first character of each line.
      size_t at = 0;
      for (double p : probs[static_cast<size_t>(b)]) {
        if (keep) out->p.push_back(p);
        out->label.push_back(t[at] == '1' ? 1.0f : 0.0f);
        at = t.find('\n', at) + 1;
      }
    }
  }
  return file->Close();
}

}  // namespace

absl::StatusOr<CtrGenStats> GenerateCtr(const CtrGenOptions& o) {
  if (o.train_path.empty()) return absl::InvalidArgumentError("ctr: a training file path is required");
  if (o.train_rows < 1 || o.test_rows < 0) return absl::InvalidArgumentError("ctr: rows must be >= 1 (train), >= 0 (test)");
  if (o.vocab < 4 || o.dim < 1 || o.dim > 64 || !(o.zipf > 0) || !(o.missing >= 0 && o.missing < 1) ||
      !(o.drift >= 0 && o.drift <= 1000)) {
    return absl::InvalidArgumentError(
        "ctr: vocab >= 4, dim 1 to 64, zipf > 0, missing in [0, 1) and drift 0 to 1000 are required");
  }
  const int threads = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const Planted model(o);
  const bool has_test = !o.test_path.empty() && o.test_rows > 0;
  Split train, test;
  RETURN_IF_ERROR(WriteSplit(model, o, 0, o.train_rows, threads, o.train_path, !has_test, &train));
  if (has_test) RETURN_IF_ERROR(WriteSplit(model, o, 1, o.test_rows, threads, o.test_path, true, &test));
  CtrGenStats s;
  s.train_rows = o.train_rows;
  s.test_rows = has_test ? o.test_rows : 0;
  s.bytes = train.bytes + test.bytes;
  double positives = 0;
  for (float l : train.label) positives += l;
  s.positive_rate = positives / static_cast<double>(train.label.size());
  const Split& judged = has_test ? test : train;
  s.best_auc = Auc(judged.p, judged.label);
  s.best_log_loss = LogLoss(judged.p, judged.label);
  s.base_log_loss = LogLoss(std::vector<double>(judged.label.size(), s.positive_rate), judged.label);
  return s;
}

}  // namespace fulcrum::data
