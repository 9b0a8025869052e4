// The one place where absl::Status and grpc::Status meet.
#ifndef FULCRUM_COMMON_RPC_GRPC_UTIL_H_
#define FULCRUM_COMMON_RPC_GRPC_UTIL_H_

#include <initializer_list>
#include <memory>
#include <string>

#include <grpcpp/channel.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <grpcpp/support/status.h>

#include "absl/status/status.h"
#include "common/rpc/security.h"

namespace fulcrum {

// Carries a WrongShardError's map version in the status details.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// Largest gRPC message Fulcrum accepts. Clients split requests so messages
// stay under kMaxPayloadBytes (4 MiB); the receive limit leaves headroom for
// headers so a full-size payload plus framing always fits.
inline constexpr int kMaxPayloadBytes = 4 << 20;
inline constexpr int kMaxMessageBytes = 8 << 20;
// A ReadCheckpoint page holds at least one whole record, and one record (a
// dense chunk of up to 2^20 elements with two optimizer slots, or a sparse
// virtual shard) can outgrow kMaxMessageBytes: servers send, and the
// channels that read checkpoints receive, messages up to this size.
inline constexpr int kMaxCheckpointMessageBytes = 256 << 20;

// A channel to `target` with Fulcrum's message limits, secured by
// `transport`. `index` distinguishes otherwise identical channels so each
// gets its own TCP connection.
std::shared_ptr<grpc::Channel> CreateFulcrumChannel(const std::string& target, int index,
                                                   const security::Transport& transport);
// A channel for reading checkpoints (kMaxCheckpointMessageBytes).
std::shared_ptr<grpc::Channel> CreateCheckpointChannel(const std::string& target,
                                                      const security::Transport& transport);


// Applies Fulcrum's limits and channel args to a server builder.
void ConfigureServerBuilder(grpc::ServerBuilder& builder);

// Registers each of `services` (full names, "fulcrum.v1.JobService") with
// the started server's standard health service as SERVING, so per-service
// probes answer as the empty name does. SetServingStatus(false) at drain
// turns them all to NOT_SERVING.
void ServeHealthOf(grpc::Server* server, std::initializer_list<const char*> services);

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_RPC_GRPC_UTIL_H_
