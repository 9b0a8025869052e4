#include <cstring>
#include <numeric>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/match.h"
#include "common/errors.h"
#include "common/rpc/wire_codec.h"
#include "fulcrum/v1/ps.pb.h"

namespace fulcrum {
namespace {

std::string Flatten(grpc::ByteBuffer& buf) {
  std::vector<grpc::Slice> slices;
  REQUIRE(buf.Dump(&slices).ok());
  std::string s;
  for (auto& sl : slices) s.append(reinterpret_cast<const char*>(sl.begin()), sl.size());
  return s;
}

TEST_CASE("encoded push parses with protoc-generated code", "[wire]") {
  std::vector<float> data(100000);
  std::iota(data.begin(), data.end(), 0.0f);
  std::vector<uint64_t> keys = {7, 1ull << 40};
  std::vector<float> values = {1, 2, 3, 4};
  PushMessage m;
  m.job_id = "job";
  m.worker_id = "w-1";
  m.seq = 42;
  m.rank = 3;
  m.step = 9;
  m.num_parts = 2;
  m.shard_map_version = 5;
  m.dense.push_back({"w", 7, DType::kFp32, Payload(data.data(), data.size() * 4)});
  SparseSliceView sv;
  sv.table = "emb";
  sv.dtype = DType::kFp32;
  sv.keys = Payload(keys.data(), 16);
  sv.values = Payload(values.data(), 16);
  m.sparse.push_back(sv);
  grpc::ByteBuffer buf = wire::EncodePush(m).Finish();
  v1::PushRequest parsed;
  REQUIRE(parsed.ParseFromString(Flatten(buf)));
  REQUIRE(parsed.job_id() == "job");
  REQUIRE(parsed.seq() == 42);
  REQUIRE(parsed.rank() == 3);
  REQUIRE(parsed.num_parts() == 2);
  REQUIRE(parsed.dense_size() == 1);
  REQUIRE(parsed.dense(0).chunk() == 7);
  REQUIRE(parsed.dense(0).data().size() == data.size() * 4);
  REQUIRE(std::memcmp(parsed.dense(0).data().data(), data.data(), data.size() * 4) == 0);
  REQUIRE(parsed.sparse(0).keys().size() == 16);
}

TEST_CASE("a push's lr_scale travels as a float, is 1 when absent and is refused out of range", "[wire]") {
  PushMessage m;
  m.job_id = "job";
  m.lr_scale = 2.5f;
  v1::PushRequest parsed;
  grpc::ByteBuffer buf = wire::EncodePush(m).Finish();
  REQUIRE(parsed.ParseFromString(Flatten(buf)));
  CHECK(parsed.lr_scale() == 2.5f);
  v1::PushRequest req;
  req.set_job_id("j");
  std::string bytes = req.SerializeAsString();
  PushMessage out;
  out.lr_scale = 9.0f;
  REQUIRE(wire::DecodePush(Payload(bytes.data(), bytes.size()), &out).ok());
  CHECK(out.lr_scale == 1.0f);
  req.set_lr_scale(0.75f);
  bytes = req.SerializeAsString();
  REQUIRE(wire::DecodePush(Payload(bytes.data(), bytes.size()), &out).ok());
  CHECK(out.lr_scale == 0.75f);
  req.set_lr_scale(-1.0f);
  bytes = req.SerializeAsString();
  const absl::Status bad = wire::DecodePush(Payload(bytes.data(), bytes.size()), &out);
  CHECK(bad.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(bad.message(), "lr_scale"));
}

TEST_CASE("a push's samples travel as a varint, are 0 when absent and are refused past 2^40", "[wire]") {
  PushMessage m;
  m.job_id = "job";
  m.samples = 8192;
  v1::PushRequest parsed;
  grpc::ByteBuffer buf = wire::EncodePush(m).Finish();
  REQUIRE(parsed.ParseFromString(Flatten(buf)));
  CHECK(parsed.samples() == 8192);
  v1::PushRequest req;
  req.set_job_id("j");
  std::string bytes = req.SerializeAsString();
  PushMessage out;
  out.samples = 5;
  REQUIRE(wire::DecodePush(Payload(bytes.data(), bytes.size()), &out).ok());
  CHECK(out.samples == 0);
  req.set_samples(uint64_t{1} << 41);
  bytes = req.SerializeAsString();
  const absl::Status bad = wire::DecodePush(Payload(bytes.data(), bytes.size()), &out);
  CHECK(bad.code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(bad.message(), "samples 2199023255552 is over"));
}

TEST_CASE("unclocked travels on pushes and pulls, false when absent", "[wire]") {
  PushMessage m;
  m.job_id = "job";
  m.unclocked = true;
  grpc::ByteBuffer buf = wire::EncodePush(m).Finish();
  v1::PushRequest parsed;
  REQUIRE(parsed.ParseFromString(Flatten(buf)));
  CHECK(parsed.unclocked());
  std::string bytes = parsed.SerializeAsString();
  PushMessage back;
  REQUIRE(wire::DecodePush(Payload(bytes.data(), bytes.size()), &back).ok());
  CHECK(back.unclocked);
  parsed.set_unclocked(false);
  bytes = parsed.SerializeAsString();
  REQUIRE(wire::DecodePush(Payload(bytes.data(), bytes.size()), &back).ok());
  CHECK_FALSE(back.unclocked);
  PullMessage pm;
  pm.job_id = "job";
  pm.unclocked = true;
  buf = wire::EncodePull(pm).Finish();
  v1::PullRequest pulled;
  REQUIRE(pulled.ParseFromString(Flatten(buf)));
  CHECK(pulled.unclocked());
  bytes = pulled.SerializeAsString();
  PullMessage pback;
  REQUIRE(wire::DecodePull(Payload(bytes.data(), bytes.size()), &pback).ok());
  CHECK(pback.unclocked);
  pulled.set_unclocked(false);
  bytes = pulled.SerializeAsString();
  REQUIRE(wire::DecodePull(Payload(bytes.data(), bytes.size()), &pback).ok());
  CHECK_FALSE(pback.unclocked);
}

TEST_CASE("a pull's prefetch flag travels, false when absent", "[wire]") {
  PullMessage pm;
  pm.job_id = "job";
  pm.prefetch = true;
  grpc::ByteBuffer buf = wire::EncodePull(pm).Finish();
  v1::PullRequest pulled;
  REQUIRE(pulled.ParseFromString(Flatten(buf)));
  CHECK(pulled.prefetch());
  CHECK_FALSE(pulled.unclocked());
  std::string bytes = pulled.SerializeAsString();
  PullMessage back;
  REQUIRE(wire::DecodePull(Payload(bytes.data(), bytes.size()), &back).ok());
  CHECK(back.prefetch);
  pulled.set_prefetch(false);
  bytes = pulled.SerializeAsString();
  REQUIRE(wire::DecodePull(Payload(bytes.data(), bytes.size()), &back).ok());
  CHECK_FALSE(back.prefetch);
}

TEST_CASE("protoc-encoded pull decodes, including from many small pieces", "[wire]") {
  v1::PullRequest req;
  req.set_job_id("j");
  req.set_worker_id("w");
  req.set_step(17);
  req.set_dtype(v1::DTYPE_BF16);
  req.set_wait_timeout_ms(1500);
  auto* d = req.add_dense();
  d->set_table("w");
  d->set_chunk(3);
  auto* s = req.add_sparse();
  s->set_table("emb");
  std::vector<uint64_t> keys(1000);
  std::iota(keys.begin(), keys.end(), 100);
  s->set_keys(std::string(reinterpret_cast<const char*>(keys.data()), keys.size() * 8));
  const std::string bytes = req.SerializeAsString();
  // Split into 7-byte pieces so fields straddle piece boundaries.
  Payload p;
  for (size_t i = 0; i < bytes.size(); i += 7) p.Append(bytes.data() + i, std::min<size_t>(7, bytes.size() - i));
  PullMessage m;
  REQUIRE(wire::DecodePull(p, &m).ok());
  REQUIRE(m.job_id == "j");
  REQUIRE(m.step == 17);
  REQUIRE(m.dtype == DType::kBf16);
  REQUIRE(m.wait_timeout_ms == 1500);
  REQUIRE(m.dense.size() == 1);
  REQUIRE(m.dense[0].chunk == 3);
  REQUIRE(m.sparse[0].keys.size() == keys.size() * 8);
  std::vector<uint64_t> back(keys.size());
  m.sparse[0].keys.CopyTo(back.data());
  REQUIRE(back == keys);
}

TEST_CASE("pull results round trip through the codec", "[wire]") {
  PullResult r;
  auto& d = r.dense.emplace_back();
  d.table = "w";
  d.chunk = 2;
  d.data = OwnedBuffer::Allocate(4096);
  std::memset(d.data.data.get(), 0xab, 4096);
  r.applied_step = 12;
  grpc::ByteBuffer buf = wire::EncodePullResult(std::move(r)).Finish();
  Payload p;
  std::shared_ptr<const void> keep;
  REQUIRE(wire::ViewByteBuffer(buf, &p, &keep).ok());
  PullResponseView v;
  REQUIRE(wire::DecodePullResponse(p, &v).ok());
  REQUIRE(v.applied_step == 12);
  REQUIRE(v.dense.size() == 1);
  REQUIRE(v.dense[0].data.size() == 4096);
  std::string bytes = v.dense[0].data.ToString();
  REQUIRE(bytes == std::string(4096, '\xab'));
}

TEST_CASE("malformed messages are rejected with a reason", "[wire]") {
  PushMessage m;
  // A bytes field (job_id) claiming 100 bytes with 2 present.
  const unsigned char truncated[] = {0x0a, 100, 'a', 'b'};
  auto s = wire::DecodePush(Payload(truncated, sizeof(truncated)), &m);
  REQUIRE(s.code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(std::string(s.message()).find("overruns") != std::string::npos);
  // seq (field 3) sent with the length-delimited wire type.
  const unsigned char wrong_type[] = {0x1a, 0x00};
  s = wire::DecodePush(Payload(wrong_type, sizeof(wrong_type)), &m);
  REQUIRE(std::string(s.message()).find("'seq'") != std::string::npos);
  // An unterminated varint.
  const unsigned char varint[] = {0x18, 0xff, 0xff};
  REQUIRE_FALSE(wire::DecodePush(Payload(varint, sizeof(varint)), &m).ok());
  // Field number 0.
  const unsigned char zero[] = {0x00, 0x01};
  REQUIRE_FALSE(wire::DecodePush(Payload(zero, sizeof(zero)), &m).ok());
  // A job id that is not UTF-8, as protobuf's own parsers refuse it.
  const unsigned char bad_utf8[] = {0x0a, 6, 'j', 'o', 'b', '-', 0xff, 0xfe};
  s = wire::DecodePush(Payload(bad_utf8, sizeof(bad_utf8)), &m);
  REQUIRE(s.code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(std::string(s.message()).find("field 'job_id' is not valid UTF-8") != std::string::npos);
}

TEST_CASE("a stream response never carries invalid UTF-8 or an unbounded message", "[wire]") {
  const std::string id = "job-\xff\xfe" + std::string(20000, 'x');
  grpc::ByteBuffer buf =
      wire::EncodeStreamResponse(7, absl::NotFoundError("no job '" + id + "'"), 0, true, wire::Writer()).Finish();
  const std::string bytes = Flatten(buf);
  // protobuf's generated parser, as a Python or Go client's would, takes it.
  v1::StreamResponse r;
  REQUIRE(r.ParseFromString(bytes));
  CHECK(r.message().size() < kMaxStatusMessageBytes + 40);
  CHECK(r.message().find("job-\\xff\\xfe") != std::string::npos);
}

}  // namespace
}  // namespace fulcrum
