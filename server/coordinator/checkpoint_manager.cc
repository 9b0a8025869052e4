#include "server/coordinator/checkpoint_manager.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"

namespace fulcrum {

const v1::CheckpointInfo* FindCut(const v1::JobStatus& st, uint64_t cut_id) {
  if (st.checkpoints_size() == 0) return nullptr;
  if (cut_id == 0) return &*st.checkpoints().rbegin();
  for (const v1::CheckpointInfo& c : st.checkpoints()) {
    if (c.cut_id() == cut_id) return &c;
  }
  return nullptr;
}

std::string CutIds(const v1::JobStatus& st) {
  std::vector<std::string> ids;
  for (const v1::CheckpointInfo& c : st.checkpoints()) ids.push_back(absl::StrCat(c.cut_id()));
  return ids.empty() ? std::string("none") : absl::StrJoin(ids, ", ");
}

absl::Status NoCutError(const std::string& job_id, const v1::JobStatus& st, uint64_t cut_id) {
  return absl::NotFoundError(absl::StrCat("job '", job_id, "' has no committed checkpoint",
                                          cut_id == 0 ? std::string() : absl::StrCat(" ", cut_id),
                                          " (its checkpoints: ", CutIds(st), ")"));
}

namespace {

// CallEachServer for cuts and restores: the answers in the servers' order,
// or the first failure, naming its server.
absl::StatusOr<std::vector<v1::ShardCutMeta>> OnEachServer(
    const std::vector<std::string>& servers,
    const std::function<absl::StatusOr<v1::ShardCutMeta>(const std::string&)>& call) {
  std::vector<absl::StatusOr<v1::ShardCutMeta>> results = CallEachServer(servers, call);
  std::vector<v1::ShardCutMeta> out;
  for (size_t i = 0; i < results.size(); ++i) {
    if (!results[i].ok()) {
      return absl::Status(results[i].status().code(),
                          absl::StrCat("server ", servers[i], ": ", results[i].status().message()));
    }
    out.push_back(*std::move(results[i]));
  }
  return out;
}

}  // namespace

CheckpointManager::CheckpointManager(ServerControl* servers, const Clock* clock, absl::Duration checkpoint_wait)
    : servers_(servers), clock_(clock), checkpoint_wait_(checkpoint_wait) {}

// ---------------------------------------------------------------- bookkeeping

CheckpointManager::Book CheckpointManager::Of(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = books_.find(job_id);
  return it == books_.end() ? Book() : it->second;
}

void CheckpointManager::Loaded(const std::string& job_id, absl::Time last_cut, absl::Time now) {
  absl::MutexLock lock(&mu_);
  Book& b = books_[job_id];
  b.last_cut = last_cut;
  b.restore_since = now;
}

void CheckpointManager::Forget(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  books_.erase(job_id);
}

bool CheckpointManager::CutInFlight(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = books_.find(job_id);
  return it != books_.end() && it->second.cut_in_flight;
}

bool CheckpointManager::Busy(const std::string& job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = books_.find(job_id);
  return it != books_.end() && (it->second.cut_in_flight || it->second.restore_in_flight);
}

void CheckpointManager::FillView(const std::string& job_id, cut_schedule::JobView* view) const {
  absl::MutexLock lock(&mu_);
  auto it = books_.find(job_id);
  const Book b = it == books_.end() ? Book() : it->second;
  view->manual_pending = b.manual_requested > b.manual_served;
  view->first_cut_failed = b.first_cut_failed;
  view->extra_lead = b.extra_lead;
  view->steps_boundary_asked = b.steps_boundary_asked;
  view->last_cut = b.last_cut;
  view->backoff_until = b.backoff_until;
}

void CheckpointManager::SetBoundaryAsked(const std::string& job_id, uint64_t boundary) {
  absl::MutexLock lock(&mu_);
  books_[job_id].steps_boundary_asked = boundary;
}

void CheckpointManager::CutStarted(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  books_[job_id].cut_in_flight = true;
}

uint64_t CheckpointManager::CutEnded(const CutTask& t, Outcome outcome,
                                     const absl::StatusOr<v1::CheckpointInfo>& result, uint64_t answers) {
  absl::MutexLock lock(&mu_);
  Book& b = books_[t.job_id];
  b.cut_in_flight = false;
  switch (outcome) {
    case Outcome::kCommitted:
      b.last_cut = clock_->Now();
      break;
    case Outcome::kTooLate:
      b.extra_lead = std::max<uint64_t>(16, b.extra_lead * 2);
      return b.extra_lead;
    case Outcome::kFailed:
      b.backoff_until = clock_->Now() + absl::Seconds(5);
      if (t.trigger == "first") b.first_cut_failed = true;
      break;
  }
  if (answers > b.manual_served) {
    b.manual_served = answers;
    b.manual_result = result;
  }
  return b.extra_lead;
}

uint64_t CheckpointManager::RequestManual(const std::string& job_id) {
  absl::MutexLock lock(&mu_);
  return ++books_[job_id].manual_requested;
}

std::optional<absl::StatusOr<v1::CheckpointInfo>> CheckpointManager::ManualAnswer(const std::string& job_id,
                                                                                  uint64_t ticket) const {
  absl::MutexLock lock(&mu_);
  auto it = books_.find(job_id);
  if (it == books_.end() || it->second.manual_served < ticket) return std::nullopt;
  return it->second.manual_result;
}

void CheckpointManager::RollbackBegan(const std::string& job_id, absl::Time now) {
  absl::MutexLock lock(&mu_);
  books_[job_id].restore_since = now;
}

void CheckpointManager::SetRestoreInFlight(const std::string& job_id, bool in_flight) {
  absl::MutexLock lock(&mu_);
  books_[job_id].restore_in_flight = in_flight;
}

// ---------------------------------------------------------------- calls to servers

absl::StatusOr<std::vector<v1::ShardCutMeta>> CheckpointManager::TakeCut(const CutTask& t) {
  return OnEachServer(t.servers, [&](const std::string& server) {
    return servers_->Checkpoint(server, t.job_id, t.cut_id, t.at_step, checkpoint_wait_);
  });
}

absl::Status CheckpointManager::Restore(const RestoreTask& t) {
  const std::vector<std::string> sources(t.cut.servers().begin(), t.cut.servers().end());
  return OnEachServer(t.targets,
                      [&](const std::string& server) {
                        return servers_->Restore(server, t.job_id, t.cut.cut_id(), sources, t.min_incarnation);
                      })
      .status();
}

v1::CheckpointInfo CheckpointManager::Committed(const CutTask& t, const std::vector<v1::ShardCutMeta>& metas) const {
  v1::CheckpointInfo info;
  info.set_cut_id(t.cut_id);
  info.set_trigger(t.trigger);
  info.set_shard_map_version(t.map_version);
  info.set_created_unix_ms(absl::ToUnixMillis(clock_->Now()));
  for (const std::string& s : t.servers) info.add_servers(s);
  uint64_t step = UINT64_MAX;
  std::vector<uint64_t> clocks;  // per rank, the lowest over the servers
  for (const auto& m : metas) {
    step = std::min(step, m.step());
    info.set_bytes(info.bytes() + m.bytes());
    info.set_pause_seconds(std::max(info.pause_seconds(), m.capture_seconds()));
    info.set_write_seconds(std::max(info.write_seconds(), m.write_seconds()));
    if (clocks.empty()) clocks.assign(m.rank_clock().begin(), m.rank_clock().end());
    for (size_t k = 0; k < clocks.size() && k < static_cast<size_t>(m.rank_clock_size()); ++k) {
      clocks[k] = std::min(clocks[k], m.rank_clock(static_cast<int>(k)));
    }
  }
  info.set_step(cut_schedule::StepsOfRounds(t.spec, t.steps_per_epoch, step));
  for (size_t k = 0; k < clocks.size(); ++k) {
    v1::RankPosition* p = info.add_positions();
    p->set_rank(static_cast<uint32_t>(k));
    // Under local steps the servers' clock counts rounds: positions are in
    // the ranks' steps.
    const uint64_t rank_step = cut_schedule::StepsOfRounds(t.spec, t.steps_per_epoch, clocks[k]);
    p->set_step(rank_step);
    if (t.steps_per_epoch > 0) {
      p->set_epoch(static_cast<uint32_t>(rank_step / t.steps_per_epoch));
      p->set_batch(rank_step % t.steps_per_epoch);
    }
  }
  return info;
}

std::set<uint64_t> CheckpointManager::Record(const v1::CheckpointInfo& info, uint32_t keep, v1::JobStatus* st,
                                             CutList* to_delete) {
  if (keep == 0) keep = 3;
  *st->add_checkpoints() = info;
  while (static_cast<uint32_t>(st->checkpoints_size()) > keep) {
    const v1::CheckpointInfo& old = st->checkpoints(0);
    to_delete->emplace_back(old.cut_id(), std::vector<std::string>(old.servers().begin(), old.servers().end()));
    st->mutable_checkpoints()->DeleteSubrange(0, 1);
  }
  std::set<uint64_t> kept;
  for (const v1::CheckpointInfo& c : st->checkpoints()) kept.insert(c.cut_id());
  return kept;
}

void CheckpointManager::DeleteCuts(const std::string& job_id, const CutList& cuts) {
  for (const auto& [cut, servers] : cuts) {
    for (const std::string& s : servers) {
      absl::Status st = servers_->DeleteCut(s, job_id, cut);
      if (!st.ok()) FLOG(WARNING) << "deleting checkpoint " << cut << " of job " << job_id << " on " << s << ": " << st;
    }
  }
}

void CheckpointManager::DeleteStrayCuts(const CutTask& t, const std::set<uint64_t>& kept) {
  for (const std::string& s : t.servers) {
    absl::StatusOr<std::vector<v1::ShardCutMeta>> cuts = servers_->ListCuts(s, t.job_id);
    if (!cuts.ok()) continue;
    for (const v1::ShardCutMeta& m : *cuts) {
      if (m.cut_id() < t.cut_id && !kept.count(m.cut_id())) (void)servers_->DeleteCut(s, t.job_id, m.cut_id());
    }
  }
}

absl::Status CheckpointManager::Export(const std::string& job_id, const v1::CheckpointInfo& info,
                                       const std::function<bool(const v1::ExportCheckpointChunk&)>& write) {
  bool first = true;
  for (const std::string& server : info.servers()) {
    v1::ReadCheckpointRequest req;
    req.set_job_id(job_id);
    req.set_cut_id(info.cut_id());
    for (;;) {
      absl::StatusOr<v1::ReadCheckpointResponse> page = servers_->ReadCut(server, req);
      if (!page.ok()) {
        return absl::Status(page.status().code(), absl::StrCat("reading checkpoint ", info.cut_id(), " from ", server,
                                                               ": ", page.status().message()));
      }
      v1::ExportCheckpointChunk chunk;
      if (first) {
        *chunk.mutable_checkpoint() = info;
        *chunk.mutable_meta() = page->meta();
        first = false;
      }
      chunk.mutable_records()->Swap(page->mutable_records());
      if (!write(chunk)) return absl::CancelledError("the reader went away");
      if (page->next_start_after().empty()) break;
      req.set_start_after(page->next_start_after());
    }
  }
  return absl::OkStatus();
}

}  // namespace fulcrum
