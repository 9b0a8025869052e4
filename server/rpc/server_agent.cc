#include "server/rpc/server_agent.h"

#include <unistd.h>

#include "common/logging.h"
#include "common/process.h"

namespace fulcrum {

std::unique_ptr<NodeAgent> StartServerAgent(ParameterServer* ps, const std::string& coordinator,
                                            const std::string& advertise_address,
                                            std::shared_ptr<const security::Transport> security) {
  NodeAgentOptions o;
  o.security = std::move(security);
  o.coordinator = coordinator;
  o.info.set_role(v1::SERVER);
  o.info.set_address(advertise_address);
  o.info.set_hostname(HostName());
  o.info.set_pid(getpid());
  o.on_update = [ps](const v1::HeartbeatResponse& r) {
    if (r.admitted_jobs_set()) {
      ps->SetAdmittedJobs({r.admitted_jobs().begin(), r.admitted_jobs().end()}, absl::Now());
    }
    if (!r.has_shard_map() || r.shard_map().servers_size() == 0) return;
    auto have = ps->GetShardMap();
    if (have.ok() && have->version() >= r.shard_map().version()) return;
    absl::Status s = ps->SetShardMap(r.shard_map());
    if (!s.ok()) FLOG(WARNING) << "installing shard map version " << r.shard_map().version() << ": " << s;
  };
  o.fill = [ps](v1::HeartbeatRequest* req) {
    for (auto& j : ps->SparseTables()) *req->add_sparse_tables() = std::move(j);
  };
  return std::make_unique<NodeAgent>(std::move(o));
}

}  // namespace fulcrum
