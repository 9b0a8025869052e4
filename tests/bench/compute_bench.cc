// fulcrum-compute-bench: step throughput of each built-in model on a
// compute backend (the CPU, or a GPU with --device=cuda:0), with the share
// of step time spent in GEMMs, in other kernels and waiting for data, and
// the GEMMs' FLOP/s next to the backend's own GEMM speed on the same shapes
// measured in the same run (the bound). Parameters stay on the device: this
// measures compute and the data pipeline, not the network (fulcrum-bench
// does that).
//
//   fulcrum-compute-bench [--device=auto|cpu|cuda:N] [--quick] [--precision=fp32|bf16|fp16]
//                         [--steps=N] [--decode_threads=N] [--device_data=auto|on|off]
// A second table runs each built-in type as its preset graph
// (config::PresetGraph, the graph model's code) on the same data and
// batches: the built-in code's samples/s over the graph's.
// The dense models train on MNIST-like bytes kept on the device, batches
// built there (--device_data=auto; off: decoded on the host). Other data is
// decoded by --decode_threads threads (0: as fulcrum-worker chooses).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/config/model_graph.h"
#include "common/logging.h"
#include "tests/testing/source_dir.h"
#include "worker/compute/backend.h"
#include "worker/data/device_data.h"
#include "worker/data/pipeline.h"
#include "worker/models/model.h"

namespace fulcrum {
namespace {

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// MNIST-shaped dense examples with uniform pixels.
// MNIST-like examples: pixels stored as bytes, decoded as byte / 255.
std::unique_ptr<data::Dataset> SyntheticDense(size_t n, int features, int classes) {
  std::vector<uint8_t> x(n * features);
  std::vector<float> y(n);
  std::mt19937 rng(1);
  for (auto& v : x) v = static_cast<uint8_t>(rng());
  for (size_t i = 0; i < n; ++i) y[i] = static_cast<float>(i % classes);
  return data::BytesInMemory(x, std::move(y), features, 1.0f / 255, classes, "synthetic bytes");
}

// nnz features per example from a Zipf-ish key space (hot keys repeat), or
// (user, item) pairs for ratings.
class SyntheticSparse final : public data::Dataset {
 public:
  SyntheticSparse(size_t n, int nnz, bool ratings) : n_(n), nnz_(nnz), ratings_(ratings) { num_classes_ = ratings ? 0 : 2; }
  size_t size() const override { return n_; }
  int num_features() const override { return 1 << 20; }
  bool sparse() const override { return true; }
  float label(size_t i) const override { return ratings_ ? 1.0f + i % 5 : static_cast<float>(i % 2); }
  void Fill(const int64_t* idx, int n, data::Batch* out) const override {
    out->Reset(n, 0);
    for (int i = 0; i < n; ++i) {
      std::mt19937_64 rng(idx[i]);
      const int k = ratings_ ? 2 : nnz_;
      for (int j = 0; j < k; ++j) {
        const uint64_t r = rng();
        // Half the features from 1k hot keys, half from 1M.
        out->keys.push_back(ratings_ ? (j == 0 ? r % 100000 : (1ull << 40) + r % 20000)
                                     : (j % 2 ? r % 1000 : r % 1000000));
        out->values.push_back(ratings_ ? 1.0f : 0.1f);
      }
      out->offsets.push_back(static_cast<int32_t>(out->keys.size()));
      out->labels[i] = label(idx[i]);
    }
  }

 private:
  size_t n_;
  int nnz_;
  bool ratings_;
};

struct Case {
  std::string name;
  models::ModelConfig config;
  v1::ModelSpec spec;  // the same model as a spec, for its preset graph
  int batch;
  const data::Dataset* data;
  std::string torch_dims;  // the same step in PyTorch (torch_step.py): "784,1024,1024,10"; empty: none
};

// The torch column: tests/bench/torch_step.py run by `python` where torch
// is installed. `why` says why a run gave no figure.
struct TorchPeer {
  std::string python = "python3";
  // A bundle run elsewhere (tests/gpu/run.sh) names its own source tree.
  std::string script = testing::SourceDir() + "/tests/bench/torch_step.py";
  bool enabled = true;
  std::string why;

