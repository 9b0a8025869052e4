#include "common/rpc/wire_codec.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/errors.h"
#include "common/status_macros.h"

namespace fulcrum::wire {
namespace {

constexpr uint32_t kVarint = 0;
constexpr uint32_t kFixed64 = 1;
constexpr uint32_t kLen = 2;
constexpr uint32_t kFixed32 = 5;
// Slices smaller than this are copied into the coalescing buffer: a slice
// per tiny field would cost more in bookkeeping than the copy.
constexpr size_t kCoalesceBelow = 256;
// PushRequest.samples above this is malformed (2^40: far beyond any dataset).
constexpr uint64_t kMaxPushSamples = uint64_t{1} << 40;


void FreeBuffer(void* p) { std::free(p); }

absl::Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("malformed message: ", what));
}

}  // namespace

void Writer::RawVarint(uint64_t v) {
  while (v >= 0x80) {
    small_.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
    ++size_;
  }
  small_.push_back(static_cast<char>(v));
  ++size_;
}

void Writer::Tag(uint32_t field, uint32_t wire_type) { RawVarint((field << 3) | wire_type); }

void Writer::Varint(uint32_t field, uint64_t value) {
  if (value == 0) return;
  Tag(field, kVarint);
  RawVarint(value);
}

void Writer::Float(uint32_t field, float value) {
  if (value == 0.0f) return;
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  Tag(field, kFixed32);
  for (int i = 0; i < 4; ++i) small_.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  size_ += 4;
}

void Writer::String(uint32_t field, std::string_view bytes) {
  if (bytes.empty()) return;
  Tag(field, kLen);
  RawVarint(bytes.size());
  small_.append(bytes.data(), bytes.size());
  size_ += bytes.size();
}

void Writer::FlushSmall() {
  if (small_.empty()) return;
  slices_.emplace_back(small_.data(), small_.size());  // copies
  small_.clear();
}

void Writer::AppendSlice(grpc::Slice slice) {
  if (slice.size() < kCoalesceBelow) {
    small_.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  } else {
    FlushSmall();
    slices_.push_back(std::move(slice));
  }
}

void Writer::External(uint32_t field, const Payload& data) {
  Tag(field, kLen);
  RawVarint(data.size());
  for (const ByteSpan& piece : data.pieces()) {
    AppendSlice(grpc::Slice(piece.data, piece.size, grpc::Slice::STATIC_SLICE));
  }
  size_ += data.size();
}

void Writer::Owned(uint32_t field, OwnedBuffer buffer) {
  Tag(field, kLen);
  RawVarint(buffer.size);
  size_ += buffer.size;
  if (buffer.size == 0) return;
  const size_t n = buffer.size;
  AppendSlice(grpc::Slice(buffer.data.release(), n, FreeBuffer));
}

void Writer::Shared(uint32_t field, const void* data, size_t size,
                    std::shared_ptr<const void> owner) {
  Tag(field, kLen);
  RawVarint(size);
  size_ += size;
  if (size == 0) return;
  auto* holder = new std::shared_ptr<const void>(std::move(owner));
  AppendSlice(grpc::Slice(const_cast<void*>(data), size,
                          [](void* h) { delete static_cast<std::shared_ptr<const void>*>(h); },
                          holder));
}

void Writer::Message(uint32_t field, Writer&& inner) {
  Tag(field, kLen);
  RawVarint(inner.size_);
  size_ += inner.size_;
  for (grpc::Slice& s : inner.slices_) AppendSlice(std::move(s));
  small_.append(inner.small_);
  inner.slices_.clear();
  inner.small_.clear();
  inner.size_ = 0;
}

grpc::ByteBuffer Writer::Finish() {
  FlushSmall();
  grpc::ByteBuffer out(slices_.data(), slices_.size());
  slices_.clear();
  size_ = 0;
  return out;
}

size_t Writer::FinishInto(uint8_t* dst) {
  FlushSmall();
  size_t n = 0;
  for (const grpc::Slice& s : slices_) {
    std::memcpy(dst + n, s.begin(), s.size());
    n += s.size();
  }
  slices_.clear();
  size_ = 0;
  return n;
}

Reader::Reader(const Payload& payload) : pieces_(payload.pieces()), remaining_(payload.size()) {}

