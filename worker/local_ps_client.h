// LocalPsClient: a PsClient over a ParameterServer in this process, without
// a network. Single-process training (tests, `fulcrum-train`-style local
// runs, benchmarks of compute alone) uses the servers' real tables,
// initializers, optimizers and consistency models. Several clients (one
// per worker rank) may share one server.
#ifndef FULCRUM_WORKER_LOCAL_PS_CLIENT_H_
#define FULCRUM_WORKER_LOCAL_PS_CLIENT_H_

#include <atomic>
#include <map>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "server/parameter_server.h"
#include "worker/ps_client.h"

namespace fulcrum {

class LocalPsClient final : public PsClient {
 public:
  // A server owning every virtual shard (of `virtual_shards`), with
  // `options` otherwise (their shard map and server index are set here).
  static absl::StatusOr<std::shared_ptr<ParameterServer>> NewServer(ParameterServerOptions options = {},
                                                                    uint32_t virtual_shards = 64);

  LocalPsClient(std::shared_ptr<ParameterServer> server, std::string worker_id, uint32_t rank = 0);

  absl::Status CreateJob(const v1::PsJobSpec& spec) override;
  absl::Status OpenJob(const std::string& job_id) override;
  absl::Status DeleteJob(const std::string& job_id) override;
  Future<absl::Status> PushAsync(const std::string& job_id, const PushBatch& batch) override;
  Future<absl::Status> PullAsync(const std::string& job_id, const PullBatch& batch) override;
  // The one server's statistics: `server` must be 0 (OUT_OF_RANGE otherwise).
  absl::StatusOr<v1::GetJobResponse> GetJobStats(const std::string& job_id, size_t server) override;

  ParameterServer* server() const { return server_.get(); }

 private:
  // The job's spec, learned from the server on first use.
  absl::StatusOr<std::shared_ptr<const v1::PsJobSpec>> Spec(const std::string& job_id);

  std::shared_ptr<ParameterServer> server_;
  const std::string worker_id_;
  const uint32_t rank_;
  std::atomic<uint64_t> seq_{0};
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const v1::PsJobSpec>> jobs_ ABSL_GUARDED_BY(mu_);
  // Groups sent so far of steps pushed in groups, by (job, step).
  std::map<std::pair<std::string, uint64_t>, uint32_t> open_steps_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fulcrum

#endif  // FULCRUM_WORKER_LOCAL_PS_CLIENT_H_
