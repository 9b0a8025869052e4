// WorkerDaemon: the stateless fulcrum-worker. It registers with the
// coordinator (reporting its devices and slots), runs exactly the
// assignments the coordinator's heartbeat answers list, one thread each,
// and reports progress. Each assignment:
//   1. loads its train and test data (cached across jobs) from --data_dir;
//   2. builds the model on its compute backend and a PsClient over the
//      assignment's shard map; creates the job's tables (idempotent);
//   3. when it replaces a lost rank (incarnation > 0), asks every server how
//      far the rank got and resumes there, mid-epoch if need be;
//   4. trains epoch by epoch, reporting progress twice a second; after each
//      epoch rank 0 evaluates on the test set; after the last, rank 0 reports
//      a fingerprint of the final weights.
// Nothing lives only here: killing the process loses no training state.
#ifndef FULCRUM_WORKER_DAEMON_WORKER_DAEMON_H_
#define FULCRUM_WORKER_DAEMON_WORKER_DAEMON_H_

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/metrics/metrics.h"
#include "common/rpc/node_agent.h"
#include "fulcrum/v1/cluster.pb.h"
#include "worker/setup/job_data.h"
#include "worker/data/dataset.h"
#include "worker/models/model.h"

namespace fulcrum {

// A GPU's busy fraction (0-1) now, by NVML index; nullopt when unknown.
using GpuUtilization = std::function<std::optional<double>(int gpu)>;

struct WorkerDaemonOptions {
  std::string coordinator;
  // The security of every channel (to the coordinator and the servers): the
  // worker's member certificate; plaintext when null.
  std::shared_ptr<const security::Transport> security;
  std::string data_dir;        // relative data paths resolve here
  // Directories data paths must resolve into (symlinks and ".." followed);
  // empty: data_dir alone. Job specs come over the network: a path outside
  // is refused, never opened.
  std::vector<std::string> data_roots;
  std::string device = "auto"; // auto | cpu | cuda:N
  uint32_t slots = 1;          // assignments run at once
  int cpu_threads = 0;         // CPU backend threads per assignment; 0: cores / slots
  bool shared_memory = true;   // with servers on this host (RemotePsClientOptions)
  absl::Duration shared_memory_poll = absl::Microseconds(500);  // RemotePsClientOptions
  absl::Duration progress_interval = absl::Milliseconds(500);
  // Threads decoding batches per assignment; 0: data::DefaultDecodeThreads
  // for the device (a GPU leaves the cores to the pipeline).
  int decode_threads = 0;
  // TrainerOptions::prefetch_hints.
  bool prefetch_hints = false;
  // Datasets on the device (data/device_data.h): auto, on or off, and the
  // share of the device's memory they may take.
  std::string device_data = "auto";
  double device_data_share = 0.25;
  // Where GPU time's busy/idle split comes from; null: NVML.
  GpuUtilization gpu_utilization;
};

class CoordinatorClient;  // worker/rpc/coordinator_client.h

class WorkerDaemon {
 public:
  explicit WorkerDaemon(WorkerDaemonOptions options);
  ~WorkerDaemon();  // stops every assignment

  std::string node_id() const { return agent_->node_id(); }
  bool WaitRegistered(absl::Duration timeout) const { return agent_->WaitRegistered(timeout); }
  // Assignments running now.
  int running() const;
  // Renders the worker's series (docs/metrics.md): per running assignment
  // (job, rank) step-time phases, samples and loss; GPUs through NVML.
  void CollectMetrics(metrics::Scrape* out) const;
  void Stop();

  class Runner;

 private:
  using Key = std::tuple<std::string, uint32_t, uint32_t>;  // job, rank, incarnation
  void OnUpdate(const v1::HeartbeatResponse& r);

  const WorkerDaemonOptions options_;
  std::unique_ptr<NodeAgent> agent_;
  std::unique_ptr<CoordinatorClient> coordinator_;  // over agent_'s stub
  std::unique_ptr<DataCache> data_;                // shared by the daemon's assignments
  std::unique_ptr<metrics::Nvml> nvml_;  // null without an NVIDIA driver
  GpuUtilization gpu_utilization_;       // options_'s, else NVML's; may be null
  mutable absl::Mutex mu_;
  std::map<Key, std::unique_ptr<Runner>> runners_ ABSL_GUARDED_BY(mu_);
  std::set<Key> done_ ABSL_GUARDED_BY(mu_);  // never restarted
  std::vector<std::unique_ptr<Runner>> retiring_ ABSL_GUARDED_BY(mu_);
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace fulcrum

#endif  // FULCRUM_WORKER_DAEMON_WORKER_DAEMON_H_
