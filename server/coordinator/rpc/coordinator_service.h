// gRPC front end of a Coordinator: JobService and ClusterService, plus the
// standard health service and server reflection. Unary calls use the sync
// API; the long polls (WatchJob, Heartbeat, CheckpointJob) are callback
// reactors over the coordinator's parked polls, so open ones hold no thread.
// A user's open WatchJobs and CheckpointJobs are bounded by
// CoordinatorOptions::max_long_calls_per_user.
#ifndef FULCRUM_SERVER_COORDINATOR_RPC_COORDINATOR_SERVICE_H_
#define FULCRUM_SERVER_COORDINATOR_RPC_COORDINATOR_SERVICE_H_

#include <memory>
#include <string>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "common/rpc/security.h"
#include "server/coordinator/rpc/auth.h"
#include "server/coordinator/coordinator.h"

namespace fulcrum {

class CoordinatorGrpcServer {
 public:
  // Serves `coordinator` (not owned) on `listen_address` ("127.0.0.1:0" for
  // any free port). With `tokens` the job API needs a bearer token and users
  // see only their own jobs; without, every caller is an anonymous admin.
  // `security`: TLS with the coordinator's member certificate, client
  // certificates asked for and required on the cluster service; plaintext
  // when null.
  static absl::StatusOr<std::unique_ptr<CoordinatorGrpcServer>> Start(
      Coordinator* coordinator, const std::string& listen_address,
      std::shared_ptr<TokenAuthenticator> tokens = nullptr,
      std::shared_ptr<const security::Transport> security = nullptr);
  ~CoordinatorGrpcServer();

  const std::string& address() const { return address_; }
  // Wakes the long polls, then stops the transport. Idempotent.
  void Shutdown();

 private:
  class JobImpl;
  class ClusterImpl;
  CoordinatorGrpcServer() = default;
  Coordinator* coordinator_ = nullptr;
  std::shared_ptr<const security::Transport> security_;  // outlives the services
  std::unique_ptr<JobImpl> jobs_;
  std::unique_ptr<ClusterImpl> cluster_;
  std::unique_ptr<grpc::Service> reflection_v1_;  // outlives server_
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  bool shut_down_ = false;
};

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_COORDINATOR_RPC_COORDINATOR_SERVICE_H_
