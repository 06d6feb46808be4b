// Element types on the wire and in published parameters, and the scalar
// conversions between them (bf16 and fp16 are stored as uint16_t bit patterns).
// Pure functions; safe from any thread.
#ifndef OPTIMUS_COMMON_DTYPE_H_
#define OPTIMUS_COMMON_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace optimus {

// Values match optimus.v1.DType in proto/optimus.proto and the wire header.
enum class DType : uint8_t {
  kFp32 = 1,
  kBf16 = 2,
  kFp16 = 3,
};

// Bytes per element.
inline size_t DTypeSize(DType d) { return d == DType::kFp32 ? 4 : 2; }

absl::string_view DTypeName(DType d);

// Accepts the proto/wire integer value; InvalidArgument for anything else.
absl::StatusOr<DType> DTypeFromInt(int value);

// Parses "fp32" | "bf16" | "fp16".
absl::StatusOr<DType> DTypeFromName(absl::string_view name);

// Round-to-nearest-even; NaN stays NaN (quiet), infinities stay infinite.
inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign, force quiet.
    return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  }
  const uint32_t rounding_bias = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding_bias) >> 16);
}

inline float Bf16ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// IEEE 754 binary16, round-to-nearest-even, with subnormals, overflow to inf.
uint16_t FloatToFp16(float f);
float Fp16ToFloat(uint16_t h);

}  // namespace optimus

#endif  // OPTIMUS_COMMON_DTYPE_H_
