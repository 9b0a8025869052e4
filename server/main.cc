// fulcrum-server: a parameter-server process.
//
//   fulcrum-server --listen=0.0.0.0:7000 --server_index=0
//                  --shard_map=host0:7000,host1:7000 [--virtual_shards=256]
//
// or, in a cluster, with a coordinator that hands out the shard map:
//
//   fulcrum-server --listen=0.0.0.0:7000 --coordinator=coord:7070
//                  [--advertise=host0:7000]
//
// Without --coordinator the shard map is given here: the listed servers own
// virtual shards round-robin, version 1.
#include <unistd.h>

#include <iostream>
#include <algorithm>
#include <memory>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/rpc/grpc_log.h"
#include "common/flags_usage.h"
#include "common/logging.h"
#include "common/metrics/metrics.h"
#include "common/process.h"
#include "common/rpc/security_flags.h"
#include "common/rpc/node_agent.h"
#include "common/spare_core.h"
#include "server/parameter_server.h"
#include "server/rpc/ps_service.h"
#include "server/rpc/server_agent.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:7000", "address to serve the parameter service on");
ABSL_FLAG(uint32_t, server_index, 0, "this server's index in --shard_map");
ABSL_FLAG(std::string, shard_map, "",
          "comma-separated server addresses (host:port), in index order; "
          "defaults to the --listen address alone");
ABSL_FLAG(uint32_t, virtual_shards, 256, "number of virtual shards (fixed for a cluster)");
ABSL_FLAG(uint64_t, default_quota_bytes, uint64_t{8} << 30,
          "per-job parameter memory quota on this server when a job names none");
ABSL_FLAG(uint64_t, memory_limit_bytes, 0,
          "parameter memory all jobs together may hold on this server, whatever their quotas "
          "(0: 80% of physical memory, or of the cgroup's memory limit when lower, divided by "
          "--servers_per_host)");
ABSL_FLAG(uint32_t, servers_per_host, 1,
          "parameter servers sharing this host's memory: the default --memory_limit_bytes is their share");
ABSL_FLAG(int32_t, unadmitted_grace_seconds, 60,
          "with --coordinator: a job the coordinator stops listing is dropped after this long");
ABSL_FLAG(std::string, coordinator, "",
          "host:port of fulcrum-coordinator; the shard map then comes from it");
ABSL_FLAG(std::string, advertise, "",
          "address workers reach this server at (default: --listen, with this host's name "
          "for a wildcard host)");
ABSL_FLAG(int32_t, max_wait_seconds, 600, "longest a pull may wait for the consistency model");
ABSL_FLAG(bool, shared_memory, true,
          "offer workers on this host shared memory for pushes and pulls");
ABSL_FLAG(absl::Duration, shared_memory_poll, absl::Microseconds(500),
          "how long a shared-memory session polls for a push its worker announced before it sleeps "
          "(0: never poll; polling yields the core to any thread that wants it)");
ABSL_FLAG(std::string, metrics_addr, "0.0.0.0:9401",
          "host:port to serve Prometheus metrics on (GET /metrics); empty: no metrics endpoint");
ABSL_FLAG(std::string, data_dir, "",
          "directory for this server's checkpoints (a RocksDB database in <data_dir>/checkpoints) and the "
          "rows tables spill from memory (<data_dir>/cold); empty: no checkpoints and no table that spills");
ABSL_FLAG(absl::Duration, fault_checkpoint_commit_delay, absl::ZeroDuration(),
          "fault injection for crash tests: each checkpoint's records wait this long uncommitted, "
          "logged when the wait starts (0: off; not for use in production)");

