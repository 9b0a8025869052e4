// gRPC's own log lines, rate-limited as Fulcrum's are.
//
// gRPC logs some events once per occurrence that anyone can cause: a failed
// TLS handshake ("Handshake failed") costs a caller no credentials, so a
// loop of bad handshakes would fill a daemon's log (2 000 lines in under a
// second). Every daemon routes gRPC's lines through LimitGrpcLogs: per kind
// (gRPC's source file and line), at most `burst` lines per `window`; the
// first line let through after some were dropped says how many.
#ifndef FULCRUM_COMMON_RPC_GRPC_LOG_H_
#define FULCRUM_COMMON_RPC_GRPC_LOG_H_

#include "absl/time/time.h"

namespace fulcrum {

// Installs the limit for the whole process (gRPC's log function is global).
// Call once from main, before serving; a second call changes the limits.
void LimitGrpcLogs(int burst = 10, absl::Duration window = absl::Minutes(1));

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_RPC_GRPC_LOG_H_