absl::Status Reader::Byte(uint8_t* b) {
  if (remaining_ == 0) return Malformed("truncated varint");
  while (offset_ == pieces_[piece_].size) { ++piece_; offset_ = 0; }
  *b = pieces_[piece_].data[offset_++];
  --remaining_;
  return absl::OkStatus();
}

absl::Status Reader::Varint(uint64_t* value) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    uint8_t b = 0;
    RETURN_IF_ERROR(Byte(&b));
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if ((b & 0x80) == 0) { *value = v; return absl::OkStatus(); }
  }
  return Malformed("varint longer than 10 bytes");
}

absl::Status Reader::Next(uint32_t* field, uint32_t* wire_type) {
  uint64_t tag = 0;
  RETURN_IF_ERROR(Varint(&tag));
  if ((tag >> 3) == 0 || (tag >> 3) > 0x1fffffff) return Malformed("invalid field number");
  *field = static_cast<uint32_t>(tag >> 3);
  *wire_type = static_cast<uint32_t>(tag & 7);
  return absl::OkStatus();
}

absl::Status Reader::Advance(size_t n, Payload* out) {
  if (n > remaining_) {
    return Malformed(absl::StrCat("field of ", n, " bytes overruns the ", remaining_,
                                  " bytes left in the message"));
  }
  remaining_ -= n;
  while (n > 0) {
    while (offset_ == pieces_[piece_].size) { ++piece_; offset_ = 0; }
    const size_t take = std::min(n, pieces_[piece_].size - offset_);
    if (out) out->Append(pieces_[piece_].data + offset_, take);
    offset_ += take;
    n -= take;
  }
  return absl::OkStatus();
}

absl::Status Reader::Fixed32(uint32_t* value) {
  if (remaining_ < 4) return Malformed("truncated fixed32");
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    uint8_t b;
    RETURN_IF_ERROR(Byte(&b));
    v |= uint32_t{b} << (8 * i);
  }
  *value = v;
  return absl::OkStatus();
}

absl::Status Reader::Bytes(Payload* out) {
  uint64_t n;
  RETURN_IF_ERROR(Varint(&n));
  *out = Payload();
  return Advance(n, out);
}

absl::Status Reader::String(std::string* out) {
  Payload p;
  RETURN_IF_ERROR(Bytes(&p));
  *out = p.ToString();
  return absl::OkStatus();
}

absl::Status Reader::Skip(uint32_t wire_type) {
  uint64_t v;
  switch (wire_type) {
    case kVarint: return Varint(&v);
    case kFixed64: return Advance(8, nullptr);
    case kLen: {
      RETURN_IF_ERROR(Varint(&v));
      return Advance(v, nullptr);
    }
    case kFixed32: return Advance(4, nullptr);
    default: return Malformed(absl::StrCat("unsupported wire type ", wire_type));
  }
}

absl::Status ViewByteBuffer(const grpc::ByteBuffer& buffer, Payload* payload,
                            std::shared_ptr<const void>* keepalive) {
  auto slices = std::make_shared<std::vector<grpc::Slice>>();
  grpc::Status s = buffer.Dump(slices.get());
  if (!s.ok()) return absl::InternalError(absl::StrCat("reading request bytes: ", s.error_message()));
  *payload = Payload();
  for (const grpc::Slice& slice : *slices) payload->Append(slice.begin(), slice.size());
  *keepalive = std::move(slices);
  return absl::OkStatus();
}

