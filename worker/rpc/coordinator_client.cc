#include "worker/rpc/coordinator_client.h"

#include <grpcpp/grpcpp.h>

#include "common/rpc/grpc_util.h"

namespace fulcrum {

absl::StatusOr<v1::ReportProgressResponse> GrpcCoordinatorClient::ReportProgress(
    const v1::ReportProgressRequest& request, absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  v1::ReportProgressResponse response;
  const grpc::Status s = stub_->ReportProgress(&ctx, request, &response);
  if (!s.ok()) return FromGrpcStatus(s);
  return response;
}

}  // namespace fulcrum
