// ServerControl: how the coordinator talks to parameter servers (the gRPC
// one in production, server/coordinator/rpc/grpc_server_control.h; fakes
// in tests), and CallEachServer, which asks every server at once.
#ifndef FULCRUM_SERVER_COORDINATOR_SERVER_CONTROL_H_
#define FULCRUM_SERVER_COORDINATOR_SERVER_CONTROL_H_

#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "fulcrum/v1/cluster.pb.h"
#include "fulcrum/v1/ps.pb.h"

namespace fulcrum {

class ServerControl {
 public:
  virtual ~ServerControl() = default;
  // OK also when the server already has this version.
  virtual absl::Status InstallShardMap(const std::string& address, const v1::ShardMap& map) = 0;
  // OK also when the job is not there.
  virtual absl::Status DeleteJob(const std::string& address, const std::string& job_id) = 0;
  // Checkpoints (ParameterService's Checkpoint, Restore, DeleteCheckpoint,
  // ListCheckpoints and ReadCheckpoint).
  virtual absl::StatusOr<v1::ShardCutMeta> Checkpoint(const std::string& address, const std::string& job_id,
                                                      uint64_t cut_id, uint64_t at_step, absl::Duration wait) = 0;
  virtual absl::StatusOr<v1::ShardCutMeta> Restore(const std::string& address, const std::string& job_id,
                                                   uint64_t cut_id, const std::vector<std::string>& sources,
                                                   uint32_t min_incarnation) = 0;
  // OK also when the cut is not there.
  virtual absl::Status DeleteCut(const std::string& address, const std::string& job_id, uint64_t cut_id) = 0;
  virtual absl::StatusOr<std::vector<v1::ShardCutMeta>> ListCuts(const std::string& address,
                                                                 const std::string& job_id) = 0;
  virtual absl::StatusOr<v1::ReadCheckpointResponse> ReadCut(const std::string& address,
                                                             const v1::ReadCheckpointRequest& req) = 0;
  // Cancels calls in flight and fails later ones (the coordinator is
  // stopping and must not wait out a cut's step).
  virtual void CancelAll() {}
};

// Calls `call` for every server at once, each on its own thread, so that a
// server that hangs holds up only its own call; returns the answers in the
// servers' order.
template <typename Result>
std::vector<Result> CallEachServer(const std::vector<std::string>& servers,
                                   const std::function<Result(const std::string&)>& call) {
  std::vector<Result> results(servers.size(), Result(absl::UnknownError("not asked")));
  std::vector<std::thread> threads;
  threads.reserve(servers.size());
  for (size_t i = 0; i < servers.size(); ++i) threads.emplace_back([&, i] { results[i] = call(servers[i]); });
  for (std::thread& th : threads) th.join();
  return results;
}

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_COORDINATOR_SERVER_CONTROL_H_
