#include "worker/daemon/worker_daemon.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/config/job_spec.h"
#include "common/dtype.h"
#include "common/errors.h"
#include "common/logging.h"
#include "common/lr_schedule.h"
#include "common/process.h"
#include "common/status_macros.h"
#include "worker/compute/backend.h"
#include "worker/daemon/gpu_time.h"
#include "worker/setup/job_data.h"
#include "worker/setup/trainer_options.h"
#include "worker/daemon/progress_outbox.h"
#include "worker/data/pipeline.h"
#include "worker/models/model.h"
#include "worker/rpc/coordinator_client.h"
#include "worker/row_cache.h"
#include "worker/rpc/remote_ps_client.h"
#include "worker/training/auto_batch.h"
#include "worker/training/trainer.h"

namespace fulcrum {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

// One assignment, on its own thread.
class WorkerDaemon::Runner {
 public:
  Runner(v1::Assignment a, const WorkerDaemonOptions& options, std::string node_id, CoordinatorClient* coordinator,
         DataCache* data, GpuUtilization gpu_utilization)
      : a_(std::move(a)),
        options_(options),
        node_id_(std::move(node_id)),
        data_(data),
        gpu_utilization_(std::move(gpu_utilization)),
        gpu_time_([this]() -> std::optional<double> {
          const int gpu = gpu_index_.load();
          if (gpu < 0 || !gpu_utilization_) return std::nullopt;
          return gpu_utilization_(gpu);
        }),
        outbox_(coordinator, a_.job_id(), [this] { stop_.store(true); }) {
    assigned_batch_.store(a_.spec().batch_size());
    thread_ = std::thread([this] { Run(); });
  }
  ~Runner() {
    Stop();
    thread_.join();
  }
  void Stop() {
    stop_.store(true);
    outbox_.Stop();
  }
  // A heartbeat's copy of this assignment: batch_size auto's choice arrives
  // this way (the coordinator fills in spec.batch_size once rank 0 chose).
  void Update(const v1::Assignment& a) { assigned_batch_.store(a.spec().batch_size()); }
  // Its thread ended and no report is in flight (a send can take up to its
  // 10 s deadline): joining it then does not hold up the caller.
  bool finished() const {
    return finished_.load() && outbox_.idle();
  }

 private:
  struct Failure {
    std::string reason, message;
  };

  void Run() {
    const std::string tag = absl::StrCat("job ", a_.job_id(), " rank ", a_.rank(), "/", a_.world_size());
    FLOG(INFO) << tag << ": assigned (incarnation " << a_.incarnation() << ")";
    absl::Status s = Train(tag);
    gpu_time_.Stop(absl::Now());
    if (stop_.load()) {
      FLOG(INFO) << tag << ": stopped (" << (s.ok() ? std::string("done") : s.ToString()) << ")";
    } else if (!s.ok()) {
      FLOG(WARNING) << tag << ": failed: " << s;
      v1::ReportProgressRequest r = Base();
      r.set_error(std::string(s.message()));
      std::string reason = reason_.empty() ? "WorkerError" : reason_;
      // A server that no longer holds the running job was restarted: the
      // coordinator rolls back as for any server it declares lost.
      if (IsJobNotOnServer(s)) reason = "ServerLost";
      // Out of parameter memory: the same rows come back after a rollback.
      if (IsParameterMemoryExhausted(s)) reason = "QuotaExceeded";
      // A step its predecessor left torn between servers: only a rollback
      // brings every server back to one step.
      if (IsTornStep(s)) reason = "TornStep";
      r.set_error_reason(reason);
      progress_.set_state("failed");
      *r.mutable_progress() = progress_;
      Report(r);
    }
    // Finished means its results reached the coordinator.
    outbox_.Drain();
    finished_.store(true);
  }

  v1::ReportProgressRequest Base() const {
    v1::ReportProgressRequest r;
    r.set_node_id(node_id_);
    r.set_job_id(a_.job_id());
    r.set_rank(a_.rank());
    r.set_incarnation(a_.incarnation());
    return r;
  }

  // Reports go out through the outbox, so a coordinator that is away never
  // holds up training.
  void Report(v1::ReportProgressRequest r) {
    if (gpu_index_.load() >= 0) {
      gpu_time_.Sample(absl::Now());
      r.mutable_progress()->set_gpu_busy_seconds(gpu_time_.busy_seconds());
      r.mutable_progress()->set_gpu_idle_seconds(gpu_time_.idle_seconds());
    }
    outbox_.Post(std::move(r));
  }

  // Whether a throttled progress report may go at `now` (always when
  // `force`); if so, it counts as sent.
  bool ReportDue(Clock::time_point now, bool force = false) {
    if (!force && now - last_report_ < absl::ToChronoNanoseconds(options_.progress_interval)) return false;
    last_report_ = now;
    return true;
  }

