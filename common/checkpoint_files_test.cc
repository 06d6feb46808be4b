#include "common/checkpoint_files.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <tuple>
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

// Files that overlap and leave a gap are refused, not read as if they
// covered the range (found by //tests/fuzz:checkpoint: counting covered
// elements let [0, 6) + [2, 6) pass for [0, 10), leaving [6, 10) unread).
TEST(CheckpointFilesTest, OverlappingFilesAreRefused) {
  const std::string dir = TempDir();
  std::vector<float> v(10, 1.0f);
  const float* a[] = {v.data()};
  v1::CheckpointManifest man;
  for (const auto& [name, offset, n] :
       std::vector<std::tuple<const char*, uint64_t, uint64_t>>{{"a", 0, 6}, {"b", 2, 4}}) {
    auto f = WriteDataFile(dir, name, 0, offset, n, a);
    ASSERT_TRUE(f.ok()) << f.status();
    *man.add_files() = *f;
  }
  ASSERT_TRUE(VerifyCheckpoint(dir, man).ok());  // Each file is sound on its own.
  std::vector<float> got(10, -1.0f);
  float* dst[] = {got.data()};
  absl::Status s = ReadTensorRange(dir, man, 0, 0, 10, dst);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("overlap"), absl::string_view::npos) << s;
  // Where they do not overlap, they read.
  EXPECT_TRUE(ReadTensorRange(dir, man, 0, 0, 2, dst).ok());
  // A range past the end overflowing 64 bits is refused.
  EXPECT_FALSE(ReadTensorRange(dir, man, 0, UINT64_MAX - 1, 4, dst).ok());
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

// The folder helpers (std::filesystem underneath): mkdir -p with mkdir's
// 0755, a file in the way is an error naming it, ListDir sorts and leaves
// out . and .., RemoveTree removes a symbolic link without following it and
// accepts a missing path.
TEST(CheckpointFilesTest, FolderHelpers) {
  const std::string root = TempDir();
  const mode_t old_umask = umask(022);
  const std::string deep = root + "/a/b/c/";
  ASSERT_TRUE(MakeDirs(deep).ok());
  ASSERT_TRUE(MakeDirs(deep).ok());  // Already there: fine.
  umask(old_umask);
  struct stat st;
  ASSERT_EQ(stat((root + "/a/b").c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0755u);
  EXPECT_EQ(MakeDirs("").code(), absl::StatusCode::kInvalidArgument);

  FILE* f = std::fopen((root + "/a/file").c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fclose(f);
  absl::Status in_the_way = MakeDirs(root + "/a/file");
  EXPECT_EQ(in_the_way.code(), absl::StatusCode::kInternal) << in_the_way;
  EXPECT_NE(in_the_way.message().find("a/file is not a folder"), absl::string_view::npos)
      << in_the_way;
  in_the_way = MakeDirs(root + "/a/file/below");
  EXPECT_FALSE(in_the_way.ok());
  EXPECT_NE(in_the_way.message().find("a/file"), absl::string_view::npos) << in_the_way;

  EXPECT_EQ(ListDir(root + "/a"), (std::vector<std::string>{"b", "file"}));
  EXPECT_TRUE(ListDir(root + "/missing").empty());

  // A link to a folder outside the tree: the link goes, its target stays.
  const std::string outside = TempDir();
  ASSERT_TRUE(MakeDirs(outside + "/kept").ok());
  ASSERT_EQ(symlink(outside.c_str(), (root + "/a/b/link").c_str()), 0);
  ASSERT_TRUE(RemoveTree(root + "/a").ok());
  EXPECT_TRUE(ListDir(root).empty());
  EXPECT_EQ(ListDir(outside), std::vector<std::string>{"kept"});
  EXPECT_TRUE(RemoveTree(root + "/a").ok());  // Missing: fine.
  ASSERT_TRUE(RemoveTree(outside).ok());
  ASSERT_TRUE(RemoveTree(root).ok());
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

TEST(CheckpointFilesTest, FileNamesNeverLeaveTheFolder) {
  for (const char* ok : {"t0_c1.bin", "w-3.part.0", "A"}) {
    EXPECT_TRUE(CheckFileName(ok).ok()) << ok;
  }
  for (const char* bad : {"", ".", "..", "../../../../dev/zero", "a/b", "/etc/passwd", "a b",
                          "x\n"}) {
    EXPECT_EQ(CheckFileName(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_FALSE(CheckFileName(std::string(129, 'a')).ok());
}

// A manifest (or a forged shard report) naming a file outside the folder,
// or claiming sizes whose product overflows, is refused before anything is
// opened: the coordinator never reads /dev/zero into memory.
TEST(CheckpointFilesTest, HostileRecordsAreRefusedBeforeAnyRead) {
  const std::string dir = TempDir();
  v1::CheckpointFile f;
  f.set_name("../../../../dev/zero");
  f.set_num_arrays(1);
  f.set_num_elems(1);
  f.set_size_bytes(kHeaderBytes + 4 + 4);
  auto r = ReadDataFile(dir, f);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("character other than"), absl::string_view::npos)
      << r.status();
  // num_arrays x num_elems x 4 wraps around to a small number.
  f.set_name("ok.bin");
  f.set_num_arrays(4);
  f.set_num_elems(uint64_t{1} << 62);
  f.set_size_bytes(kHeaderBytes + 4);
  r = ReadDataFile(dir, f);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("too large"), absl::string_view::npos) << r.status();
  // A manifest listing such a file is corrupt as a whole.
  v1::CheckpointManifest man;
  man.set_job_name("j");
  v1::CheckpointFile* bad = man.add_files();
  bad->set_name("../x");
  ASSERT_TRUE(WriteManifest(dir, man).ok());
  auto m = ReadManifest(dir);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss) << m.status();
  ASSERT_TRUE(RemoveTree(dir).ok());
}

// A data file replaced by something that is not a regular file, or by a
// larger one, is refused without reading it whole.
TEST(CheckpointFilesTest, DevicesFifosAndOversizedFilesAreNotRead) {
  const std::string dir = TempDir();
  const float a[2] = {1, 2};
  const float* arrays[] = {a};
  auto f = WriteDataFile(dir, "part.bin", 0, 0, 2, arrays);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_TRUE(ReadDataFile(dir, *f).ok());
  // Grown behind the manifest's back.
  {
    FILE* out = std::fopen((dir + "/part.bin").c_str(), "ab");
    ASSERT_NE(out, nullptr);
    std::fputs("more bytes", out);
    std::fclose(out);
  }
  auto r = ReadDataFile(dir, *f);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  // A FIFO under the file's name: refused at once (no writer needed).
  ASSERT_EQ(std::remove((dir + "/part.bin").c_str()), 0);
  ASSERT_EQ(mkfifo((dir + "/part.bin").c_str(), 0600), 0);
  r = ReadDataFile(dir, *f);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kDataLoss) << r.status();
  EXPECT_NE(r.status().message().find("not a regular file"), absl::string_view::npos)
      << r.status();
  ASSERT_TRUE(RemoveTree(dir).ok());
}

}  // namespace
}  // namespace ckpt
}  // namespace optimus
