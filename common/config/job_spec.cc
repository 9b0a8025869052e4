#include "common/config/job_spec.h"

#include <cmath>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/reflection.h>

#include "absl/strings/escaping.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "common/table_lifecycle.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_join.h"
#include "common/config/model_graph.h"
#include "common/lr_schedule.h"

namespace fulcrum::config {
namespace {

bool OneOf(const std::string& v, std::initializer_list<const char*> allowed) {
  for (const char* a : allowed) {
    if (v == a) return true;
  }
  return false;
}

std::string Allowed(std::initializer_list<const char*> allowed) {
  return absl::StrJoin(allowed, ", ");
}

// What data a model reads: the sparse built-ins and graphs with a
// sparse_input read sparse rows; other graphs either (a dense_input takes
// the keys below its width from sparse rows), as does a spec without a
// model type (reported elsewhere); every other type dense rows.
struct ModelReads {
  std::string model;
  enum { kDense, kSparse, kAny } reads = kAny;
  const char* why = "";  // appended to "reads sparse features"
};

ModelReads ReadsOf(const v1::ModelSpec& m) {
  ModelReads r{m.type()};
  if (OneOf(m.type(), {"sparse_lr", "fm", "mf"})) {
    r.reads = ModelReads::kSparse;
  } else if (!m.type().empty() && m.type() != "graph") {
    r.reads = ModelReads::kDense;  // softmax, mlp, and an unknown type (refused beside this)
  }
  if (m.type() == "graph") {
    for (const v1::GraphNode& n : m.graph()) {
      if (n.op() == "sparse_input") r = {m.type(), ModelReads::kSparse, " (its sparse_input)"};
    }
  }
  return r;
}

void CheckSource(const v1::DataSource& s, const std::string& path, const ModelReads& model,
                 std::vector<std::string>* p) {
  const bool sparse_format = OneOf(s.format(), {"libsvm", "criteo"});
  if (s.format().empty()) {
    p->push_back(absl::StrCat(path, ".format: required; allowed: idx, libsvm, csv, criteo"));
  } else if (!OneOf(s.format(), {"idx", "libsvm", "csv", "criteo"})) {
    p->push_back(absl::StrCat(path, ".format: '", s.format(), "' is not one of: idx, libsvm, csv, criteo"));
  } else if (model.reads == ModelReads::kSparse && !sparse_format) {
    p->push_back(absl::StrCat(path, ".format: model '", model.model, "' reads sparse features", model.why,
                              ": use libsvm or criteo"));
  } else if (model.reads == ModelReads::kDense && sparse_format) {
    p->push_back(absl::StrCat(path, ".format: model '", model.model, "' reads dense features: use idx or csv"));
  }
  if (s.path().empty()) p->push_back(absl::StrCat(path, ".path: required (a file; relative to the worker's --data_dir)"));
  // Workers confine data paths to their --data_roots; a ".." step or a NUL
  // is refused here already, where the user sees it at submit.
  for (const auto& [field, value] : {std::pair<const char*, const std::string&>{"path", s.path()},
                                     std::pair<const char*, const std::string&>{"labels", s.labels()}}) {
    bool dotdot = false;
    for (absl::string_view part : absl::StrSplit(value, '/')) dotdot |= part == "..";
    if (dotdot || value.find('\0') != std::string::npos || value.size() > 4096) {
      p->push_back(absl::StrCat(path, ".", field, ": '", absl::CHexEscape(value.substr(0, 200)),
                                "' must not contain '..', NUL or more than 4096 characters (paths stay inside "
                                "the workers' data directories)"));
    }
  }
  if (s.format() == "idx" && s.labels().empty()) {
    p->push_back(absl::StrCat(path, ".labels: required for idx (the labels file beside the images)"));
  }
  if (s.format() != "idx" && !s.labels().empty()) {
    p->push_back(absl::StrCat(path, ".labels: only idx data has a separate labels file"));
  }
  if (!(s.scale() >= 0) || !std::isfinite(s.scale())) p->push_back(absl::StrCat(path, ".scale: must be >= 0"));
  if (s.format() == "criteo") {
    if (s.hash_bits() > 32) p->push_back(absl::StrCat(path, ".hash_bits: ", s.hash_bits(), " must be 0 (20) to 32"));
    if (!s.label_kind().empty() && s.label_kind() != "binary") {
      p->push_back(absl::StrCat(path, ".label_kind: criteo labels are binary (0/1)"));
    }
  } else if (s.hash_bits() != 0 || s.raw_integers()) {
    p->push_back(absl::StrCat(path, ".hash_bits, raw_integers: only criteo data hashes its fields"));
  }
  if (!s.label_kind().empty() && !OneOf(s.label_kind(), {"class", "binary", "real"})) {
    p->push_back(absl::StrCat(path, ".label_kind: '", s.label_kind(), "' is not one of: class, binary, real"));
  }
  if (s.has_label_column() && s.format() != "csv") {
    p->push_back(absl::StrCat(path, ".label_column: only csv data has a label column (format is '", s.format(), "')"));
  }
  if (s.label_column() < -1) {
    p->push_back(absl::StrCat(path, ".label_column: ", s.label_column(),
                              " is not a column: columns are counted from 0 (the first), -1 is the last"));
  }
}

// Every enum field of `m` and the messages under it holds one of its
// enum's values: proto3 keeps any number a client sends, and code that
// switches on the value would silently take a default for the rest.
void EnumProblems(const google::protobuf::Message& m, const std::string& prefix, std::vector<std::string>* p) {
  using google::protobuf::FieldDescriptor;
  const google::protobuf::Reflection* r = m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(m, &fields);  // those set (non-default) only
  for (const FieldDescriptor* f : fields) {
    const std::string path = prefix.empty() ? f->name() : absl::StrCat(prefix, ".", f->name());
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (f->is_repeated()) {
        for (int i = 0; i < r->FieldSize(m, f); ++i) {
          EnumProblems(r->GetRepeatedMessage(m, f, i), absl::StrCat(path, "[", i, "]"), p);
        }
      } else {
        EnumProblems(r->GetMessage(m, f), path, p);
      }
      continue;
    }
    if (f->cpp_type() != FieldDescriptor::CPPTYPE_ENUM) continue;
    const google::protobuf::EnumDescriptor* e = f->enum_type();
    auto check = [&](int v, const std::string& where) {
      if (e->FindValueByNumber(v) != nullptr) return;
      // Short names, as specs write them: DTYPE_FP16 is fp16 where the
      // zero value is DTYPE_UNSPECIFIED.
      std::string prefix;
      if (const auto* zero = e->FindValueByNumber(0); zero != nullptr && absl::EndsWith(zero->name(), "UNSPECIFIED")) {
        prefix = zero->name().substr(0, zero->name().size() - std::string("UNSPECIFIED").size());
      }
      std::vector<std::string> names;
      for (int i = 0; i < e->value_count(); ++i) {
        if (e->value(i)->number() == 0) continue;
        absl::string_view name = e->value(i)->name();
        absl::ConsumePrefix(&name, prefix);
        names.push_back(absl::AsciiStrToLower(name));
      }
      p->push_back(absl::StrCat(where, ": ", v, " is not one of: ", absl::StrJoin(names, ", ")));
    };
    if (f->is_repeated()) {
      for (int i = 0; i < r->FieldSize(m, f); ++i) check(r->GetRepeatedEnumValue(m, f, i), absl::StrCat(path, "[", i, "]"));
    } else {
      check(r->GetEnumValue(m, f), path);
    }
  }
}

void CheckUnit(float v, const std::string& path, std::vector<std::string>* p) {
  if (!(v >= 0 && v < 1)) p->push_back(absl::StrCat(path, ": ", v, " must be in [0, 1)"));
}

}  // namespace

