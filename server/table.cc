#include "server/table.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/float_env.h"
#include "common/shard_map.h"
#include "common/status_macros.h"

namespace fulcrum {
namespace {

// A chunk must fit one 4 MiB message with room for framing.
constexpr uint32_t kMaxChunkElements = 1 << 20;
constexpr uint64_t kMaxDenseElements = uint64_t{1} << 36;
constexpr uint32_t kMaxSparseDim = 1 << 16;

float ToUnit(uint64_t bits) {  // [0, 1) with 24 bits of randomness
  return static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);
}

// A standard normal value from the 64 bits `s` (and, rarely, bits mixed
// from them): Marsaglia and Tsang's ziggurat of 128 layers (2000). About
// 99% of values take one table lookup and a compare, so a new row of a
// NORMAL table costs a few nanoseconds a float rather than a logarithm, a
// square root and a cosine. The layer comes from the high 32 bits and the
// value from the low 32, so they are independent.
struct Ziggurat {
  uint32_t k[128];
  float w[128], f[128];
  Ziggurat() {
    const double m = 2147483648.0;  // 2^31
    const double v = 9.91256303526217e-3;
    double d = 3.442619855899, t = d;
    const double q = v / std::exp(-0.5 * d * d);
    k[0] = static_cast<uint32_t>(d / q * m);
    k[1] = 0;
    w[0] = static_cast<float>(q / m);
    w[127] = static_cast<float>(d / m);
    f[0] = 1.0f;
    f[127] = static_cast<float>(std::exp(-0.5 * d * d));
    for (int i = 126; i >= 1; --i) {
      d = std::sqrt(-2.0 * std::log(v / d + std::exp(-0.5 * d * d)));
      k[i + 1] = static_cast<uint32_t>(d / t * m);
      t = d;
      f[i] = static_cast<float>(std::exp(-0.5 * d * d));
      w[i] = static_cast<float>(d / m);
    }
  }
};

}  // namespace

float StandardNormal(uint64_t s) {
  static const Ziggurat z;
  constexpr uint64_t kStep = 0x9e3779b97f4a7c15ull;
  constexpr float kTail = 3.442620f;  // where the base layer's tail starts
  for (;;) {
    const int32_t hz = static_cast<int32_t>(static_cast<uint32_t>(s));
    const uint32_t iz = static_cast<uint32_t>(s >> 32) & 127;
    const uint32_t magnitude = hz < 0 ? 0u - static_cast<uint32_t>(hz) : static_cast<uint32_t>(hz);
    const float x = static_cast<float>(hz) * z.w[iz];
    if (magnitude < z.k[iz]) return x;  // inside the layer's rectangle
    s = Mix64(s + kStep);
    if (iz == 0) {
      // Beyond the base layer: Marsaglia's exact tail.
      float xt, yt;
      do {
        xt = -std::log(1.0f - ToUnit(s)) / kTail;
        s = Mix64(s + kStep);
        yt = -std::log(1.0f - ToUnit(s));
        s = Mix64(s + kStep);
      } while (yt + yt < xt * xt);
      return hz > 0 ? kTail + xt : -kTail - xt;
    }
    if (z.f[iz] + ToUnit(s) * (z.f[iz - 1] - z.f[iz]) < std::exp(-0.5f * x * x)) return x;
    s = Mix64(s + kStep);  // rejected: a new candidate
  }
}

namespace {

absl::StatusOr<Initializer> InitializerFromProto(const v1::TableSpec& spec) {
  const auto& p = spec.initializer();
  Initializer init;
  init.kind = p.kind() == v1::InitializerSpec::KIND_UNSPECIFIED ? v1::InitializerSpec::ZEROS
                                                                 : p.kind();
  init.a = p.a();
  init.b = p.b();
  init.seed = p.seed();
  if (!v1::InitializerSpec::Kind_IsValid(init.kind)) {
    return absl::InvalidArgumentError(absl::StrCat("table '", spec.name(), "': initializer.kind ",
                                                   static_cast<int>(init.kind),
                                                   " is not ZEROS, CONSTANT, UNIFORM or NORMAL"));
  }
  if (!std::isfinite(init.a) || !std::isfinite(init.b)) {
    return absl::InvalidArgumentError(
        absl::StrCat("table '", spec.name(), "': initializer a and b must be finite"));
  }
  if (init.kind == v1::InitializerSpec::UNIFORM && !(init.a < init.b)) {
    return absl::InvalidArgumentError(absl::StrCat("table '", spec.name(),
                                                   "': UNIFORM initializer needs a < b, got [",
                                                   init.a, ", ", init.b, ")"));
  }
  if (init.kind == v1::InitializerSpec::NORMAL && init.b < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "table '", spec.name(), "': NORMAL initializer needs stddev b >= 0, got ", init.b));
  }
  return init;
}

}  // namespace

