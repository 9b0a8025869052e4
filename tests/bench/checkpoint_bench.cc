// Checkpoint write and restore throughput of one server's shards against
// this machine's sequential disk bandwidth, measured in the same run, and
// the training pause a cut costs (issue #5's benchmark); and, with
// --soak_cuts, the store's disk use over many cuts under keep 3.
//
//   fulcrum-checkpoint-bench [--gib=1] [--dir=/tmp] [--quick]
//   fulcrum-checkpoint-bench --soak_cuts=1000 [--soak_mib=1]
//
// Disk bounds: a file of the same size written with 1 MiB writes and
// fdatasync, then read back after its pages are dropped from the page cache
// (posix_fadvise DONTNEED). The checkpoint: a BSP job with one dense SGD
// table of that many bytes, cut with ParameterServer::Checkpoint (capture +
// SST write + ingest + synced commit), then, after dropping the cache of the
// RocksDB files, restored with ParameterServer::Restore. The pause is the
// capture; one training step is one push of the whole table's gradient
// (the server's part of a step of this model), timed before the cut and
// while the cut's write is in flight (updates then copy shared blocks).
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "common/process.h"
#include "absl/synchronization/notification.h"
#include "common/rocksdb_options.h"
#include "server/parameter_server.h"
#include "worker/local_ps_client.h"

ABSL_FLAG(double, gib, 1.0, "parameter bytes to checkpoint, in GiB");
ABSL_FLAG(std::string, dir, "/tmp", "directory (on the disk to measure) for the bench's files");
ABSL_FLAG(bool, quick, false, "64 MiB, for the smoke test");
ABSL_FLAG(int, soak_cuts, 0,
          "instead: the store soak, this many cuts of a job that keeps 3 (as checkpoint.keep does), reporting the "
          "store's disk bytes, files and the process's open descriptors as it goes");
ABSL_FLAG(double, soak_mib, 1.0, "the soak's dense table, in MiB");

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

void DropCache(const fs::path& p) {
  std::vector<fs::path> files;
  if (fs::is_directory(p)) {
    for (const auto& e : fs::recursive_directory_iterator(p)) {
      if (e.is_regular_file()) files.push_back(e.path());
    }
  } else {
    files.push_back(p);
  }
  for (const auto& f : files) {
    const int fd = open(f.c_str(), O_RDONLY);
    if (fd < 0) continue;
    fdatasync(fd);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
  }
}

// Sequential write (1 MiB writes, fdatasync) and read (cache dropped) of `bytes`.
std::pair<double, double> DiskBounds(const fs::path& file, size_t bytes) {
  std::vector<char> buf(1 << 20, 'x');
  auto t0 = Clock::now();
  const int fd = open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) {
    std::perror("open");
    std::exit(1);
  }
  for (size_t done = 0; done < bytes; done += buf.size()) {
    if (write(fd, buf.data(), buf.size()) != static_cast<ssize_t>(buf.size())) {
      std::perror("write");
      std::exit(1);
    }
  }
  fdatasync(fd);
  close(fd);
  const double write_gbs = bytes / Seconds(t0, Clock::now()) / 1e9;
  DropCache(file);
  t0 = Clock::now();
  const int rfd = open(file.c_str(), O_RDONLY);
  size_t total = 0;
  for (ssize_t n; (n = read(rfd, buf.data(), buf.size())) > 0;) total += static_cast<size_t>(n);
  close(rfd);
  const double read_gbs = total / Seconds(t0, Clock::now()) / 1e9;
  fs::remove(file);
  return {write_gbs, read_gbs};
}

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

// One server in-process, its checkpoints under root/server; `quota`: the
// default per-job quota (0: the server's default).
std::shared_ptr<fulcrum::ParameterServer> StartServer(const fs::path& root, uint64_t quota) {
  auto map = fulcrum::ShardMap::RoundRobin(1, 64, {"in-process"});
  Check(map.status(), "shard map");
  fulcrum::ParameterServerOptions o;
  o.shard_map = map->ToProto();
  o.data_dir = (root / "server").string();
  if (quota > 0) o.default_quota_bytes = quota;
  auto created = fulcrum::ParameterServer::Create(std::move(o));
  Check(created.status(), "server");
  return std::move(*created);
}

// A BSP job of one worker and one dense table "w" of `elements`.
fulcrum::v1::PsJobSpec DenseJob(const std::string& id, size_t elements, fulcrum::v1::OptimizerSpec::Kind kind,
                                float learning_rate) {
  fulcrum::v1::PsJobSpec spec;
  spec.set_job_id(id);
  spec.set_num_workers(1);
  spec.mutable_consistency()->set_model(fulcrum::v1::ConsistencySpec::BSP);
  auto* t = spec.add_tables();
  t->set_name("w");
  t->set_kind(fulcrum::v1::TableSpec::DENSE);
  t->add_shape(static_cast<int64_t>(elements));
  t->mutable_optimizer()->set_kind(kind);
  t->mutable_optimizer()->set_learning_rate(learning_rate);
  return spec;
}

