// The harness itself: it really runs every part on the transport it was
// asked for and leaves nothing behind, jobs can follow one another on the
// same shards with fresh workers, shards can be added and killed, and bad
// use of it is an error rather than a crash.
#include "tests/harness/cluster.h"

#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace harness {
namespace {

// The comparison the integration tests use against ReferenceParams: any
// bit counts, so a sign flip of zero or a different NaN is a mismatch
// where operator== would say equal (or, for NaNs, never equal).
TEST(HarnessTest, BitMismatchesCountsEveryDifferingBit) {
  const float nan = std::nanf("");
  EXPECT_EQ(BitMismatches({1.0f, nan, 0.0f}, {1.0f, nan, 0.0f}), 0u);
  EXPECT_EQ(BitMismatches({0.0f, 1.0f}, {-0.0f, 1.0f}), 1u);
  EXPECT_EQ(BitMismatches({nan, 2.0f}, {-nan, 2.0f}), 1u);
  EXPECT_EQ(BitMismatches({1.0f, 2.0f, 3.0f}, {1.0f, std::nextafter(2.0f, 3.0f), 4.0f}), 2u);
  EXPECT_EQ(BitMismatches({1.0f}, {1.0f, 2.0f}), SIZE_MAX);
  EXPECT_EQ(BitMismatches({}, {}), 0u);
}

TEST(HarnessTest, LoopbackClusterRunsEveryPartOnItsFabricAndLeavesNothing) {
  std::shared_ptr<transport::LoopbackFabric> fabric;
  {
    ClusterOptions o;
    o.num_shards = 2;
    o.num_workers = 3;
    ASSERT_OK_AND_ASSIGN(auto c, Cluster::Start(o));
    fabric = c->fabric();
    ASSERT_NE(fabric, nullptr);
    EXPECT_EQ(fabric->num_workers(), 2u);  // The shards' data planes.
    EXPECT_EQ(c->ShardMemoryUsed(), (std::vector<uint64_t>{0, 0}));
    ASSERT_OK(c->CreateJob(SmallJob("all-loopback", 3)));
    EXPECT_EQ(fabric->num_workers(), 5u);  // And the three workers'.
    for (uint64_t used : c->ShardMemoryUsed()) EXPECT_GT(used, 0u);
    ASSERT_OK(c->Train(1, 2));
    ASSERT_OK_AND_ASSIGN(std::vector<float> got, c->PullFp32(0, 3, /*rank=*/2));
    ASSERT_OK_AND_ASSIGN(std::vector<float> want,
                         ReferenceParams(SmallJob("all-loopback", 3), 0, 2));
    EXPECT_EQ(BitMismatches(got, want), 0u);
  }
  // Every worker and shard was destroyed with the cluster.
  EXPECT_EQ(fabric->num_workers(), 0u);
}

TEST(HarnessTest, UcxClusterHasNoFabric) {
  ClusterOptions o;
  o.transport = TransportKind::kUcx;
  o.num_shards = 1;
  ASSERT_OK_AND_ASSIGN(auto c, Cluster::Start(o));
  EXPECT_EQ(c->fabric(), nullptr);
  EXPECT_EQ(c->TransportOptions("x").loopback, nullptr);
  EXPECT_EQ(c->TransportOptions("x").net_devices, "lo");
  ASSERT_OK(c->CreateJob(SmallJob("ucx", 2)));
  ASSERT_OK(c->Train(1, 1));
}

TEST(HarnessTest, JobsFollowOneAnotherOnTheSameShards) {
  ASSERT_OK_AND_ASSIGN(auto c, Cluster::Start(ClusterOptions()));
  ASSERT_OK(c->CreateJob(SmallJob("first", 2)));
  ASSERT_OK(c->Train(1, 3));
  const std::vector<uint64_t> after_first = c->ShardMemoryUsed();
  client::JobDef second = SmallJob("second", 2);
  second.optimizer.kind = client::Optimizer::kSgd;
  second.optimizer.momentum = 0.9f;
  ASSERT_OK(c->CreateJob(second));
  EXPECT_EQ(c->joined_job(), "second");
  ASSERT_OK(c->Train(1, 4));
  ASSERT_OK_AND_ASSIGN(std::vector<float> got, c->PullFp32(1, 5));
  ASSERT_OK_AND_ASSIGN(std::vector<float> want, ReferenceParams(second, 1, 4));
  EXPECT_EQ(BitMismatches(got, want), 0u);
  // Both jobs' state is held (nothing deletes the first here).
  uint64_t before = 0, now = 0;
  for (uint64_t b : after_first) before += b;
  for (uint64_t n : c->ShardMemoryUsed()) now += n;
  EXPECT_GT(now, before);
  ASSERT_OK_AND_ASSIGN(const v1::StatusResponse status, c->Status());
  EXPECT_EQ(status.jobs_size(), 2);
}

TEST(HarnessTest, AddedShardServesAndAKilledOneGoesDown) {
  ClusterOptions o;
  o.num_shards = 1;
  ASSERT_OK_AND_ASSIGN(auto c, Cluster::Start(o));
  ASSERT_OK_AND_ASSIGN(const size_t added, c->AddShard());
  EXPECT_EQ(added, 1u);
  EXPECT_EQ(c->num_shards(), 2u);
  const uint64_t killed_id = c->shard(0)->shard_id();
  ASSERT_OK(c->KillShard(0));
  ASSERT_OK(c->KillShard(0));  // Idempotent.
  EXPECT_EQ(c->KillShard(2).code(), absl::StatusCode::kOutOfRange);
  ASSERT_OK(c->WaitStatus("shard 0 DOWN", [killed_id](const v1::StatusResponse& st) {
    for (const auto& s : st.shards()) {
      if (s.shard_id() == killed_id) return s.state() == v1::SHARD_STATE_DOWN;
    }
    return false;
  }));
  EXPECT_EQ(c->ShardStats()[0].shard_id, killed_id);  // Still readable.
  // A job now lands on the added shard alone, and trains.
  ASSERT_OK(c->CreateJob(SmallJob("on-the-new-one", 2)));
  ASSERT_OK(c->Train(1, 2));
  EXPECT_EQ(c->ShardStats()[0].chunks_owned, 0u);
  EXPECT_GT(c->ShardStats()[1].chunks_owned, 0u);
}

TEST(HarnessTest, MisuseIsAnErrorNotACrash) {
  ClusterOptions bad;
  bad.num_workers = 0;
  EXPECT_EQ(Cluster::Start(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReferenceParams(SmallJob("j", 2), 7, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(auto c, Cluster::Start(ClusterOptions()));
  EXPECT_EQ(c->Train(1, 1).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c->Pull(0, 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c->LeaveJob().code(), absl::StatusCode::kFailedPrecondition);
  // World size must match the workers the cluster runs.
  EXPECT_EQ(c->CreateJob(SmallJob("w3", 3)).code(), absl::StatusCode::kInvalidArgument);
  ASSERT_OK(c->CreateJob(SmallJob("ok", 2)));
  EXPECT_EQ(c->Pull(9, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->Pull(0, 1, /*rank=*/5).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(c->RunWorker(5, 1, 1).code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace harness
}  // namespace optimus