namespace {

// Field readers that check the wire type before reading.
#define EXPECT_WIRE(type, name)                                                        \
  if (wt != (type)) return Malformed(absl::StrCat("field '", name, "' has wire type ", wt))

absl::Status ReadU32(Reader& r, uint32_t wt, const char* name, uint32_t* out) {
  EXPECT_WIRE(kVarint, name);
  uint64_t v;
  RETURN_IF_ERROR(r.Varint(&v));
  if (v > 0xffffffffu) return Malformed(absl::StrCat("field '", name, "' exceeds 32 bits"));
  *out = static_cast<uint32_t>(v);
  return absl::OkStatus();
}

absl::Status ReadU64(Reader& r, uint32_t wt, const char* name, uint64_t* out) {
  EXPECT_WIRE(kVarint, name);
  return r.Varint(out);
}

absl::Status ReadBool(Reader& r, uint32_t wt, const char* name, bool* out) {
  uint64_t v = 0;
  RETURN_IF_ERROR(ReadU64(r, wt, name, &v));
  *out = v != 0;
  return absl::OkStatus();
}

absl::Status ReadFloat(Reader& r, uint32_t wt, const char* name, float* out) {
  EXPECT_WIRE(kFixed32, name);
  uint32_t bits;
  RETURN_IF_ERROR(r.Fixed32(&bits));
  std::memcpy(out, &bits, 4);
  return absl::OkStatus();
}

absl::Status ReadStr(Reader& r, uint32_t wt, const char* name, std::string* out) {
  EXPECT_WIRE(kLen, name);
  RETURN_IF_ERROR(r.String(out));
  // As protobuf's parsers refuse it in a proto3 string.
  if (!IsValidUtf8(*out)) return Malformed(absl::StrCat("field '", name, "' is not valid UTF-8"));
  return absl::OkStatus();
}

absl::Status ReadPayload(Reader& r, uint32_t wt, const char* name, Payload* out) {
  EXPECT_WIRE(kLen, name);
  return r.Bytes(out);
}

absl::Status ReadDType(Reader& r, uint32_t wt, DType* out) {
  uint32_t v;
  RETURN_IF_ERROR(ReadU32(r, wt, "dtype", &v));
  // Unknown values are kept as-is and rejected by the server with context.
  *out = static_cast<DType>(v);
  return absl::OkStatus();
}

absl::Status DecodeDenseSlice(const Payload& p, DenseSliceView* d) {
  Reader r(p);
  while (!r.done()) {
    uint32_t f = 0, wt = 0;
    RETURN_IF_ERROR(r.Next(&f, &wt));
    switch (f) {
      case 1: RETURN_IF_ERROR(ReadStr(r, wt, "table", &d->table)); break;
      case 2: RETURN_IF_ERROR(ReadU32(r, wt, "chunk", &d->chunk)); break;
      case 3: RETURN_IF_ERROR(ReadDType(r, wt, &d->dtype)); break;
      case 15: RETURN_IF_ERROR(ReadPayload(r, wt, "data", &d->data)); break;
      default: RETURN_IF_ERROR(r.Skip(wt));
    }
  }
  return absl::OkStatus();
}

absl::Status DecodeSparseSlice(const Payload& p, SparseSliceView* s) {
  Reader r(p);
  while (!r.done()) {
    uint32_t f = 0, wt = 0;
    RETURN_IF_ERROR(r.Next(&f, &wt));
    switch (f) {
      case 1: RETURN_IF_ERROR(ReadStr(r, wt, "table", &s->table)); break;
      case 3: RETURN_IF_ERROR(ReadDType(r, wt, &s->dtype)); break;
      case 4: RETURN_IF_ERROR(ReadPayload(r, wt, "keys", &s->keys)); break;
      case 15: RETURN_IF_ERROR(ReadPayload(r, wt, "values", &s->values)); break;
      default: RETURN_IF_ERROR(r.Skip(wt));
    }
  }
  return absl::OkStatus();
}

Writer DenseSliceWriter(const std::string& table, uint32_t chunk, DType dtype) {
  Writer w;
  w.String(1, table);
  w.Varint(2, chunk);
  w.Varint(3, static_cast<uint64_t>(dtype));
  return w;
}

}  // namespace

Writer EncodePush(const PushMessage& m) {
  Writer w;
  w.String(1, m.job_id);
  w.String(2, m.worker_id);
  w.Varint(3, m.seq);
  w.Varint(4, m.rank);
  w.Varint(5, m.step);
  w.Varint(6, m.num_parts);
  w.Varint(7, m.shard_map_version);
  w.Varint(10, m.more_parts ? 1 : 0);
  w.Varint(11, m.incarnation);
  w.Float(12, m.lr_scale == 1.0f ? 0.0f : m.lr_scale);
  if (m.samples != 0) w.Varint(13, m.samples);
  if (m.unclocked) w.Varint(14, 1);
  for (const DenseSliceView& d : m.dense) {
    Writer inner = DenseSliceWriter(d.table, d.chunk, d.dtype);
    inner.External(15, d.data);
    w.Message(8, std::move(inner));
  }
  for (const SparseSliceView& s : m.sparse) {
    Writer inner;
    inner.String(1, s.table);
    inner.Varint(3, static_cast<uint64_t>(s.dtype));
    inner.External(4, s.keys);
    inner.External(15, s.values);
    w.Message(9, std::move(inner));
  }
  return w;
}

