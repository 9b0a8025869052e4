#include "common/binary_metrics.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace fulcrum {

double Auc(const std::vector<double>& scores, const std::vector<float>& labels) {
  const size_t n = std::min(scores.size(), labels.size());
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return scores[a] < scores[b]; });
  // Sum of the positives' ranks (1-based, ties given their mean rank).
  double rank_sum = 0;
  double positives = 0;
  for (size_t i = 0; i < n;) {
    size_t j = i;
    double pos = 0;
    while (j < n && scores[order[j]] == scores[order[i]]) pos += labels[order[j++]] > 0.5f ? 1 : 0;
    const double mean_rank = (static_cast<double>(i + 1) + static_cast<double>(j)) / 2;
    rank_sum += pos * mean_rank;
    positives += pos;
    i = j;
  }
  const double negatives = static_cast<double>(n) - positives;
  if (positives == 0 || negatives == 0) return 0.5;
  return (rank_sum - positives * (positives + 1) / 2) / (positives * negatives);
}

double LogLoss(const std::vector<double>& probabilities, const std::vector<float>& labels) {
  const size_t n = std::min(probabilities.size(), labels.size());
  if (n == 0) return 0;
  double sum = 0;
  for (size_t i = 0; i < n; ++i) {
    const double p = std::clamp(probabilities[i], 1e-15, 1 - 1e-15);
    sum -= labels[i] > 0.5f ? std::log(p) : std::log(1 - p);
  }
  return sum / static_cast<double>(n);
}

}  // namespace fulcrum
