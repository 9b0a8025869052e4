// CoordinatorClient: what a worker's training asks of the coordinator
// beyond its node agent's registration and heartbeats: taking its progress
// reports. The worker daemon uses the interface; GrpcCoordinatorClient
// carries it over the ClusterService stub the node agent already holds.
#ifndef FULCRUM_WORKER_RPC_COORDINATOR_CLIENT_H_
#define FULCRUM_WORKER_RPC_COORDINATOR_CLIENT_H_

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "fulcrum/v1/cluster.grpc.pb.h"

namespace fulcrum {

class CoordinatorClient {
 public:
  virtual ~CoordinatorClient() = default;
  // UNAVAILABLE or DEADLINE_EXCEEDED when the coordinator could not be
  // reached in `timeout` (worth sending again); other errors as it answered.
  virtual absl::StatusOr<v1::ReportProgressResponse> ReportProgress(const v1::ReportProgressRequest& request,
                                                                    absl::Duration timeout) = 0;
};

class GrpcCoordinatorClient final : public CoordinatorClient {
 public:
  explicit GrpcCoordinatorClient(v1::ClusterService::Stub* stub) : stub_(stub) {}
  absl::StatusOr<v1::ReportProgressResponse> ReportProgress(const v1::ReportProgressRequest& request,
                                                            absl::Duration timeout) override;

 private:
  v1::ClusterService::Stub* const stub_;  // not owned
};

}  // namespace fulcrum

#endif  // FULCRUM_WORKER_RPC_COORDINATOR_CLIENT_H_
