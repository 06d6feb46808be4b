// Checkpoint faults with real servers in this process (tests/harness, over
// the in-process loopback transport): a corrupted file makes a
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
#include "absl/strings/str_cat.h"
#include "common/checkpoint_files.h"
#include "gtest/gtest.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace {

using harness::Cluster;

constexpr uint32_t kWorkers = 2;

// S shards sharing the checkpoint folder `dir`, over loopback.
harness::ClusterOptions Options(const std::string& dir, int shards) {
  harness::ClusterOptions o;
  o.num_shards = shards;
  o.num_workers = kWorkers;
  o.checkpoint_dir = dir;
  return o;
}

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
absl::StatusOr<v1::CheckpointInfo> CheckpointAt(Cluster& c, const std::string& job,
                                                uint64_t step) {
  if (absl::Status s = c.WaitApplied(job, step - 1); !s.ok()) return s;
  auto info = c.CreateCheckpoint(job);
  if (!info.ok()) return info.status();
  if (info->step() != step) {
    return absl::InternalError(absl::StrCat("checkpoint ordered at step ", info->step(),
                                            ", expected ", step));
  }
  return c.WaitCheckpoint(job, info->checkpoint_id());
}

// Tensors 0 and 1 at `version`.
absl::StatusOr<std::vector<std::vector<uint8_t>>> PullBoth(Cluster& c, uint64_t version) {
  std::vector<std::vector<uint8_t>> out;
  for (uint32_t t = 0; t < 2; ++t) {
    auto got = c.Pull(t, version);
    if (!got.ok()) return got.status();
    out.push_back(std::move(*got));
  }
  return out;
}

TEST(CheckpointFaultTest, CorruptedFileIsRefusedByNameAndThePreviousOneRestores) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, harness::NewTempDir("ckpt"));
  ASSERT_OK_AND_ASSIGN(auto c, Cluster::Start(Options(dir, 2)));
  ASSERT_OK(c->CreateJob(harness::SmallJob("corrupt", kWorkers)));
  ASSERT_OK(c->Train(1, 3));
  ASSERT_OK_AND_ASSIGN(const auto at4, PullBoth(*c, 4));
  ASSERT_OK_AND_ASSIGN(const v1::CheckpointInfo first, CheckpointAt(*c, "corrupt", 4));
  ASSERT_EQ(first.state(), v1::CHECKPOINT_STATE_COMPLETE) << first.error();
  ASSERT_OK(c->Train(4, 6));
  ASSERT_OK_AND_ASSIGN(const v1::CheckpointInfo second, CheckpointAt(*c, "corrupt", 7));
  ASSERT_EQ(second.state(), v1::CHECKPOINT_STATE_COMPLETE) << second.error();

  // Flip one byte in the middle of one data file of the newest checkpoint.
  auto manifest = ckpt::ReadManifest(second.path());
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  const v1::CheckpointFile& victim = manifest->files(manifest->files_size() / 2);
  const std::string victim_path = second.path() + "/" + victim.name();
  FlipByte(victim_path, static_cast<long>(victim.size_bytes() / 2));

  // The newest (the default) is refused, naming the file; nothing changes.
  auto refused = c->RestoreCheckpoint("corrupt", 0, "corrupt-restored");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kDataLoss) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), victim_path)) << refused.status();
  ASSERT_OK_AND_ASSIGN(const v1::StatusResponse status, c->Status());
  EXPECT_EQ(status.jobs_size(), 1);
  // The previous checkpoint is intact and restores, at its own step.
  auto restored = c->RestoreCheckpoint("corrupt", first.checkpoint_id(), "corrupt-restored");
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->resume_step(), 4u);
  ASSERT_OK(c->JoinJob("corrupt-restored"));
  EXPECT_EQ(c->worker(1)->resume_step(), 4u);
  ASSERT_OK_AND_ASSIGN(const auto restored4, PullBoth(*c, 4));
  EXPECT_EQ(restored4[0], at4[0]);
  EXPECT_EQ(restored4[1], at4[1]);
  // And trains on from there.
  ASSERT_OK(c->Train(4, 5));
  EXPECT_TRUE(ckpt::RemoveTree(dir).ok());
}

