// Readers (round trips and every bad input), sharding, shuffling, the
// prefetching pipeline, and the text-to-LibSVM converter.
#include <zlib.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <thread>

#include <catch2/catch.hpp>

#include "tests/testing/test_util.h"
#include "absl/strings/match.h"
#include "worker/data/dataset.h"
#include "worker/data/device_data.h"
#include "worker/data/pipeline.h"
#include "worker/data/text_hashing.h"

namespace fulcrum::data {
namespace {

namespace fs = std::filesystem;

class TempDir {
 public:
  TempDir() {
    path_ = fs::temp_directory_path() / ("fulcrum_data_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter_++));
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string Write(const std::string& name, const std::string& bytes) const {
    const fs::path p = path_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << bytes;
    return p.string();
  }
  std::string WriteGz(const std::string& name, const std::string& bytes) const {
    const std::string p = (path_ / name).string();
    gzFile f = gzopen(p.c_str(), "wb");
    gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
    gzclose(f);
    return p;
  }
  std::string path() const { return path_.string(); }

 private:
  fs::path path_;
  static inline int counter_ = 0;
};

std::string Be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8), static_cast<char>(v)};
}

// n images of 2x3 pixels: pixel j of image i = i * 10 + j; label i % 10.
std::string IdxImages(uint32_t n) {
  std::string s = Be32(0x803) + Be32(n) + Be32(2) + Be32(3);
  for (uint32_t i = 0; i < n; ++i)
    for (int j = 0; j < 6; ++j) s.push_back(static_cast<char>(i * 10 + j));
  return s;
}
std::string IdxLabels(uint32_t n) {
  std::string s = Be32(0x801) + Be32(n);
  for (uint32_t i = 0; i < n; ++i) s.push_back(static_cast<char>(i % 10));
  return s;
}

TEST_CASE("IDX round trip, raw and gzipped") {
  TempDir dir;
  for (bool gz : {false, true}) {
    const std::string images = gz ? dir.WriteGz("i.gz", IdxImages(12)) : dir.Write("i", IdxImages(12));
    const std::string labels = gz ? dir.WriteGz("l.gz", IdxLabels(12)) : dir.Write("l", IdxLabels(12));
    REQUIRE_OK_AND_ASSIGN(auto ds, ReadIdx(images, labels));
    REQUIRE(ds->size() == 12);
    REQUIRE(ds->num_features() == 6);
    REQUIRE(ds->num_classes() == 10);
    Batch b;
    const int64_t idx[] = {11, 3};
    ds->Fill(idx, 2, &b);
    REQUIRE(b.size == 2);
    REQUIRE(b.dense[0] == Approx(110.0f / 255));
    REQUIRE(b.dense[6 + 5] == Approx(35.0f / 255));
    REQUIRE(b.labels == std::vector<float>{1, 3});
  }
}

TEST_CASE("IDX bad inputs name the file and the offset") {
  TempDir dir;
  const std::string labels = dir.Write("l", IdxLabels(4));
  std::string wrong_magic = IdxImages(4);
  wrong_magic[3] = 0x02;
  REQUIRE_STATUS(ReadIdx(dir.Write("wm", wrong_magic), labels).status(), absl::StatusCode::kInvalidArgument,
                 "wm: byte 0: wrong magic number 0x00000802");
  const std::string images = IdxImages(4);
  REQUIRE_STATUS(ReadIdx(dir.Write("tr", images.substr(0, images.size() - 5)), labels).status(),
                 absl::StatusCode::kInvalidArgument, "tr: byte 35: file is truncated");
  REQUIRE_STATUS(ReadIdx(dir.Write("short", images.substr(0, 10)), labels).status(), absl::StatusCode::kInvalidArgument,
                 "header");
  std::string bad_label = IdxLabels(4);
  bad_label[8 + 2] = 12;
  REQUIRE_STATUS(ReadIdx(dir.Write("i", images), dir.Write("bl", bad_label)).status(),
                 absl::StatusCode::kInvalidArgument, "bl: byte 10: label 12 is outside [0, 10)");
  REQUIRE_STATUS(ReadIdx(dir.Write("i", images), dir.Write("l5", IdxLabels(5))).status(),
                 absl::StatusCode::kInvalidArgument, "5 labels for 4 images");
  REQUIRE_STATUS(ReadIdx(dir.path() + "/missing", labels).status(), absl::StatusCode::kNotFound, "missing: cannot open");
  // A gzip stream cut in the middle.
  const std::string gz = dir.WriteGz("full.gz", IdxImages(200));
  std::ifstream in(gz, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string cut = dir.Write("cut.gz", bytes.substr(0, bytes.size() / 2));
  auto r = ReadIdx(cut, labels);
  REQUIRE_FALSE(r.ok());
  INFO(r.status().ToString());
  REQUIRE(r.status().message().find("cut.gz") != absl::string_view::npos);
}

TEST_CASE("LibSVM round trip: labels, comments, sparse rows") {
  TempDir dir;
  const std::string p = dir.Write("a.svm",
                                  "+1 1:0.5 7:2 # comment\n"
                                  "-1 3:1e-1\n"
                                  "\n"
                                  "0\n"
                                  "1 2:1 4:1 100000000000:3\r\n");
  REQUIRE_OK_AND_ASSIGN(auto ds, ReadLibSvm(p));
  REQUIRE(ds->size() == 4);
  REQUIRE(ds->sparse());
  REQUIRE(ds->num_classes() == 2);
  Batch b;
  const int64_t idx[] = {0, 2, 3};
  ds->Fill(idx, 3, &b);
  REQUIRE(b.offsets == std::vector<int32_t>{0, 2, 2, 5});
  REQUIRE(b.keys == std::vector<uint64_t>{1, 7, 2, 4, 100000000000ull});
  REQUIRE(b.values[1] == 2.0f);
  REQUIRE(b.labels == std::vector<float>{1, 0, 1});
}

TEST_CASE("LibSVM bad lines name the file and the line") {
  TempDir dir;
  auto bad = [&](const std::string& text, const std::string& want, LabelKind kind = LabelKind::kBinary) {
    LibSvmOptions o;
    o.labels = kind;
    o.num_classes = 3;
    REQUIRE_STATUS(ReadLibSvm(dir.Write("b.svm", text), o).status(), absl::StatusCode::kInvalidArgument, want);
  };
  bad("1 1:1\nx 2:1\n", "b.svm: line 2: label \"x\" is not a number");
  bad("1 1:1\n1 2:1\n1 3\n", "line 3: \"3\" is not index:value");
  bad("1 a:1\n", "line 1: feature index \"a\"");
  bad("1 4:1 2:1\n", "line 1: feature indices must increase (2 after 4)");
  bad("1 2:zz\n", "line 1: feature value \"zz\"");
  bad("1 2:nan\n", "line 1: feature value \"nan\"");
  bad("2 1:1\n", "line 1: label 2 is not binary");
  bad("1 1:1\n3 1:1\n", "line 2: label 3 is outside [0, 3)", LabelKind::kClass);
  bad("\n# nothing\n", "no examples");
}

TEST_CASE("CSV: label column, header, scale, and bad rows") {
  TempDir dir;
  CsvOptions o;
  o.header = true;
  o.label_column = 0;
  o.scale = 0.5f;
  REQUIRE_OK_AND_ASSIGN(auto ds, ReadCsv(dir.Write("a.csv", "y,a,b\n1,2,4\n0,6,8\n"), o));
  REQUIRE(ds->size() == 2);
  REQUIRE(ds->num_features() == 2);
  Batch b;
  const int64_t idx[] = {1, 0};
  ds->Fill(idx, 2, &b);
  REQUIRE(b.dense == std::vector<float>{3, 4, 1, 2});
  REQUIRE(b.labels == std::vector<float>{0, 1});

  CsvOptions d;  // label last, no header
  REQUIRE_STATUS(ReadCsv(dir.Write("b.csv", "1,2,3\n4,5\n"), d).status(), absl::StatusCode::kInvalidArgument,
                 "b.csv: line 2: 2 columns, expected 3");
  REQUIRE_STATUS(ReadCsv(dir.Write("c.csv", "1,2,3\n4,x,1\n"), d).status(), absl::StatusCode::kInvalidArgument,
                 "c.csv: line 2: column 1 (counted from 0): \"x\" is not a number");
  REQUIRE_STATUS(ReadCsv(dir.Write("d.csv", "1,2,0.5\n"), d).status(), absl::StatusCode::kInvalidArgument,
                 "d.csv: line 1, column 2 (counted from 0): label 0.5 is not a non-negative integer class");
  d.num_classes = 2;
  REQUIRE_STATUS(ReadCsv(dir.Write("e.csv", "1,2,1\n1,2,2\n"), d).status(), absl::StatusCode::kInvalidArgument,
                 "e.csv: line 2, column 2 (counted from 0): label 2 is outside [0, 2)");
  d.label_column = 5;
  REQUIRE_STATUS(ReadCsv(dir.Write("f.csv", "1,2,1\n"), d).status(), absl::StatusCode::kInvalidArgument,
                 "label_column 5 does not exist: rows have 3 columns, 0 to 2");
}

TEST_CASE("readers refuse numbers that would overflow a class count or fp32 (found by fuzz_readers)") {
  TempDir dir;
  CsvOptions d;
  // A class id of 1e50 once became an infinite class count.
  REQUIRE_STATUS(ReadCsv(dir.Write("g.csv", "0,99999999999999999999999999999999999999999999999913\n"), d).status(),
                 absl::StatusCode::kInvalidArgument, "is beyond the largest class id supported (1048575)");
  REQUIRE_STATUS(ReadCsv(dir.Write("h.csv", "1e39,1\n"), d).status(), absl::StatusCode::kInvalidArgument,
                 "h.csv: line 1: column 0 (counted from 0) is not a finite fp32 number");
  d.labels = LabelKind::kValue;
  REQUIRE_STATUS(ReadCsv(dir.Write("i.csv", "1,1e300\n"), d).status(), absl::StatusCode::kInvalidArgument,
                 "label 1e+300 is outside the fp32 range");
  REQUIRE_STATUS(ReadLibSvm(dir.Write("j.svm", "1 3:1e40\n")).status(), absl::StatusCode::kInvalidArgument,
                 "feature value 1e+40 is outside the fp32 range");
}

TEST_CASE("sharding: ranks partition a seeded shuffle, equal counts, same seed same order") {
  const size_t n = 103;
  std::set<int64_t> seen;
  for (int rank = 0; rank < 4; ++rank) {
    auto order = ShardOrder(n, rank, 4, 7, 0);
    REQUIRE(order.size() == 25);  // 103 / 4, the remainder is dropped so ranks step together
    for (int64_t i : order) REQUIRE(seen.insert(i).second);
    REQUIRE(order == ShardOrder(n, rank, 4, 7, 0));
  }
  REQUIRE(seen.size() == 100);
  REQUIRE(ShardOrder(n, 0, 1, 7, 0) != ShardOrder(n, 0, 1, 7, 1));  // epochs differ
  REQUIRE(ShardOrder(n, 0, 1, 7, 0) != ShardOrder(n, 0, 1, 8, 0));  // seeds differ
  auto plain = ShardOrder(10, 0, 1, 7, 0, /*shuffle=*/false);
  REQUIRE(plain == std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
}

TEST_CASE("the prefetcher delivers every batch in order, stages into host buffers, counts waiting") {
  TempDir dir;
  REQUIRE_OK_AND_ASSIGN(auto ds, ReadIdx(dir.Write("i", IdxImages(50)), dir.Write("l", IdxLabels(50))));
  auto be = compute::NewCpuBackend(1);
  auto order = ShardOrder(50, 0, 1, 3, 0);
  PrefetchOptions o;
  o.batch_size = 8;
  o.depth = 2;
  Prefetcher p(ds.get(), order, 0, o, be.get());
  REQUIRE(p.num_batches() == 7);
  int64_t batches = 0, examples = 0;
  for (;;) {
    REQUIRE_OK_AND_ASSIGN(auto b, p.Next());
    if (!b) break;
    REQUIRE(b->index == batches);
    REQUIRE(b->staged.data() != nullptr);
    // The staged copy holds the features then the labels, and label_data reads it.
    for (int i = 0; i < b->size; ++i) {
      const int64_t ex = order[batches * 8 + i];
      REQUIRE(b->label_data()[i] == static_cast<float>(ex % 10));
      REQUIRE(b->dense_data()[i * 6] == Approx(static_cast<float>(static_cast<uint8_t>(ex * 10)) / 255));
    }
    examples += b->size;
    ++batches;
    if (batches == 3) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));  // let it run ahead
      // Decoded by now: Peek shows the batch Next hands out next.
      const Batch* next = p.Peek();
      REQUIRE(next != nullptr);
      CHECK(next->index == batches);
    }
    p.Recycle(std::move(b));
  }
  CHECK(p.Peek() == nullptr);  // past the last batch
  REQUIRE(batches == 7);
  REQUIRE(examples == 50);
  REQUIRE(p.wait_seconds() >= 0);
  REQUIRE(p.wait_seconds() < 1.0);
}

