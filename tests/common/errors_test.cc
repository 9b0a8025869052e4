// Error messages that quote outside input stay valid UTF-8 and bounded.
#include "common/errors.h"

#include <string>

#include <catch2/catch.hpp>

namespace fulcrum {
namespace {

TEST_CASE("IsValidUtf8 accepts UTF-8 and refuses what protobuf's parsers refuse", "[errors]") {
  CHECK(IsValidUtf8(""));
  CHECK(IsValidUtf8("job-1"));
  CHECK(IsValidUtf8("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"));
  CHECK_FALSE(IsValidUtf8("job-\xff\xfe"));
  CHECK_FALSE(IsValidUtf8("\xc0\xaf"));          // overlong '/'
  CHECK_FALSE(IsValidUtf8("\xe0\x80\xaf"));      // overlong, 3 bytes
  CHECK_FALSE(IsValidUtf8("\xed\xa0\x80"));      // a surrogate
  CHECK_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));  // past U+10FFFF
  CHECK_FALSE(IsValidUtf8("\xc3"));              // cut short
  CHECK_FALSE(IsValidUtf8("\x80"));              // a continuation first
}

TEST_CASE("QuoteInput escapes and cuts what a client sent", "[errors]") {
  CHECK(QuoteInput("job-1") == "'job-1'");
  CHECK(QuoteInput("job-\xff\xfe") == "'job-\\xff\\xfe'");
  CHECK(QuoteInput("a'b\n") == "'a\\x27b\\x0a'");
  const std::string quoted = QuoteInput(std::string(20000, 'x'));
  CHECK(quoted == "'" + std::string(64, 'x') + "' (cut: 20000 bytes)");
}

TEST_CASE("SafeStatusMessage keeps valid characters, escapes the rest and bounds the length", "[errors]") {
  CHECK(SafeStatusMessage("no job 'caf\xc3\xa9'") == "no job 'caf\xc3\xa9'");
  CHECK(SafeStatusMessage("no job 'job-\xff\xfe'") == "no job 'job-\\xff\\xfe'");
  CHECK(IsValidUtf8(SafeStatusMessage("\xe2\x82")));
  const std::string big = SafeStatusMessage(std::string(5000, 'y'));
  CHECK(big.size() < kMaxStatusMessageBytes + 40);
  CHECK(big.find("... (2952 more bytes)") != std::string::npos);
  // Cut at a character boundary: still valid UTF-8.
  std::string euros;
  while (euros.size() < 3000) euros += "\xe2\x82\xac";
  CHECK(IsValidUtf8(SafeStatusMessage(euros)));
  CHECK(JobNotOnServerError("job-\xff\xfe").message() == "job 'job-\\xff\\xfe' is not on this server");
  CHECK(IsJobNotOnServer(JobNotOnServerError(std::string(20000, 'j'))));
}

}  // namespace
}  // namespace fulcrum
