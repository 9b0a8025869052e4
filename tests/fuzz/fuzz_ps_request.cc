// libFuzzer target: what a parameter server does with bytes from the
// network. The first byte picks the request kind:
//   0 Push, 1 Pull, 2 a streaming-RPC frame: decoded by the zero-copy wire
//     codec, then (when it decodes) handed to a ParameterServer holding a
//     job "j" (dense "w", sparse "e"), so validation runs on it too;
//   3 a PsJobSpec (CreateJob's request): parsed, created, deleted.
// The server's memory quota is small, so no input can allocate much.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "common/logging.h"
#include "common/rpc/wire_codec.h"
#include "google/protobuf/stubs/logging.h"
#include "server/parameter_server.h"

namespace {

using fulcrum::ParameterServer;

fulcrum::v1::PsJobSpec JobJ() {
  fulcrum::v1::PsJobSpec spec;
  spec.set_job_id("j");
  spec.set_num_workers(2);
  spec.mutable_consistency()->set_model(fulcrum::v1::ConsistencySpec::ASP);
  auto* w = spec.add_tables();
  w->set_name("w");
  w->set_kind(fulcrum::v1::TableSpec::DENSE);
  w->add_shape(96);
  w->set_chunk_elements(32);
  w->mutable_optimizer()->set_kind(fulcrum::v1::OptimizerSpec::ADAM);
  w->mutable_optimizer()->set_learning_rate(0.01f);
  auto* e = spec.add_tables();
  e->set_name("e");
  e->set_kind(fulcrum::v1::TableSpec::SPARSE);
  e->set_dim(4);
  e->mutable_optimizer()->set_kind(fulcrum::v1::OptimizerSpec::ADAGRAD);
  e->mutable_optimizer()->set_learning_rate(0.1f);
  return spec;
}

ParameterServer* Server() {
  static ParameterServer* ps = [] {
    fulcrum::ParameterServerOptions o;
    o.shard_map = fulcrum::ShardMap::FromServerList("self:1", 8)->ToProto();
    o.default_quota_bytes = 4 << 20;
    o.max_wait = absl::Milliseconds(1);
    return ParameterServer::Create(o)->release();
  }();
  return ps;
}

void ResetJob() {
  (void)Server()->DeleteJob("j");
  (void)Server()->CreateJob(JobJ());
}

}  // namespace

// Quiet: job creation logs, and protobuf logs invalid UTF-8 in strings.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fulcrum::SetMinLogSeverity(fulcrum::LogSeverity::kError);
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static int calls = 0;
  if (calls++ % 512 == 0) ResetJob();  // sparse rows accumulate: start afresh now and then
  if (size < 1) return 0;
  const uint8_t kind = data[0] % 4;
  const fulcrum::Payload p(data + 1, size - 1);
  switch (kind) {
    case 0: {
      fulcrum::PushMessage m;
      if (fulcrum::wire::DecodePush(p, &m).ok()) {
        fulcrum::PushResult r;
        (void)Server()->Push(m, &r);
      }
      break;
    }
    case 1: {
      auto m = std::make_shared<fulcrum::PullMessage>();
      if (fulcrum::wire::DecodePull(p, m.get()).ok()) {
        bool done = false;
        Server()->Pull(m, absl::Now() + absl::Seconds(1), [&](absl::StatusOr<fulcrum::PullResult>) { done = true; });
        // ASP pulls answer at once; anything else expires within max_wait.
        for (int i = 0; i < 1000 && !done; ++i) absl::SleepFor(absl::Milliseconds(1));
      }
      break;
    }
    case 2: {
      fulcrum::wire::StreamRequestView v;
      (void)fulcrum::wire::DecodeStreamRequest(p, &v);
      break;
    }
    default: {
      fulcrum::v1::PsJobSpec spec;
      if (spec.ParseFromArray(data + 1, static_cast<int>(size - 1)) && spec.job_id() != "j") {
        if (Server()->CreateJob(spec).ok()) (void)Server()->DeleteJob(spec.job_id());
      }
      break;
    }
  }
  return 0;
}