TEST(CheckpointFaultTest, FullDiskFailsTheNewCheckpointAndKeepsThePreviousOne) {
  // A 1 MiB tmpfs holds one checkpoint of this job (~620 KB) but not two.
  ASSERT_OK_AND_ASSIGN(const std::string dir, harness::NewTempDir("ckpt"));
  if (mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=1m") != 0) {
    GTEST_SKIP() << "cannot mount a small tmpfs to fill (needs root): " << std::strerror(errno);
  }
  {
    ASSERT_OK_AND_ASSIGN(auto c, Cluster::Start(Options(dir, 2)));
    client::JobDef def = harness::SmallJob("full", kWorkers);
    def.checkpoint.keep_last = 5;  // The first must not be pruned to make room.
    ASSERT_OK(c->CreateJob(def));
    ASSERT_OK(c->Train(1, 3));
    ASSERT_OK_AND_ASSIGN(const auto at4, PullBoth(*c, 4));
    ASSERT_OK_AND_ASSIGN(const v1::CheckpointInfo first, CheckpointAt(*c, "full", 4));
    ASSERT_EQ(first.state(), v1::CHECKPOINT_STATE_COMPLETE) << first.error();
    ASSERT_OK(c->Train(4, 6));
    ASSERT_OK_AND_ASSIGN(const v1::CheckpointInfo second, CheckpointAt(*c, "full", 7));
    EXPECT_EQ(second.state(), v1::CHECKPOINT_STATE_FAILED);
    EXPECT_TRUE(absl::StrContains(second.error(), "No space left on device")) << second.error();
    // The error shows in status, as the job's last checkpoint.
    ASSERT_OK_AND_ASSIGN(const v1::StatusResponse status, c->Status());
    ASSERT_EQ(status.jobs_size(), 1);
    EXPECT_EQ(status.jobs(0).last_checkpoint().state(), v1::CHECKPOINT_STATE_FAILED);
    EXPECT_TRUE(absl::StrContains(status.jobs(0).last_checkpoint().error(), "No space"));
    // And in the coordinator's metrics, for alerting.
    EXPECT_TRUE(absl::StrContains(c->coordinator()->RenderMetrics(),
                                  "optimus_coord_job_last_checkpoint_failed{job_name=\"full\"} 1"))
        << c->coordinator()->RenderMetrics();
    // The failed checkpoint's partial files are gone; the first is intact.
    EXPECT_EQ(ckpt::ListDir(dir + "/full"),
              std::vector<std::string>{ckpt::FolderName(first.checkpoint_id())});
    // Training was not disturbed.
    ASSERT_OK(c->Train(7, 8));
    auto restored = c->RestoreCheckpoint("full", 0, "full-restored");
    ASSERT_TRUE(restored.ok()) << restored.status();
    EXPECT_EQ(restored->resume_step(), 4u);
    ASSERT_OK(c->JoinJob("full-restored"));
    ASSERT_OK_AND_ASSIGN(const auto restored4, PullBoth(*c, 4));
    EXPECT_EQ(restored4[0], at4[0]);
    EXPECT_EQ(restored4[1], at4[1]);
  }
  EXPECT_EQ(umount2(dir.c_str(), MNT_DETACH), 0) << std::strerror(errno);
  EXPECT_TRUE(ckpt::RemoveTree(dir).ok());
}

// A shard dies without a replica: the coordinator rolls the job back to its
// last checkpoint on the two shards left, under the same name; re-joined
// workers are told the step to resume from, and the result equals a run
// that never failed.
TEST(CheckpointFaultTest, LostShardRollsTheJobBackToItsLastCheckpoint) {
  constexpr uint64_t kLast = 9;
  std::vector<std::vector<uint8_t>> reference;
  {
    ASSERT_OK_AND_ASSIGN(const std::string dir, harness::NewTempDir("ckpt"));
    ASSERT_OK_AND_ASSIGN(auto ref, Cluster::Start(Options(dir, 2)));
    ASSERT_OK(ref->CreateJob(harness::SmallJob("lost", kWorkers)));
    ASSERT_OK(ref->Train(1, kLast));
    ASSERT_OK_AND_ASSIGN(reference, PullBoth(*ref, kLast + 1));
    EXPECT_TRUE(ckpt::RemoveTree(dir).ok());
  }
  ASSERT_OK_AND_ASSIGN(const std::string dir, harness::NewTempDir("ckpt"));
  ASSERT_OK_AND_ASSIGN(auto c, Cluster::Start(Options(dir, 3)));
  ASSERT_OK(c->CreateJob(harness::SmallJob("lost", kWorkers)));
  ASSERT_OK(c->Train(1, 3));
  ASSERT_OK_AND_ASSIGN(const v1::CheckpointInfo ck, CheckpointAt(*c, "lost", 4));
  ASSERT_EQ(ck.state(), v1::CHECKPOINT_STATE_COMPLETE) << ck.error();
  ASSERT_OK(c->Train(4, 6));  // Steps 4-6 are lost with the shard and redone.
  ASSERT_OK(c->KillShard(0));
  // After the lease (2 s) the job fails and is restored under its name.
  ASSERT_OK(c->WaitStatus("job lost rolled back and READY", [](const v1::StatusResponse& st) {
    for (const auto& j : st.jobs()) {
      if (j.name() == "lost" && j.job_id() != 1 && j.state() == v1::JOB_STATE_READY) return true;
    }
    return false;
  }));
  ASSERT_OK(c->JoinJob("lost"));
  EXPECT_EQ(c->worker(0)->resume_step(), 4u);
  EXPECT_EQ(c->worker(1)->resume_step(), 4u);
  ASSERT_OK(c->Train(4, kLast));
  ASSERT_OK_AND_ASSIGN(const auto got, PullBoth(*c, kLast + 1));
  EXPECT_EQ(got[0], reference[0]);
  EXPECT_EQ(got[1], reference[1]);
  EXPECT_TRUE(ckpt::RemoveTree(dir).ok());
}

}  // namespace
}  // namespace optimus
