#include "tests/testing/test_util.h"

#include <grpcpp/client_context.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/logging.h"
#include "common/rpc/grpc_util.h"
#include "common/shard_map.h"

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
    po.require_admission = options.require_admission;
    if (!options.data_dir.empty()) po.data_dir = absl::StrCat(options.data_dir, "/server-", i);
    auto ps = ParameterServer::Create(po);
    REQUIRE(ps.ok());
    PsGrpcServer::Options go;
    go.shared_memory = options.shared_memory;
    go.shared_memory_poll = options.shared_memory_poll;
    go.spare_core = options.spare_core;
    go.blocking_threads = options.blocking_threads;
    go.blocking_queue = options.blocking_queue;
    go.security = options.security;
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

std::unique_ptr<v1::ParameterService::Stub> RawStub(const std::string& address) {
  return v1::ParameterService::NewStub(CreateFulcrumChannel(address, 99, *security::Transport::Plaintext()));
}

absl::Status RawPush(v1::ParameterService::Stub* stub, const v1::PushRequest& req,
                     v1::PushResponse* resp) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::PushResponse r;
  return FromGrpcStatus(stub->Push(&ctx, req, resp ? resp : &r));
}

uint32_t OwnerOfChunk(const TestCluster& c, const std::string& table, uint32_t chunk) {
  auto m = ShardMap::FromProto(c.shard_map());
  return m->ServerOfChunk(table, chunk);
}

v1::PushRequest DensePush(const std::string& job, const std::string& table, uint32_t chunk,
                          const std::vector<float>& g, uint64_t seq, uint64_t step) {
  v1::PushRequest req;
  req.set_job_id(job);
  req.set_worker_id("raw");
  req.set_seq(seq);
  req.set_step(step);
  req.set_num_parts(1);
  auto* d = req.add_dense();
  d->set_table(table);
  d->set_chunk(chunk);
  d->set_dtype(v1::DTYPE_FP32);
  d->set_data(std::string(reinterpret_cast<const char*>(g.data()), g.size() * 4));
  return req;
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
