#include "tests/testing/test_util.h"

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/logging.h"

namespace fulcrum::testing {

std::unique_ptr<TestCluster> TestCluster::Start(Options options) {
  SetMinLogSeverity(LogSeverity::kWarning);
  auto c = std::make_unique<TestCluster>();
  for (int i = 0; i < options.num_servers; ++i) {
    ParameterServerOptions po;
    po.server_index = static_cast<uint32_t>(i);
    po.default_quota_bytes = options.default_quota_bytes;
    po.memory_limit_bytes = options.memory_limit_bytes;
    po.max_wait = options.max_wait;
    if (!options.data_dir.empty()) po.data_dir = absl::StrCat(options.data_dir, "/server-", i);
    auto ps = ParameterServer::Create(po);
    REQUIRE(ps.ok());
    PsGrpcServer::Options go;
    go.shared_memory = options.shared_memory;
    go.shared_memory_poll = options.shared_memory_poll;
    go.blocking_threads = options.blocking_threads;
    go.blocking_queue = options.blocking_queue;
    auto grpc = PsGrpcServer::Start(ps->get(), "127.0.0.1:0", go);
    REQUIRE(grpc.ok());
    c->servers_.push_back(*std::move(ps));
    c->grpc_.push_back(*std::move(grpc));
  }
  std::vector<std::string> addresses;
  for (auto& g : c->grpc_) {
    if (options.mapped_servers == 0 || static_cast<int>(addresses.size()) < options.mapped_servers) {
      addresses.push_back(g->address());
    }
  }
  auto map = ShardMap::RoundRobin(1, options.num_virtual_shards, addresses);
  REQUIRE(map.ok());
  c->SetShardMap(map->ToProto());
  return c;
}

TestCluster::~TestCluster() {
  for (auto& g : grpc_) g->Shutdown();
}

void TestCluster::SetShardMap(const v1::ShardMap& map) {
  for (size_t i = 0; i < servers_.size(); ++i) {
    if (static_cast<int>(i) >= map.servers_size()) continue;  // unlisted: owns nothing yet
    const absl::Status st = servers_[i]->SetShardMap(map);
    INFO(st.ToString());
    REQUIRE(st.ok());
  }
  map_ = map;
}

std::unique_ptr<GrpcPsClient> TestCluster::Client(uint32_t rank, GrpcPsClientOptions base) {
  base.shard_map = map_;
  base.rank = rank;
  if (base.worker_id.empty()) base.worker_id = absl::StrCat("worker-", rank);
  base.pull_wait_timeout = std::min(base.pull_wait_timeout, absl::Seconds(20));
  base.retry_budget = std::min(base.retry_budget, absl::Seconds(5));
  auto client = GrpcPsClient::Create(base);
  REQUIRE(client.ok());
  return *std::move(client);
}

grpc::Status RawUnaryCall(grpc::GenericStub* stub, const std::string& method, const std::string& bytes,
                          const std::string& bearer_token) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  if (!bearer_token.empty()) ctx.AddMetadata("authorization", "Bearer " + bearer_token);
  grpc::Slice slice(bytes);
  const grpc::ByteBuffer req(&slice, 1);
  grpc::ByteBuffer resp;
  grpc::Status st;
  absl::Notification done;
  stub->UnaryCall(&ctx, method, grpc::StubOptions(), &req, &resp, [&](grpc::Status s) {
    st = std::move(s);
    done.Notify();
  });
  done.WaitForNotification();
  return st;
}

}  // namespace fulcrum::testing
