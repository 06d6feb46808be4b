// Checkpoints end to end with real servers (tests/harness): a checkpoint
// restored onto a different number of shards (and a different chunking)
// continues training bit for bit like an uninterrupted run (over loopback
// and over UCX); a policy keeps the last K; and persisting does not stall
// the workers (loopback).
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/checkpoint_files.h"
#include "gtest/gtest.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace {

using harness::Cluster;
using harness::TransportKind;

constexpr uint32_t kWorkers = 2;
constexpr uint64_t kSteps = 12;
constexpr uint64_t kCheckpointStep = 6;  // Version 6: steps 1..5 applied.

// S shards sharing the checkpoint folder `dir`.
harness::ClusterOptions Options(const std::string& dir, int shards,
                                TransportKind transport = TransportKind::kLoopback) {
  harness::ClusterOptions o;
  o.transport = transport;
  o.num_shards = shards;
  o.num_workers = kWorkers;
  o.checkpoint_dir = dir;
  return o;
}

class CheckpointRestoreTest : public ::testing::TestWithParam<TransportKind> {};

TEST_P(CheckpointRestoreTest, OntoThreeShardsContinuesBitwiseLikeAnUninterruptedRun) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, harness::NewTempDir("ckpt"));
  std::vector<std::vector<uint8_t>> uninterrupted;
  uint64_t checkpoint_id = 0;
  {
    ASSERT_OK_AND_ASSIGN(auto a, Cluster::Start(Options(dir, /*shards=*/2, GetParam())));
    ASSERT_OK(a->CreateJob(harness::SmallJob("rt", kWorkers)));
    EXPECT_EQ(a->worker(0)->resume_step(), 1u);
    ASSERT_OK(a->Train(1, kCheckpointStep - 1));
    ASSERT_OK(a->WaitApplied("rt", kCheckpointStep - 1));
    ASSERT_OK_AND_ASSIGN(v1::CheckpointInfo info, a->CreateCheckpoint("rt"));
    EXPECT_EQ(info.state(), v1::CHECKPOINT_STATE_IN_PROGRESS);
    ASSERT_OK_AND_ASSIGN(v1::CheckpointInfo done, a->WaitCheckpoint("rt", info.checkpoint_id()));
    ASSERT_EQ(done.state(), v1::CHECKPOINT_STATE_COMPLETE) << done.error();
    EXPECT_EQ(done.step(), kCheckpointStep);
    EXPECT_GT(done.size_bytes(), (200 * 257 + 37) * 12u);
    checkpoint_id = done.checkpoint_id();
    // Status shows the job's last checkpoint.
    bool seen = false;
    ASSERT_OK_AND_ASSIGN(const v1::StatusResponse status, a->Status());
    for (const auto& j : status.jobs()) {
      if (j.name() != "rt") continue;
      seen = true;
      EXPECT_EQ(j.last_checkpoint().checkpoint_id(), checkpoint_id);
      EXPECT_EQ(j.last_checkpoint().state(), v1::CHECKPOINT_STATE_COMPLETE);
      EXPECT_EQ(j.last_checkpoint().step(), kCheckpointStep);
    }
    EXPECT_TRUE(seen);
    // The same cluster trains on, uninterrupted.
    ASSERT_OK(a->Train(kCheckpointStep, kSteps));
    for (uint32_t t = 0; t < 2; ++t) {
      ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> got, a->Pull(t, kSteps + 1));
      uninterrupted.push_back(std::move(got));
    }
  }
  // A new coordinator and three shards over the same folder: restore with
  // 16 KiB chunks instead of 64 KiB, so no chunk matches a file.
  ASSERT_OK_AND_ASSIGN(auto b, Cluster::Start(Options(dir, /*shards=*/3, GetParam())));
  ASSERT_OK_AND_ASSIGN(auto restored, b->RestoreCheckpoint("rt", checkpoint_id, "", 16 * 1024));
  EXPECT_EQ(restored.resume_step(), kCheckpointStep);
  ASSERT_OK(b->JoinJob("rt"));
  EXPECT_EQ(b->worker(0)->resume_step(), kCheckpointStep);
  EXPECT_GT(b->worker(0)->tensors()[0].num_chunks, 4u);
  // Only the checkpoint's version is held; older ones are refused.
  EXPECT_EQ(b->Pull(1, kCheckpointStep - 1).status().code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_OK(b->Train(kCheckpointStep, kSteps));
  for (uint32_t t = 0; t < 2; ++t) {
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> got, b->Pull(t, kSteps + 1));
    ASSERT_EQ(got.size(), uninterrupted[t].size());
    size_t mismatches = 0;
    for (size_t i = 0; i < got.size(); ++i) mismatches += got[i] != uninterrupted[t][i];
    EXPECT_EQ(mismatches, 0u) << "tensor " << t;
  }
  // A name in use by a running job is refused, and changes nothing.
  auto again = b->RestoreCheckpoint("rt", checkpoint_id, "");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists) << again.status();
  ASSERT_OK_AND_ASSIGN(const v1::StatusResponse status, b->Status());
  EXPECT_EQ(status.jobs_size(), 1);
  EXPECT_EQ(b->RestoreCheckpoint("nope", 0, "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(ckpt::RemoveTree(dir).ok());
}

INSTANTIATE_TEST_SUITE_P(Transports, CheckpointRestoreTest,
                         ::testing::Values(TransportKind::kLoopback, TransportKind::kUcx),
                         [](const ::testing::TestParamInfo<TransportKind>& info) {
                           return harness::TransportName(info.param);
                         });

TEST(CheckpointTest, PolicyEveryTwoStepsKeepsTheLastTwo) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, harness::NewTempDir("ckpt"));
  ASSERT_OK_AND_ASSIGN(auto c, Cluster::Start(Options(dir, 2)));
  client::JobDef def = harness::SmallJob("policy", kWorkers);
  def.checkpoint.every_steps = 2;
  def.checkpoint.keep_last = 2;
  ASSERT_OK(c->CreateJob(def));
  uint64_t completed = 0;
  for (uint64_t step = 1; step <= 8; step += 2) {
    ASSERT_OK(c->Train(step, step + 1));
    // Every chunk took version step + 1 (a boundary of the policy) as it
    // published it; wait for the coordinator to complete that checkpoint.
    ASSERT_OK(c->WaitUntil(absl::StrCat("a checkpoint at step ", step + 1), [&] {
      auto list = c->ListCheckpoints("policy");
      bool done = false;
      for (const auto& ck : list.ok() ? *list : std::vector<v1::CheckpointInfo>()) {
        done |= ck.state() == v1::CHECKPOINT_STATE_COMPLETE && ck.step() == step + 1 &&
                ck.checkpoint_id() == step + 1;
      }
      return done;
    }));
    ++completed;
  }
  EXPECT_EQ(completed, 4u);
  ASSERT_OK_AND_ASSIGN(std::vector<v1::CheckpointInfo> list, c->ListCheckpoints("policy"));
  std::vector<uint64_t> steps;
  for (const auto& ck : list) {
    if (ck.state() == v1::CHECKPOINT_STATE_COMPLETE) steps.push_back(ck.step());
  }
  EXPECT_EQ(steps, (std::vector<uint64_t>{6, 8}));
  // On disk: exactly two checkpoint folders, each with its manifest.
  std::vector<std::string> folders = ckpt::ListDir(dir + "/policy");
  EXPECT_EQ(folders.size(), 2u);
  for (const auto& f : folders) EXPECT_TRUE(ckpt::ReadManifest(dir + "/policy/" + f).ok()) << f;
  EXPECT_TRUE(ckpt::RemoveTree(dir).ok());
}

