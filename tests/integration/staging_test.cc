// End-to-end: shards whose staging pool (gradients in flight) holds about
// one chunk step, so that most pushes wait at their worker for room and most
// sums are folded as pushes land, train to exactly the single-process
// reference, over loopback and over UCX; with the commit round and without,
// with folding (W = 4) and with two slots (W = 2); and a pool with room for
// two chunk steps' W slots at W = 8, where steps wait for W slots instead
// of folding. Nothing is lost, nothing deadlocks, and the shards' memory
// stays within the plan plus the pool.
#include <memory>
#include <string>
#include <vector>

#include "client/client.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace {

using client::JobDef;
using harness::Cluster;
using harness::TransportKind;

constexpr uint64_t kChunkElems = 16384;  // max_chunk_bytes 64 KiB.

struct Case {
  TransportKind transport;
  uint32_t workers;
  bool commit_round;
  // Room for two chunk steps' W slots (and the reserve) instead of one
  // chunk step's fold.
  bool slots_pool = false;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  return std::string(harness::TransportName(info.param.transport)) + "_W" +
         std::to_string(info.param.workers) + (info.param.commit_round ? "_round" : "_noround") +
         (info.param.slots_pool ? "_slotspool" : "");
}

class StagingTest : public ::testing::TestWithParam<Case> {};

TEST_P(StagingTest, ATinyPoolMakesPushesWaitAndTrainsExactlyTheReference) {
  const Case c = GetParam();
  harness::ClusterOptions o;
  o.transport = c.transport;
  o.num_shards = 2;
  o.num_workers = c.workers;
  o.step_threads = 2;
  // Room for one chunk step: its fp32 sum and one landing (fold), or its
  // two slots, plus a little.
  const uint64_t one_step = kChunkElems * (c.workers > 2 ? 4 + 2 : 2 * 2);
  o.staging_bytes = one_step + kChunkElems;
  if (c.slots_pool) o.staging_bytes = 2 * kChunkElems * 2 * c.workers + kChunkElems * 2;
  o.wait = absl::Seconds(60);
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::Start(o));
  ASSERT_OK(cluster->ConnectWorkers());
  JobDef def = harness::SmallJob("tiny-pool", c.workers, kChunkElems * 4);
  def.tensors = {{"weight", {300, 257}}, {"bias", {37}}};  // 6 chunks.
  def.skip_nonfinite = c.commit_round;
  ASSERT_OK(cluster->CreateJob(def));
  ASSERT_OK(cluster->Train(1, 8));
  for (uint32_t t = 0; t < 2; ++t) {
    ASSERT_OK_AND_ASSIGN(std::vector<float> got, cluster->PullFp32(t, 9, 0));
    ASSERT_OK_AND_ASSIGN(std::vector<float> want, harness::ReferenceParams(def, t, 8));
    EXPECT_EQ(harness::BitMismatches(got, want), 0u) << "tensor " << t << ": the folded sums must be the fused sums";
  }
  uint64_t waits = 0;
  for (const auto& s : cluster->ShardStats()) {
    waits += s.staging_waits;
    EXPECT_LE(s.staging_in_use_bytes, o.staging_bytes);
    EXPECT_EQ(s.staging_in_use_bytes, 0u) << "a finished step gives its buffers back";
  }
  // 6 chunks x W pushes per step against room for one chunk step: most
  // pushes found the pool full and waited at their worker (with the round
  // and W = 2 the chunks hold their own two slots: the pool is not used).
  if (!c.commit_round || c.workers > 2) {
    EXPECT_GT(waits, 0u);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Pools, StagingTest,
    ::testing::Values(Case{TransportKind::kLoopback, 4, false},
                      Case{TransportKind::kLoopback, 4, true},
                      Case{TransportKind::kLoopback, 2, false},
                      Case{TransportKind::kUcx, 4, false}, Case{TransportKind::kUcx, 2, true},
                      Case{TransportKind::kUcx, 8, false}, Case{TransportKind::kLoopback, 8, false},
                      Case{TransportKind::kLoopback, 8, false, true},
                      Case{TransportKind::kUcx, 8, false, true}),
    CaseName);

}  // namespace
}  // namespace optimus
