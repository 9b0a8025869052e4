#include "common/rpc/grpc_util.h"

#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/channel_arguments.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/errors.h"

namespace fulcrum {
namespace {
constexpr char kShardMapDetailPrefix[] = "fulcrum-shard-map-version:";
}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const auto code = static_cast<grpc::StatusCode>(status.code());
  if (auto version = WrongShardVersion(status)) {
    return grpc::Status(code, std::string(status.message()),
                        absl::StrCat(kShardMapDetailPrefix, *version));
  }
  return grpc::Status(code, std::string(status.message()));
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

std::shared_ptr<grpc::Channel> CreateFulcrumChannel(const std::string& target, int index) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(kMaxMessageBytes);
  args.SetMaxSendMessageSize(kMaxMessageBytes);
  // A distinct arg value keeps gRPC from sharing one subchannel (one TCP
  // connection) between our parallel channels.
  args.SetInt("fulcrum.channel_index", index);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 30000);
  // TLS arrives with the security issue; until then channels are plaintext.
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

void ConfigureServerBuilder(grpc::ServerBuilder& builder) {
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  // Without this gRPC 1.51 opens a second random port when asked for port 0.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
}

}  // namespace fulcrum
