// Jobs on an in-process cluster (tests/cluster/cluster_fixture.h): training,
// the job API's answers and errors, bad data, progress reports, epochs'
// metrics and what reaches Prometheus.
#include "tests/cluster/cluster_fixture.h"

namespace fulcrum {
namespace {

TEST_CASE("an in-process cluster trains softmax regression on digits to >= 0.90 and releases the job", "[cluster]") {
  InProcessCluster cluster(2, 2);
  std::string id;
  REQUIRE(Submit(cluster.jobs(), DigitsSpec(), &id).ok());
  CHECK(id == "digits-1");
  int events = 0;
  const auto t0 = absl::Now();
  v1::Job j = WatchToEnd(cluster.jobs(), id, &events);
  INFO(j.status().message());
  REQUIRE(j.status().state() == v1::SUCCEEDED);
  WARN("digits on an in-process cluster: test accuracy " << j.status().test_accuracy() << " in "
                                                         << absl::FormatDuration(absl::Now() - t0) << ", "
                                                         << events << " watch events");
  CHECK(j.status().test_accuracy() >= 0.90);
  CHECK(j.status().epochs_size() == 10);
  CHECK(j.status().weights_fingerprint().size() == 16);
  CHECK(j.status().succeeded_workers() == 2);
  CHECK(j.status().samples_per_second() > 0);  // the last speed, kept once every rank finished
  CHECK(events >= 3);  // snapshot, running, ..., succeeded
  for (const auto& w : j.status().workers()) CHECK(w.state() == "finished");
  // What the workers read, in the job's status: digits.csv, label last.
  const v1::DataSummary& d = j.status().train_data();
  CHECK(d.features() == 64);
  CHECK(d.classes() == 10);
  CHECK(d.label_column() == 64);
  CHECK(d.label_kind() == "class");
  CHECK(d.examples() + j.status().test_data().examples() == 1797);
  CHECK(j.status().test_data().examples() > 0);
  // Both servers held a share and dropped it when the job ended.
  ExpectNoJobOnServers(cluster);
}

TEST_CASE("a job spec's learning-rate schedule and gradient clipping reach the servers' updates",
          "[cluster][lr_schedule]") {
  InProcessCluster cluster(2, 2);
  // Digits for 3 epochs: 2 workers x 45 steps of 16 per epoch, 135 steps, BSP.
  auto run = [&](const std::function<void(v1::LearningRateSchedule*)>& schedule, float clip = 0) {
    v1::JobSpec spec = DigitsSpec();
    spec.set_epochs(3);
    if (schedule) schedule(spec.mutable_optimizer()->mutable_schedule());
    spec.mutable_optimizer()->set_clip_global_norm(clip);
    std::string id;
    REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
    int events = 0;
    v1::Job j = WatchToEnd(cluster.jobs(), id, &events);
    INFO(j.status().message());
    REQUIRE(j.status().state() == v1::SUCCEEDED);
    REQUIRE(j.status().weights_fingerprint().size() == 16);
    return j;
  };
  const v1::Job flat = run(nullptr);
  // A schedule that does not decay within the run changes nothing, bit for bit.
  const v1::Job inert = run([](v1::LearningRateSchedule* s) {
    s->set_kind(v1::LearningRateSchedule::STEP);
    s->set_decay_steps(1000000);
    s->set_gamma(0.5f);
  });
  // 10 steps of warm-up, then down to a tenth of 0.1 over 120 steps.
  const v1::Job decayed = run([](v1::LearningRateSchedule* s) {
    s->set_kind(v1::LearningRateSchedule::LINEAR);
    s->set_warmup_steps(10);
    s->set_decay_steps(120);
    s->set_min_learning_rate(0.01f);
  });
  WARN("digits, 3 epochs: test accuracy " << flat.status().test_accuracy() << " at a constant rate, "
                                          << decayed.status().test_accuracy() << " with warm-up and linear decay");
  // Each worker clips its gradient to a tiny norm before pushing: other weights.
  const v1::Job clipped = run(nullptr, 1e-3f);
  CHECK(inert.status().weights_fingerprint() == flat.status().weights_fingerprint());
  CHECK(clipped.status().weights_fingerprint() != flat.status().weights_fingerprint());
  CHECK(decayed.status().weights_fingerprint() != flat.status().weights_fingerprint());
  // Lowering the rate of this short run trains it less far (0.85 against
  // 0.89 when written), but it still learns: 10 classes, chance is 0.1.
  CHECK(decayed.status().test_accuracy() >= 0.75);
  // Each worker reports the rate of its last step: past the decay, the floor.
  REQUIRE(decayed.status().workers_size() == 2);
  for (const auto& w : decayed.status().workers()) CHECK(w.learning_rate() == Approx(0.01));
  for (const auto& w : flat.status().workers()) CHECK(w.learning_rate() == Approx(0.1));
}

TEST_CASE("the job API answers bad specs, unknown jobs and late cancels with clear errors", "[cluster]") {
  InProcessCluster cluster(1, 1);
  v1::JobSpec bad = DigitsSpec();
  bad.set_num_workers(0);
  bad.mutable_optimizer()->set_learning_rate(-1);
  std::string id;
  grpc::Status s = Submit(cluster.jobs(), bad, &id);
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(s.error_message().find("2 problems") != std::string::npos);
  CHECK(s.error_message().find("num_workers: 0 must be 1 to 1024") != std::string::npos);
  CHECK(s.error_message().find("optimizer.learning_rate: -1 must be > 0") != std::string::npos);

  v1::JobRef ref;
  ref.set_job_id("no-such-job-7");
  v1::Job j;
  s = cluster.jobs()->GetJob(Ctx().get(), ref, &j);
  CHECK(s.error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK(s.error_message() == "no job 'no-such-job-7'");
  s = cluster.jobs()->CancelJob(Ctx().get(), ref, &j);
  CHECK(s.error_code() == grpc::StatusCode::NOT_FOUND);

  // A job needing more workers than exist waits and says why; cancelling it works once.
  v1::JobSpec big = DigitsSpec();
  big.set_num_workers(3);
  REQUIRE(Submit(cluster.jobs(), big, &id).ok());
  // Until the servers have the shard map it waits for that (ShardMapNotReady);
  // then for workers.
  for (int tries = 0; tries < 50 && Get(cluster.jobs(), id).status().reason() != "WorkersNotReady"; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  j = Get(cluster.jobs(), id);
  CHECK(j.status().state() == v1::PENDING);
  CHECK(j.status().reason() == "WorkersNotReady");
  CHECK(j.status().message() == "needs 3 workers with a free slot; 1 free of 1 live");
  ref.set_job_id(id);
  REQUIRE(cluster.jobs()->CancelJob(Ctx().get(), ref, &j).ok());
  CHECK(j.status().state() == v1::CANCELLED);
  s = cluster.jobs()->CancelJob(Ctx().get(), ref, &j);
  CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(s.error_message().find("already ended: CANCELLED") != std::string::npos);
}

TEST_CASE("ListJobs pages through the registry oldest first and refuses bad page sizes and tokens", "[cluster]") {
  InProcessCluster cluster(1, 0);  // no workers: every job waits
  v1::JobSpec spec = DigitsSpec();
  spec.mutable_run_policy()->set_ttl_seconds_after_finished(1);
  std::vector<std::string> ids(5);
  for (std::string& id : ids) REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  auto list = [&](int page_size, const std::string& token, v1::ListJobsResponse* resp) {
    v1::ListJobsRequest req;
    req.set_page_size(page_size);
    req.set_page_token(token);
    *resp = v1::ListJobsResponse();
    return cluster.jobs()->ListJobs(Ctx().get(), req, resp);
  };
  auto ids_of = [](const v1::ListJobsResponse& r) {
    std::vector<std::string> out;
    for (const auto& j : r.jobs()) out.push_back(j.id());
    return out;
  };
  v1::ListJobsResponse r;
  REQUIRE(list(0, "", &r).ok());  // 0: the default page (100) holds them all
  CHECK(ids_of(r) == ids);
  CHECK(r.next_page_token().empty());

  // Pages of 2: [0 1] [2 3] [4], and no empty page after the last.
  REQUIRE(list(2, "", &r).ok());
  CHECK(ids_of(r) == std::vector<std::string>{ids[0], ids[1]});
  REQUIRE(!r.next_page_token().empty());
  const std::string second = r.next_page_token();
  REQUIRE(list(2, second, &r).ok());
  CHECK(ids_of(r) == std::vector<std::string>{ids[2], ids[3]});
  // The job the token follows is forgotten meanwhile (cancelled, past its
  // TTL): the next page is the same.
  Cancel(cluster.jobs(), ids[3]);
  v1::JobRef gone;
  gone.set_job_id(ids[3]);
  v1::Job j;
  for (int tries = 0; tries < 100 && cluster.jobs()->GetJob(Ctx().get(), gone, &j).ok(); ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  REQUIRE(cluster.jobs()->GetJob(Ctx().get(), gone, &j).error_code() == grpc::StatusCode::NOT_FOUND);
  REQUIRE(list(2, r.next_page_token(), &r).ok());
  CHECK(ids_of(r) == std::vector<std::string>{ids[4]});
  CHECK(r.next_page_token().empty());
  // A token can be used again (a retried call): the same page, less the
  // forgotten job.
  REQUIRE(list(2, second, &r).ok());
  CHECK(ids_of(r) == std::vector<std::string>{ids[2], ids[4]});

  grpc::Status s = list(1001, "", &r);
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(s.error_message() == "page_size: 1001 must be 0 to 1000 (0 means 100)");
  s = list(-1, "", &r);
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  for (const std::string bad : {"7", "after-", "after-x", "after-99999999999999999999999"}) {
    s = list(2, bad, &r);
    INFO(bad);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(s.error_message() == "page_token: '" + bad + "' is not a next_page_token this coordinator gave");
  }
}

TEST_CASE("a server that hangs on a job's release holds up neither the scheduler nor the next job", "[cluster]") {
  InProcessCluster cluster(2, 1);
  v1::JobSpec spec = DigitsSpec();
  spec.set_num_workers(1);
  spec.set_epochs(2);
  cluster.faults().hold_deletes = true;
  std::string first;
  REQUIRE(Submit(cluster.jobs(), spec, &first).ok());
  int events = 0;
  REQUIRE(WatchToEnd(cluster.jobs(), first, &events).status().state() == v1::SUCCEEDED);
  // Its release is sent to both servers at once, and both hang.
  for (int tries = 0; tries < 500 && cluster.faults().deletes_held.load() < 2; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(cluster.faults().deletes_held.load() == 2);
  // The scheduler goes on: the next job starts and finishes meanwhile.
  std::string second;
  REQUIRE(Submit(cluster.jobs(), spec, &second).ok());
  const v1::Job done = WatchToEnd(cluster.jobs(), second, &events);
  CHECK(done.status().state() == v1::SUCCEEDED);
  CHECK(done.status().test_accuracy() >= 0.85);
  // The first job's release was not sent again while it hung; the second's
  // hangs too. Once the servers answer, both jobs' tables go.
  for (int tries = 0; tries < 500 && cluster.faults().deletes_held.load() < 4; ++tries) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  CHECK(cluster.faults().deletes_held.load() == 4);
  cluster.faults().hold_deletes = false;
  ExpectNoJobOnServers(cluster);
}

TEST_CASE("a job past ttl_seconds_after_finished is forgotten, with its checkpoints on every server",
          "[cluster][checkpoint]") {
  InProcessCluster cluster(2, 1);
  v1::JobSpec spec = DigitsSpec();
  spec.set_num_workers(1);
  spec.set_epochs(2);
  spec.mutable_checkpoint()->set_every_steps(30);
  spec.mutable_run_policy()->set_ttl_seconds_after_finished(2);
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  int events = 0;
  const v1::Job done = WatchToEnd(cluster.jobs(), id, &events);
  REQUIRE(done.status().state() == v1::SUCCEEDED);
  REQUIRE(done.status().checkpoints_size() > 0);
  auto cuts_on = [&](Server& s) {
    auto cuts = s.ps->ListCuts(id);
    return cuts.ok() ? cuts->size() : size_t{0};
  };
  for (auto& s : cluster.servers()) CHECK(cuts_on(s) > 0);
  const absl::Time ended = absl::FromUnixMillis(done.status().end_time_unix_ms());
  // Kept for its TTL, then gone from the job API and from the servers' disks.
  v1::JobRef ref;
  ref.set_job_id(id);
  grpc::Status got;
  for (int tries = 0; tries < 200; ++tries) {
    v1::Job j;
    got = cluster.jobs()->GetJob(Ctx().get(), ref, &j);
    if (!got.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  CHECK(got.error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK(absl::Now() - ended >= absl::Seconds(2));
  for (int tries = 0; tries < 100; ++tries) {
    size_t left = 0;
    for (auto& s : cluster.servers()) left += cuts_on(s);
    if (left == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  for (auto& s : cluster.servers()) CHECK(cuts_on(s) == 0);
}

TEST_CASE("a job whose data is missing fails with the reason and the file", "[cluster]") {
  InProcessCluster cluster(1, 1);
  v1::JobSpec spec = DigitsSpec();
  spec.set_num_workers(1);
  spec.mutable_data()->mutable_train()->set_path("digits/nope.csv");
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  int events = 0;
  v1::Job j = WatchToEnd(cluster.jobs(), id, &events);
  CHECK(j.status().state() == v1::FAILED);
  CHECK(j.status().reason() == "BadData");
  CHECK(j.status().message().find("digits/nope.csv") != std::string::npos);
}

TEST_CASE("a model whose classes disagree with the data's fails as BadData, naming the label column",
          "[cluster]") {
  InProcessCluster cluster(1, 1);
  v1::JobSpec spec = DigitsSpec();
  spec.set_num_workers(1);
  spec.mutable_model()->set_num_classes(26);  // digits have 10
  std::string id;
  REQUIRE(Submit(cluster.jobs(), spec, &id).ok());
  int events = 0;
  v1::Job j = WatchToEnd(cluster.jobs(), id, &events);
  INFO(j.status().message());
  CHECK(j.status().state() == v1::FAILED);
  CHECK(j.status().reason() == "BadData");
  CHECK(j.status().message().find("labels in column 64 counted from 0) has labels 0 to 9 (10 classes), but "
                                  "model.num_classes is 26") != std::string::npos);
  CHECK(j.status().restarts() == 0);  // bad data fails the same way every time: no rollback
  CHECK(j.status().train_data().classes() == 10);
}

TEST_CASE("an evaluation-only report fills in test figures an epoch lacks and changes nothing else", "[cluster]") {
  InProcessCluster cluster(1, 0);
  FakeNodes fakes(cluster.address(), 2);
  v1::JobSpec spec = DigitsSpec();
  spec.set_epochs(3);
  std::string id;
  const v1::Job running = SubmitRunning(cluster.jobs(), spec, &id);
  // Epoch 0 was reported with its test figures: an evaluation does not replace them.
  REQUIRE(ReportEpoch(cluster.address(), running, 0, 0, 1.0, 100).ok());
  REQUIRE(ReportEvaluation(cluster.address(), running, 0, 0.5).ok());
  v1::Job j = Get(cluster.jobs(), id);
  CHECK(j.status().epochs(0).test_accuracy() == 0.75);
  CHECK(j.status().test_accuracy() == 0.75);
  // The last epoch was trained by an incarnation whose reports were never
  // taken (only rank 1's came): the evaluation supplies its test figures and
  // does not count as rank 0's training.
  REQUIRE(ReportEpoch(cluster.address(), running, 1, 2, 3.0, 50).ok());
  REQUIRE(ReportEvaluation(cluster.address(), running, 2, 0.9).ok());
  j = Get(cluster.jobs(), id);
  REQUIRE(j.status().epochs_size() == 2);
  const v1::EpochSummary& last = j.status().epochs(1);
  CHECK(last.epoch() == 2);
  CHECK(last.tested());
  CHECK(last.test_accuracy() == 0.9);
  CHECK(last.train_loss() == 3.0);
  CHECK(last.samples_per_second() == 50);
  CHECK(std::vector<uint32_t>(last.reported_ranks().begin(), last.reported_ranks().end()) == std::vector<uint32_t>{1});
  CHECK(j.status().test_accuracy() == 0.9);
  // Only once: a second evaluation of the same epoch changes nothing.
  REQUIRE(ReportEvaluation(cluster.address(), running, 2, 0.1).ok());
  CHECK(Get(cluster.jobs(), id).status().test_accuracy() == 0.9);
  Cancel(cluster.jobs(), id);
}

TEST_CASE("GPU time adds up over a job's reports, and batch_size auto's choice reaches every rank's assignment",
          "[cluster]") {
  InProcessCluster cluster(1, 0);
  FakeNodes fakes(cluster.address(), 2);
  v1::JobSpec spec = DigitsSpec();
  spec.set_batch_size(0);
  spec.mutable_batch_size_auto()->set_enabled(true);
  std::string id;
  const v1::Job running = SubmitRunning(cluster.jobs(), spec, &id);
  auto report = [&](uint32_t rank, double busy, double idle, uint32_t batch) {
    v1::ReportProgressResponse resp;
    grpc::Status s = ReportAsRank(
        cluster.address(), running, rank,
        [&](v1::ReportProgressRequest& req) {
          req.mutable_progress()->set_state("training");
          req.mutable_progress()->set_gpu_busy_seconds(busy);
          req.mutable_progress()->set_gpu_idle_seconds(idle);
          req.mutable_progress()->set_batch_size(batch);
          if (batch > 0) req.mutable_progress()->set_batch_size_choice("batch 128, lr x4 (tried ...)");
        },
        &resp);
    INFO(s.error_message());
    REQUIRE(s.ok());
  };
  // A rank's figures are totals for its incarnation: the job adds the growth.
  report(0, 10, 5, 0);
  report(0, 12, 6, 0);
  report(1, 3, 1, 0);
  v1::Job j = Get(cluster.jobs(), id);
  CHECK(j.status().gpu_busy_seconds() == 15);
  CHECK(j.status().gpu_idle_seconds() == 7);
  // Before rank 0 chose, assignments carry no batch; rank 1 cannot choose.
  report(1, 3, 1, 64);
  CHECK(Get(cluster.jobs(), id).status().batch_size() == 0);
  for (const v1::Assignment& a : fakes.Assignments()) CHECK(a.spec().batch_size() == 0);
  report(0, 12, 6, 128);
  j = Get(cluster.jobs(), id);
  CHECK(j.status().batch_size() == 128);
  CHECK(j.status().batch_size_choice() == "batch 128, lr x4 (tried ...)");
  CHECK(j.status().gpu_busy_seconds() == 15);
  // Every rank's next assignment carries the choice.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  bool all = false;
  while (!all && absl::Now() < deadline) {
    const std::vector<v1::Assignment> as = fakes.Assignments();
    all = as.size() == 2;
    for (const v1::Assignment& a : as) all = all && a.spec().batch_size() == 128 && a.spec().batch_size_auto().enabled();
    if (!all) absl::SleepFor(absl::Milliseconds(50));
  }
  CHECK(all);
  // A worker's impossible figures are refused by field.
  v1::ReportProgressResponse resp;
  const grpc::Status bad = ReportAsRank(
      cluster.address(), running, 0, [](v1::ReportProgressRequest& req) { req.mutable_progress()->set_gpu_idle_seconds(-1); },
      &resp);
  CHECK(bad.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(absl::StrContains(bad.error_message(), "progress.gpu_idle_seconds"));
  Cancel(cluster.jobs(), id);
}

TEST_CASE("a rank that finished stays finished when older progress arrives after its end", "[cluster]") {
  InProcessCluster cluster(1, 0);
  FakeNodes fakes(cluster.address(), 2);
  std::string id;
  const v1::Job running = SubmitRunning(cluster.jobs(), DigitsSpec(), &id);
  auto progress = [&](const std::string& state, uint64_t step, bool finished) {
    v1::ReportProgressResponse resp;
    const grpc::Status s = ReportAsRank(
        cluster.address(), running, 1,
        [&](v1::ReportProgressRequest& req) {
          req.mutable_progress()->set_state(state);
          req.mutable_progress()->set_step(step);
          req.set_finished(finished);
        },
        &resp);
    INFO(s.error_message());
    REQUIRE(s.ok());
  };
  progress("finished", 450, true);
  // Periodic progress from before the end, delivered after it (as when the
  // worker sent its result first), then the end sent again.
  progress("training", 440, false);
  v1::Job j = Get(cluster.jobs(), id);
  CHECK(j.status().workers(1).state() == "finished");
  CHECK(j.status().workers(1).step() == 450);
  CHECK(j.status().succeeded_workers() == 1);
  progress("finished", 450, true);
  j = Get(cluster.jobs(), id);
  CHECK(j.status().workers(1).state() == "finished");
  CHECK(j.status().succeeded_workers() == 1);
  // Rank 0 has not finished: its periodic progress is still taken.
  v1::ReportProgressResponse resp;
  REQUIRE(ReportAsRank(
              cluster.address(), running, 0,
              [](v1::ReportProgressRequest& req) {
                req.mutable_progress()->set_state("training");
                req.mutable_progress()->set_step(300);
              },
              &resp)
              .ok());
  j = Get(cluster.jobs(), id);
  CHECK(j.status().workers(0).state() == "training");
  CHECK(j.status().workers(0).step() == 300);
  Cancel(cluster.jobs(), id);
  // Cancelling does not undo the finished rank either.
  j = Get(cluster.jobs(), id);
  CHECK(j.status().workers(1).state() == "finished");
  CHECK(j.status().workers(0).state() == "cancelled");
}

TEST_CASE("an epoch's metrics count each rank once, across a resent report and a coordinator restart",
          "[cluster]") {
  InProcessCluster cluster(1, 0);
  FakeNodes fakes(cluster.address(), 2);
  std::string id;
  const v1::Job running = SubmitRunning(cluster.jobs(), DigitsSpec(), &id);

  // Rank 0's report, sent twice as a worker does when the answer is lost.
  REQUIRE(ReportEpoch(cluster.address(), running, 0, 0, 1.0, 100).ok());
  REQUIRE(ReportEpoch(cluster.address(), running, 0, 0, 1.0, 100).ok());
  v1::Job j = Get(cluster.jobs(), id);
  REQUIRE(j.status().epochs_size() == 1);
  CHECK(j.status().epochs(0).train_loss() == 1.0);
  CHECK(j.status().epochs(0).samples_per_second() == 100);
  CHECK(j.status().epochs(0).reported_ranks_size() == 1);

  // Rank 1 reports after a coordinator restart: the mean still has rank 0.
  cluster.RestartCoordinator();
  REQUIRE(ReportEpoch(cluster.address(), running, 1, 0, 3.0, 50).ok());
  j = Get(cluster.jobs(), id);
  REQUIRE(j.status().epochs_size() == 1);
  const v1::EpochSummary& e = j.status().epochs(0);
  CHECK(e.train_loss() == 2.0);
  CHECK(e.samples_per_second() == 150);
  CHECK(std::vector<uint32_t>(e.reported_ranks().begin(), e.reported_ranks().end()) == std::vector<uint32_t>{0, 1});
  CHECK(e.tested());
  CHECK(e.test_accuracy() == 0.75);

  // An epoch the job does not have is refused by name, and nothing is added.
  const grpc::Status bad = ReportEpoch(cluster.address(), running, 1, 10, 3.0, 50);
  CHECK(bad.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK_THAT(bad.error_message(), Catch::Contains("epoch_done.epoch 10 is out of range") &&
                                      Catch::Contains("has 10 epochs (0 to 9)"));
  CHECK(Get(cluster.jobs(), id).status().epochs_size() == 1);
  Cancel(cluster.jobs(), id);
}

// The coordinator exports the test figures its ranks report: AUC and log
// loss when rank 0 evaluated a binary task, RMSE for a regression, neither
// for a job that reported none.
TEST_CASE("a job's test AUC and log loss or RMSE reach Prometheus as its rank 0 reports them", "[cluster]") {
  InProcessCluster cluster(1, 0);
  FakeNodes fakes(cluster.address(), 4);
  std::string binary_id, regression_id;
  const v1::Job binary = SubmitRunning(cluster.jobs(), DigitsSpec(), &binary_id);
  const v1::Job regression = SubmitRunning(cluster.jobs(), DigitsSpec(), &regression_id);
  auto series = [](const std::string& name, const std::string& id) { return name + "{job=\"" + id + "\"}"; };
  CHECK(MetricOf(cluster.coordinator(), series("fulcrum_coordinator_job_test_auc", binary_id)) == -1);
  auto report = [&](const v1::Job& j, const std::function<void(v1::EpochSummary*)>& figures) {
    v1::ReportProgressResponse resp;
    const grpc::Status s = ReportAsRank(
        cluster.address(), j, 0,
        [&](v1::ReportProgressRequest& req) {
          req.mutable_progress()->set_state("running");
          v1::EpochSummary* e = req.mutable_epoch_done();
          e->set_epoch(0);
          e->set_train_loss(0.5);
          e->set_seconds(1.0);
          e->set_tested(true);
          figures(e);
        },
        &resp);
    INFO(s.error_message());
    REQUIRE(s.ok());
  };
  report(binary, [](v1::EpochSummary* e) {
    e->set_test_accuracy(0.875);
    e->set_test_auc(0.9375);
    e->set_test_loss(0.3125);
  });
  report(regression, [](v1::EpochSummary* e) {
    e->set_test_rmse(0.8125);
    e->set_test_loss(0.33);
  });
  const Coordinator& c = cluster.coordinator();
  CHECK(MetricOf(c, series("fulcrum_coordinator_job_test_accuracy", binary_id)) == 0.875);
  CHECK(MetricOf(c, series("fulcrum_coordinator_job_test_auc", binary_id)) == 0.9375);
  CHECK(MetricOf(c, series("fulcrum_coordinator_job_test_log_loss", binary_id)) == 0.3125);
  CHECK(MetricOf(c, series("fulcrum_coordinator_job_test_rmse", binary_id)) == -1);
  CHECK(MetricOf(c, series("fulcrum_coordinator_job_test_rmse", regression_id)) == 0.8125);
  CHECK(MetricOf(c, series("fulcrum_coordinator_job_test_auc", regression_id)) == -1);
  CHECK(MetricOf(c, series("fulcrum_coordinator_job_test_log_loss", regression_id)) == -1);
  Cancel(cluster.jobs(), binary_id);
  Cancel(cluster.jobs(), regression_id);
}

TEST_CASE("the ranks' progressive validation windows are weighted by their examples into the job's status and "
          "metrics",
          "[cluster]") {
  InProcessCluster cluster(1, 0);
  FakeNodes fakes(cluster.address(), 2);
  std::string id;
  const v1::Job j = SubmitRunning(cluster.jobs(), DigitsSpec(), &id);
  REQUIRE(j.spec().num_workers() == 2);
  const std::string series = "fulcrum_coordinator_job_progressive_auc{job=\"" + id + "\"}";
  CHECK(MetricOf(cluster.coordinator(), series) == -1);  // nothing reported yet
  auto report = [&](uint32_t rank, double auc, double log_loss, uint64_t examples) {
    v1::ReportProgressResponse resp;
    const grpc::Status s = ReportAsRank(
        cluster.address(), j, rank,
        [&](v1::ReportProgressRequest& req) {
          req.mutable_progress()->set_state("training");
          req.mutable_progress()->set_progressive_auc(auc);
          req.mutable_progress()->set_progressive_log_loss(log_loss);
          req.mutable_progress()->set_progressive_examples(examples);
        },
        &resp);
    INFO(s.error_message());
    REQUIRE(s.ok());
  };
  report(0, 0.8, 0.40, 1000);
  report(1, 0.7, 0.50, 3000);
  const v1::Job after = Get(cluster.jobs(), id);
  CHECK(after.status().progressive_examples() == 4000);
  CHECK(after.status().progressive_auc() == Approx(0.725));
  CHECK(after.status().progressive_log_loss() == Approx(0.475));
  CHECK(MetricOf(cluster.coordinator(), series) == Approx(0.725));
  CHECK(MetricOf(cluster.coordinator(), "fulcrum_coordinator_job_progressive_log_loss{job=\"" + id + "\"}") ==
        Approx(0.475));
  Cancel(cluster.jobs(), id);
}

TEST_CASE("progress reports with oversized strings or impossible speeds are refused by field and change nothing",
          "[cluster]") {
  InProcessCluster cluster(1, 0);
  FakeNodes fakes(cluster.address(), 1);
  v1::JobSpec spec = DigitsSpec();
  spec.set_num_workers(1);
  std::string id;
  const v1::Job running = SubmitRunning(cluster.jobs(), spec, &id);
  const v1::Job before = Get(cluster.jobs(), id);

  using Fill = std::function<void(v1::ReportProgressRequest&)>;
  const std::pair<Fill, std::string> bad[] = {
      {[](auto& r) { r.mutable_progress()->set_state(std::string(33, 's')); },
       "progress.state is 33 bytes; at most 32 allowed"},
      {[](auto& r) { r.mutable_progress()->set_device(std::string(1 << 20, 'd')); },
       "progress.device is 1048576 bytes; at most 256 allowed"},
      {[](auto& r) { r.set_error_reason(std::string(65, 'R')); }, "error_reason is 65 bytes; at most 64 allowed"},
      {[](auto& r) { r.set_weights_fingerprint(std::string(129, 'f')); },
       "weights_fingerprint is 129 bytes; at most 128 allowed"},
      {[](auto& r) { r.mutable_progress()->set_samples_per_second(std::nan("")); },
       "progress.samples_per_second is nan; must be a finite number >= 0"},
      {[](auto& r) { r.mutable_progress()->set_data_wait_seconds(-1); },
       "progress.data_wait_seconds is -1; must be a finite number >= 0"},
      {[](auto& r) { r.mutable_progress()->set_learning_rate(HUGE_VAL); },
       "progress.learning_rate is inf; must be a finite number >= 0"},
      {[](auto& r) {
         r.mutable_epoch_done()->set_samples_per_second(-HUGE_VAL);
       },
       "epoch_done.samples_per_second is -inf; must be a finite number >= 0"},
      {[](auto& r) { r.mutable_epoch_done()->set_seconds(-0.5); },
       "epoch_done.seconds is -0.5; must be a finite number >= 0"},
      {[](auto& r) { r.mutable_progress()->set_progressive_auc(1.5); },
       "progress.progressive_auc is 1.5; must be in [0, 1]"},
      {[](auto& r) { r.mutable_progress()->set_progressive_auc(std::nan("")); },
       "progress.progressive_auc is nan; must be in [0, 1]"},
      {[](auto& r) { r.mutable_progress()->set_progressive_log_loss(-1); },
       "progress.progressive_log_loss is -1; must be a finite number >= 0"},
      {[](auto& r) { r.mutable_progress()->set_progressive_examples(uint64_t{1} << 62); },
       "progress.progressive_examples is 4611686018427387904; at most 1099511627776 allowed"},
  };
  for (const auto& [fill, want] : bad) {
    v1::ReportProgressResponse resp;
    const grpc::Status s = ReportAsRank(cluster.address(), running, 0, fill, &resp);
    INFO(want);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(s.error_message() == "progress report: " + want);
  }
  // Nothing of them reached the job.
  const v1::Job after = Get(cluster.jobs(), id);
  CHECK(after.status().state() == v1::RUNNING);
  CHECK(after.status().workers(0).SerializeAsString() == before.status().workers(0).SerializeAsString());
  CHECK(after.status().epochs_size() == 0);
  CHECK(after.status().weights_fingerprint().empty());

  // A worker's error is not refused for its length (the rank did fail), but
  // kept to its first 4 KiB, cut between characters: the job record stays
  // valid UTF-8 and loads after a restart.
  std::string error(4095, 'e');
  error += "\xc3\xa9 and 10 KiB more: " + std::string(10240, 'x');  // 'é' straddles the 4096th byte
  FailRank0(cluster.address(), running, "BadData", error);
  cluster.RestartCoordinator();
  const v1::Job failed = Get(cluster.jobs(), id);
  CHECK(failed.status().state() == v1::FAILED);
  CHECK(failed.status().reason() == "BadData");
  const std::string& message = failed.status().message();
  CHECK(message.size() < 4200);
  CHECK(absl::StartsWith(message, "rank 0 on " + running.status().workers(0).worker_id() + ": eee"));
  CHECK(absl::EndsWith(message, std::string(100, 'e') + " ... (" + std::to_string(error.size() - 4095) +
                                    " more bytes)"));
}

}  // namespace
}  // namespace fulcrum
