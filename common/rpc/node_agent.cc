#include "common/rpc/node_agent.h"

#include <grpcpp/grpcpp.h>

#include "common/backoff.h"
#include "common/logging.h"
#include "common/rpc/grpc_util.h"

namespace fulcrum {

NodeAgent::NodeAgent(NodeAgentOptions options) : options_(std::move(options)) {
  stub_ = v1::ClusterService::NewStub(CreateFulcrumChannel(options_.coordinator, 0, *security::Transport::OrPlaintext(options_.security)));
  thread_ = std::thread([this] { Run(); });
}

NodeAgent::~NodeAgent() { Stop(); }

void NodeAgent::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

std::string NodeAgent::node_id() const {
  absl::MutexLock lock(&mu_);
  return node_id_;
}

bool NodeAgent::WaitRegistered(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !node_id_.empty() || stop_; };
  return mu_.AwaitWithTimeout(absl::Condition(&done), timeout) && !node_id_.empty();
}

void NodeAgent::Run() {
  Backoff backoff({.initial = absl::Milliseconds(100), .max = absl::Milliseconds(500)});
  absl::Time last_warning = absl::InfinitePast();
  uint64_t generation = 0;
  std::string id;
  uint32_t interval_ms = 1000;
  auto stopping = [this] {
    absl::MutexLock lock(&mu_);
    return stop_;
  };
  auto sleep = [this](absl::Duration d) {
    absl::MutexLock lock(&mu_);
    auto s = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
    mu_.AwaitWithTimeout(absl::Condition(&s), d);
  };
  // A failed call: warn at most every 10 s, back off up to 500 ms (with
  // jitter: the nodes a coordinator restart cut off do not retry together). A
  // restarted coordinator gives known nodes one node timeout to heartbeat
  // again; a call to one that is down fails at once, so trying twice a
  // second costs nothing (the channel itself retries its connection at
  // least once a second, common/rpc/grpc_util.cc).
  auto retry_later = [&](const std::string& what, const absl::Status& s) {
    if (absl::Now() - last_warning > absl::Seconds(10)) {
      FLOG(WARNING) << what << " " << options_.coordinator << ": " << s << "; retrying";
      last_warning = absl::Now();
    }
    sleep(backoff.Next());
  };
  while (!stopping()) {
    if (id.empty()) {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
      v1::RegisterNodeRequest req;
      *req.mutable_node() = options_.info;
      v1::RegisterNodeResponse resp;
      absl::Status s = FromGrpcStatus(stub_->RegisterNode(&ctx, req, &resp));
      if (!s.ok()) {
        retry_later("waiting for the coordinator at", s);
        continue;
      }
      backoff.Reset();
      id = resp.node_id();
      interval_ms = resp.heartbeat_interval_ms() == 0 ? 1000 : resp.heartbeat_interval_ms();
      generation = 0;
      FLOG(INFO) << "registered with the coordinator at " << options_.coordinator << " as " << id
                 << " (heartbeat every " << interval_ms << " ms)";
      {
        absl::MutexLock lock(&mu_);
        node_id_ = id;
      }
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout + absl::Milliseconds(interval_ms)));
    v1::HeartbeatRequest req;
    req.set_node_id(id);
    req.set_generation(generation);
    req.set_wait_ms(interval_ms);
    if (options_.fill) options_.fill(&req);
    v1::HeartbeatResponse resp;
    absl::Status s = FromGrpcStatus(stub_->Heartbeat(&ctx, req, &resp));
    if (s.code() == absl::StatusCode::kNotFound) {
      FLOG(WARNING) << "coordinator: " << s.message();
      id.clear();
      v1::HeartbeatResponse none;  // nothing assigned any more
      if (options_.on_update) options_.on_update(none);
      continue;
    }
    if (!s.ok()) {
      retry_later("heartbeat to", s);
      continue;
    }
    backoff.Reset();
    generation = resp.generation();
    if (options_.on_update) options_.on_update(resp);
  }
}

}  // namespace fulcrum