std::string DataSummaryLine(const v1::DataSummary& d) {
  return absl::StrCat(d.source(), ": ", d.examples(), " examples, ", d.features(), " features, ", d.label_kind(),
                      " labels", d.label_kind() == "class" ? absl::StrCat(" (", d.classes(), " classes)") : "",
                      d.label_column() >= 0 ? absl::StrCat(" from column ", d.label_column(), " (counted from 0)")
                                            : "");
}

void NormalizeJobSpec(v1::JobSpec* spec) {
  auto lower = [](std::string* s) { absl::AsciiStrToLower(s); };
  lower(spec->mutable_model()->mutable_type());
  lower(spec->mutable_model()->mutable_activation());
  for (v1::GraphNode& n : *spec->mutable_model()->mutable_graph()) {
    for (std::string* w : {n.mutable_op(), n.mutable_activation(), n.mutable_final_activation(), n.mutable_pooling(),
                           n.mutable_loss()}) {
      lower(w);
    }
  }
  // Touching an absent source would create it (has_test means "test data").
  auto source = [&](v1::DataSource* d) {
    lower(d->mutable_format());
    lower(d->mutable_label_kind());
  };
  if (spec->data().has_train()) source(spec->mutable_data()->mutable_train());
  if (spec->data().has_test()) source(spec->mutable_data()->mutable_test());
}

