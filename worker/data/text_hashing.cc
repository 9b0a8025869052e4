#include "worker/data/text_hashing.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/shard_map.h"

namespace fulcrum::data {

namespace fs = std::filesystem;

uint64_t HashToken(const std::string& token, int bits) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : token) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return Mix64(h) & ((uint64_t{1} << bits) - 1);
}

absl::StatusOr<TextToLibSvmStats> TextToLibSvm(const TextToLibSvmOptions& o) {
  if (o.bits < 1 || o.bits > 40) return absl::InvalidArgumentError(absl::StrCat("--bits=", o.bits, ": allowed 1..40"));
  if (o.positive.empty()) return absl::InvalidArgumentError("--positive: name at least one positive folder pattern");
  if (!(o.test_fraction >= 0 && o.test_fraction < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("--test_fraction=", o.test_fraction, ": allowed [0, 1)"));
  }
  std::error_code ec;
  if (!fs::is_directory(o.input_dir, ec)) {
    return absl::NotFoundError(absl::StrCat(o.input_dir, ": not a directory"));
  }
  std::vector<fs::path> files;
  for (auto it = fs::recursive_directory_iterator(o.input_dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (!it->is_regular_file()) continue;
    const std::string name = it->path().filename().string();
    if (!o.extension.empty() &&
        (name.size() < o.extension.size() || name.compare(name.size() - o.extension.size(), o.extension.size(), o.extension) != 0)) {
      continue;
    }
    files.push_back(it->path());
  }
  if (ec) return absl::InternalError(absl::StrCat(o.input_dir, ": cannot list: ", ec.message()));
  if (files.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(o.input_dir, ": no documents", o.extension.empty() ? "" : " ending in ",
                                                   o.extension));
  }
  std::sort(files.begin(), files.end());
  std::ofstream train(o.train_output), test;
  if (!train) return absl::PermissionDeniedError(absl::StrCat(o.train_output, ": cannot write"));
  if (!o.test_output.empty()) {
    test.open(o.test_output);
    if (!test) return absl::PermissionDeniedError(absl::StrCat(o.test_output, ": cannot write"));
  }
  TextToLibSvmStats stats;
  std::map<uint64_t, int> counts;
  std::string token;
  for (const fs::path& path : files) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat(path.string(), ": cannot read"));
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    counts.clear();
    token.clear();
    auto flush = [&] {
      if (token.size() >= 2 && token.size() <= 32) {
        ++counts[HashToken(token, o.bits)];
        ++stats.tokens;
      }
      token.clear();
    };
    for (unsigned char c : text) {
      if (std::isalnum(c) && c < 128) token.push_back(static_cast<char>(std::tolower(c)));
      else flush();
    }
    flush();
    const std::string folder = fs::relative(path.parent_path(), o.input_dir).string();
    bool positive = false;
    for (const std::string& p : o.positive) positive = positive || folder.find(p) != std::string::npos;
    double norm = 0;
    for (const auto& [k, n] : counts) norm += std::log1p(n) * std::log1p(n);
    norm = norm > 0 ? std::sqrt(norm) : 1;
    std::string line = positive ? "1" : "0";
    for (const auto& [k, n] : counts) absl::StrAppend(&line, " ", k, ":", std::log1p(n) / norm);
    line.push_back('\n');
    const std::string rel = fs::relative(path, o.input_dir).string();
    const bool to_test = test.is_open() && (Mix64(HashToken(rel, 62)) % 1000000) < o.test_fraction * 1000000;
    (to_test ? test : train) << line;
    ++stats.documents;
    stats.positives += positive;
    ++(to_test ? stats.test : stats.train);
  }
  train.close();
  if (!train) return absl::DataLossError(absl::StrCat(o.train_output, ": write failed"));
  if (test.is_open()) {
    test.close();
    if (!test) return absl::DataLossError(absl::StrCat(o.test_output, ": write failed"));
  }
  return stats;
}

}  // namespace fulcrum::data