bool MemoryQuota::TryAdd(uint64_t bytes, uint64_t* in_use) {
  uint64_t cur = used_.load(std::memory_order_relaxed);
  do {
    if (bytes > limit_ || cur > limit_ - bytes) {
      *in_use = cur;
      return false;
    }
  } while (!used_.compare_exchange_weak(cur, cur + bytes, std::memory_order_relaxed));
  return true;
}

absl::Status MemoryQuota::Exhausted(absl::string_view what, uint64_t bytes, uint64_t in_use) const {
  if (job_id_.empty()) {
    return absl::ResourceExhaustedError(absl::StrCat("this server's parameter memory limit of ", limit_,
                                                     " bytes (--memory_limit_bytes) is reached: ", what, " needs ",
                                                     bytes, " bytes, ", in_use, " already in use by all jobs"));
  }
  return absl::ResourceExhaustedError(absl::StrCat("job '", job_id_, "' would exceed its parameter memory quota of ",
                                                   limit_, " bytes on this server: ", what, " needs ", bytes,
                                                   " bytes, ", in_use, " already in use"));
}

absl::Status MemoryQuota::Reserve(uint64_t bytes, absl::string_view what) {
  uint64_t in_use;
  if (!TryAdd(bytes, &in_use)) return Exhausted(what, bytes, in_use);
  if (pool_ != nullptr && !pool_->TryAdd(bytes, &in_use)) {
    used_.fetch_sub(bytes, std::memory_order_relaxed);
    return pool_->Exhausted(absl::StrCat("job '", job_id_, "': ", what), bytes, in_use);
  }
  return absl::OkStatus();
}

void Initializer::Fill(uint64_t table_hash, uint64_t stream, uint64_t offset, float* out,
                       size_t n) const {
  switch (kind) {
    case v1::InitializerSpec::CONSTANT:
      for (size_t i = 0; i < n; ++i) out[i] = a;
      return;
    case v1::InitializerSpec::UNIFORM: {
      const uint64_t base = Mix64(seed ^ table_hash) ^ Mix64(stream);
      for (size_t i = 0; i < n; ++i) out[i] = a + (b - a) * ToUnit(Mix64(base + offset + i));
      return;
    }
    case v1::InitializerSpec::NORMAL: {
      const uint64_t base = Mix64(seed ^ table_hash) ^ Mix64(stream);
      for (size_t i = 0; i < n; ++i) out[i] = a + b * StandardNormal(Mix64(base + offset + i));
      return;
    }
    default:
      std::memset(out, 0, n * sizeof(float));
  }
}

Table::Table(std::string name, bool dense, OptimizerConfig opt, Initializer init)
    : name_(std::move(name)),
      name_hash_(HashTableName(name_)),
      dense_(dense),
      optimizer_(opt),
      init_(init) {}

// ---------------------------------------------------------------- dense

absl::StatusOr<std::unique_ptr<DenseTable>> DenseTable::Create(const v1::TableSpec& spec,
                                                               MemoryQuota* quota) {
  ASSIGN_OR_RETURN(OptimizerConfig opt, OptimizerConfigFromProto(spec.optimizer(), spec.name()));
  ASSIGN_OR_RETURN(Initializer init, InitializerFromProto(spec));
  if (spec.shape_size() == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dense table '", spec.name(), "' has an empty shape"));
  }
  uint64_t elements = 1;
  for (int i = 0; i < spec.shape_size(); ++i) {
    const int64_t d = spec.shape(i);
    if (d <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("dense table '", spec.name(), "': shape[", i, "] = ", d, " must be > 0"));
    }
    if (static_cast<uint64_t>(d) > kMaxDenseElements || elements * static_cast<uint64_t>(d) > kMaxDenseElements) {
      return absl::ResourceExhaustedError(absl::StrCat("dense table '", spec.name(), "': shape[", i, "] = ", d,
                                                       " takes the table past the limit of 2^36 (", kMaxDenseElements,
                                                       ") elements per table"));
    }
    elements *= static_cast<uint64_t>(d);
  }
  const uint32_t chunk = ChunkElements(spec);
  if (chunk > kMaxChunkElements) {
    return absl::ResourceExhaustedError(absl::StrCat("dense table '", spec.name(), "': chunk_elements ", chunk,
                                                     " exceeds the limit of ", kMaxChunkElements,
                                                     " elements per chunk"));
  }
  // The chunk index (a pointer per chunk) is allocated with the table:
  // bound it before it is, whatever the quota.
  const uint64_t chunks = (elements + chunk - 1) / chunk;
  if (chunks > kMaxDenseChunks) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "dense table '", spec.name(), "': ", elements, " elements in chunks of ", chunk, " make ", chunks,
        " chunks, past the limit of ", kMaxDenseChunks, " chunks per job; raise chunk_elements"));
  }
  return std::unique_ptr<DenseTable>(new DenseTable(spec, opt, init, elements, chunk, quota));
}

