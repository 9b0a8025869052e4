// libFuzzer target: what a parameter server does with a checkpoint page a
// peer sends while it restores a cut (ReadCheckpoint's response: the cut's
// meta with the job spec, and records; docs/checkpoint-format.md). The
// first byte's low bit asks for every record's checksum to be recomputed,
// so the record decoder and the tables' restore run on the fuzzed bytes
// rather than stopping at "checksum mismatch"; the rest is the serialized
// ReadCheckpointResponse. The server's memory limit is small, so no spec
// or record can make it allocate much.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

#include "common/checkpoint_record.h"
#include "common/logging.h"
#include "google/protobuf/stubs/logging.h"
#include "server/parameter_server.h"

namespace {

using fulcrum::ParameterServer;

ParameterServer* Server() {
  static ParameterServer* ps = [] {
    fulcrum::ParameterServerOptions o;
    o.shard_map = fulcrum::ShardMap::FromServerList("self:1", 8)->ToProto();
    o.default_quota_bytes = 4 << 20;
    o.memory_limit_bytes = 32 << 20;
    o.max_wait = absl::Milliseconds(1);
    return ParameterServer::Create(o)->release();
  }();
  return ps;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fulcrum::SetMinLogSeverity(fulcrum::LogSeverity::kError);
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  fulcrum::v1::ReadCheckpointResponse page;
  if (!page.ParseFromArray(data + 1, static_cast<int>(size - 1))) return 0;
  const uint32_t format = page.meta().format();
  if ((data[0] & 1) != 0 && fulcrum::KnownFormat(format)) {
    for (fulcrum::v1::CheckpointRecord& r : *page.mutable_records()) {
      std::string* v = r.mutable_value();
      if (v->size() < 4) continue;
      const uint32_t crc = fulcrum::CheckpointCrc(format, v->data(), v->size() - 4);
      std::memcpy(v->data() + v->size() - 4, &crc, 4);
    }
  }
  // The page answers the first read (the meta, then its records); a next
  // page, when it names one, is empty.
  int reads = 0;
  ParameterServer::CutReader peer =
      [&](const fulcrum::v1::ReadCheckpointRequest&) -> absl::StatusOr<fulcrum::v1::ReadCheckpointResponse> {
    if (reads++ == 0) return page;
    return fulcrum::v1::ReadCheckpointResponse();
  };
  const std::string job = page.meta().spec().job_id().empty() ? "c" : page.meta().spec().job_id();
  (void)Server()->Restore(job, page.meta().cut_id(), {peer});
  (void)Server()->DeleteJob(job);
  return 0;
}
