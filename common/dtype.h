// Wire dtypes and conversions. The servers keep fp32 master weights; fp16 and
// bf16 exist only on the wire (and, later, in GPU compute).
#ifndef FULCRUM_COMMON_DTYPE_H_
#define FULCRUM_COMMON_DTYPE_H_

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include <functional>

#include "absl/status/statusor.h"
#include "common/payload.h"

static_assert(std::endian::native == std::endian::little,
              "Fulcrum's wire payloads are little-endian and copied as-is");

namespace fulcrum {

// Values match fulcrum.v1.DType.
enum class DType : int { kUnspecified = 0, kFp32 = 1, kFp16 = 2, kBf16 = 3 };

// Bytes per element; 0 for kUnspecified.
size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);
// Validates a value read from the wire.
absl::StatusOr<DType> DTypeFromWire(int value);

// Scalar conversions, round to nearest even; NaN stays NaN, overflow -> Inf.
uint16_t FloatToBf16(float f);
float Bf16ToFloat(uint16_t h);
uint16_t FloatToFp16(float f);
float Fp16ToFloat(uint16_t h);

// Bulk conversions between fp32 and `dtype`. `src`/`dst` hold n elements of
// the named type and need no particular alignment.
void EncodeFloats(const float* src, size_t n, DType dtype, void* dst);
void DecodeFloats(const void* src, size_t n, DType dtype, float* dst);

// True when all n floats are finite. Vectorizes.
bool AllFinite(const float* data, size_t n);

// Walks a payload of n elements of dtype (any number of pieces, any
// alignment) as fp32 blocks of at most kDecodeBlock elements staged in an
// L1-sized buffer: fn(block, first element index, length). Stops early when
// fn returns false. No copy of the whole payload is made.
inline constexpr size_t kDecodeBlock = 2048;
bool ForEachFloatBlock(const Payload& payload, DType dtype, size_t n,
                       const std::function<bool(const float*, size_t, size_t)>& fn);

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_DTYPE_H_
