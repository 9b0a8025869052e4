#include "worker/rpc/routing.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace fulcrum::routing {
namespace {

// Groups keyed rows by owner into the packer's parts.
void AddSparse(const ShardMap& m, size_t esize, Packer<PushPart>& packer, const TableInfo* t, const uint64_t* keys,
               size_t n, const float* values) {
  const size_t row_bytes = 8 + size_t{t->dim} * esize;
  std::vector<PushPart::Sparse*> cur(m.num_servers(), nullptr);
  for (size_t k = 0; k < n; ++k) {
    const uint32_t s = m.owner(VShardOfKey(t->name_hash, keys[k], m.num_virtual_shards()));
    bool fresh;
    PushPart& part = packer.For(s, row_bytes, &fresh);
    if (fresh || cur[s] == nullptr) {
      cur[s] = &part.sparse.emplace_back();
      cur[s]->table = t;
    }
    cur[s]->keys.push_back(keys[k]);
    cur[s]->values.insert(cur[s]->values.end(), values + k * t->dim, values + (k + 1) * t->dim);
  }
}

}  // namespace

absl::StatusOr<std::shared_ptr<const JobInfo>> MakeJobInfo(const v1::PsJobSpec& spec) {
  auto info = std::make_shared<JobInfo>();
  info->spec = spec;
  info->synchronous = spec.consistency().model() != v1::ConsistencySpec::ASP;
  for (const v1::TableSpec& t : spec.tables()) {
    TableInfo ti;
    ti.name = t.name();
    ti.dense = t.kind() != v1::TableSpec::SPARSE;
    ti.name_hash = HashTableName(t.name());
    if (ti.dense) {
      ti.num_elements = 1;
      for (int64_t d : t.shape()) ti.num_elements *= static_cast<uint64_t>(std::max<int64_t>(d, 0));
      ti.chunk_elements = ChunkElements(t);
      ti.num_chunks =
          static_cast<uint32_t>((ti.num_elements + ti.chunk_elements - 1) / ti.chunk_elements);
    } else {
      ti.dim = t.dim();
    }
    info->tables.emplace(t.name(), ti);
  }
  return std::shared_ptr<const JobInfo>(std::move(info));
}

absl::StatusOr<Parts<PushPart>> PlanPush(const ShardMap& m, const JobInfo& job, const PushBatch& batch, DType wire,
                                         size_t budget) {
  const size_t esize = DTypeSize(wire);
  Packer<PushPart> packer(m.num_servers(), budget);
  for (const DenseGradient& g : batch.dense) {
    auto it = job.tables.find(g.table);
    if (it == job.tables.end() || !it->second.dense) {
      return absl::InvalidArgumentError(absl::StrCat("job '", job.spec.job_id(), "' has no dense table '", g.table, "'"));
    }
    const TableInfo& t = it->second;
    if (g.size != t.num_elements) {
      return absl::InvalidArgumentError(
          absl::StrCat("table '", g.table, "' has ", t.num_elements, " elements; gradient has ", g.size));
    }
    for (uint32_t c = 0; c < t.num_chunks; ++c) {
      const uint32_t server = m.owner(VShardOfChunk(t.name_hash, c, m.num_virtual_shards()));
      packer.For(server, size_t{t.ChunkLength(c)} * esize)
          .dense.push_back({&t, c, g.data + uint64_t{c} * t.chunk_elements});
    }
  }
  for (const SparseGradient& g : batch.sparse) {
    auto it = job.tables.find(g.table);
    if (it == job.tables.end() || it->second.dense) {
      return absl::InvalidArgumentError(absl::StrCat("job '", job.spec.job_id(), "' has no sparse table '", g.table, "'"));
    }
    AddSparse(m, esize, packer, &it->second, g.keys, g.num_keys, g.values);
  }
  return packer.Take(batch.last);
}

Parts<PushPart> ReslicePush(const ShardMap& m, const PushPart& part, DType wire, size_t budget) {
  Packer<PushPart> packer(m.num_servers(), budget);
  const size_t esize = DTypeSize(wire);
  for (const PushPart::Dense& d : part.dense) {
    const uint32_t srv = m.owner(VShardOfChunk(d.table->name_hash, d.chunk, m.num_virtual_shards()));
    packer.For(srv, size_t{d.table->ChunkLength(d.chunk)} * esize).dense.push_back(d);
  }
  for (const PushPart::Sparse& sp : part.sparse) {
    AddSparse(m, esize, packer, sp.table, sp.keys.data(), sp.keys.size(), sp.values.data());
  }
  return packer.Take(false);
}

Parts<PullPart> PlanPull(const ShardMap& m, const std::vector<PullPart::Dense>& dense,
                         const std::vector<PullPart::Sparse>& sparse, DType wire, size_t budget) {
  const size_t esize = DTypeSize(wire);
  Packer<PullPart> packer(m.num_servers(), budget);
  for (const PullPart::Dense& d : dense) {
    const uint32_t server = m.owner(VShardOfChunk(d.table->name_hash, d.chunk, m.num_virtual_shards()));
    packer.For(server, size_t{d.table->ChunkLength(d.chunk)} * esize).dense.push_back(d);
  }
  for (const PullPart::Sparse& sp : sparse) {
    const size_t row_bytes = 8 + size_t{sp.table->dim} * esize;
    std::vector<PullPart::Sparse*> cur(m.num_servers(), nullptr);
    for (size_t k = 0; k < sp.keys.size(); ++k) {
      const uint32_t s = m.owner(VShardOfKey(sp.table->name_hash, sp.keys[k], m.num_virtual_shards()));
      bool fresh;
      PullPart& part = packer.For(s, row_bytes, &fresh);
      if (fresh || cur[s] == nullptr) {
        cur[s] = &part.sparse.emplace_back();
        cur[s]->table = sp.table;
      }
      cur[s]->keys.push_back(sp.keys[k]);
      cur[s]->out.push_back(sp.out[k]);
    }
  }
  return packer.Take(false);
}

}  // namespace fulcrum::routing
