// fulcrum-graph-step: one training step of a job spec's model graph on a
// chosen backend, over a batch and table values it draws from a seed, with
// everything written to files so tests/gpu/graph_torch_check.py can build
// the same graph in torch and compare the loss and every gradient.
//   DIR/graph.txt: "batch B dense_keys D field_bits F", then one line per
//     node in order: "node NAME OP ROWS COLS INPUTS(a,b or -) fields=.. dim=..
//     mean=0|1 shared=0|1 sum_fields=0|1 fm=0|1 by_position=0|1 index=.. begin=..
//     eps=.. loss=.. crossed=.."; then one
//     line per table: "table NAME dense|sparse ELEMENTS DIM".
//   DIR/keys.u64, values.f32, offsets.i32, labels.f32: the batch (CSR).
//   DIR/<table>.value.f32 and, per device, DIR/<device>.<table>.grad.f32;
//   sparse tables also DIR/<table>.keys.u64 (row order); DIR/<device>.loss.txt.
//   A '/' in a table's name is '~' in its files' names.
// Usage: fulcrum-graph-step --spec=SPEC.yaml --device=cpu|cuda:0 DIR
// (the batch and values are the same for every device: same seed).
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/config/model_graph.h"
#include "common/config/spec_text.h"
#include "worker/compute/backend.h"
#include "worker/models/model.h"

ABSL_FLAG(std::string, spec, "", "job spec whose model is a graph");
ABSL_FLAG(std::string, device, "cpu", "cpu or cuda:N");
ABSL_FLAG(int, batch, 64, "examples");

namespace {

constexpr int kDense = 13, kFields = 26, kFieldBits = 20;

template <typename T>
void Write(const std::string& path, const T* v, size_t n) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(v), static_cast<std::streamsize>(n * sizeof(T)));
}

std::string FileName(std::string table) {
  for (char& ch : table) ch = ch == '/' ? '~' : ch;
  return table;
}

int Fail(const std::string& what) {
  std::fprintf(stderr, "fulcrum-graph-step: %s\n", what.c_str());
  return 1;
}

// Criteo-shaped rows: 13 dense values (some absent), 26 fields of 0 to 2
// ids from a small range (absent, multi-valued and repeated rows all occur).
// Criteo-shaped rows; for a graph whose sparse_input takes its keys by
// position, `by_position` keys from 0 to 6 an example instead.
fulcrum::data::Batch MakeBatch(int B, int by_position) {
  std::mt19937 rng(11);
  std::normal_distribution<float> n(0, 1);
  fulcrum::data::Batch b;
  b.size = B;
  b.offsets.push_back(0);
  if (by_position > 0) {
    for (int i = 0; i < B; ++i) {
      for (int f = 0; f < by_position; ++f) {
        b.keys.push_back(rng() % 7);
        b.values.push_back(1.0f);
      }
      b.offsets.push_back(static_cast<int32_t>(b.keys.size()));
      b.labels.push_back(n(rng));
    }
    return b;
  }
  for (int i = 0; i < B; ++i) {
    for (int k = 0; k < kDense; ++k) {
      if (rng() % 8 == 0) continue;
      b.keys.push_back(k);
      b.values.push_back(n(rng));
    }
    for (int f = 0; f < kFields; ++f) {
      const int count = rng() % 6 == 0 ? 0 : rng() % 5 == 0 ? 2 : 1;
      for (int j = 0; j < count; ++j) {
        b.keys.push_back(kDense + (uint64_t{static_cast<uint32_t>(f)} << kFieldBits) + rng() % 7);
        b.values.push_back(1.0f);
      }
    }
    b.offsets.push_back(static_cast<int32_t>(b.keys.size()));
    b.labels.push_back(static_cast<float>(rng() % 2));
  }
  return b;
}