size_t OpenFds() {
  size_t n = 0;
  std::error_code ec;
  for (auto it = fs::directory_iterator("/proc/self/fd", ec); !ec && it != fs::directory_iterator(); it.increment(ec)) ++n;
  return n;
}

// The store soak: `cuts` cuts of one job, each followed by the deletion of
// the cut `keep` before it, as the coordinator does under checkpoint.keep.
// The disk must stay flat, under the documented bound (docs/checkpoints.md,
// "Disk"): (keep + 1) cuts (the one being written lands before the oldest
// goes) plus RocksDB's own files, at most 16 MiB.
int Soak(const fs::path& root, int cuts, double mib) {
  constexpr int kKeep = 3;
  constexpr uint64_t kSlack = 16 << 20;
  const size_t elements = static_cast<size_t>(mib * (1 << 20) / 4);
  std::shared_ptr<fulcrum::ParameterServer> ps = StartServer(root, 0);
  fulcrum::LocalPsClient client(ps, "soak");
  Check(client.CreateJob(DenseJob("soak", elements, fulcrum::v1::OptimizerSpec::ADAM, 0.001f)), "create job");
  std::vector<float> g(elements, 0.001f);
  const auto t0 = Clock::now();
  std::printf("store soak: %d cuts of a %.2f MiB Adam table, keep %d, in %s\n", cuts, mib, kKeep, root.c_str());
  std::printf("| cuts | disk MiB | files | table files | RocksDB's own files MiB | open fds | s |\n"
              "|---|---|---|---|---|---|---|\n");
  uint64_t cut_bytes = 0, most_bytes = 0, settled_bytes = 0, most_own = 0;
  size_t most_files = 0, least_fds = SIZE_MAX, most_fds = 0, settled_files = 0;
  for (int cut = 1; cut <= cuts; ++cut) {
    Check(client.Push("soak", {static_cast<uint64_t>(cut - 1), {{"w", g.data(), elements}}, {}}), "push");
    auto meta = ps->Checkpoint("soak", cut, cut, absl::Seconds(60));
    Check(meta.status(), "checkpoint");
    cut_bytes = meta->bytes();
    if (cut > kKeep) Check(ps->DeleteCut("soak", cut - kKeep), "delete cut");
    auto disk = ps->checkpoints()->Disk();
    Check(disk.status(), "disk use");
    const size_t fds = OpenFds();
    most_bytes = std::max(most_bytes, disk->bytes);
    most_own = std::max(most_own, disk->own_bytes);
    most_files = std::max<size_t>(most_files, disk->files);
    if (cut >= cuts / 10) {  // after the store has settled
      least_fds = std::min(least_fds, fds);
      most_fds = std::max(most_fds, fds);
      if (cut == cuts / 10) {
        settled_bytes = disk->bytes;
        settled_files = disk->files;
      }
    }
    if (cut % std::max(1, cuts / 10) == 0 || cut == 1) {
      std::printf("| %d | %.2f | %llu | %llu | %.3f | %zu | %.1f |\n", cut, disk->bytes / 1048576.0,
                  static_cast<unsigned long long>(disk->files), static_cast<unsigned long long>(disk->table_files),
                  disk->own_bytes / 1048576.0, fds, Seconds(t0, Clock::now()));
    }
  }
  auto last = ps->checkpoints()->Disk();
  Check(last.status(), "disk use");
  const uint64_t bound = (kKeep + 1) * cut_bytes + kSlack;
  const double growth = static_cast<double>(last->bytes) - static_cast<double>(settled_bytes);
  std::printf("a cut: %.2f MiB; most on disk: %.2f MiB, %zu files; bound (keep + 1) x cut + 16 MiB = %.2f MiB; "
              "most/bound %.3f\n",
              cut_bytes / 1048576.0, most_bytes / 1048576.0, most_files, bound / 1048576.0,
              static_cast<double>(most_bytes) / bound);
  std::printf("from cut %d to the end: disk %+.3f MiB (%.0f bytes a cut), files %+lld, open fds %zu-%zu\n",
              cuts / 10, growth / 1048576.0, growth / (cuts - cuts / 10),
              static_cast<long long>(last->files) - static_cast<long long>(settled_files),
              least_fds, most_fds);
  // Every file of the directory: the tables under (keep + 1) cuts, and
  // RocksDB's own files (LOG, MANIFEST, WAL, OPTIONS) under their bound.
  std::printf("RocksDB's own files: most %.3f MiB, bound %.1f MiB (common/rocksdb_options.h), most/bound %.3f\n",
              most_own / 1048576.0, fulcrum::kRocksDbOwnFilesBound / 1048576.0,
              static_cast<double>(most_own) / fulcrum::kRocksDbOwnFilesBound);
  // Descriptors stay flat: the kept cuts' tables, plus a table of the
  // store's own records once the memtable flushes (every few thousand cuts)
  // and, while a compaction runs, its output beside its inputs.
  const bool held = most_bytes <= bound && most_own <= fulcrum::kRocksDbOwnFilesBound &&
                    most_fds - least_fds <= 4 && last->files <= settled_files + 8;
  std::printf("disk bound %s\n", held ? "held" : "BROKEN");
  return held ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // As fulcrum-server does: pinned malloc thresholds, so multi-MiB buffers
  // are reused instead of faulted in afresh (shared/ENVIRONMENT.md).
  fulcrum::InitServingProcess();
  const double gib = absl::GetFlag(FLAGS_quick) ? 1.0 / 16 : absl::GetFlag(FLAGS_gib);
  const size_t elements = static_cast<size_t>(gib * (1ull << 30) / 4);
  const size_t bytes = elements * 4;
  const fs::path root = fs::path(absl::GetFlag(FLAGS_dir)) / absl::StrCat("fulcrum-ckpt-bench-", getpid());
  fs::create_directories(root);
  if (absl::GetFlag(FLAGS_soak_cuts) > 0) {
    const int rc = Soak(root, absl::GetFlag(FLAGS_soak_cuts), absl::GetFlag(FLAGS_soak_mib));
    fs::remove_all(root);
    return rc;
  }

  const auto [disk_write, disk_read] = DiskBounds(root / "seq.bin", bytes);

  std::shared_ptr<fulcrum::ParameterServer> ps = StartServer(root, bytes * 3);
  fulcrum::LocalPsClient client(ps, "bench");
  Check(client.CreateJob(DenseJob("bench", elements, fulcrum::v1::OptimizerSpec::SGD, 0.01f)), "create job");

  std::vector<float> g(elements, 0.001f);
  auto step = [&](uint64_t s) {
    const auto a = Clock::now();
    Check(client.Push("bench", {s, {{"w", g.data(), elements}}, {}}), "push");
    return Seconds(a, Clock::now());
  };
  step(0);
  const double step_seconds = std::min(step(1), step(2));

  // The cut at step 3, with a training step running while it is written.
  absl::StatusOr<fulcrum::v1::ShardCutMeta> meta;
  const auto c0 = Clock::now();
  absl::Notification captured;
  Clock::time_point c1;  // when the cut is committed: the thread's own clock, since
                        // the step below may end after it (then join() would be late)
  std::thread cut([&] {
    meta = ps->Checkpoint("bench", 1, 3, absl::Seconds(60), [&] { captured.Notify(); });
    c1 = Clock::now();
  });
  captured.WaitForNotification();
  const double step_during_write = step(3);
  const auto step_end = Clock::now();
  cut.join();
  const double cut_seconds = Seconds(c0, c1);
  Check(meta.status(), "checkpoint");

  DropCache(root / "server");
  const auto r0 = Clock::now();
  auto restored = ps->Restore("bench", 1);
  const double restore_seconds = Seconds(r0, Clock::now());
  Check(restored.status(), "restore");

  const double write_gbs = meta->bytes() / cut_seconds / 1e9;
  const double read_gbs = meta->bytes() / restore_seconds / 1e9;
  std::printf("checkpoint of %.2f GiB (one dense SGD table, %zu chunks), disk %s\n", gib,
              static_cast<size_t>(meta->records()), root.c_str());
  std::printf("| what | GB/s | bound GB/s | ratio |\n|---|---|---|---|\n");
  std::printf("| checkpoint write (capture, SST, ingest, synced commit) | %.2f | %.2f | %.2f |\n", write_gbs,
              disk_write, write_gbs / disk_write);
  std::printf("| restore (read, verify, install) | %.2f | %.2f | %.2f |\n", read_gbs, disk_read, read_gbs / disk_read);
  std::printf("pause: capture %.3f ms; one training step (push of the whole table) %.1f ms; pause/step %.4f\n",
              meta->capture_seconds() * 1e3, step_seconds * 1e3, meta->capture_seconds() / step_seconds);
  std::printf("step while the cut is written: %.1f ms (%.2fx a normal step: updates copy the shared blocks); "
              "it ended %.0f ms %s the commit\n",
              step_during_write * 1e3, step_during_write / step_seconds,
              std::abs(Seconds(c1, step_end)) * 1e3, step_end > c1 ? "after" : "before");
  fs::remove_all(root);
  return 0;
}
