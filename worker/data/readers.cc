#include <zlib.h>

#include <charconv>
#include <cmath>
#include <limits>
#include <cstring>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/shard_map.h"
#include "common/status_macros.h"
#include "worker/data/dataset.h"

namespace fulcrum::data {
namespace {

absl::Status FileError(const std::string& path, absl::string_view where, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", where, ": ", what));
}

uint32_t BigEndian32(const std::string& s, size_t at) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data() + at);
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

// Checks a label and turns it into the stored value.
absl::Status CheckLabel(double v, LabelKind kind, int num_classes, const std::string& path, absl::string_view where,
                        float* out) {
  if (!std::isfinite(v)) return FileError(path, where, "label is not a finite number");
  // Class ids size the model's output layer: bounded (found by fuzz_readers,
  // a label of 1e50 overflowed the class count).
  constexpr int kMaxClasses = 1 << 20;
  switch (kind) {
    case LabelKind::kClass:
      if (v >= kMaxClasses && v == std::floor(v)) {
        return FileError(path, where, absl::StrCat("label ", v, " is beyond the largest class id supported (",
                                                   kMaxClasses - 1, ")"));
      }
      if (v != std::floor(v) || v < 0 || (num_classes > 0 && v >= num_classes)) {
        return FileError(path, where,
                         num_classes > 0
                             ? absl::StrCat("label ", v, " is outside [0, ", num_classes, ")")
                             : absl::StrCat("label ", v, " is not a non-negative integer class"));
      }
      *out = static_cast<float>(v);
      return absl::OkStatus();
    case LabelKind::kBinary:
      if (v == 1) *out = 1;
      else if (v == 0 || v == -1) *out = 0;
      else return FileError(path, where, absl::StrCat("label ", v, " is not binary (0/1 or -1/+1)"));
      return absl::OkStatus();
    case LabelKind::kValue:
      if (std::fabs(v) > std::numeric_limits<float>::max()) {
        return FileError(path, where, absl::StrCat("label ", v, " is outside the fp32 range"));
      }
      *out = static_cast<float>(v);
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

int ClassesOf(const std::vector<float>& labels, LabelKind kind, int declared) {
  if (kind == LabelKind::kValue) return 0;
  if (kind == LabelKind::kBinary) return 2;
  if (declared > 0) return declared;
  float mx = 0;
  for (float l : labels) mx = std::max(mx, l);
  return static_cast<int>(mx) + 1;
}

// ---------------------------------------------------------------- IDX

class IdxDataset final : public Dataset {
 public:
  IdxDataset(std::string pixels, size_t n, int features, std::vector<float> labels, float scale, int classes,
             std::string source)
      : pixels_(std::move(pixels)), n_(n), features_(features), labels_(std::move(labels)), scale_(scale) {
    num_classes_ = classes;
    source_ = std::move(source);
    stored_ = {reinterpret_cast<const uint8_t*>(pixels_.data()) + 16, n_, features_, scale_};
  }
  const StoredBytes* stored_bytes() const override { return &stored_; }
  size_t size() const override { return n_; }
  int num_features() const override { return features_; }
  bool sparse() const override { return false; }
  float label(size_t i) const override { return labels_[i]; }
  void Fill(const int64_t* idx, int n, Batch* out) const override {
    out->Reset(n, features_);
    for (int i = 0; i < n; ++i) {
      const auto* src = reinterpret_cast<const uint8_t*>(pixels_.data()) + 16 + size_t{1} * idx[i] * features_;
      float* dst = out->dense.data() + size_t{1} * i * features_;
      for (int j = 0; j < features_; ++j) dst[j] = src[j] * scale_;
      out->labels[i] = labels_[idx[i]];
    }
  }

 private:
  std::string pixels_;  // the whole images file; pixels start at byte 16
  size_t n_;
  int features_;
  std::vector<float> labels_;
  float scale_;
  StoredBytes stored_;
};

// ---------------------------------------------------------------- CSR (LibSVM)

class CsrDataset final : public Dataset {
 public:
  size_t size() const override { return labels_.size(); }
  int num_features() const override { return features_; }
  bool sparse() const override { return true; }
  float label(size_t i) const override { return labels_[i]; }
  void Fill(const int64_t* idx, int n, Batch* out) const override {
    out->Reset(n, 0);
    for (int i = 0; i < n; ++i) {
      const size_t r = idx[i];
      out->keys.insert(out->keys.end(), keys_.begin() + offsets_[r], keys_.begin() + offsets_[r + 1]);
      out->values.insert(out->values.end(), values_.begin() + offsets_[r], values_.begin() + offsets_[r + 1]);
      out->offsets.push_back(static_cast<int32_t>(out->keys.size()));
      out->labels[i] = labels_[r];
    }
  }

  std::vector<size_t> offsets_{0};
  std::vector<uint64_t> keys_;
  std::vector<float> values_;
  std::vector<float> labels_;
  int features_ = 0;
  void Finish(LabelKind kind, int classes, std::string source) {
    num_classes_ = ClassesOf(labels_, kind, classes);
    source_ = std::move(source);
  }
};

// ---------------------------------------------------------------- dense (CSV)

class DenseDataset final : public Dataset {
 public:
  DenseDataset(std::vector<float> features, std::vector<float> labels, int num_features, int num_classes,
               std::string source)
      : features_data_(std::move(features)), labels_(std::move(labels)), features_(num_features) {
    num_classes_ = num_classes;
    source_ = std::move(source);
  }
  size_t size() const override { return labels_.size(); }
  int num_features() const override { return features_; }
  bool sparse() const override { return false; }
  float label(size_t i) const override { return labels_[i]; }
  void Fill(const int64_t* idx, int n, Batch* out) const override {
    out->Reset(n, features_);
    for (int i = 0; i < n; ++i) {
      std::memcpy(out->dense.data() + size_t{1} * i * features_, features_data_.data() + size_t{1} * idx[i] * features_,
                  sizeof(float) * features_);
      out->labels[i] = labels_[idx[i]];
    }
  }

 private:
  std::vector<float> features_data_;
  std::vector<float> labels_;
  int features_;
};

// Iterates over lines, counting them from 1.
class Lines {
 public:
  explicit Lines(const std::string& text) : text_(text) {}
  bool Next(std::string_view* line) {
    if (pos_ >= text_.size()) return false;
    size_t end = text_.find('\n', pos_);
    if (end == std::string::npos) end = text_.size();
    *line = std::string_view(text_).substr(pos_, end - pos_);
    if (!line->empty() && line->back() == '\r') line->remove_suffix(1);
    pos_ = end + 1;
    ++number_;
    return true;
  }
  int number() const { return number_; }

 private:
  const std::string& text_;
  size_t pos_ = 0;
  int number_ = 0;
};

// Debian's Abseil has its own string_view: StrCat cannot take std's.
absl::string_view A(std::string_view s) { return absl::string_view(s.data(), s.size()); }

std::string_view Trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool ParseDouble(std::string_view s, double* out) {
  s = Trim(s);
  if (s.empty()) return false;
  if (s.front() == '+') s.remove_prefix(1);
  const auto r = std::from_chars(s.data(), s.data() + s.size(), *out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size();
}

}  // namespace

namespace {

class SubsetDataset final : public Dataset {
 public:
  SubsetDataset(const Dataset* base, std::vector<int64_t> indices) : base_(base), indices_(std::move(indices)) {
    num_classes_ = base->num_classes();
    source_ = base->source();
  }
  size_t size() const override { return indices_.size(); }
  int num_features() const override { return base_->num_features(); }
  bool sparse() const override { return base_->sparse(); }
  float label(size_t i) const override { return base_->label(indices_[i]); }
  const StoredBytes* stored_bytes() const override { return base_->stored_bytes(); }
  int64_t stored_row(int64_t i) const override { return base_->stored_row(indices_[i]); }
  // Called by several pipeline threads at once (PrefetchOptions::threads):
  // no state of its own.
  void Fill(const int64_t* idx, int n, Batch* out) const override {
    std::vector<int64_t> mapped(n);
    for (int i = 0; i < n; ++i) mapped[i] = indices_[idx[i]];
    base_->Fill(mapped.data(), n, out);
  }

 private:
  const Dataset* base_;
  std::vector<int64_t> indices_;
};

}  // namespace

std::unique_ptr<Dataset> BytesInMemory(const std::vector<uint8_t>& pixels, std::vector<float> labels, int num_features,
                                       float scale, int num_classes, std::string source) {
  // IdxDataset keeps a whole IDX file, whose pixels start at byte 16.
  std::string file(16, '\0');
  file.append(reinterpret_cast<const char*>(pixels.data()), pixels.size());
  const size_t n = labels.size();
  return std::make_unique<IdxDataset>(std::move(file), n, num_features, std::move(labels), scale, num_classes,
                                      std::move(source));
}

std::unique_ptr<Dataset> DenseInMemory(std::vector<float> features, std::vector<float> labels, int num_features,
                                       int num_classes, std::string source) {
  return std::make_unique<DenseDataset>(std::move(features), std::move(labels), num_features, num_classes,
                                        std::move(source));
}

std::unique_ptr<Dataset> Subset(const Dataset* base, std::vector<int64_t> indices) {
  return std::make_unique<SubsetDataset>(base, std::move(indices));
}

absl::StatusOr<std::string> ReadFileMaybeGz(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  if (f == nullptr) return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  gzbuffer(f, 1 << 20);
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const int n = gzread(f, buf, sizeof(buf));
    if (n < 0) {
      int code = 0;
      const std::string msg = gzerror(f, &code);
      gzclose(f);
      return absl::DataLossError(absl::StrCat(path, ": byte ", out.size(), ": cannot decompress: ", msg));
    }
    if (n == 0) break;
    out.append(buf, n);
  }
  // A truncated .gz reads as a short file without an error from gzread on
  // some zlib versions; gzclose_r reports it.
  const int rc = gzclose(f);
  if (rc != Z_OK && rc != Z_BUF_ERROR) {
    return absl::DataLossError(absl::StrCat(path, ": byte ", out.size(), ": compressed stream is corrupt (zlib ", rc, ")"));
  }
  if (rc == Z_BUF_ERROR) {
    return absl::DataLossError(absl::StrCat(path, ": byte ", out.size(), ": compressed stream is truncated"));
  }
  return out;
}

namespace {

// An IDX file of `what` starts with a `header_bytes` header whose first word is `magic`.
absl::Status CheckIdxHeader(const std::string& bytes, const std::string& path, size_t header_bytes, uint32_t magic,
                            const char* what) {
  if (bytes.size() < header_bytes) {
    return FileError(path, absl::StrCat("byte ", bytes.size()),
                     absl::StrCat("file ends inside the ", header_bytes, "-byte IDX header"));
  }
  if (BigEndian32(bytes, 0) != magic) {
    return FileError(path, "byte 0",
                     absl::StrCat("wrong magic number 0x", absl::Hex(BigEndian32(bytes, 0), absl::kZeroPad8),
                                  " (IDX ", what, " are 0x", absl::Hex(magic, absl::kZeroPad8), ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Dataset>> ReadIdx(const std::string& images_path, const std::string& labels_path,
                                                 const IdxOptions& options) {
  ASSIGN_OR_RETURN(std::string images, ReadFileMaybeGz(images_path));
  ASSIGN_OR_RETURN(std::string labels, ReadFileMaybeGz(labels_path));
  RETURN_IF_ERROR(CheckIdxHeader(images, images_path, 16, 0x00000803, "images"));
  const uint64_t n = BigEndian32(images, 4), rows = BigEndian32(images, 8), cols = BigEndian32(images, 12);
  if (rows == 0 || cols == 0 || rows * cols > (1u << 24)) {
    return FileError(images_path, "byte 8", absl::StrCat("implausible image size ", rows, " x ", cols));
  }
  const uint64_t want = 16 + n * rows * cols;
  if (images.size() != want) {
    return FileError(images_path, absl::StrCat("byte ", images.size()),
                     absl::StrCat(images.size() < want ? "file is truncated" : "file has trailing bytes", ": header says ",
                                  n, " images of ", rows, " x ", cols, " = ", want, " bytes"));
  }
  RETURN_IF_ERROR(CheckIdxHeader(labels, labels_path, 8, 0x00000801, "labels"));
  const uint64_t nl = BigEndian32(labels, 4);
  if (nl != n) {
    return FileError(labels_path, "byte 4", absl::StrCat(nl, " labels for ", n, " images in ", images_path));
  }
  if (labels.size() != 8 + n) {
    return FileError(labels_path, absl::StrCat("byte ", labels.size()),
                     absl::StrCat(labels.size() < 8 + n ? "file is truncated" : "file has trailing bytes",
                                  ": header says ", n, " labels"));
  }
  std::vector<float> y(n);
  for (uint64_t i = 0; i < n; ++i) {
    const int v = static_cast<uint8_t>(labels[8 + i]);
    if (v >= options.num_classes) {
      return FileError(labels_path, absl::StrCat("byte ", 8 + i),
                       absl::StrCat("label ", v, " is outside [0, ", options.num_classes, ")"));
    }
    y[i] = static_cast<float>(v);
  }
  return std::unique_ptr<Dataset>(new IdxDataset(std::move(images), n, static_cast<int>(rows * cols), std::move(y),
                                                 options.scale, options.num_classes, images_path));
}

absl::StatusOr<std::unique_ptr<Dataset>> ReadLibSvm(const std::string& path, const LibSvmOptions& options) {
  ASSIGN_OR_RETURN(std::string text, ReadFileMaybeGz(path));
  auto ds = std::make_unique<CsrDataset>();
  Lines lines(text);
  std::string_view line;
  while (lines.Next(&line)) {
    if (size_t hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    line = Trim(line);
    if (line.empty()) continue;
    const std::string where = absl::StrCat("line ", lines.number());
    size_t pos = line.find_first_of(" \t");
    double label;
    if (!ParseDouble(line.substr(0, pos), &label)) {
      return FileError(path, where, absl::StrCat("label \"", A(line.substr(0, pos)), "\" is not a number"));
    }
    float stored;
    RETURN_IF_ERROR(CheckLabel(label, options.labels, options.num_classes, path, where, &stored));
    uint64_t previous = 0;
    bool first = true;
    while (pos != std::string_view::npos) {
      const size_t start = line.find_first_not_of(" \t", pos);
      if (start == std::string_view::npos) break;
      pos = line.find_first_of(" \t", start);
      const std::string_view item = line.substr(start, pos == std::string_view::npos ? std::string_view::npos : pos - start);
      const size_t colon = item.find(':');
      if (colon == std::string_view::npos) {
        return FileError(path, where, absl::StrCat("\"", A(item), "\" is not index:value"));
      }
      uint64_t index = 0;
      const auto r = std::from_chars(item.data(), item.data() + colon, index);
      if (r.ec != std::errc() || r.ptr != item.data() + colon) {
        return FileError(path, where, absl::StrCat("feature index \"", A(item.substr(0, colon)), "\" is not a non-negative integer"));
      }
      double value;
      if (!ParseDouble(item.substr(colon + 1), &value) || !std::isfinite(value)) {
        return FileError(path, where, absl::StrCat("feature value \"", A(item.substr(colon + 1)), "\" is not a finite number"));
      }
      if (std::fabs(value) > std::numeric_limits<float>::max()) {
        return FileError(path, where, absl::StrCat("feature value ", value, " is outside the fp32 range"));
      }
      if (!first && index <= previous) {
        return FileError(path, where, absl::StrCat("feature indices must increase (", index, " after ", previous, ")"));
      }
      first = false;
      previous = index;
      ds->keys_.push_back(index);
      ds->values_.push_back(static_cast<float>(value));
      if (index + 1 > static_cast<uint64_t>(ds->features_)) {
        ds->features_ = static_cast<int>(std::min<uint64_t>(index + 1, INT32_MAX));
      }
    }
    ds->labels_.push_back(stored);
    ds->offsets_.push_back(ds->keys_.size());
  }
  if (ds->labels_.empty()) return FileError(path, "line 1", "no examples in the file");
  ds->Finish(options.labels, options.num_classes, path);
  return std::unique_ptr<Dataset>(std::move(ds));
}

uint64_t CriteoKey(int field, uint64_t value, int hash_bits) {
  const uint64_t buckets = uint64_t{1} << hash_bits;
  return kCriteoIntegers + static_cast<uint64_t>(field) * buckets + (Mix64(value ^ (uint64_t{0x9e3779b97f4a7c15} * (field + 1))) & (buckets - 1));
}

namespace {

// One Criteo line's features into `ds`; the label is the caller's.
absl::Status CriteoFeatures(const std::vector<std::string_view>& fields, const CriteoOptions& o,
                            const std::string& path, const std::string& where, CsrDataset* ds) {
  for (int i = 0; i < kCriteoIntegers; ++i) {
    const std::string_view f = fields[1 + i];
    if (f.empty()) continue;
    int64_t x = 0;
    const auto r = std::from_chars(f.data(), f.data() + f.size(), x);
    if (r.ec != std::errc() || r.ptr != f.data() + f.size()) {
      return FileError(path, where, absl::StrCat("I", i + 1, " \"", A(f), "\" is not an integer"));
    }
    ds->keys_.push_back(static_cast<uint64_t>(i));
    ds->values_.push_back(o.raw_integers ? static_cast<float>(x)
                                         : static_cast<float>(std::log1p(static_cast<double>(std::max<int64_t>(x, 0)))));
  }
  for (int j = 0; j < kCriteoCategoricals; ++j) {
    const std::string_view f = fields[1 + kCriteoIntegers + j];
    if (f.empty()) continue;
    uint64_t v = 0;
    const auto r = f.size() <= 16 ? std::from_chars(f.data(), f.data() + f.size(), v, 16)
                                  : std::from_chars_result{f.data(), std::errc::result_out_of_range};
    if (r.ec != std::errc() || r.ptr != f.data() + f.size()) {
      return FileError(path, where, absl::StrCat("C", j + 1, " \"", A(f), "\" is not a hexadecimal value of at most 16 digits"));
    }
    ds->keys_.push_back(CriteoKey(j, v, o.hash_bits));
    ds->values_.push_back(1.0f);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Dataset>> ReadCriteo(const std::string& path, const CriteoOptions& options) {
  if (options.hash_bits < 1 || options.hash_bits > 32) {
    return absl::InvalidArgumentError(absl::StrCat("criteo hash_bits ", options.hash_bits, " must be 1 to 32"));
  }
  ASSIGN_OR_RETURN(std::string text, ReadFileMaybeGz(path));
  auto ds = std::make_unique<CsrDataset>();
  Lines lines(text);
  std::string_view line;
  std::vector<std::string_view> fields;
  constexpr size_t kFields = 1 + kCriteoIntegers + kCriteoCategoricals;
  while (lines.Next(&line)) {
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const std::string where = absl::StrCat("line ", lines.number());
    fields.clear();
    for (size_t start = 0;;) {
      const size_t tab = line.find('\t', start);
      fields.push_back(line.substr(start, tab == std::string_view::npos ? std::string_view::npos : tab - start));
      if (tab == std::string_view::npos) break;
      start = tab + 1;
    }
    if (fields.size() != kFields) {
      return FileError(path, where, absl::StrCat(fields.size(), " tab-separated fields; the Criteo layout has ",
                                                 kFields, " (the label, I1-I13, C1-C26)"));
    }
    double label;
    if (!ParseDouble(fields[0], &label)) {
      return FileError(path, where, absl::StrCat("label \"", A(fields[0]), "\" is not a number"));
    }
    float stored;
    RETURN_IF_ERROR(CheckLabel(label, LabelKind::kBinary, 2, path, where, &stored));
    RETURN_IF_ERROR(CriteoFeatures(fields, options, path, where, ds.get()));
    ds->labels_.push_back(stored);
    ds->offsets_.push_back(ds->keys_.size());
  }
  if (ds->labels_.empty()) return FileError(path, "line 1", "no examples in the file");
  const uint64_t keys = kCriteoIntegers + kCriteoCategoricals * (uint64_t{1} << options.hash_bits);
  ds->features_ = static_cast<int>(std::min<uint64_t>(keys, INT32_MAX));
  ds->Finish(LabelKind::kBinary, 2, path);
  return std::unique_ptr<Dataset>(std::move(ds));
}

namespace {
// Columns are named as the spec's label_column counts them: from 0.
std::string Column(size_t c) { return absl::StrCat("column ", c, " (counted from 0)"); }
}  // namespace

absl::StatusOr<std::unique_ptr<Dataset>> ReadCsv(const std::string& path, const CsvOptions& options) {
  ASSIGN_OR_RETURN(std::string text, ReadFileMaybeGz(path));
  std::vector<float> features, labels;
  int num_features = 0;
  Lines lines(text);
  std::string_view line;
  int columns = -1;
  std::vector<double> fields;
  while (lines.Next(&line)) {
    if (options.header && lines.number() == 1) continue;
    if (Trim(line).empty()) continue;
    const std::string where = absl::StrCat("line ", lines.number());
    fields.clear();
    size_t start = 0;
    for (;;) {
      const size_t end = line.find(options.delimiter, start);
      const std::string_view cell = line.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start);
      double v;
      if (!ParseDouble(cell, &v)) {
        return FileError(path, where, absl::StrCat(Column(fields.size()), ": \"", A(cell), "\" is not a number"));
      }
      fields.push_back(v);
      if (end == std::string_view::npos) break;
      start = end + 1;
    }
    if (columns < 0) {
      columns = static_cast<int>(fields.size());
      if (columns < 2) return FileError(path, where, "a row needs a label and at least one feature");
      const int lc = options.label_column < 0 ? columns - 1 : options.label_column;
      if (lc >= columns) {
        return FileError(path, where, absl::StrCat("label_column ", lc, " does not exist: rows have ", columns,
                                                   " columns, 0 to ", columns - 1, " (counted from 0; -1 is the last)"));
      }
      num_features = columns - 1;
    } else if (static_cast<int>(fields.size()) != columns) {
      return FileError(path, where, absl::StrCat(fields.size(), " columns, expected ", columns, " as in the first row"));
    }
    const int lc = options.label_column < 0 ? columns - 1 : options.label_column;
    float stored;
    RETURN_IF_ERROR(CheckLabel(fields[lc], options.labels, options.num_classes, path,
                               absl::StrCat(where, ", ", Column(lc)), &stored));
    labels.push_back(stored);
    for (int c = 0; c < columns; ++c) {
      if (c == lc) continue;
      if (!std::isfinite(fields[c]) || std::fabs(fields[c] * options.scale) > std::numeric_limits<float>::max()) {
        return FileError(path, where, absl::StrCat(Column(c), " is not a finite fp32 number"));
      }
      features.push_back(static_cast<float>(fields[c] * options.scale));
    }
  }
  if (labels.empty()) return FileError(path, "line 1", "no examples in the file");
  const int classes = ClassesOf(labels, options.labels, options.num_classes);
  return DenseInMemory(std::move(features), std::move(labels), num_features, classes, path);
}

}  // namespace fulcrum::data
