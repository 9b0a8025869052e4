// gRPC server reflection v1 (grpc.reflection.v1.ServerReflection), next to
// the v1alpha service gRPC's plugin registers: current clients (grpcurl,
// buf curl, Postman) ask for v1 first. Answers from the process's
// generated descriptor pool, so it describes exactly the protos compiled in.
#ifndef FULCRUM_COMMON_RPC_REFLECTION_H_
#define FULCRUM_COMMON_RPC_REFLECTION_H_

#include <memory>
#include <string>
#include <vector>

#include <grpcpp/impl/service_type.h>

namespace fulcrum {

// A service to register with a ServerBuilder (it must outlive the server).
// `services`: the full names of the server's own services, listed by
// list_services with the health and reflection services.
std::unique_ptr<grpc::Service> NewReflectionV1Service(std::vector<std::string> services);

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_RPC_REFLECTION_H_
