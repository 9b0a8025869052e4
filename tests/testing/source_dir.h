// The source tree for tests and tools that read files from it: the
// FULCRUM_SOURCE_DIR environment variable where set (a GPU machine runs
// them from a bundle, away from the tree they were built in), else the
// build's FULCRUM_SOURCE_DIR definition.
#ifndef FULCRUM_TESTS_TESTING_SOURCE_DIR_H_
#define FULCRUM_TESTS_TESTING_SOURCE_DIR_H_

#include <cstdlib>
#include <string>

namespace fulcrum::testing {

inline std::string SourceDir() {
  const char* env = std::getenv("FULCRUM_SOURCE_DIR");
  return env != nullptr && *env != '\0' ? env : FULCRUM_SOURCE_DIR;
}

}  // namespace fulcrum::testing

#endif  // FULCRUM_TESTS_TESTING_SOURCE_DIR_H_
