#include "worker/data/pipeline.h"

#include <chrono>
#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/shard_map.h"

namespace fulcrum::data {

std::vector<int64_t> ShardOrder(size_t n, int rank, int world_size, uint64_t seed, int epoch, bool shuffle) {
  std::vector<int64_t> all(n);
  for (size_t i = 0; i < n; ++i) all[i] = static_cast<int64_t>(i);
  if (shuffle) {
    // Fisher-Yates with our own generator (SplitMix64 over Mix64), so the
    // order does not depend on the standard library's std::shuffle.
    uint64_t state = Mix64(seed ^ (0x9e3779b97f4a7c15ull * static_cast<uint64_t>(epoch + 1)));
    for (size_t i = n; i > 1; --i) {
      state += 0x9e3779b97f4a7c15ull;
      const uint64_t r = Mix64(state);
      const size_t j = static_cast<size_t>(r % i);
      std::swap(all[i - 1], all[j]);
    }
  }
  if (world_size <= 1) return all;
  const size_t per_rank = n / world_size;
  std::vector<int64_t> mine;
  mine.reserve(per_rank);
  for (size_t k = 0; k < per_rank; ++k) mine.push_back(all[k * world_size + rank]);
  return mine;
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> SplitIndices(size_t n, double test_fraction, uint64_t seed) {
  std::vector<int64_t> all = ShardOrder(n, 0, 1, seed, /*epoch=*/-1, /*shuffle=*/true);
  const size_t test = static_cast<size_t>(n * test_fraction);
  std::vector<int64_t> test_idx(all.begin(), all.begin() + test), train_idx(all.begin() + test, all.end());
  std::sort(test_idx.begin(), test_idx.end());
  std::sort(train_idx.begin(), train_idx.end());
  return {std::move(train_idx), std::move(test_idx)};
}

Prefetcher::Prefetcher(const Dataset* dataset, std::vector<int64_t> order, int epoch, PrefetchOptions options,
                       compute::Backend* backend)
    : dataset_(dataset), order_(std::move(order)), epoch_(epoch), options_(options), backend_(backend) {
  const int64_t b = std::max(1, options_.batch_size);
  const int64_t n = static_cast<int64_t>(order_.size());
  num_batches_ = options_.drop_last ? n / b : (n + b - 1) / b;
  thread_ = std::thread([this] { Run(); });
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Prefetcher::Run() {
  const int b = std::max(1, options_.batch_size);
  for (int64_t i = 0; i < num_batches_; ++i) {
    std::unique_ptr<Batch> batch;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return stop_ || static_cast<int>(ready_.size()) < options_.depth; });
      if (stop_) return;
      if (!free_.empty()) {
        batch = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!batch) batch = std::make_unique<Batch>();
    const int64_t begin = i * b;
    const int n = static_cast<int>(std::min<int64_t>(b, static_cast<int64_t>(order_.size()) - begin));
    dataset_->Fill(order_.data() + begin, n, batch.get());
    batch->epoch = epoch_;
    batch->index = i;
    absl::StatusOr<std::unique_ptr<Batch>> item = std::move(batch);
    if (backend_ != nullptr) {
      Batch& bt = **item;
      const size_t bytes = (bt.dense.size() + bt.labels.size()) * sizeof(float);
      if (bt.staged.bytes() < bytes) {
        bt.staged.Reset();
        auto buf = backend_->AllocateHost(bytes);
        if (!buf.ok()) {
          item = absl::Status(buf.status().code(), absl::StrCat("staging batch ", i, ": ", buf.status().message()));
        } else {
          bt.staged = std::move(*buf);
        }
      }
      if (item.ok()) {
        // Sparse batches have no dense part: memcpy from an empty vector's
        // null data() is undefined even for 0 bytes (UBSan).
        if (!bt.dense.empty()) std::memcpy(bt.staged.data(), bt.dense.data(), bt.dense.size() * sizeof(float));
        if (!bt.labels.empty()) {
          std::memcpy(bt.staged.as<float>() + bt.dense.size(), bt.labels.data(), bt.labels.size() * sizeof(float));
        }
      }
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      ready_.push_back(std::move(item));
      ++produced_;
    }
    cv_.notify_all();
  }
}

absl::StatusOr<std::unique_ptr<Batch>> Prefetcher::Next() {
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return !ready_.empty() || produced_ == num_batches_; });
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (ready_.empty()) return std::unique_ptr<Batch>();
  auto item = std::move(ready_.front());
  ready_.pop_front();
  l.unlock();
  cv_.notify_all();
  return item;
}

void Prefetcher::Recycle(std::unique_ptr<Batch> batch) {
  if (!batch) return;
  std::lock_guard<std::mutex> l(mu_);
  if (free_.size() < static_cast<size_t>(options_.depth) + 2) free_.push_back(std::move(batch));
}

double Prefetcher::wait_seconds() const {
  std::lock_guard<std::mutex> l(mu_);
  return wait_seconds_;
}

}  // namespace fulcrum::data
