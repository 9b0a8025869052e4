#include "worker/training/progressive.h"

#include <algorithm>
#include <cmath>

namespace fulcrum::training {

ProgressiveWindow::ProgressiveWindow(uint64_t window)
    : chunk_size_(std::max<uint64_t>(1, (window == 0 ? kDefaultWindow : window) / kChunks)), chunks_(kChunks) {
  for (Chunk& c : chunks_) {
    c.positives.assign(kBins, 0);
    c.negatives.assign(kBins, 0);
  }
}

void ProgressiveWindow::Add(const float* scores, const float* labels, size_t n) {
  constexpr double kEps = 1e-7;
  for (size_t i = 0; i < n; ++i) {
    Chunk* c = &chunks_[current_];
    if (c->examples == chunk_size_) {
      // The oldest chunk leaves the window.
      current_ = (current_ + 1) % chunks_.size();
      c = &chunks_[current_];
      std::fill(c->positives.begin(), c->positives.end(), 0);
      std::fill(c->negatives.begin(), c->negatives.end(), 0);
      c->loss = 0;
      c->examples = 0;
    }
    float p = scores[i];
    if (!(p >= 0)) p = 0;  // NaN too: counted, at the bottom
    if (p > 1) p = 1;
    const int bin = std::min(kBins - 1, static_cast<int>(p * kBins));
    const double q = std::clamp(static_cast<double>(p), kEps, 1 - kEps);
    if (labels[i] > 0.5f) {
      ++c->positives[bin];
      c->loss -= std::log(q);
    } else {
      ++c->negatives[bin];
      c->loss -= std::log(1 - q);
    }
    ++c->examples;
  }
}

ProgressiveWindow::Figures ProgressiveWindow::Now() const {
  Figures f;
  double loss = 0;
  for (const Chunk& c : chunks_) {
    f.examples += c.examples;
    loss += c.loss;
  }
  if (f.examples == 0) return f;
  f.log_loss = loss / static_cast<double>(f.examples);
  // Pairs (positive, negative) ranked right, ties in a bin counting half.
  double pairs_right = 0, negatives_below = 0, positives = 0;
  for (int b = 0; b < kBins; ++b) {
    double pos = 0, neg = 0;
    for (const Chunk& c : chunks_) {
      pos += c.positives[b];
      neg += c.negatives[b];
    }
    pairs_right += pos * (negatives_below + 0.5 * neg);
    negatives_below += neg;
    positives += pos;
  }
  if (positives > 0 && negatives_below > 0) f.auc = pairs_right / (positives * negatives_below);
  return f;
}

}  // namespace fulcrum::training
