// Writes the binary seeds of fuzz_ps_request into a directory: valid Push
// and Pull messages for job "j" as the wire codec encodes them (a kind byte
// first, as the target reads them), a streaming frame and a PsJobSpec.
// The committed corpus (tests/fuzz/corpus/ps_request) was made with it.
// With a second directory, also fuzz_checkpoint's seed there: the page a
// server sends a peer restoring cut 1 of a job with a dense Adam table and
// a sparse Adagrad table (tests/fuzz/corpus/checkpoint).
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <stdlib.h>

#include <filesystem>

#include "common/rpc/wire_codec.h"
#include "fulcrum/v1/ps.pb.h"
#include "server/parameter_server.h"

namespace {

void Write(const std::string& dir, const std::string& name, char kind, fulcrum::wire::Writer w) {
  std::string bytes(1, kind);
  grpc::ByteBuffer buffer = w.Finish();
  std::vector<grpc::Slice> slices;
  (void)buffer.Dump(&slices);
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
}

// A real cut: created, pushed to once, checkpointed, read as a peer would.
int WriteCheckpointSeed(const std::string& dir) {
  char tmp[] = "/tmp/fulcrum-seed-XXXXXX";
  if (mkdtemp(tmp) == nullptr) return 1;
  fulcrum::ParameterServerOptions o;
  o.shard_map = fulcrum::ShardMap::FromServerList("self:1", 8)->ToProto();
  o.data_dir = tmp;
  auto ps = fulcrum::ParameterServer::Create(o);
  if (!ps.ok()) return 1;
  fulcrum::v1::PsJobSpec spec;
  spec.set_job_id("c");
  spec.set_num_workers(1);
  spec.mutable_consistency()->set_model(fulcrum::v1::ConsistencySpec::ASP);
  auto* w = spec.add_tables();
  w->set_name("w");
  w->set_kind(fulcrum::v1::TableSpec::DENSE);
  w->add_shape(40);
  w->set_chunk_elements(16);
  w->mutable_optimizer()->set_kind(fulcrum::v1::OptimizerSpec::ADAM);
  w->mutable_optimizer()->set_learning_rate(0.01f);
  auto* e = spec.add_tables();
  e->set_name("e");
  e->set_kind(fulcrum::v1::TableSpec::SPARSE);
  e->set_dim(2);
  e->mutable_optimizer()->set_kind(fulcrum::v1::OptimizerSpec::ADAGRAD);
  e->mutable_optimizer()->set_learning_rate(0.1f);
  if (!(*ps)->CreateJob(spec).ok()) return 1;
  std::vector<float> g(16, 0.25f);
  std::vector<uint64_t> keys = {3, 1u << 30};
  std::vector<float> rows(keys.size() * 2, -0.5f);
  fulcrum::PushMessage push;
  push.job_id = "c";
  push.worker_id = "w0";
  push.seq = 1;
  push.dense.push_back({"w", 0, fulcrum::DType::kFp32, fulcrum::Payload(g.data(), g.size() * 4)});
  push.sparse.push_back({"e", fulcrum::DType::kFp32, fulcrum::Payload(keys.data(), keys.size() * 8),
                         fulcrum::Payload(rows.data(), rows.size() * 4)});
  fulcrum::PushResult result;
  if (!(*ps)->Push(push, &result).ok()) return 1;
  if (!(*ps)->Checkpoint("c", 1, 0, absl::Seconds(5)).ok()) return 1;
  fulcrum::v1::ReadCheckpointRequest req;
  req.set_job_id("c");
  req.set_cut_id(1);
  auto page = (*ps)->ReadCut(req);
  if (!page.ok()) return 1;
  std::ofstream(dir + "/peer_page", std::ios::binary) << std::string(1, 1) << page->SerializeAsString();
  ps->reset();
  std::filesystem::remove_all(tmp);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 && argc != 3) {
    std::fprintf(stderr, "usage: %s PS_REQUEST_DIR [CHECKPOINT_DIR]\n", argv[0]);
    return 2;
  }
  if (argc == 3 && WriteCheckpointSeed(argv[2]) != 0) {
    std::fprintf(stderr, "%s: could not make the checkpoint seed\n", argv[0]);
    return 1;
  }
  const std::string dir = argv[1];
  std::vector<float> g(32, 0.25f);
  std::vector<uint64_t> keys = {1, 7, 1u << 20};
  std::vector<float> rows(keys.size() * 4, -0.5f);
  fulcrum::PushMessage push;
  push.job_id = "j";
  push.worker_id = "w0";
  push.seq = 1;
  push.dense.push_back({"w", 1, fulcrum::DType::kFp32, fulcrum::Payload(g.data(), g.size() * 4)});
  push.sparse.push_back({"e", fulcrum::DType::kFp32, fulcrum::Payload(keys.data(), keys.size() * 8),
                         fulcrum::Payload(rows.data(), rows.size() * 4)});
  Write(dir, "push", 0, fulcrum::wire::EncodePush(push));
  fulcrum::PullMessage pull;
  pull.job_id = "j";
  pull.worker_id = "w0";
  pull.dense.push_back({"w", 0});
  pull.sparse.push_back({"e", fulcrum::Payload(keys.data(), keys.size() * 8)});
  Write(dir, "pull", 1, fulcrum::wire::EncodePull(pull));
  Write(dir, "stream", 2, fulcrum::wire::EncodeStreamRequest(9, true, fulcrum::wire::EncodePush(push)));
  fulcrum::v1::PsJobSpec spec;
  spec.set_job_id("k");
  spec.set_num_workers(1);
  auto* t = spec.add_tables();
  t->set_name("t");
  t->set_kind(fulcrum::v1::TableSpec::DENSE);
  t->add_shape(10);
  std::ofstream(dir + "/ps_job_spec", std::ios::binary) << std::string(1, 3) << spec.SerializeAsString();
  return 0;
}