namespace {

void NameProblems(const v1::JobSpec& spec, std::vector<std::string>* out) {
  std::vector<std::string>& p = *out;
  const std::string& name = spec.name();
  if (name.empty()) {
    p.push_back("name: required (lowercase letters, digits and '-', starting with a letter)");
  } else {
    bool ok = name.size() <= 48 && name[0] >= 'a' && name[0] <= 'z';
    for (char c : name) ok = ok && ((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-');
    if (!ok) {
      p.push_back(absl::StrCat("name: '", name,
                               "' must be at most 48 lowercase letters, digits and '-', starting with a letter"));
    }
  }
}

void ModelAndDataProblems(const v1::JobSpec& spec, std::vector<std::string>* out) {
  std::vector<std::string>& p = *out;
  const v1::ModelSpec& m = spec.model();
  const auto kModels = {"softmax", "mlp", "sparse_lr", "fm", "mf", "graph"};
  if (m.type().empty()) {
    p.push_back(absl::StrCat("model.type: required; allowed: ", Allowed(kModels)));
  } else if (!OneOf(m.type(), kModels)) {
    p.push_back(absl::StrCat("model.type: '", m.type(), "' is not one of: ", Allowed(kModels)));
  }
  if (m.type() == "mlp" && m.hidden_size() == 0) {
    p.push_back("model.hidden: mlp needs at least one hidden layer width (softmax has none)");
  }
  if (m.type() != "mlp" && m.hidden_size() > 0) p.push_back(absl::StrCat("model.hidden: only mlp has hidden layers"));
  for (int i = 0; i < m.hidden_size(); ++i) {
    if (m.hidden(i) <= 0 || m.hidden(i) > 65536) p.push_back(absl::StrCat("model.hidden[", i, "]: ", m.hidden(i), " must be 1 to 65536"));
  }
  if (!m.activation().empty() && !OneOf(m.activation(), {"relu", "gelu"})) {
    p.push_back(absl::StrCat("model.activation: '", m.activation(), "' is not one of: relu, gelu"));
  }
  if (m.num_features() < 0) p.push_back("model.num_features: must be >= 0 (0: from the data)");
  if (m.num_classes() == 1 || m.num_classes() < 0 || m.num_classes() > kMaxClasses) {
    p.push_back(absl::StrCat("model.num_classes: ", m.num_classes(), " must be 0 (from the data) or 2 to ", kMaxClasses));
  }
  if (m.factors() < 0 || m.factors() > 4096) p.push_back("model.factors: must be 0 (8) to 4096");
  if (!(m.init_stddev() >= 0)) p.push_back("model.init_stddev: must be >= 0");
  for (const auto& [field, what] : TableLifecycleProblems(m.has_admission() ? &m.admission() : nullptr,
                                                          m.has_eviction() ? &m.eviction() : nullptr,
                                                          m.has_storage() ? &m.storage() : nullptr, 0)) {
    p.push_back(absl::StrCat("model.", field, ": ", what));
  }
  const ModelReads kind = ReadsOf(m);
  if (m.type() == "graph") {
    for (std::string& s : ModelGraphProblems(m)) p.push_back(std::move(s));
  } else if (m.graph_size() > 0) {
    p.push_back(absl::StrCat("model.graph: only a model of type graph has nodes"));
  }
  // data
  if (!spec.data().has_train()) {
    p.push_back("data.train: required (format, path)");
  } else {
    CheckSource(spec.data().train(), "data.train", kind, &p);
  }
  if (spec.data().has_test()) CheckSource(spec.data().test(), "data.test", kind, &p);
  CheckUnit(spec.data().test_fraction(), "data.test_fraction", &p);
  if (spec.data().has_test() && spec.data().test_fraction() > 0) {
    p.push_back("data.test_fraction: give either data.test or a held-out fraction, not both");
  }
}

// A job of user processes (user_workers): the model and data are theirs.
void UserWorkerProblems(const v1::JobSpec& spec, std::vector<std::string>* out) {
  std::vector<std::string>& p = *out;
  if (spec.model().ByteSizeLong() > 0) p.push_back("model: user_workers jobs train the user processes' own model; give none");
  if (spec.data().ByteSizeLong() > 0) p.push_back("data: user_workers jobs read the user processes' own data; give none");
  if (spec.batch_size_auto().enabled()) p.push_back("batch_size: 'auto' is for fulcrum-worker daemons, not user_workers");
  if (spec.precision() != v1::DTYPE_UNSPECIFIED && spec.precision() != v1::DTYPE_FP32) {
    p.push_back("precision: user processes choose their own; give none (or fp32) with user_workers");
  }
  if (spec.max_steps_per_epoch() != 0) p.push_back("max_steps_per_epoch: the user processes decide their steps");
}

void OptimizerProblems(const v1::OptimizerSpec& o, std::vector<std::string>* out) {
  std::vector<std::string>& p = *out;
  if (o.kind() == v1::OptimizerSpec::KIND_UNSPECIFIED) {
    p.push_back("optimizer.kind: required; allowed: sgd, momentum, adagrad, adam, adamw, ftrl");
  }
  if (!(o.learning_rate() > 0) || !std::isfinite(o.learning_rate())) {
    p.push_back(absl::StrCat("optimizer.learning_rate: ", o.learning_rate(), " must be > 0"));
  }
  CheckUnit(o.momentum(), "optimizer.momentum", &p);
  CheckUnit(o.beta1(), "optimizer.beta1", &p);
  CheckUnit(o.beta2(), "optimizer.beta2", &p);
  for (auto [v, f] : {std::pair{o.epsilon(), "epsilon"}, {o.weight_decay(), "weight_decay"},
                      {o.initial_accumulator(), "initial_accumulator"}, {o.l1(), "l1"}, {o.l2(), "l2"},
                      {o.clip_global_norm(), "clip_global_norm"}}) {
    if (!(v >= 0) || !std::isfinite(v)) p.push_back(absl::StrCat("optimizer.", f, ": ", v, " must be >= 0"));
  }
  if (o.momentum() != 0 && o.kind() != v1::OptimizerSpec::MOMENTUM) {
    p.push_back("optimizer.momentum: only the momentum optimizer uses it");
  }
  for (std::string& s : LrScheduleProblems(o.schedule(), o.learning_rate(), "optimizer.schedule")) {
    p.push_back(std::move(s));
  }
}

void ConsistencyProblems(const v1::ConsistencySpec& c, std::vector<std::string>* out) {
  std::vector<std::string>& p = *out;
  if (c.model() == v1::ConsistencySpec::SSP && c.staleness() == 0) {
    p.push_back("consistency.staleness: ssp needs a bound >= 1 (0 is bsp)");
  }
  const bool local = c.model() == v1::ConsistencySpec::LOCAL;
  if (c.model() != v1::ConsistencySpec::SSP && !local && c.staleness() != 0) {
    p.push_back("consistency.staleness: only ssp (in steps) and local (in rounds) have a staleness bound");
  }
  if (c.staleness() > 1000) p.push_back("consistency.staleness: at most 1000");
  if (c.staleness_aware_lr() && c.model() != v1::ConsistencySpec::SSP && c.model() != v1::ConsistencySpec::ASP) {
    p.push_back("consistency.staleness_aware_lr: only ssp and asp apply stale gradients");
  }
  if (local) {
    if (c.sync_every_steps() < 1 || c.sync_every_steps() > 100000) {
      p.push_back(absl::StrCat("consistency.sync_every_steps: ", c.sync_every_steps(),
                               " must be 1 to 100000 (inner steps per round) for local"));
    }
    const v1::OptimizerSpec& in = c.inner_optimizer();
    if (!OneOf(v1::OptimizerSpec::Kind_Name(in.kind()), {"SGD", "MOMENTUM", "ADAM", "ADAMW"})) {
      p.push_back(absl::StrCat("consistency.inner_optimizer.kind: ", absl::AsciiStrToLower(v1::OptimizerSpec::Kind_Name(in.kind())),
                               " does not run on workers; allowed: sgd, momentum, adam, adamw"));
    }
    if (!(in.learning_rate() > 0) || !std::isfinite(in.learning_rate())) {
      p.push_back(absl::StrCat("consistency.inner_optimizer.learning_rate: ", in.learning_rate(),
                               " must be a finite value > 0"));
    }
  } else if (c.sync_every_steps() != 0 || c.has_inner_optimizer() || c.overlap_rounds()) {
    p.push_back("consistency.sync_every_steps, inner_optimizer, overlap_rounds: only the local model has rounds");
  }
}

// The workers' row cache (docs/embeddings.md "The worker's row cache").
void CacheProblems(const v1::JobSpec& spec, std::vector<std::string>* out) {
  if (!spec.has_cache()) return;
  std::vector<std::string>& p = *out;
  const v1::RowCacheSpec& c = spec.cache();
  constexpr uint64_t kMaxCacheRows = uint64_t{1} << 28;
  if (c.rows() < 1 || c.rows() > kMaxCacheRows) {
    p.push_back(absl::StrCat("cache.rows: ", c.rows(), " must be 1 to ", kMaxCacheRows, " (rows per sparse table)"));
  }
  if (spec.user_workers()) {
    p.push_back("cache: a fulcrum-worker daemon's cache; user_workers processes pull through their own client");
  } else if (OneOf(spec.model().type(), {"softmax", "mlp"})) {
    p.push_back(absl::StrCat("cache: model '", spec.model().type(), "' has no sparse tables to cache"));
  }
  const v1::ConsistencySpec& cs = spec.consistency();
  if (cs.model() == v1::ConsistencySpec::SSP && c.max_staleness_steps() > cs.staleness()) {
    p.push_back(absl::StrCat("cache.max_staleness_steps: ", c.max_staleness_steps(),
                             " exceeds consistency.staleness ", cs.staleness(),
                             "; under ssp a cached row may be at most the job's own bound stale"));
  }
  if (c.max_staleness_steps() > 1000) p.push_back("cache.max_staleness_steps: at most 1000");
}

// num_workers, batch_size (or batch_size_auto), epochs and precision.
void ScheduleProblems(const v1::JobSpec& spec, std::vector<std::string>* out) {
  std::vector<std::string>& p = *out;
  if (spec.num_workers() < 1 || spec.num_workers() > kMaxWorkers) {
    p.push_back(absl::StrCat("num_workers: ", spec.num_workers(), " must be 1 to ", kMaxWorkers));
  }
  const v1::AutoBatchSpec& ab = spec.batch_size_auto();
  if (ab.enabled()) {
    if (spec.batch_size() != 0) {
      p.push_back(absl::StrCat("batch_size: ", spec.batch_size(),
                               " is fixed while batch_size_auto.enabled is true; give a number or 'auto', not both"));
    }
  } else if ((spec.batch_size() < 1 && !spec.user_workers()) || spec.batch_size() > 65536) {
    p.push_back(absl::StrCat("batch_size: ", spec.batch_size(),
                             " must be 1 to 65536 (examples per worker per step), or 'auto'"));
  }
  if (ab.base_batch_size() > 65536) {
    p.push_back(absl::StrCat("batch_size_auto.base_batch_size: ", ab.base_batch_size(), " must be 0 (32) to 65536"));
  }
  if (ab.max_batch_size() > 65536 || (ab.max_batch_size() > 0 && ab.max_batch_size() < ab.base_batch_size())) {
    p.push_back(absl::StrCat("batch_size_auto.max_batch_size: ", ab.max_batch_size(),
                             " must be 0 (65536) or from base_batch_size to 65536"));
  }
  if (!(ab.min_gain() >= 0 && ab.min_gain() <= 10)) {
    p.push_back(absl::StrCat("batch_size_auto.min_gain: ", ab.min_gain(), " must be 0 (0.10) to 10"));
  }
  if (!(ab.memory_headroom() >= 0 && ab.memory_headroom() < 0.95)) {
    p.push_back(absl::StrCat("batch_size_auto.memory_headroom: ", ab.memory_headroom(), " must be 0 (0.25) to 0.95"));
  }
  if (ab.warmup_steps() > 10000000) {
    p.push_back(absl::StrCat("batch_size_auto.warmup_steps: ", ab.warmup_steps(), " must be at most 10000000"));
  }
  if ((spec.epochs() < 1 && !spec.user_workers()) || spec.epochs() > 100000) p.push_back(absl::StrCat("epochs: ", spec.epochs(), " must be 1 to 100000"));
  if (spec.checkpoint().keep() > kMaxCheckpointsKept) {
    p.push_back(absl::StrCat("checkpoint.keep: ", spec.checkpoint().keep(), " must be 0 (3) to ", kMaxCheckpointsKept));
  }
  if (spec.run_policy().backoff_limit() > kMaxBackoffLimit) {
    p.push_back(absl::StrCat("run_policy.backoff_limit: ", spec.run_policy().backoff_limit(), " must be 0 (6) to ",
                             kMaxBackoffLimit));
  }
  if (spec.precision() != v1::DTYPE_UNSPECIFIED && spec.precision() != v1::DTYPE_FP32 &&
      !OneOf(spec.model().type(), {"softmax", "mlp", "graph"})) {
    p.push_back(absl::StrCat("precision: model '", spec.model().type(), "' has no GEMMs to run in 16 bits; use fp32"));
  }
}

}  // namespace

std::vector<std::string> JobSpecProblems(const v1::JobSpec& spec) {
  std::vector<std::string> p;
  NameProblems(spec, &p);
  EnumProblems(spec, "", &p);
  if (spec.user_workers()) {
    UserWorkerProblems(spec, &p);
  } else {
    ModelAndDataProblems(spec, &p);
  }
  OptimizerProblems(spec.optimizer(), &p);
  ConsistencyProblems(spec.consistency(), &p);
  ScheduleProblems(spec, &p);
  CacheProblems(spec, &p);
  return p;
}

absl::Status ValidateJobSpec(const v1::JobSpec& spec) {
  std::vector<std::string> p = JobSpecProblems(spec);
  if (p.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("job spec has ", p.size(), p.size() == 1 ? " problem" : " problems",
                                                 ":\n  ", absl::StrJoin(p, "\n  ")));
}

}  // namespace fulcrum::config
