// Writes the binary seeds of fuzz_ps_request into a directory: valid Push
// and Pull messages for job "j" as the wire codec encodes them (a kind byte
// first, as the target reads them), a streaming frame and a PsJobSpec.
// The committed corpus (tests/fuzz/corpus/ps_request) was made with it.
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "common/rpc/wire_codec.h"
#include "fulcrum/v1/ps.pb.h"

namespace {

void Write(const std::string& dir, const std::string& name, char kind, fulcrum::wire::Writer w) {
  std::string bytes(1, kind);
  grpc::ByteBuffer buffer = w.Finish();
  std::vector<grpc::Slice> slices;
  (void)buffer.Dump(&slices);
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
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
