// fulcrum-server: a parameter-server process.
//
//   fulcrum-server --listen=0.0.0.0:7000 --server_index=0
//                  --shard_map=host0:7000,host1:7000 [--virtual_shards=256]
//
// Until the coordinator exists the shard map is given here: the listed
// servers own virtual shards round-robin, version 1.
#include <iostream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "common/logging.h"
#include "common/process.h"
#include "server/parameter_server.h"
#include "server/rpc/ps_service.h"

ABSL_FLAG(std::string, listen, "0.0.0.0:7000", "address to serve the parameter service on");
ABSL_FLAG(uint32_t, server_index, 0, "this server's index in --shard_map");
ABSL_FLAG(std::string, shard_map, "",
          "comma-separated server addresses (host:port), in index order; "
          "defaults to the --listen address alone");
ABSL_FLAG(uint32_t, virtual_shards, 256, "number of virtual shards (fixed for a cluster)");
ABSL_FLAG(uint64_t, default_quota_bytes, uint64_t{8} << 30,
          "per-job parameter memory quota on this server when a job names none");
ABSL_FLAG(int32_t, max_wait_seconds, 600, "longest a pull may wait for the consistency model");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Fulcrum parameter server");
  absl::ParseCommandLine(argc, argv);
  fulcrum::InitServingProcess();
  fulcrum::BlockTerminationSignals();

  std::string servers = absl::GetFlag(FLAGS_shard_map);
  if (servers.empty()) servers = absl::GetFlag(FLAGS_listen);
  auto map = fulcrum::ShardMap::FromServerList(servers, absl::GetFlag(FLAGS_virtual_shards));
  if (!map.ok()) {
    std::cerr << "fulcrum-server: bad --shard_map: " << map.status() << "\n";
    return 2;
  }
  fulcrum::ParameterServerOptions options;
  options.server_index = absl::GetFlag(FLAGS_server_index);
  options.shard_map = map->ToProto();
  options.default_quota_bytes = absl::GetFlag(FLAGS_default_quota_bytes);
  options.max_wait = absl::Seconds(absl::GetFlag(FLAGS_max_wait_seconds));
  auto ps = fulcrum::ParameterServer::Create(options);
  if (!ps.ok()) {
    std::cerr << "fulcrum-server: " << ps.status() << "\n";
    return 2;
  }
  auto server = fulcrum::PsGrpcServer::Start(ps->get(), absl::GetFlag(FLAGS_listen));
  if (!server.ok()) {
    std::cerr << "fulcrum-server: " << server.status() << "\n";
    return 1;
  }
  FLOG(INFO) << "fulcrum-server listening on " << (*server)->address() << " as server "
             << options.server_index << " of " << map->num_servers() << " (shard map version "
             << map->version() << ", " << map->num_virtual_shards()
             << " virtual shards, owns " << map->DescribeOwned(options.server_index)
             << "); default job quota " << options.default_quota_bytes << " bytes";
  const int sig = fulcrum::WaitForTerminationSignal();
  FLOG(INFO) << "signal " << sig << " received; draining and shutting down";
  (*server)->Shutdown();
  return 0;
}
