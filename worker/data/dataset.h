// Training data in memory: readers for IDX (MNIST, Fashion-MNIST; raw or
// .gz), LibSVM (sparse) and CSV (dense), and the Batch a step consumes.
//
// Readers load a whole file (datasets here fit in memory) and keep it in its
// compact form (IDX pixels stay bytes); batches are decoded on demand by the
// prefetching pipeline (pipeline.h). Every error names the file and the line
// or byte offset: "mnist/train-labels-idx1-ubyte: byte 8: label 12 is
// outside [0, 10)".
#ifndef FULCRUM_WORKER_DATA_DATASET_H_
#define FULCRUM_WORKER_DATA_DATASET_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/compute/backend.h"

namespace fulcrum::data {

class DeviceData;

// One mini-batch on the host. Dense data: `dense` is size x num_features.
// Sparse data: CSR rows, row i's features are keys/values[offsets[i],
// offsets[i+1]). Labels: a class index (as a float), 0/1 for binary tasks,
// or the target value for regression.
struct Batch {
  int size = 0;
  int num_features = 0;
  std::vector<float> dense;
  std::vector<float> labels;
  std::vector<int32_t> offsets;
  std::vector<uint64_t> keys;
  std::vector<float> values;
  // Sparse batches from the pipeline: `keys`' distinct values in first-seen
  // order and each key's index among them (DistinctKeys), found on the
  // pipeline's threads so the step does not (key_index empty: not found).
  std::vector<uint64_t> distinct_keys;
  std::vector<int32_t> key_index;
  int epoch = 0;
  int64_t index = 0;  // the batch's number within the epoch

  // Staged copies of dense and labels in page-locked memory (set by the
  // pipeline when it has a backend): uploads from here are asynchronous.
  compute::Buffer staged;
  const float* dense_data() const { return staged.data() ? staged.as<float>() : dense.data(); }
  const float* label_data() const {
    return staged.data() ? staged.as<float>() + dense.size() : labels.data();
  }

  // Dense features already on their way to the device (the pipeline's
  // upload stream, Backend::UploadAsync): `uploaded` holds size x
  // num_features floats once `upload` is done; empty when not uploaded.
  compute::Buffer uploaded;
  compute::UploadEvent upload;
  bool features_uploaded = false;

  // Set when the dataset lives on the device (device_data.h): `dense` stays
  // empty, and the features are gathered on the device from the stored rows
  // `rows` (staged after the labels) by device->Gather.
  const DeviceData* device = nullptr;
  std::vector<int32_t> rows;
  const int32_t* row_data() const {
    return staged.data() ? reinterpret_cast<const int32_t*>(staged.as<float>() + dense.size() + labels.size())
                         : rows.data();
  }
  bool sparse() const { return !offsets.empty(); }
  // What a model computed from the batch on the decoding threads
  // (PrefetchOptions::host_work), and which model's work it is.
  std::shared_ptr<const void> host_work;
  const void* host_work_by = nullptr;

  // Empties the batch for n examples: dense data sized n x num_features
  // (0 features: sparse, with offsets = {0} and no keys yet).
  void Reset(int n, int features) {
    size = n;
    num_features = features;
    dense.resize(size_t{1} * n * features);
    labels.resize(n);
    offsets.assign(features == 0 ? 1 : 0, 0);
    keys.clear();
    values.clear();
    distinct_keys.clear();
    key_index.clear();
    device = nullptr;
    rows.clear();
    features_uploaded = false;
    host_work.reset();
    host_work_by = nullptr;
  }
};

// A dataset's features as stored: `rows` x `cols` bytes, decoded as
// byte x scale (IDX pixels). What the device keeps (device_data.h).
struct StoredBytes {
  const uint8_t* data = nullptr;
  size_t rows = 0;
  int cols = 0;
  float scale = 1;
};

// Distinct keys in first-seen order and, for every input key, its index
// among them.
void DistinctKeys(const uint64_t* keys, size_t n, std::vector<uint64_t>* distinct, std::vector<int32_t>* index);

class Dataset {
 public:
  virtual ~Dataset() = default;
  // The stored bytes behind this dataset's features, or null when they are
  // not bytes (CSV, LibSVM, generated data). A subset shares its base's.
  virtual const StoredBytes* stored_bytes() const { return nullptr; }
  // The row of stored_bytes() that holds example i.
  virtual int64_t stored_row(int64_t i) const { return i; }
  virtual size_t size() const = 0;
  // Dense: features per example. Sparse: one more than the largest feature
  // index seen (for reporting; keys are not bounded by it).
  virtual int num_features() const = 0;
  virtual bool sparse() const = 0;
  // Decodes examples `indices[0..n)` into *out (resizing its vectors).
  // Several pipeline threads call it at once, each with its own batch.
  virtual void Fill(const int64_t* indices, int n, Batch* out) const = 0;
  virtual float label(size_t i) const = 0;

