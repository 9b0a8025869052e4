// Model graphs (common/config/model_graph.h): shapes and parameter counts
// of valid graphs, mlp expansion, and that every mistake names its node and
// field.
#include <fstream>
#include <sstream>
#include <string>

#include <catch2/catch.hpp>

#include "common/config/job_spec.h"
#include "common/config/model_graph.h"
#include "common/config/spec_text.h"

namespace fulcrum::config {
namespace {

v1::ModelSpec Graph(const std::string& nodes) {
  v1::ModelSpec m;
  const absl::Status s = ParseSpecText("graph:\n" + nodes, "test", &m);
  INFO(s.message());
  REQUIRE(s.ok());
  m.set_type("graph");
  return m;
}

std::string Problems(const std::string& nodes) {
  auto g = BuildModelGraph(Graph(nodes));
  REQUIRE_FALSE(g.ok());
  CHECK(absl::IsInvalidArgument(g.status()));
  return std::string(g.status().message());
}

const GraphNodeInfo& Find(const ModelGraph& g, const std::string& name) {
  for (const GraphNodeInfo& n : g.nodes) {
    if (n.name == name) return n;
  }
  FAIL("no node " << name);
  return g.nodes.front();
}

constexpr char kDlrm[] =
    "  - {name: top, op: mlp, inputs: [features], layers: [64, 32, 1]}\n"  // listed before its inputs
    "  - {name: dense, op: dense_input, width: 13}\n"
    "  - {name: cat, op: sparse_input, fields: 26}\n"
    "  - {name: bottom, op: mlp, inputs: [dense], layers: [64, 16], final_activation: relu}\n"
    "  - {name: emb, op: embedding, inputs: [cat], dim: 16}\n"
    "  - {name: inter, op: dot_interaction, inputs: [bottom, emb]}\n"
    "  - {name: features, op: concat, inputs: [bottom, inter]}\n"
    "  - {name: loss, op: loss, inputs: [top], loss: binary_cross_entropy}\n";

TEST_CASE("model graph: DLRM's shapes, order and parameter counts", "[graph]") {
  auto g = BuildModelGraph(Graph(kDlrm));
  INFO(g.status().message());
  REQUIRE(g.ok());
  // Every input precedes its reader; the loss is last.
  for (size_t i = 0; i < g->nodes.size(); ++i) {
    for (int k : g->nodes[i].inputs) CHECK(k < static_cast<int>(i));
  }
  CHECK(g->nodes.back().op == GraphOp::kLoss);
  CHECK(Find(*g, "emb").rows == 26);
  CHECK(Find(*g, "emb").cols == 16);
  CHECK(Find(*g, "bottom").op == GraphOp::kRelu);  // the mlp's last node carries its name
  CHECK(Find(*g, "bottom").width() == 16);
  CHECK(Find(*g, "inter").width() == 27 * 26 / 2);
  CHECK(Find(*g, "features").width() == 16 + 351);
  CHECK(Find(*g, "top").op == GraphOp::kLinear);
  CHECK(Find(*g, "top").width() == 1);
  CHECK(Find(*g, "top.linear0").dense_parameters == 367 * 64 + 64);
  CHECK(Find(*g, "bottom.linear0").dense_parameters == 13 * 64 + 64);
  CHECK(g->dense_parameters() == (13 * 64 + 64) + (64 * 16 + 16) + (367 * 64 + 64) + (64 * 32 + 32) + (32 + 1));
  CHECK(g->floats_per_sparse_key() == 16);
  const std::string text = ModelGraphText(*g);
  CHECK_THAT(text, Catch::Contains("inter"));
  CHECK_THAT(text, Catch::Contains("dot_interaction"));
  CHECK_THAT(text, Catch::Contains("26x16"));
  CHECK_THAT(text, Catch::Contains("16 per key"));
  CHECK_THAT(text, Catch::Contains("sparse floats per key: emb 16,"));
}

TEST_CASE("model graph text: each embedding's floats per key, not their sum (mf holds k + 1 per key)", "[graph]") {
  v1::ModelSpec mf;
  mf.set_type("mf");
  mf.set_factors(32);
  auto preset = PresetGraph(mf, 0, 0);
  REQUIRE(preset.ok());
  auto g = BuildModelGraph(*preset);
  REQUIRE(g.ok());
  const std::string text = ModelGraphText(*g);
  INFO(text);
  CHECK_THAT(text, Catch::Contains("sparse floats per key: user 33, item 33,"));
  CHECK_THAT(text, !Catch::Contains("66"));
}

TEST_CASE("model graph: an embedding's admission and eviction reach its table, and bad knobs are named", "[graph]") {
  const std::string nodes =
      "  - {name: cat, op: sparse_input, fields: 2}\n"
      "  - {name: emb, op: embedding, inputs: [cat], dim: 1, sum_fields: true, "
      "admission: {min_count: 2}, eviction: {policy: lfu, max_rows: 1000, ttl_steps: 50}}\n"
      "  - {name: loss, op: loss, inputs: [emb], loss: binary_cross_entropy}\n";
  auto g = BuildModelGraph(Graph(nodes));
  INFO(g.status().message());
  REQUIRE(g.ok());
  const GraphNodeInfo& emb = Find(*g, "emb");
  CHECK(emb.lifecycle.admission().min_count() == 2);
  CHECK(emb.lifecycle.eviction().policy() == v1::EvictionSpec::LFU);
  CHECK(emb.lifecycle.eviction().max_rows() == 1000);
  CHECK(emb.lifecycle.eviction().ttl_steps() == 50);
  std::string p = Problems(
      "  - {name: cat, op: sparse_input, fields: 2}\n"
      "  - {name: emb, op: embedding, inputs: [cat], dim: 1, sum_fields: true, "
      "admission: {probability: 2}, eviction: {policy: lru}}\n"
      "  - {name: loss, op: loss, inputs: [emb], loss: binary_cross_entropy, eviction: {max_rows: 5}}\n");
  INFO(p);
  CHECK(p.find("'emb'.admission.probability: 2 must be in (0, 1]") != std::string::npos);
  CHECK(p.find("'emb'.eviction: needs max_rows, max_bytes or ttl_steps") != std::string::npos);
  CHECK(p.find("'loss'.eviction: applies to embedding nodes only") != std::string::npos);
  // A built-in model's knobs hold for each of its tables, and are checked.
  v1::JobSpec spec;
  REQUIRE(ParseSpecText("name: x\nmodel: {type: fm, eviction: {max_rows: 0}}\ndata: {train: {format: libsvm, path: a}}\n",
                        "fm.yaml", &spec)
              .ok());
  bool named = false;
  for (const std::string& q : JobSpecProblems(spec)) named = named || q.find("model.eviction: needs max_rows") != std::string::npos;
  CHECK(named);
  v1::ModelSpec fm;
  fm.set_type("fm");
  fm.mutable_admission()->set_min_count(3);
  auto preset = PresetGraph(fm, 0, 0);
  REQUIRE(preset.ok());
  int with = 0;
  for (const v1::GraphNode& n : preset->graph()) with += n.op() == "embedding" && n.admission().min_count() == 3;
  CHECK(with == 2);  // linear and factors
}

TEST_CASE("model graph: an embedding's storage reaches its table, and a bad tier or budget is named", "[graph]") {
  auto g = BuildModelGraph(Graph("  - {name: cat, op: sparse_input, fields: 2}\n"
                                 "  - {name: emb, op: embedding, inputs: [cat], dim: 1, sum_fields: true, "
                                 "storage: {memory_bytes: 4096, spill: rocksdb}, eviction: {policy: lfu}}\n"
                                 "  - {name: loss, op: loss, inputs: [emb], loss: binary_cross_entropy}\n"));
  INFO(g.status().message());
  REQUIRE(g.ok());
  const GraphNodeInfo& emb = Find(*g, "emb");
  CHECK(emb.lifecycle.storage().memory_bytes() == 4096);
  CHECK(emb.lifecycle.storage().spill() == v1::StorageSpec::ROCKSDB);
  CHECK(emb.lifecycle.eviction().policy() == v1::EvictionSpec::LFU);
  std::string p = Problems(
      "  - {name: cat, op: sparse_input, fields: 2}\n"
      "  - {name: emb, op: embedding, inputs: [cat], dim: 1, sum_fields: true, "
      "storage: {memory_bytes: 2}, eviction: {max_rows: 10}}\n"
      "  - {name: loss, op: loss, inputs: [emb], loss: binary_cross_entropy, storage: {memory_bytes: 4096}}\n");
  INFO(p);
  CHECK(p.find("'emb'.storage.spill: must name the tier") != std::string::npos);
  CHECK(p.find("'emb'.storage.memory_bytes: 2 is below one row") != std::string::npos);
  CHECK(p.find("'emb'.eviction: with storage takes only policy and lfu_decay") != std::string::npos);
  CHECK(p.find("'loss'.storage: applies to embedding nodes only") != std::string::npos);
  // A built-in model's storage holds for each of its tables.
  v1::ModelSpec fm;
  fm.set_type("fm");
  fm.mutable_storage()->set_memory_bytes(1 << 20);
  fm.mutable_storage()->set_spill(v1::StorageSpec::ROCKSDB);
  auto preset = PresetGraph(fm, 0, 0);
  REQUIRE(preset.ok());
  int with = 0;
  for (const v1::GraphNode& n : preset->graph()) with += n.op() == "embedding" && n.storage().memory_bytes() == 1 << 20;
  CHECK(with == 2);
}

TEST_CASE("model graph: a cross of k fields has k(k-1)/2 fields for its embedding", "[graph]") {
  auto g = BuildModelGraph(Graph("  - {name: c, op: sparse_input, fields: 26}\n"
                                 "  - {name: k, op: cross, inputs: [c], fields: 8}\n"
                                 "  - {name: all, op: cross, inputs: [c]}\n"
                                 "  - {name: e, op: embedding, inputs: [k], dim: 1, sum_fields: true}\n"
                                 "  - {name: f, op: embedding, inputs: [all], dim: 2}\n"
                                 "  - {name: s, op: linear, inputs: [f], width: 1}\n"
                                 "  - {name: a, op: add, inputs: [e, s]}\n"
                                 "  - {name: loss, op: loss, inputs: [a], loss: binary_cross_entropy}\n"));
  INFO(g.status().message());
  REQUIRE(g.ok());
  CHECK(Find(*g, "k").fields == 28);
  CHECK(Find(*g, "all").fields == 325);
  CHECK(Find(*g, "e").width() == 1);
  CHECK(Find(*g, "f").rows == 325);
  CHECK_THAT(ModelGraphText(*g), Catch::Contains("28 fields"));
}

TEST_CASE("model graph: concat stacks vectors of one width and flattens others", "[graph]") {
  auto g = BuildModelGraph(Graph("  - {name: x, op: dense_input, width: 4}\n"
                                 "  - {name: c, op: sparse_input, fields: 3}\n"
                                 "  - {name: e, op: embedding, inputs: [c], dim: 4}\n"
                                 "  - {name: s, op: concat, inputs: [x, e]}\n"
                                 "  - {name: w, op: embedding, inputs: [c], dim: 1, sum_fields: true}\n"
                                 "  - {name: f, op: concat, inputs: [s, w]}\n"
                                 "  - {name: n, op: layer_norm, inputs: [f]}\n"
                                 "  - {name: l, op: linear, inputs: [n], width: 1}\n"
                                 "  - {name: loss, op: loss, inputs: [l], loss: squared_error}\n"));
  INFO(g.status().message());
  REQUIRE(g.ok());
  CHECK(Find(*g, "s").rows == 4);
  CHECK(Find(*g, "s").cols == 4);
  CHECK(Find(*g, "w").width() == 1);
  CHECK(Find(*g, "f").rows == 1);
  CHECK(Find(*g, "f").cols == 17);
  CHECK(Find(*g, "n").dense_parameters == 34);
}

TEST_CASE("model graph: a cross_net is DCN-v2's layers as linear, mul and add nodes, full or low rank", "[graph]") {
  // x_0: 4 fields of 3 values beside 5 dense ones, 17 wide.
  auto g = BuildModelGraph(Graph("  - {name: x, op: dense_input, width: 5}\n"
                                 "  - {name: c, op: sparse_input, fields: 4}\n"
                                 "  - {name: e, op: embedding, inputs: [c], dim: 3}\n"
                                 "  - {name: x0, op: concat, inputs: [x, e]}\n"
                                 "  - {name: cross, op: cross_net, inputs: [x0], layers: [0, 2, 0]}\n"
                                 "  - {name: l, op: linear, inputs: [cross], width: 1}\n"
                                 "  - {name: loss, op: loss, inputs: [l], loss: binary_cross_entropy}\n"));
  INFO(g.status().message());
  REQUIRE(g.ok());
  const int w = 17;
  // Layer 0, full rank: x_1 = x_0 * (W x_0 + b) + x_0.
  CHECK(Find(*g, "cross.linear0").cols == w);
  CHECK(Find(*g, "cross.linear0").dense_parameters == w * w + w);
  CHECK(Find(*g, "cross.mul0").op == GraphOp::kMul);
  CHECK(Find(*g, "cross.mul0").width() == w);
  CHECK(Find(*g, "cross.add0").op == GraphOp::kAdd);
  // Layer 1, rank 2: U (V x_1 + c) + b.
  CHECK(Find(*g, "cross.down1").cols == 2);
  CHECK(Find(*g, "cross.down1").dense_parameters == w * 2 + 2);
  CHECK(Find(*g, "cross.up1").cols == w);
  CHECK(Find(*g, "cross.up1").dense_parameters == 2 * w + w);
  // The last layer's sum carries the node's name.
  const GraphNodeInfo& out = Find(*g, "cross");
  CHECK(out.op == GraphOp::kAdd);
  CHECK(out.width() == w);
  CHECK(out.from == "cross");
  CHECK(g->nodes[out.inputs[1]].name == "cross.add1");
  // Each mul reads x_0 and its layer's linear.
  const GraphNodeInfo& mul2 = Find(*g, "cross.mul2");
  CHECK(g->nodes[mul2.inputs[0]].name == "x0");
  CHECK(g->nodes[mul2.inputs[1]].name == "cross.linear2");
  CHECK(Find(*g, "l").dense_parameters == w + 1);
}

TEST_CASE("model graph: a mul takes two inputs of one width, a cross_net one input and layer ranks", "[graph]") {
  const std::string x = "  - {name: x, op: dense_input, width: 4}\n"
                        "  - {name: y, op: linear, inputs: [x], width: 3}\n";
  const std::string tail = "  - {name: loss, op: loss, inputs: [m], loss: squared_error}\n";
  CHECK_THAT(Problems(x + "  - {name: m, op: mul, inputs: [x, y]}\n" + tail),
             Catch::Contains("model.graph[2] 'm': input 'y' has width 3 but 'x' has 4; mul needs equal widths"));
  CHECK_THAT(Problems(x + "  - {name: m, op: mul, inputs: [x, x, x]}\n" + tail),
             Catch::Contains("model.graph[2] 'm'.inputs: mul takes 2 input"));
  CHECK_THAT(Problems(x + "  - {name: m, op: cross_net, inputs: [x, y], layers: [0]}\n" + tail),
             Catch::Contains("model.graph[2] 'm'.inputs: cross_net takes 1 input (x_0), not 2"));
  CHECK_THAT(Problems(x + "  - {name: m, op: cross_net, inputs: [x]}\n" + tail),
             Catch::Contains("model.graph[2] 'm'.layers: a cross_net needs at least one layer"));
  CHECK_THAT(Problems(x + "  - {name: m, op: cross_net, inputs: [x], layers: [0, -1]}\n" + tail),
             Catch::Contains("model.graph[2] 'm'.layers[1]: rank -1 must be 0 (full) to"));
  // Its linear and its mul both read x_0: the problem is said once.
  CHECK(Problems("  - {name: c, op: sparse_input, fields: 2}\n"
                 "  - {name: m, op: cross_net, inputs: [c], layers: [0]}\n" + tail) ==
        "model.graph[1] 'm'.layers[0]: input 'c' is a sparse_input; only an embedding, a cross or a field reads one");
}

TEST_CASE("model graph: a bias node keeps its input's shape with one parameter per column", "[graph]") {
  auto g = BuildModelGraph(Graph("  - {name: c, op: sparse_input, fields: 2}\n"
                                 "  - {name: e, op: embedding, inputs: [c], dim: 3, zero_init: true}\n"
                                 "  - {name: b, op: bias, inputs: [e]}\n"
                                 "  - {name: l, op: linear, inputs: [b], width: 1}\n"
                                 "  - {name: loss, op: loss, inputs: [l], loss: squared_error}\n"));
  INFO(g.status().message());
  REQUIRE(g.ok());
  CHECK(Find(*g, "b").rows == 2);
  CHECK(Find(*g, "b").cols == 3);
  CHECK(Find(*g, "b").dense_parameters == 6);
  CHECK(Find(*g, "e").init_stddev == 0);
  CHECK_THAT(ModelGraphText(*g), Catch::Contains("bias"));
  auto two = BuildModelGraph(Graph("  - {name: x, op: dense_input, width: 2}\n"
                                   "  - {name: b, op: bias, inputs: [x, x]}\n"
                                   "  - {name: loss, op: loss, inputs: [b], loss: squared_error}\n"));
  REQUIRE_FALSE(two.ok());
  CHECK_THAT(std::string(two.status().message()), Catch::Contains("'b'"));
}

TEST_CASE("model graph: pooling fm gives one value per field and refuses sum_fields", "[graph]") {
  auto g = BuildModelGraph(Graph("  - {name: c, op: sparse_input, fields: 3}\n"
                                 "  - {name: f, op: embedding, inputs: [c], dim: 5, pooling: fm}\n"
                                 "  - {name: l, op: linear, inputs: [f], width: 1}\n"
                                 "  - {name: loss, op: loss, inputs: [l], loss: squared_error}\n"));
  INFO(g.status().message());
  REQUIRE(g.ok());
  CHECK(Find(*g, "f").rows == 3);
  CHECK(Find(*g, "f").cols == 1);
  CHECK(g->floats_per_sparse_key() == 5);
  auto bad = BuildModelGraph(Graph("  - {name: c, op: sparse_input, fields: 3}\n"
                                   "  - {name: f, op: embedding, inputs: [c], dim: 5, pooling: fm, sum_fields: true}\n"
                                   "  - {name: g, op: embedding, inputs: [c], dim: 5, pooling: max}\n"
                                   "  - {name: a, op: concat, inputs: [f, g]}\n"
                                   "  - {name: loss, op: loss, inputs: [a], loss: squared_error}\n"));
  REQUIRE_FALSE(bad.ok());
  CHECK_THAT(std::string(bad.status().message()),
             Catch::Contains("sum_fields: not with pooling fm") && Catch::Contains("'max' is not one of: sum, mean, fm"));
}

TEST_CASE("model graph: field selects one field and slice a run of values, each checked against its input",
          "[graph]") {
  auto g = BuildModelGraph(Graph("  - {name: r, op: sparse_input, fields: 2, by_position: true}\n"
                                 "  - {name: i, op: field, inputs: [r], index: 1}\n"
                                 "  - {name: e, op: embedding, inputs: [i], dim: 5}\n"
                                 "  - {name: s, op: slice, inputs: [e], begin: 4, width: 1}\n"
                                 "  - {name: loss, op: loss, inputs: [s], loss: squared_error}\n"));
  INFO(g.status().message());
  REQUIRE(g.ok());
  CHECK(Find(*g, "r").by_position);
  CHECK(Find(*g, "i").fields == 1);
  CHECK(Find(*g, "i").index == 1);
  CHECK(Find(*g, "e").width() == 5);
  CHECK(Find(*g, "s").begin == 4);
  CHECK(Find(*g, "s").width() == 1);
  CHECK_THAT(Problems("  - {name: r, op: sparse_input, fields: 2}\n"
                      "  - {name: i, op: field, inputs: [r], index: 2}\n"
                      "  - {name: e, op: embedding, inputs: [i], dim: 5}\n"
                      "  - {name: s, op: slice, inputs: [e], begin: 3, width: 3}\n"
                      "  - {name: loss, op: loss, inputs: [s], loss: squared_error}\n"),
             Catch::Contains("model.graph[1] 'i': index: 2 is past 'r''s 2 fields") &&
                 Catch::Contains("model.graph[3] 's': values 3 to 5 are past 'e''s 5"));
  CHECK_THAT(Problems("  - {name: r, op: sparse_input, fields: 2}\n"
                      "  - {name: i, op: field, inputs: [r], index: -1}\n"
                      "  - {name: e, op: embedding, inputs: [i], dim: 5}\n"
                      "  - {name: s, op: slice, inputs: [e], begin: -1}\n"
                      "  - {name: loss, op: loss, inputs: [s], loss: squared_error}\n"),
             Catch::Contains("model.graph[1] 'i'.index: -1 must be >= 0") &&
                 Catch::Contains("model.graph[3] 's'.begin: -1 must be >= 0") &&
                 Catch::Contains("model.graph[3] 's'.width: 0 must be 1 to"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: i, op: field, inputs: [x]}\n"
                      "  - {name: e, op: embedding, inputs: [i], dim: 1}\n"
                      "  - {name: loss, op: loss, inputs: [e], loss: squared_error}\n"),
             Catch::Contains("model.graph[1] 'i': input 'x' is a dense_input; a field reads a sparse_input"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: r, op: sparse_input, fields: 2, by_position: true}\n"
                      "  - {name: e, op: embedding, inputs: [r], dim: 4}\n"
                      "  - {name: c, op: concat, inputs: [x, e]}\n"
                      "  - {name: l, op: linear, inputs: [c], width: 1}\n"
                      "  - {name: loss, op: loss, inputs: [l], loss: squared_error}\n"),
             Catch::Contains("a sparse_input by_position takes every key of an example; no dense_input can go beside "
                             "it ('x')"));
}

