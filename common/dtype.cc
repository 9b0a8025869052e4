#include "common/dtype.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace fulcrum {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kFp32: return 4;
    case DType::kFp16:
    case DType::kBf16: return 2;
    case DType::kUnspecified: return 0;
  }
  return 0;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kFp32: return "fp32";
    case DType::kFp16: return "fp16";
    case DType::kBf16: return "bf16";
    case DType::kUnspecified: return "unspecified";
  }
  return "unknown";
}

absl::StatusOr<DType> DTypeFromWire(int value) {
  switch (value) {
    case 1: return DType::kFp32;
    case 2: return DType::kFp16;
    case 3: return DType::kBf16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("dtype ", value, " is not one of fp32 (1), fp16 (2), bf16 (3)"));
  }
}

uint16_t FloatToBf16(float f) {
  uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float Bf16ToFloat(uint16_t h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }

uint16_t FloatToFp16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow (rounds to Inf)
  if (abs < 0x38800000u) {
    // Subnormal or zero in fp16: scale into the 2^-24 grid with RNE via float math.
    const float scaled = std::bit_cast<float>(abs) * 16777216.0f;  // * 2^24, exact
    const float r = std::nearbyint(scaled);                        // RNE (default mode)
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(r));
  }
  // Normal: rebias exponent 127 -> 15 and round the 13 dropped mantissa bits.
  uint32_t m = abs - 0x38000000u;  // (127 - 15) << 23
  m += 0x0fffu + ((m >> 13) & 1u);
  return static_cast<uint16_t>(sign | (m >> 13));
}

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    const float v = static_cast<float>(mant) * (1.0f / 16777216.0f);  // mant * 2^-24
    return std::bit_cast<float>(std::bit_cast<uint32_t>(v) | sign);
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

void EncodeFloats(const float* src, size_t n, DType dtype, void* dst) {
  switch (dtype) {
    case DType::kFp32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBf16: {
      auto* out = static_cast<unsigned char*>(dst);
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = FloatToBf16(src[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    }
    case DType::kFp16: {
      auto* out = static_cast<unsigned char*>(dst);
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = FloatToFp16(src[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    }
    case DType::kUnspecified:
      return;
  }
}

void DecodeFloats(const void* src, size_t n, DType dtype, float* dst) {
  const auto* in = static_cast<const unsigned char*>(src);
  switch (dtype) {
    case DType::kFp32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBf16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, in + 2 * i, 2);
        dst[i] = Bf16ToFloat(h);
      }
      return;
    case DType::kFp16:
      for (size_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, in + 2 * i, 2);
        dst[i] = Fp16ToFloat(h);
      }
      return;
    case DType::kUnspecified:
      return;
  }
}

bool AllFinite(const float* data, size_t n) {
  // x - x is 0 for finite x and NaN for Inf/NaN; summing keeps the loop
  // branch-free so it vectorizes.
  float acc = 0.0f;
  for (size_t i = 0; i < n; ++i) acc += data[i] - data[i];
  return acc == 0.0f;
}

}  // namespace fulcrum