  // Progressive validation's figures now into progress_ and the metrics
  // (on the training thread, at each report and each epoch's end).
  void NoteProgressive() {
    if (trainer_ == nullptr) return;
    const training::ProgressiveWindow::Figures f = trainer_->progressive().Now();
    if (f.auc <= 0) return;  // not a binary task, or one class so far
    progress_.set_progressive_auc(f.auc);
    progress_.set_progressive_log_loss(f.log_loss);
    progress_.set_progressive_examples(f.examples);
    metrics_.progressive_auc.store(f.auc);
    metrics_.progressive_log_loss.store(f.log_loss);
  }

  void SendProgress(const std::string& state) {
    progress_.set_state(state);
    v1::ReportProgressRequest r = Base();
    *r.mutable_progress() = progress_;
    r.set_total_steps(total_steps_);
    Report(r);
  }

  // The assignment's training and test data, summarized in progress_.
  absl::StatusOr<JobDatasets> LoadDatasets(const std::string& tag) {
    const v1::JobSpec& spec = a_.spec();
    ASSIGN_OR_RETURN(auto train_all, data_->Get(spec.data().train(), options_.data_dir, options_.data_roots));
    std::shared_ptr<const data::Dataset> test;
    if (spec.data().has_test()) {
      ASSIGN_OR_RETURN(test, data_->Get(spec.data().test(), options_.data_dir, options_.data_roots));
    }
    ASSIGN_OR_RETURN(JobDatasets d, SplitJobData(spec, std::move(train_all), std::move(test)));
    // What was read, where a user sees it: this log, and the job's status.
    *progress_.mutable_train_data() = SummarizeData(spec.data().train(), *d.train);
    if (d.test) {
      *progress_.mutable_test_data() =
          SummarizeData(spec.data().has_test() ? spec.data().test() : spec.data().train(), *d.test);
    }
    FLOG(INFO) << tag << ": train data " << config::DataSummaryLine(progress_.train_data());
    if (d.test) FLOG(INFO) << tag << ": test data " << config::DataSummaryLine(progress_.test_data());
    return d;
  }

  RemotePsClientOptions ClientOptions() const {
    RemotePsClientOptions po;
    po.shard_map = a_.shard_map();
    po.worker_id = absl::StrCat(node_id_, "/", a_.job_id(), "/r", a_.rank(), "/i", a_.incarnation());
    po.rank = a_.rank();
    po.incarnation = a_.incarnation();
    po.wire_dtype = DTypeOf(a_.spec().wire_dtype());
    // Short waits, asked again by the Trainer until stopped: a withdrawn
    // assignment or a stopping worker never sits in a long wait.
    po.pull_wait_timeout = absl::Seconds(2);
    po.channels_per_server = 2;
    // A long-lived stream per connection: a step's few large requests do not
    // each pay for a new call (+6-24% samples/s on the MNIST MLP cluster
    // bench, docs/benchmarks.md).
    po.transport = RemotePsClientOptions::Transport::kStream;
    // With a server on this host, shared memory in front of the stream: no
    // socket copies, no HTTP/2 (docs/benchmarks.md, "Transport: current figures").
    po.shared_memory = options_.shared_memory;
    po.shared_memory_poll = options_.shared_memory_poll;
    po.security = options_.security;
    return po;
  }

