#include "common/backoff.h"

#include <algorithm>

namespace fulcrum {

Backoff::Backoff(Options options, uint64_t seed)
    : options_(options), base_(options.initial), rng_(seed != 0 ? seed : std::random_device()()) {}

absl::Duration Backoff::Next() {
  const absl::Duration base = base_;
  base_ = std::min(base_ * options_.multiplier, options_.max);
  ++failures_;
  if (options_.jitter <= 0) return base;
  std::uniform_real_distribution<double> spread(1 - options_.jitter, 1 + options_.jitter);
  return std::min(base * spread(rng_), options_.max);
}

void Backoff::Reset() {
  base_ = options_.initial;
  failures_ = 0;
}

}  // namespace fulcrum