TEST_CASE("a batch pool carries one epoch's batches and their staging buffers into the next epoch") {
  TempDir dir;
  REQUIRE_OK_AND_ASSIGN(auto ds, ReadIdx(dir.Write("i", IdxImages(50)), dir.Write("l", IdxLabels(50))));
  auto be = compute::NewCpuBackend(1);
  BatchPool pool(8);
  PrefetchOptions o;
  o.batch_size = 8;
  o.depth = 2;
  o.pool = &pool;
  std::set<const void*> staged;  // the first epoch's staging buffers
  {
    Prefetcher p(ds.get(), ShardOrder(50, 0, 1, 3, 0), 0, o, be.get());
    for (;;) {
      REQUIRE_OK_AND_ASSIGN(auto b, p.Next());
      if (!b) break;
      staged.insert(b->staged.data());
      p.Recycle(std::move(b));
    }
  }
  // The second epoch decodes into those buffers, and reads right.
  const auto order = ShardOrder(50, 0, 1, 3, 1);
  Prefetcher p(ds.get(), order, 1, o, be.get());
  REQUIRE_OK_AND_ASSIGN(auto b, p.Next());
  REQUIRE(b != nullptr);
  CHECK(staged.count(b->staged.data()) == 1);
  CHECK(b->epoch == 1);
  for (int i = 0; i < b->size; ++i) {
    CHECK(b->label_data()[i] == static_cast<float>(order[i] % 10));
  }
  // A pool keeps at most its limit.
  BatchPool one(1);
  one.Give(std::make_unique<Batch>());
  one.Give(std::make_unique<Batch>());
  CHECK(one.Take() != nullptr);
  CHECK(one.Take() == nullptr);
}

