#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include <catch2/catch.hpp>

#include "common/dtype.h"

namespace fulcrum {
namespace {

TEST_CASE("bf16 round trip stays within bf16 precision", "[dtype]") {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> dist(-1000.0f, 1000.0f);
  std::vector<float> in(10000);
  for (float& x : in) x = dist(rng);
  std::vector<uint16_t> wire(in.size());
  std::vector<float> out(in.size());
  EncodeFloats(in.data(), in.size(), DType::kBf16, wire.data());
  DecodeFloats(wire.data(), in.size(), DType::kBf16, out.data());
  for (size_t i = 0; i < in.size(); ++i) {
    // 8 significant bits: half an ulp is at most 2^-8 of the value.
    REQUIRE(std::fabs(out[i] - in[i]) <= std::fabs(in[i]) * (1.0f / 256.0f));
  }
}

TEST_CASE("fp16 round trip stays within fp16 precision", "[dtype]") {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> dist(-60000.0f, 60000.0f);
  for (int i = 0; i < 10000; ++i) {
    const float x = dist(rng);
    const float y = Fp16ToFloat(FloatToFp16(x));
    REQUIRE(std::fabs(y - x) <= std::fabs(x) * (1.0f / 2048.0f));  // 2^-11
  }
}

TEST_CASE("fp16 conversion handles subnormals, overflow, infinities and NaN", "[dtype]") {
  REQUIRE(Fp16ToFloat(FloatToFp16(0.0f)) == 0.0f);
  REQUIRE(std::signbit(Fp16ToFloat(FloatToFp16(-0.0f))));
  const float smallest = std::ldexp(1.0f, -24);  // smallest fp16 subnormal
  REQUIRE(Fp16ToFloat(FloatToFp16(smallest)) == smallest);
  REQUIRE(Fp16ToFloat(FloatToFp16(3 * smallest)) == 3 * smallest);
  REQUIRE(FloatToFp16(65504.0f) == 0x7bff);          // largest finite
  REQUIRE(std::isinf(Fp16ToFloat(FloatToFp16(70000.0f))));
  REQUIRE(std::isinf(Fp16ToFloat(FloatToFp16(std::numeric_limits<float>::infinity()))));
  REQUIRE(std::isnan(Fp16ToFloat(FloatToFp16(std::nanf("")))));
  REQUIRE(FloatToFp16(1.0f) == 0x3c00);
  REQUIRE(Fp16ToFloat(0xc000) == -2.0f);
}

TEST_CASE("bf16 rounds to nearest even and keeps NaN", "[dtype]") {
  REQUIRE(FloatToBf16(1.0f) == 0x3f80);
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  REQUIRE(FloatToBf16(1.0f + std::ldexp(1.0f, -8)) == 0x3f80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (upper).
  REQUIRE(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3f82);
  REQUIRE(std::isnan(Bf16ToFloat(FloatToBf16(std::nanf("")))));
  REQUIRE(std::isinf(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::infinity()))));
}

TEST_CASE("AllFinite finds NaN and Inf anywhere", "[dtype]") {
  std::vector<float> v(1001, 1.5f);
  REQUIRE(AllFinite(v.data(), v.size()));
  v[777] = std::nanf("");
  REQUIRE_FALSE(AllFinite(v.data(), v.size()));
  v[777] = -std::numeric_limits<float>::infinity();
  REQUIRE_FALSE(AllFinite(v.data(), v.size()));
  v[777] = std::numeric_limits<float>::max();
  REQUIRE(AllFinite(v.data(), v.size()));
}

TEST_CASE("unknown wire dtypes are rejected by value", "[dtype]") {
  REQUIRE(DTypeFromWire(3).value() == DType::kBf16);
  auto bad = DTypeFromWire(9);
  REQUIRE_FALSE(bad.ok());
  REQUIRE(std::string(bad.status().message()).find("dtype 9") != std::string::npos);
}

}  // namespace
}  // namespace fulcrum

namespace fulcrum {
namespace {

TEST_CASE("ForEachFloatBlock reads payloads split anywhere, in any dtype", "[dtype]") {
  const size_t n = 3 * kDecodeBlock + 17;
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) values[i] = static_cast<float>(i) * 0.5f - 100.0f;
  for (DType dt : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    std::vector<uint8_t> bytes(n * DTypeSize(dt));
    EncodeFloats(values.data(), n, dt, bytes.data());
    // Pieces of 1, 3, 7, ... bytes: elements straddle piece boundaries.
    Payload p;
    size_t at = 0, piece = 1;
    while (at < bytes.size()) {
      const size_t take = std::min(piece, bytes.size() - at);
      p.Append(bytes.data() + at, take);
      at += take;
      piece = piece * 2 + 1;
    }
    std::vector<float> back(n, -1.0f);
    size_t calls = 0;
    REQUIRE(ForEachFloatBlock(p, dt, n, [&](const float* block, size_t begin, size_t len) {
      REQUIRE(len <= kDecodeBlock);
      std::copy(block, block + len, back.begin() + begin);
      ++calls;
      return true;
    }));
    REQUIRE(calls == 4);
    std::vector<float> want(n);
    DecodeFloats(bytes.data(), n, dt, want.data());
    REQUIRE(back == want);
  }
  // Stopping early reports false and visits no further block.
  Payload p(values.data(), n * 4);
  size_t calls = 0;
  REQUIRE_FALSE(ForEachFloatBlock(p, DType::kFp32, n, [&](const float*, size_t, size_t) {
    return ++calls < 2;
  }));
  REQUIRE(calls == 2);
}

}  // namespace
}  // namespace fulcrum
