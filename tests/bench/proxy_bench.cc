// fulcrum-proxy-bench: what a GPU worker's utilisation would be, measured
// without a GPU. The step's compute is replaced by a fixed time (the
// H100's measured torch step: 1.1 ms for 784-1024-1024-10 at batch 512,
// 1.9 ms for 784-4096-4096-10 at batch 2048 in bf16), during which the
// worker's thread sleeps as it would while a GPU computes; everything
// else is real: the model's tables, the trainer, the pipeline, gRPC over
// 127.0.0.1 (streams and shared memory, as fulcrum-worker uses them) to
// parameter servers in this process. For per-step BSP, SSP(1) and local
// steps with H = 1, 4, 16, 64 it prints the step time, the exposed
// communication (step time minus compute) and the GPU-utilisation proxy
// (compute / step time), with the exposed time split into waiting for
// batches, pulls, pushes and the rest. Device-side copies and updates at
// local rounds' ends (the anchor, the pseudo-gradient, the merge) count as
// compute, as the inner optimizer's update does: a GPU does them in
// microseconds, the CPU backend in milliseconds; their time is printed.
//
//   fulcrum-proxy-bench [--quick] [--servers=N] [--steps=N] [--only=TEXT]
//   (--only: the rows whose model or sync contains TEXT)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/shard_map.h"
#include "server/parameter_server.h"
#include "server/rpc/ps_service.h"
#include "worker/compute/backend.h"
#include "worker/data/dataset.h"
#include "worker/models/model.h"
#include "worker/rpc/grpc_ps_client.h"
#include "worker/training/trainer.h"

namespace fulcrum {
namespace {

// An MLP's tables whose step takes a fixed time: forward a third of it,
// then backward, each layer's gradients reported final as its share of the
// backward time passes (as a GPU's backward would let the trainer push
// them). Gradients are small constants, so the servers' updates are real.
class FixedTimeMlp final : public models::Model {
 public:
  FixedTimeMlp(const std::vector<int>& dims, absl::Duration step, compute::Backend* be)
      : Model(Config(dims), be), step_(step) {
    for (size_t l = 0; l + 1 < dims.size(); ++l) {
      AddDense(absl::StrCat("dense", l, ".weight"), {dims[l], dims[l + 1]}, Zeros());
      AddDense(absl::StrCat("dense", l, ".bias"), {dims[l + 1]}, Zeros());
    }
  }
  models::Task task() const override { return models::Task::kClassification; }

  absl::StatusOr<models::Metrics> Run(const data::Batch& batch, bool train) override {
    // The trainer rotates a few gradient buffers: fill each once.
    for (models::Table& t : tables_) {
      if (!filled_.insert(t.grad.data()).second) continue;
      float* g = t.grad.as<float>();
      for (size_t i = 0; i < t.elements; ++i) g[i] = 1e-6f;
    }
    absl::SleepFor(step_ / 3);
    if (train) {
      const absl::Duration per_layer = (step_ - step_ / 3) / static_cast<int64_t>(tables_.size() / 2);
      for (size_t l = tables_.size() / 2; l-- > 0;) {
        absl::SleepFor(per_layer);
        if (absl::Status s = GradientReady(2 * l + 1); !s.ok()) return s;
        if (absl::Status s = GradientReady(2 * l); !s.ok()) return s;
      }
    }
    models::Metrics m;
    m.examples = batch.size;
    return m;
  }

 private:
  static models::ModelConfig Config(const std::vector<int>& dims) {
    models::ModelConfig c;
    c.type = "mlp";
    c.num_features = dims.front();
    c.num_classes = dims.back();
    c.hidden.assign(dims.begin() + 1, dims.end() - 1);
    return c;
  }
  static v1::InitializerSpec Zeros() {
    v1::InitializerSpec i;
    i.set_kind(v1::InitializerSpec::ZEROS);
    return i;
  }
  absl::Status PrepareKeys(const data::Batch&) override { return absl::OkStatus(); }