  // Classes seen in the labels (max label + 1) for classification data, 0
  // for regression data.
  int num_classes() const { return num_classes_; }
  const std::string& source() const { return source_; }

 protected:
  int num_classes_ = 0;
  std::string source_;
};

// Labels: kClass expects integers in [0, num_classes) (num_classes 0: any
// non-negative integer, the count is inferred); kBinary accepts 0/1 and -1/+1
// (mapped to 0/1); kValue keeps any finite number.
enum class LabelKind { kClass, kBinary, kValue };

struct IdxOptions {
  int num_classes = 10;
  float scale = 1.0f / 255;  // pixel bytes are multiplied by this
};
// images: magic 0x00000803 (N, rows, cols, pixels); labels: 0x00000801.
absl::StatusOr<std::unique_ptr<Dataset>> ReadIdx(const std::string& images_path,
                                                 const std::string& labels_path,
                                                 const IdxOptions& options = {});

struct LibSvmOptions {
  LabelKind labels = LabelKind::kBinary;
  int num_classes = 0;
};
// "label index:value index:value ..." per line; '#' starts a comment.
absl::StatusOr<std::unique_ptr<Dataset>> ReadLibSvm(const std::string& path,
                                                    const LibSvmOptions& options = {});

// The Criteo display-advertising layout: per line, tab-separated, a 0/1
// label, 13 integer features (I1-I13) and 26 categorical ones (C1-C26) as
// hexadecimal strings; any feature may be empty (absent). Gzip is read as
// the other formats are. Features become sparse keys:
//   integer feature i (0-12): key i, value log(1 + max(x, 0)) (or x itself
//     with raw_integers);
//   categorical field j (0-25): key 13 + j * 2^hash_bits + (a 64-bit mix of
//     the value) mod 2^hash_bits, value 1 (one bucket space per field).
struct CriteoOptions {
  int hash_bits = 20;
  bool raw_integers = false;
};
inline constexpr int kCriteoIntegers = 13;
inline constexpr int kCriteoCategoricals = 26;
// The key of categorical field `field`'s value `value` (its hex digits parsed).
uint64_t CriteoKey(int field, uint64_t value, int hash_bits);
absl::StatusOr<std::unique_ptr<Dataset>> ReadCriteo(const std::string& path, const CriteoOptions& options = {});

struct CsvOptions {
  int label_column = -1;  // -1: the last column
  char delimiter = ',';
  bool header = false;    // skip the first line
  LabelKind labels = LabelKind::kClass;
  int num_classes = 0;
  float scale = 1.0f;     // features are multiplied by this
};
absl::StatusOr<std::unique_ptr<Dataset>> ReadCsv(const std::string& path, const CsvOptions& options = {});

// Dense examples already in memory: `features` is labels.size() x
// num_features, row-major (CSV files, synthetic data).
std::unique_ptr<Dataset> DenseInMemory(std::vector<float> features, std::vector<float> labels, int num_features,
                                       int num_classes, std::string source);

// Examples stored as bytes in memory, decoded as byte x scale, as IDX
// files are: `pixels` is labels.size() x num_features (benchmarks).
std::unique_ptr<Dataset> BytesInMemory(const std::vector<uint8_t>& pixels, std::vector<float> labels, int num_features,
                                       float scale, int num_classes, std::string source);

// The examples `indices` of `base` (which must outlive the subset), e.g. a
// train/test split of one file.
std::unique_ptr<Dataset> Subset(const Dataset* base, std::vector<int64_t> indices);
// A seeded split of [0, n): (train indices, test indices).
std::pair<std::vector<int64_t>, std::vector<int64_t>> SplitIndices(size_t n, double test_fraction, uint64_t seed);

// Whole file contents, transparently gunzipped (.gz or plain alike).
absl::StatusOr<std::string> ReadFileMaybeGz(const std::string& path);

}  // namespace fulcrum::data

#endif  // FULCRUM_WORKER_DATA_DATASET_H_
