// FakePsClient: an in-memory PsClient for unit tests of code that uses one
// (the worker's training loop). It keeps each job's tables in memory and
// applies plain SGD with the table's learning rate. Calls are queued; the
// test completes them one by one (CompleteNext), or turns on auto-complete.
// Thread-safe.
#ifndef FULCRUM_TESTS_FAKES_FAKE_PS_CLIENT_H_
#define FULCRUM_TESTS_FAKES_FAKE_PS_CLIENT_H_

#include <deque>
#include <map>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "worker/ps_client.h"

namespace fulcrum::testing {

class FakePsClient final : public PsClient {
 public:
  struct Call {
    bool is_push;
    std::string job_id;
    uint64_t step;
    bool last = true;                  // push: PushBatch::last
    std::vector<std::string> tables;   // dense then sparse, as given
  };

  absl::Status CreateJob(const v1::PsJobSpec& spec) override;
  absl::Status OpenJob(const std::string& job_id) override;
  absl::Status DeleteJob(const std::string& job_id) override;
  Future<absl::Status> PushAsync(const std::string& job_id, const PushBatch& batch) override;
  Future<absl::Status> PullAsync(const std::string& job_id, const PullBatch& batch) override;

  void set_auto_complete(bool on);
  size_t pending() const;
  // Completes the oldest queued call: with OK its effect happens (push
  // applied, pull filled); with an error nothing changes. False if none queued.
  bool CompleteNext(const absl::Status& status = absl::OkStatus());
  std::vector<Call> calls() const;  // every call made, in order
  // A dense table's current values (empty when unknown).
  std::vector<float> Dense(const std::string& job_id, const std::string& table) const;

 private:
  struct Table {
    bool dense = true;
    uint32_t dim = 0;
    float lr = 0;
    std::vector<float> values;                                   // dense
    absl::flat_hash_map<uint64_t, std::vector<float>> rows;      // sparse
  };
  struct Pending {
    std::function<absl::Status()> effect;
    Promise<absl::Status> promise;
  };
  Future<absl::Status> Enqueue(Call call, std::function<absl::Status()> effect);

  mutable absl::Mutex mu_;
  bool auto_complete_ ABSL_GUARDED_BY(mu_) = false;
  std::map<std::string, std::map<std::string, Table>> jobs_ ABSL_GUARDED_BY(mu_);
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<Call> calls_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fulcrum::testing

#endif  // FULCRUM_TESTS_FAKES_FAKE_PS_CLIENT_H_
