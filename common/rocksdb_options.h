// RocksDB options shared by the stores that keep state in RocksDB (the
// coordinator's state, the servers' checkpoints). Header-only: only targets
// that link RocksDB include it.
#ifndef FULCRUM_COMMON_ROCKSDB_OPTIONS_H_
#define FULCRUM_COMMON_ROCKSDB_OPTIONS_H_

#include <cstdint>

#include <rocksdb/options.h>

namespace fulcrum {

// RocksDB's own files, beside the data: the info LOG, the MANIFEST and the
// write-ahead log. Each grows with every write (a cut's meta, a deletion's
// tombstones, a job record) and starts afresh only past a size, so a store
// that runs for months must bound them:
//   LOG:      the current file and 2 old ones, each at most 256 KiB;
//   MANIFEST: a new one (and the old deleted) past 1 MiB;
//   WAL:      the memtable flushes, ending its log, past 1 MiB of writes,
//             and past 1 MiB of logs in all.
// So these files hold at most about 3.5 MiB (kRocksDbOwnFilesBound leaves
// room for a MANIFEST and a WAL being replaced).
inline constexpr uint64_t kRocksDbOwnFilesBound = uint64_t{5} << 20;

inline void BoundRocksDbOwnFiles(rocksdb::Options* o) {
  o->keep_log_file_num = 2;
  o->max_log_file_size = 256 << 10;
  o->max_manifest_file_size = 1 << 20;
  o->write_buffer_size = 1 << 20;
  o->max_total_wal_size = 1 << 20;
}

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_ROCKSDB_OPTIONS_H_
