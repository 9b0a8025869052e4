// Job and table specs for tests and benchmarks (no Catch2 here, so tools
// like fulcrum-load-test link them without a test runner).
#include "tests/testing/test_util.h"

namespace fulcrum::testing {

v1::TableSpec DenseTableSpec(const std::string& name, int64_t elements, float lr,
                             v1::OptimizerSpec::Kind kind, uint32_t chunk_elements) {
  v1::TableSpec t;
  t.set_name(name);
  t.set_kind(v1::TableSpec::DENSE);
  t.add_shape(elements);
  t.set_chunk_elements(chunk_elements);
  t.mutable_optimizer()->set_kind(kind);
  t.mutable_optimizer()->set_learning_rate(lr);
  return t;
}

v1::TableSpec SparseTableSpec(const std::string& name, uint32_t dim, float lr,
                              v1::OptimizerSpec::Kind kind) {
  v1::TableSpec t;
  t.set_name(name);
  t.set_kind(v1::TableSpec::SPARSE);
  t.set_dim(dim);
  t.mutable_optimizer()->set_kind(kind);
  t.mutable_optimizer()->set_learning_rate(lr);
  return t;
}

v1::PsJobSpec JobSpec(const std::string& id, std::vector<v1::TableSpec> tables,
                      uint32_t num_workers, v1::ConsistencySpec::Model model, uint32_t staleness) {
  v1::PsJobSpec spec;
  spec.set_job_id(id);
  for (auto& t : tables) *spec.add_tables() = std::move(t);
  spec.set_num_workers(num_workers);
  spec.mutable_consistency()->set_model(model);
  spec.mutable_consistency()->set_staleness(staleness);
  return spec;
}

}  // namespace fulcrum::testing