  // samples/s, or -1 with `why` set.
  double Run(const std::string& device, const Case& c, int steps, int threads) {
    if (!enabled || c.torch_dims.empty()) return -1;
    const std::string cmd =
        absl::StrCat(python, " ", script, " --device ", device, " --dims ", c.torch_dims, " --batch ", c.batch,
                     " --precision ", DTypeName(c.config.precision), " --steps ", std::max(steps, 3), " --threads ",
                     threads, " 2>&1");
    FILE* f = popen(cmd.c_str(), "r");
    if (f == nullptr) {
      why = "cannot run " + python;
      enabled = false;
      return -1;
    }
    std::string out;
    char buf[512];
    while (std::fgets(buf, sizeof buf, f) != nullptr) out += buf;
    const int rc = pclose(f);
    const size_t at = out.find("samples_per_second ");
    if (rc != 0 || at == std::string::npos) {
      why = out.empty() ? absl::StrCat(cmd, " failed") : out.substr(0, out.find('\n'));
      enabled = false;  // torch missing: no use asking again
      return -1;
    }
    return std::strtod(out.c_str() + at + 19, nullptr);
  }
};

struct DataOptions {
  data::DeviceDataMode device_data = data::DeviceDataMode::kAuto;
  int decode_threads = 0;  // 0: data::DefaultDecodeThreads
};

// Timed steps of one case: samples/s, and samples/s of the step without
// its wait for data (-1 after an error, printed as a row); with `torch`
// the main table's row is printed.
struct Rate {
  double samples_per_s = -1;
  double compute_samples_per_s = -1;
};
Rate RunCase(compute::Backend& be, const Case& c, int steps, const DataOptions& d, TorchPeer* torch) {
  auto model = models::CreateModel(c.config, &be);
  if (!model.ok()) {
    std::printf("| %s | error: %s |\n", c.name.c_str(), std::string(model.status().message()).c_str());
    return Rate();
  }
  data::PrefetchOptions po;
  po.batch_size = c.batch;
  po.depth = 4;
  po.drop_last = true;
  po.distinct_keys = (*model)->wants_distinct_keys();
  po.threads = d.decode_threads > 0
                   ? d.decode_threads
                   : data::DefaultDecodeThreads(static_cast<int>(std::thread::hardware_concurrency()), be.is_gpu());
  std::string why;
  auto on_device = data::DeviceData::Upload(*c.data, &be, d.device_data, 0.25, &why);
  if (!on_device.ok()) {
    std::printf("| %s | error: %s |\n", c.name.c_str(), std::string(on_device.status().message()).c_str());
    return Rate();
  }
  po.device = on_device->get();
  data::Prefetcher prefetch(c.data, data::ShardOrder(c.data->size(), 0, 1, 1, 0), 0, po, &be);
  // Warm-up step (allocations, cuBLAS heuristics), then the timed steps.
  int done = 0;
  double total = 0, wait_before = 0;
  for (int s = 0; s < steps + 1; ++s) {
    auto t0 = Clock::now();
    auto batch = prefetch.Next();
    if (!batch.ok() || !*batch) break;
    if (s == 1) {
      be.ResetProfile();
      be.set_profiling(true);
      wait_before = prefetch.wait_seconds();
      t0 = Clock::now();
    }
    absl::Status st = (*model)->Prepare(**batch);
    if (s == 0 && st.ok()) {
      // Parameters: small random values, loaded once.
      std::mt19937 rng(3);
      std::normal_distribution<float> n(0, 0.05f);
      for (models::Table& t : (*model)->tables()) {
        std::vector<float> v(t.elements);
        for (auto& x : v) x = n(rng);
        st = be.CopyToDevice(t.value.data(), v.data(), v.size() * 4);
        if (st.ok()) st = be.Synchronize();
      }
    }
    if (st.ok()) st = (*model)->Run(**batch, true).status();
    if (st.ok()) st = be.Synchronize();
    if (!st.ok()) {
      std::printf("| %s | error: %s |\n", c.name.c_str(), std::string(st.message()).c_str());
      return Rate();
    }
    if (s >= 1) {
      total += Seconds(t0, Clock::now());
      ++done;
    }
    prefetch.Recycle(std::move(*batch));
  }
  be.set_profiling(false);
  const double gemm = be.profile().gemm_seconds, other = be.profile().other_seconds,
               copy = be.profile().copy_seconds;
  const uint64_t flops = be.profile().gemm_flops;
  const double wait = prefetch.wait_seconds() - wait_before;
  const double rest = std::max(0.0, total - gemm - other - copy - wait);
  const double ours = done * c.batch / total;
  const Rate rate{ours, total > wait ? done * c.batch / (total - wait) : -1};
  if (torch == nullptr) return rate;
  const double peer = torch->Run(be.is_gpu() ? "cuda" : "cpu", c, steps,
                                 be.is_gpu() ? 0 : static_cast<int>(std::thread::hardware_concurrency()));
  std::printf("| %s | %s | %d | %.0f | %.0f%% | %.0f%% | %.0f%% | %.0f%% | %.0f%% | %s | %s | %s |\n", c.name.c_str(),
              po.device != nullptr ? "device" : absl::StrCat("host, ", po.threads, " thread(s)").c_str(), c.batch,
              ours, 100 * gemm / total, 100 * other / total, 100 * copy / total, 100 * wait / total,
              100 * rest / total,
              gemm > 0 ? absl::StrCat(static_cast<int>(flops / gemm / 1e9), " GFLOP/s").c_str() : "-",
              peer > 0 ? absl::StrFormat("%.0f", peer).c_str() : "-",
              peer > 0 ? absl::StrFormat("%.2fx", ours / peer).c_str() : "-");
  return rate;
}

// The case's model as its preset graph (the same tables and data).
absl::StatusOr<Case> AsPresetGraph(const Case& c) {
  Case g = c;
  auto preset = config::PresetGraph(c.spec, c.config.num_features, c.config.num_classes);
  if (!preset.ok()) return preset.status();
  g.config.type = "graph";
  g.config.graph = *std::move(preset);
  return g;
}

// The backend's own GEMM speed on the MLP's shapes (forward and both
// backward GEMMs), fp32 or 16-bit inputs: the bound for the GEMM column.
double GemmBound(compute::Backend& be, const std::vector<int>& dims, int batch, DType precision, int reps) {
  double flops = 0, seconds = 0;
  for (size_t l = 0; l + 1 < dims.size(); ++l) {
    const int in = dims[l], out = dims[l + 1];
    auto A = be.Allocate(size_t{4} * batch * std::max(in, out));
    auto W = be.Allocate(size_t{4} * in * out);
    auto C = be.Allocate(size_t{4} * batch * std::max(in, out));
    auto G = be.Allocate(size_t{4} * in * out);
    if (!A.ok() || !W.ok() || !C.ok() || !G.ok()) return 0;
    (void)be.Zero(A->data(), A->bytes());
    (void)be.Zero(W->data(), W->bytes());
    auto gemms = [&] {
      if (precision == DType::kFp32) {
        (void)be.Gemm(false, false, batch, out, in, 1, A->as<float>(), W->as<float>(), 0, C->as<float>());
        (void)be.Gemm(true, false, in, out, batch, 1, A->as<float>(), C->as<float>(), 0, G->as<float>());
        (void)be.Gemm(false, true, batch, in, out, 1, C->as<float>(), W->as<float>(), 0, A->as<float>());
      } else {
        auto a = A->as<uint16_t>(), w = W->as<uint16_t>(), c16 = C->as<uint16_t>();
        (void)be.GemmLowp(precision, false, false, batch, out, in, 1, a, w, 0, C->as<float>());
        (void)be.GemmLowp(precision, true, false, in, out, batch, 1, a, c16, 0, G->as<float>());
        (void)be.GemmLowp(precision, false, true, batch, in, out, 1, c16, w, 0, A->as<float>());
      }
    };
    gemms();
    (void)be.Synchronize();
    const auto t0 = Clock::now();
    for (int r = 0; r < reps; ++r) gemms();
    (void)be.Synchronize();
    seconds += Seconds(t0, Clock::now());
    flops += 3.0 * 2 * batch * in * out * reps;
  }
  return flops / seconds / 1e9;
}

}  // namespace
}  // namespace fulcrum

