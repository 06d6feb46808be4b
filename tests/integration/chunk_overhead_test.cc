// What a chunk costs beyond its elements is in the plan and the shard's
// accounting: a job cut into one-element chunks cannot make a shard use
// many times its budget, and one too big for the shards' memory once the
// per-chunk cost is counted is refused up front. Loading a job of very many
// chunks does not hold up the shard's heartbeat: no shard misses its lease
// and a job already running keeps training meanwhile.
#include <atomic>
#include <cstdio>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace harness {
namespace {

client::JobDef TinyChunks(const std::string& name, int64_t elems, uint32_t world) {
  client::JobDef def;
  def.name = name;
  def.world_size = world;
  def.tensors = {{"w", {elems}}};
  def.optimizer.kind = client::Optimizer::kAdamW;
  def.optimizer.lr = 1e-3f;
  def.max_chunk_bytes = 4;  // One fp32 element per chunk.
  return def;
}

TEST(ChunkOverheadTest, OneElementChunksAreAccountedForWhatTheyCost) {
  ClusterOptions o;
  o.num_shards = 1;
  o.num_workers = 1;
  o.shard_memory_limit_bytes = uint64_t{512} << 20;
  ASSERT_OK_AND_ASSIGN(auto c, Cluster::Start(o));
  const uint64_t rss0 = ResidentBytes();
  const uint64_t used0 = c->ShardMemoryUsed()[0];
  constexpr int64_t kChunks = 20000;
  ASSERT_OK(c->CreateJob(TinyChunks("tiny", kChunks, 1)));
  const uint64_t rss = ResidentBytes() - rss0;
  const uint64_t used = c->ShardMemoryUsed()[0] - used0;
  std::printf("%lld one-element chunks: RSS +%llu bytes (%llu per chunk), memory_used +%llu "
              "(%llu per chunk)\n",
              static_cast<long long>(kChunks), static_cast<unsigned long long>(rss),
              static_cast<unsigned long long>(rss / kChunks), static_cast<unsigned long long>(used),
              static_cast<unsigned long long>(used / kChunks));
  // The process's growth also holds the coordinator's map and the client's
  // tables for these chunks: the shard's accounting must cover at least
  // most of it, not a tenth.
  EXPECT_GE(used * 2, rss) << "memory_used grew by " << used << ", RSS by " << rss;
}

TEST(ChunkOverheadTest, AJobOverBudgetOnceChunksAreCountedIsRefused) {
  ClusterOptions o;
  o.num_shards = 2;
  o.num_workers = 1;
  o.shard_memory_limit_bytes = uint64_t{64} << 20;
  ASSERT_OK_AND_ASSIGN(auto c, Cluster::Start(o));
  // 4 MB of state in elements, but a million chunks.
  absl::Status s = c->CreateJob(TinyChunks("too-many", 1 << 20, 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(c->ShardMemoryUsed()[0], 0u);
}

TEST(ChunkOverheadTest, LoadingManyChunksKeepsHeartbeatsAndOtherJobsGoing) {
  ClusterOptions o;
  o.num_shards = 2;
  o.num_workers = 1;
  o.shard_memory_limit_bytes = uint64_t{1} << 30;
  ASSERT_OK_AND_ASSIGN(auto c, Cluster::Start(o));
  ASSERT_OK(c->CreateJob(SmallJob("running", 1)));
  ASSERT_OK(c->Train(1, 2));
  // The big job, created from another client while "running" trains.
  auto creator = client::Client::Connect([&] {
    client::ClientOptions co;
    co.coordinator_address = c->coordinator_address();
    co.transport = c->TransportOptions("creator");
    co.ready_timeout = absl::Minutes(5);
    return co;
  }());
  ASSERT_OK(creator.status());
  std::atomic<bool> done{false};
  absl::Status big;
  std::thread t([&] {
    big = (*creator)->CreateJob(TinyChunks("many", 100000, 1));
    if (big.ok()) big = (*creator)->Join("many", 0, 1);
    done = true;
  });
  uint64_t step = 3;
  while (!done) {
    ASSERT_OK(c->Train(step, step));
    ++step;
  }
  t.join();
  ASSERT_OK(big);
  EXPECT_GT(step, 3u);
  ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, c->Status());
  for (const v1::ShardStatus& s : st.shards()) {
    EXPECT_EQ(s.state(), v1::SHARD_STATE_UP) << "shard " << s.shard_id();
  }
  for (const v1::JobStatus& j : st.jobs()) {
    EXPECT_EQ(j.state(), v1::JOB_STATE_READY) << j.name();
  }
}

}  // namespace
}  // namespace harness
}  // namespace optimus
