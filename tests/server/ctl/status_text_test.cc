// What fulcrumctl shows of a job's figures: accuracy for classes, AUC and
// log loss for binary tasks, RMSE (not half the MSE) for regression.
#include "server/ctl/status_text.h"

#include <string>

#include <catch2/catch.hpp>

#include "common/logging.h"

namespace fulcrum::ctl {
namespace {

v1::Job JobOf(const std::string& model, const std::string& label_kind = "") {
  v1::Job j;
  j.set_id("j-1");
  j.mutable_spec()->mutable_model()->set_type(model);
  j.mutable_spec()->set_epochs(2);
  if (!label_kind.empty()) j.mutable_spec()->mutable_data()->mutable_train()->set_label_kind(label_kind);
  j.mutable_status()->set_state(v1::SUCCEEDED);
  return j;
}

v1::EpochSummary* AddEpoch(v1::Job& j) {
  v1::EpochSummary* e = j.mutable_status()->add_epochs();
  e->set_epoch(j.status().epochs_size() - 1);
  e->set_tested(true);
  return e;
}

TEST_CASE("regression jobs show RMSE, binary jobs AUC and log loss, class jobs accuracy", "[ctl]") {
  v1::Job mf = JobOf("mf");
  mf.mutable_status()->set_test_rmse(0.9123);
  mf.mutable_status()->set_loss(0.5);  // half the MSE: RMSE 1
  AddEpoch(mf)->set_test_rmse(0.9123);
  CHECK(TaskOf(mf) == Task::kRegression);
  CHECK(FinalFigures(mf) == "test RMSE 0.9123");
  const std::string mf_line = JobLine(mf);
  INFO(mf_line);
  CHECK(mf_line.find(" rmse 1.0000 test_rmse 0.9123") != std::string::npos);
  CHECK(mf_line.find("acc") == std::string::npos);

  // A graph under squared error is regression too.
  v1::Job graph = JobOf("graph");
  v1::GraphNode* loss = graph.mutable_spec()->mutable_model()->add_graph();
  loss->set_op("loss");
  loss->set_loss("squared_error");
  CHECK(TaskOf(graph) == Task::kRegression);
  loss->set_loss("binary_cross_entropy");
  CHECK(TaskOf(graph) == Task::kBinary);

  v1::Job ctr = JobOf("fm");
  ctr.mutable_status()->set_test_auc(0.8012);
  ctr.mutable_status()->set_test_loss(0.4512);
  ctr.mutable_status()->set_test_accuracy(0.8678);
  ctr.mutable_status()->set_loss(0.47);
  v1::EpochSummary* e = AddEpoch(ctr);
  e->set_test_auc(0.8012);
  e->set_test_loss(0.4512);
  CHECK(TaskOf(ctr) == Task::kBinary);
  CHECK(FinalFigures(ctr) == "test AUC 0.8012, log loss 0.4512");
  CHECK(JobLine(ctr).find(" logloss 0.4700 test_auc 0.8012 test_logloss 0.4512") != std::string::npos);
  CHECK(JobLine(ctr).find("prog_auc") == std::string::npos);  // no window reported yet
  ctr.mutable_status()->set_progressive_auc(0.7931);
  ctr.mutable_status()->set_progressive_log_loss(0.4602);
  ctr.mutable_status()->set_progressive_examples(1 << 20);
  CHECK(JobLine(ctr).find(" test_logloss 0.4512 prog_auc 0.7931 prog_logloss 0.4602") != std::string::npos);
  CHECK(TaskOf(JobOf("graph", "binary")) == Task::kBinary);

  v1::Job digits = JobOf("softmax");
  digits.mutable_status()->set_test_accuracy(0.9781);
  CHECK(TaskOf(digits) == Task::kClasses);
  CHECK(FinalFigures(digits) == "test accuracy 0.9781");
}

TEST_CASE("a sparse table's line shows its rows, bytes and lifecycle counts", "[ctl]") {
  v1::SparseTableStats t;
  t.set_table("emb");
  t.set_rows(1200);
  t.set_bytes(3 << 20);
  CHECK(SparseTableLine(t) == "  table emb: 1200 rows, " + fulcrum::HumanBytes(3 << 20));
  t.set_admitted(5000);
  t.set_rejected(2300);
  t.set_evicted_cap(3700);
  t.set_evicted_ttl(100);
  t.set_sketch_bytes(32768);
  CHECK(SparseTableLine(t) == "  table emb: 1200 rows, " + fulcrum::HumanBytes(3 << 20) +
                                  "; admitted 5000, rejected 2300, evicted 3800 (cap 3700, ttl 100); sketch " +
                                  fulcrum::HumanBytes(32768));
  t.set_cold_rows(9000);
  t.set_demoted(9500);
  t.set_promoted(500);
  t.set_cold_reads(42);
  t.set_prefetched(7);
  CHECK(SparseTableLine(t) == "  table emb: 1200 rows, " + fulcrum::HumanBytes(3 << 20) +
                                  "; admitted 5000, rejected 2300, evicted 3800 (cap 3700, ttl 100); sketch " +
                                  fulcrum::HumanBytes(32768) +
                                  "; on disk 9000 rows (moved there 9500, back 500, read there 42, read ahead 7)");
}

}  // namespace
}  // namespace fulcrum::ctl