DenseTable::DenseTable(const v1::TableSpec& spec, OptimizerConfig opt, Initializer init,
                       uint64_t elements, uint32_t chunk_elements, MemoryQuota* quota)
    : Table(spec.name(), true, opt, init),
      num_elements_(elements),
      chunk_elements_(chunk_elements),
      num_chunks_(static_cast<uint32_t>((elements + chunk_elements - 1) / chunk_elements)),
      quota_(quota),
      chunks_(new std::atomic<Chunk*>[num_chunks_]) {
  for (uint32_t i = 0; i < num_chunks_; ++i) chunks_[i].store(nullptr, std::memory_order_relaxed);
}

DenseTable::~DenseTable() {
  absl::MutexLock lock(&create_mu_);
  for (uint32_t i = 0; i < num_chunks_; ++i) {
    if (chunks_[i].load(std::memory_order_relaxed) != nullptr) quota_->Release(ChunkBytes(i));
  }
}

uint32_t DenseTable::ChunkLength(uint32_t chunk) const {
  const uint64_t begin = uint64_t{chunk} * chunk_elements_;
  return static_cast<uint32_t>(std::min<uint64_t>(chunk_elements_, num_elements_ - begin));
}

uint64_t DenseTable::ChunkBytes(uint32_t chunk) const {
  return uint64_t{ChunkLength(chunk)} * (1 + num_slots()) * sizeof(float);
}

absl::Status DenseTable::EnsureChunk(uint32_t chunk) { return GetChunk(chunk).status(); }

absl::StatusOr<DenseTable::Chunk*> DenseTable::GetChunk(uint32_t index, bool initialize) {
  Chunk* c = chunks_[index].load(std::memory_order_acquire);
  if (c != nullptr) return c;
  absl::MutexLock lock(&create_mu_);
  c = chunks_[index].load(std::memory_order_relaxed);
  if (c != nullptr) return c;
  RETURN_IF_ERROR(quota_->Reserve(ChunkBytes(index),
                                  absl::StrCat("chunk ", index, " of table '", name_, "'")));
  auto chunk = std::make_unique<Chunk>();
  const uint32_t n = ChunkLength(index);
  const int slots = num_slots();
  std::shared_ptr<float[]> block(new float[size_t{n} * (1 + slots)]);
  if (initialize) {
    init_.Fill(name_hash_, 0, uint64_t{index} * chunk_elements_, block.get(), n);
    for (int s = 0; s < slots; ++s) {
      const float v = InitialSlotValue(optimizer_, s);
      std::fill_n(block.get() + size_t{n} * (1 + s), n, v);
    }
  }
  {
    absl::MutexLock chunk_lock(&chunk->mu);
    chunk->block = std::move(block);
  }
  c = chunk.get();
  owned_.push_back(std::move(chunk));
  chunks_[index].store(c, std::memory_order_release);
  return c;
}

