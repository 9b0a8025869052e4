// fulcrum-coordinator: the cluster's control plane.
//
//   fulcrum-coordinator --listen=0.0.0.0:7070 --data_dir=/var/lib/fulcrum/coordinator
//                       --tls_ca_file=ca.crt --tls_cert_file=coordinator.crt --tls_key_file=coordinator.key
//                       --token_file=tokens.csv [--min_servers=2] [--node_timeout_ms=5000]
//
// TLS is on unless --insecure (common/rpc/security_flags.h); users of the job
// API authenticate with bearer tokens from --token_file (server/coordinator/rpc/auth.h).
//
// Servers and workers start with --coordinator=host:7070; users submit jobs
// with `fulcrumctl --coordinator=host:7070 submit -f spec.yaml`.
#include <iostream>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "common/rpc/grpc_log.h"
#include "common/flags_usage.h"
#include "common/logging.h"
#include "common/metrics/metrics.h"
#include "common/process.h"
#include "common/rpc/security_flags.h"
#include "common/shard_map.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/rpc/grpc_server_control.h"
#include "server/coordinator/rpc/coordinator_service.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:7070", "address to serve the job and cluster services on");
ABSL_FLAG(std::string, data_dir, "fulcrum-coordinator-data", "RocksDB directory for the coordinator's state");
ABSL_FLAG(std::string, metrics_addr, "0.0.0.0:9400",
          "host:port to serve Prometheus metrics on (GET /metrics); empty: no metrics endpoint");
ABSL_FLAG(uint32_t, min_servers, 1, "jobs wait until this many parameter servers are live");
ABSL_FLAG(uint32_t, virtual_shards, 256, "virtual shards of the shard map (fixed for a cluster)");
ABSL_FLAG(int32_t, heartbeat_interval_ms, 1000, "how often nodes heartbeat (the long-poll length)");
ABSL_FLAG(int32_t, node_timeout_ms, 5000, "a node silent this long is declared dead");
ABSL_FLAG(int32_t, dead_node_retention_s, 600,
          "how long a dead node stays listed (fulcrumctl cluster, metrics) before it is forgotten");
ABSL_FLAG(int32_t, checkpoint_wait_s, 60, "how long a server may wait for a BSP checkpoint's step boundary");
ABSL_FLAG(std::string, token_file, "",
          "users' bearer tokens (Kubernetes static token file: token,user,uid[,\"groups\"]; group fulcrum:admins "
          "sees every job); required unless --insecure, re-read when it changes");
ABSL_FLAG(uint32_t, max_active_jobs_per_user, 16, "jobs a user may have pending or running at once (0: no limit)");
ABSL_FLAG(uint32_t, max_long_calls_per_user, 1024,
          "open WatchJob and ExportCheckpoint streams and waiting CheckpointJob calls a user (or, without "
          "--token_file, a client address) may hold at once (0: no limit)");
ABSL_FLAG(int32_t, restore_timeout_s, 300,
          "how long a job rolling back to a checkpoint waits for the servers holding it, or keeps retrying a "
          "restore that fails, before it fails");

