// Datasets fetched by deploy/local/fetch_data.sh (ctest's fetch_data
// fixture), for tests declared with DATA (which defines
// FULCRUM_TEST_DATA_DIR). Missing data fails the test: it is never skipped.
#ifndef FULCRUM_TESTS_TESTING_DATA_DIR_H_
#define FULCRUM_TESTS_TESTING_DATA_DIR_H_

#include <filesystem>
#include <string>

#include <catch2/catch.hpp>

namespace fulcrum::testing {

// The directory of dataset `name`.
inline std::string DataDir(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::path(FULCRUM_TEST_DATA_DIR) / name;
  if (!std::filesystem::exists(dir / ".complete")) {
    FAIL("dataset " << name << " is missing under " << FULCRUM_TEST_DATA_DIR
                    << ": run deploy/local/fetch_data.sh (ctest runs it as the fetch_data test)");
  }
  return dir.string();
}

}  // namespace fulcrum::testing

#endif  // FULCRUM_TESTS_TESTING_DATA_DIR_H_