TEST_CASE("several decoding threads hand out the batches of one thread, in order") {
  TempDir dir;
  REQUIRE_OK_AND_ASSIGN(auto ds, ReadIdx(dir.Write("i", IdxImages(203)), dir.Write("l", IdxLabels(203))));
  auto be = compute::NewCpuBackend(1);
  const auto order = ShardOrder(203, 0, 1, 11, 2);
  auto batches = [&](int threads) {
    PrefetchOptions o;
    o.batch_size = 10;
    o.depth = 3;
    o.threads = threads;
    Prefetcher p(ds.get(), order, 2, o, be.get());
    std::vector<std::vector<float>> out;
    for (;;) {
      REQUIRE_OK_AND_ASSIGN(auto b, p.Next());
      if (!b) break;
      REQUIRE(b->index == static_cast<int64_t>(out.size()));
      std::vector<float> v(b->dense_data(), b->dense_data() + b->dense.size());
      v.insert(v.end(), b->label_data(), b->label_data() + b->size);
      out.push_back(std::move(v));
      p.Recycle(std::move(b));
    }
    return out;
  };
  const auto one = batches(1);
  REQUIRE(one.size() == 21);
  REQUIRE(one.back().size() == 3 * 6 + 3);  // the short last batch
  CHECK(batches(3) == one);
  CHECK(batches(8) == one);
  CHECK(batches(64) == one);  // more threads than batches
  CHECK(DefaultDecodeThreads(16, /*gpu=*/true) == 4);
  CHECK(DefaultDecodeThreads(2, /*gpu=*/true) == 1);
  CHECK(DefaultDecodeThreads(16, /*gpu=*/false) == 1);
}

