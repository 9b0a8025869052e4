// gRPC front end of a ParameterServer: the ParameterService over the callback
// API. Push, Pull, Stream and shared-memory slots are served raw (grpc::ByteBuffer) through
// common/rpc/wire_codec so tensor bytes are not copied into protobuf objects.
#ifndef FULCRUM_SERVER_RPC_PS_SERVICE_H_
#define FULCRUM_SERVER_RPC_PS_SERVICE_H_

#include <memory>
#include <string>

#include <grpcpp/server.h>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/rpc/security.h"
#include "common/spare_core.h"
#include "server/parameter_server.h"

namespace fulcrum {
namespace metrics {
class Scrape;
}

class PsGrpcServer {
 public:
  struct Options {
    // Offer workers on this host shared memory (OpenSharedMemory).
    bool shared_memory = true;
    // How long a session's thread polls for a push the worker announced
    // (GrpcPsClient::ExpectPush) before it sleeps again; zero never polls.
    absl::Duration shared_memory_poll = absl::Microseconds(500);
    // Whether the host has a core to spare for that polling (SpareCore;
    // tests of polling give one that answers as they need).
    SpareCoreProbe spare_core = &SpareCore;
    // Calls that block (Checkpoint and Restore wait for a step or the disk;
    // ReadCheckpoint reads the store) run on bounded pools, one for each
    // kind so a Restore waiting on a peer's reads never starves them: at
    // most this many threads each, and this many calls waiting; the next
    // is refused RESOURCE_EXHAUSTED.
    int blocking_threads = 8;
    size_t blocking_queue = 256;
    // Mutual TLS with the process's member certificate; plaintext when null.
    // Peer servers' checkpoints are read over it too.
    std::shared_ptr<const security::Transport> security;
  };
  // Serves `ps` (not owned; must outlive this) on `listen_address`, e.g.
  // "127.0.0.1:0" for any free port. Enables health checking and reflection.
  static absl::StatusOr<std::unique_ptr<PsGrpcServer>> Start(ParameterServer* ps,
                                                             const std::string& listen_address,
                                                             const Options& options);
  static absl::StatusOr<std::unique_ptr<PsGrpcServer>> Start(ParameterServer* ps,
                                                             const std::string& listen_address) {
    return Start(ps, listen_address, Options());
  }
  ~PsGrpcServer();

  int port() const { return port_; }
  // "host:port" with the bound port.
  const std::string& address() const { return address_; }
  // Shared-memory sessions open now.
  size_t shared_memory_sessions() const;
  // Shared-memory requests found polling for a push the worker announced.
  uint64_t shared_memory_polled() const;
  // This transport's metrics (shared-memory sessions and requests).
  void CollectMetrics(metrics::Scrape* out) const;
  // Drains the parameter server's waits, then stops the transport. Idempotent.
  void Shutdown();
  void Wait();

 private:
  class Service;
  PsGrpcServer() = default;
  ParameterServer* ps_ = nullptr;
  std::shared_ptr<const security::Transport> security_;  // outlives service_
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Service> reflection_v1_;  // outlives server_
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::string address_;
  bool shut_down_ = false;
};

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_RPC_PS_SERVICE_H_
