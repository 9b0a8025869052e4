// Turns a directory of text documents into hashed LibSVM: one document per
// file, its label from the name of the sub-directory it sits in, its
// features the hashed counts of its words (the "hashing trick"), so a
// high-dimensional sparse job can run on real text such as the
// SpamAssassin corpus.
//
// Tokens are runs of ASCII letters and digits, lower-cased, 2 to 32 long.
// A token's feature index is Mix64(FNV-1a(token)) mod 2^bits; its value is
// log(1 + count), and each document's vector is scaled to unit L2 norm.
// Documents are taken in sorted path order; a document goes to the test
// file when a hash of its path falls under test_fraction, so the split is
// the same on every machine.
#ifndef FULCRUM_WORKER_DATA_TEXT_HASHING_H_
#define FULCRUM_WORKER_DATA_TEXT_HASHING_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace fulcrum::data {

struct TextToLibSvmOptions {
  std::string input_dir;
  std::string train_output;
  std::string test_output;       // empty: everything goes to train_output
  double test_fraction = 0.2;
  int bits = 20;                 // 2^bits feature buckets
  std::string extension;         // only files ending so ("" = all files)
  // A document is positive (label 1) when its sub-directory's name contains
  // one of these, else 0. Required.
  std::vector<std::string> positive;
};

struct TextToLibSvmStats {
  int64_t documents = 0, positives = 0, train = 0, test = 0, tokens = 0;
};

absl::StatusOr<TextToLibSvmStats> TextToLibSvm(const TextToLibSvmOptions& options);

// The hashed feature index of one token.
uint64_t HashToken(const std::string& token, int bits);

}  // namespace fulcrum::data

#endif  // FULCRUM_WORKER_DATA_TEXT_HASHING_H_
