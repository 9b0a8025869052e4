#include "common/config/model_graph.h"

#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/table_lifecycle.h"

namespace fulcrum::config {
namespace {

constexpr int kMaxWidth = 1 << 20;
constexpr int kMaxFields = 4096;
constexpr int kMaxDim = 4096;

struct OpName {
  const char* name;
  GraphOp op;
};
constexpr OpName kOps[] = {
    {"dense_input", GraphOp::kDenseInput}, {"sparse_input", GraphOp::kSparseInput},
    {"embedding", GraphOp::kEmbedding},    {"linear", GraphOp::kLinear},
    {"relu", GraphOp::kRelu},              {"gelu", GraphOp::kGelu},
    {"sigmoid", GraphOp::kSigmoid},        {"tanh", GraphOp::kTanh},
    {"concat", GraphOp::kConcat},          {"add", GraphOp::kAdd},
    {"dot_interaction", GraphOp::kDotInteraction}, {"fm", GraphOp::kFm},
    {"layer_norm", GraphOp::kLayerNorm},   {"loss", GraphOp::kLoss},
    {"cross", GraphOp::kCross},            {"bias", GraphOp::kBias},
    {"field", GraphOp::kField},            {"slice", GraphOp::kSlice},
    {"mul", GraphOp::kMul},
};
constexpr char kAllowedOps[] =
    "dense_input, sparse_input, embedding, linear, mlp, relu, gelu, sigmoid, tanh, concat, add, mul, "
    "dot_interaction, fm, layer_norm, loss, cross, cross_net, bias, field, slice";

bool IsActivation(GraphOp op) {
  return op == GraphOp::kRelu || op == GraphOp::kGelu || op == GraphOp::kSigmoid || op == GraphOp::kTanh;
}

// A node before ordering: its spec, where it came from, its inputs by name.
struct Raw {
  GraphNodeInfo info;
  std::vector<std::string> input_names;
  std::string path;  // "model.graph[2] 'top'"
  const v1::GraphNode* spec = nullptr;
};

bool ParseOp(const std::string& s, GraphOp* op) {
  for (const OpName& o : kOps) {
    if (s == o.name) {
      *op = o.op;
      return true;
    }
  }
  return false;
}

// A cross_net (DCN-v2's cross network) as the nodes it stands for: layer l
// takes x_l (x_0 the input) to x_{l+1} = x_0 * (W_l x_l + b_l) + x_l, W_l
// square (layers[l] 0) or of rank r = layers[l] (W_l = U_l V_l: a linear
// NAME.down<l> to r values, then NAME.up<l> back to the input's width).
void ExpandCrossNet(const v1::GraphNode& n, const std::string& path, std::vector<Raw>* out,
                    std::vector<std::string>* p) {
  if (n.inputs_size() != 1) {
    p->push_back(absl::StrCat(path, ".inputs: cross_net takes 1 input (x_0), not ", n.inputs_size()));
    return;
  }
  if (n.layers_size() == 0) {
    p->push_back(absl::StrCat(path, ".layers: a cross_net needs at least one layer (0: full rank, r: rank r)"));
    return;
  }
  const std::string x0 = n.inputs(0);
  const int L = n.layers_size();
  std::string prev = x0;
  auto node = [&](GraphOp op, std::string name, std::vector<std::string> inputs, int l) {
    Raw r;
    r.path = absl::StrCat(path, ".layers[", l, "]");
    r.spec = &n;
    r.info.op = op;
    r.info.name = std::move(name);
    r.info.from = n.name();
    r.input_names = std::move(inputs);
    out->push_back(std::move(r));
    return &out->back();
  };
  for (int l = 0; l < L; ++l) {
    const int rank = n.layers(l);
    if (rank < 0 || rank > kMaxWidth) {
      p->push_back(absl::StrCat(path, ".layers[", l, "]: rank ", rank, " must be 0 (full) to ", kMaxWidth));
      return;
    }
    std::string in = prev;
    if (rank > 0) {
      Raw* down = node(GraphOp::kLinear, absl::StrCat(n.name(), ".down", l), {in}, l);
      down->info.cols = rank;
      in = down->info.name;
    }
    Raw* lin = node(GraphOp::kLinear, absl::StrCat(n.name(), rank > 0 ? ".up" : ".linear", l), {in}, l);
    lin->info.input_width = rank > 0 ? 2 : 1;
    const std::string lin_name = lin->info.name;
    const std::string mul = absl::StrCat(n.name(), ".mul", l);
    node(GraphOp::kMul, mul, {x0, lin_name}, l);
    const std::string sum = l + 1 == L ? n.name() : absl::StrCat(n.name(), ".add", l);
    node(GraphOp::kAdd, sum, {mul, prev}, l);
    prev = sum;
  }
}

// Expands one spec node (an mlp into its layers, a cross_net into its
// nodes) onto *out.
void Expand(const v1::GraphNode& n, int index, std::vector<Raw>* out, std::vector<std::string>* p) {
  const std::string path = absl::StrCat("model.graph[", index, "] '", n.name(), "'");
  std::vector<std::string> inputs(n.inputs().begin(), n.inputs().end());
  if (n.op() == "cross_net") {
    ExpandCrossNet(n, path, out, p);
    return;
  }
  if (n.op() != "mlp") {
    Raw r;
    r.path = path;
    r.spec = &n;
    r.info.name = n.name();
    r.input_names = std::move(inputs);
    if (!ParseOp(n.op(), &r.info.op)) {
      p->push_back(absl::StrCat(path, ".op: '", n.op(), "' is not one of: ", kAllowedOps));
      return;
    }
    out->push_back(std::move(r));
    return;
  }
  if (n.layers_size() == 0) {
    p->push_back(absl::StrCat(path, ".layers: an mlp needs at least one layer width"));
    return;
  }
  GraphOp act = GraphOp::kRelu, last = GraphOp::kLoss;  // kLoss: none
  if (!n.activation().empty() && (!ParseOp(n.activation(), &act) || !IsActivation(act))) {
    p->push_back(absl::StrCat(path, ".activation: '", n.activation(), "' is not one of: relu, gelu, sigmoid, tanh"));
    return;
  }
  if (!n.final_activation().empty() && n.final_activation() != "none" &&
      (!ParseOp(n.final_activation(), &last) || !IsActivation(last))) {
    p->push_back(absl::StrCat(path, ".final_activation: '", n.final_activation(),
                              "' is not one of: none, relu, gelu, sigmoid, tanh"));
    return;
  }
  const int L = n.layers_size();
  std::string prev_name;
  for (int l = 0; l < L; ++l) {
    const GraphOp a = l + 1 < L ? act : last;
    const bool named_last = l + 1 == L && a == GraphOp::kLoss;
    Raw lin;
    lin.path = absl::StrCat(path, ".layers[", l, "]");
    lin.spec = &n;
    lin.info.op = GraphOp::kLinear;
    lin.info.name = named_last ? n.name() : absl::StrCat(n.name(), ".linear", l);
    lin.info.cols = n.layers(l);
    lin.info.from = n.name();
    lin.input_names = l == 0 ? inputs : std::vector<std::string>{prev_name};
    prev_name = lin.info.name;
    const std::string layer_path = lin.path;
    out->push_back(std::move(lin));
    if (a == GraphOp::kLoss) continue;
    Raw r;
    r.path = layer_path;
    r.spec = &n;
    r.info.op = a;
    r.info.name = l + 1 == L ? n.name() : absl::StrCat(n.name(), ".", GraphOpName(a), l);
    r.info.from = n.name();
    r.input_names = {prev_name};
    prev_name = r.info.name;
    out->push_back(std::move(r));
  }
}

// Reads the op's own fields into r.info, checking their ranges.
void ReadParameters(Raw& r, std::vector<std::string>* p) {
  const v1::GraphNode& s = *r.spec;
  GraphNodeInfo& g = r.info;
  auto bad = [&](const char* field, const std::string& what) { p->push_back(absl::StrCat(r.path, ".", field, ": ", what)); };
  if ((s.has_admission() || s.has_eviction() || s.has_storage()) && g.op != GraphOp::kEmbedding && g.from.empty()) {
    bad(s.has_admission() ? "admission" : s.has_eviction() ? "eviction" : "storage",
        "applies to embedding nodes only (their tables)");
  }
  switch (g.op) {
    case GraphOp::kDenseInput:
      if (s.width() <= 0 || s.width() > kMaxWidth) bad("width", absl::StrCat(s.width(), " must be 1 to ", kMaxWidth));
      g.cols = s.width();
      break;
    case GraphOp::kSparseInput:
      if (s.fields() <= 0 || s.fields() > kMaxFields) bad("fields", absl::StrCat(s.fields(), " must be 1 to ", kMaxFields));
      g.fields = s.fields();
      g.by_position = s.by_position();
      break;
    case GraphOp::kField:
      if (s.index() < 0) bad("index", absl::StrCat(s.index(), " must be >= 0 (fields count from 0)"));
      g.index = s.index();
      g.fields = 1;
      break;
    case GraphOp::kSlice:
      if (s.begin() < 0) bad("begin", absl::StrCat(s.begin(), " must be >= 0 (values count from 0)"));
      if (s.width() <= 0 || s.width() > kMaxWidth) bad("width", absl::StrCat(s.width(), " must be 1 to ", kMaxWidth));
      g.begin = s.begin();
      g.cols = s.width();
      break;
    case GraphOp::kCross:
      if (s.fields() < 0 || s.fields() > kMaxFields) bad("fields", absl::StrCat(s.fields(), " must be 0 (all) to ", kMaxFields));
      g.crossed = s.fields();
      break;
    case GraphOp::kEmbedding:
      if (s.dim() <= 0 || s.dim() > kMaxDim) bad("dim", absl::StrCat(s.dim(), " must be 1 to ", kMaxDim));
      if (!s.pooling().empty() && s.pooling() != "sum" && s.pooling() != "mean" && s.pooling() != "fm") {
        bad("pooling", absl::StrCat("'", s.pooling(), "' is not one of: sum, mean, fm"));
      }
      if (s.pooling() == "fm" && s.sum_fields()) bad("sum_fields", "not with pooling fm (one value per field)");
      if (!(s.init_stddev() >= 0)) bad("init_stddev", "must be >= 0 (0: 0.01)");
      g.dim = s.dim();
      g.mean = s.pooling() == "mean";
      g.fm = s.pooling() == "fm";
      g.shared = s.shared();
      g.sum_fields = s.sum_fields();
      g.init_stddev = s.zero_init() ? 0.0f : s.init_stddev() > 0 ? s.init_stddev() : 0.01f;
      for (const auto& [field, what] : TableLifecycleProblems(s.has_admission() ? &s.admission() : nullptr,
                                                              s.has_eviction() ? &s.eviction() : nullptr,
                                                              s.has_storage() ? &s.storage() : nullptr, 0)) {
        bad(field.c_str(), what);
      }
      if (s.has_admission()) *g.lifecycle.mutable_admission() = s.admission();
      if (s.has_eviction()) *g.lifecycle.mutable_eviction() = s.eviction();
      if (s.has_storage()) *g.lifecycle.mutable_storage() = s.storage();
      break;
    case GraphOp::kLinear:
      if (g.from.empty()) g.cols = s.width();
      if (g.input_width > 0) break;  // an input's width, set with the shapes
      if (g.cols <= 0 || g.cols > kMaxWidth) {
        bad(g.from.empty() ? "width" : "layers", absl::StrCat(g.cols, " must be 1 to ", kMaxWidth));
      }
      break;
    case GraphOp::kLayerNorm:
      if (!(s.epsilon() >= 0)) bad("epsilon", "must be >= 0 (0: 1e-5)");
      g.epsilon = s.epsilon() > 0 ? s.epsilon() : 1e-5f;
      break;
    case GraphOp::kLoss:
      if (s.loss() == "softmax_cross_entropy") {
        g.loss = GraphLoss::kSoftmaxCrossEntropy;
      } else if (s.loss() == "binary_cross_entropy") {
        g.loss = GraphLoss::kBinaryCrossEntropy;
      } else if (s.loss() == "squared_error") {
        g.loss = GraphLoss::kSquaredError;
      } else {
        bad("loss", absl::StrCat(s.loss().empty() ? "required" : absl::StrCat("'", s.loss(), "' is not one of"),
                                 "; allowed: softmax_cross_entropy, binary_cross_entropy, squared_error"));
      }
      break;
    default:
      break;
  }
}

// How many inputs an op takes: [min, max] (max -1: any).
std::pair<int, int> Arity(GraphOp op) {
  switch (op) {
    case GraphOp::kDenseInput:
    case GraphOp::kSparseInput: return {0, 0};
    case GraphOp::kCross:
    case GraphOp::kField: return {1, 1};
    case GraphOp::kConcat:
    case GraphOp::kAdd: return {2, -1};
    case GraphOp::kMul: return {2, 2};
    case GraphOp::kDotInteraction:
    case GraphOp::kFm: return {1, -1};
    default: return {1, 1};
  }
}

using Bad = std::function<void(const std::string&)>;
using InputOf = std::function<const GraphNodeInfo&(size_t)>;

void ConcatShape(GraphNodeInfo& g, const InputOf& in, const Bad& bad) {
  bool same = true;
  int64_t rows = 0, width = 0;
  for (size_t k = 0; k < g.inputs.size(); ++k) {
    same = same && in(k).cols == in(0).cols;
    rows += in(k).rows;
    width += in(k).width();
  }
  if (width > kMaxWidth) {
    bad(absl::StrCat("concatenated width ", width, " is over ", kMaxWidth));
    return;
  }
  g.rows = same ? static_cast<int>(rows) : 1;
  g.cols = same ? in(0).cols : static_cast<int>(width);
}

// add and mul: inputs of one width.
void AddShape(GraphNodeInfo& g, const InputOf& in, const Bad& bad) {
  for (size_t k = 1; k < g.inputs.size(); ++k) {
    if (in(k).width() != in(0).width()) {
      bad(absl::StrCat("input '", in(k).name, "' has width ", in(k).width(), " but '", in(0).name, "' has ",
                       in(0).width(), "; ", GraphOpName(g.op), " needs equal widths"));
      return;
    }
  }
  g.rows = in(0).rows;
  g.cols = in(0).cols;
}

// dot_interaction and fm: the inputs' vectors, all of one width.
void InteractionShape(GraphNodeInfo& g, const InputOf& in, const Bad& bad) {
  int64_t n = 0;
  for (size_t k = 0; k < g.inputs.size(); ++k) {
    if (in(k).cols != in(0).cols) {
      bad(absl::StrCat("input '", in(k).name, "' has vectors of width ", in(k).cols, " but '", in(0).name, "' has ",
                       in(0).cols, "; ", GraphOpName(g.op), " needs vectors of one width"));
      return;
    }
    n += in(k).rows;
  }
  if (n < 2) {
    bad(absl::StrCat(GraphOpName(g.op), " needs at least 2 vectors per example; its inputs give ", n));
    return;
  }
  if (n * (n - 1) / 2 > kMaxWidth) {
    bad(absl::StrCat(GraphOpName(g.op), " of ", n, " vectors gives ", n * (n - 1) / 2, " pairs, over ", kMaxWidth));
    return;
  }
  g.fields = static_cast<int>(n);  // the vectors it interacts
  g.rows = 1;
  g.cols = g.op == GraphOp::kFm ? 1 : static_cast<int>(n * (n - 1) / 2);
}

void LossShape(GraphNodeInfo& g, const InputOf& in, const Bad& bad) {
  const int64_t w = in(0).width();
  if (g.loss == GraphLoss::kSoftmaxCrossEntropy && w < 2) {
    bad(absl::StrCat("input '", in(0).name, "' has width ", w,
                     "; softmax_cross_entropy needs one logit per class (at least 2)"));
  } else if (g.loss != GraphLoss::kSoftmaxCrossEntropy && w != 1) {
    bad(absl::StrCat("input '", in(0).name, "' has width ", w, "; ",
                     g.loss == GraphLoss::kBinaryCrossEntropy ? "binary_cross_entropy" : "squared_error",
                     " needs width 1"));
  }
  g.rows = 1;
  g.cols = 1;
}

// Whether g's inputs are of kinds it can read (reported otherwise), and
// shaped (an input without a shape has its own problem reported).
bool InputsReadable(const GraphNodeInfo& g, const std::vector<GraphNodeInfo>& nodes, const Bad& bad) {
  for (int k : g.inputs) {
    const GraphNodeInfo& in = nodes[k];
    if (in.op == GraphOp::kLoss) {
      bad(absl::StrCat("input '", in.name, "' is the loss; nothing reads a loss"));
      return false;
    }
    const bool reads_fields = g.op == GraphOp::kEmbedding || g.op == GraphOp::kCross || g.op == GraphOp::kField;
    const bool from_input = g.op == GraphOp::kCross || g.op == GraphOp::kField;  // reads a sparse_input only
    if (IsSparseSource(in.op) != reads_fields || (from_input && in.op != GraphOp::kSparseInput)) {
      bad(from_input ? absl::StrCat("input '", in.name, "' is a ", GraphOpName(in.op), "; a ", GraphOpName(g.op),
                                    " reads a sparse_input")
          : reads_fields ? absl::StrCat("input '", in.name, "' is a ", GraphOpName(in.op),
                                        "; an embedding reads a sparse_input, a cross or a field")
                         : absl::StrCat("input '", in.name, "' is a ", GraphOpName(in.op),
                                        "; only an embedding, a cross or a field reads one"));
      return false;
    }
    if (g.op == GraphOp::kEmbedding && g.shared && in.op == GraphOp::kCross) {
      bad(absl::StrCat("shared: a cross's keys have no field to share within; input '", in.name, "' is a cross"));
      return false;
    }
    if (in.cols == 0 && !IsSparseSource(in.op)) return false;
  }
  return true;
}

// Infers node g's shape from its inputs (already inferred).
void InferShape(const Raw& r, std::vector<GraphNodeInfo>& nodes, GraphNodeInfo& g, std::vector<std::string>* p) {
  const Bad bad = [&](const std::string& what) { p->push_back(absl::StrCat(r.path, ": ", what)); };
  if (!InputsReadable(g, nodes, bad)) return;
  const InputOf in = [&](size_t k) -> const GraphNodeInfo& { return nodes[g.inputs[k]]; };
  switch (g.op) {
    case GraphOp::kDenseInput:
    case GraphOp::kSparseInput:
      break;
    case GraphOp::kCross: {
      const int k = g.crossed == 0 ? in(0).fields : g.crossed;
      if (k < 2 || k > in(0).fields) {
        bad(absl::StrCat("fields: crosses ", k, " fields; '", in(0).name, "' has ", in(0).fields,
                         " (give 2 to its count, or 0 for all)"));
        return;
      }
      g.crossed = k;
      g.fields = k * (k - 1) / 2;
      break;
    }
    case GraphOp::kField:
      if (g.index >= in(0).fields) {
        bad(absl::StrCat("index: ", g.index, " is past '", in(0).name, "''s ", in(0).fields,
                         " fields (they count from 0)"));
      }
      break;
    case GraphOp::kSlice:
      if (int64_t{g.begin} + g.cols > in(0).width()) {
        bad(absl::StrCat("values ", g.begin, " to ", g.begin + g.cols - 1, " are past '", in(0).name, "''s ",
                         in(0).width(), " (begin and width count from 0)"));
      }
      break;
    case GraphOp::kEmbedding:
      g.rows = g.sum_fields ? 1 : in(0).fields;
      g.cols = g.fm ? 1 : g.dim;
      g.fields = in(0).fields;
      if (g.width() > kMaxWidth) {
        bad(absl::StrCat(g.rows, " fields x dim ", g.dim, " = ", g.width(), " values per example, over ", kMaxWidth));
      }
      break;
    case GraphOp::kLinear:
      if (g.input_width > 0) {
        const GraphNodeInfo* src = &in(0);
        for (int h = 1; h < g.input_width && !src->inputs.empty(); ++h) src = &nodes[src->inputs[0]];
        if (src->width() <= 0 || src->width() > kMaxWidth) {
          bad(absl::StrCat("'", src->name, "' has width ", src->width(), "; a cross_net needs 1 to ", kMaxWidth));
          break;
        }
        g.cols = static_cast<int>(src->width());
      }
      if (g.cols > 0) g.dense_parameters = in(0).width() * g.cols + g.cols;
      if (g.dense_parameters > (int64_t{1} << 31)) bad(absl::StrCat(in(0).width(), " x ", g.cols, " weights, over 2^31"));
      break;
    case GraphOp::kRelu:
    case GraphOp::kGelu:
    case GraphOp::kSigmoid:
    case GraphOp::kTanh:
    case GraphOp::kLayerNorm:
    case GraphOp::kBias:
      g.rows = in(0).rows;
      g.cols = in(0).cols;
      if (g.op == GraphOp::kLayerNorm) g.dense_parameters = 2 * g.width();
      if (g.op == GraphOp::kBias) g.dense_parameters = g.width();
      break;
    case GraphOp::kConcat: ConcatShape(g, in, bad); break;
    case GraphOp::kAdd:
    case GraphOp::kMul: AddShape(g, in, bad); break;
    case GraphOp::kDotInteraction:
    case GraphOp::kFm: InteractionShape(g, in, bad); break;
    case GraphOp::kLoss: LossShape(g, in, bad); break;
  }
}

}  // namespace

const char* GraphOpName(GraphOp op) {
  for (const OpName& o : kOps) {
    if (o.op == op) return o.name;
  }
  return "?";
}

int64_t ModelGraph::dense_parameters() const {
  int64_t n = 0;
  for (const GraphNodeInfo& g : nodes) n += g.dense_parameters;
  return n;
}

int64_t ModelGraph::floats_per_sparse_key() const {
  int64_t n = 0;
  for (const GraphNodeInfo& g : nodes) n += g.op == GraphOp::kEmbedding ? g.dim : 0;
  return n;
}

namespace {

// The spec's nodes, mlp shorthands expanded, each name unique.
void ExpandAll(const v1::ModelSpec& model, std::vector<Raw>* raw, std::vector<std::string>* p) {
  std::map<std::string, int> by_name;
  for (int i = 0; i < model.graph_size(); ++i) {
    const v1::GraphNode& n = model.graph(i);
    const std::string path = absl::StrCat("model.graph[", i, "]");
    if (n.name().empty()) {
      p->push_back(absl::StrCat(path, ".name: required"));
    } else if (n.name().find_first_of("./") != std::string::npos) {
      p->push_back(absl::StrCat(path, " '", n.name(),
                                "'.name: '.' and '/' are reserved ('.' joins an mlp's or cross_net's name and its nodes')"));
    } else if (!by_name.emplace(n.name(), i).second) {
      p->push_back(absl::StrCat(path, " '", n.name(), "'.name: also the name of model.graph[", by_name[n.name()], "]"));
    } else {
      Expand(n, i, raw, p);
    }
  }
}

// Reads each node's parameters and resolves its inputs: in[i] the nodes i
// reads, readers[i] the nodes that read i.
void Resolve(std::vector<Raw>& raw, std::vector<std::vector<int>>* in, std::vector<std::vector<int>>* readers,
             std::vector<std::string>* p) {
  std::map<std::string, int> by_name;
  for (size_t i = 0; i < raw.size(); ++i) by_name[raw[i].info.name] = static_cast<int>(i);
  in->assign(raw.size(), {});
  readers->assign(raw.size(), {});
  for (size_t i = 0; i < raw.size(); ++i) {
    Raw& r = raw[i];
    ReadParameters(r, p);
    const auto [lo, hi] = Arity(r.info.op);
    const int n = static_cast<int>(r.input_names.size());
    if (n < lo || (hi >= 0 && n > hi)) {
      p->push_back(absl::StrCat(
          r.path, ".inputs: ", GraphOpName(r.info.op), " takes ",
          hi == 0 ? "no inputs" : hi == lo ? absl::StrCat(lo, " input") : absl::StrCat(lo, " or more inputs"),
          "; it names ", n));
      continue;
    }
    for (const std::string& name : r.input_names) {
      auto it = by_name.find(name);
      if (it == by_name.end()) {
        p->push_back(absl::StrCat(r.path, ".inputs: unknown node '", name, "'"));
      } else {
        (*in)[i].push_back(it->second);
        (*readers)[it->second].push_back(static_cast<int>(i));
      }
    }
  }
}

// Kahn's algorithm, the earliest listed first among the ready nodes; a
// cycle is reported with its nodes.
std::vector<int> Order(const std::vector<Raw>& raw, const std::vector<std::vector<int>>& in,
                       const std::vector<std::vector<int>>& readers, std::vector<std::string>* p) {
  std::vector<int> pending(raw.size()), order;
  std::set<int> ready;
  for (size_t i = 0; i < raw.size(); ++i) {
    pending[i] = static_cast<int>(in[i].size());
    if (pending[i] == 0) ready.insert(static_cast<int>(i));
  }
  while (!ready.empty()) {
    const int i = *ready.begin();
    ready.erase(ready.begin());
    order.push_back(i);
    for (int r : readers[i]) {
      if (--pending[r] == 0) ready.insert(r);
    }
  }
  if (order.size() != raw.size()) {
    std::vector<std::string> cycle;
    for (size_t i = 0; i < raw.size(); ++i) {
      if (pending[i] > 0) cycle.push_back(absl::StrCat("'", raw[i].info.name, "'"));
    }
    p->push_back(absl::StrCat("model.graph: a cycle runs through ", absl::StrJoin(cycle, ", "),
                              "; a graph's inputs must come before the nodes that read them"));
  }
  return order;
}

// Which nodes lead to the loss (exactly one loss is required).
std::vector<bool> UsedByLoss(const std::vector<Raw>& raw, const std::vector<std::vector<int>>& in,
                             const std::vector<int>& order, std::vector<std::string>* p) {
  std::vector<int> losses;
  for (size_t i = 0; i < raw.size(); ++i) {
    if (raw[i].info.op == GraphOp::kLoss) losses.push_back(static_cast<int>(i));
  }
  std::vector<bool> used(raw.size(), false);
  if (losses.size() != 1) {
    p->push_back(absl::StrCat("model.graph: needs exactly one loss node; it has ", losses.size()));
    return used;
  }
  used[losses[0]] = true;
  for (auto it = order.rbegin(); it != order.rend(); ++it) {
    if (!used[*it]) continue;
    for (int k : in[*it]) used[k] = true;
  }
  return used;
}

// The nodes in `order`, inputs renumbered to positions in it.
ModelGraph Assemble(const std::vector<Raw>& raw, const std::vector<std::vector<int>>& in,
                    const std::vector<int>& order, const std::vector<bool>& used, std::vector<std::string>* p) {
  ModelGraph g;
  std::string sparse_path;
  std::vector<int> position(raw.size());
  for (size_t k = 0; k < order.size(); ++k) position[order[k]] = static_cast<int>(k);
  for (int i : order) {
    const Raw& r = raw[i];
    if (!used[i]) {
      p->push_back(absl::StrCat(r.path, ": nothing leads from it to the loss"));
      continue;
    }
    if (r.info.op == GraphOp::kDenseInput || r.info.op == GraphOp::kSparseInput) {
      int& slot = r.info.op == GraphOp::kDenseInput ? g.dense_input : g.sparse_input;
      if (slot >= 0) {
        p->push_back(absl::StrCat(r.path, ": a graph has at most one ", GraphOpName(r.info.op), "; '",
                                  g.nodes[slot].name, "' is one"));
        continue;
      }
      slot = static_cast<int>(g.nodes.size());
      if (r.info.op == GraphOp::kSparseInput) sparse_path = r.path;
    }
    GraphNodeInfo info = r.info;
    for (int k : in[i]) info.inputs.push_back(position[k]);
    g.nodes.push_back(std::move(info));
  }
  if (g.sparse_input >= 0 && g.nodes[g.sparse_input].by_position && g.dense_input >= 0) {
    p->push_back(absl::StrCat(sparse_path, ": a sparse_input by_position takes every key of an example; no ",
                              "dense_input can go beside it ('", g.nodes[g.dense_input].name, "')"));
  }
  return g;
}

std::optional<ModelGraph> BuildStages(const v1::ModelSpec& model, std::vector<std::string>* p);

// The graph, or nullopt with every problem found on *p (each stage runs
// only when the ones before it found none), each said once: the nodes a
// shorthand expands to can share one (a cross_net's linear and mul both
// read x_0).
std::optional<ModelGraph> Build(const v1::ModelSpec& model, std::vector<std::string>* p) {
  std::optional<ModelGraph> g = BuildStages(model, p);
  std::set<std::string> seen;
  p->erase(std::remove_if(p->begin(), p->end(), [&](const std::string& s) { return !seen.insert(s).second; }),
           p->end());
  return g;
}

std::optional<ModelGraph> BuildStages(const v1::ModelSpec& model, std::vector<std::string>* p) {
  if (model.graph_size() == 0) {
    p->push_back("model.graph: a graph model needs nodes (docs/compute.md, \"Model graphs\")");
    return std::nullopt;
  }
  std::vector<Raw> raw;
  ExpandAll(model, &raw, p);
  if (!p->empty()) return std::nullopt;
  std::vector<std::vector<int>> in, readers;
  Resolve(raw, &in, &readers, p);
  if (!p->empty()) return std::nullopt;
  const std::vector<int> order = Order(raw, in, readers, p);
  if (!p->empty()) return std::nullopt;
  const std::vector<bool> used = UsedByLoss(raw, in, order, p);
  if (!p->empty()) return std::nullopt;
  ModelGraph g = Assemble(raw, in, order, used, p);
  if (!p->empty()) return std::nullopt;
  for (size_t k = 0; k < g.nodes.size(); ++k) InferShape(raw[order[k]], g.nodes, g.nodes[k], p);
  if (!p->empty()) return std::nullopt;
  return g;
}

}  // namespace

absl::StatusOr<ModelGraph> BuildModelGraph(const v1::ModelSpec& model) {
  std::vector<std::string> p;
  std::optional<ModelGraph> g = Build(model, &p);
  if (!g) return absl::InvalidArgumentError(absl::StrJoin(p, "\n"));
  return *std::move(g);
}

std::vector<std::string> ModelGraphProblems(const v1::ModelSpec& model) {
  std::vector<std::string> p;
  Build(model, &p);
  return p;
}

absl::StatusOr<v1::ModelSpec> PresetGraph(const v1::ModelSpec& model, int num_features, int num_classes) {
  if (model.type() != "softmax" && model.type() != "mlp" && model.type() != "sparse_lr" && model.type() != "fm" &&
      model.type() != "mf") {
    return absl::InvalidArgumentError(absl::StrCat("model type '", model.type(), "' is not a built-in type"));
  }
  v1::ModelSpec out;
  out.set_type("graph");
  auto add = [&](const std::string& name, const std::string& op, const std::string& input) {
    v1::GraphNode* n = out.add_graph();
    n->set_name(name);
    n->set_op(op);
    if (!input.empty()) n->add_inputs(input);
    // The model's admission, eviction and storage hold for each of its tables.
    if (op == "embedding" && model.has_admission()) *n->mutable_admission() = model.admission();
    if (op == "embedding" && model.has_eviction()) *n->mutable_eviction() = model.eviction();
    if (op == "embedding" && model.has_storage()) *n->mutable_storage() = model.storage();
    return n;
  };
  if (model.type() == "mf") {
    // A rating's two keys by position; each row the k factors, then the
    // bias: prediction = <user factors, item factors> + user bias + item
    // bias + global bias, under squared error.
    const int k = model.factors() > 0 ? model.factors() : 8;
    add("rating", "sparse_input", "")->set_fields(2);
    out.mutable_graph(0)->set_by_position(true);
    for (const char* side : {"user", "item"}) {
      const std::string key = absl::StrCat(side, "_key");
      add(key, "field", "rating")->set_index(std::string(side) == "user" ? 0 : 1);
      v1::GraphNode* e = add(side, "embedding", key);
      e->set_dim(k + 1);
      e->set_init_stddev(model.init_stddev());
      v1::GraphNode* f = add(absl::StrCat(side, "_factors"), "slice", side);
      f->set_width(k);
      v1::GraphNode* b = add(absl::StrCat(side, "_bias"), "slice", side);
      b->set_begin(k);
      b->set_width(1);
    }
    add("dot", "dot_interaction", "user_factors")->add_inputs("item_factors");
    v1::GraphNode* sum = add("sum", "add", "dot");
    sum->add_inputs("user_bias");
    sum->add_inputs("item_bias");
    add("global_bias", "bias", "sum");
    add("loss", "loss", "global_bias")->set_loss("squared_error");
    return out;
  }
  if (model.type() == "sparse_lr" || model.type() == "fm") {
    // One field holding all of an example's features (LibSVM), a weight per
    // feature (summed, scaled by the features' values) and a bias; fm adds
    // the second-order term over the features' factor vectors.
    add("features", "sparse_input", "")->set_fields(1);
    v1::GraphNode* linear = add("linear", "embedding", "features");
    linear->set_dim(1);
    linear->set_zero_init(true);
    add("bias", "bias", "linear");
    std::string logit = "bias";
    if (model.type() == "fm") {
      v1::GraphNode* factors = add("factors", "embedding", "features");
      factors->set_dim(model.factors() > 0 ? model.factors() : 8);
      factors->set_pooling("fm");
      factors->set_init_stddev(model.init_stddev());
      v1::GraphNode* sum = add("logit", "add", "bias");
      sum->add_inputs("factors");
      logit = "logit";
    }
    add("loss", "loss", logit)->set_loss("binary_cross_entropy");
    return out;
  }
  add("features", "dense_input", "")->set_width(num_features);
  std::vector<int> widths(model.hidden().begin(), model.type() == "mlp" ? model.hidden().end() : model.hidden().begin());
  widths.push_back(num_classes);
  const std::string act = model.activation().empty() ? "relu" : model.activation();
  std::string prev = "features";
  for (size_t l = 0; l < widths.size(); ++l) {
    add(absl::StrCat("dense", l), "linear", prev)->set_width(widths[l]);
    prev = absl::StrCat("dense", l);
    if (l + 1 == widths.size()) break;
    add(absl::StrCat(act, l), act, prev);
    prev = absl::StrCat(act, l);
  }
  add("loss", "loss", prev)->set_loss("softmax_cross_entropy");
  return out;
}

std::string ModelGraphText(const ModelGraph& graph) {
  std::string out = absl::StrFormat("%-22s %-16s %-28s %-12s %s\n", "node", "op", "inputs", "shape", "parameters");
  for (const GraphNodeInfo& g : graph.nodes) {
    std::vector<std::string> ins;
    for (int k : g.inputs) ins.push_back(graph.nodes[k].name);
    std::string shape = IsSparseSource(g.op) ? absl::StrCat(g.fields, " fields")
                        : g.rows == 1                  ? absl::StrCat(g.cols)
                                                       : absl::StrCat(g.rows, "x", g.cols);
    std::string params = g.op == GraphOp::kEmbedding ? absl::StrCat(g.dim, " per key") : absl::StrCat(g.dense_parameters);
    out += absl::StrFormat("%-22s %-16s %-28s %-12s %s\n", g.name, GraphOpName(g.op),
                           ins.empty() ? "-" : absl::StrJoin(ins, ","), shape, params);
  }
  // Each embedding is a table of its own: a key holds its dim there.
  std::vector<std::string> tables;
  for (const GraphNodeInfo& g : graph.nodes) {
    if (g.op == GraphOp::kEmbedding) tables.push_back(absl::StrCat(g.name, " ", g.dim));
  }
  out += absl::StrCat("dense parameters: ", graph.dense_parameters(), " (", graph.dense_parameters() * 4 / 1024,
                      " KiB); sparse floats per key: ", tables.empty() ? "none" : absl::StrJoin(tables, ", "),
                      ", optimizer state aside\n");
  return out;
}

}  // namespace fulcrum::config