absl::Status DecodePush(const Payload& p, PushMessage* m) {
  Reader r(p);
  // Proto3: an absent field is 0 (a "more follow" part omits num_parts).
  m->num_parts = 0;
  m->more_parts = false;
  m->incarnation = 0;
  m->lr_scale = 1.0f;
  m->samples = 0;
  m->unclocked = false;
  while (!r.done()) {
    uint32_t f = 0, wt = 0;
    RETURN_IF_ERROR(r.Next(&f, &wt));
    switch (f) {
      case 1: RETURN_IF_ERROR(ReadStr(r, wt, "job_id", &m->job_id)); break;
      case 2: RETURN_IF_ERROR(ReadStr(r, wt, "worker_id", &m->worker_id)); break;
      case 12: {
        RETURN_IF_ERROR(ReadFloat(r, wt, "lr_scale", &m->lr_scale));
        if (m->lr_scale == 0.0f) m->lr_scale = 1.0f;  // proto3's default
        if (!(m->lr_scale > 0.0f && m->lr_scale <= 65536.0f)) {
          return Malformed(absl::StrCat("lr_scale ", m->lr_scale, " is not in (0, 65536]"));
        }
        break;
      }
      case 13: {
        RETURN_IF_ERROR(ReadU64(r, wt, "samples", &m->samples));
        if (m->samples > kMaxPushSamples) {
          return Malformed(absl::StrCat("samples ", m->samples, " is over ", kMaxPushSamples));
        }
        break;
      }
      case 3: RETURN_IF_ERROR(ReadU64(r, wt, "seq", &m->seq)); break;
      case 4: RETURN_IF_ERROR(ReadU32(r, wt, "rank", &m->rank)); break;
      case 5: RETURN_IF_ERROR(ReadU64(r, wt, "step", &m->step)); break;
      case 6: RETURN_IF_ERROR(ReadU32(r, wt, "num_parts", &m->num_parts)); break;
      case 7: RETURN_IF_ERROR(ReadU64(r, wt, "shard_map_version", &m->shard_map_version)); break;
      case 10: RETURN_IF_ERROR(ReadBool(r, wt, "more_parts", &m->more_parts)); break;
      case 11: RETURN_IF_ERROR(ReadU32(r, wt, "incarnation", &m->incarnation)); break;
      case 14: RETURN_IF_ERROR(ReadBool(r, wt, "unclocked", &m->unclocked)); break;
      case 8: {
        Payload sub;
        RETURN_IF_ERROR(ReadPayload(r, wt, "dense", &sub));
        RETURN_IF_ERROR(DecodeDenseSlice(sub, &m->dense.emplace_back()));
        break;
      }
      case 9: {
        Payload sub;
        RETURN_IF_ERROR(ReadPayload(r, wt, "sparse", &sub));
        RETURN_IF_ERROR(DecodeSparseSlice(sub, &m->sparse.emplace_back()));
        break;
      }
      default: RETURN_IF_ERROR(r.Skip(wt));
    }
  }
  return absl::OkStatus();
}

Writer EncodePull(const PullMessage& m) {
  Writer w;
  w.String(1, m.job_id);
  w.String(2, m.worker_id);
  w.Varint(3, m.rank);
  w.Varint(4, m.step);
  w.Varint(5, m.shard_map_version);
  w.Varint(6, static_cast<uint64_t>(m.dtype));
  for (const DenseChunkRef& d : m.dense) {
    Writer inner;
    inner.String(1, d.table);
    inner.Varint(2, d.chunk);
    w.Message(7, std::move(inner));
  }
  for (const SparseKeysView& s : m.sparse) {
    Writer inner;
    inner.String(1, s.table);
    inner.External(2, s.keys);
    w.Message(8, std::move(inner));
  }
  w.Varint(9, m.wait_timeout_ms);
  w.Varint(10, m.incarnation);
  if (m.unclocked) w.Varint(11, 1);
  if (m.prefetch) w.Varint(12, 1);
  return w;
}

