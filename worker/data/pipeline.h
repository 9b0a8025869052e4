// Sharding, shuffling and prefetching.
//
// ShardOrder gives a worker its examples for one epoch: the whole dataset
// permuted by (seed, epoch), then every world_size-th example starting at
// rank, cut so every rank gets the same count (BSP needs every worker to run
// the same number of steps). The same seed gives the same batches.
//
// Prefetcher decodes batches on `threads` background threads, up to `depth`
// ahead of the consumer and handed out in order (batch i by thread i mod
// threads: the same batches whatever the thread count), and stages them in
// page-locked memory when given a backend; on a GPU each dense batch then
// starts its upload on the backend's upload stream at once, so it overlaps
// the steps still computing. With a DeviceData it decodes no
// features: it stages each batch's row numbers and labels, and the model
// gathers the features on the device. Its wait_seconds() says how long
// Next() blocked: time a step waited on data.
#ifndef FULCRUM_WORKER_DATA_PIPELINE_H_
#define FULCRUM_WORKER_DATA_PIPELINE_H_

#include <condition_variable>
#include <cstdint>
#include <map>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/compute/backend.h"
#include "worker/data/dataset.h"
#include "worker/data/device_data.h"

namespace fulcrum::data {

std::vector<int64_t> ShardOrder(size_t n, int rank, int world_size, uint64_t seed, int epoch, bool shuffle = true);

// Batches kept from one Prefetcher to the next: a Prefetcher takes its
// batches from the pool before allocating and gives them all back when it
// ends, so an epoch decodes into memory the previous epoch already faulted
// in (a 784 x 2048 batch is 6.4 MB of fresh pages otherwise). Thread-safe.
class BatchPool {
 public:
  explicit BatchPool(size_t max_batches = 16) : max_(max_batches) {}
  std::unique_ptr<Batch> Take();           // null when empty
  void Give(std::unique_ptr<Batch> batch);  // dropped past max_batches

 private:
  const size_t max_;
  std::mutex mu_;
  std::vector<std::unique_ptr<Batch>> batches_;
};

struct PrefetchOptions {
  int batch_size = 64;
  int depth = 4;            // batches decoded ahead
  bool drop_last = false;   // drop a final short batch
  int threads = 1;          // decoding threads
  const DeviceData* device = nullptr;  // the dataset on the device (device_data.h)
  // Upload each dense batch's features on the backend's upload stream as
  // soon as it is staged (Batch::uploaded), overlapping the steps before
  // it. kAuto: on a GPU backend.
  enum class Upload { kAuto, kOn, kOff };
  Upload upload = Upload::kAuto;
  // Sparse batches: find the distinct keys on the decoding threads
  // (Batch::distinct_keys), for models that use them.
  bool distinct_keys = true;
  // Run on each decoded batch on the decoding threads (Model::HostWork):
  // a model's own host work, off the training thread.
  std::function<void(Batch*)> host_work;
  BatchPool* pool = nullptr;  // batches to reuse and give back (may be null)
};

// Decoding threads for a worker with `cores` cores that computes on a GPU
// (`gpu`) or on the CPU: a GPU step leaves the cores to the pipeline (up to
// 4: MNIST-sized batches need no more); the CPU backend's GEMMs want them.
int DefaultDecodeThreads(int cores, bool gpu);

class Prefetcher {
 public:
  // `backend` may be null (no staging). `order` lists the examples in turn.
  Prefetcher(const Dataset* dataset, std::vector<int64_t> order, int epoch, PrefetchOptions options,
             compute::Backend* backend);
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  // The next batch, or null at the end of the epoch.
  absl::StatusOr<std::unique_ptr<Batch>> Next();
  // The batch Next() returns next, if it is decoded already, else null.
  // It stays the prefetcher's: read it only until the next call to Next().
  const Batch* Peek() const;
  // Gives a consumed batch back so its buffers are reused.
  void Recycle(std::unique_ptr<Batch> batch);

  int64_t num_batches() const { return num_batches_; }
  double wait_seconds() const;

 private:
  void Run(int thread);
  // Decodes batch i into *batch (and stages it): the batch, or the error.
  absl::StatusOr<std::unique_ptr<Batch>> Produce(int64_t i, std::unique_ptr<Batch> batch);

  const Dataset* dataset_;
  const std::vector<int64_t> order_;
  const int epoch_;
  const PrefetchOptions options_;
  compute::Backend* backend_;
  int64_t num_batches_;
  int num_threads_ = 1;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<int64_t, absl::StatusOr<std::unique_ptr<Batch>>> ready_;  // by batch number
  std::vector<std::unique_ptr<Batch>> free_;
  int64_t consumed_ = 0;  // batches handed out by Next
  bool stop_ = false;
  double wait_seconds_ = 0;
  std::vector<std::thread> threads_;
};

}  // namespace fulcrum::data

#endif  // FULCRUM_WORKER_DATA_PIPELINE_H_
