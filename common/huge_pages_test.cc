#include "common/huge_pages.h"

#include <cstdint>
#include <cstring>

#include "gtest/gtest.h"

namespace optimus {
namespace {

TEST(MapAlignedTest, StartsOnAHugePageBoundaryZeroedAndWritable) {
  for (size_t bytes : {size_t{1}, size_t{4096}, kHugePageBytes + 12345, size_t{9} << 20}) {
    for (bool huge : {false, true}) {
      auto* p = static_cast<uint8_t*>(MapAligned(bytes, huge));
      ASSERT_NE(p, nullptr) << bytes;
      EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kHugePageBytes, 0u) << bytes;
      for (size_t i = 0; i < bytes; i += 4096) ASSERT_EQ(p[i], 0) << i;
      EXPECT_EQ(p[bytes - 1], 0);
      std::memset(p, 0x5a, bytes);
      EXPECT_EQ(p[bytes - 1], 0x5a);
      UnmapAligned(p, bytes);
    }
  }
  EXPECT_EQ(MapAligned(0, true), nullptr);
}

// Where the kernel gives huge pages only to advised memory (Debian's
// default), the advice is what decides; "always" makes every large mapping
// eligible and "never" none.
TEST(MapAlignedTest, AdvisedMappingIsHugePageEligibleAndTheOtherIsNot) {
  const std::string mode = TransparentHugePageMode();
  if (mode != "madvise" && mode != "always") {
    GTEST_SKIP() << "transparent huge pages are '" << mode << "' here";
  }
  const size_t bytes = size_t{8} << 20;
  void* advised = MapAligned(bytes, true);
  void* plain = MapAligned(bytes, false);
  ASSERT_NE(advised, nullptr);
  ASSERT_NE(plain, nullptr);
  EXPECT_TRUE(HugePageEligible(advised));
  if (mode == "madvise") {
    EXPECT_FALSE(HugePageEligible(plain));
  }
  UnmapAligned(advised, bytes);
  UnmapAligned(plain, bytes);
}

TEST(HugePageEligibleTest, FalseForAnAddressOutsideAnyMapping) {
  EXPECT_FALSE(HugePageEligible(reinterpret_cast<const void*>(uintptr_t{16})));
}

}  // namespace
}  // namespace optimus