absl::Status DecodePull(const Payload& p, PullMessage* m) {
  Reader r(p);
  m->dtype = DType::kUnspecified;
  m->incarnation = 0;
  m->unclocked = false;
  m->prefetch = false;
  while (!r.done()) {
    uint32_t f = 0, wt = 0;
    RETURN_IF_ERROR(r.Next(&f, &wt));
    switch (f) {
      case 1: RETURN_IF_ERROR(ReadStr(r, wt, "job_id", &m->job_id)); break;
      case 2: RETURN_IF_ERROR(ReadStr(r, wt, "worker_id", &m->worker_id)); break;
      case 3: RETURN_IF_ERROR(ReadU32(r, wt, "rank", &m->rank)); break;
      case 11: RETURN_IF_ERROR(ReadBool(r, wt, "unclocked", &m->unclocked)); break;
      case 12: RETURN_IF_ERROR(ReadBool(r, wt, "prefetch", &m->prefetch)); break;
      case 4: RETURN_IF_ERROR(ReadU64(r, wt, "step", &m->step)); break;
      case 5: RETURN_IF_ERROR(ReadU64(r, wt, "shard_map_version", &m->shard_map_version)); break;
      case 6: RETURN_IF_ERROR(ReadDType(r, wt, &m->dtype)); break;
      case 10: RETURN_IF_ERROR(ReadU32(r, wt, "incarnation", &m->incarnation)); break;
      case 7: {
        Payload sub;
        RETURN_IF_ERROR(ReadPayload(r, wt, "dense", &sub));
        DenseChunkRef& d = m->dense.emplace_back();
        Reader ir(sub);
        while (!ir.done()) {
          uint32_t f2 = 0, wt2 = 0;
          RETURN_IF_ERROR(ir.Next(&f2, &wt2));
          if (f2 == 1) RETURN_IF_ERROR(ReadStr(ir, wt2, "dense.table", &d.table));
          else if (f2 == 2) RETURN_IF_ERROR(ReadU32(ir, wt2, "dense.chunk", &d.chunk));
          else RETURN_IF_ERROR(ir.Skip(wt2));
        }
        break;
      }
      case 8: {
        Payload sub;
        RETURN_IF_ERROR(ReadPayload(r, wt, "sparse", &sub));
        SparseKeysView& s = m->sparse.emplace_back();
        Reader ir(sub);
        while (!ir.done()) {
          uint32_t f2 = 0, wt2 = 0;
          RETURN_IF_ERROR(ir.Next(&f2, &wt2));
          if (f2 == 1) RETURN_IF_ERROR(ReadStr(ir, wt2, "sparse.table", &s.table));
          else if (f2 == 2) RETURN_IF_ERROR(ReadPayload(ir, wt2, "sparse.keys", &s.keys));
          else RETURN_IF_ERROR(ir.Skip(wt2));
        }
        break;
      }
      case 9: RETURN_IF_ERROR(ReadU32(r, wt, "wait_timeout_ms", &m->wait_timeout_ms)); break;
      default: RETURN_IF_ERROR(r.Skip(wt));
    }
  }
  if (m->dtype == DType::kUnspecified) m->dtype = DType::kFp32;
  return absl::OkStatus();
}

Writer EncodePushResult(const PushResult& r) {
  Writer w;
  w.Varint(1, r.duplicate ? 1 : 0);
  w.Varint(2, r.applied_step);
  return w;
}

absl::Status DecodePushResult(const Payload& p, PushResult* out) {
  Reader r(p);
  while (!r.done()) {
    uint32_t f = 0, wt = 0;
    RETURN_IF_ERROR(r.Next(&f, &wt));
    uint64_t v = 0;
    if (f == 1) { RETURN_IF_ERROR(ReadU64(r, wt, "duplicate", &v)); out->duplicate = v != 0; }
    else if (f == 2) RETURN_IF_ERROR(ReadU64(r, wt, "applied_step", &out->applied_step));
    else RETURN_IF_ERROR(r.Skip(wt));
  }
  return absl::OkStatus();
}

