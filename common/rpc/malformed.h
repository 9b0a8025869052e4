// Requests that do not parse get an answer a client can act on.
//
// gRPC answers a request whose bytes do not parse as the method's request
// message with a bare UNIMPLEMENTED (unary callback methods) or INTERNAL
// (streams) and no message. This interceptor turns those into
// INVALID_ARGUMENT naming the method and the likely cause, as
// docs/wire-protocol.md promises, unless `check` refuses the caller: a
// caller without credentials learns only that (UNAUTHENTICATED,
// PERMISSION_DENIED), never how its request was judged.
#ifndef FULCRUM_COMMON_RPC_MALFORMED_H_
#define FULCRUM_COMMON_RPC_MALFORMED_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/server_context.h>
#include <grpcpp/support/server_interceptor.h>

#include "absl/status/status.h"

namespace fulcrum {

// The caller's credentials for `method` ("/fulcrum.v1.JobService/GetJob"):
// OK, or the status to answer instead. Called only for requests that did
// not parse.
using CallerCheck = std::function<absl::Status(const std::string& method, grpc::ServerContextBase& ctx)>;

// `raw_methods`: methods whose handlers decode the bytes themselves (and
// answer INVALID_ARGUMENT on their own): not intercepted, so their calls
// (the data path: every push and pull) pay nothing for this.
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> NewMalformedRequestInterceptor(
    CallerCheck check, std::vector<std::string> raw_methods = {});

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_RPC_MALFORMED_H_