absl::Status DenseTable::Read(uint32_t index, DType dtype, void* out) {
  ASSIGN_OR_RETURN(Chunk * c, GetChunk(index));
  absl::MutexLock lock(&c->mu);
  EncodeFloats(c->block.get(), ChunkLength(index), dtype, out);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const float[]>> DenseTable::Snapshot(uint32_t index) {
  ASSIGN_OR_RETURN(Chunk * c, GetChunk(index));
  absl::MutexLock lock(&c->mu);
  return std::shared_ptr<const float[]>(c->block);
}

float* DenseTable::Writable(Chunk* c, uint32_t index) {
  // Under c->mu nobody can take a new reference, so a count of 1 means no
  // response is reading this block and it can be updated in place.
  if (c->block.use_count() > 1) {
    const size_t floats = size_t{ChunkLength(index)} * (1 + num_slots());
    std::shared_ptr<float[]> copy(new float[floats]);
    std::memcpy(copy.get(), c->block.get(), floats * sizeof(float));
    c->block = std::move(copy);
  }
  return c->block.get();
}

absl::Status DenseTable::Apply(uint32_t index, const float* g, uint64_t step, float lr_scale) {
  ASSIGN_OR_RETURN(Chunk * c, GetChunk(index));
  const OptimizerConfig opt = optimizer_.AtStep(step, lr_scale);
  ScopedFlushDenormals flush;
  absl::MutexLock lock(&c->mu);
  ApplyOptimizer(opt, Writable(c, index), ChunkLength(index), g, ++c->updates);
  return absl::OkStatus();
}

absl::Status DenseTable::Apply(uint32_t index, const Payload& g, DType dtype, uint64_t step, float lr_scale) {
  ASSIGN_OR_RETURN(Chunk * c, GetChunk(index));
  const size_t n = ChunkLength(index);
  const OptimizerConfig opt = optimizer_.AtStep(step, lr_scale);
  ScopedFlushDenormals flush;
  absl::MutexLock lock(&c->mu);
  const uint64_t updates = ++c->updates;
  float* weights = Writable(c, index);
  ForEachFloatBlock(g, dtype, n, [&](const float* block, size_t begin, size_t len) {
    ApplyOptimizerRange(opt, weights, n, begin, len, block, updates);
    return true;
  });
  return absl::OkStatus();
}

std::vector<DenseTable::ChunkState> DenseTable::Capture() const {
  std::vector<ChunkState> out;
  for (uint32_t i = 0; i < num_chunks_; ++i) {
    Chunk* c = chunks_[i].load(std::memory_order_acquire);
    if (c == nullptr) continue;
    absl::MutexLock lock(&c->mu);
    out.push_back({i, c->updates, std::shared_ptr<const float[]>(c->block)});
  }
  return out;
}

absl::Status DenseTable::Restore(uint32_t index, uint64_t updates, uint32_t length, uint32_t slots,
                                 const void* block) {
  if (index >= num_chunks_) {
    return absl::DataLossError(absl::StrCat("checkpoint record of table '", name_, "' names chunk ", index,
                                            "; the table has ", num_chunks_, " chunks"));
  }
  if (length != ChunkLength(index) || slots != static_cast<uint32_t>(num_slots())) {
    return absl::DataLossError(absl::StrCat("checkpoint record of table '", name_, "' chunk ", index, " holds ",
                                            length, " elements with ", slots, " optimizer slots; the table's chunk has ",
                                            ChunkLength(index), " elements with ", num_slots()));
  }
  ASSIGN_OR_RETURN(Chunk * c, GetChunk(index, /*initialize=*/false));
  absl::MutexLock lock(&c->mu);
  std::memcpy(Writable(c, index), block, ChunkBytes(index));
  c->updates = updates;
  return absl::OkStatus();
}

uint32_t DenseTable::materialized_chunks() const {
  absl::MutexLock lock(&create_mu_);
  return static_cast<uint32_t>(owned_.size());
}

// ---------------------------------------------------------------- sparse

absl::StatusOr<std::unique_ptr<SparseTable>> SparseTable::Create(const v1::TableSpec& spec,
                                                                 uint32_t num_virtual_shards,
                                                                 MemoryQuota* quota) {
  ASSIGN_OR_RETURN(OptimizerConfig opt, OptimizerConfigFromProto(spec.optimizer(), spec.name()));
  ASSIGN_OR_RETURN(Initializer init, InitializerFromProto(spec));
  if (spec.dim() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("sparse table '", spec.name(), "': dim 0 must be at least 1"));
  }
  if (spec.dim() > kMaxSparseDim) {
    return absl::ResourceExhaustedError(absl::StrCat("sparse table '", spec.name(), "': dim ", spec.dim(),
                                                     " exceeds the limit of ", kMaxSparseDim, " per row"));
  }
  if (spec.shape_size() != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sparse table '", spec.name(), "' has a shape; sparse tables take only dim"));
  }
  const uint64_t row_bytes = uint64_t{spec.dim()} * (1 + NumSlots(opt.kind)) * sizeof(float);
  ASSIGN_OR_RETURN(Lifecycle life, LifecycleFromProto(spec, num_virtual_shards, row_bytes));
  return std::unique_ptr<SparseTable>(new SparseTable(spec, opt, init, life, num_virtual_shards, quota));
}

absl::StatusOr<std::unique_ptr<Table>> CreateTable(const v1::TableSpec& spec,
                                                   uint32_t num_virtual_shards, MemoryQuota* quota) {
  if (spec.name().empty() || spec.name().size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("table name '", spec.name(), "' must be 1 to 128 characters"));
  }
  switch (spec.kind()) {
    case v1::TableSpec::DENSE: {
      ASSIGN_OR_RETURN(auto t, DenseTable::Create(spec, quota));
      return std::unique_ptr<Table>(std::move(t));
    }
    case v1::TableSpec::SPARSE: {
      ASSIGN_OR_RETURN(auto t, SparseTable::Create(spec, num_virtual_shards, quota));
      return std::unique_ptr<Table>(std::move(t));
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("table '", spec.name(), "': kind must be DENSE or SPARSE"));
  }
}

}  // namespace fulcrum