TEST_CASE("model graph: an mlp's activation layers are named by their layer in errors", "[graph]") {
  const std::string p = Problems("  - {name: x, op: dense_input, width: 4}\n"
                                 "  - {name: unused, op: mlp, inputs: [x], layers: [3, 2]}\n"
                                 "  - {name: l, op: linear, inputs: [x], width: 1}\n"
                                 "  - {name: loss, op: loss, inputs: [l], loss: squared_error}\n");
  CHECK_THAT(p, Catch::Contains("model.graph[1] 'unused'.layers[0]: nothing leads from it to the loss"));
  CHECK_THAT(p, !Catch::Contains("\n: nothing leads") && !Catch::StartsWith(": "));
}

TEST_CASE("model graph: every mistake names its node and field", "[graph]") {
  const std::string tail = "  - {name: loss, op: loss, inputs: [l], loss: binary_cross_entropy}\n";
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: l, op: linear, inputs: [y], width: 1}\n" + tail),
             Catch::Contains("model.graph[1] 'l'.inputs: unknown node 'y'"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: a, op: add, inputs: [x, l]}\n"
                      "  - {name: l, op: linear, inputs: [a], width: 1}\n" + tail),
             Catch::Contains("a cycle runs through 'a', 'l'"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: h, op: linear, inputs: [x], width: 3}\n"
                      "  - {name: a, op: add, inputs: [x, h]}\n"
                      "  - {name: l, op: linear, inputs: [a], width: 1}\n" + tail),
             Catch::Contains("model.graph[2] 'a': input 'h' has width 3 but 'x' has 4; add needs equal widths"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: c, op: sparse_input, fields: 3}\n"
                      "  - {name: e, op: embedding, inputs: [c], dim: 8}\n"
                      "  - {name: d, op: dot_interaction, inputs: [x, e]}\n"
                      "  - {name: l, op: linear, inputs: [d], width: 1}\n" + tail),
             Catch::Contains("model.graph[3] 'd': input 'e' has vectors of width 8 but 'x' has 4"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: l, op: linear, inputs: [x], width: 2}\n" + tail),
             Catch::Contains("input 'l' has width 2; binary_cross_entropy needs width 1"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: l, op: convolution, inputs: [x]}\n" + tail),
             Catch::Contains("model.graph[1] 'l'.op: 'convolution' is not one of: dense_input"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: x, op: linear, inputs: [x], width: 1}\n" + tail),
             Catch::Contains("model.graph[1] 'x'.name: also the name of model.graph[0]"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: l.1, op: linear, inputs: [x], width: 1}\n" + tail),
             Catch::Contains("model.graph[1] 'l.1'.name: '.' and '/' are reserved"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: unused, op: dense_input, width: 4}\n"
                      "  - {name: l, op: linear, inputs: [x], width: 1}\n" + tail),
             Catch::Contains("model.graph[1] 'unused': nothing leads from it to the loss"));
  CHECK_THAT(Problems("  - {name: c, op: sparse_input, fields: 3}\n"
                      "  - {name: l, op: linear, inputs: [c], width: 1}\n" + tail),
             Catch::Contains("model.graph[1] 'l': input 'c' is a sparse_input; only an embedding, a cross or a field reads one"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: e, op: embedding, inputs: [x], dim: 2}\n"
                      "  - {name: l, op: linear, inputs: [e], width: 1}\n" + tail),
             Catch::Contains("input 'x' is a dense_input; an embedding reads a sparse_input"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: k, op: cross, inputs: [x]}\n"
                      "  - {name: e, op: embedding, inputs: [k], dim: 1}\n"
                      "  - {name: l, op: linear, inputs: [e], width: 1}\n" + tail),
             Catch::Contains("model.graph[1] 'k': input 'x' is a dense_input; a cross reads a sparse_input"));
  CHECK_THAT(Problems("  - {name: c, op: sparse_input, fields: 3}\n"
                      "  - {name: k, op: cross, inputs: [c], fields: 4}\n"
                      "  - {name: e, op: embedding, inputs: [k], dim: 1}\n"
                      "  - {name: l, op: linear, inputs: [e], width: 1}\n" + tail),
             Catch::Contains("model.graph[1] 'k': fields: crosses 4 fields; 'c' has 3"));
  CHECK_THAT(Problems("  - {name: c, op: sparse_input, fields: 3}\n"
                      "  - {name: k, op: cross, inputs: [c]}\n"
                      "  - {name: e, op: embedding, inputs: [k], dim: 1, shared: true}\n"
                      "  - {name: l, op: linear, inputs: [e], width: 1}\n" + tail),
             Catch::Contains("model.graph[2] 'e': shared: a cross's keys have no field to share within"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: l, op: mlp, inputs: [x], layers: [8, 0]}\n" + tail),
             Catch::Contains("model.graph[1] 'l'.layers[1].layers: 0 must be 1 to"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: l, op: mlp, inputs: [x], layers: [8, 1], activation: swish}\n" + tail),
             Catch::Contains("model.graph[1] 'l'.activation: 'swish' is not one of: relu, gelu, sigmoid, tanh"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: l, op: linear, inputs: [x, x], width: 1}\n" + tail),
             Catch::Contains("model.graph[1] 'l'.inputs: linear takes 1 input; it names 2"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: l, op: linear, inputs: [x], width: 1}\n"
                      "  - {name: loss, op: loss, inputs: [l]}\n"),
             Catch::Contains("model.graph[2] 'loss'.loss: required"));
  CHECK_THAT(Problems("  - {name: x, op: dense_input, width: 4}\n"
                      "  - {name: l, op: linear, inputs: [x], width: 1}\n"),
             Catch::Contains("needs exactly one loss node; it has 0"));
}

