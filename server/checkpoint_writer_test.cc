#include "server/checkpoint_writer.h"

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/checkpoint_files.h"
#include "gtest/gtest.h"

namespace optimus {
namespace server {
namespace {

std::string TempDir() {
  std::string tmpl = absl::StrCat(std::getenv("TEST_TMPDIR"), "/writerXXXXXX");
  EXPECT_NE(mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

ChunkSnapshot Snap(uint64_t ckpt, uint64_t offset, uint64_t n) {
  ChunkSnapshot s;
  s.job_id = 1;
  s.checkpoint_id = ckpt;
  s.tensor = 0;
  s.offset_elems = offset;
  s.num_elems = n;
  s.num_arrays = 2;
  s.data.assign(2 * n, 1.5f);
  return s;
}

CheckpointReport WaitReport(CheckpointWriter& w, uint64_t ckpt) {
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  CheckpointReport last;
  while (absl::Now() < give_up) {
    for (const auto& r : w.Reports()) {
      if (r.checkpoint_id == ckpt) last = r;
    }
    if (last.done || !last.error.empty()) return last;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return last;
}

TEST(CheckpointWriterTest, WritesEverySnapshotThenReportsDoneWithChecksums) {
  const std::string dir = TempDir();
  CheckpointWriter w(0);
  w.Begin(1, 3, dir, 2);
  EXPECT_TRUE(w.Known(1, 3));
  w.Add(Snap(3, 0, 100));
  w.Add(Snap(3, 100, 50));
  CheckpointReport r = WaitReport(w, 3);
  ASSERT_TRUE(r.done) << r.error;
  ASSERT_EQ(r.files.size(), 2u);
  v1::CheckpointManifest m;
  for (const auto& f : r.files) *m.add_files() = f;
  EXPECT_TRUE(ckpt::VerifyCheckpoint(dir, m).ok());
  // Forgotten once the coordinator stops ordering it.
  w.Retain({});
  EXPECT_FALSE(w.Known(1, 3));
}

TEST(CheckpointWriterTest, WriteErrorIsReportedNotFatal) {
  CheckpointWriter w(0);
  w.Begin(1, 4, "/nonexistent/folder", 1);
  w.Add(Snap(4, 0, 10));
  CheckpointReport r = WaitReport(w, 4);
  EXPECT_FALSE(r.done);
  EXPECT_NE(r.error.find("/nonexistent/folder"), std::string::npos) << r.error;
  // Snapshots of a failed checkpoint are dropped.
  w.Add(Snap(4, 10, 10));
  EXPECT_EQ(WaitReport(w, 4).files.size(), 0u);
}

TEST(CheckpointWriterTest, DeletedJobFailsItsCheckpointsAndDropsTheirSnapshots) {
  const std::string dir = TempDir();
  CheckpointWriter w(0);
  w.Begin(1, 6, dir, 2);
  w.FailJob(1, "job 1 was deleted");
  w.Add(Snap(6, 0, 10));
  CheckpointReport r = WaitReport(w, 6);
  EXPECT_FALSE(r.done);
  EXPECT_EQ(r.error, "job 1 was deleted");
  EXPECT_TRUE(r.files.empty());
  // Failed and no longer ordered: forgotten.
  w.Retain({});
  EXPECT_FALSE(w.Known(1, 6));
}

TEST(CheckpointWriterTest, PolicyCheckpointMakesItsFolderAndStaysUntilReported) {
  const std::string dir = TempDir() + "/job/ckpt-000050";
  CheckpointWriter w(0);
  EXPECT_TRUE(w.BeginIfNew(1, 50, dir, 1, /*make_dir=*/true));
  EXPECT_FALSE(w.BeginIfNew(1, 50, dir, 7, /*make_dir=*/true)) << "tracked already";
  w.Add(Snap(50, 0, 10));
  // Finished but never reported: the coordinator has not heard of it, so
  // a heartbeat reply that does not list it must not drop it.
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (ckpt::ListDir(dir).empty() && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  absl::SleepFor(absl::Milliseconds(50));
  w.Retain({});
  EXPECT_TRUE(w.Known(1, 50));
  CheckpointReport r = WaitReport(w, 50);  // Reported now.
  ASSERT_TRUE(r.done) << r.error;
  EXPECT_EQ(r.files.size(), 1u);
  w.Retain({});
  EXPECT_FALSE(w.Known(1, 50));
}

TEST(CheckpointWriterTest, PolicyCheckpointNeverOverwritesACompleteOne) {
  const std::string dir = TempDir();
  v1::CheckpointManifest m;
  m.set_step(50);
  ASSERT_TRUE(ckpt::WriteManifest(dir, m).ok());
  CheckpointWriter w(0);
  ASSERT_TRUE(w.BeginIfNew(1, 50, dir, 1, /*make_dir=*/true));
  w.Add(Snap(50, 0, 10));
  CheckpointReport r = WaitReport(w, 50);
  EXPECT_FALSE(r.done);
  EXPECT_NE(r.error.find("a complete checkpoint exists"), std::string::npos) << r.error;
  EXPECT_EQ(ckpt::ListDir(dir), std::vector<std::string>{"MANIFEST"});
}

TEST(CheckpointWriterTest, RateLimitPacesTheWrites) {
  const std::string dir = TempDir();
  CheckpointWriter w(400 << 10);  // 400 KiB/s.
  w.Begin(1, 5, dir, 1);
  const absl::Time start = absl::Now();
  w.Add(Snap(5, 0, 50000));  // 400 KB.
  CheckpointReport r = WaitReport(w, 5);
  ASSERT_TRUE(r.done) << r.error;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(800));
}

}  // namespace
}  // namespace server
}  // namespace optimus
