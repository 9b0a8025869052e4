#include "worker/setup/trainer_options.h"

#include "common/status_macros.h"
#include "worker/data/pipeline.h"

namespace fulcrum {

absl::StatusOr<training::TrainerOptions> TrainerOptionsFor(const v1::JobSpec& spec, const RankEnvironment& env) {
  training::TrainerOptions to;
  to.job_id = env.job_id;
  to.batch_size = env.batch_size;
  to.lr_scaling = env.lr_scaling;
  to.seed = spec.seed();
  to.progressive_window = spec.progressive_window();
  // Every consistency model: under BSP the servers hold the early pull
  // until the step is applied (TrainerOptions::prefetch_parameters).
  to.prefetch_parameters = true;
  to.rank = env.rank;
  to.world_size = env.world_size;
  to.shuffle = !spec.data().no_shuffle();
  to.decode_threads = env.decode_threads > 0 ? env.decode_threads : data::DefaultDecodeThreads(env.cores, env.gpu);
  to.prefetch_hints = env.prefetch_hints;
  ASSIGN_OR_RETURN(to.device_data, data::DeviceDataModeFromName(env.device_data));
  to.device_data_share = env.device_data_share;
  if (spec.max_steps_per_epoch() > 0) to.max_steps_per_epoch = spec.max_steps_per_epoch();
  to.clip_global_norm = spec.optimizer().clip_global_norm();
  if (spec.consistency().model() == v1::ConsistencySpec::LOCAL) {
    to.sync_every = static_cast<int>(spec.consistency().sync_every_steps());
    ASSIGN_OR_RETURN(to.inner, training::InnerOptimizerFromSpec(spec.consistency().inner_optimizer()));
    to.prefetch_parameters = false;  // a round pulls once, at its start
    to.overlap_rounds = spec.consistency().overlap_rounds();
  }
  return to;
}

}  // namespace fulcrum
