#include "tests/fakes/fake_ps_client.h"

#include "absl/strings/str_cat.h"

namespace fulcrum::testing {

absl::Status FakePsClient::CreateJob(const v1::PsJobSpec& spec) {
  absl::MutexLock lock(&mu_);
  auto& tables = jobs_[spec.job_id()];
  for (const v1::TableSpec& t : spec.tables()) {
    Table& table = tables[t.name()];
    table.dense = t.kind() != v1::TableSpec::SPARSE;
    table.dim = t.dim();
    table.lr = t.optimizer().learning_rate();
    if (table.dense) {
      int64_t n = 1;
      for (int64_t d : t.shape()) n *= d;
      table.values.assign(static_cast<size_t>(n), t.initializer().kind() == v1::InitializerSpec::CONSTANT
                                                      ? t.initializer().a()
                                                      : 0.0f);
    }
  }
  return absl::OkStatus();
}

absl::Status FakePsClient::OpenJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  return jobs_.count(job_id) ? absl::OkStatus()
                             : absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
}

absl::Status FakePsClient::DeleteJob(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  return jobs_.erase(job_id) ? absl::OkStatus()
                             : absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
}

Future<absl::Status> FakePsClient::Enqueue(Call call, std::function<absl::Status()> effect) {
  Pending p;
  p.effect = std::move(effect);
  Future<absl::Status> f = p.promise.future();
  bool run_now;
  {
    absl::MutexLock lock(&mu_);
    calls_.push_back(std::move(call));
    run_now = auto_complete_;
    if (!run_now) queue_.push_back(std::move(p));
  }
  if (run_now) {
    absl::Status s;
    {
      absl::MutexLock lock(&mu_);
      s = p.effect();
    }
    p.promise.Set(s);
  }
  return f;
}

Future<absl::Status> FakePsClient::PushAsync(const std::string& job_id, const PushBatch& batch) {
  Call call{true, job_id, batch.step, batch.last, {}};
  for (const DenseGradient& g : batch.dense) call.tables.push_back(g.table);
  for (const SparseGradient& g : batch.sparse) call.tables.push_back(g.table);
  return Enqueue(std::move(call), [this, job_id, batch]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    auto job = jobs_.find(job_id);
    if (job == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
    for (const DenseGradient& g : batch.dense) {
      auto t = job->second.find(g.table);
      if (t == job->second.end() || !t->second.dense || t->second.values.size() != g.size) {
        return absl::InvalidArgumentError(absl::StrCat("bad dense gradient for '", g.table, "'"));
      }
      for (size_t i = 0; i < g.size; ++i) t->second.values[i] -= t->second.lr * g.data[i];
    }
    for (const SparseGradient& g : batch.sparse) {
      auto t = job->second.find(g.table);
      if (t == job->second.end() || t->second.dense) {
        return absl::InvalidArgumentError(absl::StrCat("bad sparse gradient for '", g.table, "'"));
      }
      for (size_t k = 0; k < g.num_keys; ++k) {
        auto& row = t->second.rows[g.keys[k]];
        row.resize(t->second.dim, 0.0f);
        for (uint32_t j = 0; j < t->second.dim; ++j) row[j] -= t->second.lr * g.values[k * t->second.dim + j];
      }
    }
    return absl::OkStatus();
  });
}

Future<absl::Status> FakePsClient::PullAsync(const std::string& job_id, const PullBatch& batch) {
  Call call{false, job_id, batch.step, true, {}};
  for (const DenseTarget& t : batch.dense) call.tables.push_back(t.table);
  for (const SparseTarget& t : batch.sparse) call.tables.push_back(t.table);
  return Enqueue(std::move(call), [this, job_id, batch]() ABSL_NO_THREAD_SAFETY_ANALYSIS {
    auto job = jobs_.find(job_id);
    if (job == jobs_.end()) return absl::NotFoundError(absl::StrCat("job '", job_id, "' not found"));
    for (const DenseTarget& d : batch.dense) {
      auto t = job->second.find(d.table);
      if (t == job->second.end() || !t->second.dense || t->second.values.size() != d.size) {
        return absl::InvalidArgumentError(absl::StrCat("bad dense target for '", d.table, "'"));
      }
      std::copy(t->second.values.begin(), t->second.values.end(), d.out);
    }
    for (const SparseTarget& s : batch.sparse) {
      auto t = job->second.find(s.table);
      if (t == job->second.end() || t->second.dense) {
        return absl::InvalidArgumentError(absl::StrCat("bad sparse target for '", s.table, "'"));
      }
      for (size_t k = 0; k < s.num_keys; ++k) {
        auto& row = t->second.rows[s.keys[k]];
        row.resize(t->second.dim, 0.0f);
        std::copy(row.begin(), row.end(), s.out + k * t->second.dim);
      }
    }
    return absl::OkStatus();
  });
}

void FakePsClient::set_auto_complete(bool on) {
  absl::MutexLock lock(&mu_);
  auto_complete_ = on;
}

size_t FakePsClient::pending() const {
  absl::MutexLock lock(&mu_);
  return queue_.size();
}

bool FakePsClient::CompleteNext(const absl::Status& status) {
  Pending p;
  absl::Status s = status;
  {
    absl::MutexLock lock(&mu_);
    if (queue_.empty()) return false;
    p = std::move(queue_.front());
    queue_.pop_front();
    if (s.ok()) s = p.effect();
  }
  p.promise.Set(s);
  return true;
}

std::vector<FakePsClient::Call> FakePsClient::calls() const {
  absl::MutexLock lock(&mu_);
  return calls_;
}

std::vector<float> FakePsClient::Dense(const std::string& job_id, const std::string& table) const {
  absl::MutexLock lock(&mu_);
  auto job = jobs_.find(job_id);
  if (job == jobs_.end()) return {};
  auto t = job->second.find(table);
  return t == job->second.end() ? std::vector<float>() : t->second.values;
}

}  // namespace fulcrum::testing
