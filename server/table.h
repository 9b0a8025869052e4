// Parameter tables held by one server for one job.
//
// DenseTable: a tensor split into fixed-size chunks; this server materializes
// the chunks whose virtual shard it owns. SparseTable: rows of `dim` floats
// keyed by uint64, partitioned by virtual shard, created on first touch.
// Each chunk / partition has its own lock, so updates to different chunks or
// shards proceed in parallel. Initial values are a pure function of (seed,
// table, element index or key), so placement never changes them.
#ifndef FULCRUM_SERVER_TABLE_H_
#define FULCRUM_SERVER_TABLE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/checkpoint_record.h"
#include "common/dtype.h"
#include "fulcrum/v1/common.pb.h"
#include "server/cold_tier.h"
#include "server/optimizer.h"

namespace fulcrum {

class ColdTier;
struct ColdRows;

// Bytes of weights and optimizer state a job may hold on this server. A
// job's quota also draws from `pool`, the server's memory limit shared by
// all its jobs (ParameterServerOptions::memory_limit_bytes), so jobs whose
// quotas add up to more than the machine has fail RESOURCE_EXHAUSTED
// instead of getting the server OOM-killed. A quota with an empty job id is
// such a pool.
class MemoryQuota {
 public:
  MemoryQuota(std::string job_id, uint64_t limit, std::shared_ptr<MemoryQuota> pool = nullptr)
      : job_id_(std::move(job_id)), limit_(limit), pool_(std::move(pool)) {}
  // RESOURCE_EXHAUSTED naming the quota (or the server's limit) when
  // `bytes` do not fit; nothing is reserved then.
  absl::Status Reserve(uint64_t bytes, absl::string_view what);
  // Reserve's two halves, for callers that build `what` only on failure:
  // adds `bytes` if they fit (this quota only, not its pool), else returns
  // false with the bytes in use; and the error naming this quota.
  bool TryAdd(uint64_t bytes, uint64_t* in_use);
  absl::Status Exhausted(absl::string_view what, uint64_t bytes, uint64_t in_use) const;
  // Counts `bytes` even past the limit (what must not be refused, such as
  // the gradients that complete the step every worker waits for).
  void Charge(uint64_t bytes) {
    used_.fetch_add(bytes, std::memory_order_relaxed);
    if (pool_ != nullptr) pool_->Charge(bytes);
  }
  void Release(uint64_t bytes) {
    used_.fetch_sub(bytes, std::memory_order_relaxed);
    if (pool_ != nullptr) pool_->Release(bytes);
  }
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }
  uint64_t limit() const { return limit_; }
  const std::shared_ptr<MemoryQuota>& pool() const { return pool_; }

 private:
  const std::string job_id_;
  const uint64_t limit_;
  const std::shared_ptr<MemoryQuota> pool_;
  std::atomic<uint64_t> used_{0};
};

