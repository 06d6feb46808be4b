#include "common/dtype.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace optimus {
namespace {

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

bool IsFp16Nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0; }

// Value of an fp16 pattern computed independently of Fp16ToFloat.
double Fp16Value(uint16_t h) {
  const int exponent = (h >> 10) & 0x1f;
  const int mantissa = h & 0x3ff;
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  if (exponent == 0x1f) return sign * std::numeric_limits<double>::infinity();
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1024 + mantissa, exponent - 25);
}

// Independent reference for float -> fp16 rounding: binary search among the
// ordered non-negative fp16 patterns, nearest wins, ties go to even.
uint16_t ReferenceFloatToFp16(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(f));
  if (std::isinf(a)) return sign | 0x7c00;
  // Largest finite is 0x7bff (65504); "next" value for rounding is 65536.
  uint16_t lo = 0, hi = 0x7bff;
  if (a >= 65504.0) {
    if (a == 65504.0) return sign | 0x7bff;
    // Between 65504 and 65536 (2^16, the would-be next value, even).
    return (a - 65504.0 < 65536.0 - a) ? (sign | 0x7bff) : (sign | 0x7c00);
  }
  while (hi - lo > 1) {
    const uint16_t mid = static_cast<uint16_t>((lo + hi) / 2);
    if (Fp16Value(mid) <= a) lo = mid; else hi = mid;
  }
  if (Fp16Value(hi) <= a) lo = hi;  // only when a is exactly the top
  if (Fp16Value(lo) == a) return sign | lo;
  const uint16_t up = static_cast<uint16_t>(lo + 1);
  const double d_lo = a - Fp16Value(lo);
  const double d_up = Fp16Value(up) - a;
  if (d_lo < d_up) return sign | lo;
  if (d_up < d_lo) return sign | up;
  return sign | ((lo & 1) ? up : lo);
}

TEST(Fp16Test, ExhaustiveRoundTrip) {
  for (uint32_t p = 0; p <= 0xffff; ++p) {
    const uint16_t h = static_cast<uint16_t>(p);
    const float f = Fp16ToFloat(h);
    if (IsFp16Nan(h)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << p;
      const uint16_t back = FloatToFp16(f);
      ASSERT_TRUE(IsFp16Nan(back)) << std::hex << p;
      ASSERT_EQ(back & 0x8000, h & 0x8000) << std::hex << p;
      continue;
    }
    // Fp16ToFloat is exact.
    ASSERT_EQ(static_cast<double>(f), Fp16Value(h)) << std::hex << p;
    ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << p;
    ASSERT_EQ(FloatToFp16(f), h) << std::hex << p;
  }
}

TEST(Fp16Test, MidpointsAndNeighboursMatchReference) {
  // For every pair of adjacent non-negative fp16 values, check the exact
  // midpoint (a tie when representable in fp32) and its fp32 neighbours.
  for (uint32_t p = 0; p < 0x7c00; ++p) {
    const double lo = Fp16Value(static_cast<uint16_t>(p));
    const double hi = (p == 0x7bff) ? 65536.0 : Fp16Value(static_cast<uint16_t>(p + 1));
    const float mid = static_cast<float>((lo + hi) / 2);  // exact: few bits
    ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
    for (float f : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
      ASSERT_EQ(FloatToFp16(f), ReferenceFloatToFp16(f)) << f;
      ASSERT_EQ(FloatToFp16(-f), ReferenceFloatToFp16(-f)) << -f;
    }
  }
}

TEST(Fp16Test, SampledFloatsMatchReference) {
  // Every 997th fp32 pattern (~4.3M values) over the whole range.
  for (uint64_t b = 0; b <= 0xffffffffull; b += 997) {
    const float f = FromBits(static_cast<uint32_t>(b));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToFp16(f), ReferenceFloatToFp16(f)) << std::hex << b;
  }
}

TEST(Fp16Test, TiesGoToEven) {
  // 1 + 2^-11 is halfway between 1 (0x3c00, even) and 1 + 2^-10 (odd).
  EXPECT_EQ(FloatToFp16(1.0f + 0x1p-11f), 0x3c00);
  // 1 + 3 * 2^-11 is halfway between 0x3c01 (odd) and 0x3c02 (even).
  EXPECT_EQ(FloatToFp16(1.0f + 3 * 0x1p-11f), 0x3c02);
  // Just above a tie rounds up.
  EXPECT_EQ(FloatToFp16(std::nextafter(1.0f + 0x1p-11f, 2.0f)), 0x3c01);
  // Subnormal ties: 2^-25 -> 0 (even), 3 * 2^-25 -> 2 * 2^-24 (even).
  EXPECT_EQ(FloatToFp16(0x1p-25f), 0x0000);
  EXPECT_EQ(FloatToFp16(3 * 0x1p-25f), 0x0002);
  EXPECT_EQ(FloatToFp16(-0x1p-25f), 0x8000);
  EXPECT_EQ(FloatToFp16(std::nextafter(0x1p-25f, 1.0f)), 0x0001);
  // Largest subnormal + half ulp rounds to the smallest normal.
  EXPECT_EQ(FloatToFp16(0x1p-14f - 0x1p-25f), 0x0400);
}