int main(int argc, char** argv) {
  using namespace fulcrum;
  std::string device = "auto";
  bool quick = false;
  int steps = 0;
  DType precision = DType::kFp32;
  DataOptions data_options;
  TorchPeer torch;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") quick = true;
    else if (a.rfind("--device=", 0) == 0) device = a.substr(9);
    else if (a.rfind("--steps=", 0) == 0) steps = std::stoi(a.substr(8));
    else if (a == "--precision=bf16") precision = DType::kBf16;
    else if (a == "--precision=fp16") precision = DType::kFp16;
    else if (a == "--precision=fp32") precision = DType::kFp32;
    else if (a.rfind("--decode_threads=", 0) == 0) data_options.decode_threads = std::stoi(a.substr(17));
    else if (a == "--torch=off") torch.enabled = false;
    else if (a.rfind("--python=", 0) == 0) torch.python = a.substr(9);
    else if (a.rfind("--torch_script=", 0) == 0) torch.script = a.substr(15);
    else if (a.rfind("--device_data=", 0) == 0 && data::DeviceDataModeFromName(a.substr(14)).ok()) {
      data_options.device_data = *data::DeviceDataModeFromName(a.substr(14));
    } else {
      std::fprintf(stderr, "usage: fulcrum-compute-bench [--device=auto|cpu|cuda:N] [--quick] [--steps=N] "
                           "[--precision=fp32|bf16|fp16] [--decode_threads=N] [--device_data=auto|on|off] "
                           "[--torch=off] [--python=PATH] [--torch_script=PATH]\n");
      return 2;
    }
  }
  SetMinLogSeverity(LogSeverity::kWarning);
  std::string why;
  auto be = compute::CreateBackend(device, &why);
  if (!be.ok()) {
    std::fprintf(stderr, "fulcrum-compute-bench: %s\n", std::string(be.status().message()).c_str());
    return 1;
  }
  const bool gpu = (*be)->is_gpu();
  if (steps == 0) steps = quick ? 3 : (gpu ? 200 : 30);
  std::printf("# fulcrum-compute-bench on %s (%s), %d timed steps per model, GEMM precision %s\n\n",
              (*be)->name().c_str(), why.c_str(), steps, DTypeName(precision));

  const int mlp_batch = gpu ? 4096 : 256;
  const std::vector<int> mlp_dims = {784, 1024, 1024, 10};
  const size_t dense_n = static_cast<size_t>(mlp_batch) * (steps + 2);
  auto mnist_like = SyntheticDense(dense_n, 784, 10);
  const int sparse_batch = gpu ? 8192 : 512;
  SyntheticSparse sparse(static_cast<size_t>(sparse_batch) * (steps + 2), 64, false);
  SyntheticSparse ratings(static_cast<size_t>(sparse_batch) * (steps + 2), 2, true);

  std::vector<Case> cases;
  auto add = [&](std::string name, std::string type, int batch, const data::Dataset* d) {
    Case c;
    c.name = std::move(name);
    c.spec.set_type(type);
    c.spec.set_factors(16);
    c.config.type = std::move(type);
    c.config.num_features = 784;
    c.config.num_classes = 10;
    c.config.factors = 16;
    c.batch = batch;
    c.data = d;
    cases.push_back(std::move(c));
    return &cases.back();
  };
  add("softmax 784-10", "softmax", mlp_batch, mnist_like.get())->torch_dims = "784,10";
  {
    Case* c = add("mlp 784-1024-1024-10", "mlp", mlp_batch, mnist_like.get());
    c->config.hidden = {1024, 1024};
    c->spec.add_hidden(1024);
    c->spec.add_hidden(1024);
    c->config.precision = precision;
    c->torch_dims = "784,1024,1024,10";
  }
  add("sparse_lr, 64 nnz", "sparse_lr", sparse_batch, &sparse);
  add("fm k=16, 64 nnz", "fm", sparse_batch, &sparse);
  add("mf k=16", "mf", sparse_batch, &ratings);

  std::printf("| model | batches built | batch | samples/s | GEMM | other kernels | copies | data wait | host (keys, launch) | GEMM speed | torch samples/s | vs torch |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Case& c : cases) RunCase(**be, c, steps, data_options, &torch);
  if (!torch.enabled || !torch.why.empty()) {
    std::printf("\ntorch column empty: %s\n", torch.why.empty() ? "--torch=off" : torch.why.c_str());
  } else {
    std::printf("\ntorch column: the same step in PyTorch (tests/bench/torch_step.py: same widths, batch and "
                "precision, bytes decoded on the device, autocast for bf16/fp16 on a GPU), run by %s\n",
                torch.python.c_str());
  }
  // One model path (docs/compute.md): each built-in type against its
  // preset graph, same data, batches and backend, in this run, alternating
  // `reps` times; medians. "Compute" leaves out the wait for data, which
  // is the same decoder for both.
  const int reps = quick ? 1 : 5;
  std::printf("\n| model | built-in samples/s | preset graph samples/s | built-in / graph | compute only: built-in / graph |\n"
              "|---|---|---|---|---|\n");
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? -1.0 : v[v.size() / 2];
  };
  for (const Case& c : cases) {
    absl::StatusOr<Case> g = AsPresetGraph(c);
    if (!g.ok()) {
      std::printf("| %s | %s |\n", c.name.c_str(), std::string(g.status().message()).c_str());
      continue;
    }
    std::vector<double> b, gr, bc, gc;
    for (int r = 0; r < reps; ++r) {
      const Rate x = RunCase(**be, c, steps, data_options, nullptr);
      const Rate y = RunCase(**be, *g, steps, data_options, nullptr);
      b.push_back(x.samples_per_s);
      gr.push_back(y.samples_per_s);
      bc.push_back(x.compute_samples_per_s);
      gc.push_back(y.compute_samples_per_s);
    }
    const double mb = median(b), mg = median(gr), mbc = median(bc), mgc = median(gc);
    std::printf("| %s | %.0f | %.0f | %s | %s |\n", c.name.c_str(), mb, mg,
                mb > 0 && mg > 0 ? absl::StrFormat("%.2fx", mb / mg).c_str() : "-",
                mbc > 0 && mgc > 0 ? absl::StrFormat("%.2fx", mbc / mgc).c_str() : "-");
  }
  const double bound = GemmBound(**be, mlp_dims, mlp_batch, precision, quick ? 2 : (gpu ? 50 : 5));
  std::printf("\nGEMM bound: the backend's %s GEMMs alone on the MLP's shapes (batch %d): %.0f GFLOP/s\n",
              DTypeName(precision), mlp_batch, bound);
  return 0;
}
