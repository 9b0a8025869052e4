// The Trainer's options for a job spec, one function for every program that
// trains one: fulcrum-worker's assignments and fulcrum-train-local alike, so
// a spec trains the same way in a cluster and in one process.
#ifndef FULCRUM_WORKER_SETUP_TRAINER_OPTIONS_H_
#define FULCRUM_WORKER_SETUP_TRAINER_OPTIONS_H_

#include <string>

#include "absl/status/statusor.h"
#include "fulcrum/v1/cluster.pb.h"
#include "worker/training/trainer.h"

namespace fulcrum {

// What the program running a rank knows beside its spec.
struct RankEnvironment {
  std::string job_id;
  int rank = 0;
  int world_size = 1;
  // Batch size (the spec's, or what batch_size auto chose) and the learning
  // rate's scaling for it.
  int batch_size = 0;
  training::LrScaling lr_scaling;
  // Threads decoding batches; 0: data::DefaultDecodeThreads for `cores`
  // cores on the device.
  int decode_threads = 0;
  int cores = 1;
  bool gpu = false;
  // TrainerOptions::prefetch_hints.
  bool prefetch_hints = false;
  // Datasets on the device: auto, on or off (data::DeviceDataModeFromName),
  // and the share of its memory they may take.
  std::string device_data = "auto";
  double device_data_share = 0.25;
};

// The options: the spec's seed, shuffling, steps per epoch, clipping and
// local steps (inner optimizer, overlap; a round pulls once, at its start,
// so parameters are prefetched only for per-step training); `env`'s rank,
// batch and threads. INVALID_ARGUMENT names a bad device_data or inner
// optimizer. Callbacks (on_step, stop) are the caller's to set.
absl::StatusOr<training::TrainerOptions> TrainerOptionsFor(const v1::JobSpec& spec, const RankEnvironment& env);

}  // namespace fulcrum

#endif  // FULCRUM_WORKER_SETUP_TRAINER_OPTIONS_H_
