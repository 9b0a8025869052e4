// A PsClient that reaches a job's parameter servers over the network (and
// shared memory for servers on this host), for code outside worker/rpc/:
// the worker daemon names what it needs here and never the transport.
// The client behind it is GrpcPsClient (worker/rpc/grpc_ps_client.h).
#ifndef FULCRUM_WORKER_RPC_REMOTE_PS_CLIENT_H_
#define FULCRUM_WORKER_RPC_REMOTE_PS_CLIENT_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "common/spare_core.h"
#include "fulcrum/v1/ps.pb.h"
#include "worker/ps_client.h"

namespace fulcrum {
namespace security {
class Transport;  // common/rpc/security.h
}  // namespace security

struct RemotePsClientOptions {
  // Asked for the shard map when `shard_map` is not given.
  std::vector<std::string> bootstrap_servers;
  std::optional<v1::ShardMap> shard_map;
  std::string worker_id;  // required; with seq, identifies every push
  // The channels' security (the process's member certificate); plaintext
  // when null.
  std::shared_ptr<const security::Transport> security;
  // The rank's incarnation, sent with every push and pull: a job restored
  // from a checkpoint refuses older ones.
  uint32_t incarnation = 0;
  uint32_t rank = 0;
  DType wire_dtype = DType::kFp32;  // of gradients pushed and weights pulled
  int channels_per_server = 4;
  enum class Transport { kUnary, kStream };
  Transport transport = Transport::kUnary;
  // With a server on this host, send requests
  // through shared memory (docs/wire-protocol.md, "Shared memory"); a
  // request that does not fit, or finds the slots busy, takes `transport`.
  bool shared_memory = false;
  uint32_t shared_memory_slots = 8;
  // How long a thread waiting for a push or pull polls shared memory for
  // the answer before it sleeps until the client's dispatcher wakes it
  // (polling yields the core to any thread that wants it); zero never polls.
  absl::Duration shared_memory_poll = absl::Microseconds(500);
  // Whether the host has a core to spare for that polling (SpareCore;
  // tests of polling give one that answers as they need).
  SpareCoreProbe spare_core = &SpareCore;
  absl::Duration rpc_timeout = absl::Seconds(60);
  // How long a pull may wait for the consistency model (sent to the server).
  absl::Duration pull_wait_timeout = absl::Minutes(5);
  // Total time spent retrying UNAVAILABLE before giving up.
  absl::Duration retry_budget = absl::Seconds(30);
  // Payload per message. 1 MiB keeps several messages of a big tensor in
  // flight over the connections (docs/benchmarks.md); at most 4 MiB.
  size_t max_payload_bytes = 1 << 20;
};

absl::StatusOr<std::unique_ptr<PsClient>> NewRemotePsClient(RemotePsClientOptions options);

}  // namespace fulcrum

#endif  // FULCRUM_WORKER_RPC_REMOTE_PS_CLIENT_H_
