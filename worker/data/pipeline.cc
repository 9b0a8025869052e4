#include "worker/data/pipeline.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/shard_map.h"

namespace fulcrum::data {

void DistinctKeys(const uint64_t* keys, size_t n, std::vector<uint64_t>* distinct, std::vector<int32_t>* index) {
  distinct->clear();
  index->resize(n);
  absl::flat_hash_map<uint64_t, int32_t> seen;
  seen.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    auto [it, fresh] = seen.try_emplace(keys[i], static_cast<int32_t>(distinct->size()));
    if (fresh) distinct->push_back(keys[i]);
    (*index)[i] = it->second;
  }
}

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

int DefaultDecodeThreads(int cores, bool gpu) {
  if (!gpu) return 1;
  return std::clamp(cores / 2, 1, 4);
}

Prefetcher::Prefetcher(const Dataset* dataset, std::vector<int64_t> order, int epoch, PrefetchOptions options,
                       compute::Backend* backend)
    : dataset_(dataset), order_(std::move(order)), epoch_(epoch), options_(options), backend_(backend) {
  const int64_t b = std::max(1, options_.batch_size);
  const int64_t n = static_cast<int64_t>(order_.size());
  num_batches_ = options_.drop_last ? n / b : (n + b - 1) / b;
  num_threads_ = static_cast<int>(std::clamp<int64_t>(options_.threads, 1, std::max<int64_t>(1, num_batches_)));
  for (int t = 0; t < num_threads_; ++t) threads_.emplace_back([this, t] { Run(t); });
}

Prefetcher::~Prefetcher() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  if (options_.pool == nullptr) return;
  for (auto& b : free_) options_.pool->Give(std::move(b));
  for (auto& [i, item] : ready_) {
    if (item.ok()) options_.pool->Give(std::move(*item));
  }
}

std::unique_ptr<Batch> BatchPool::Take() {
  std::lock_guard<std::mutex> l(mu_);
  if (batches_.empty()) return nullptr;
  std::unique_ptr<Batch> b = std::move(batches_.back());
  batches_.pop_back();
  return b;
}

void BatchPool::Give(std::unique_ptr<Batch> batch) {
  if (batch == nullptr) return;
  std::lock_guard<std::mutex> l(mu_);
  if (batches_.size() < max_) batches_.push_back(std::move(batch));
}

absl::StatusOr<std::unique_ptr<Batch>> Prefetcher::Produce(int64_t i, std::unique_ptr<Batch> batch) {
  const int b = std::max(1, options_.batch_size);
  const int64_t begin = i * b;
  const int n = static_cast<int>(std::min<int64_t>(b, static_cast<int64_t>(order_.size()) - begin));
  const int64_t* idx = order_.data() + begin;
  if (options_.device != nullptr) {
    // Features stay on the device: the rows to gather, and the labels.
    batch->Reset(n, 0);
    batch->offsets.clear();
    batch->num_features = dataset_->num_features();
    batch->device = options_.device;
    batch->rows.resize(n);
    for (int k = 0; k < n; ++k) {
      batch->labels[k] = dataset_->label(static_cast<size_t>(idx[k]));
      batch->rows[k] = static_cast<int32_t>(dataset_->stored_row(idx[k]));
    }
  } else {
    dataset_->Fill(idx, n, batch.get());
    if (batch->sparse() && options_.distinct_keys) DistinctKeys(batch->keys.data(), batch->keys.size(), &batch->distinct_keys, &batch->key_index);
    if (options_.host_work) options_.host_work(batch.get());
  }
  batch->epoch = epoch_;
  batch->index = i;
  if (backend_ == nullptr) return batch;
  Batch& bt = *batch;
  const size_t floats = bt.dense.size() + bt.labels.size();
  const size_t bytes = floats * sizeof(float) + bt.rows.size() * sizeof(int32_t);
  if (bt.staged.bytes() < bytes) {
    // Room for a full batch (bytes grow with its examples), so an epoch's
    // short last batch, pooled, stages the next epoch's batches as well.
    const size_t room = n > 0 && n < b ? bytes / static_cast<size_t>(n) * static_cast<size_t>(b) : bytes;
    bt.staged.Reset();
    auto buf = backend_->AllocateHost(room);
    if (!buf.ok()) {
      return absl::Status(buf.status().code(), absl::StrCat("staging batch ", i, ": ", buf.status().message()));
    }
    bt.staged = std::move(*buf);
  }
  // Empty parts are skipped: memcpy from an empty vector's null data() is
  // undefined even for 0 bytes (UBSan).
  if (!bt.dense.empty()) std::memcpy(bt.staged.data(), bt.dense.data(), bt.dense.size() * sizeof(float));
  if (!bt.labels.empty()) {
    std::memcpy(bt.staged.as<float>() + bt.dense.size(), bt.labels.data(), bt.labels.size() * sizeof(float));
  }
  if (!bt.rows.empty()) {
    std::memcpy(bt.staged.as<float>() + floats, bt.rows.data(), bt.rows.size() * sizeof(int32_t));
  }
  const bool upload = options_.upload == PrefetchOptions::Upload::kOn ||
                      (options_.upload == PrefetchOptions::Upload::kAuto && backend_->is_gpu());
  if (upload && !bt.dense.empty()) {
    const size_t dense_bytes = bt.dense.size() * sizeof(float);
    if (bt.uploaded.bytes() < dense_bytes) {
      bt.uploaded.Reset();
      auto buf = backend_->Allocate(dense_bytes);
      if (!buf.ok()) {
        return absl::Status(buf.status().code(), absl::StrCat("uploading batch ", i, ": ", buf.status().message()));
      }
      bt.uploaded = std::move(*buf);
    }
    absl::Status s = backend_->UploadAsync(bt.uploaded.data(), bt.staged.data(), dense_bytes, &bt.upload);
    if (!s.ok()) return absl::Status(s.code(), absl::StrCat("uploading batch ", i, ": ", s.message()));
    bt.features_uploaded = true;
  }
  return batch;
}