// Bytes held in a pool for as long as this lives (movable, not copyable).
class PoolHold {
 public:
  PoolHold() = default;
  PoolHold(std::shared_ptr<MemoryQuota> pool, uint64_t bytes) : pool_(std::move(pool)), bytes_(bytes) {}
  PoolHold(PoolHold&& o) noexcept : pool_(std::move(o.pool_)), bytes_(std::exchange(o.bytes_, 0)) {}
  PoolHold& operator=(PoolHold&& o) noexcept {
    if (this != &o) {
      Reset();
      pool_ = std::move(o.pool_);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  ~PoolHold() { Reset(); }
  void Reset() {
    if (pool_ != nullptr && bytes_ != 0) pool_->Release(bytes_);
    pool_.reset();
    bytes_ = 0;
  }

 private:
  std::shared_ptr<MemoryQuota> pool_;
  uint64_t bytes_ = 0;
};

// A standard normal value from 64 random bits (NORMAL initializers; a
// ziggurat, exact in distribution, tails included).
float StandardNormal(uint64_t bits);

struct Initializer {
  v1::InitializerSpec::Kind kind = v1::InitializerSpec::ZEROS;
  float a = 0, b = 0;
  uint64_t seed = 0;
  // Fills n values for stream `stream` (element index base or row key).
  void Fill(uint64_t table_hash, uint64_t stream, uint64_t offset, float* out, size_t n) const;
};

class Table {
 public:
  virtual ~Table() = default;
  const std::string& name() const { return name_; }
  uint64_t name_hash() const { return name_hash_; }
  const OptimizerConfig& optimizer() const { return optimizer_; }
  int num_slots() const { return NumSlots(optimizer_.kind); }
  bool is_dense() const { return dense_; }

 protected:
  Table(std::string name, bool dense, OptimizerConfig opt, Initializer init);
  const std::string name_;
  const uint64_t name_hash_;
  const bool dense_;
  const OptimizerConfig optimizer_;
  const Initializer init_;
};

// Chunks of all dense tables of a job together (each costs an index entry
// when the table is created, before any quota is charged).
inline constexpr uint64_t kMaxDenseChunks = uint64_t{1} << 22;

class DenseTable final : public Table {
 public:
  // Validates the spec (shape, chunk size) without allocating.
  static absl::StatusOr<std::unique_ptr<DenseTable>> Create(const v1::TableSpec& spec,
                                                           MemoryQuota* quota);
  ~DenseTable() override;

  uint64_t num_elements() const { return num_elements_; }
  uint32_t chunk_elements() const { return chunk_elements_; }
  uint32_t num_chunks() const { return num_chunks_; }
  uint32_t ChunkLength(uint32_t chunk) const;
  uint64_t ChunkBytes(uint32_t chunk) const;

  // Materializes a chunk (idempotent); RESOURCE_EXHAUSTED over quota.
  absl::Status EnsureChunk(uint32_t chunk);
  // Copies the chunk's weights into out (ChunkLength elements of dtype),
  // converting on the way out when dtype is not fp32.
  absl::Status Read(uint32_t chunk, DType dtype, void* out);
  // The chunk's current fp32 weights without a copy: a reference to the
  // chunk's block, which later updates leave untouched (they copy the block
  // first while such a reference is alive). `*weights` points into the owner.
  absl::StatusOr<std::shared_ptr<const float[]>> Snapshot(uint32_t chunk);
  // Applies gradient g (ChunkLength floats) with the table's optimizer, at
  // the learning rate of push step `step` (the table's schedule).
  absl::Status Apply(uint32_t chunk, const float* g, uint64_t step, float lr_scale = 1.0f);
  // The same for a gradient still in its received form (any dtype, any
  // number of pieces), widened block by block inside the update: no fp32 copy
  // of the whole chunk is made.
  absl::Status Apply(uint32_t chunk, const Payload& g, DType dtype, uint64_t step, float lr_scale = 1.0f);
  uint32_t materialized_chunks() const;

  // Checkpoints: every materialized chunk's block (weights, then each
  // optimizer slot; ChunkLength floats each) and update count. The blocks
  // are shared copy-on-write with the live table, so this costs no copy and
  // later updates leave them untouched.
  struct ChunkState {
    uint32_t chunk;
    uint64_t updates;
    std::shared_ptr<const float[]> block;
  };
  std::vector<ChunkState> Capture() const;
  // Installs a chunk's block (ChunkLength * (1 + slots) floats, any
  // alignment) and update count, materializing it (RESOURCE_EXHAUSTED over
  // quota). `length` and `slots` are what the record says it holds: DATA_LOSS
  // unless they are this chunk's, so a record never reads past its block.
  absl::Status Restore(uint32_t chunk, uint64_t updates, uint32_t length, uint32_t slots, const void* block);

 private:
  struct Chunk {
    absl::Mutex mu;
    // Shared with in-flight pull responses (Snapshot); updated in place only
    // while this is the sole reference, copied first otherwise.
    std::shared_ptr<float[]> block ABSL_GUARDED_BY(mu);
    uint64_t updates ABSL_GUARDED_BY(mu) = 0;
  };
  DenseTable(const v1::TableSpec& spec, OptimizerConfig opt, Initializer init, uint64_t elements,
             uint32_t chunk_elements, MemoryQuota* quota);
  // Creates the chunk on first use, initialized unless `initialize` is
  // false (a restore overwrites all of it).
  absl::StatusOr<Chunk*> GetChunk(uint32_t chunk, bool initialize = true);
  // The chunk's block, made exclusive (copied if a snapshot shares it).
  float* Writable(Chunk* c, uint32_t chunk) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu);

  const uint64_t num_elements_;
  const uint32_t chunk_elements_;
  const uint32_t num_chunks_;
  MemoryQuota* const quota_;
  mutable absl::Mutex create_mu_;
  std::vector<std::unique_ptr<Chunk>> owned_ ABSL_GUARDED_BY(create_mu_);
  std::unique_ptr<std::atomic<Chunk*>[]> chunks_;  // published after creation
};

class SparseTable final : public Table {
 public:
  // Which keys become rows and which rows go (TableSpec.admission and
  // .eviction; docs/embeddings.md, "A row's life").
  struct Lifecycle {
    enum class Policy { kLru, kLfu };
    uint32_t min_count = 0;      // admitted once pushed this often (0, 1: at once)
    float probability = 0;       // admitted with this probability a push (0: always)
    uint32_t sketch_width = 4096;
    Policy policy = Policy::kLru;
    uint32_t max_rows_per_shard = 0;  // 0: no cap
    uint64_t ttl_steps = 0;           // 0: none
    float lfu_decay = 0.99f;
    // storage.spill: rows past the cap move to the server's cold tier
    // (AttachColdTier) instead of being dropped.
    bool spill = false;
    bool admission() const { return min_count > 1 || probability > 0; }
    bool on() const { return admission() || max_rows_per_shard > 0 || ttl_steps > 0; }
  };
  // The lifecycle of `spec` for a cluster of `num_virtual_shards`;
  // INVALID_ARGUMENT naming the field on a bad knob.
  static absl::StatusOr<Lifecycle> LifecycleFromProto(const v1::TableSpec& spec, uint32_t num_virtual_shards,
                                                      uint64_t row_bytes);
  static absl::StatusOr<std::unique_ptr<SparseTable>> Create(const v1::TableSpec& spec,
                                                            uint32_t num_virtual_shards,
                                                            MemoryQuota* quota);
  ~SparseTable() override;

