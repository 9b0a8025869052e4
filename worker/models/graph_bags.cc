#include "worker/models/graph_bags.h"

#include "absl/strings/str_cat.h"

namespace fulcrum::models {

namespace {

uint64_t Mix(uint64_t x) {  // splitmix64's finalizer
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

}  // namespace

uint64_t CrossKey(int i, int j, uint64_t a, uint64_t b) {
  return Mix(Mix(a ^ (uint64_t{static_cast<uint32_t>(i)} << 48 | uint64_t{static_cast<uint32_t>(j)} << 32)) ^ b);
}

void Bags::Finish(int batch, bool mean, bool shared, uint64_t first, uint64_t mask) {
  example_offsets.resize(batch + 1);
  for (int b = 0; b <= batch; ++b) example_offsets[b] = offsets[static_cast<size_t>(b) * fields];
  data::DistinctKeys(keys.data(), keys.size(), &distinct, &index);
  if (shared) {
    std::vector<uint64_t> within(keys.size());
    for (size_t i = 0; i < keys.size(); ++i) within[i] = (keys[i] - first) & mask;
    data::DistinctKeys(within.data(), within.size(), &distinct_shared, &index_shared);
  }
  if (mean) {
    mean_values.resize(keys.size());
    for (size_t bag = 0; bag + 1 < offsets.size(); ++bag) {
      const int n = offsets[bag + 1] - offsets[bag];
      for (int j = offsets[bag]; j < offsets[bag + 1]; ++j) mean_values[j] = values[j] / n;
    }
  }
}

absl::Status SplitRows(const data::Batch& batch, uint64_t first, int field_bits, int dense_width,
                       const std::string& node, std::vector<float>* dense, Bags* bags) {
  const int B = batch.size, F = bags ? bags->fields : 1;
  if (dense_width > 0) dense->assign(static_cast<size_t>(B) * dense_width, 0.0f);
  auto field = [&](uint64_t k) { return field_bits > 0 ? (k - first) >> field_bits : 0; };
  std::vector<int32_t> count(static_cast<size_t>(B) * F + 1, 0);
  for (int b = 0; b < B; ++b) {
    for (int j = batch.offsets[b]; j < batch.offsets[b + 1]; ++j) {
      const uint64_t k = batch.keys[j];
      if (k < first) {
        if (static_cast<int64_t>(k) < dense_width) (*dense)[static_cast<size_t>(b) * dense_width + k] = batch.values[j];
      } else if (bags != nullptr) {
        if (field(k) >= static_cast<uint64_t>(F)) {
          return absl::InvalidArgumentError(absl::StrCat("model graph: example ", b, " of batch ", batch.index,
                                                         " has key ", k, " of field ", field(k), "; node '", node,
                                                         "' has ", F, " fields"));
        }
        ++count[static_cast<size_t>(b) * F + field(k) + 1];
      }
    }
  }
  if (bags == nullptr) return absl::OkStatus();
  for (size_t i = 1; i < count.size(); ++i) count[i] += count[i - 1];
  bags->offsets = count;
  bags->keys.resize(count.back());
  bags->values.resize(count.back());
  for (int b = 0; b < B; ++b) {
    for (int j = batch.offsets[b]; j < batch.offsets[b + 1]; ++j) {
      const uint64_t k = batch.keys[j];
      if (k < first) continue;
      const int32_t at = count[static_cast<size_t>(b) * F + field(k)]++;
      bags->keys[at] = k;
      bags->values[at] = batch.values[j];
    }
  }
  return absl::OkStatus();
}

absl::Status SplitByPosition(const data::Batch& batch, const std::string& node, Bags* bags) {
  const int B = batch.size, F = bags->fields;
  for (int b = 0; b < B; ++b) {
    if (batch.offsets[b + 1] - batch.offsets[b] != F) {
      return absl::InvalidArgumentError(absl::StrCat("model graph: example ", b, " of batch ", batch.index, " has ",
                                                     batch.offsets[b + 1] - batch.offsets[b], " keys; node '", node,
                                                     "' takes exactly ", F, " by position"));
    }
  }
  const size_t n = static_cast<size_t>(B) * F;
  bags->offsets.resize(n + 1);
  for (size_t i = 0; i <= n; ++i) bags->offsets[i] = static_cast<int32_t>(i);
  bags->keys.assign(batch.keys.begin() + batch.offsets[0], batch.keys.begin() + batch.offsets[0] + n);
  bags->values.assign(batch.values.begin() + batch.offsets[0], batch.values.begin() + batch.offsets[0] + n);
  return absl::OkStatus();
}

void SelectField(const Bags& in, int batch, int f, Bags* out) {
  out->fields = 1;
  out->offsets.assign(1, 0);
  out->keys.clear();
  out->values.clear();
  for (int b = 0; b < batch; ++b) {
    const size_t bag = static_cast<size_t>(b) * in.fields + f;
    for (int x = in.offsets[bag]; x < in.offsets[bag + 1]; ++x) {
      out->keys.push_back(in.keys[x]);
      out->values.push_back(in.values[x]);
    }
    out->offsets.push_back(static_cast<int32_t>(out->keys.size()));
  }
}

std::shared_ptr<const GraphHostPlan> MakeGraphHostPlan(config::ModelGraph graph, int dense_keys, int field_bits) {
  auto plan = std::make_shared<GraphHostPlan>();
  plan->first = static_cast<uint64_t>(dense_keys);
  plan->mask = field_bits > 0 ? (uint64_t{1} << field_bits) - 1 : ~uint64_t{0};
  plan->field_bits = field_bits;
  plan->dense_width = graph.dense_input >= 0 ? static_cast<int>(graph.nodes[graph.dense_input].width()) : 0;
  plan->wants_mean.assign(graph.nodes.size(), false);
  plan->wants_shared.assign(graph.nodes.size(), false);
  for (const config::GraphNodeInfo& n : graph.nodes) {
    if (n.op != config::GraphOp::kEmbedding) continue;
    if (n.mean) plan->wants_mean[n.inputs[0]] = true;
    if (n.shared) plan->wants_shared[n.inputs[0]] = true;
  }
  plan->graph = std::move(graph);
  return plan;
}

void BuildGraphHostBatch(const GraphHostPlan& plan, const data::Batch& batch, GraphHostBatch* out) {
  const config::ModelGraph& g = plan.graph;
  const int B = batch.size, sp = g.sparse_input;
  out->bags.resize(g.nodes.size());
  Bags* fields = sp >= 0 ? &out->bags[sp] : nullptr;
  if (fields != nullptr) fields->fields = g.nodes[sp].fields;
  out->status = fields != nullptr && g.nodes[sp].by_position
                    ? SplitByPosition(batch, g.nodes[sp].name, fields)
                    : SplitRows(batch, plan.first, plan.field_bits, plan.dense_width, sp >= 0 ? g.nodes[sp].name : "",
                                &out->dense, fields);
  if (!out->status.ok()) return;
  for (size_t i = 0; i < g.nodes.size(); ++i) {
    const config::GraphNodeInfo& n = g.nodes[i];
    if (!config::IsSparseSource(n.op)) continue;
    if (n.op == config::GraphOp::kCross) Cross(out->bags[n.inputs[0]], B, n.crossed, &out->bags[i]);
    if (n.op == config::GraphOp::kField) SelectField(out->bags[n.inputs[0]], B, n.index, &out->bags[i]);
    out->bags[i].Finish(B, plan.wants_mean[i], plan.wants_shared[i], plan.first, plan.mask);
  }
}

void Cross(const Bags& in, int batch, int crossed, Bags* out) {
  out->fields = crossed * (crossed - 1) / 2;
  out->offsets.assign(1, 0);
  out->keys.clear();
  out->values.clear();
  for (int b = 0; b < batch; ++b) {
    const int32_t* bag = in.offsets.data() + static_cast<size_t>(b) * in.fields;
    for (int i = 0; i < crossed; ++i) {
      for (int j = i + 1; j < crossed; ++j) {
        for (int x = bag[i]; x < bag[i + 1]; ++x) {
          for (int y = bag[j]; y < bag[j + 1]; ++y) {
            out->keys.push_back(CrossKey(i, j, in.keys[x], in.keys[y]));
            out->values.push_back(in.values[x] * in.values[y]);
          }
        }
        out->offsets.push_back(static_cast<int32_t>(out->keys.size()));
      }
    }
  }
}

}  // namespace fulcrum::models