void Prefetcher::Run(int thread) {
  // Decoding is throughput work: as a batch thread it does not preempt the
  // training thread when the consumer's notify wakes it (on a machine with
  // fewer cores than busy threads, that preemption delays the next step by
  // a whole batch's decode). It still gets its share of the cores.
#ifdef SCHED_BATCH
  sched_param param{};
  param.sched_priority = 0;
  (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
#endif
  for (int64_t i = thread; i < num_batches_; i += num_threads_) {
    std::unique_ptr<Batch> batch;
    {
      std::unique_lock<std::mutex> l(mu_);
      // At most `depth` batches decoded ahead of the consumer.
      cv_.wait(l, [&] { return stop_ || i < consumed_ + options_.depth; });
      if (stop_) return;
      if (!free_.empty()) {
        batch = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!batch && options_.pool != nullptr) batch = options_.pool->Take();
    if (!batch) batch = std::make_unique<Batch>();
    absl::StatusOr<std::unique_ptr<Batch>> item = Produce(i, std::move(batch));
    {
      std::lock_guard<std::mutex> l(mu_);
      ready_.emplace(i, std::move(item));
    }
    cv_.notify_all();
  }
}

absl::StatusOr<std::unique_ptr<Batch>> Prefetcher::Next() {
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_lock<std::mutex> l(mu_);
  cv_.wait(l, [&] { return consumed_ == num_batches_ || ready_.count(consumed_) > 0; });
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (consumed_ == num_batches_) return std::unique_ptr<Batch>();
  auto it = ready_.find(consumed_);
  auto item = std::move(it->second);
  ready_.erase(it);
  ++consumed_;
  l.unlock();
  cv_.notify_all();
  return item;
}

const Batch* Prefetcher::Peek() const {
  std::lock_guard<std::mutex> l(mu_);
  auto it = ready_.find(consumed_);
  if (it == ready_.end() || !it->second.ok()) return nullptr;
  return it->second->get();
}

void Prefetcher::Recycle(std::unique_ptr<Batch> batch) {
  if (!batch) return;
  std::unique_lock<std::mutex> l(mu_);
  if (free_.size() < static_cast<size_t>(options_.depth) + 2) {
    free_.push_back(std::move(batch));
  } else if (options_.pool != nullptr) {
    l.unlock();
    options_.pool->Give(std::move(batch));
  }
}

double Prefetcher::wait_seconds() const {
  std::lock_guard<std::mutex> l(mu_);
  return wait_seconds_;
}

}  // namespace fulcrum::data
