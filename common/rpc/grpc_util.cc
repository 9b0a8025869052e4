#include "common/rpc/grpc_util.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/errors.h"
#include "common/rpc/security.h"

namespace fulcrum {
namespace {
constexpr char kShardMapDetailPrefix[] = "fulcrum-shard-map-version:";
}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const auto code = static_cast<grpc::StatusCode>(status.code());
  // Messages may quote what a client sent: bounded, valid UTF-8.
  std::string message = SafeStatusMessage(std::string_view(status.message().data(), status.message().size()));
  if (auto version = WrongShardVersion(status)) {
    return grpc::Status(code, std::move(message), absl::StrCat(kShardMapDetailPrefix, *version));
  }
  return grpc::Status(code, std::move(message));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  // error_details() returns by value: keep the string alive while viewing it.
  const std::string details_copy = status.error_details();
  absl::string_view details = details_copy;
  uint64_t version = 0;
  if (absl::ConsumePrefix(&details, kShardMapDetailPrefix) && absl::SimpleAtoi(details, &version)) {
    return WrongShardError(status.error_message(), version);
  }
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

namespace {

constexpr int kKeepaliveMs = 30000;

// The longest wait between a channel's attempts to reconnect. gRPC's default
// grows to 120 s, so a node found its restarted coordinator (or a worker its
// restarted server) up to two minutes late, long past the coordinator's
// grace period (one node timeout, 5 s by default). A failed connect to a
// peer that is down costs a SYN and a RST.
constexpr int kMaxReconnectBackoffMs = 1000;

// Big tensors move best in big pieces: HTTP/2 frames of up to 1 MiB instead
// of 16 KiB, and socket reads of up to 4 MiB, so a chunk usually arrives in
// one slice and is used in place (see docs/benchmarks.md for the effect).
template <typename Args>
void SetTransportArgs(Args& set_int) {
  set_int(GRPC_ARG_HTTP2_MAX_FRAME_SIZE, 1 << 20);
  set_int(GRPC_ARG_TCP_READ_CHUNK_SIZE, 1 << 20);
  set_int(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 256 << 10);
  set_int(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 4 << 20);
}

}  // namespace

std::shared_ptr<grpc::Channel> CreateFulcrumChannel(const std::string& target, int index,
                                                   const security::Transport& transport) {
  grpc::ChannelArguments args;
  auto set_int = [&](const char* key, int value) { args.SetInt(key, value); };
  SetTransportArgs(set_int);
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // A distinct arg value keeps gRPC from sharing one subchannel (one TCP
  // connection) between our parallel channels.
  args.SetInt("fulcrum.channel_index", index);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveMs);
  // gRPC's reconnect backoff grows to 120 s: after a long outage a node
  // would find its restarted coordinator or server up to two minutes late.
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, kMaxReconnectBackoffMs);
  return grpc::CreateCustomChannel(target, transport.ChannelCredentials(), args);
}

std::shared_ptr<grpc::Channel> CreateCheckpointChannel(const std::string& target,
                                                      const security::Transport& transport) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxCheckpointMessageBytes);
  return grpc::CreateCustomChannel(target, transport.ChannelCredentials(), args);
}

void ConfigureServerBuilder(grpc::ServerBuilder& builder) {
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxCheckpointMessageBytes);
  // Without this gRPC 1.51 opens a second random port when asked for port 0.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Clients ping every kKeepaliveMs on long-lived calls (a stream idle in a
  // BSP wait carries no data for minutes). gRPC servers by default accept
  // data-less pings only every 5 minutes and answer more with GOAWAY
  // "too_many_pings", which would cut such streams: accept them here.
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, kKeepaliveMs / 2);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  auto set_int = [&](const char* key, int value) { builder.AddChannelArgument(key, value); };
  SetTransportArgs(set_int);
}

void ServeHealthOf(grpc::Server* server, std::initializer_list<const char*> services) {
  grpc::HealthCheckServiceInterface* health = server->GetHealthCheckService();
  if (health == nullptr) return;
  for (const char* name : services) health->SetServingStatus(name, true);
}

}  // namespace fulcrum
