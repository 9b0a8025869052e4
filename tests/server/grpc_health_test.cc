// Both gRPC servers (parameter server, coordinator) answer the standard
// health service (grpc.health.v1.Health/Check) and server reflection
// (grpc.reflection.v1alpha), over 127.0.0.1, called as generic byte-level
// RPCs so the test depends on nothing but the wire format.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/synchronization/notification.h"

#include "common/rpc/grpc_util.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/coordinator_service.h"
#include "tests/testing/process_util.h"
#include "tests/testing/test_util.h"

namespace fulcrum {
namespace {

std::string ToString(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  REQUIRE(b.Dump(&slices).ok());
  std::string out;
  for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

grpc::ByteBuffer FromString(const std::string& s) {
  grpc::Slice slice(s);
  return grpc::ByteBuffer(&slice, 1);
}

// grpc.health.v1.Health/Check for `service` ("" = the whole server):
// returns the status enum (1 SERVING, 2 NOT_SERVING), or -code on error.
int HealthCheck(const std::string& address, const std::string& service) {
  grpc::GenericStub stub(CreateFulcrumChannel(address, 0));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  std::string req;
  if (!service.empty()) req = std::string("\x0a", 1) + static_cast<char>(service.size()) + service;
  const grpc::ByteBuffer request = FromString(req);
  grpc::ByteBuffer resp;
  grpc::Status st;
  absl::Notification done;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &resp, [&](grpc::Status s) {
                   st = s;
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!st.ok()) return -static_cast<int>(st.error_code());
  const std::string r = ToString(resp);
  return r.size() == 2 && r[0] == 0x08 ? r[1] : 0;  // field 1, varint
}

// grpc.reflection.v1alpha ServerReflectionInfo with list_services: the
// raw response, which names every service.
std::string ReflectionListServices(const std::string& address) {
  grpc::GenericStub stub(CreateFulcrumChannel(address, 0));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  void* tag;
  bool ok;
  call->StartCall(reinterpret_cast<void*>(1));
  REQUIRE(cq.Next(&tag, &ok));
  REQUIRE(ok);
  call->Write(FromString(std::string("\x3a\x00", 2)), reinterpret_cast<void*>(2));  // list_services = ""
  REQUIRE(cq.Next(&tag, &ok));
  REQUIRE(ok);
  grpc::ByteBuffer resp;
  call->Read(&resp, reinterpret_cast<void*>(3));
  REQUIRE(cq.Next(&tag, &ok));
  REQUIRE(ok);
  call->WritesDone(reinterpret_cast<void*>(4));
  REQUIRE(cq.Next(&tag, &ok));
  grpc::Status st;
  call->Finish(&st, reinterpret_cast<void*>(5));
  while (cq.Next(&tag, &ok)) {
    if (tag == reinterpret_cast<void*>(5)) break;
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return ToString(resp);
}

TEST_CASE("the parameter server answers gRPC health checks and reflection", "[grpc]") {
  testing::TestCluster::Options o;
  o.num_servers = 1;
  auto cluster = testing::TestCluster::Start(o);
  const std::string addr = cluster->address(0);
  REQUIRE(HealthCheck(addr, "") == 1);
  REQUIRE(HealthCheck(addr, "no.such.Service") == -static_cast<int>(grpc::StatusCode::NOT_FOUND));
  const std::string services = ReflectionListServices(addr);
  INFO(services);
  REQUIRE(services.find("fulcrum.v1.ParameterService") != std::string::npos);
  REQUIRE(services.find("grpc.health.v1.Health") != std::string::npos);
}

TEST_CASE("the coordinator answers gRPC health checks and reflection", "[grpc]") {
  CoordinatorOptions o;
  o.data_dir = testing::MakeTempDir("fulcrum-health");
  REQUIRE_OK_AND_ASSIGN(auto coordinator, Coordinator::Open(o, NewGrpcServerControl(absl::Seconds(5))));
  REQUIRE_OK_AND_ASSIGN(auto server, CoordinatorGrpcServer::Start(coordinator.get(), "127.0.0.1:0"));
  const std::string addr = server->address();
  REQUIRE(HealthCheck(addr, "") == 1);
  const std::string services = ReflectionListServices(addr);
  INFO(services);
  REQUIRE(services.find("fulcrum.v1.JobService") != std::string::npos);
  REQUIRE(services.find("fulcrum.v1.ClusterService") != std::string::npos);
  server->Shutdown();
}

}  // namespace
}  // namespace fulcrum
