// Safetensors files (https://huggingface.co/docs/safetensors): an 8-byte
// little-endian header length, a JSON header naming each tensor's dtype,
// shape and byte range (and optional string metadata under
// "__metadata__"), then the tensors' bytes, back to back. The format
// PyTorch, JAX and NumPy users load models from; fulcrumctl export writes
// it, and Read parses it back (tests, and tools checking an export).
#ifndef FULCRUM_COMMON_SAFETENSORS_H_
#define FULCRUM_COMMON_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace fulcrum::safetensors {

// One tensor to write: `bytes` at `data` must equal the product of `shape`
// times the dtype's size. Dtypes: F64, F32, F16, BF16, I64, I32, I16, I8,
// U8, BOOL.
struct Tensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t bytes = 0;
};

// `s` as a JSON string literal, quotes included (as the header writes
// names and metadata; fulcrumctl's --json output uses it too).
std::string JsonQuoted(const std::string& s);

// The size in bytes of one element of `dtype`; 0 when it is not one above.
size_t DtypeSize(const std::string& dtype);

// The header Write puts before the data (without its length prefix),
// padded with spaces to a multiple of 8 bytes so the data is aligned.
// INVALID_ARGUMENT naming the tensor when a name is empty or repeated, a
// dtype unknown, a dimension negative or the bytes do not match the shape.
absl::StatusOr<std::string> Header(const std::vector<Tensor>& tensors,
                                   const std::map<std::string, std::string>& metadata);

// Writes the file through `path`.tmp and a rename, so a reader never sees
// half a file. On success *file_bytes (when given) is the file's size.
absl::Status Write(const std::string& path, const std::vector<Tensor>& tensors,
                   const std::map<std::string, std::string>& metadata, uint64_t* file_bytes = nullptr);

// A file read back: tensors in the order of their data, each with its bytes.
struct ReadTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string data;
};
struct File {
  std::map<std::string, std::string> metadata;
  std::vector<ReadTensor> tensors;
};

// Reads and checks a file: DATA_LOSS naming the file and what is wrong
// (a header longer than the file, JSON that does not parse, a tensor
// whose byte range does not match its shape or leaves a gap or overlap).
absl::StatusOr<File> Read(const std::string& path);

}  // namespace fulcrum::safetensors

#endif  // FULCRUM_COMMON_SAFETENSORS_H_
