// The coordinator's ServerControl over gRPC: ParameterService calls to the
// servers (shard maps, job deletion, checkpoints), each with a deadline,
// all cancelled by CancelAll. The coordinator core sees only the
// ServerControl interface (server/coordinator/coordinator.h).
#ifndef FULCRUM_SERVER_COORDINATOR_RPC_GRPC_SERVER_CONTROL_H_
#define FULCRUM_SERVER_COORDINATOR_RPC_GRPC_SERVER_CONTROL_H_

#include <memory>

#include "absl/time/time.h"
#include "common/rpc/security.h"
#include "server/coordinator/server_control.h"

namespace fulcrum {

// `timeout`: each call's deadline (a checkpoint's also covers its wait).
// `security`: the coordinator's member certificate; plaintext when null.
std::unique_ptr<ServerControl> NewGrpcServerControl(absl::Duration timeout,
                                                    std::shared_ptr<const security::Transport> security = nullptr);

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_COORDINATOR_RPC_GRPC_SERVER_CONTROL_H_