namespace {

// "8589934592 bytes (8.0 GiB)": exact for scripts and flags, readable for people.
std::string Bytes(uint64_t n) { return absl::StrCat(n, " bytes (", fulcrum::HumanBytes(n), ")"); }

// The server's options from its flags; `map`: the static shard map when
// there is no coordinator; `advertise_out`: the address given to workers.
absl::StatusOr<fulcrum::ParameterServerOptions> OptionsFromFlags(std::optional<fulcrum::ShardMap>* map,
                                                                 std::string* advertise_out) {
  fulcrum::ParameterServerOptions options;
  const std::string coordinator = absl::GetFlag(FLAGS_coordinator);
  options.default_quota_bytes = absl::GetFlag(FLAGS_default_quota_bytes);
  options.memory_limit_bytes = absl::GetFlag(FLAGS_memory_limit_bytes);
  if (absl::GetFlag(FLAGS_servers_per_host) == 0) {
    return absl::InvalidArgumentError("--servers_per_host must be >= 1");
  }
  options.servers_per_host = absl::GetFlag(FLAGS_servers_per_host);
  // Servers registered with a coordinator hold only the jobs it admits.
  options.require_admission = !coordinator.empty();
  options.unadmitted_grace = absl::Seconds(std::max(1, absl::GetFlag(FLAGS_unadmitted_grace_seconds)));
  options.max_wait = absl::Seconds(absl::GetFlag(FLAGS_max_wait_seconds));
  if (options.max_wait <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_wait_seconds must be > 0, got ", absl::GetFlag(FLAGS_max_wait_seconds)));
  }
  if (coordinator.empty()) {
    std::string servers = absl::GetFlag(FLAGS_shard_map);
    if (servers.empty()) servers = absl::GetFlag(FLAGS_listen);
    auto m = fulcrum::ShardMap::FromServerList(servers, absl::GetFlag(FLAGS_virtual_shards));
    if (!m.ok()) return absl::InvalidArgumentError(absl::StrCat("bad --shard_map: ", m.status().ToString()));
    *map = *std::move(m);
    options.server_index = absl::GetFlag(FLAGS_server_index);
    options.shard_map = (*map)->ToProto();
  } else if (!absl::GetFlag(FLAGS_shard_map).empty()) {
    return absl::InvalidArgumentError("give --coordinator or --shard_map, not both");
  }
  // The address goes into shard maps, so it must be one workers can dial.
  const std::string listen = absl::GetFlag(FLAGS_listen);
  std::string& advertise = *advertise_out;
  advertise = absl::GetFlag(FLAGS_advertise);
  if (!coordinator.empty()) {
    if (advertise.empty()) {
      advertise = listen;
      const size_t colon = listen.rfind(':');
      const std::string host = listen.substr(0, colon);
      if (host == "0.0.0.0" || host == "[::]" || host.empty()) advertise = fulcrum::HostName() + listen.substr(colon);
    }
    if (advertise.rfind(":0") == advertise.size() - 2) {
      return absl::InvalidArgumentError("with --coordinator, --listen needs a fixed port (or give --advertise)");
    }
    options.advertise_address = advertise;
  }
  options.data_dir = absl::GetFlag(FLAGS_data_dir);
  options.checkpoint_commit_delay = absl::GetFlag(FLAGS_fault_checkpoint_commit_delay);
  return options;
}

// What the server is, serves and waits for, at startup.
void LogStartup(const fulcrum::ParameterServerOptions& options, const std::optional<fulcrum::ShardMap>& map,
                const fulcrum::ParameterServer& ps, const std::string& address, const std::string& advertise,
                const fulcrum::PsGrpcServer::Options& grpc_options) {
  const std::string coordinator = absl::GetFlag(FLAGS_coordinator);
  if (options.data_dir.empty()) {
    FLOG(INFO) << "no --data_dir: this server takes no checkpoints and holds no table that spills to disk";
  } else {
    FLOG(INFO) << "checkpoints in " << options.data_dir << "/checkpoints, rows spilled from memory in "
               << options.data_dir << "/cold";
  }
  if (map) {
    FLOG(INFO) << "fulcrum-server listening on " << address << " as server "
               << options.server_index << " of " << map->num_servers() << " (static shard map version "
               << map->version() << ", " << map->num_virtual_shards()
               << " virtual shards, owns " << map->DescribeOwned(options.server_index)
               << "); default job quota " << Bytes(options.default_quota_bytes) << ", memory limit "
               << Bytes(ps.memory_limit_bytes()) << " for all jobs";
  } else {
    FLOG(INFO) << "fulcrum-server listening on " << address << ", advertised as " << advertise
               << "; coordinator " << coordinator << " assigns the shard map; default job quota "
               << Bytes(options.default_quota_bytes) << ", memory limit " << Bytes(ps.memory_limit_bytes())
               << " for all jobs";
  }
  FLOG(INFO) << (grpc_options.shared_memory
                     ? absl::StrCat("workers on this host get shared memory for pushes and pulls (polling ",
                                    absl::FormatDuration(grpc_options.shared_memory_poll), " for announced pushes)")
                     : std::string("shared memory off (--shared_memory=false): every push and pull comes over gRPC"));
}

}  // namespace