const char* LossName(fulcrum::config::GraphLoss l) {
  switch (l) {
    case fulcrum::config::GraphLoss::kSoftmaxCrossEntropy: return "softmax_cross_entropy";
    case fulcrum::config::GraphLoss::kBinaryCrossEntropy: return "binary_cross_entropy";
    case fulcrum::config::GraphLoss::kSquaredError: return "squared_error";
  }
  return "?";
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2 || absl::GetFlag(FLAGS_spec).empty()) {
    return Fail("usage: fulcrum-graph-step --spec=SPEC.yaml [--device=cpu|cuda:N] DIR");
  }
  const std::string dir = args[1], device = absl::GetFlag(FLAGS_device);
  fulcrum::v1::JobSpec spec;
  if (auto s = fulcrum::config::ParseSpecFile(absl::GetFlag(FLAGS_spec), &spec); !s.ok()) return Fail(s.ToString());
  auto graph = fulcrum::config::BuildModelGraph(spec.model());
  if (!graph.ok()) return Fail(graph.status().ToString());
  std::string why;
  auto be = fulcrum::compute::CreateBackend(device, &why, 1);
  if (!be.ok()) return Fail(be.status().ToString());
  if (device != "cpu" && !(*be)->is_gpu()) return Fail(absl::StrCat("no usable GPU for ", device, ": ", why));
  fulcrum::models::ModelConfig c;
  c.type = "graph";
  c.graph = spec.model();
  c.dense_keys = kDense;
  c.field_bits = kFieldBits;
  auto model = fulcrum::models::CreateModel(c, be->get());
  if (!model.ok()) return Fail(model.status().ToString());
  const int by_position =
      graph->sparse_input >= 0 && graph->nodes[graph->sparse_input].by_position ? graph->nodes[graph->sparse_input].fields : 0;
  const fulcrum::data::Batch batch = MakeBatch(absl::GetFlag(FLAGS_batch), by_position);
  if (auto s = (*model)->Prepare(batch); !s.ok()) return Fail(s.ToString());

  std::ofstream g(dir + "/graph.txt");
  g << "batch " << batch.size << " dense_keys " << kDense << " field_bits " << kFieldBits << "\n";
  for (const auto& n : graph->nodes) {
    std::vector<std::string> ins;
    for (int k : n.inputs) ins.push_back(graph->nodes[k].name);
    g << "node " << n.name << " " << fulcrum::config::GraphOpName(n.op) << " " << n.rows << " " << n.cols << " "
      << (ins.empty() ? "-" : absl::StrJoin(ins, ",")) << " fields=" << n.fields << " dim=" << n.dim
      << " mean=" << n.mean << " shared=" << n.shared << " sum_fields=" << n.sum_fields << " fm=" << n.fm << " by_position=" << n.by_position << " index=" << n.index << " begin=" << n.begin << " eps=" << n.epsilon
      << " loss=" << LossName(n.loss) << " crossed=" << n.crossed << "\n";
  }
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0, 0.1f);
  for (auto& t : (*model)->tables()) {
    std::vector<float> v(t.elements);
    for (float& x : v) x = normal(rng);
    if (auto s = (*be)->CopyToDevice(t.value.data(), v.data(), v.size() * 4); !s.ok()) return Fail(s.ToString());
    g << "table " << t.spec.name() << " " << (t.sparse ? "sparse" : "dense") << " " << t.elements << " "
      << (t.sparse ? t.dim : 0) << "\n";
    Write(dir + "/" + FileName(t.spec.name()) + ".value.f32", v.data(), v.size());
    if (t.sparse) Write(dir + "/" + FileName(t.spec.name()) + ".keys.u64", t.keys.data(), t.keys.size());
  }
  g.close();
  Write(dir + "/keys.u64", batch.keys.data(), batch.keys.size());
  Write(dir + "/values.f32", batch.values.data(), batch.values.size());
  Write(dir + "/offsets.i32", batch.offsets.data(), batch.offsets.size());
  Write(dir + "/labels.f32", batch.labels.data(), batch.labels.size());

  auto m = (*model)->Run(batch, true);
  if (!m.ok()) return Fail(m.status().ToString());
  const std::string tag = device == "cpu" ? "cpu" : "cuda";
  for (auto& t : (*model)->tables()) {
    std::vector<float> grad(t.elements);
    if (auto s = (*be)->CopyToHost(grad.data(), t.grad.data(), grad.size() * 4); !s.ok()) return Fail(s.ToString());
    if (auto s = (*be)->Synchronize(); !s.ok()) return Fail(s.ToString());
    Write(dir + "/" + tag + "." + FileName(t.spec.name()) + ".grad.f32", grad.data(), grad.size());
  }
  std::ofstream(dir + "/" + tag + ".loss.txt") << absl::StrCat(m->loss_sum / m->examples) << "\n";
  std::printf("%s: %s, %zu tables, loss %.6f\n", (*be)->name().c_str(), spec.name().c_str(), (*model)->tables().size(),
              m->loss_sum / m->examples);
  return 0;
}
