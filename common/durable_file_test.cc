#include "common/durable_file.h"

#include <cstdio>
#include <vector>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace optimus {
namespace {

std::string TestDir() {
  const char* d = std::getenv("TEST_TMPDIR");
  return d != nullptr ? d : "/tmp";
}

TEST(DurableFileTest, WritesReplacesAndLeavesNoTemporary) {
  const std::string path = TestDir() + "/state_a";
  ASSERT_TRUE(WriteFileAtomically(path, "first").ok());
  ASSERT_TRUE(WriteFileAtomically(path, "second, longer").ok());
  absl::StatusOr<std::string> got = ReadWholeFile(path);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "second, longer");
  EXPECT_NE(::access((path + ".tmp").c_str(), F_OK), 0);
}

TEST(DurableFileTest, FailedWriteKeepsTheOldFileAndNamesThePath) {
  const std::string path = TestDir() + "/state_b";
  ASSERT_TRUE(WriteFileAtomically(path, "kept").ok());
  // A folder where the temporary file must go: creating it fails (as root
  // too, unlike a permission bit).
  ASSERT_EQ(::mkdir((path + ".tmp").c_str(), 0755), 0);
  absl::Status s = WriteFileAtomically(path, "lost");
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find(path + ".tmp"), std::string::npos) << s;
  EXPECT_EQ(*ReadWholeFile(path), "kept");
  ::rmdir((path + ".tmp").c_str());
}

TEST(DurableFileTest, FullDiskIsResourceExhausted) {
  EXPECT_EQ(ErrnoToStatus(ENOSPC, "writing", "/x").code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(ReadWholeFile(TestDir() + "/missing").status().code(), absl::StatusCode::kNotFound);
}

TEST(DurableFileTest, Crc32cKnownValue) {
  // The CRC-32C check value from the iSCSI standard (RFC 3720, B.4).
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(Crc32c("6789", Crc32c("12345")), 0xE3069283u);
  EXPECT_EQ(Crc32cPortable(0, "123456789", 9), 0xE3069283u);
}

TEST(DurableFileTest, ChecksummedFileDetectsAFlippedByteAndTruncation) {
  const std::string path = TestDir() + "/state_c";
  const std::string payload(1000, 'x');
  ASSERT_TRUE(WriteChecksummedFile(path, "OPTTEST1", payload).ok());
  EXPECT_EQ(*ReadChecksummedFile(path, "OPTTEST1"), payload);
  EXPECT_EQ(ReadChecksummedFile(path, "OTHER").status().code(), absl::StatusCode::kDataLoss);

  std::string raw = *ReadWholeFile(path);
  raw[raw.size() - 10] ^= 0x01;
  ASSERT_TRUE(WriteFileAtomically(path, raw).ok());
  absl::Status s = ReadChecksummedFile(path, "OPTTEST1").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(s.message().find(path), std::string::npos) << s;

  ASSERT_TRUE(WriteFileAtomically(path, raw.substr(0, raw.size() - 3)).ok());
  EXPECT_EQ(ReadChecksummedFile(path, "OPTTEST1").status().code(), absl::StatusCode::kDataLoss);
}

}  // namespace
TEST(DurableFileTest, Crc32cInstructionMatchesTheTablesAtEveryLengthAndAlignment) {
  std::vector<uint8_t> buf(4096 + 16);
  uint32_t x = 12345;
  for (auto& b : buf) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(x >> 24);
  }
  for (size_t offset = 0; offset < 8; ++offset) {
    for (size_t len : {0, 1, 7, 8, 9, 63, 64, 65, 1000, 4096}) {
      const uint8_t* p = buf.data() + offset;
      EXPECT_EQ(Crc32c(0, p, len), Crc32cPortable(0, p, len)) << offset << " " << len;
      EXPECT_EQ(Crc32c(0xdeadbeef, p, len), Crc32cPortable(0xdeadbeef, p, len));
    }
  }
  std::printf("CRC-32C uses the CPU instruction: %s\n", Crc32cIsHardware() ? "yes" : "no");
}

}  // namespace optimus
