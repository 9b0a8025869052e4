// Both gRPC servers (parameter server, coordinator) answer the standard
// health service (grpc.health.v1.Health/Check, per service too) and server
// reflection (grpc.reflection.v1alpha and v1), over 127.0.0.1; health and
// v1alpha are called as generic byte-level RPCs so the test depends on
// nothing but the wire format.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <string>
#include <utility>
#include <vector>

#include <google/protobuf/descriptor.pb.h>

#include "absl/synchronization/notification.h"

#include "common/rpc/grpc_util.h"
#include "grpc/reflection/v1/reflection.grpc.pb.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/rpc/grpc_server_control.h"
#include "server/coordinator/rpc/coordinator_service.h"
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

// Requests whose bytes do not parse: INVALID_ARGUMENT naming the method,
// not gRPC's bare UNIMPLEMENTED or INTERNAL.
// By default: a truncated tag, and a field 1 string (a job_id) that is not
// UTF-8.
void ExpectMalformedRefused(const std::string& address, const std::string& method,
                            std::vector<std::string> requests = {std::string("\xff\xff\xff"),
                                                                 std::string("\x0a\x02\xff\xfe", 4)}) {
  for (const std::string& bytes : requests) {
    grpc::GenericStub stub(CreateFulcrumChannel(address, 0, *security::Transport::Plaintext()));
    const grpc::Status st = testing::RawUnaryCall(&stub, method, bytes);
    INFO(method << ": code " << st.error_code() << " " << st.error_message());
    CHECK(st.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(st.error_message().find("the request to " + method + " does not parse") != std::string::npos);
  }
}

// grpc.health.v1.Health/Check for `service` ("" = the whole server):
// returns the status enum (1 SERVING, 2 NOT_SERVING), or -code on error.
int HealthCheck(const std::string& address, const std::string& service) {
  grpc::GenericStub stub(CreateFulcrumChannel(address, 0, *security::Transport::Plaintext()));
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
  grpc::GenericStub stub(CreateFulcrumChannel(address, 0, *security::Transport::Plaintext()));
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

// Reflection v1: the service names, and the file defining `symbol` (its
// name, then its imports).
std::pair<std::string, std::vector<std::string>> ReflectionV1(const std::string& address, const std::string& symbol) {
  auto stub = grpc::reflection::v1::ServerReflection::NewStub(CreateFulcrumChannel(address, 0, *security::Transport::Plaintext()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto stream = stub->ServerReflectionInfo(&ctx);
  grpc::reflection::v1::ServerReflectionRequest req;
  grpc::reflection::v1::ServerReflectionResponse resp;
  req.set_list_services("*");
  REQUIRE(stream->Write(req));
  REQUIRE(stream->Read(&resp));
  std::string names;
  for (const auto& s : resp.list_services_response().service()) names += s.name() + "\n";
  req.set_file_containing_symbol(symbol);
  REQUIRE(stream->Write(req));
  REQUIRE(stream->Read(&resp));
  std::vector<std::string> files;
  for (const std::string& bytes : resp.file_descriptor_response().file_descriptor_proto()) {
    google::protobuf::FileDescriptorProto f;
    REQUIRE(f.ParseFromString(bytes));
    files.push_back(f.name());
  }
  req.set_file_containing_symbol("no.such.Thing");
  REQUIRE(stream->Write(req));
  REQUIRE(stream->Read(&resp));
  CHECK(resp.error_response().error_code() == static_cast<int>(grpc::StatusCode::NOT_FOUND));
  REQUIRE(stream->WritesDone());
  REQUIRE(stream->Finish().ok());
  return {names, files};
}

TEST_CASE("the parameter server answers gRPC health checks and reflection", "[grpc]") {
  testing::TestCluster::Options o;
  o.num_servers = 1;
  auto cluster = testing::TestCluster::Start(o);
  const std::string addr = cluster->address(0);
  REQUIRE(HealthCheck(addr, "") == 1);
  REQUIRE(HealthCheck(addr, "no.such.Service") == -static_cast<int>(grpc::StatusCode::NOT_FOUND));
  REQUIRE(HealthCheck(addr, "fulcrum.v1.ParameterService") == 1);  // per-service probes
  const std::string services = ReflectionListServices(addr);
  INFO(services);
  REQUIRE(services.find("fulcrum.v1.ParameterService") != std::string::npos);
  REQUIRE(services.find("grpc.health.v1.Health") != std::string::npos);
  const auto [v1_services, files] = ReflectionV1(addr, "fulcrum.v1.ParameterService.Push");
  INFO(v1_services);
  CHECK(v1_services.find("fulcrum.v1.ParameterService\n") != std::string::npos);
  CHECK(v1_services.find("grpc.reflection.v1.ServerReflection\n") != std::string::npos);
  REQUIRE(files.size() == 2);  // ps.proto, then what it imports
  CHECK(files[0] == "fulcrum/v1/ps.proto");
  CHECK(files[1] == "fulcrum/v1/common.proto");
  ExpectMalformedRefused(addr, "/fulcrum.v1.ParameterService/GetJob");
  ExpectMalformedRefused(addr, "/fulcrum.v1.ParameterService/CreateJob");
}

TEST_CASE("the coordinator answers gRPC health checks and reflection", "[grpc]") {
  CoordinatorOptions o;
  o.data_dir = testing::MakeTempDir("fulcrum-health");
  REQUIRE_OK_AND_ASSIGN(auto coordinator, Coordinator::Open(o, NewGrpcServerControl(absl::Seconds(5))));
  REQUIRE_OK_AND_ASSIGN(auto server, CoordinatorGrpcServer::Start(coordinator.get(), "127.0.0.1:0"));
  const std::string addr = server->address();
  REQUIRE(HealthCheck(addr, "") == 1);
  REQUIRE(HealthCheck(addr, "fulcrum.v1.JobService") == 1);
  REQUIRE(HealthCheck(addr, "fulcrum.v1.ClusterService") == 1);
  const std::string services = ReflectionListServices(addr);
  INFO(services);
  REQUIRE(services.find("fulcrum.v1.JobService") != std::string::npos);
  REQUIRE(services.find("fulcrum.v1.ClusterService") != std::string::npos);
  const auto [v1_services, files] = ReflectionV1(addr, "fulcrum.v1.JobSpec");
  CHECK(v1_services.find("fulcrum.v1.JobService\n") != std::string::npos);
  CHECK(v1_services.find("fulcrum.v1.ClusterService\n") != std::string::npos);
  REQUIRE_FALSE(files.empty());
  CHECK(files[0] == "fulcrum/v1/cluster.proto");
  ExpectMalformedRefused(addr, "/fulcrum.v1.JobService/GetJob");        // callback unary
  // A sync unary method (its request has no fields: only broken framing fails).
  ExpectMalformedRefused(addr, "/fulcrum.v1.ClusterService/GetCluster", {std::string("\xff\xff\xff")});
  server->Shutdown();
}

}  // namespace
}  // namespace fulcrum
