// Progressive validation of a binary task (docs/training.md, "Progressive
// validation"). The trainer scores each batch with the forward pass before
// the batch's gradients reach the servers, so those scores are predictions
// on examples the model has not yet learned from: over a stream read once,
// the AUC and log loss of the last N of them are test figures of the model
// as it is now, with no data held out.
//
// ProgressiveWindow keeps the last `window` examples as kChunks chunks of
// score histograms (kBins equal bins over [0, 1], positives and negatives
// apart) with their log-loss sums: adding is O(1) per example, the figures
// O(kBins * kChunks), and memory fixed (256 KiB) whatever the window. The
// window holds the current chunk and the kChunks - 1 before it, so between
// (kChunks - 1) / kChunks of `window` and `window` examples once full. AUC
// counts two examples in one bin as a tie (half a pair): with 4 096 bins its
// error against an exact AUC is below 0.001 on scores spread over [0, 1]
// (tests/worker/training/progressive_test.cc).
#ifndef FULCRUM_WORKER_TRAINING_PROGRESSIVE_H_
#define FULCRUM_WORKER_TRAINING_PROGRESSIVE_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fulcrum::training {

class ProgressiveWindow {
 public:
  static constexpr int kBins = 4096;
  static constexpr int kChunks = 8;
  static constexpr uint64_t kDefaultWindow = uint64_t{1} << 20;

  // `window`: examples kept (0: kDefaultWindow; at least kChunks).
  explicit ProgressiveWindow(uint64_t window = 0);

  // `n` examples: each one's predicted probability of the positive class
  // and its label (positive when > 0.5).
  void Add(const float* scores, const float* labels, size_t n);

  struct Figures {
    uint64_t examples = 0;  // in the window now
    double auc = 0;         // 0 until the window holds both classes
    double log_loss = 0;    // mean per example
  };
  Figures Now() const;

  uint64_t window() const { return chunk_size_ * kChunks; }

 private:
  struct Chunk {
    std::vector<uint32_t> positives, negatives;  // kBins each
    double loss = 0;
    uint64_t examples = 0;
  };
  uint64_t chunk_size_;
  std::vector<Chunk> chunks_;  // a ring; current_ is filling
  size_t current_ = 0;
};

}  // namespace fulcrum::training

#endif  // FULCRUM_WORKER_TRAINING_PROGRESSIVE_H_
