// A job's data and model as its spec names them: data paths resolved and
// confined to the worker's roots, datasets read (once per daemon) and
// summarized, the model's configuration completed from the data.
#ifndef FULCRUM_WORKER_SETUP_JOB_DATA_H_
#define FULCRUM_WORKER_SETUP_JOB_DATA_H_

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/dtype.h"
#include "fulcrum/v1/cluster.pb.h"
#include "worker/data/dataset.h"
#include "worker/models/model.h"

namespace fulcrum {

// A spec's dtype: unspecified means fp32.
DType DTypeOf(v1::DType d);

// Where relative data paths resolve by default: $FULCRUM_DATA_DIR, else
// ~/.cache/fulcrum/data (where deploy/local/fetch_data.sh puts datasets).
std::string DefaultDataDir();

// Loads one DataSource (paths relative to `data_dir`). With `roots`, every
// path must resolve inside one of them, else PERMISSION_DENIED naming the
// path and the roots (train_local, which reads the user's own spec, passes
// none).
absl::StatusOr<std::unique_ptr<data::Dataset>> LoadDataSource(const v1::DataSource& source,
                                                              const std::string& data_dir,
                                                              const std::vector<std::string>* roots = nullptr);

// `path` (relative ones under `dir`) made canonical and checked to lie inside
// one of `roots`.
absl::StatusOr<std::string> ConfinedDataPath(const std::string& path, const std::string& dir,
                                             const std::vector<std::string>& roots);
// The model a job spec asks for, completed from the training data.
// The model a spec describes for its training data. mf, and a graph whose
// loss is squared_error, start their global bias at the mean training label.
absl::StatusOr<models::ModelConfig> ModelConfigFor(const v1::JobSpec& spec, const data::Dataset& train);
// The epoch a rank that resumed at step `start` should evaluate before it
// trains: for rank 0 of a later incarnation with test data, resuming exactly
// at the end of an epoch that is not the last (the one it replaced may have
// died between that epoch's last step and its report). Under BSP the
// servers then hold exactly that epoch's weights (no rank passes the step
// until rank 0 pushes it); under SSP and ASP they may be a few steps later.
// The last epoch is evaluated at the end (FinishTraining) as before.
std::optional<uint32_t> EpochToEvaluateOnResume(uint32_t rank, uint32_t incarnation, uint64_t start,
                                                uint64_t steps_per_epoch, uint64_t total_steps, bool has_test);
// The mean of `d`'s labels (0 when empty), summed in order in double: every
// rank computes the same value from the same rows.
float MeanLabel(const data::Dataset& d);

// What a worker read from `source`: examples, features, classes, the label
// column (counted from 0), for its log and the job's status.
v1::DataSummary SummarizeData(const v1::DataSource& source, const data::Dataset& data);
// INVALID_ARGUMENT when the classes in the data disagree with the model's:
// training labels that span another count than model.num_classes (when the
// spec sets it), or test labels beyond the model's classes. The message
// names the label column and how to fix the spec.
absl::Status CheckClasses(const v1::JobSpec& spec, const models::ModelConfig& model, const v1::DataSummary& train,
                          const v1::DataSummary* test);

// A job's training and test data: the spec's test source when it has one,
// else `test_fraction` of the training rows (split by the spec's seed, the
// same rows on every rank), else none.
struct JobDatasets {
  std::shared_ptr<const data::Dataset> train, test;
};
// From the loaded training data (all of it) and the test source's data
// (null without one). INVALID_ARGUMENT when dense test data has another
// width than the training data's.
absl::StatusOr<JobDatasets> SplitJobData(const v1::JobSpec& spec, std::shared_ptr<const data::Dataset> train_all,
                                         std::shared_ptr<const data::Dataset> test);

// Datasets shared by every assignment of a daemon, by source.
class DataCache {
 public:
  // The dataset `source` names, read on first use (LoadDataSource, confined
  // to `roots`) and shared after.
  absl::StatusOr<std::shared_ptr<const data::Dataset>> Get(const v1::DataSource& source, const std::string& dir,
                                                           const std::vector<std::string>& roots);

 private:
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const data::Dataset>> cache_ ABSL_GUARDED_BY(mu_);
};

}  // namespace fulcrum

#endif  // FULCRUM_WORKER_SETUP_JOB_DATA_H_