TEST_CASE("sparse batches come with their distinct keys, found on the pipeline's threads") {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 40; ++i) text += std::to_string(i % 2) + " " + std::to_string(1 + i % 5) + ":1 " +
                                       std::to_string(10 + i % 3) + ":0.5 " + std::to_string(100 + i) + ":2\n";
  REQUIRE_OK_AND_ASSIGN(auto ds, ReadLibSvm(dir.Write("k.svm", text)));
  PrefetchOptions o;
  o.batch_size = 16;
  o.threads = 2;
  Prefetcher p(ds.get(), ShardOrder(40, 0, 1, 5, 0), 0, o, nullptr);
  int batches = 0;
  for (;;) {
    REQUIRE_OK_AND_ASSIGN(auto b, p.Next());
    if (!b) break;
    std::vector<uint64_t> distinct;
    std::vector<int32_t> index;
    DistinctKeys(b->keys.data(), b->keys.size(), &distinct, &index);
    CHECK(b->distinct_keys == distinct);
    CHECK(b->key_index == index);
    CHECK(b->distinct_keys.size() < b->keys.size());  // the batch repeats keys 1-5 and 10-12
    for (size_t k = 0; k < b->keys.size(); ++k) CHECK(b->distinct_keys[b->key_index[k]] == b->keys[k]);
    ++batches;
  }
  CHECK(batches == 3);
}

