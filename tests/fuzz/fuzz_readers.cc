// libFuzzer target: the dataset readers a worker runs on files it is given
// (IDX images + labels, LibSVM, CSV; plain or gzip). The first byte picks
// the reader and its options; the rest is the file (IDX: the second byte
// x 4 is the images file's length, the labels file follows). Files live in a per-process temp dir.
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>

#include "worker/data/dataset.h"

namespace {

// Made on first use, removed with its files when the fuzzer exits.
struct TempDir {
  std::string path = "/tmp/fulcrum-fuzz-readers-" + std::to_string(getpid());
  TempDir() { mkdir(path.c_str(), 0700); }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

const std::string& Dir() {
  static const TempDir dir;
  return dir.path;
}

std::string Write(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = Dir() + "/" + name;
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data),
                                                                static_cast<std::streamsize>(size));
  return path;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  const uint8_t mode = data[0];
  data += 1;
  size -= 1;
  using namespace fulcrum::data;
  switch (mode % 3) {
    case 0: {  // IDX
      // The next byte x 4 is the images file's length; labels follow.
      const size_t n = std::min(size - 1, static_cast<size_t>(data[0]) * 4);
      const std::string images = Write("images", data + 1, n);
      const std::string labels = Write("labels", data + 1 + n, size - 1 - n);
      IdxOptions o;
      o.num_classes = 1 + (mode >> 2) % 12;
      (void)ReadIdx(images, labels, o);
      break;
    }
    case 1: {  // LibSVM
      LibSvmOptions o;
      o.labels = (mode >> 2) % 2 ? LabelKind::kClass : LabelKind::kBinary;
      o.num_classes = (mode >> 3) % 5;
      (void)ReadLibSvm(Write("data.libsvm", data, size), o);
      break;
    }
    default: {  // CSV
      CsvOptions o;
      o.header = (mode >> 2) & 1;
      o.label_column = static_cast<int>((mode >> 3) % 4) - 1;
      o.delimiter = (mode >> 5) & 1 ? ';' : ',';
      (void)ReadCsv(Write("data.csv", data, size), o);
      break;
    }
  }
  return 0;
}