  absl::StatusOr<training::TrainerOptions> RankTrainerOptions(int batch_size, const training::LrScaling& lr_scaling,
                                                              bool gpu) {
    RankEnvironment env;
    env.job_id = a_.job_id();
    env.rank = static_cast<int>(a_.rank());
    env.world_size = static_cast<int>(a_.world_size());
    env.batch_size = batch_size;
    env.lr_scaling = lr_scaling;
    env.decode_threads = options_.decode_threads;
    env.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()) / std::max(1u, options_.slots));
    env.gpu = gpu;
    env.prefetch_hints = options_.prefetch_hints;
    env.device_data = options_.device_data;
    env.device_data_share = options_.device_data_share;
    ASSIGN_OR_RETURN(training::TrainerOptions to, TrainerOptionsFor(a_.spec(), env));
    to.on_step = [this](uint64_t step, const models::Metrics& m, const training::StepTiming& t) {
      OnStep(step, m, t);
    };
    to.stop = &stop_;
    return to;
  }

  // A replacement resumes where the slowest server says this rank's last
  // step landed; a first incarnation starts at 0.
  absl::StatusOr<uint64_t> ResumeStep(training::Trainer& trainer, PsClient& client, int64_t spe,
                                      const std::string& tag) {
    if (a_.incarnation() == 0) return 0;
    uint64_t start = UINT64_MAX;
    for (int i = 0; i < a_.shard_map().servers_size(); ++i) {
      ASSIGN_OR_RETURN(v1::GetJobResponse st, client.GetJobStats(a_.job_id(), static_cast<size_t>(i)));
      const int rank = static_cast<int>(a_.rank());
      start = std::min<uint64_t>(start, rank < st.rank_clock_size() ? st.rank_clock(rank) : 0);
    }
    if (start == UINT64_MAX) start = 0;
    // Under local steps the servers count rounds: resume at the start of
    // the first round they lack (its inner steps are lost).
    const uint64_t clock = start;
    start = std::min(trainer.StepOfClock(clock, spe), total_steps_);
    trainer.ResumeAtClock(clock, spe);
    FLOG(INFO) << tag << ": replacing a lost worker; resuming at step " << start << " of " << total_steps_
               << (trainer.local() ? absl::StrCat(" (round ", clock, ")") : std::string());
    return start;
  }

  // The test figures of the servers' weights, as an epoch summary.
  absl::StatusOr<v1::EpochSummary> Evaluate(training::Trainer& trainer, const data::Dataset& test) {
    SendProgress("evaluating");
    ASSIGN_OR_RETURN(training::EvalResult t, trainer.Evaluate(test));
    v1::EpochSummary sum;
    sum.set_test_loss(t.loss);
    sum.set_test_accuracy(t.accuracy);
    sum.set_test_rmse(t.rmse);
    sum.set_test_auc(t.auc);
    sum.set_tested(true);
    return sum;
  }

  absl::Status RunEpoch(training::Trainer& trainer, uint32_t epoch, int64_t first, bool report_start,
                        const JobDatasets& d, const std::string& tag) {
    progress_.set_epoch(epoch);
    epoch_examples_ = 0;
    epoch_loss_ = 0;
    epoch_correct_ = 0;
    epoch_start_ = Clock::now();
    // Epochs shorter than the progress interval report at their end (with
    // the epoch's loss and rate) rather than at every start as well.
    if (ReportDue(epoch_start_, report_start)) SendProgress("training");
    ASSIGN_OR_RETURN(training::EpochResult e, trainer.TrainEpoch(*d.train, static_cast<int>(epoch), first));
    if (stop_.load()) return absl::CancelledError("assignment withdrawn");
    v1::EpochSummary sum;
    progress_.set_data_wait_seconds(e.data_wait_seconds);
    // Until the next in-epoch report, the live figures are this epoch's.
    progress_.set_loss(e.train.loss);
    progress_.set_train_accuracy(e.train.accuracy);
    progress_.set_has_metrics(e.steps > 0);
    progress_.set_samples_per_second(e.samples_per_second);
    if (a_.rank() == 0 && d.test) {
      ASSIGN_OR_RETURN(sum, Evaluate(trainer, *d.test));
      FLOG(INFO) << tag << ": epoch " << epoch << " train loss " << e.train.loss << ", test accuracy "
                 << sum.test_accuracy()
                 << (sum.test_auc() > 0 ? absl::StrCat(", test AUC ", sum.test_auc()) : std::string()) << " ("
                 << e.steps << " steps, " << e.samples_per_second << " samples/s)";
    }
    sum.set_epoch(epoch);
    sum.set_train_loss(e.train.loss);
    sum.set_train_accuracy(e.train.accuracy);
    sum.set_train_auc(e.train.auc);
    sum.set_seconds(e.seconds);
    sum.set_samples_per_second(e.samples_per_second);
    FLOG(INFO) << tag << ": epoch " << epoch << " took " << e.seconds << " s: pull " << e.pull_wait_seconds
               << " s, compute " << e.compute_seconds << " s, push " << e.push_wait_seconds << " s, data "
               << e.data_wait_seconds << " s, prepare " << e.prepare_seconds << " s";
    v1::ReportProgressRequest r = Base();
    progress_.set_state("training");
    NoteProgressive();
    *r.mutable_progress() = progress_;
    *r.mutable_epoch_done() = sum;
    r.set_total_steps(total_steps_);
    Report(r);
    return absl::OkStatus();
  }

  // Evaluates the weights the servers hold now as epoch `epoch`'s test
  // figures and reports them as an evaluation only: the coordinator takes
  // them where the epoch has none.
  absl::Status ReportEvaluation(training::Trainer& trainer, const data::Dataset& test, uint32_t epoch,
                                const std::string& tag) {
    ASSIGN_OR_RETURN(v1::EpochSummary sum, Evaluate(trainer, test));
    sum.set_epoch(epoch);
    sum.set_evaluation_only(true);
    FLOG(INFO) << tag << ": resumed at the end of epoch " << epoch << "; its test figures from the weights there: "
               << "loss " << sum.test_loss() << ", accuracy " << sum.test_accuracy();
    v1::ReportProgressRequest er = Base();
    *er.mutable_progress() = progress_;
    *er.mutable_epoch_done() = sum;
    er.set_total_steps(total_steps_);
    Report(er);
    return absl::OkStatus();
  }

  // After the last epoch: the last round landed, the final weights'
  // evaluation where no epoch of this incarnation gave one, and the report
  // that this rank finished.
  absl::Status FinishTraining(training::Trainer& trainer, uint64_t start, const JobDatasets& d,
                              const std::string& tag) {
    // The last overlapped round is still in flight: this rank has finished
    // once the servers hold it.
    RETURN_IF_ERROR(trainer.Flush());
    if (a_.rank() == 0 && d.test && start >= total_steps_) {
      // A replacement that resumed after the last step trained nothing; the
      // incarnation it replaced may have finished the last epoch without its
      // evaluation being taken. Evaluate the final weights.
      RETURN_IF_ERROR(ReportEvaluation(trainer, *d.test, a_.spec().epochs() - 1, tag));
    }
    v1::ReportProgressRequest r = Base();
    if (a_.rank() == 0) {
      ASSIGN_OR_RETURN(std::string fp, trainer.DenseFingerprint());
      r.set_weights_fingerprint(fp);
    }
    progress_.set_state("finished");
    progress_.set_step(trainer.step());
    *r.mutable_progress() = progress_;
    r.set_finished(true);
    r.set_total_steps(total_steps_);
    Report(r);
    FLOG(INFO) << tag << ": finished at step " << trainer.step();
    return absl::OkStatus();
  }

  absl::Status Train(const std::string& tag) {
    const v1::JobSpec& spec = a_.spec();
    SendProgress("loading");
    reason_ = "BadData";
    ASSIGN_OR_RETURN(const JobDatasets d, LoadDatasets(tag));
    reason_ = "BadSpec";
    std::string why;
    ASSIGN_OR_RETURN(std::unique_ptr<compute::Backend> backend,
                     compute::CreateBackend(options_.device, &why, cpu_threads()));
    progress_.set_device(backend->name());
    ASSIGN_OR_RETURN(models::ModelConfig mc, ModelConfigFor(spec, *d.train));
    reason_ = "BadData";
    RETURN_IF_ERROR(CheckClasses(spec, mc, progress_.train_data(), d.test ? &progress_.test_data() : nullptr));
    reason_ = "BadSpec";
    ASSIGN_OR_RETURN(std::unique_ptr<models::Model> model, models::CreateModel(mc, backend.get()));
    if (backend->is_gpu()) gpu_index_.store(GpuIndexOf(backend->name()));
    training::LrScaling lr_scaling;
    int batch_size = static_cast<int>(spec.batch_size());
    if (spec.batch_size_auto().enabled()) {
      ASSIGN_OR_RETURN(batch_size, AutoBatch(tag, spec, mc, *d.train, backend.get(), &lr_scaling));
    }
    progress_.set_batch_size(static_cast<uint32_t>(batch_size));
    progress_batch_.store(static_cast<uint32_t>(batch_size));
    lr_scaling_ = lr_scaling;

    reason_ = "ParameterServerError";
    ASSIGN_OR_RETURN(std::unique_ptr<PsClient> remote, NewRemotePsClient(ClientOptions()));
    // The job's row cache wraps the servers' client (worker/row_cache.h).
    std::unique_ptr<PsClient> cached;
    if (spec.cache().rows() > 0) {
      RowCacheOptions ro;
      ro.rows = spec.cache().rows();
      ro.max_staleness_steps = spec.cache().max_staleness_steps();
      ro.wire_value_bytes = (spec.wire_dtype() == v1::DTYPE_BF16 || spec.wire_dtype() == v1::DTYPE_FP16) ? 2 : 4;
      ro.stats = &cache_stats_;
      cached = std::make_unique<CachingPsClient>(remote.get(), ro);
      FLOG(INFO) << tag << ": caching up to " << ro.rows << " rows per sparse table, served up to "
                 << ro.max_staleness_steps << " steps after their pull";
    }
    PsClient* const client = cached != nullptr ? cached.get() : remote.get();
    v1::PsJobSpec ps_spec = training::JobSpecFor(*model, a_.job_id(), spec.optimizer(), spec.consistency(),
                                                 a_.world_size());
    ps_spec.set_quota_bytes(spec.quota_bytes());
    RETURN_IF_ERROR(client->CreateJob(ps_spec));
    lr_base_ = spec.optimizer().learning_rate();
    lr_schedule_ = LrScheduleFromProto(spec.optimizer().schedule());

    ASSIGN_OR_RETURN(training::TrainerOptions to, RankTrainerOptions(batch_size, lr_scaling, backend->is_gpu()));
    training::Trainer trainer(model.get(), client, to);
    trainer_ = &trainer;
    absl::Cleanup forget_trainer = [this] { trainer_ = nullptr; };
    const int64_t spe = trainer.StepsPerEpoch(*d.train);
    if (spe <= 0) return absl::InvalidArgumentError("the training data gives this rank no batches");
    total_steps_ = static_cast<uint64_t>(spe) * spec.epochs();
    ASSIGN_OR_RETURN(const uint64_t start, ResumeStep(trainer, *client, spe, tag));
    trainer.set_step(start);
    // Under BSP a predecessor that died between its pushes of one step to
    // different servers left that step applied on some and missing on
    // others: the servers ahead no longer hold the weights the step needs,
    // so the first pulls must get exactly this clock's weights or fail
    // (TornStep: the coordinator rolls back to the last cut).
    const v1::ConsistencySpec& cs = spec.consistency();
    const bool bsp = cs.model() == v1::ConsistencySpec::BSP || cs.model() == v1::ConsistencySpec::MODEL_UNSPECIFIED ||
                     (cs.model() == v1::ConsistencySpec::LOCAL && cs.staleness() == 0);
    if (a_.incarnation() > 0 && bsp) trainer.set_exact_pull_clock(trainer.clock());
    progress_.set_step(start);
    FLOG(INFO) << tag << ": " << model->config().type << " on " << backend->name() << ", " << d.train->size()
               << " training examples, " << spe << " steps per epoch, " << spec.epochs() << " epochs"
               << (d.test ? absl::StrCat(", ", d.test->size(), " test examples") : std::string());
    reason_ = "WorkerError";
    // A replacement of rank 0 that resumes at the end of an epoch evaluates
    // it first: the incarnation it replaced may have died between that
    // epoch's last step and its report (the epoch would stay "not tested").
    if (const std::optional<uint32_t> e = EpochToEvaluateOnResume(a_.rank(), a_.incarnation(), start,
                                                                   static_cast<uint64_t>(spe), total_steps_,
                                                                   d.test != nullptr)) {
      RETURN_IF_ERROR(ReportEvaluation(trainer, *d.test, *e, tag));
    }
    if (gpu_index_.load() >= 0) gpu_time_.Start(absl::Now());
    for (uint32_t epoch = static_cast<uint32_t>(start / spe); epoch < spec.epochs(); ++epoch) {
      if (stop_.load()) return absl::CancelledError("assignment withdrawn");
      const bool first_epoch = epoch == start / spe;
      const int64_t first = first_epoch ? static_cast<int64_t>(start % spe) : 0;
      RETURN_IF_ERROR(RunEpoch(trainer, epoch, first, /*report_start=*/first_epoch, d, tag));
    }
    return FinishTraining(trainer, start, d, tag);
  }

  void OnStep(uint64_t step, const models::Metrics& m, const training::StepTiming& t) {
    metrics_.data_wait.Observe(t.data_wait);
    metrics_.pull.Observe(t.pull);
    metrics_.compute.Observe(t.compute);
    metrics_.push.Observe(t.push);
    metrics_.step.Observe(t.total);
    metrics::AtomicAdd(&metrics_.samples, static_cast<double>(m.examples));
    metrics_.steps.fetch_add(1, std::memory_order_relaxed);
    if (m.examples > 0) metrics_.loss.store(m.loss_sum / static_cast<double>(m.examples));
    metrics_.epoch.store(progress_.epoch());
    if (m.grad_norm >= 0) metrics_.grad_norm.store(m.grad_norm);
    if (m.clipped) metrics_.clipped_steps.fetch_add(1, std::memory_order_relaxed);
    const double scale = lr_scaling_.At(step);
    const double lr = LearningRateAt(lr_schedule_, lr_base_, step) * scale;
    metrics_.learning_rate.store(lr);
    progress_.set_learning_rate(lr);
    progress_.set_lr_scale(scale);
    epoch_examples_ += m.examples;
    epoch_loss_ += m.loss_sum;
    epoch_correct_ += m.correct;
    progress_.set_step(step + 1);
    const auto now = Clock::now();
    if (!ReportDue(now)) return;
    const double secs = std::chrono::duration<double>(now - epoch_start_).count();
    if (epoch_examples_ > 0) {
      progress_.set_loss(epoch_loss_ / epoch_examples_);
      progress_.set_train_accuracy(static_cast<double>(epoch_correct_) / epoch_examples_);
      progress_.set_has_metrics(true);
    }
    progress_.set_samples_per_second(secs > 0 ? epoch_examples_ / secs : 0);
    NoteProgressive();
    SendProgress("training");
  }


 public:
  void CollectMetrics(metrics::Scrape* out) const {
    const metrics::Labels l = {{"job", a_.job_id()}, {"rank", absl::StrCat(a_.rank())}};
    auto phase = [&](const char* name, const metrics::Histogram& h) {
      out->Histogram("fulcrum_worker_step_phase_seconds",
                     "Where a training step's time went: data_wait, pull, compute (forward + backward), push",
                     {{"job", a_.job_id()}, {"rank", absl::StrCat(a_.rank())}, {"phase", name}}, h);
    };
    phase("data_wait", metrics_.data_wait);
    phase("pull", metrics_.pull);
    phase("compute", metrics_.compute);
    phase("push", metrics_.push);
    out->Histogram("fulcrum_worker_step_duration_seconds", "Wall time of one training step", l, metrics_.step);
    out->Counter("fulcrum_worker_samples_total", "Training examples processed", l, metrics_.samples.load());
    out->Counter("fulcrum_worker_steps_total", "Training steps completed by this worker for the rank", l,
                 static_cast<double>(metrics_.steps.load()));
    out->Gauge("fulcrum_worker_loss", "Mean training loss of the rank's last step (NaN when it diverged)", l,
               metrics_.loss.load());
    out->Gauge("fulcrum_worker_epoch", "The epoch the rank is training", l, metrics_.epoch.load());
    if (gpu_index_.load() >= 0) {
      const char* help = "Seconds this worker held a GPU for the rank while training, split by NVML utilization";
      metrics::Labels busy = l, idle = l;
      busy.push_back({"state", "busy"});
      idle.push_back({"state", "idle"});
      out->Counter("fulcrum_worker_gpu_seconds_total", help, busy, gpu_time_.busy_seconds());
      out->Counter("fulcrum_worker_gpu_seconds_total", help, idle, gpu_time_.idle_seconds());
    }
    if (progress_batch_.load() > 0) {
      out->Gauge("fulcrum_worker_batch_size", "Examples per step the rank trains with (the spec's, or batch_size auto's)",
                 l, progress_batch_.load());
    }
    if (a_.spec().cache().rows() > 0) {
      const RowCacheStats& c = cache_stats_;
      out->Counter("fulcrum_worker_cache_hits_total", "Sparse rows served from the worker's row cache (spec cache)", l,
                   static_cast<double>(c.hits.load()));
      out->Counter("fulcrum_worker_cache_misses_total",
                   "Sparse rows of cached tables pulled from the servers (not held, or older than the bound)", l,
                   static_cast<double>(c.misses.load()));
      out->Counter("fulcrum_worker_cache_bytes_saved_total",
                   "Wire bytes of the rows served from the cache instead of pulled", l,
                   static_cast<double>(c.bytes_saved.load()));
      out->Gauge("fulcrum_worker_cache_rows", "Rows the worker's row cache holds, over all sparse tables", l,
                 static_cast<double>(c.rows.load()));
      out->Gauge("fulcrum_worker_cache_memory_bytes", "Host memory the worker's row cache takes", l,
                 static_cast<double>(c.bytes.load()));
      out->Histogram("fulcrum_worker_cache_staleness_steps",
                     "Age in steps of each row served from the cache (at most cache.max_staleness_steps)", l,
                     c.staleness);
    }
    out->Gauge("fulcrum_worker_learning_rate",
               "The optimizer's learning rate at the rank's last step (the spec's optimizer.schedule)", l,
               metrics_.learning_rate.load());
    if (metrics_.progressive_auc.load() > 0) {
      out->Gauge("fulcrum_worker_progressive_auc",
                 "Binary tasks: AUC of the rank's trailing window of batches, each scored before it was trained on",
                 l, metrics_.progressive_auc.load());
      out->Gauge("fulcrum_worker_progressive_log_loss",
                 "Binary tasks: log loss of the rank's trailing window of batches, each scored before it was trained on",
                 l, metrics_.progressive_log_loss.load());
    }
    if (metrics_.grad_norm.load() >= 0) {  // clipping is on: the trainer computes the norm
      out->Gauge("fulcrum_worker_gradient_norm",
                 "Global L2 norm of the rank's last step's gradients before clipping (optimizer.clip_global_norm)", l,
                 metrics_.grad_norm.load());
      out->Counter("fulcrum_worker_clipped_steps_total",
                   "Steps whose gradients were scaled down to optimizer.clip_global_norm", l,
                   static_cast<double>(metrics_.clipped_steps.load()));
    }
  }

 private:

  // batch_size auto (training/auto_batch.h): rank 0 times growing batches
  // on its device and reports its choice; the coordinator hands it to every
  // rank (and to any replacement) in the assignment's spec.batch_size, so
  // all ranks take the same number of steps per epoch. Returns the batch
  // and sets the learning-rate scaling that goes with it.
  absl::StatusOr<int> AutoBatch(const std::string& tag, const v1::JobSpec& spec, const models::ModelConfig& mc,
                                const data::Dataset& train, compute::Backend* be, training::LrScaling* lr) {
    const training::AutoBatchOptions o = training::AutoBatchOptionsFromSpec(spec.batch_size_auto());
    int batch = static_cast<int>(spec.batch_size());
    if (batch == 0 && a_.rank() == 0) {
      SendProgress("choosing batch size");
      FLOG(INFO) << tag << ": batch_size auto: timing training steps of batches from " << o.base_batch_size
                 << " up on " << be->name();
      const int64_t limit = std::max<int64_t>(1, static_cast<int64_t>(train.size()) / std::max(1u, a_.world_size()));
      ASSIGN_OR_RETURN(training::AutoBatchChoice c,
                       training::ChooseBatchSize(o, be->memory_bytes(), limit,
                                                 [&](int b) -> absl::StatusOr<training::BatchTrial> {
                                                   if (stop_.load()) return absl::CancelledError("assignment withdrawn");
                                                   return training::MeasureBatch(be, mc, train, b);
                                                 }));
      batch = c.batch;
      progress_.set_batch_size_choice(c.summary);
      FLOG(INFO) << tag << ": batch_size auto: " << c.summary;
    } else if (batch == 0) {
      FLOG(INFO) << tag << ": batch_size auto: waiting for rank 0 to choose the batch";
      SendProgress("waiting for batch size");
      while ((batch = static_cast<int>(assigned_batch_.load())) == 0) {
        if (stop_.load()) return absl::CancelledError("assignment withdrawn");
        absl::SleepFor(absl::Milliseconds(50));
      }
    }
    lr->factor = static_cast<double>(batch) / o.base_batch_size;
    lr->warmup_steps = lr->factor == 1.0 ? 0 : o.warmup_steps;
    FLOG(INFO) << tag << ": batch " << batch << " (batch_size auto); learning rate x" << lr->factor
               << " of the spec's, reached over " << lr->warmup_steps << " warm-up steps (linear scaling rule)";
    return batch;
  }

  // "cuda:1 (NVIDIA ...)" -> 1 (NVML's index; CUDA_VISIBLE_DEVICES remaps
  // CUDA's, so with it set the utilization may be another GPU's).
  static int GpuIndexOf(const std::string& device) {
    int index = 0;
    if (absl::StartsWith(device, "cuda:")) {
      const std::string digits = device.substr(5, device.find_first_not_of("0123456789", 5) - 5);
      if (!absl::SimpleAtoi(digits, &index)) index = 0;
    }
    return index;
  }

  int cpu_threads() const {
    if (options_.cpu_threads > 0) return options_.cpu_threads;
    // Several assignments on one host share its cores.
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    return static_cast<int>(std::max<long>(1, cores / std::max<uint32_t>(1, options_.slots)));
  }

  const v1::Assignment a_;
  const WorkerDaemonOptions& options_;
  const std::string node_id_;
  DataCache* const data_;  // the daemon's
  const GpuUtilization gpu_utilization_;
  std::atomic<int> gpu_index_{-1};  // the GPU this rank trains on; -1 on the CPU
  GpuTimeMeter gpu_time_;
  std::atomic<uint32_t> assigned_batch_{0}, progress_batch_{0};
  training::LrScaling lr_scaling_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> finished_{false};
  // The reports on their way to the coordinator; a stop in its answer
  // ends the assignment.
  ProgressOutbox outbox_;
  std::string reason_;
  v1::WorkerProgress progress_;
  uint64_t total_steps_ = 0;
  // The servers' optimizer schedule, for reporting the rate of each step.
  float lr_base_ = 0;
  LrSchedule lr_schedule_;
  // The rank's trainer while it trains (its progressive window, read in OnStep).
  const training::Trainer* trainer_ = nullptr;
  int64_t epoch_examples_ = 0, epoch_correct_ = 0;
  double epoch_loss_ = 0;
  Clock::time_point epoch_start_, last_report_;
  struct Metrics {
    metrics::Histogram data_wait, pull, compute, push, step;
    std::atomic<double> samples{0}, loss{0}, epoch{0}, learning_rate{0};
    std::atomic<double> grad_norm{-1};  // -1 until a step computed it (clipping on)
    // Binary tasks: 0 until the progressive window holds both classes.
    std::atomic<double> progressive_auc{0}, progressive_log_loss{0};
    std::atomic<uint64_t> steps{0}, clipped_steps{0};
  } metrics_;
  // The row cache's numbers (spec.cache), summed over the assignments run.
  RowCacheStats cache_stats_;
  std::thread thread_;
};

