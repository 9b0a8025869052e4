// GrpcPsClient: the PsClient over gRPC.
//
// Slicing: dense tables go chunk by chunk to the chunk's owner; sparse keys
// are grouped by owner. Requests to a server are packed into messages of at
// most max_payload_bytes (1 MiB by default) and spread over
// `channels_per_server` TCP connections, so a big tensor moves over several
// connections at once. Transport is unary calls, or long-lived bidirectional
// streams (one per connection) to each server, with shared memory in front
// of either for servers on the same host.
//
// Retries: UNAVAILABLE is retried with backoff (a push keeps its (worker_id,
// seq), so the server applies it once). A shard-map mismatch (ABORTED with
// the server's map version) refreshes the map from that server and re-routes
// the affected part: always for pulls and ASP pushes; for BSP/SSP pushes the
// error is returned, since a mid-step map change would split a step's parts
// (map changes under BSP/SSP happen at step boundaries).
#ifndef FULCRUM_WORKER_RPC_GRPC_PS_CLIENT_H_
#define FULCRUM_WORKER_RPC_GRPC_PS_CLIENT_H_

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "fulcrum/v1/ps.pb.h"
#include "worker/ps_client.h"
#include "worker/rpc/remote_ps_client.h"

namespace fulcrum {

// Its options are transport-neutral (worker/rpc/remote_ps_client.h), so
// code outside rpc/ names them without naming gRPC.
using GrpcPsClientOptions = RemotePsClientOptions;

class GrpcPsClient final : public PsClient {
 public:
  static absl::StatusOr<std::unique_ptr<GrpcPsClient>> Create(GrpcPsClientOptions options);
  ~GrpcPsClient() override;

  absl::Status CreateJob(const v1::PsJobSpec& spec) override;
  absl::Status OpenJob(const std::string& job_id) override;
  absl::Status DeleteJob(const std::string& job_id) override;
  Future<absl::Status> PushAsync(const std::string& job_id, const PushBatch& batch) override;
  Future<absl::Status> PullAsync(const std::string& job_id, const PullBatch& batch) override;
  // Rings the servers this worker shares memory with (their session
  // threads then poll for the push: PsGrpcServer::Options::shared_memory_poll).
  void ExpectPush() override;
  void Prefetch(const std::string& job_id, const std::vector<SparseTarget>& keys) override;

  // Job statistics from one server (PsClient::GetJobStats).
  absl::StatusOr<v1::GetJobResponse> GetJobStats(const std::string& job_id, size_t server) override;
  uint64_t shard_map_version() const;
  // Requests sent through shared memory so far (for tests and tools).
  uint64_t shared_memory_requests() const;
  // Of their responses, those the waiting thread read itself (polling).
  uint64_t shared_memory_polled() const;
  // Of the requests, those that waited for a free slot (sessions still open).
  uint64_t shared_memory_waited() const;

  class Impl;

 private:
  explicit GrpcPsClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fulcrum

#endif  // FULCRUM_WORKER_RPC_GRPC_PS_CLIENT_H_
