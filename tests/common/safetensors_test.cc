// Safetensors files (common/safetensors.h) and a checkpoint cut exported
// as one (common/checkpoint_export.h): the exact bytes of a small file,
// round trips, and every refusal naming what is wrong. Checkpoint records
// are built here as docs/checkpoint-format.md lays them out.
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_format.h"
#include "common/checkpoint_export.h"
#include "common/safetensors.h"
#include "tests/testing/process_util.h"
#include "tests/testing/test_util.h"

namespace fulcrum {
namespace {

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void Spit(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

std::string TempPath(const std::string& name) {
  static const std::string dir = testing::MakeTempDir("safetensors");
  return dir + "/" + name;
}

template <typename T>
void Append(std::string* out, const T& v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

void AppendCrc(std::string* value) {
  Append(value, CheckpointCrc(kCurrentFormat, value->data(), value->size()));
}

// A dense record: chunk `chunk` of `table`, weights then `slots` slots each.
v1::CheckpointRecord DenseRecord(const std::string& table, uint32_t chunk, const std::vector<float>& weights,
                                 uint32_t slots) {
  v1::CheckpointRecord r;
  r.set_key(absl::StrFormat("dense/%s/%08x", table, chunk));
  std::string v;
  Append(&v, uint64_t{7});  // updates
  Append(&v, static_cast<uint32_t>(weights.size()));
  Append(&v, slots);
  for (float w : weights) Append(&v, w);
  for (uint32_t s = 0; s < slots; ++s) {
    for (size_t i = 0; i < weights.size(); ++i) Append(&v, -1.0f);
  }
  AppendCrc(&v);
  r.set_value(v);
  return r;
}

// A sparse record: rows (key, values of dim) of `table` with `slots` slots.
v1::CheckpointRecord SparseRecord(const std::string& table, uint32_t vshard,
                                  const std::vector<std::pair<uint64_t, std::vector<float>>>& rows, uint32_t dim,
                                  uint32_t slots) {
  v1::CheckpointRecord r;
  r.set_key(absl::StrFormat("sparse/%s/%08x", table, vshard));
  std::string v;
  Append(&v, static_cast<uint32_t>(rows.size()));
  Append(&v, dim);
  Append(&v, slots);
  Append(&v, uint32_t{0});
  for (const auto& [k, _] : rows) Append(&v, k);
  for (size_t i = 0; i < rows.size(); ++i) Append(&v, uint32_t{1});
  for (const auto& [_, values] : rows) {
    for (float x : values) Append(&v, x);
    for (uint32_t s = 0; s < slots * dim; ++s) Append(&v, 9.0f);
  }
  AppendCrc(&v);
  r.set_value(v);
  return r;
}

TEST_CASE("a small safetensors file has exactly the documented bytes") {
  const std::vector<float> w = {1.5f, -2.0f};
  const std::vector<int64_t> k = {3};
  const std::string path = TempPath("small.safetensors");
  uint64_t size = 0;
  REQUIRE_OK(safetensors::Write(path,
                                {{"w", "F32", {1, 2}, w.data(), 8}, {"k", "I64", {1}, k.data(), 8}},
                                {{"job", "a\"b"}}, &size));
  const std::string want_header =
      "{\"__metadata__\":{\"job\":\"a\\\"b\"},"
      "\"w\":{\"dtype\":\"F32\",\"shape\":[1,2],\"data_offsets\":[0,8]},"
      "\"k\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[8,16]}}";
  std::string header = want_header;
  while (header.size() % 8 != 0) header += ' ';
  std::string want;
  Append(&want, static_cast<uint64_t>(header.size()));
  want += header;
  want.append(reinterpret_cast<const char*>(w.data()), 8);
  want.append(reinterpret_cast<const char*>(k.data()), 8);
  CHECK(Slurp(path) == want);
  CHECK(size == want.size());
  CHECK(!std::ifstream(path + ".tmp").good());  // written through a rename
}

TEST_CASE("safetensors files read back as written: names, dtypes, shapes, bytes and metadata") {
  std::vector<float> a(12);
  for (size_t i = 0; i < a.size(); ++i) a[i] = 0.25f * static_cast<float>(i);
  const std::vector<uint16_t> b = {1, 2, 3};
  const std::string path = TempPath("round.safetensors");
  REQUIRE_OK(safetensors::Write(path, {{"layer.weight", "F32", {3, 4}, a.data(), 48}, {"h", "BF16", {3}, b.data(), 6},
                                       {"empty", "F32", {0, 5}, nullptr, 0}},
                                {{"format", "pt"}, {"line", "x\ny"}}));
  auto f = safetensors::Read(path);
  REQUIRE_OK(f.status());
  CHECK(f->metadata.at("format") == "pt");
  CHECK(f->metadata.at("line") == "x\ny");
  REQUIRE(f->tensors.size() == 3);
  CHECK(f->tensors[0].name == "layer.weight");
  CHECK(f->tensors[0].dtype == "F32");
  CHECK(f->tensors[0].shape == std::vector<int64_t>{3, 4});
  CHECK(f->tensors[0].data == std::string(reinterpret_cast<const char*>(a.data()), 48));
  CHECK(f->tensors[1].name == "h");
  CHECK(f->tensors[1].shape == std::vector<int64_t>{3});
  CHECK(f->tensors[1].data == std::string(reinterpret_cast<const char*>(b.data()), 6));
  CHECK(f->tensors[2].name == "empty");
  CHECK(f->tensors[2].data.empty());
}

TEST_CASE("safetensors refuses tensors that do not describe their bytes, naming the tensor") {
  const std::vector<float> x(4);
  const std::string path = TempPath("bad.safetensors");
  auto refused = [&](std::vector<safetensors::Tensor> t, const std::string& what) {
    absl::Status s = safetensors::Write(path, t, {});
    INFO(s.message());
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(s.message()).find(what) != std::string::npos);
  };
  refused({{"x", "F32", {3}, x.data(), 16}}, "tensor 'x': shape [3] of F32 is 12 bytes, given 16");
  refused({{"x", "F31", {4}, x.data(), 16}}, "tensor 'x': unknown dtype 'F31'");
  refused({{"x", "F32", {-1}, x.data(), 16}}, "tensor 'x': dimension -1 < 0");
  refused({{"x", "F32", {4}, x.data(), 16}, {"x", "F32", {4}, x.data(), 16}}, "tensor name 'x'");
  refused({{"", "F32", {4}, x.data(), 16}}, "tensor name ''");
  refused({{"__metadata__", "F32", {4}, x.data(), 16}}, "reserved");
  absl::Status s = safetensors::Write("/nonexistent-dir/x.safetensors", {{"x", "F32", {4}, x.data(), 16}}, {});
  CHECK(s.code() == absl::StatusCode::kNotFound);
  CHECK(std::string(s.message()).find("/nonexistent-dir/x.safetensors.tmp") != std::string::npos);
}

TEST_CASE("reading a damaged safetensors file names the file and the damage") {
  const std::vector<float> x = {1, 2, 3, 4};
  const std::string path = TempPath("damaged.safetensors");
  REQUIRE_OK(safetensors::Write(path, {{"x", "F32", {4}, x.data(), 16}}, {}));
  const std::string good = Slurp(path);
  auto damage = [&](const std::string& bytes, const std::string& what) {
    Spit(path, bytes);
    auto f = safetensors::Read(path);
    INFO(f.status().message());
    CHECK(f.status().code() == absl::StatusCode::kDataLoss);
    CHECK(std::string(f.status().message()).find(path) != std::string::npos);
    CHECK(std::string(f.status().message()).find(what) != std::string::npos);
  };
  damage(good.substr(0, good.size() - 4), "tensor 'x' ends at data byte 16, past the file's 12");
  damage(good + "abcd", "4 bytes after the last tensor");
  damage(good.substr(0, 5), "shorter than the 8-byte header length");
  std::string long_header = good;
  const uint64_t huge = 1 << 20;
  std::memcpy(long_header.data(), &huge, 8);
  damage(long_header, "header of 1048576 bytes is longer than the file's");
  std::string bad_json = good;
  bad_json[8] = '[';
  damage(bad_json, "header byte 0: expected '{'");
  // The header's length prefix is fixed up after each edit that resizes it.
  auto with_length = [](std::string bytes, size_t data) {
    const uint64_t header = bytes.size() - 8 - data;
    std::memcpy(bytes.data(), &header, 8);
    return bytes;
  };
  std::string bad_escape = good;
  bad_escape.replace(bad_escape.find("\"x\""), 3, "\"\\uZZ\"");
  damage(with_length(bad_escape, 16), "a \\u escape with a digit that is not hexadecimal");
  std::string huge_dim = good;
  huge_dim.replace(huge_dim.find("[4]"), 3, "[9999999999999999999]");
  huge_dim = with_length(huge_dim, 16);
  damage(huge_dim, "an integer of more than 18 digits");
  std::string bad_shape = good;
  bad_shape.replace(bad_shape.find("[4]"), 3, "[5]");
  damage(bad_shape, "tensor 'x' has 16 bytes for shape [5] of F32");
  CHECK(safetensors::Read(TempPath("missing.safetensors")).status().code() == absl::StatusCode::kNotFound);
}

v1::ShardCutMeta Meta() {
  v1::ShardCutMeta meta;
  meta.set_format(kCurrentFormat);
  v1::TableSpec* d = meta.mutable_spec()->add_tables();
  d->set_name("dense0.weight");
  d->set_kind(v1::TableSpec::DENSE);
  d->add_shape(2);
  d->add_shape(3);
  d->set_chunk_elements(4);  // two chunks: 4 and 2 elements
  v1::TableSpec* e = meta.mutable_spec()->add_tables();
  e->set_name("emb");
  e->set_kind(v1::TableSpec::SPARSE);
  e->set_dim(2);
  return meta;
}

TEST_CASE("a checkpoint cut exports as safetensors: dense tables whole, sparse rows by ascending key, no slots") {
  CutExport out;
  REQUIRE_OK(out.Begin(Meta()));
  REQUIRE_OK(out.Add(DenseRecord("dense0.weight", 1, {5, 6}, 1)));
  REQUIRE_OK(out.Add(SparseRecord("emb", 3, {{40, {4, 4.5f}}, {7, {0.5f, 1}}}, 2, 2)));
  REQUIRE_OK(out.Add(DenseRecord("dense0.weight", 0, {1, 2, 3, 4}, 1)));
  REQUIRE_OK(out.Add(SparseRecord("emb", 9, {{12, {-1, -2}}}, 2, 2)));
  const std::string path = TempPath("cut.safetensors");
  REQUIRE_OK(out.Write(path, {{"fulcrum_job", "j"}}));
  CHECK(out.tensors() == 3);
  auto f = safetensors::Read(path);
  REQUIRE_OK(f.status());
  CHECK(out.bytes() == Slurp(path).size());
  CHECK(f->metadata.at("fulcrum_job") == "j");
  REQUIRE(f->tensors.size() == 3);
  auto floats = [](const std::string& d) {
    std::vector<float> v(d.size() / 4);
    std::memcpy(v.data(), d.data(), d.size());
    return v;
  };
  CHECK(f->tensors[0].name == "dense0.weight");
  CHECK(f->tensors[0].shape == std::vector<int64_t>{2, 3});
  CHECK(floats(f->tensors[0].data) == std::vector<float>{1, 2, 3, 4, 5, 6});
  CHECK(f->tensors[1].name == "emb.keys");
  CHECK(f->tensors[1].dtype == "I64");
  std::vector<int64_t> keys(3);
  REQUIRE(f->tensors[1].data.size() == 24);
  std::memcpy(keys.data(), f->tensors[1].data.data(), 24);
  CHECK(keys == std::vector<int64_t>{7, 12, 40});
  CHECK(f->tensors[2].name == "emb.values");
  CHECK(f->tensors[2].shape == std::vector<int64_t>{3, 2});
  CHECK(floats(f->tensors[2].data) == std::vector<float>{0.5f, 1, -1, -2, 4, 4.5f});
}

TEST_CASE("a checkpoint export refuses what does not belong to the cut, naming it") {
  CutExport out;
  v1::ShardCutMeta future = Meta();
  future.set_format(99);
  absl::Status s = out.Begin(future);
  CHECK(s.code() == absl::StatusCode::kDataLoss);
  CHECK(std::string(s.message()).find("format 99") != std::string::npos);

  CutExport cut;
  CHECK(cut.Add(DenseRecord("dense0.weight", 0, {1, 2, 3, 4}, 0)).code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE_OK(cut.Begin(Meta()));
  s = cut.Add(DenseRecord("other", 0, {1}, 0));
  CHECK(std::string(s.message()).find("dense record for unknown table 'other'") != std::string::npos);
  s = cut.Add(DenseRecord("dense0.weight", 2, {1}, 0));
  CHECK(std::string(s.message()).find("chunk 2 of table 'dense0.weight' is out of range") != std::string::npos);
  s = cut.Add(SparseRecord("emb", 0, {{1, {1, 2, 3}}}, 3, 0));
  CHECK(std::string(s.message()).find("rows of dim 3 for table 'emb', whose dim is 2") != std::string::npos);
  v1::CheckpointRecord torn = DenseRecord("dense0.weight", 0, {1, 2, 3, 4}, 0);
  torn.mutable_value()->back() ^= 1;
  s = cut.Add(torn);
  CHECK(s.code() == absl::StatusCode::kDataLoss);
  CHECK(std::string(s.message()).find("checksum mismatch") != std::string::npos);
  REQUIRE_OK(cut.Add(DenseRecord("dense0.weight", 0, {1, 2, 3, 4}, 0)));
  s = cut.Write(TempPath("partial.safetensors"), {});
  CHECK(s.code() == absl::StatusCode::kDataLoss);
  CHECK(std::string(s.message()).find("no chunk 1 of table 'dense0.weight'") != std::string::npos);
}

}  // namespace
}  // namespace fulcrum
