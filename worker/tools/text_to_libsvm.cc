// fulcrum-text2libsvm: a directory of text documents (one per file, label
// from the sub-directory) to hashed LibSVM train/test files.
//   fulcrum-text2libsvm --input=spam-assassin --positive=spam --extension=.txt
//       --train=spam.train.svm --test=spam.test.svm --bits=20
#include <cstdio>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_split.h"
#include "common/flags_usage.h"
#include "worker/data/text_hashing.h"

ABSL_FLAG(std::string, input, "", "directory of documents (recursed)");
ABSL_FLAG(std::string, train, "", "LibSVM output for training");
ABSL_FLAG(std::string, test, "", "LibSVM output for testing (optional)");
ABSL_FLAG(double, test_fraction, 0.2, "share of documents sent to --test");
ABSL_FLAG(int, bits, 20, "hash into 2^bits feature buckets");
ABSL_FLAG(std::string, extension, "", "only files whose names end so");
ABSL_FLAG(std::string, positive, "", "comma-separated folder-name substrings that mean label 1");

int main(int argc, char** argv) {
  fulcrum::SetUsage("hash a directory of text documents (label from the sub-directory) into LibSVM train/test files");
  absl::ParseCommandLine(argc, argv);
  fulcrum::data::TextToLibSvmOptions o;
  o.input_dir = absl::GetFlag(FLAGS_input);
  o.train_output = absl::GetFlag(FLAGS_train);
  o.test_output = absl::GetFlag(FLAGS_test);
  o.test_fraction = absl::GetFlag(FLAGS_test_fraction);
  o.bits = absl::GetFlag(FLAGS_bits);
  o.extension = absl::GetFlag(FLAGS_extension);
  for (auto p : absl::StrSplit(absl::GetFlag(FLAGS_positive), ',', absl::SkipEmpty())) o.positive.emplace_back(p);
  if (o.input_dir.empty() || o.train_output.empty()) {
    std::fprintf(stderr, "fulcrum-text2libsvm: --input and --train are required (see --help)\n");
    return 2;
  }
  auto stats = fulcrum::data::TextToLibSvm(o);
  if (!stats.ok()) {
    std::fprintf(stderr, "fulcrum-text2libsvm: %s\n", std::string(stats.status().message()).c_str());
    return 1;
  }
  std::printf("%lld documents (%lld positive, %lld tokens): %lld to %s, %lld to %s\n",
              static_cast<long long>(stats->documents), static_cast<long long>(stats->positives),
              static_cast<long long>(stats->tokens), static_cast<long long>(stats->train), o.train_output.c_str(),
              static_cast<long long>(stats->test), o.test_output.empty() ? "-" : o.test_output.c_str());
  return 0;
}
