// Checkpoint faults with real servers on loopback: a corrupted file makes a
// restore refuse with the file's name while the previous checkpoint still
// restores; a full disk fails the checkpoint in progress (reported, partial
// files removed) and leaves the previous one intact and restorable.
#include <sys/mount.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "common/checkpoint_files.h"
#include "gtest/gtest.h"
#include "tests/integration/ckpt_cluster.h"

namespace optimus {
namespace testing_ckpt {
namespace {

void FlipByte(const std::string& path, long at) {
  FILE* f = std::fopen(path.c_str(), "r+b");
  ASSERT_NE(f, nullptr) << path;
  std::fseek(f, at, SEEK_SET);
  const int c = std::fgetc(f);
  std::fseek(f, at, SEEK_SET);
  std::fputc(c ^ 0x01, f);
  std::fclose(f);
}

// Checkpoints at `step` (training is paused there) and waits for it.
v1::CheckpointInfo CheckpointAt(CkptCluster& c, const std::string& job, uint64_t step) {
  c.WaitApplied(job, step - 1);
  auto info = c.CreateCheckpoint(job);
  EXPECT_TRUE(info.ok()) << info.status();
  if (!info.ok()) return {};
  EXPECT_EQ(info->step(), step);
  return c.WaitDone(job, info->checkpoint_id());
}

TEST(CheckpointFaultTest, CorruptedFileIsRefusedByNameAndThePreviousOneRestores) {
  const std::string dir = NewTempDir();
  CkptCluster c(dir, 2);
  c.CreateAndJoin(MakeJob("corrupt"));
  c.Train(1, 3);
  std::vector<std::vector<uint8_t>> at4 = {c.Pull(0, 4), c.Pull(1, 4)};
  const v1::CheckpointInfo first = CheckpointAt(c, "corrupt", 4);
  ASSERT_EQ(first.state(), v1::CHECKPOINT_STATE_COMPLETE) << first.error();
  c.Train(4, 6);
  const v1::CheckpointInfo second = CheckpointAt(c, "corrupt", 7);
  ASSERT_EQ(second.state(), v1::CHECKPOINT_STATE_COMPLETE) << second.error();

  // Flip one byte in the middle of one data file of the newest checkpoint.
  auto manifest = ckpt::ReadManifest(second.path());
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  const v1::CheckpointFile& victim = manifest->files(manifest->files_size() / 2);
  const std::string victim_path = second.path() + "/" + victim.name();
  FlipByte(victim_path, static_cast<long>(victim.size_bytes() / 2));

  // The newest (the default) is refused, naming the file; nothing changes.
  auto refused = c.Restore("corrupt", 0, "corrupt-restored");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), victim_path)) << refused.status();
  EXPECT_EQ(c.Status().jobs_size(), 1);
  // The previous checkpoint is intact and restores, at its own step.
  auto restored = c.Restore("corrupt", first.checkpoint_id(), "corrupt-restored");
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->resume_step(), 4u);
  c.ConnectClients();
  c.JoinAll("corrupt-restored");
  EXPECT_EQ(c.client(1)->resume_step(), 4u);
  EXPECT_EQ(c.Pull(0, 4), at4[0]);
  EXPECT_EQ(c.Pull(1, 4), at4[1]);
  // And trains on from there.
  c.Train(4, 5);
  EXPECT_TRUE(ckpt::RemoveTree(dir).ok());
}

