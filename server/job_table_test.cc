#include "server/job_table.h"

#include <memory>
#include <string>

#include "common/huge_pages.h"
#include "gtest/gtest.h"

namespace optimus {
namespace server {
namespace {

JobConfig Config(uint32_t world_size, kernels::OptimizerKind kind, uint32_t replication = 0) {
  JobConfig c;
  c.job_id = 3;
  c.world_size = world_size;
  c.replication = replication;
  c.grad_dtype = DType::kBf16;
  c.param_dtype = DType::kBf16;
  c.hyper.kind = kind;
  return c;
}

ChunkPlacement Placement(uint64_t num_elems) {
  ChunkPlacement p;
  p.tensor = 1;
  p.chunk = 2;
  p.num_elems = num_elems;
  p.primary = 1;
  return p;
}

TEST(MemoryAccountTest, RefusesWhatDoesNotFitWithTheNumbers) {
  MemoryAccount a(1000);
  ASSERT_TRUE(a.Reserve(600, "first").ok());
  absl::Status s = a.Reserve(500, "tensor 1 chunk 2");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(s.message()).find("tensor 1 chunk 2 needs 500 bytes"), std::string::npos)
      << s;
  EXPECT_NE(std::string(s.message()).find("400 of 1000 free"), std::string::npos) << s;
  EXPECT_EQ(a.used(), 600u);  // A refusal reserves nothing.
  a.Release(600);
  EXPECT_TRUE(a.Reserve(1000, "all").ok());
}

// A shard's large buffers are advised for transparent huge pages when its
// account says so: on 4 KiB pages every shared-memory transfer walks and
// pins each page (docs/benchmarks.md, "Huge pages").
TEST(BufferTest, LargeBuffersAreHugePageEligibleWhenTheAccountAsks) {
  const std::string mode = TransparentHugePageMode();
  if (mode != "madvise" && mode != "always") {
    GTEST_SKIP() << "transparent huge pages are '" << mode << "' here";
  }
  auto asks = std::make_shared<MemoryAccount>(1 << 30, /*huge_pages=*/true);
  auto declines = std::make_shared<MemoryAccount>(1 << 30, /*huge_pages=*/false);
  const size_t large = (size_t{4} << 20) + 64;
  auto a = Buffer::Allocate(large, asks, {}, "test");
  auto d = Buffer::Allocate(large, declines, {}, "test");
  auto small = Buffer::Allocate(size_t{1} << 20, asks, {}, "test");
  ASSERT_TRUE(a.ok() && d.ok() && small.ok());
  EXPECT_EQ(reinterpret_cast<uintptr_t>((*a)->data()) % kHugePageBytes, 0u);
  EXPECT_TRUE(HugePageEligible((*a)->data()));
  EXPECT_EQ((*a)->data()[large - 1], 0);  // Zeroed, to the last byte.
  if (mode == "madvise") {
    EXPECT_FALSE(HugePageEligible((*d)->data()));
  }
  EXPECT_EQ(asks->used(), large + (size_t{1} << 20));
  a->reset();
  small->reset();
  EXPECT_EQ(asks->used(), 0u);
}

// The shard allocates exactly what the coordinator plans per element: the
// gradients too when the job's steps wait for a commit, else nothing for
// them until a push lands (the staging pool).
TEST(ChunkTest, CostsWhatShardBytesPerElemSays) {
  for (auto kind : {kernels::OptimizerKind::kAdamW, kernels::OptimizerKind::kSgd,
                    kernels::OptimizerKind::kLion}) {
    for (uint32_t replication : {0u, 1u}) {
      for (bool round : {false, true}) {
        for (uint32_t w : {1u, 2u, 4u}) {
          auto account = std::make_shared<MemoryAccount>(1 << 30);
          JobConfig c = Config(w, kind, replication);
          c.commit_round = round;
          auto chunk = Chunk::Create(c, Placement(1000), Role::kPrimary, replication > 0,
                                     account, {}, nullptr);
          ASSERT_TRUE(chunk.ok()) << chunk.status();
          EXPECT_EQ(account->used(),
                    kernels::ShardChunkBytes(
                        1000, kernels::ShardBytesPerElem(kind, w, DType::kBf16, DType::kBf16,
                                                         replication > 0, round),
                        w))
              << kernels::OptimizerName(kind) << " replication " << replication << " round "
              << round << " W " << w;
          EXPECT_EQ((*chunk)->state_arrays().size(), kernels::LayoutOf(kind).num_arrays);
          chunk->reset();
          EXPECT_EQ(account->used(), 0u);
        }
      }
    }
  }
}

TEST(ChunkTest, DoesNotFitAndLeavesNothingAllocated) {
  const JobConfig c = Config(2, kernels::OptimizerKind::kAdamW);
  auto account = std::make_shared<MemoryAccount>(1000 * 12);  // Room for master/m/v only.
  auto chunk = Chunk::Create(c, Placement(1000), Role::kPrimary, false, account, {}, nullptr);
  EXPECT_EQ(chunk.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(account->used(), 0u);
}

TEST(ChunkTest, MemoryIsFreedWhenTheLastHolderLetsGo) {
  auto account = std::make_shared<MemoryAccount>(1 << 30);
  JobTable table(1 << 30);
  auto job = std::make_shared<Job>(Config(2, kernels::OptimizerKind::kAdamW));
  auto chunk = Chunk::Create(job->config, Placement(100), Role::kPrimary, false, account, {}, nullptr);
  ASSERT_TRUE(chunk.ok());
  {
    absl::MutexLock lock(&job->mu);
    job->chunks[ChunkKey(1, 2)] = *chunk;
    job->primary_of[ChunkKey(1, 2)] = 1;
  }
  ASSERT_TRUE(table.Insert(job));
  EXPECT_FALSE(table.Insert(std::make_shared<Job>(job->config))) << "the id is taken";
  const uint64_t used = account->used();
  EXPECT_GT(used, 0u);
  // A pull reply still being sent holds the chunk.
  std::shared_ptr<Chunk> in_flight = *chunk;
  chunk->reset();
  std::shared_ptr<Job> removed = table.Remove(3);
  ASSERT_NE(removed, nullptr);
  EXPECT_EQ(table.Find(3), nullptr);
  removed.reset();
  job.reset();
  EXPECT_EQ(account->used(), used);
  in_flight.reset();
  EXPECT_EQ(account->used(), 0u);
}

TEST(ChunkTest, SumBufferIsAddedOnceAndAccounted) {
  auto account = std::make_shared<MemoryAccount>(1 << 30);
  const JobConfig c = Config(1, kernels::OptimizerKind::kSgd);
  auto chunk = Chunk::Create(c, Placement(64), Role::kPrimary, false, account, {}, nullptr);
  ASSERT_TRUE(chunk.ok());
  EXPECT_EQ((*chunk)->sum(), nullptr);
  const uint64_t before = account->used();
  ASSERT_TRUE((*chunk)->AddSumBuffer(account, {}).ok());
  ASSERT_TRUE((*chunk)->AddSumBuffer(account, {}).ok());
  EXPECT_NE((*chunk)->sum(), nullptr);
  EXPECT_EQ(account->used(), before + 64 * 4);
}

TEST(JobTest, KnowsEveryChunksPrimaryFromItsMap) {
  Job job(Config(1, kernels::OptimizerKind::kAdamW));
  {
    absl::MutexLock lock(&job.mu);
    job.primary_of[ChunkKey(0, 0)] = 4;
    job.map_epoch = 7;
  }
  EXPECT_EQ(job.PrimaryOf(0, 0), 4u);
  EXPECT_EQ(job.PrimaryOf(0, 1), 0u);
  EXPECT_EQ(job.epoch(), 7u);
  EXPECT_EQ(job.Find(0, 0), nullptr);
}

}  // namespace
}  // namespace server
}  // namespace optimus
