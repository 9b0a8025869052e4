// fulcrum-mlp-step: one MLP training step on a chosen backend from inputs
// in files, writing the gradients to files, so tests/gpu/torch_check.py can
// compare them with torch autograd on the same numbers.
//   DIR/config.txt: "batch features hidden1 ... classes activation precision"
//   DIR/x.f32 (batch x features), DIR/y.f32 (class ids), DIR/w<l>.f32 and
//   DIR/b<l>.f32 (layer l: in x out weights, out biases), raw little-endian.
// Writes DIR/<device>.gw<l>.f32, DIR/<device>.gb<l>.f32, DIR/<device>.loss.txt
// (mean loss). Usage: fulcrum-mlp-step --device=cpu|cuda:0 DIR
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/logging.h"
#include "worker/compute/backend.h"
#include "worker/models/model.h"

namespace {

std::vector<float> Read(const std::string& path, size_t n) {
  std::vector<float> v(n);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * 4));
  if (!in) {
    std::fprintf(stderr, "fulcrum-mlp-step: %s: cannot read %zu floats\n", path.c_str(), n);
    std::exit(1);
  }
  return v;
}

void Write(const std::string& path, const std::vector<float>& v) {
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(v.data()),
                                              static_cast<std::streamsize>(v.size() * 4));
}

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "fulcrum-mlp-step: %s\n", s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace fulcrum;
  if (argc != 3 || std::string(argv[1]).rfind("--device=", 0) != 0) {
    std::fprintf(stderr, "usage: fulcrum-mlp-step --device=cpu|cuda:N DIR\n");
    return 2;
  }
  SetMinLogSeverity(LogSeverity::kWarning);
  const std::string device = std::string(argv[1]).substr(9), dir = argv[2];
  std::ifstream cfg(dir + "/config.txt");
  std::vector<std::string> words;
  for (std::string w; cfg >> w;) words.push_back(w);
  if (words.size() < 6) {
    std::fprintf(stderr, "fulcrum-mlp-step: %s/config.txt: expected batch features hidden... classes act precision\n",
                 dir.c_str());
    return 2;
  }
  models::ModelConfig c;
  c.type = "mlp";
  const int batch = std::stoi(words[0]);
  c.num_features = std::stoi(words[1]);
  for (size_t i = 2; i + 3 < words.size(); ++i) c.hidden.push_back(std::stoi(words[i]));
  c.num_classes = std::stoi(words[words.size() - 3]);
  auto act = compute::ActivationFromName(words[words.size() - 2]);
  if (!act.ok()) return Fail(act.status());
  c.activation = *act;
  const std::string prec = words.back();
  c.precision = prec == "bf16" ? DType::kBf16 : prec == "fp16" ? DType::kFp16 : DType::kFp32;

  std::string why;
  auto be = compute::CreateBackend(device, &why);
  if (!be.ok()) return Fail(be.status());
  auto model = models::CreateModel(c, be->get());
  if (!model.ok()) return Fail(model.status());
  data::Batch b;
  b.size = batch;
  b.num_features = c.num_features;
  b.dense = Read(dir + "/x.f32", size_t{1} * batch * c.num_features);
  b.labels = Read(dir + "/y.f32", batch);
  if (auto s = (*model)->Prepare(b); !s.ok()) return Fail(s);
  auto& tables = (*model)->tables();
  for (size_t t = 0; t < tables.size(); ++t) {
    const std::string name = (t % 2 == 0 ? "/w" : "/b") + std::to_string(t / 2) + ".f32";
    auto v = Read(dir + name, tables[t].elements);
    if (auto s = (*be)->CopyToDevice(tables[t].value.data(), v.data(), v.size() * 4); !s.ok()) return Fail(s);
    if (auto s = (*be)->Synchronize(); !s.ok()) return Fail(s);
  }
  auto m = (*model)->Run(b, true);
  if (!m.ok()) return Fail(m.status());
  const std::string tag = device == "cpu" ? "cpu" : "cuda";
  for (size_t t = 0; t < tables.size(); ++t) {
    std::vector<float> g(tables[t].elements);
    if (auto s = (*be)->CopyToHost(g.data(), tables[t].grad.data(), g.size() * 4); !s.ok()) return Fail(s);
    if (auto s = (*be)->Synchronize(); !s.ok()) return Fail(s);
    Write(dir + "/" + tag + (t % 2 == 0 ? ".gw" : ".gb") + std::to_string(t / 2) + ".f32", g);
  }
  std::ofstream(dir + "/" + tag + ".loss.txt") << m->loss_sum / batch << "\n";
  std::printf("%s: %s, mean loss %.6f\n", (*be)->name().c_str(), why.c_str(), m->loss_sum / batch);
  return 0;
}