TEST_CASE("model graph: job specs check the graph and its data", "[graph]") {
  v1::JobSpec spec;
  const std::string yaml = std::string("name: g\nmodel:\n  type: graph\n  graph:\n") +
                           "    - {name: x, op: dense_input, width: 4}\n"
                           "    - {name: c, op: sparse_input, fields: 3}\n"
                           "    - {name: e, op: embedding, inputs: [c], dim: 4, pooling: max}\n"
                           "    - {name: d, op: fm, inputs: [x, e]}\n"
                           "    - {name: loss, op: loss, inputs: [d], loss: binary_cross_entropy}\n"
                           "data: {train: {format: csv, path: a.csv}}\nbatch_size: 8\nepochs: 1\n";
  REQUIRE(ParseSpecText(yaml, "test", &spec).ok());
  NormalizeJobSpec(&spec);
  const absl::Status s = ValidateJobSpec(spec);
  CHECK_THAT(std::string(s.message()), Catch::Contains("model.graph[2] 'e'.pooling: 'max' is not one of: sum, mean"));
  CHECK_THAT(std::string(s.message()),
             Catch::Contains("data.train.format: model 'graph' reads sparse features (its sparse_input): use libsvm"));

  // The examples are valid as they stand.
  for (const char* file : {"ctr-dlrm.yaml", "ctr-wide-deep.yaml", "ctr-deepfm.yaml"}) {
    std::ifstream in(std::string(FULCRUM_SOURCE_DIR) + "/deploy/examples/" + file);
    std::stringstream ss;
    ss << in.rdbuf();
    v1::JobSpec ex;
    REQUIRE(ParseSpecText(ss.str(), file, &ex).ok());
    NormalizeJobSpec(&ex);
    INFO(file << ": " << ValidateJobSpec(ex).message());
    CHECK(ValidateJobSpec(ex).ok());
  }
}

}  // namespace
}  // namespace fulcrum::config