  const absl::Duration step_;
  std::set<void*> filled_;
};

struct Servers {
  std::vector<std::shared_ptr<ParameterServer>> ps;
  std::vector<std::unique_ptr<PsGrpcServer>> grpc;
  v1::ShardMap map;
};

std::unique_ptr<Servers> StartServers(int n) {
  auto s = std::make_unique<Servers>();
  std::vector<std::string> addresses;
  for (int i = 0; i < n; ++i) {
    ParameterServerOptions o;
    o.server_index = i;
    s->ps.push_back(*ParameterServer::Create(o));
    s->grpc.push_back(*PsGrpcServer::Start(s->ps.back().get(), "127.0.0.1:0"));
    addresses.push_back(s->grpc.back()->address());
  }
  s->map = ShardMap::RoundRobin(1, 256, addresses)->ToProto();
  for (auto& p : s->ps) (void)p->SetShardMap(s->map);
  return s;
}

struct Mode {
  std::string name;
  v1::ConsistencySpec consistency;
  int sync_every = 0;
  bool overlap = false;
};

struct Result {
  double step_ms = 0, exposed_ms = 0, proxy = 0;
  // Of the exposed time, per step: waiting for the next batch, for pulls
  // (a round's start), for pushes (a round's end); the rest is the
  // trainer's own work between steps.
  double data_ms = 0, pull_ms = 0, push_ms = 0, other_ms = 0;
  // Device-side copies and updates at rounds' ends (in the pull and push
  // waits on the CPU backend), counted as compute, per step.
  double device_ms = 0;
  std::string error;
};

Result RunMode(const std::vector<int>& dims, int batch, absl::Duration compute, const Mode& mode, int servers,
               int steps, int job) {
  Result r;
  auto cluster = StartServers(servers);
  GrpcPsClientOptions po;
  po.shard_map = cluster->map;
  po.worker_id = "proxy";
  po.transport = GrpcPsClientOptions::Transport::kStream;  // as fulcrum-worker
  po.shared_memory = true;
  po.channels_per_server = 2;
  po.pull_wait_timeout = absl::Seconds(2);
  auto client = GrpcPsClient::Create(po);
  if (!client.ok()) {
    r.error = std::string(client.status().message());
    return r;
  }
  auto be = compute::NewCpuBackend(1);
  FixedTimeMlp model(dims, compute, be.get());
  const std::string id = absl::StrCat("proxy-", job);
  v1::OptimizerSpec opt;
  opt.set_kind(v1::OptimizerSpec::SGD);
  opt.set_learning_rate(0.01f);
  if (absl::Status s = (*client)->CreateJob(training::JobSpecFor(model, id, opt, mode.consistency, 1)); !s.ok()) {
    r.error = std::string(s.message());
    return r;
  }
  // Bytes as MNIST's pixels, decoded into batches by the pipeline: one
  // dataset of `steps` batches, two warm-up epochs over it, then one timed
  // epoch (an epoch ends a local round, so the timed rounds are whole).
  auto make = [&](size_t batches) {
    const size_t rows = static_cast<size_t>(batch) * batches;
    std::vector<uint8_t> pixels(rows * dims.front());
    for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = static_cast<uint8_t>(i * 131);
    std::vector<float> labels(rows);
    for (size_t i = 0; i < rows; ++i) labels[i] = static_cast<float>(i % dims.back());
    return data::BytesInMemory(pixels, labels, dims.front(), 1.0f / 255, dims.back(), "proxy");
  };
  auto data = make(static_cast<size_t>(steps));
  training::TrainerOptions o;
  o.job_id = id;
  o.batch_size = batch;
  o.prefetch_parameters = mode.sync_every == 0;
  o.sync_every = mode.sync_every;
  o.overlap_rounds = mode.overlap;
  // Batches decoded on the host by one thread while the step "computes",
  // as a GPU worker's pipeline does (keeping the dataset on the device
  // would put its one-time upload inside the timed epoch).
  o.decode_threads = 1;
  o.device_data = data::DeviceDataMode::kOff;
  training::Trainer trainer(&model, client->get(), o);
  // Warm-up: allocations, connections, and first touches, which cost
  // this VM about 4 ms per MB in page faults and make a dataset's first
  // epoch read its rows several times slower than later ones (a one-time
  // cost a long run never sees again). Two epochs, so every buffer a round
  // rotates through (pulled weights, anchors, pushed pseudo-gradients) has
  // been written: an epoch's first round starts from a pull into a buffer
  // the previous epoch's handed to the model.
  for (int epoch = 0; epoch < 2; ++epoch) {
    if (auto e = trainer.TrainEpoch(*data, epoch); !e.ok()) {
      r.error = std::string(e.status().message());
      return r;
    }
  }
  // Exposed time: all of a step but its compute phase. The compute phase is
  // the fixed time plus, under local steps, the inner optimizer's update,
  // which a GPU does in microseconds and this CPU in milliseconds at these
  // sizes: it counts as compute, so the step is the fixed time plus what
  // is exposed.
  auto e = trainer.TrainEpoch(*data, 2);
  if (!e.ok()) {
    r.error = std::string(e.status().message());
    return r;
  }
  const int done = static_cast<int>(e->steps);
  const double seconds = e->seconds, compute_seconds = e->compute_seconds;
  r.device_ms = 1e3 * e->round_device_seconds / done;
  r.exposed_ms = 1e3 * std::max(0.0, seconds - compute_seconds - e->round_device_seconds) / done;
  r.step_ms = absl::ToDoubleMilliseconds(compute) + r.exposed_ms;
  r.proxy = absl::ToDoubleMilliseconds(compute) / r.step_ms;
  r.data_ms = 1e3 * e->data_wait_seconds / done;
  // The device work sits in the push waits (rounds' ends), and for a waited
  // round's anchor copy in the pull wait: taken out of the push column.
  r.pull_ms = 1e3 * e->pull_wait_seconds / done;
  r.push_ms = std::max(0.0, 1e3 * e->push_wait_seconds / done - r.device_ms);
  r.other_ms = std::max(0.0, r.exposed_ms - r.data_ms - r.pull_ms - r.push_ms);
  return r;
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  using namespace fulcrum;
  bool quick = false;
  int servers = 1, steps = 0;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") quick = true;
    else if (a.rfind("--servers=", 0) == 0) servers = std::stoi(a.substr(10));
    else if (a.rfind("--steps=", 0) == 0) steps = std::stoi(a.substr(8));
    else if (a.rfind("--only=", 0) == 0) only = a.substr(7);
    else {
      std::fprintf(stderr, "usage: fulcrum-proxy-bench [--quick] [--servers=N] [--steps=N] [--only=TEXT]\n");
      return 2;
    }
  }
  SetMinLogSeverity(LogSeverity::kWarning);
  struct Shape {
    std::string name;
    std::vector<int> dims;
    int batch;
    absl::Duration compute;
  };
  std::vector<Shape> shapes = {{"784-1024-1024-10, batch 512", {784, 1024, 1024, 10}, 512, absl::Microseconds(1100)},
                               {"784-4096-4096-10, batch 2048", {784, 4096, 4096, 10}, 2048, absl::Microseconds(1900)}};
  if (quick) shapes = {{"784-64-10, batch 32 (quick)", {784, 64, 10}, 32, absl::Microseconds(1100)}};
  std::vector<Mode> modes;
  {
    Mode bsp{"per-step BSP", {}, 0};
    bsp.consistency.set_model(v1::ConsistencySpec::BSP);
    modes.push_back(bsp);
    Mode ssp{"per-step SSP(1)", {}, 0};
    ssp.consistency.set_model(v1::ConsistencySpec::SSP);
    ssp.consistency.set_staleness(1);
    modes.push_back(ssp);
    for (int h : quick ? std::vector<int>{4} : std::vector<int>{1, 4, 16, 64}) {
      Mode m{absl::StrCat("local steps, H = ", h), {}, h};
      m.consistency.set_model(v1::ConsistencySpec::LOCAL);
      m.consistency.set_sync_every_steps(h);
      modes.push_back(m);
    }
    for (int h : quick ? std::vector<int>{} : std::vector<int>{16, 64}) {
      Mode m{absl::StrCat("local steps, H = ", h, ", overlapped"), {}, h, true};
      m.consistency.set_model(v1::ConsistencySpec::LOCAL);
      m.consistency.set_sync_every_steps(h);
      modes.push_back(m);
    }
  }
  std::printf("# fulcrum-proxy-bench: compute replaced by a fixed time per step; %d server(s) in this process, "
              "gRPC streams + shared memory over 127.0.0.1, fp32 on the wire, 1 worker; %u cores\n\n",
              servers, std::thread::hardware_concurrency());
  // The bound the host's memory puts on rounds: one copy of each model's
  // weights (a round moves them through host memory about 8 times: the
  // pseudo-gradient, its encoding, the server's update, the pull's two
  // copies, the merge and the next anchor), timed in this run.
  for (const Shape& s : shapes) {
    size_t params = 0;
    for (size_t l = 0; l + 1 < s.dims.size(); ++l) params += size_t(s.dims[l] + 1) * s.dims[l + 1];
    std::vector<float> from(params, 1.0f), to(params, 0.0f);
    double best = 1e9;
    for (int i = 0; i < 5; ++i) {
      const absl::Time t0 = absl::Now();
      std::memcpy(to.data(), from.data(), params * 4);
      best = std::min(best, absl::ToDoubleMilliseconds(absl::Now() - t0));
    }
    std::printf("# %s: %.1f MB of weights; one host copy of them %.2f ms (%.1f GB/s), %.3f ms a step at H = 16\n",
                s.name.c_str(), params * 4 / 1e6, best, params * 4 / best / 1e6, best / 16);
  }
  std::printf("\n");
  std::printf("| model | sync | compute ms | step ms | exposed communication ms | GPU-utilisation proxy | exposed: "
              "data / pull / push / other ms | device work at rounds' ends ms (not exposed) |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  int job = 0;
  for (const Shape& s : shapes) {
    for (const Mode& m : modes) {
      if (!only.empty() && absl::StrCat(s.name, " | ", m.name).find(only) == std::string::npos) continue;
      // Whole rounds timed: at least 4 of them, and 128 steps.
      const int n = steps > 0 ? steps : quick ? 8 : std::max(128, 4 * m.sync_every);
      const Result r = RunMode(s.dims, s.batch, s.compute, m, servers, n, ++job);
      if (!r.error.empty()) {
        std::printf("| %s | %s | error: %s | | | | | |\n", s.name.c_str(), m.name.c_str(), r.error.c_str());
        continue;
      }
      std::printf("| %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f / %.2f / %.2f / %.2f | %.2f |\n", s.name.c_str(),
                  m.name.c_str(), absl::ToDoubleMilliseconds(s.compute), r.step_ms, r.exposed_ms, r.proxy, r.data_ms,
                  r.pull_ms, r.push_ms, r.other_ms, r.device_ms);
      std::fflush(stdout);
    }
  }
  return 0;
}