TEST_CASE("a model's host work runs on the pipeline's threads on every batch, ahead of the consumer") {
  TempDir dir;
  std::string text;
  for (int i = 0; i < 40; ++i) text += "1 " + std::to_string(1 + i) + ":1\n";
  REQUIRE_OK_AND_ASSIGN(auto ds, ReadLibSvm(dir.Write("w.svm", text)));
  const std::thread::id consumer = std::this_thread::get_id();
  std::atomic<int> calls{0}, on_consumer{0};
  PrefetchOptions o;
  o.batch_size = 16;
  o.threads = 2;
  o.distinct_keys = false;
  o.host_work = [&](Batch* b) {
    ++calls;
    if (std::this_thread::get_id() == consumer) ++on_consumer;
    b->host_work = std::make_shared<const size_t>(b->keys.size());  // the batch's key count, as its "work"
    b->host_work_by = &calls;
  };
  Prefetcher p(ds.get(), ShardOrder(40, 0, 1, 5, 0), 0, o, nullptr);
  int batches = 0;
  for (;;) {
    REQUIRE_OK_AND_ASSIGN(auto b, p.Next());
    if (!b) break;
    REQUIRE(b->host_work_by == &calls);
    CHECK(*static_cast<const size_t*>(b->host_work.get()) == b->keys.size());
    CHECK(b->distinct_keys.empty());
    ++batches;
    p.Recycle(std::move(b));
  }
  CHECK(batches == 3);
  CHECK(calls == 3);
  CHECK(on_consumer == 0);
}

