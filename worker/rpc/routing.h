// Routing and slicing for GrpcPsClient, without a transport: which server
// owns each dense chunk and sparse key under a shard map, and how a push's
// or pull's items pack into per-server messages of a bounded size. Pure
// functions of their inputs (routing_test checks them without gRPC).
#ifndef FULCRUM_WORKER_RPC_ROUTING_H_
#define FULCRUM_WORKER_RPC_ROUTING_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "common/shard_map.h"
#include "fulcrum/v1/ps.pb.h"
#include "worker/ps_client.h"

namespace fulcrum::routing {

struct TableInfo {
  std::string name;
  bool dense = true;
  uint64_t num_elements = 0;
  uint32_t chunk_elements = 0;
  uint32_t num_chunks = 0;
  uint32_t dim = 0;
  uint64_t name_hash = 0;
  uint32_t ChunkLength(uint32_t c) const {
    const uint64_t begin = uint64_t{c} * chunk_elements;
    return static_cast<uint32_t>(std::min<uint64_t>(chunk_elements, num_elements - begin));
  }
};

struct JobInfo {
  v1::PsJobSpec spec;
  bool synchronous = true;  // BSP or SSP: a push's parts must not be re-routed mid-step
  absl::flat_hash_map<std::string, TableInfo> tables;
};

// The routing view of a job's spec: each table's chunking or row width.
absl::StatusOr<std::shared_ptr<const JobInfo>> MakeJobInfo(const v1::PsJobSpec& spec);

// One part of a push to one server. Owns converted or gathered payloads.
struct PushPart {
  struct Dense {
    const TableInfo* table;
    uint32_t chunk;
    const float* data;
  };
  struct Sparse {
    const TableInfo* table;
    std::vector<uint64_t> keys;
    std::vector<float> values;
  };
  std::vector<Dense> dense;
  std::vector<Sparse> sparse;
  float lr_scale = 1.0f;  // PushBatch::lr_scale
  uint64_t samples = 0;   // PushBatch::samples
  bool unclocked = false;  // PushBatch::unclocked
  size_t bytes = 0;
};

// One pull request to one server, with where to put each answer.
struct PullPart {
  struct Dense {
    const TableInfo* table;
    uint32_t chunk;
    float* out;  // chunk start
  };
  struct Sparse {
    const TableInfo* table;
    std::vector<uint64_t> keys;
    std::vector<float*> out;  // row destination per key
  };
  std::vector<Dense> dense;
  std::vector<Sparse> sparse;
  bool unclocked = false;  // PullBatch::unclocked
  bool exact = false;      // PullBatch::exact
  bool prefetch = false;   // a hint (PsClient::Prefetch): nothing delivered
  size_t bytes = 0;
};

// Packs a call's items into per-server messages of at most `budget` bytes.
template <typename Part>
class Packer {
 public:
  Packer(size_t servers, size_t budget) : per_server_(servers), budget_(budget) {}

  // The part `bytes` more go into for `server`: the current one, or a new
  // one when they would not fit (then *fresh is set).
  Part& For(uint32_t server, size_t bytes, bool* fresh = nullptr) {
    auto& parts = per_server_[server];
    const bool start = parts.empty() || parts.back()->bytes + bytes > budget_;
    if (start) parts.push_back(std::make_shared<Part>());
    if (fresh) *fresh = start;
    parts.back()->bytes += bytes;
    return *parts.back();
  }

  // The parts, server by server. With `every_server`, a server with nothing
  // gets one empty part (BSP/SSP servers count every worker's parts).
  std::vector<std::pair<uint32_t, std::shared_ptr<Part>>> Take(bool every_server) {
    std::vector<std::pair<uint32_t, std::shared_ptr<Part>>> out;
    for (uint32_t s = 0; s < per_server_.size(); ++s) {
      if (per_server_[s].empty() && every_server) per_server_[s].push_back(std::make_shared<Part>());
      for (auto& p : per_server_[s]) out.emplace_back(s, std::move(p));
    }
    return out;
  }

 private:
  std::vector<std::vector<std::shared_ptr<Part>>> per_server_;
  const size_t budget_;
};

template <typename Part>
using Parts = std::vector<std::pair<uint32_t, std::shared_ptr<Part>>>;

// A push's items by owner, in parts of at most `budget` bytes of `wire`
// values (one part can exceed it by one item). With batch.last, every
// server gets at least one part, empty if need be: each server hears from
// every worker each step, so its per-rank clocks stay exact.
// INVALID_ARGUMENT naming the table for an unknown table or a dense
// gradient whose size is not the table's.
absl::StatusOr<Parts<PushPart>> PlanPush(const ShardMap& m, const JobInfo& job, const PushBatch& batch, DType wire,
                                         size_t budget);
// A rejected part's items re-sliced under a newer map (ASP: parts are
// independent); its rate and samples are the caller's to copy.
Parts<PushPart> ReslicePush(const ShardMap& m, const PushPart& part, DType wire, size_t budget);
// A pull's items by owner, in parts of at most `budget` bytes.
Parts<PullPart> PlanPull(const ShardMap& m, const std::vector<PullPart::Dense>& dense,
                         const std::vector<PullPart::Sparse>& sparse, DType wire, size_t budget);

}  // namespace fulcrum::routing

#endif  // FULCRUM_WORKER_RPC_ROUTING_H_