  uint32_t dim() const { return dim_; }
  const Lifecycle& lifecycle() const { return life_; }
  // A row's floats: its weights and its optimizer state.
  uint64_t RowBytes() const { return uint64_t{dim_} * (1 + num_slots()) * sizeof(float); }
  // What the table holds and counts against its quota: each virtual shard's
  // row blocks (16 rows, then doubling to 1024 a block), its hash index
  // (slots and control bytes at the index's capacity), the per-row update
  // counts and lifecycle fields, and the admission sketch; reserved as each
  // grows, not row by row (docs/embeddings.md, "What a row costs").
  uint64_t bytes() const;

  // Reads rows for keys that all hash to `vshard`; out has keys.size() * dim
  // floats. A missing row is created, unless the table has a lifecycle:
  // then it reads the row's initial value and nothing is created.
  absl::Status Read(uint32_t vshard, const uint64_t* keys, const uint32_t* idx, size_t n,
                    float* out);
  // Read over several virtual shards: runs[j] = (shard, end of its keys in
  // idx), shards ascending. With a cold tier, the rows on disk of every
  // shard come in one batched read, under the locks of all the shards
  // (taken in ascending order; nothing else holds two).
  absl::Status ReadShards(const uint64_t* keys, const uint32_t* idx,
                          const std::vector<std::pair<uint32_t, size_t>>& runs, float* out)
      ABSL_NO_THREAD_SAFETY_ANALYSIS;  // holds a run of partition locks
  // A prefetch hint (PullRequest.prefetch), runs as for ReadShards: the
  // rows on disk of keys neither in memory nor kept are read in one batch,
  // holding no shard's lock, and kept (Partition::read_at) for the pull
  // that follows, in each shard no push moved rows of since the keys were
  // looked at; a hint never makes a shard forget what it keeps. Returns
  // the rows read ahead; 0 without a cold tier.
  absl::StatusOr<uint64_t> Prefetch(const uint64_t* keys, const uint32_t* idx,
                                    const std::vector<std::pair<uint32_t, size_t>>& runs);
  // Prefetch's two halves, between which pushes and pulls may come: the
  // disk read (with what each shard looked like before it), then keeping
  // what it read where nothing moved meanwhile.
  struct ReadAhead {
    std::vector<uint32_t> shards;   // per run: its virtual shard
    std::vector<std::pair<uint64_t, uint64_t>> seen;  // per run: moves, restores
    std::vector<uint32_t> vshard;   // per key read
    std::vector<uint64_t> keys;
    ColdRows rows;
    std::vector<bool> found;
  };
  absl::StatusOr<ReadAhead> ReadAheadOf(const uint64_t* keys, const uint32_t* idx,
                                        const std::vector<std::pair<uint32_t, size_t>>& runs);
  uint64_t KeepReadAhead(const ReadAhead& read);
  // Makes room for the keys' missing rows (all in `vshard`) without
  // reading them; RESOURCE_EXHAUSTED over quota. Used before applying a push
  // so a quota failure leaves nothing half-applied. Without a lifecycle the
  // rows are created; with one, blocks and index are sized for them (up to
  // the cap) and rows are created as Apply admits them.
  absl::Status EnsureRows(uint32_t vshard, const uint64_t* keys, const uint32_t* idx, size_t n);
  // Applies one gradient row (dim floats) per key; all keys in `vshard`; at
  // the learning rate of push step `step`. With a lifecycle, `step` is the
  // clock of last use and TTL, keys not yet admitted drop their gradient,
  // and an admitted key past the cap takes the place of an evicted row.
  absl::Status Apply(uint32_t vshard, const uint64_t* keys, const uint32_t* idx, size_t n,
                     const float* grads, uint64_t step, float lr_scale = 1.0f);
  uint64_t num_rows() const;  // lock-free

