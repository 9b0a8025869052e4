// A parameter server's membership in a cluster: registers with the
// coordinator under `advertise_address` and installs every newer shard map
// the heartbeats bring.
#ifndef FULCRUM_SERVER_RPC_SERVER_AGENT_H_
#define FULCRUM_SERVER_RPC_SERVER_AGENT_H_

#include <memory>
#include <string>

#include "common/rpc/node_agent.h"
#include "server/parameter_server.h"

namespace fulcrum {

// `ps` must outlive the agent. `security`: the server's member certificate
// (plaintext when null).
std::unique_ptr<NodeAgent> StartServerAgent(ParameterServer* ps, const std::string& coordinator,
                                            const std::string& advertise_address,
                                            std::shared_ptr<const security::Transport> security = nullptr);

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_RPC_SERVER_AGENT_H_
