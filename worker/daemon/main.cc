// fulcrum-worker: a stateless training worker.
//
//   fulcrum-worker --coordinator=coord:7070 [--device=auto|cpu|cuda:N]
//                  [--data_dir=~/.cache/fulcrum/data] [--slots=1]
//
// One worker drives one device; run one per GPU on a multi-GPU host
// (--device=cuda:0, --device=cuda:1, ...).
#include <iostream>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/time.h"
#include "common/rpc/grpc_log.h"
#include "common/flags_usage.h"
#include "common/logging.h"
#include "common/metrics/metrics.h"
#include "common/process.h"
#include "common/rpc/security_flags.h"
#include "common/spare_core.h"
#include "worker/compute/backend.h"
#include "worker/daemon/worker_daemon.h"
#include "worker/data/device_data.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070", "host:port of fulcrum-coordinator");
ABSL_FLAG(std::string, device, "auto", "compute device: auto (first GPU, else CPU), cpu, cuda:N");
ABSL_FLAG(std::string, data_dir, "", "where relative data paths of job specs resolve "
          "(default $FULCRUM_DATA_DIR, else ~/.cache/fulcrum/data)");
ABSL_FLAG(std::vector<std::string>, data_roots, {},
          "comma-separated directories job specs' data paths must resolve into, symlinks and '..' followed "
          "(default: --data_dir alone)");
ABSL_FLAG(std::string, metrics_addr, "0.0.0.0:9402",
          "host:port to serve Prometheus metrics on (GET /metrics); empty: no metrics endpoint");
ABSL_FLAG(uint32_t, slots, 1, "assignments this worker runs at once");
ABSL_FLAG(int32_t, cpu_threads, 0, "CPU backend threads per assignment (0: the host's cores / slots)");
ABSL_FLAG(int32_t, decode_threads, 0,
          "threads decoding batches per assignment (0: up to 4, half the cores, on a GPU; 1 on the CPU backend)");
ABSL_FLAG(bool, prefetch_hints, false,
          "send each next batch's keys ahead to servers whose tables keep rows on disk (storage.spill), "
          "so they read those rows before the pull (docs/embeddings.md, \"Reading ahead\")");
ABSL_FLAG(std::string, device_data, "auto",
          "keep datasets stored as bytes (IDX) on the device and build batches there: auto or on (when they "
          "fit), off");
ABSL_FLAG(double, device_data_share, 0.25, "the share of the device's memory such datasets may take");
ABSL_FLAG(bool, shared_memory, true,
          "talk to servers on this host through shared memory; gRPC otherwise");
ABSL_FLAG(absl::Duration, shared_memory_poll, absl::Microseconds(500),
          "how long the training thread polls shared memory for an answer before it sleeps "
          "(0: never poll; polling yields the core to any thread that wants it)");

int main(int argc, char** argv) {
  fulcrum::SetUsage("Fulcrum worker");
  absl::ParseCommandLine(argc, argv);
  fulcrum::InitServingProcess();
  // gRPC's own lines (a failed handshake costs a caller nothing) are
  // rate-limited per kind, as ours are.
  fulcrum::LimitGrpcLogs();
  fulcrum::InstallCrashHandler(argv[0]);
  auto transport = fulcrum::security::TransportFromFlags("fulcrum-worker", fulcrum::security::Role::kWorker);
  if (!transport.ok()) {
    std::cerr << "fulcrum-worker: " << transport.status().message() << "\n";
    return 2;
  }
  fulcrum::BlockTerminationSignals();
  fulcrum::WorkerDaemonOptions o;
  o.coordinator = absl::GetFlag(FLAGS_coordinator);
  o.security = *transport;
  o.device = absl::GetFlag(FLAGS_device);
  o.slots = absl::GetFlag(FLAGS_slots);
  o.cpu_threads = absl::GetFlag(FLAGS_cpu_threads);
  o.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  o.decode_threads = absl::GetFlag(FLAGS_decode_threads);
  o.prefetch_hints = absl::GetFlag(FLAGS_prefetch_hints);
  o.device_data = absl::GetFlag(FLAGS_device_data);
  o.device_data_share = absl::GetFlag(FLAGS_device_data_share);
  if (o.decode_threads < 0 || o.decode_threads > 64) {
    std::cerr << "fulcrum-worker: --decode_threads must be 0 to 64 (0: chosen for the device), got "
              << o.decode_threads << "\n";
    return 2;
  }
  if (auto m = fulcrum::data::DeviceDataModeFromName(o.device_data); !m.ok()) {
    std::cerr << "fulcrum-worker: --device_data: " << m.status().message() << "\n";
    return 2;
  }
  if (!(o.device_data_share > 0 && o.device_data_share <= 1)) {
    std::cerr << "fulcrum-worker: --device_data_share must be in (0, 1], got " << o.device_data_share << "\n";
    return 2;
  }
  o.shared_memory_poll = absl::GetFlag(FLAGS_shared_memory_poll);
  if (absl::Status s = fulcrum::CheckPollFlag(o.shared_memory_poll); !s.ok()) {
    std::cerr << "fulcrum-worker: " << s.message() << "\n";
    return 2;
  }
  o.data_dir = absl::GetFlag(FLAGS_data_dir);
  if (o.data_dir.empty()) o.data_dir = fulcrum::DefaultDataDir();
  o.data_roots = absl::GetFlag(FLAGS_data_roots);
  if (o.coordinator.empty()) {
    // Otherwise it would wait for a coordinator at "" forever.
    std::cerr << "fulcrum-worker: --coordinator is empty; give the coordinator's host:port\n";
    return 2;
  }
  if (o.slots == 0 || o.slots > 1024) {
    std::cerr << "fulcrum-worker: --slots must be 1 to 1024, got " << o.slots << "\n";
    return 2;
  }
  if (o.cpu_threads < 0) {
    std::cerr << "fulcrum-worker: --cpu_threads must be >= 0 (0: the host's cores / slots), got " << o.cpu_threads
              << "\n";
    return 2;
  }
  if (absl::Status s = fulcrum::compute::CheckDeviceName(o.device); !s.ok()) {
    std::cerr << "fulcrum-worker: " << s.message() << "\n";
    return 2;
  }
  fulcrum::WorkerDaemon daemon(o);
  auto metrics = fulcrum::metrics::ServeMetrics(absl::GetFlag(FLAGS_metrics_addr), "worker",
                                                [&daemon](fulcrum::metrics::Scrape* out) { daemon.CollectMetrics(out); },
                                                fulcrum::security::MetricsSecurityFromFlags());
  if (!metrics.ok()) {
    std::cerr << "fulcrum-worker: " << metrics.status() << "\n";
    return 2;
  }
  const int sig = fulcrum::WaitForTerminationSignal();
  FLOG(INFO) << "signal " << sig << " received; stopping";
  daemon.Stop();
  return 0;
}