namespace {
// Data paths resolve inside --data_dir alone unless roots are given.
WorkerDaemonOptions WithDataRoots(WorkerDaemonOptions o) {
  if (o.data_roots.empty()) o.data_roots = {o.data_dir};
  return o;
}
}  // namespace

WorkerDaemon::WorkerDaemon(WorkerDaemonOptions options)
    : options_(WithDataRoots(std::move(options))), data_(std::make_unique<DataCache>()) {
  std::string why;
  v1::NodeInfo info;
  info.set_role(v1::WORKER);
  info.set_slots(std::max<uint32_t>(1, options_.slots));
  info.set_hostname(HostName());
  info.set_pid(getpid());
  auto probe = compute::CreateBackend(options_.device, &why, 1);
  v1::DeviceInfo* d = info.add_devices();
  if (probe.ok()) {
    d->set_kind((*probe)->is_gpu() ? "cuda" : "cpu");
    d->set_name((*probe)->name());
  } else {
    d->set_kind("none");
    d->set_name(probe.status().ToString());
  }
  FLOG(INFO) << "fulcrum-worker: device " << d->name() << " (" << why << "); data dir "
             << options_.data_dir << " (data paths confined to "
             << absl::StrJoin(options_.data_roots, ", ") << "); "
             << info.slots() << " slot(s); coordinator " << options_.coordinator;
  NodeAgentOptions ao;
  ao.coordinator = options_.coordinator;
  ao.security = options_.security;
  ao.info = info;
  ao.on_update = [this](const v1::HeartbeatResponse& r) { OnUpdate(r); };
  nvml_ = metrics::Nvml::Load();
  gpu_utilization_ = options_.gpu_utilization;
  if (!gpu_utilization_ && nvml_) {
    const metrics::Nvml* nvml = nvml_.get();
    gpu_utilization_ = [nvml](int gpu) -> std::optional<double> {
      for (const metrics::Nvml::Device& d : nvml->Read()) {
        if (d.index == gpu) return d.utilization;
      }
      return std::nullopt;
    };
  }
  agent_ = std::make_unique<NodeAgent>(std::move(ao));
  coordinator_ = std::make_unique<GrpcCoordinatorClient>(agent_->stub());
}

