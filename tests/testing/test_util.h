// Test helpers shared by every Fulcrum test binary.
#ifndef FULCRUM_TESTS_TESTING_TEST_UTIL_H_
#define FULCRUM_TESTS_TESTING_TEST_UTIL_H_

#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>
#include <grpcpp/generic/generic_stub.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fulcrum/v1/ps.grpc.pb.h"
#include "server/parameter_server.h"
#include "server/rpc/ps_service.h"
#include "worker/rpc/grpc_ps_client.h"

namespace absl {
inline std::ostream& operator<<(std::ostream& os, StatusCode code) {
  return os << StatusCodeToString(code);
}
}  // namespace absl

#define REQUIRE_OK(expr)                                  \
  do {                                                    \
    const ::absl::Status fulcrum_s_ = (expr);             \
    INFO("status: " << fulcrum_s_.ToString());            \
    REQUIRE(fulcrum_s_.ok());                             \
  } while (0)

#define REQUIRE_OK_AND_ASSIGN(lhs, expr)                  \
  auto FULCRUM_TEST_CONCAT_(sor_, __LINE__) = (expr);     \
  REQUIRE_OK(FULCRUM_TEST_CONCAT_(sor_, __LINE__).status()); \
  lhs = std::move(FULCRUM_TEST_CONCAT_(sor_, __LINE__)).value()
#define FULCRUM_TEST_CONCAT_INNER_(a, b) a##b
#define FULCRUM_TEST_CONCAT_(a, b) FULCRUM_TEST_CONCAT_INNER_(a, b)

// Requires `status` to have `code` and a message containing `substring`.
#define REQUIRE_STATUS(expr, want_code, substring)                    \
  do {                                                           \
    const ::absl::Status fulcrum_s_ = (expr);                    \
    INFO("status: " << fulcrum_s_.ToString());                   \
    REQUIRE(fulcrum_s_.code() == (want_code));                        \
    REQUIRE(std::string(fulcrum_s_.message()).find(substring) != std::string::npos); \
  } while (0)

namespace fulcrum::testing {

// N parameter servers in this process, each on its own 127.0.0.1 port, with a
// round-robin shard map (version 1) installed on all of them.
class TestCluster {
 public:
  struct Options {
    int num_servers = 2;
    uint32_t num_virtual_shards = 16;
    uint64_t default_quota_bytes = uint64_t{1} << 30;
    uint64_t memory_limit_bytes = 0;  // per server; 0: the server's default
    absl::Duration max_wait = absl::Seconds(30);
    // When set, server i keeps checkpoints in <data_dir>/server-i.
    std::string data_dir;
    // Servers listed in the initial map (0: all of them); the others own
    // nothing until a map lists them.
    int mapped_servers = 0;
    bool shared_memory = true;  // servers offer OpenSharedMemory
    absl::Duration shared_memory_poll = absl::Microseconds(500);  // PsGrpcServer::Options
    SpareCoreProbe spare_core = &SpareCore;                        // PsGrpcServer::Options
    int blocking_threads = 8;      // PsGrpcServer::Options
    size_t blocking_queue = 256;   // PsGrpcServer::Options
    // The servers' transport (PsGrpcServer::Options); plaintext when null.
    std::shared_ptr<const security::Transport> security;
    // As with a coordinator (ParameterServerOptions::require_admission):
    // the test admits jobs with SetAdmittedJobs.
    bool require_admission = false;
  };
  static std::unique_ptr<TestCluster> Start(Options options);
  static std::unique_ptr<TestCluster> Start() { return Start(Options()); }
  ~TestCluster();

  size_t size() const { return servers_.size(); }
  ParameterServer* server(size_t i) { return servers_[i].get(); }
  const std::string& address(size_t i) const { return grpc_[i]->address(); }
  PsGrpcServer* grpc(size_t i) { return grpc_[i].get(); }
  const v1::ShardMap& shard_map() const { return map_; }
  // Installs `map` on every server.
  void SetShardMap(const v1::ShardMap& map);

  // A client for worker `rank` that knows the cluster's current map.
  std::unique_ptr<GrpcPsClient> Client(uint32_t rank, GrpcPsClientOptions base = {});

 private:
  std::vector<std::unique_ptr<ParameterServer>> servers_;
  std::vector<std::unique_ptr<PsGrpcServer>> grpc_;
  v1::ShardMap map_;
};

// A one-table spec helper: dense table `name` of `elements` floats.
v1::TableSpec DenseTableSpec(const std::string& name, int64_t elements, float lr = 1.0f,
                             v1::OptimizerSpec::Kind kind = v1::OptimizerSpec::SGD,
                             uint32_t chunk_elements = 0);
v1::TableSpec SparseTableSpec(const std::string& name, uint32_t dim, float lr = 1.0f,
                              v1::OptimizerSpec::Kind kind = v1::OptimizerSpec::SGD);
v1::PsJobSpec JobSpec(const std::string& id, std::vector<v1::TableSpec> tables,
                      uint32_t num_workers,
                      v1::ConsistencySpec::Model model = v1::ConsistencySpec::BSP,
                      uint32_t staleness = 0);

// A ParameterService stub on a channel of its own, for requests the client
// would never send as they are.
std::unique_ptr<v1::ParameterService::Stub> RawStub(const std::string& address);
// One Push on `stub` with a 10 s deadline.
absl::Status RawPush(v1::ParameterService::Stub* stub, const v1::PushRequest& req,
                     v1::PushResponse* resp = nullptr);
// The server owning chunk `chunk` of `table` under the cluster's map.
uint32_t OwnerOfChunk(const TestCluster& c, const std::string& table, uint32_t chunk);
// A push of one fp32 dense chunk from worker "raw".
v1::PushRequest DensePush(const std::string& job, const std::string& table, uint32_t chunk,
                          const std::vector<float>& g, uint64_t seq, uint64_t step = 0);

// A unary call of raw bytes to `method` ("/fulcrum.v1.JobService/GetJob"),
// with a 10 s deadline and, when given, a bearer token: for requests no
// generated stub would send.
grpc::Status RawUnaryCall(grpc::GenericStub* stub, const std::string& method, const std::string& bytes,
                          const std::string& bearer_token = "");

}  // namespace fulcrum::testing

#endif  // FULCRUM_TESTS_TESTING_TEST_UTIL_H_
