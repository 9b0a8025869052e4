#include "common/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/file_util.h"
#include "common/status_macros.h"

namespace fulcrum::safetensors {
namespace {

// A reader of the header's JSON: objects, strings, arrays and
// non-negative integers, which is all a safetensors header holds.
class Json {
 public:
  explicit Json(const std::string& text) : s_(text) {}

  absl::Status Expect(char c) {
    Skip();
    if (i_ >= s_.size() || s_[i_] != c) return Error(absl::StrCat("expected '", std::string(1, c), "'"));
    ++i_;
    return absl::OkStatus();
  }
  bool Peek(char c) {
    Skip();
    return i_ < s_.size() && s_[i_] == c;
  }
  absl::StatusOr<std::string> String() {
    RETURN_IF_ERROR(Expect('"'));
    std::string out;
    while (i_ < s_.size() && s_[i_] != '"') {
      char c = s_[i_++];
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) break;
      c = s_[i_++];
      switch (c) {
        case 'n': out += '\n'; break;
        case 't': out += '\t'; break;
        case 'r': out += '\r'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'u': {
          if (i_ + 4 > s_.size()) return Error("a \\u escape is cut short");
          unsigned v = 0;
          for (int k = 0; k < 4; ++k, ++i_) {
            const char h = s_[i_];
            const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                        : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
            if (d < 0) return Error("a \\u escape with a digit that is not hexadecimal");
            v = v * 16 + static_cast<unsigned>(d);
          }
          if (v >= 0x80) return Error("a \\u escape beyond ASCII");
          out += static_cast<char>(v);
          break;
        }
        default: out += c;
      }
    }
    RETURN_IF_ERROR(Expect('"'));
    return out;
  }
  absl::StatusOr<int64_t> Integer() {
    Skip();
    const size_t start = i_;
    int64_t v = 0;
    while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') {
      if (i_ - start == 18) return Error("an integer of more than 18 digits");
      v = v * 10 + (s_[i_++] - '0');
    }
    if (i_ == start) return Error("expected a non-negative integer");
    return v;
  }
  absl::StatusOr<std::vector<int64_t>> Integers() {
    RETURN_IF_ERROR(Expect('['));
    std::vector<int64_t> out;
    if (Peek(']')) {
      ++i_;
      return out;
    }
    for (;;) {
      ASSIGN_OR_RETURN(int64_t v, Integer());
      out.push_back(v);
      if (Peek(',')) {
        ++i_;
        continue;
      }
      RETURN_IF_ERROR(Expect(']'));
      return out;
    }
  }
  bool AtEnd() {
    Skip();
    return i_ == s_.size();
  }
  absl::Status Error(const std::string& what) const {
    return absl::DataLossError(absl::StrCat("header byte ", i_, ": ", what));
  }

 private:
  void Skip() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
  }
  const std::string& s_;
  size_t i_ = 0;
};

struct Entry {
  ReadTensor tensor;
  int64_t begin = 0, end = 0;
};

// One tensor's object: {"dtype": ..., "shape": [...], "data_offsets": [b, e]}.
absl::StatusOr<Entry> ParseEntry(Json& j, std::string name) {
  Entry e;
  e.tensor.name = std::move(name);
  bool dtype = false, shape = false, offsets = false;
  RETURN_IF_ERROR(j.Expect('{'));
  while (!j.Peek('}')) {
    ASSIGN_OR_RETURN(std::string key, j.String());
    RETURN_IF_ERROR(j.Expect(':'));
    if (key == "dtype") {
      ASSIGN_OR_RETURN(e.tensor.dtype, j.String());
      dtype = true;
    } else if (key == "shape") {
      ASSIGN_OR_RETURN(e.tensor.shape, j.Integers());
      shape = true;
    } else if (key == "data_offsets") {
      ASSIGN_OR_RETURN(std::vector<int64_t> o, j.Integers());
      if (o.size() != 2 || o[1] < o[0]) return j.Error(absl::StrCat("tensor '", e.tensor.name, "': bad data_offsets"));
      e.begin = o[0];
      e.end = o[1];
      offsets = true;
    } else {
      return j.Error(absl::StrCat("tensor '", e.tensor.name, "': unknown field '", key, "'"));
    }
    if (j.Peek(',')) RETURN_IF_ERROR(j.Expect(','));
  }
  RETURN_IF_ERROR(j.Expect('}'));
  if (!dtype || !shape || !offsets) {
    return j.Error(absl::StrCat("tensor '", e.tensor.name, "' lacks dtype, shape or data_offsets"));
  }
  return e;
}

}  // namespace

std::string JsonQuoted(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      out += absl::StrFormat("\\u%04x", ch);
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

size_t DtypeSize(const std::string& dtype) {
  static const std::map<std::string, size_t> kSizes = {{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2},
                                                       {"I64", 8}, {"I32", 4}, {"I16", 2}, {"I8", 1},
                                                       {"U8", 1},  {"BOOL", 1}};
  auto it = kSizes.find(dtype);
  return it == kSizes.end() ? 0 : it->second;
}

absl::StatusOr<std::string> Header(const std::vector<Tensor>& tensors,
                                   const std::map<std::string, std::string>& metadata) {
  std::set<std::string> names;
  std::string header = "{\"__metadata__\":{";
  bool first = true;
  for (const auto& [k, v] : metadata) {
    absl::StrAppend(&header, first ? "" : ",", JsonQuoted(k), ":", JsonQuoted(v));
    first = false;
  }
  header += "}";
  size_t offset = 0;
  for (const Tensor& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor name '", t.name, "' is empty, reserved or repeated"));
    }
    const size_t size = DtypeSize(t.dtype);
    if (size == 0) return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': unknown dtype '", t.dtype, "'"));
    uint64_t elements = 1;
    for (int64_t d : t.shape) {
      if (d < 0) return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': dimension ", d, " < 0"));
      elements *= static_cast<uint64_t>(d);
    }
    if (elements * size != t.bytes) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': shape [", absl::StrJoin(t.shape, ","),
                                                     "] of ", t.dtype, " is ", elements * size, " bytes, given ",
                                                     t.bytes));
    }
    absl::StrAppend(&header, ",", JsonQuoted(t.name), ":{\"dtype\":\"", t.dtype, "\",\"shape\":[",
                    absl::StrJoin(t.shape, ","), "],\"data_offsets\":[", offset, ",", offset + t.bytes, "]}");
    offset += t.bytes;
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';  // the data starts 8-byte aligned
  return header;
}