TEST(CheckpointFaultTest, FullDiskFailsTheNewCheckpointAndKeepsThePreviousOne) {
  // A 1 MiB tmpfs holds one checkpoint of this job (~620 KB) but not two.
  const std::string dir = NewTempDir();
  if (mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=1m") != 0) {
    GTEST_SKIP() << "cannot mount a small tmpfs to fill (needs root): " << std::strerror(errno);
  }
  {
    CkptCluster c(dir, 2);
    client::JobDef def = MakeJob("full");
    def.checkpoint.keep_last = 5;  // The first must not be pruned to make room.
    c.CreateAndJoin(def);
    c.Train(1, 3);
    std::vector<std::vector<uint8_t>> at4 = {c.Pull(0, 4), c.Pull(1, 4)};
    const v1::CheckpointInfo first = CheckpointAt(c, "full", 4);
    ASSERT_EQ(first.state(), v1::CHECKPOINT_STATE_COMPLETE) << first.error();
    c.Train(4, 6);
    const v1::CheckpointInfo second = CheckpointAt(c, "full", 7);
    EXPECT_EQ(second.state(), v1::CHECKPOINT_STATE_FAILED);
    EXPECT_TRUE(absl::StrContains(second.error(), "No space left on device")) << second.error();
    // The error shows in status, as the job's last checkpoint.
    const v1::StatusResponse status = c.Status();
    ASSERT_EQ(status.jobs_size(), 1);
    EXPECT_EQ(status.jobs(0).last_checkpoint().state(), v1::CHECKPOINT_STATE_FAILED);
    EXPECT_TRUE(absl::StrContains(status.jobs(0).last_checkpoint().error(), "No space"));
    // And in the coordinator's metrics, for alerting.
    EXPECT_TRUE(absl::StrContains(c.coord()->RenderMetrics(),
                                  "optimus_coord_job_last_checkpoint_failed{job=\"full\"} 1"))
        << c.coord()->RenderMetrics();
    // The failed checkpoint's partial files are gone; the first is intact.
    EXPECT_EQ(ckpt::ListDir(dir + "/full"),
              std::vector<std::string>{ckpt::FolderName(first.checkpoint_id())});
    // Training was not disturbed.
    c.Train(7, 8);
    auto restored = c.Restore("full", 0, "full-restored");
    ASSERT_TRUE(restored.ok()) << restored.status();
    EXPECT_EQ(restored->resume_step(), 4u);
    c.ConnectClients();
    c.JoinAll("full-restored");
    EXPECT_EQ(c.Pull(0, 4), at4[0]);
    EXPECT_EQ(c.Pull(1, 4), at4[1]);
  }
  EXPECT_EQ(umount2(dir.c_str(), MNT_DETACH), 0) << std::strerror(errno);
  EXPECT_TRUE(ckpt::RemoveTree(dir).ok());
}

}  // namespace
}  // namespace testing_ckpt
}  // namespace optimus

namespace optimus {
namespace testing_ckpt {
namespace {

// A shard dies without a replica: the coordinator rolls the job back to its
// last checkpoint on the two shards left, under the same name; re-joined
// workers are told the step to resume from, and the result equals a run
// that never failed.
TEST(CheckpointFaultTest, LostShardRollsTheJobBackToItsLastCheckpoint) {
  constexpr uint64_t kLast = 9;
  std::vector<std::vector<uint8_t>> reference;
  {
    const std::string dir = NewTempDir();
    CkptCluster ref(dir, 2);
    ref.CreateAndJoin(MakeJob("lost"));
    ref.Train(1, kLast);
    reference = {ref.Pull(0, kLast + 1), ref.Pull(1, kLast + 1)};
    EXPECT_TRUE(ckpt::RemoveTree(dir).ok());
  }
  const std::string dir = NewTempDir();
  CkptCluster c(dir, 3);
  c.CreateAndJoin(MakeJob("lost"));
  c.Train(1, 3);
  const v1::CheckpointInfo ck = CheckpointAt(c, "lost", 4);
  ASSERT_EQ(ck.state(), v1::CHECKPOINT_STATE_COMPLETE) << ck.error();
  c.Train(4, 6);  // Steps 4-6 are lost with the shard and redone.
  c.StopShard(0);
  // After the lease (2 s) the job fails and is restored under its name.
  const absl::Time give_up = absl::Now() + kWait;
  bool rolled_back = false;
  while (!rolled_back && absl::Now() < give_up) {
    const v1::StatusResponse st = c.Status();
    for (const auto& j : st.jobs()) {
      rolled_back |= j.name() == "lost" && j.job_id() != 1 && j.state() == v1::JOB_STATE_READY;
    }
    if (!rolled_back) absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_TRUE(rolled_back);
  c.ConnectClients();
  c.JoinAll("lost");
  EXPECT_EQ(c.client(0)->resume_step(), 4u);
  EXPECT_EQ(c.client(1)->resume_step(), 4u);
  c.Train(4, kLast);
  EXPECT_EQ(c.Pull(0, kLast + 1), reference[0]);
  EXPECT_EQ(c.Pull(1, kLast + 1), reference[1]);
  EXPECT_TRUE(ckpt::RemoveTree(dir).ok());
}

}  // namespace
}  // namespace testing_ckpt
}  // namespace optimus