WorkerDaemon::~WorkerDaemon() { Stop(); }

void WorkerDaemon::Stop() {
  agent_->Stop();
  std::map<Key, std::unique_ptr<Runner>> runners;
  std::vector<std::unique_ptr<Runner>> retiring;
  {
    absl::MutexLock lock(&mu_);
    stopped_ = true;
    runners.swap(runners_);
    retiring.swap(retiring_);
  }
  for (auto& [k, r] : runners) r->Stop();
  runners.clear();  // joins
  retiring.clear();
}

void WorkerDaemon::CollectMetrics(metrics::Scrape* out) const {
  absl::MutexLock lock(&mu_);
  double running = 0;
  for (const auto& [k, r] : runners_) {
    if (r->finished()) continue;
    ++running;
    r->CollectMetrics(out);
  }
  out->Gauge("fulcrum_worker_assignments", "Assignments (job ranks) this worker runs now", {}, running);
  out->Gauge("fulcrum_worker_slots", "Assignments this worker can run at once", {},
             std::max<uint32_t>(1, options_.slots));
  if (nvml_) {
    for (const metrics::Nvml::Device& d : nvml_->Read()) {
      const metrics::Labels l = {{"gpu", absl::StrCat(d.index)}, {"name", d.name}};
      out->Gauge("fulcrum_worker_gpu_utilization_ratio",
                 "GPU busy fraction over NVML's last sample period (from NVML; DCGM_FI_DEV_GPU_UTIL / 100)", l,
                 d.utilization);
      out->Gauge("fulcrum_worker_gpu_memory_used_bytes", "GPU memory in use (from NVML; DCGM_FI_DEV_FB_USED in MiB)",
                 l, d.memory_used_bytes);
      out->Gauge("fulcrum_worker_gpu_memory_total_bytes", "GPU memory in all (from NVML)", l, d.memory_total_bytes);
    }
  }
}

