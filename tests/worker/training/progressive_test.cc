// Progressive validation's window (worker/training/progressive.h): its AUC
// and log loss against exact ones over the same examples, and a window that
// forgets what slid out of it.
#include "worker/training/progressive.h"

#include <cmath>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "common/binary_metrics.h"

namespace fulcrum::training {
namespace {

using fulcrum::Auc;

struct Examples {
  std::vector<float> scores, labels;
};

// Labels drawn with P(positive) rising with the score by `signal`.
Examples Draw(size_t n, double signal, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  Examples e;
  for (size_t i = 0; i < n; ++i) {
    const double s = u(rng);
    e.scores.push_back(static_cast<float>(s));
    e.labels.push_back(u(rng) < 0.5 + signal * (s - 0.5) ? 1.0f : 0.0f);
  }
  return e;
}

double ExactLogLoss(const Examples& e, size_t begin) {
  double sum = 0;
  for (size_t i = begin; i < e.scores.size(); ++i) {
    const double p = std::clamp(static_cast<double>(e.scores[i]), 1e-7, 1 - 1e-7);
    sum -= e.labels[i] > 0.5f ? std::log(p) : std::log(1 - p);
  }
  return sum / static_cast<double>(e.scores.size() - begin);
}

TEST_CASE("a window's AUC and log loss match exact ones over the same examples", "[progressive]") {
  ProgressiveWindow w(1 << 16);
  const Examples e = Draw(40000, 0.6, 1);
  w.Add(e.scores.data(), e.labels.data(), e.scores.size());
  const ProgressiveWindow::Figures f = w.Now();
  CHECK(f.examples == 40000);
  const double exact = Auc(std::vector<double>(e.scores.begin(), e.scores.end()), e.labels);
  INFO("window " << f.auc << " exact " << exact);
  CHECK(exact > 0.6);  // the data has signal
  CHECK(std::abs(f.auc - exact) < 0.001);
  CHECK(std::abs(f.log_loss - ExactLogLoss(e, 0)) < 1e-9);
}

TEST_CASE("a window keeps only its trailing examples: a model that got better shows it", "[progressive]") {
  // 8 chunks of 1 000: after 4 000 examples of noise then 10 000 with
  // signal, only signal is left.
  ProgressiveWindow w(8000);
  REQUIRE(w.window() == 8000);
  const Examples noise = Draw(4000, 0.0, 2);
  w.Add(noise.scores.data(), noise.labels.data(), noise.scores.size());
  const double before = w.Now().auc;
  CHECK(std::abs(before - 0.5) < 0.05);
  const Examples signal = Draw(10000, 0.9, 3);
  // In pieces of odd sizes, as batches come.
  for (size_t i = 0; i < signal.scores.size(); i += 333) {
    const size_t n = std::min<size_t>(333, signal.scores.size() - i);
    w.Add(signal.scores.data() + i, signal.labels.data() + i, n);
  }
  const ProgressiveWindow::Figures f = w.Now();
  // 14 000 examples filled 14 chunks of 1 000: the window is the last 8,
  // all signal.
  CHECK(f.examples == 8000);
  const size_t begin = signal.scores.size() - f.examples;
  const Examples tail{std::vector<float>(signal.scores.begin() + static_cast<std::ptrdiff_t>(begin), signal.scores.end()),
                      std::vector<float>(signal.labels.begin() + static_cast<std::ptrdiff_t>(begin), signal.labels.end())};
  const double exact = Auc(std::vector<double>(tail.scores.begin(), tail.scores.end()), tail.labels);
  INFO("window " << f.auc << " exact over its examples " << exact);
  CHECK(std::abs(f.auc - exact) < 0.002);
  CHECK(f.auc > before + 0.15);
  CHECK(std::abs(f.log_loss - ExactLogLoss(signal, begin)) < 1e-9);
}

TEST_CASE("a window of one class has no AUC yet, and bad scores are clamped, not lost", "[progressive]") {
  ProgressiveWindow w(800);
  const std::vector<float> scores = {0.9f, 0.8f, NAN, 1.5f, -0.2f};
  const std::vector<float> ones(scores.size(), 1.0f);
  w.Add(scores.data(), ones.data(), scores.size());
  ProgressiveWindow::Figures f = w.Now();
  CHECK(f.examples == 5);
  CHECK(f.auc == 0);
  CHECK(std::isfinite(f.log_loss));
  CHECK(f.log_loss > 0);
  const float negative_score = 0.1f, zero = 0.0f;
  w.Add(&negative_score, &zero, 1);
  f = w.Now();
  // Positives at 0.9, 0.8, 1 (clamped 1.5) beat the negative; NaN and -0.2
  // (clamped to 0) lose to it.
  CHECK(f.auc == Approx(3.0 / 5.0));
}

}  // namespace
}  // namespace fulcrum::training