TEST(CheckpointTest, WorkersDoNotWaitForTheDisk) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, harness::NewTempDir("ckpt"));
  // The writer is held to 32 KiB/s: each shard's 220-400 KB take 7 s or more,
  // while 10 steps take well under a second (5 s allowed on a busy machine).
  harness::ClusterOptions o = Options(dir, 2);
  o.checkpoint_max_bytes_per_second = 32 << 10;
  ASSERT_OK_AND_ASSIGN(auto c, Cluster::Start(o));
  ASSERT_OK(c->CreateJob(harness::SmallJob("nostall", kWorkers)));
  ASSERT_OK(c->Train(1, 3));
  ASSERT_OK(c->WaitApplied("nostall", 3));
  std::vector<std::vector<uint8_t>> at4;
  for (uint32_t t = 0; t < 2; ++t) {
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> got, c->Pull(t, 4));
    at4.push_back(std::move(got));
  }
  ASSERT_OK_AND_ASSIGN(v1::CheckpointInfo info, c->CreateCheckpoint("nostall"));
  EXPECT_EQ(info.step(), 4u);
  // Orders travel with heartbeats (every 50 ms here): give the shards time
  // to take their snapshot of version 4 before training moves past it.
  absl::SleepFor(absl::Milliseconds(400));
  // Training goes on at full speed while the files are being written...
  const absl::Time start = absl::Now();
  ASSERT_OK(c->Train(4, 13));
  const absl::Duration took = absl::Now() - start;
  ASSERT_OK_AND_ASSIGN(std::vector<v1::CheckpointInfo> list, c->ListCheckpoints("nostall"));
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].state(), v1::CHECKPOINT_STATE_IN_PROGRESS)
      << "10 steps took " << absl::FormatDuration(took);
  EXPECT_LT(took, absl::Seconds(5));
  // ...and the checkpoint, once complete, holds version 4, not a later one.
  ASSERT_OK_AND_ASSIGN(v1::CheckpointInfo done, c->WaitCheckpoint("nostall", info.checkpoint_id()));
  ASSERT_EQ(done.state(), v1::CHECKPOINT_STATE_COMPLETE) << done.error();
  EXPECT_EQ(done.checkpoint_id(), info.checkpoint_id());
  EXPECT_EQ(done.step(), 4u);
  ASSERT_OK(c->RestoreCheckpoint("nostall", 0, "nostall-copy").status());
  ASSERT_OK(c->JoinJob("nostall-copy"));
  for (uint32_t t = 0; t < 2; ++t) {
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> got, c->Pull(t, 4));
    EXPECT_EQ(got, at4[t]) << "tensor " << t;
  }
  EXPECT_TRUE(ckpt::RemoveTree(dir).ok());
}

}  // namespace
}  // namespace optimus
