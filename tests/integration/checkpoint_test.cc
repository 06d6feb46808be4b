// Checkpoints end to end with real servers: a checkpoint restored onto a
// different number of shards (and a different chunking) continues training
// bit for bit like an uninterrupted run; a policy keeps the last K; and
// persisting does not stall the workers.
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/checkpoint_files.h"
#include "gtest/gtest.h"
#include "tests/integration/ckpt_cluster.h"

namespace optimus {
namespace testing_ckpt {
namespace {

constexpr uint64_t kSteps = 12;
constexpr uint64_t kCheckpointStep = 6;  // Version 6: steps 1..5 applied.

TEST(CheckpointTest, RestoreOntoThreeShardsContinuesBitwiseLikeAnUninterruptedRun) {
  const std::string dir = NewTempDir();
  std::vector<std::vector<uint8_t>> uninterrupted;
  uint64_t checkpoint_id = 0;
  {
    CkptCluster a(dir, /*num_shards=*/2);
    a.CreateAndJoin(MakeJob("rt"));
    EXPECT_EQ(a.client(0)->resume_step(), 1u);
    a.Train(1, kCheckpointStep - 1);
    a.WaitApplied("rt", kCheckpointStep - 1);
    auto info = a.CreateCheckpoint("rt");
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->state(), v1::CHECKPOINT_STATE_IN_PROGRESS);
    v1::CheckpointInfo done = a.WaitDone("rt", info->checkpoint_id());
    ASSERT_EQ(done.state(), v1::CHECKPOINT_STATE_COMPLETE) << done.error();
    EXPECT_EQ(done.step(), kCheckpointStep);
    EXPECT_GT(done.size_bytes(), (200 * 257 + 37) * 12u);
    checkpoint_id = done.checkpoint_id();
    // Status shows the job's last checkpoint.
    bool seen = false;
    const v1::StatusResponse status = a.Status();
    for (const auto& j : status.jobs()) {
      if (j.name() != "rt") continue;
      seen = true;
      EXPECT_EQ(j.last_checkpoint().checkpoint_id(), checkpoint_id);
      EXPECT_EQ(j.last_checkpoint().state(), v1::CHECKPOINT_STATE_COMPLETE);
      EXPECT_EQ(j.last_checkpoint().step(), kCheckpointStep);
    }
    EXPECT_TRUE(seen);
    // The same cluster trains on, uninterrupted.
    a.Train(kCheckpointStep, kSteps);
    for (uint32_t t = 0; t < 2; ++t) uninterrupted.push_back(a.Pull(t, kSteps + 1));
  }
  // A new coordinator and three shards over the same folder: restore with
  // 16 KiB chunks instead of 64 KiB, so no chunk matches a file.
  CkptCluster b(dir, /*num_shards=*/3);
  auto restored = b.Restore("rt", checkpoint_id, "", 16 * 1024);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->resume_step(), kCheckpointStep);
  b.ConnectClients();
  b.JoinAll("rt");
  EXPECT_EQ(b.client(0)->resume_step(), kCheckpointStep);
  EXPECT_GT(b.client(0)->tensors()[0].num_chunks, 4u);
  // Only the checkpoint's version is held; older ones are refused.
  {
    std::vector<uint8_t> dst(37 * 2);
    auto t = b.client(0)->Pull(1, kCheckpointStep - 1, dst.data(), 37);
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(b.client(0)->Wait(*t, kWait).code(), absl::StatusCode::kFailedPrecondition);
  }
  b.Train(kCheckpointStep, kSteps);
  for (uint32_t t = 0; t < 2; ++t) {
    std::vector<uint8_t> got = b.Pull(t, kSteps + 1);
    ASSERT_EQ(got.size(), uninterrupted[t].size());
    size_t mismatches = 0;
    for (size_t i = 0; i < got.size(); ++i) mismatches += got[i] != uninterrupted[t][i];
    EXPECT_EQ(mismatches, 0u) << "tensor " << t;
  }
  // A name in use by a running job is refused, and changes nothing.
  auto again = b.Restore("rt", checkpoint_id, "");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists) << again.status();
  EXPECT_EQ(b.Status().jobs_size(), 1);
  EXPECT_EQ(b.Restore("nope", 0, "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(ckpt::RemoveTree(dir).ok());
}

TEST(CheckpointTest, PolicyEveryTwoStepsKeepsTheLastTwo) {
  const std::string dir = NewTempDir();
  CkptCluster c(dir, 2);
  client::JobDef def = MakeJob("policy");
  def.checkpoint.every_steps = 2;
  def.checkpoint.keep_last = 2;
  c.CreateAndJoin(def);
  uint64_t completed = 0;
  for (uint64_t step = 1; step <= 8; step += 2) {
    c.Train(step, step + 1);
    // The policy fires once two more steps are applied; wait for it.
    const absl::Time give_up = absl::Now() + kWait;
    bool done = false;
    while (!done && absl::Now() < give_up) {
      for (const auto& ck : c.List("policy")) {
        done |= ck.state() == v1::CHECKPOINT_STATE_COMPLETE && ck.step() == step + 2;
      }
      if (!done) absl::SleepFor(absl::Milliseconds(20));
    }
    ASSERT_TRUE(done) << "no checkpoint at step " << step + 2;
    ++completed;
  }
  EXPECT_EQ(completed, 4u);
  std::vector<v1::CheckpointInfo> list = c.List("policy");
  std::vector<uint64_t> steps;
  for (const auto& ck : list) {
    if (ck.state() == v1::CHECKPOINT_STATE_COMPLETE) steps.push_back(ck.step());
  }
  EXPECT_EQ(steps, (std::vector<uint64_t>{7, 9}));
  // On disk: exactly two checkpoint folders, each with its manifest.
  std::vector<std::string> folders = ckpt::ListDir(dir + "/policy");
  EXPECT_EQ(folders.size(), 2u);
  for (const auto& f : folders) EXPECT_TRUE(ckpt::ReadManifest(dir + "/policy/" + f).ok()) << f;
  EXPECT_TRUE(ckpt::RemoveTree(dir).ok());
}

TEST(CheckpointTest, WorkersDoNotWaitForTheDisk) {
  const std::string dir = NewTempDir();
  // The writer is held to 32 KiB/s: each shard's 220-400 KB take 7 s or more,
  // while 10 steps take well under a second (5 s allowed on a busy machine).
  CkptCluster c(dir, 2, /*writer_bytes_per_second=*/32 << 10);
  c.CreateAndJoin(MakeJob("nostall"));
  c.Train(1, 3);
  c.WaitApplied("nostall", 3);
  std::vector<std::vector<uint8_t>> at4;
  for (uint32_t t = 0; t < 2; ++t) at4.push_back(c.Pull(t, 4));
  auto info = c.CreateCheckpoint("nostall");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->step(), 4u);
  // Orders travel with heartbeats (every 50 ms here): give the shards time
  // to take their snapshot of version 4 before training moves past it.
  absl::SleepFor(absl::Milliseconds(400));
  // Training goes on at full speed while the files are being written...
  const absl::Time start = absl::Now();
  c.Train(4, 13);
  const absl::Duration took = absl::Now() - start;
  std::vector<v1::CheckpointInfo> list = c.List("nostall");
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].state(), v1::CHECKPOINT_STATE_IN_PROGRESS)
      << "10 steps took " << absl::FormatDuration(took);
  EXPECT_LT(took, absl::Seconds(5));
  // ...and the checkpoint, once complete, holds version 4, not a later one.
  v1::CheckpointInfo done = c.WaitDone("nostall", info->checkpoint_id());
  ASSERT_EQ(done.state(), v1::CHECKPOINT_STATE_COMPLETE) << done.error();
  EXPECT_EQ(done.checkpoint_id(), info->checkpoint_id());
  EXPECT_EQ(done.step(), 4u);
  auto restored = c.Restore("nostall", 0, "nostall-copy");
  ASSERT_TRUE(restored.ok()) << restored.status();
  c.ConnectClients();
  c.JoinAll("nostall-copy");
  for (uint32_t t = 0; t < 2; ++t) EXPECT_EQ(c.Pull(t, 4), at4[t]) << "tensor " << t;
  EXPECT_TRUE(ckpt::RemoveTree(dir).ok());
}

}  // namespace
}  // namespace testing_ckpt
}  // namespace optimus
