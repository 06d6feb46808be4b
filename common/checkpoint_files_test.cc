#include "common/checkpoint_files.h"

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace optimus {
namespace ckpt {
namespace {

std::string TempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string tmpl = absl::StrCat(base != nullptr ? base : "/tmp", "/ckptXXXXXX");
  EXPECT_NE(mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

void FlipByte(const std::string& path, long at) {
  FILE* f = std::fopen(path.c_str(), "r+b");
  ASSERT_NE(f, nullptr);
  std::fseek(f, at, SEEK_SET);
  const int c = std::fgetc(f);
  std::fseek(f, at, SEEK_SET);
  std::fputc(c ^ 0x40, f);
  std::fclose(f);
}

TEST(Crc32cTest, KnownValues) {
  // The check value of CRC-32C (RFC 3720 test vector).
  EXPECT_EQ(Crc32c(0, "123456789", 9), 0xE3069283u);
  std::string zeros(32, '\0');
  EXPECT_EQ(Crc32c(0, zeros.data(), zeros.size()), 0x8A9136AAu);
  // Extending piecewise equals one pass.
  const std::string s = "the quick brown fox jumps over the lazy dog";
  EXPECT_EQ(Crc32c(Crc32c(0, s.data(), 10), s.data() + 10, s.size() - 10),
            Crc32c(0, s.data(), s.size()));
}

TEST(CheckpointFilesTest, FolderNames) {
  EXPECT_EQ(FolderName(42), "ckpt-000042");
  EXPECT_EQ(ParseFolderName("ckpt-000042"), 42u);
  EXPECT_EQ(ParseFolderName("ckpt-x"), 0u);
  EXPECT_EQ(ParseFolderName("other"), 0u);
}

// Two files cut a tensor at 100 and 250; ranges read across both, and a
// flipped byte is refused with the file's name.
TEST(CheckpointFilesTest, WriteReadRangesAndCorruption) {
  const std::string dir = TempDir();
  std::vector<float> master(250), m(250);
  for (int i = 0; i < 250; ++i) {
    master[i] = 0.5f * i;
    m[i] = -1.0f * i;
  }
  v1::CheckpointManifest man;
  {
    const float* a[] = {master.data(), m.data()};
    auto f = WriteDataFile(dir, "t0-a", 0, 0, 100, a);
    ASSERT_TRUE(f.ok()) << f.status();
    *man.add_files() = *f;
    const float* b[] = {master.data() + 100, m.data() + 100};
    f = WriteDataFile(dir, "t0-b", 0, 100, 150, b);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_EQ(f->size_bytes(), kHeaderBytes + 2 * 150 * 4 + 4);
    *man.add_files() = *f;
  }
  ASSERT_TRUE(VerifyCheckpoint(dir, man).ok());
  std::vector<float> got_master(60), got_m(60);
  float* dst[] = {got_master.data(), got_m.data()};
  ASSERT_TRUE(ReadTensorRange(dir, man, 0, 70, 60, dst).ok());
  for (int i = 0; i < 60; ++i) {
    EXPECT_EQ(got_master[i], master[70 + i]);
    EXPECT_EQ(got_m[i], m[70 + i]);
  }
  // Past the end: not covered.
  EXPECT_EQ(ReadTensorRange(dir, man, 0, 240, 20, dst).code(),
            absl::StatusCode::kFailedPrecondition);
  // Wrong array count.
  float* one[] = {got_master.data()};
  EXPECT_EQ(ReadTensorRange(dir, man, 0, 0, 10, one).code(),
            absl::StatusCode::kFailedPrecondition);

  FlipByte(dir + "/t0-b", kHeaderBytes + 17);
  absl::Status s = VerifyCheckpoint(dir, man);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find(dir + "/t0-b"), absl::string_view::npos) << s;
  // The untouched file still reads.
  std::vector<float> a0(100), a1(100);
  float* first[] = {a0.data(), a1.data()};
  EXPECT_TRUE(ReadTensorRange(dir, man, 0, 0, 100, first).ok());

  // A missing file is NOT_FOUND with its name.
  std::remove((dir + "/t0-a").c_str());
  s = VerifyCheckpoint(dir, man);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("t0-a"), absl::string_view::npos) << s;
  ASSERT_TRUE(RemoveTree(dir).ok());
  EXPECT_TRUE(ListDir(dir).empty());
}

TEST(CheckpointFilesTest, ManifestRoundTripAndChecksum) {
  const std::string dir = TempDir();
  v1::CheckpointManifest man;
  man.set_job_name("j");
  man.set_step(17);
  man.mutable_spec()->add_tensors()->set_name("w");
  man.add_arrays("master");
  ASSERT_TRUE(WriteManifest(dir, man).ok());
  auto back = ReadManifest(dir);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->step(), 17u);
  EXPECT_EQ(back->spec().tensors(0).name(), "w");
  FlipByte(dir + "/MANIFEST", 80);
  back = ReadManifest(dir);
  EXPECT_EQ(back.status().code(), absl::StatusCode::kDataLoss) << back.status();
  EXPECT_NE(back.status().message().find("MANIFEST"), absl::string_view::npos);
  EXPECT_EQ(ReadManifest(dir + "/nope").status().code(), absl::StatusCode::kNotFound);
  // No leftover temporary files.
  EXPECT_EQ(ListDir(dir), std::vector<std::string>{"MANIFEST"});
  ASSERT_TRUE(RemoveTree(dir).ok());
}

TEST(CheckpointFilesTest, MissingFolderIsAnErrorNamingThePath) {
  auto f = WriteDataFile("/nonexistent/optimus", "x", 0, 0, 0, {});
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(f.status().message().find("/nonexistent/optimus/x"), absl::string_view::npos)
      << f.status();
}

}  // namespace
}  // namespace ckpt
}  // namespace optimus
