#include "common/dtype.h"

#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace optimus {

absl::string_view DTypeName(DType d) {
  switch (d) {
    case DType::kFp32:
      return "fp32";
    case DType::kBf16:
      return "bf16";
    case DType::kFp16:
      return "fp16";
  }
  return "invalid";
}

absl::StatusOr<DType> DTypeFromInt(int value) {
  switch (value) {
    case static_cast<int>(DType::kFp32):
      return DType::kFp32;
    case static_cast<int>(DType::kBf16):
      return DType::kBf16;
    case static_cast<int>(DType::kFp16):
      return DType::kFp16;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("invalid dtype value ", value,
                       "; expected 1 (fp32), 2 (bf16) or 3 (fp16)"));
  }
}

absl::StatusOr<DType> DTypeFromName(absl::string_view name) {
  if (name == "fp32") return DType::kFp32;
  if (name == "bf16") return DType::kBf16;
  if (name == "fp16") return DType::kFp16;
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown dtype name \"", name, "\"; expected fp32, bf16 or fp16"));
}

// Bit layouts: fp32 is 1 sign, 8 exponent (bias 127), 23 mantissa bits;
// fp16 is 1 sign, 5 exponent (bias 15), 10 mantissa bits.
uint16_t FloatToFp16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs_bits = bits & 0x7fffffffu;

  if (abs_bits > 0x7f800000u) {
    // NaN: quiet it and keep the top mantissa bits, as x86 VCVTPS2PH does, so
    // the scalar and vector casts agree bit for bit.
    return static_cast<uint16_t>(sign | 0x7e00u | ((abs_bits >> 13) & 0x03ffu));
  }
  // 0x477ff000 is 65520, halfway between fp16's largest finite value (65504,
  // odd mantissa) and 65536: it and everything above round to infinity.
  if (abs_bits >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);
  // Below 2^-25 (0x33000000) rounds to zero; exactly 2^-25 is a tie that goes
  // to the even value zero, which the subnormal path below also yields.
  if (abs_bits < 0x33000000u) return sign;
  if (abs_bits < 0x38800000u) {
    // Result is an fp16 subnormal k * 2^-24 (or rounds up to the smallest
    // normal, 0x0400, which the same encoding produces).
    const uint32_t exponent = abs_bits >> 23;  // 102..112 here
    const uint32_t mantissa = (abs_bits & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - exponent;  // 14..24
    uint32_t k = mantissa >> shift;
    const uint32_t rem = mantissa & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (k & 1u))) ++k;
    return static_cast<uint16_t>(sign | k);
  }
  // Normal: rebias the exponent (127 -> 15, i.e. subtract 112 << 23) and
  // round the 13 dropped mantissa bits to nearest even; a carry correctly
  // bumps the exponent.
  uint32_t r = abs_bits - 0x38000000u;
  r += 0x0fffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x03ffu;
  uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf or NaN (payload kept)
  } else if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24, exact in fp32.
    const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
    std::memcpy(&bits, &magnitude, sizeof(bits));
    bits |= sign;
  } else {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace optimus