namespace {

// The job API's users from --token_file; null (anyone) only with --insecure.
absl::StatusOr<std::shared_ptr<fulcrum::TokenAuthenticator>> TokensFromFlags() {
  if (const std::string token_file = absl::GetFlag(FLAGS_token_file); !token_file.empty()) {
    auto opened = fulcrum::TokenAuthenticator::Open(token_file);
    if (!opened.ok()) return opened.status();
    FLOG(INFO) << "job API: bearer tokens of " << (*opened)->users() << " user(s) from " << token_file;
    return *std::move(opened);
  }
  if (!fulcrum::security::InsecureFlag()) {
    return absl::InvalidArgumentError(
        "the job API needs --token_file (users' bearer tokens; deploy/tls/gen-certs.sh writes one) unless --insecure");
  }
  FLOG(WARNING) << "job API WITHOUT authentication (no --token_file): every caller may see and cancel every job";
  return nullptr;
}

absl::StatusOr<fulcrum::CoordinatorOptions> OptionsFromFlags() {
  fulcrum::CoordinatorOptions options;
  options.max_active_jobs_per_user = absl::GetFlag(FLAGS_max_active_jobs_per_user);
  options.max_long_calls_per_user = absl::GetFlag(FLAGS_max_long_calls_per_user);
  options.data_dir = absl::GetFlag(FLAGS_data_dir);
  options.min_servers = absl::GetFlag(FLAGS_min_servers);
  options.virtual_shards = absl::GetFlag(FLAGS_virtual_shards);
  options.heartbeat_interval = absl::Milliseconds(absl::GetFlag(FLAGS_heartbeat_interval_ms));
  options.node_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_node_timeout_ms));
  options.checkpoint_wait = absl::Seconds(absl::GetFlag(FLAGS_checkpoint_wait_s));
  options.dead_node_retention = absl::Seconds(absl::GetFlag(FLAGS_dead_node_retention_s));
  options.restore_timeout = absl::Seconds(absl::GetFlag(FLAGS_restore_timeout_s));
  if (options.virtual_shards == 0 || options.virtual_shards > fulcrum::ShardMap::kMaxVirtualShards) {
    return absl::InvalidArgumentError(absl::StrCat("--virtual_shards must be 1 to ", fulcrum::ShardMap::kMaxVirtualShards,
                                                   ", got ", options.virtual_shards));
  }
  for (const auto& [flag, value] : {std::pair<const char*, int32_t>{"--heartbeat_interval_ms", absl::GetFlag(FLAGS_heartbeat_interval_ms)},
                                    {"--checkpoint_wait_s", absl::GetFlag(FLAGS_checkpoint_wait_s)},
                                    {"--dead_node_retention_s", absl::GetFlag(FLAGS_dead_node_retention_s)},
                                    {"--restore_timeout_s", absl::GetFlag(FLAGS_restore_timeout_s)}}) {
    if (value <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(flag, " must be > 0, got ", value));
    }
  }
  if (options.node_timeout <= options.heartbeat_interval) {
    return absl::InvalidArgumentError("--node_timeout_ms must exceed --heartbeat_interval_ms");
  }
  return options;
}

}  // namespace

int main(int argc, char** argv) {
  fulcrum::SetUsage("Fulcrum coordinator");
  absl::ParseCommandLine(argc, argv);
  // Small messages only: a refused flood of large ones must not stay in the heap.
  fulcrum::InitServingProcess({.pin_malloc_thresholds = false});
  // gRPC's own lines (a failed handshake costs a caller nothing) are
  // rate-limited per kind, as ours are.
  fulcrum::LimitGrpcLogs();
  fulcrum::InstallCrashHandler(argv[0]);
  fulcrum::BlockTerminationSignals();
  auto transport = fulcrum::security::TransportFromFlags("fulcrum-coordinator", fulcrum::security::Role::kCoordinator);
  if (!transport.ok()) {
    std::cerr << "fulcrum-coordinator: " << transport.status().message() << "\n";
    return 2;
  }
  auto tokens = TokensFromFlags();
  if (!tokens.ok()) {
    std::cerr << "fulcrum-coordinator: " << tokens.status().message() << "\n";
    return 2;
  }
  auto parsed = OptionsFromFlags();
  if (!parsed.ok()) {
    std::cerr << "fulcrum-coordinator: " << parsed.status().message() << "\n";
    return 2;
  }
  const fulcrum::CoordinatorOptions& options = *parsed;
  auto coordinator =
      fulcrum::Coordinator::Open(options, fulcrum::NewGrpcServerControl(options.server_rpc_timeout, *transport));
  if (!coordinator.ok()) {
    std::cerr << "fulcrum-coordinator: " << coordinator.status() << "\n";
    return 2;
  }
  auto server = fulcrum::CoordinatorGrpcServer::Start(coordinator->get(), absl::GetFlag(FLAGS_listen), *tokens, *transport);
  if (!server.ok()) {
    std::cerr << "fulcrum-coordinator: " << server.status() << "\n";
    return 1;
  }
  auto metrics = fulcrum::metrics::ServeMetrics(absl::GetFlag(FLAGS_metrics_addr), "coordinator",
                                                [c = coordinator->get()](fulcrum::metrics::Scrape* out) { c->CollectMetrics(out); },
                                                fulcrum::security::MetricsSecurityFromFlags());
  if (!metrics.ok()) {
    std::cerr << "fulcrum-coordinator: " << metrics.status() << "\n";
    return 2;
  }
  FLOG(INFO) << "fulcrum-coordinator listening on " << (*server)->address() << "; state in " << options.data_dir
             << "; jobs wait for " << options.min_servers << " server(s); nodes heartbeat every "
             << absl::FormatDuration(options.heartbeat_interval) << ", dead after "
             << absl::FormatDuration(options.node_timeout) << "; rollbacks wait "
             << absl::FormatDuration(options.restore_timeout) << " for the servers holding a checkpoint";
  const int sig = fulcrum::WaitForTerminationSignal();
  FLOG(INFO) << "signal " << sig << " received; shutting down";
  (*server)->Shutdown();
  return 0;
}