int main(int argc, char** argv) {
  fulcrum::SetUsage("Fulcrum parameter server");
  absl::ParseCommandLine(argc, argv);
  fulcrum::InitServingProcess();
  // gRPC's own lines (a failed handshake costs a caller nothing) are
  // rate-limited per kind, as ours are.
  fulcrum::LimitGrpcLogs();
  fulcrum::InstallCrashHandler(argv[0]);
  auto transport = fulcrum::security::TransportFromFlags("fulcrum-server", fulcrum::security::Role::kServer);
  if (!transport.ok()) {
    std::cerr << "fulcrum-server: " << transport.status().message() << "\n";
    return 2;
  }
  fulcrum::BlockTerminationSignals();

  std::optional<fulcrum::ShardMap> map;
  std::string advertise;
  absl::StatusOr<fulcrum::ParameterServerOptions> parsed = OptionsFromFlags(&map, &advertise);
  if (!parsed.ok()) {
    std::cerr << "fulcrum-server: " << parsed.status().message() << "\n";
    return 2;
  }
  const fulcrum::ParameterServerOptions& options = *parsed;
  const std::string coordinator = absl::GetFlag(FLAGS_coordinator);
  const std::string listen = absl::GetFlag(FLAGS_listen);
  auto ps = fulcrum::ParameterServer::Create(options);
  if (!ps.ok()) {
    std::cerr << "fulcrum-server: " << ps.status() << "\n";
    return 2;
  }
  fulcrum::PsGrpcServer::Options grpc_options;
  grpc_options.shared_memory = absl::GetFlag(FLAGS_shared_memory);
  grpc_options.shared_memory_poll = absl::GetFlag(FLAGS_shared_memory_poll);
  grpc_options.security = *transport;
  if (absl::Status s = fulcrum::CheckPollFlag(grpc_options.shared_memory_poll); !s.ok()) {
    std::cerr << "fulcrum-server: " << s.message() << "\n";
    return 2;
  }
  auto server = fulcrum::PsGrpcServer::Start(ps->get(), listen, grpc_options);
  if (!server.ok()) {
    std::cerr << "fulcrum-server: " << server.status() << "\n";
    return 1;
  }
  // Declared after the server so it stops first: no scrape outlives it.
  auto metrics = fulcrum::metrics::ServeMetrics(absl::GetFlag(FLAGS_metrics_addr), "server",
                                                [ps = ps->get(), grpc = server->get()](fulcrum::metrics::Scrape* out) {
                                                  ps->CollectMetrics(out);
                                                  grpc->CollectMetrics(out);
                                                },
                                                fulcrum::security::MetricsSecurityFromFlags());
  if (!metrics.ok()) {
    std::cerr << "fulcrum-server: " << metrics.status() << "\n";
    return 2;
  }
  LogStartup(options, map, **ps, (*server)->address(), advertise, grpc_options);
  std::unique_ptr<fulcrum::NodeAgent> agent;
  if (!map) agent = fulcrum::StartServerAgent(ps->get(), coordinator, advertise, *transport);
  const int sig = fulcrum::WaitForTerminationSignal();
  FLOG(INFO) << "signal " << sig << " received; draining and shutting down";
  if (agent) agent->Stop();
  (*server)->Shutdown();
  return 0;
}