int WorkerDaemon::running() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& [k, r] : runners_) n += r->finished() ? 0 : 1;
  return n;
}

void WorkerDaemon::OnUpdate(const v1::HeartbeatResponse& resp) {
  std::vector<std::unique_ptr<Runner>> retired;
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    // Withdrawn runners end at their next step, or when their blocked pull
    // fails (the job's tables are dropped); join only those that ended, so
    // the heartbeat thread never waits on one.
    for (auto it = retiring_.begin(); it != retiring_.end();) {
      if ((*it)->finished()) {
        retired.push_back(std::move(*it));
        it = retiring_.erase(it);
      } else {
        ++it;
      }
    }
    std::set<Key> wanted;
    for (const v1::Assignment& a : resp.assignments()) {
      Key k{a.job_id(), a.rank(), a.incarnation()};
      wanted.insert(k);
      if (auto it = runners_.find(k); it != runners_.end()) it->second->Update(a);
      if (runners_.count(k) || done_.count(k)) continue;
      runners_.emplace(k, std::make_unique<Runner>(a, options_, agent_->node_id(), coordinator_.get(), data_.get(),
                                                   gpu_utilization_));
    }
    for (auto it = runners_.begin(); it != runners_.end();) {
      if (!wanted.count(it->first) || it->second->finished()) {
        it->second->Stop();
        if (it->second->finished()) done_.insert(it->first);
        retiring_.push_back(std::move(it->second));
        it = runners_.erase(it);
      } else {
        ++it;
      }
    }
  }
  retired.clear();  // joined outside the lock
}

}  // namespace fulcrum
