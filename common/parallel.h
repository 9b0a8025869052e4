// ParallelRunner: runs the iterations of a loop on the calling thread and a
// few helper threads kept parked between calls (a thread started per call
// costs tens of microseconds, as much as the work it would share here).
// The parameter server owns one and hands it to its jobs, which apply a BSP
// step's chunks on all cores while the workers wait for that step. Thread-safe: concurrent ForEach
// calls do not queue; a call that finds the helpers busy runs its loop on
// its own thread.
#ifndef FULCRUM_COMMON_PARALLEL_H_
#define FULCRUM_COMMON_PARALLEL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace fulcrum {

class ParallelRunner {
 public:
  // `helpers` threads besides the caller; 0 runs every loop serially.
  explicit ParallelRunner(int helpers);
  ~ParallelRunner();
  ParallelRunner(const ParallelRunner&) = delete;
  ParallelRunner& operator=(const ParallelRunner&) = delete;

  // Calls f(i) once for each i in [0, n), in no particular order and
  // possibly concurrently; returns when every call returned.
  void ForEach(size_t n, absl::FunctionRef<void(size_t)> f);

  int helpers() const { return static_cast<int>(threads_.size()); }

  // A helper per usable core beyond the first, at most 7: what a server's
  // runner is given.
  static int DefaultHelpers();

 private:
  void Loop();

  absl::Mutex call_mu_;  // held for a whole parallel ForEach
  absl::Mutex mu_;
  const absl::FunctionRef<void(size_t)>* fn_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t n_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int busy_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<size_t> next_{0};
  std::vector<std::thread> threads_;
};

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_PARALLEL_H_