TEST_CASE("a dataset on the device: batches gathered there equal the host's, bit for bit") {
  TempDir dir;
  REQUIRE_OK_AND_ASSIGN(auto base, ReadIdx(dir.Write("i", IdxImages(60)), dir.Write("l", IdxLabels(60))));
  // A subset (as a train/test split makes): its rows map into the base's bytes.
  std::vector<int64_t> odd;
  for (int64_t i = 1; i < 60; i += 2) odd.push_back(i);
  auto ds = Subset(base.get(), odd);
  auto be = compute::NewCpuBackend(1);
  std::string why;
  REQUIRE_OK_AND_ASSIGN(auto none, DeviceData::Upload(*ds, be.get(), DeviceDataMode::kOff, 0.25, &why));
  CHECK(none == nullptr);
  CHECK(why == "off");
  REQUIRE_OK_AND_ASSIGN(none, DeviceData::Upload(*ds, be.get(), DeviceDataMode::kAuto, 1e-12, &why));
  CHECK(none == nullptr);
  CHECK(absl::StrContains(why, "does not fit"));
  auto csv = DenseInMemory(std::vector<float>(12, 1.0f), {0, 1}, 6, 2, "generated");
  REQUIRE_OK_AND_ASSIGN(none, DeviceData::Upload(*csv, be.get(), DeviceDataMode::kOn, 0.25, &why));
  CHECK(none == nullptr);
  CHECK(absl::StrContains(why, "not stored as bytes"));
  REQUIRE_OK_AND_ASSIGN(auto on, DeviceData::Upload(*ds, be.get(), DeviceDataMode::kAuto, 0.25, &why));
  REQUIRE(on != nullptr);
  CHECK(on->bytes() == 60 * 6);

  const auto order = ShardOrder(ds->size(), 0, 1, 4, 0);
  PrefetchOptions host_options, device_options;
  host_options.batch_size = device_options.batch_size = 7;
  device_options.device = on.get();
  device_options.threads = 2;
  Prefetcher host(ds.get(), order, 0, host_options, be.get());
  Prefetcher device(ds.get(), order, 0, device_options, be.get());
  int batches = 0;
  for (;;) {
    REQUIRE_OK_AND_ASSIGN(auto h, host.Next());
    REQUIRE_OK_AND_ASSIGN(auto d, device.Next());
    REQUIRE((h == nullptr) == (d == nullptr));
    if (!h) break;
    REQUIRE(d->device == on.get());
    REQUIRE(d->dense.empty());  // no features decoded on the host
    REQUIRE(d->num_features == 6);
    REQUIRE(d->size == h->size);
    std::vector<float> gathered(size_t{6} * d->size);
    REQUIRE_OK(on->Gather(*d, gathered.data()));
    REQUIRE_OK(be->Synchronize());
    CHECK(std::memcmp(gathered.data(), h->dense_data(), gathered.size() * sizeof(float)) == 0);
    CHECK(std::memcmp(d->label_data(), h->label_data(), d->size * sizeof(float)) == 0);
    ++batches;
  }
  CHECK(batches == 5);  // ceil(30 / 7)
}

TEST_CASE("text to hashed LibSVM: labels from folders, unit-norm rows, deterministic split") {
  TempDir dir;
  dir.Write("corpus/spam/a.txt", "Buy cheap pills now now now");
  dir.Write("corpus/spam/b.txt", "cheap offer");
  dir.Write("corpus/ham/c.txt", "Meeting notes for the project");
  dir.Write("corpus/ham/d.json", "{\"ignored\": true}");
  TextToLibSvmOptions o;
  o.input_dir = dir.path() + "/corpus";
  o.train_output = dir.path() + "/train.svm";
  o.test_output = "";
  o.bits = 12;
  o.extension = ".txt";
  o.positive = {"spam"};
  REQUIRE_OK_AND_ASSIGN(TextToLibSvmStats s, TextToLibSvm(o));
  REQUIRE(s.documents == 3);
  REQUIRE(s.positives == 2);
  REQUIRE_OK_AND_ASSIGN(auto ds, ReadLibSvm(o.train_output));
  REQUIRE(ds->size() == 3);
  Batch b;
  const int64_t idx[] = {0, 1, 2};
  ds->Fill(idx, 3, &b);
  REQUIRE(b.labels == std::vector<float>{0, 1, 1});  // sorted paths: ham/c, spam/a, spam/b
  for (int i = 0; i < 3; ++i) {
    double norm = 0;
    for (int j = b.offsets[i]; j < b.offsets[i + 1]; ++j) {
      norm += b.values[j] * b.values[j];
      REQUIRE(b.keys[j] < 4096);
    }
    REQUIRE(norm == Approx(1).epsilon(1e-4));
  }
  // "now" three times weighs more than "buy" once in spam/a.
  const uint64_t now = HashToken("now", 12), buy = HashToken("buy", 12);
  float w_now = 0, w_buy = 0;
  for (int j = b.offsets[1]; j < b.offsets[2]; ++j) {
    if (b.keys[j] == now) w_now = b.values[j];
    if (b.keys[j] == buy) w_buy = b.values[j];
  }
  REQUIRE(w_now > w_buy);
  REQUIRE(w_buy > 0);

  o.positive.clear();
  REQUIRE_STATUS(TextToLibSvm(o).status(), absl::StatusCode::kInvalidArgument, "--positive");
  o.positive = {"spam"};
  o.input_dir = dir.path() + "/nope";
  REQUIRE_STATUS(TextToLibSvm(o).status(), absl::StatusCode::kNotFound, "not a directory");
}

}  // namespace
}  // namespace fulcrum::data
