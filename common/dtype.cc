#include "common/dtype.h"

#include <cmath>
#include <algorithm>
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

namespace {

// Round to nearest even; NaN stays a (quiet) NaN. Branch-free so loops over
// it vectorize.
inline uint16_t Bf16Bits(uint32_t bits) {
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  // Signed compare (both sides < 2^31) maps to SSE2's pcmpgtd.
  const bool nan = static_cast<int32_t>(bits & 0x7fffffffu) > 0x7f800000;
  return static_cast<uint16_t>(nan ? quiet_nan : rounded);
}

}  // namespace

uint16_t FloatToBf16(float f) { return Bf16Bits(std::bit_cast<uint32_t>(f)); }

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

namespace {

// Plain branch-free loops over aligned arrays are what GCC vectorizes. The
// fp32 side is always aligned (our buffers); a 16-bit payload inside a
// received message is 2-byte aligned in practice, and when it is not it is
// staged through a small aligned block.
constexpr size_t kBlock = 1024;

bool Aligned2(const void* p) { return reinterpret_cast<uintptr_t>(p) % 2 == 0; }

// AVX2 clones where the CPU has it (8-wide packs), baseline x86-64 otherwise.
// Not under TSan: the clones' resolver runs while the program is relocated,
// before TSan's runtime is up, and its instrumented code crashes there.
#if defined(__SANITIZE_THREAD__)
#define FULCRUM_VECTOR_CLONES
#else
#define FULCRUM_VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#endif

FULCRUM_VECTOR_CLONES
void EncodeBf16(const float* __restrict src, size_t n, uint16_t* __restrict out) {
  for (size_t i = 0; i < n; ++i) out[i] = Bf16Bits(std::bit_cast<uint32_t>(src[i]));
}

FULCRUM_VECTOR_CLONES
void DecodeBf16(const uint16_t* __restrict in, size_t n, float* __restrict dst) {
  for (size_t i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<uint32_t>(in[i]) << 16);
}

}  // namespace

void EncodeFloats(const float* src, size_t n, DType dtype, void* dst) {
  auto* out = static_cast<unsigned char*>(dst);
  switch (dtype) {
    case DType::kFp32:
      std::memcpy(dst, src, n * 4);
      return;
    case DType::kBf16: {
      if (Aligned2(dst)) {
        EncodeBf16(src, n, static_cast<uint16_t*>(dst));
        return;
      }
      alignas(64) uint16_t tmp[kBlock];
      for (size_t base = 0; base < n; base += kBlock) {
        const size_t m = std::min(kBlock, n - base);
        EncodeBf16(src + base, m, tmp);
        std::memcpy(out + 2 * base, tmp, m * 2);
      }
      return;
    }
    case DType::kFp16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h = FloatToFp16(src[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
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
    case DType::kBf16: {
      if (Aligned2(src)) {
        DecodeBf16(static_cast<const uint16_t*>(src), n, dst);
        return;
      }
      alignas(64) uint16_t tmp[kBlock];
      for (size_t base = 0; base < n; base += kBlock) {
        const size_t m = std::min(kBlock, n - base);
        std::memcpy(tmp, in + 2 * base, m * 2);
        DecodeBf16(tmp, m, dst + base);
      }
      return;
    }
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

FULCRUM_VECTOR_CLONES
bool AllFinite(const float* data, size_t n) {
  // A float is Inf or NaN exactly when its exponent bits are all ones. An
  // integer OR-reduction vectorizes; a float one would not (no reassociation
  // without -ffast-math). Blocks give an early exit without a branch per element.
  for (size_t base = 0; base < n; base += kBlock) {
    const size_t m = std::min(kBlock, n - base);
    uint32_t bad = 0;
    for (size_t i = 0; i < m; ++i) {
      bad |= static_cast<uint32_t>((std::bit_cast<uint32_t>(data[base + i]) & 0x7f800000u) == 0x7f800000u);
    }
    if (bad) return false;
  }
  return true;
}

bool ForEachFloatBlock(const Payload& payload, DType dtype, size_t n,
                       const std::function<bool(const float*, size_t, size_t)>& fn) {
  const size_t esize = DTypeSize(dtype);
  alignas(64) float wide[kDecodeBlock];
  alignas(64) uint8_t raw[kDecodeBlock * 4];
  const auto& pieces = payload.pieces();
  size_t piece = 0, offset = 0;
  for (size_t begin = 0; begin < n; begin += kDecodeBlock) {
    const size_t len = std::min(kDecodeBlock, n - begin);
    // Gather len elements' bytes from the pieces (fp32 lands in `wide` directly).
    uint8_t* dst = dtype == DType::kFp32 ? reinterpret_cast<uint8_t*>(wide) : raw;
    size_t want = len * esize;
    while (want > 0) {
      const size_t take = std::min(want, pieces[piece].size - offset);
      std::memcpy(dst, pieces[piece].data + offset, take);
      dst += take;
      want -= take;
      offset += take;
      if (offset == pieces[piece].size) {
        ++piece;
        offset = 0;
      }
    }
    if (dtype != DType::kFp32) DecodeFloats(raw, len, dtype, wide);
    if (!fn(wide, begin, len)) return false;
  }
  return true;
}

}  // namespace fulcrum