  // What the lifecycle did since the table was created.
  struct Counts {
    uint64_t admitted = 0;     // rows created by an admitted push
    uint64_t rejected = 0;     // gradient rows dropped: key not admitted yet
    uint64_t evicted_cap = 0;  // rows dropped for a new one past the cap
    uint64_t evicted_ttl = 0;  // rows dropped, unused for ttl_steps
    uint64_t sketch_bytes = 0;
    uint64_t sketch_agings = 0;  // times a shard's sketch halved
    // With a cold tier: rows moved to disk, brought back by a push, and
    // read from disk by a pull; read from disk ahead by a prefetch hint.
    uint64_t demoted = 0, promoted = 0, cold_reads = 0, prefetched = 0;
    uint64_t cold_rows = 0;  // rows on disk and not in memory now
  };
  Counts counts() const;

  // Checkpoints: the rows of one virtual shard, copied under its lock.
  struct ShardState {
    uint32_t vshard;
    std::vector<uint64_t> keys;
    std::vector<uint32_t> updates;
    std::vector<float> rows;  // per key: dim weights, then dim per slot
    // With a lifecycle (has_life): per key its slot, last push and decayed
    // count; the shard's slots, cursors, freed slots and sketch, so a
    // restored shard admits and evicts as this one would have.
    bool has_life = false;
    std::vector<uint32_t> slot;
    std::vector<uint64_t> last_step;
    std::vector<float> freq;
    uint32_t slots = 0, victim_cursor = 0, ttl_cursor = 0;
    std::vector<uint32_t> free_slots;
    std::vector<uint16_t> sketch;
    // With a cold tier, rows on disk are merged in, slot kColdSlot; not OK
    // when reading them failed (the state is then not a cut). Or, captured
    // against a linked cut of the tier in which the shard's rows on disk
    // are as they are now (CaptureShard's `marks`): `cold_linked`, and
    // the rows are left there, `linked_cold_rows` of them.
    absl::Status error;
    bool cold_linked = false;
    uint64_t linked_cold_rows = 0;
    // The lifecycle fields as a record carries them (pointing into this).
    SparseShardLife Life() const;
  };
  // Every virtual shard that holds rows (or, with a lifecycle, ever held
  // one or has counted a key).
  std::vector<ShardState> Capture(const std::vector<uint64_t>* marks = nullptr) const;
  // The same one shard at a time: which shards Capture would copy, and one
  // of them (a cut written shard by shard never holds a copy of the table).
  std::vector<uint32_t> CapturedShards() const;
  // `marks`: MoveMarks() as they were just before the cold tier was cut
  // (ColdTier::Checkpoint). A shard whose rows on disk no push or restore
  // has moved since is captured linked to that cut; the others (and all,
  // without marks) have their rows on disk copied in.
  ShardState CaptureShard(uint32_t vshard, const std::vector<uint64_t>* marks = nullptr) const;
  // Per virtual shard, a count that changes whenever a push or restore
  // changes what the cold tier holds for it; empty without a cold tier.
  std::vector<uint64_t> MoveMarks() const;
  // About what Capture's copy takes: per row its key, floats, update count
  // and lifecycle fields, and the sketches.
  uint64_t CaptureBytes() const;
  // Whether the table has a row cap (eviction's max_rows or max_bytes).
  bool capped() const { return life_.max_rows_per_shard != 0; }
  // The disk tier (server/cold_tier.h) as the table's second tier: past the
  // cap a row is demoted to `tier`'s `space` (weights, optimizer state,
  // update count and lifecycle fields) instead of dropped; a push of a
  // demoted key promotes it back (no admission: it was admitted), and a
  // pull reads it where it lies. FAILED_PRECONDITION for a table without a
  // cap. Set before the table's first push; `tier` outlives the table.
  // Cuts hold demoted rows (slot kColdSlot) and restore puts them back on
  // disk. A job attaches its server's tier to each table whose spec has
  // storage.spill (lifecycle().spill).
  absl::Status AttachColdTier(ColdTier* tier, uint32_t space);
  bool spills() const { return tier_ != nullptr; }
  uint32_t tier_space() const { return tier_space_; }
  // Installs rows (creating or overwriting them) into `vshard`: n rows of
  // dim * (1 + slots) floats. DATA_LOSS unless dim and slots are the
  // table's and every key hashes to `vshard`. Without `life`, restored rows
  // count as last used at `step`; with it (a lifecycle table's record, into
  // an empty shard) the shard is rebuilt as it was: the same slots, cursors
  // and sketch, DATA_LOSS when they do not fit together.
  absl::Status Restore(uint32_t vshard, uint32_t dim, uint32_t slots, size_t n, const uint64_t* keys,
                       const uint32_t* updates, const float* rows, uint64_t step = 0,
                       const SparseShardLife* life = nullptr);

