// NodeAgent: a server's or worker's link to the coordinator. A background
// thread registers (retrying, and logging what it waits for, until the
// coordinator answers), then keeps a heartbeat long poll open: every answer,
// changed or not, goes to `on_update`. A node the coordinator no longer knows
// (declared dead, or state lost) registers again under a new id.
#ifndef FULCRUM_COMMON_RPC_NODE_AGENT_H_
#define FULCRUM_COMMON_RPC_NODE_AGENT_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/rpc/security.h"
#include "fulcrum/v1/cluster.grpc.pb.h"

namespace fulcrum {

struct NodeAgentOptions {
  std::string coordinator;  // host:port
  // The channel's security (the process's member certificate); plaintext
  // when null.
  std::shared_ptr<const security::Transport> security;
  v1::NodeInfo info;        // role, address, devices, slots
  absl::Duration rpc_timeout = absl::Seconds(10);
  // Called on the agent's thread after every heartbeat.
  std::function<void(const v1::HeartbeatResponse&)> on_update;
  // Called before every heartbeat to add what the node reports (a server's
  // sparse tables).
  std::function<void(v1::HeartbeatRequest*)> fill;
};

class NodeAgent {
 public:
  explicit NodeAgent(NodeAgentOptions options);
  ~NodeAgent();  // stops the thread

  // Empty until registered.
  std::string node_id() const;
  // Blocks until registered or `timeout`; false on timeout.
  bool WaitRegistered(absl::Duration timeout) const;
  v1::ClusterService::Stub* stub() { return stub_.get(); }
  const std::string& coordinator() const { return options_.coordinator; }
  void Stop();

 private:
  void Run();

  const NodeAgentOptions options_;
  std::unique_ptr<v1::ClusterService::Stub> stub_;
  mutable absl::Mutex mu_;
  std::string node_id_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_RPC_NODE_AGENT_H_