absl::Status Write(const std::string& path, const std::vector<Tensor>& tensors,
                   const std::map<std::string, std::string>& metadata, uint64_t* file_bytes) {
  ASSIGN_OR_RETURN(std::string header, Header(tensors, metadata));
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return absl::NotFoundError(absl::StrCat("cannot write ", tmp, ": ", std::strerror(errno)));
  const uint64_t n = header.size();  // little-endian on every host Fulcrum builds for
  bool ok = std::fwrite(&n, 8, 1, f) == 1 && std::fwrite(header.data(), 1, header.size(), f) == header.size();
  uint64_t data = 0;
  for (const Tensor& t : tensors) {
    ok = ok && (t.bytes == 0 || std::fwrite(t.data, 1, t.bytes, f) == t.bytes);
    data += t.bytes;
  }
  const int saved = errno;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = ok ? errno : saved;
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat("writing ", path, ": ", std::strerror(err)));
  }
  if (file_bytes != nullptr) *file_bytes = 8 + header.size() + data;
  return absl::OkStatus();
}

absl::StatusOr<File> Read(const std::string& path) {
  ASSIGN_OR_RETURN(const std::string bytes, ReadFileToString(path, "safetensors"));
  auto loss = [&](const std::string& what) { return absl::DataLossError(absl::StrCat(path, ": ", what)); };
  uint64_t n = 0;
  if (bytes.size() < 8) return loss("shorter than the 8-byte header length");
  std::memcpy(&n, bytes.data(), 8);
  if (n > bytes.size() - 8) return loss(absl::StrCat("header of ", n, " bytes is longer than the file's ", bytes.size()));
  const std::string header = bytes.substr(8, n);
  const size_t data_begin = 8 + n, data_size = bytes.size() - data_begin;
  File file;
  std::vector<Entry> entries;
  Json j(header);
  auto parsed = [&]() -> absl::Status {
    RETURN_IF_ERROR(j.Expect('{'));
    while (!j.Peek('}')) {
      ASSIGN_OR_RETURN(std::string name, j.String());
      RETURN_IF_ERROR(j.Expect(':'));
      if (name == "__metadata__") {
        RETURN_IF_ERROR(j.Expect('{'));
        while (!j.Peek('}')) {
          ASSIGN_OR_RETURN(std::string k, j.String());
          RETURN_IF_ERROR(j.Expect(':'));
          ASSIGN_OR_RETURN(file.metadata[k], j.String());
          if (j.Peek(',')) RETURN_IF_ERROR(j.Expect(','));
        }
        RETURN_IF_ERROR(j.Expect('}'));
      } else {
        ASSIGN_OR_RETURN(Entry e, ParseEntry(j, std::move(name)));
        entries.push_back(std::move(e));
      }
      if (j.Peek(',')) RETURN_IF_ERROR(j.Expect(','));
    }
    RETURN_IF_ERROR(j.Expect('}'));
    if (!j.AtEnd()) return j.Error("text after the header's object");
    return absl::OkStatus();
  }();
  if (!parsed.ok()) return loss(std::string(parsed.message()));
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  int64_t next = 0;
  for (Entry& e : entries) {
    const size_t size = DtypeSize(e.tensor.dtype);
    if (size == 0) return loss(absl::StrCat("tensor '", e.tensor.name, "': unknown dtype '", e.tensor.dtype, "'"));
    uint64_t elements = 1;
    for (int64_t d : e.tensor.shape) elements *= static_cast<uint64_t>(d);
    if (e.begin != next) {
      return loss(absl::StrCat("tensor '", e.tensor.name, "' starts at data byte ", e.begin, ", not ", next,
                               " (a gap or an overlap)"));
    }
    if (static_cast<uint64_t>(e.end - e.begin) != elements * size) {
      return loss(absl::StrCat("tensor '", e.tensor.name, "' has ", e.end - e.begin, " bytes for shape [",
                               absl::StrJoin(e.tensor.shape, ","), "] of ", e.tensor.dtype));
    }
    if (static_cast<uint64_t>(e.end) > data_size) {
      return loss(absl::StrCat("tensor '", e.tensor.name, "' ends at data byte ", e.end, ", past the file's ",
                               data_size));
    }
    e.tensor.data = bytes.substr(data_begin + static_cast<size_t>(e.begin), static_cast<size_t>(e.end - e.begin));
    next = e.end;
    file.tensors.push_back(std::move(e.tensor));
  }
  if (static_cast<uint64_t>(next) != data_size) {
    return loss(absl::StrCat(data_size - static_cast<uint64_t>(next), " bytes after the last tensor"));
  }
  return file;
}

}  // namespace fulcrum::safetensors