Writer EncodePullResult(PullResult&& res) {
  Writer w;
  for (PullResult::Dense& d : res.dense) {
    Writer inner = DenseSliceWriter(d.table, d.chunk, d.dtype);
    if (d.owner != nullptr) {
      inner.Shared(15, d.shared, d.shared_size, std::move(d.owner));
    } else {
      inner.Owned(15, std::move(d.data));
    }
    w.Message(1, std::move(inner));
  }
  for (PullResult::Sparse& s : res.sparse) {
    Writer inner;
    inner.String(1, s.table);
    inner.Varint(3, static_cast<uint64_t>(s.dtype));
    inner.Owned(15, std::move(s.values));
    w.Message(2, std::move(inner));
  }
  w.Varint(3, res.applied_step);
  return w;
}

absl::Status DecodePullResponse(const Payload& p, PullResponseView* out) {
  Reader r(p);
  while (!r.done()) {
    uint32_t f = 0, wt = 0;
    RETURN_IF_ERROR(r.Next(&f, &wt));
    Payload sub;
    switch (f) {
      case 1:
        RETURN_IF_ERROR(ReadPayload(r, wt, "dense", &sub));
        RETURN_IF_ERROR(DecodeDenseSlice(sub, &out->dense.emplace_back()));
        break;
      case 2:
        RETURN_IF_ERROR(ReadPayload(r, wt, "sparse", &sub));
        RETURN_IF_ERROR(DecodeSparseSlice(sub, &out->sparse.emplace_back()));
        break;
      case 3: RETURN_IF_ERROR(ReadU64(r, wt, "applied_step", &out->applied_step)); break;
      default: RETURN_IF_ERROR(r.Skip(wt));
    }
  }
  return absl::OkStatus();
}

Writer EncodeStreamRequest(uint64_t id, bool is_push, Writer&& body) {
  Writer w;
  w.Varint(1, id);
  w.Message(is_push ? 2 : 3, std::move(body));
  return w;
}

absl::Status DecodeStreamRequest(const Payload& p, StreamRequestView* out) {
  Reader r(p);
  while (!r.done()) {
    uint32_t f = 0, wt = 0;
    RETURN_IF_ERROR(r.Next(&f, &wt));
    if (f == 1) {
      RETURN_IF_ERROR(ReadU64(r, wt, "id", &out->id));
    } else if (f == 2 || f == 3) {
      RETURN_IF_ERROR(ReadPayload(r, wt, f == 2 ? "push" : "pull", &out->body));
      out->is_push = f == 2;
      out->has_body = true;
    } else {
      RETURN_IF_ERROR(r.Skip(wt));
    }
  }
  return absl::OkStatus();
}

Writer EncodeStreamResponse(uint64_t id, const absl::Status& status, uint64_t shard_map_version,
                            bool is_push, Writer&& body) {
  Writer w;
  w.Varint(1, id);
  w.Varint(2, static_cast<uint64_t>(status.code()));
  w.String(3, SafeStatusMessage(std::string_view(status.message().data(), status.message().size())));
  w.Varint(4, shard_map_version);
  if (status.ok()) w.Message(is_push ? 5 : 6, std::move(body));
  return w;
}

absl::Status DecodeStreamResponse(const Payload& p, StreamResponseView* out) {
  Reader r(p);
  while (!r.done()) {
    uint32_t f = 0, wt = 0;
    RETURN_IF_ERROR(r.Next(&f, &wt));
    uint64_t v = 0;
    switch (f) {
      case 1: RETURN_IF_ERROR(ReadU64(r, wt, "id", &out->id)); break;
      case 2:
        RETURN_IF_ERROR(ReadU64(r, wt, "code", &v));
        out->code = static_cast<int32_t>(v);
        break;
      case 3: RETURN_IF_ERROR(ReadStr(r, wt, "message", &out->message)); break;
      case 4: RETURN_IF_ERROR(ReadU64(r, wt, "shard_map_version", &out->shard_map_version)); break;
      case 5:
      case 6:
        RETURN_IF_ERROR(ReadPayload(r, wt, "body", &out->body));
        out->is_push = f == 5;
        break;
      default: RETURN_IF_ERROR(r.Skip(wt));
    }
  }
  return absl::OkStatus();
}

absl::Status StatusOf(const StreamResponseView& r) {
  if (r.code == 0) return absl::OkStatus();
  if (r.shard_map_version != 0) return WrongShardError(r.message, r.shard_map_version);
  return absl::Status(static_cast<absl::StatusCode>(r.code), r.message);
}

}  // namespace fulcrum::wire