TEST(Fp16Test, OverflowInfinityNanAndZero) {
  EXPECT_EQ(FloatToFp16(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToFp16(65519.99f), 0x7bff);
  EXPECT_EQ(FloatToFp16(65520.0f), 0x7c00);  // tie with odd 0x7bff -> inf
  EXPECT_EQ(FloatToFp16(1e10f), 0x7c00);
  EXPECT_EQ(FloatToFp16(-1e10f), 0xfc00);
  EXPECT_EQ(FloatToFp16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(FloatToFp16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(FloatToFp16(0.0f), 0x0000);
  EXPECT_EQ(FloatToFp16(-0.0f), 0x8000);
  EXPECT_EQ(FloatToFp16(1e-30f), 0x0000);
  EXPECT_TRUE(IsFp16Nan(FloatToFp16(std::numeric_limits<float>::quiet_NaN())));
  // A signalling NaN whose payload is only in the low bits stays a NaN.
  EXPECT_EQ(FloatToFp16(FromBits(0x7f800001u)), 0x7e00);
  EXPECT_EQ(FloatToFp16(FromBits(0xff800001u)), 0xfe00);
  EXPECT_TRUE(std::isinf(Fp16ToFloat(0x7c00)));
  EXPECT_EQ(Fp16ToFloat(0x0001), 0x1p-24f);
  EXPECT_EQ(Fp16ToFloat(0x3c00), 1.0f);
}

TEST(Bf16Test, RoundToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between 1 (0x3f80, even) and 1 + 2^-7 (0x3f81).
  EXPECT_EQ(FloatToBf16(1.0f + 0x1p-8f), 0x3f80);
  EXPECT_EQ(FloatToBf16(1.0f + 3 * 0x1p-8f), 0x3f82);
  EXPECT_EQ(FloatToBf16(std::nextafter(1.0f + 0x1p-8f, 2.0f)), 0x3f81);
  EXPECT_EQ(FloatToBf16(-1.0f - 0x1p-8f), 0xbf80);
  // Largest finite fp32 rounds up to infinity; infinities are kept.
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(FloatToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(FloatToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(FloatToBf16(-0.0f), 0x8000);
  // Round trip of every bf16 pattern except NaNs is exact.
  for (uint32_t p = 0; p <= 0xffff; ++p) {
    const uint16_t h = static_cast<uint16_t>(p);
    const float f = Bf16ToFloat(h);
    EXPECT_EQ(Bits(f), p << 16);
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToBf16(f), h) << std::hex << p;
  }
}

TEST(Bf16Test, NanStaysQuietNan) {
  // A signalling NaN whose payload is only in the dropped bits would become
  // infinity by truncation; it must stay NaN.
  for (uint32_t b : {0x7f800001u, 0xff800001u, 0x7fc00000u, 0x7fffffffu}) {
    const uint16_t h = FloatToBf16(FromBits(b));
    EXPECT_TRUE(std::isnan(Bf16ToFloat(h))) << std::hex << b;
    EXPECT_EQ(h & 0x8000, (b >> 16) & 0x8000);
    EXPECT_NE(h & 0x0040, 0);  // quiet bit
  }
}

TEST(DTypeTest, NamesAndSizes) {
  EXPECT_EQ(DTypeName(DType::kFp32), "fp32");
  EXPECT_EQ(DTypeName(DType::kBf16), "bf16");
  EXPECT_EQ(DTypeName(DType::kFp16), "fp16");
  EXPECT_EQ(DTypeSize(DType::kFp32), 4u);
  EXPECT_EQ(DTypeSize(DType::kBf16), 2u);
  EXPECT_EQ(DTypeSize(DType::kFp16), 2u);
  for (DType d : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    auto by_name = DTypeFromName(DTypeName(d));
    ASSERT_TRUE(by_name.ok());
    EXPECT_EQ(*by_name, d);
    auto by_int = DTypeFromInt(static_cast<int>(d));
    ASSERT_TRUE(by_int.ok());
    EXPECT_EQ(*by_int, d);
  }
}

TEST(DTypeTest, Errors) {
  for (int bad : {0, 4, -1, 255}) {
    auto s = DTypeFromInt(bad);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("invalid dtype value"), absl::string_view::npos)
        << s.status();
  }
  for (const char* bad : {"", "FP32", "float16", "int8"}) {
    auto s = DTypeFromName(bad);
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("expected fp32, bf16 or fp16"),
              absl::string_view::npos)
        << s.status();
  }
}

}  // namespace
}  // namespace optimus