 private:
  // Row blocks: 16 rows, then 16, 32, ... 512 (1 024 rows in 7 blocks),
  // then 1 024 rows each; a sparsely used shard holds little slack.
  static constexpr uint32_t kRowsPerBlock = 1024;
  static uint32_t BlockRows(size_t block) {
    return block == 0 ? 16 : block <= 6 ? 16u << (block - 1) : kRowsPerBlock;
  }
  struct Partition {
    absl::Mutex mu;
    absl::flat_hash_map<uint64_t, uint32_t> index ABSL_GUARDED_BY(mu);
    std::vector<std::unique_ptr<float[]>> blocks ABSL_GUARDED_BY(mu);
    uint32_t block_rows ABSL_GUARDED_BY(mu) = 0;  // rows the blocks hold
    std::vector<uint32_t> updates ABSL_GUARDED_BY(mu);  // per slot
    uint32_t room ABSL_GUARDED_BY(mu) = 0;      // slots the index and per-slot fields are sized for
    // With a lifecycle, per slot: its key, whether it holds a row, the step
    // of its last push and (LFU) its decayed push count; freed slots; the
    // victim and TTL cursors; the admission sketch (4 x width counters).
    std::vector<uint64_t> slot_key ABSL_GUARDED_BY(mu);
    // kLive: the slot holds a row; kCopyOnDisk (with a cold tier): the
    // tier still holds an older copy of its key's row, left there when
    // the row came back (a promotion writes nothing to disk). The row in
    // memory is the row; the copy is overwritten when it is demoted again
    // and deleted when it is dropped for good.
    std::vector<uint8_t> live ABSL_GUARDED_BY(mu);
    std::vector<uint64_t> last_step ABSL_GUARDED_BY(mu);
    std::vector<float> freq ABSL_GUARDED_BY(mu);
    std::vector<uint32_t> free_slots ABSL_GUARDED_BY(mu);
    uint32_t victim_cursor ABSL_GUARDED_BY(mu) = 0;
    uint32_t ttl_cursor ABSL_GUARDED_BY(mu) = 0;
    std::vector<uint16_t> sketch ABSL_GUARDED_BY(mu);
    uint64_t sketch_sum ABSL_GUARDED_BY(mu) = 0;  // of its counters (a function of them)
    // With a cold tier: rows pulls found on disk (key -> its entry in
    // `read`, or kNotOnDisk for a key on neither tier), so the push that
    // follows a pull of the same keys, and other pulls of them, do not read
    // them again. A key in memory is never here. Only a push of a key
    // changes what the tier holds for it (a push's victims come from
    // memory), and a push forgets its keys; a restore forgets them all.
    // Both start over when `read` would pass kReadKeepBytes or `read_at`
    // kReadKeepKeys.
    absl::flat_hash_map<uint64_t, uint32_t> read_at ABSL_GUARDED_BY(mu);
    ColdRows read ABSL_GUARDED_BY(mu);
    // A prefetch hint reads disk without the lock, then keeps a key's row
    // only if no push moved a row of a key in its bucket meanwhile
    // (moved_at[MoveBucket(key)], the count of pushes that moved rows when
    // the last such did, passed what the hint saw) and no restore came.
    uint64_t moves ABSL_GUARDED_BY(mu) = 0;
    uint64_t restores ABSL_GUARDED_BY(mu) = 0;
    // Rows of the shard on disk and not in memory (as cold_rows_).
    uint64_t cold ABSL_GUARDED_BY(mu) = 0;
    std::vector<uint64_t> moved_at ABSL_GUARDED_BY(mu);  // kMoveBuckets, once a tier is attached
  };
  static constexpr uint8_t kLive = 1, kCopyOnDisk = 2;
  static constexpr size_t kSketchRows = 4;  // the admission sketch's rows
  static constexpr size_t kMoveBuckets = 512;
  static size_t MoveBucket(uint64_t key);
  static constexpr uint32_t kNotOnDisk = 0xffffffffu;
  static constexpr size_t kReadKeepBytes = size_t{64} << 10;
  static constexpr size_t kReadKeepKeys = 2048;
  float* RowAt(Partition* p, uint32_t r) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu);
  // Keeps a key's row on disk (rows->row(j)), or with rows == nullptr a key
  // on neither tier, in p's kept rows. When they are full, starts them
  // over if `start_over`, else keeps nothing and returns false.
  bool Keep(Partition* p, uint64_t key, const ColdRows* rows, size_t j, bool start_over) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu);
  // Whether a checkpoint holds the partition (it has, or with a lifecycle
  // ever had, rows, or has counted a key).
  bool Captured(const Partition& p) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  // Sizes the index and per-slot fields for `slots` slots, reserving the
  // growth first; RESOURCE_EXHAUSTED leaves the partition as it was.
  absl::Status Grow(Partition* p, uint32_t slots) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu);
  // Blocks and index for slots [0, slots).
  absl::Status EnsureCapacity(Partition* p, uint32_t slots) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu);
  // The bytes the index and per-slot fields hold at their current capacity.
  uint64_t IndexBytes(const Partition& p) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(p.mu);
  SparseTable(const v1::TableSpec& spec, OptimizerConfig opt, Initializer init, Lifecycle life,
              uint32_t num_virtual_shards, MemoryQuota* quota);
  // Returns the row for key, creating it (a new slot, at its initial
  // value) if missing.
  absl::StatusOr<float*> Row(Partition* p, uint64_t key, uint32_t* row_index, uint64_t step = 0)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu);
  // Row for a key known to be missing; `initial`: its initial weights when
  // already computed.
  absl::StatusOr<float*> NewRow(Partition* p, uint64_t key, uint32_t* row_index, uint64_t step,
                                const float* initial = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu);
  // Lifecycle: whether a push of a missing key admits it (counting it);
  // the row a new one past the cap replaces; drops expired
  // rows from the TTL cursor on.
  absl::StatusOr<bool> Admit(Partition* p, uint64_t key, uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu);
  // The row a new one past the cap replaces (kNoSlot: none live).
  uint32_t PickVictim(Partition* p, uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu);
  // Drops expired rows; the keys of those with a copy on disk are appended
  // to `copies` (to delete from the tier).
  void SweepExpired(Partition* p, uint64_t step, std::vector<uint64_t>* copies) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu);
  void Drop(Partition* p, uint32_t slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu);
  // Counts `bytes` more held by a partition (already reserved).
  void Charged(uint64_t bytes);
  // The admission sketch, allocated on first use.
  absl::Status EnsureSketch(Partition* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu);
  // Halves every counter of the partition's sketch.
  void AgeSketch(Partition* p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu);
  absl::Status RestoreLife(uint32_t vshard, Partition* p, size_t n, const uint64_t* keys, const uint32_t* updates,
                           const float* rows, const SparseShardLife& life) ABSL_EXCLUSIVE_LOCKS_REQUIRED(p->mu);

  // CaptureShard's last part: the shard's rows on disk merged in.
  void MergeColdRows(uint32_t vshard, ShardState* s) const;  // under the shard's lock

  const uint32_t dim_;
  const Lifecycle life_;
  MemoryQuota* const quota_;
  ColdTier* tier_ = nullptr;
  uint32_t tier_space_ = 0;
  std::vector<std::unique_ptr<Partition>> partitions_;
  std::atomic<uint64_t> admitted_{0}, rejected_{0}, evicted_cap_{0}, evicted_ttl_{0}, sketch_bytes_{0},
      sketch_agings_{0}, demoted_{0}, promoted_{0}, cold_reads_{0}, cold_rows_{0}, prefetched_{0};
  // Rows and charged bytes over all partitions, kept as they change, so
  // stats, metrics and heartbeats never wait on a partition's lock (a
  // checkpoint holds each in turn while it copies it).
  std::atomic<uint64_t> rows_{0}, bytes_{0};
};

// Builds a table from its spec; INVALID_ARGUMENT naming the field on a bad spec.
absl::StatusOr<std::unique_ptr<Table>> CreateTable(const v1::TableSpec& spec,
                                                   uint32_t num_virtual_shards, MemoryQuota* quota);

}  // namespace fulcrum

#endif  // FULCRUM_SERVER_TABLE_H_
