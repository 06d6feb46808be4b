// The staging pool and a chunk's gradients in flight: pushes landing in and
// out of rank order, W slots whenever the pool could hold them (waiting for
// them rather than folding), folds in rank order, waits for room that end when a
// fold or a step frees it, a bounded pool that never deadlocks, the step's
// inputs equal to the fused sum over all slots, and everything given back.
#include "server/staging.h"

#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/cpu/optimizer.h"

namespace optimus {
namespace server {
namespace {

// Runs the pool's wake-ups when the test says so (no threads).
struct Later {
  std::vector<std::function<void()>> queue;
  StagingPool::RunLater fn() {
    return [this](std::function<void()> f) { queue.push_back(std::move(f)); };
  }
  void RunAll() {
    while (!queue.empty()) {
      auto q = std::move(queue);
      queue.clear();
      for (auto& f : q) f();
    }
  }
};

std::vector<uint16_t> Grad(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, 3.0f);
  std::vector<uint16_t> g(n);
  for (auto& x : g) x = FloatToBf16(d(rng));
  return g;
}

constexpr size_t kN = 5000;

struct Fixture {
  Later later;
  std::shared_ptr<MemoryAccount> account = std::make_shared<MemoryAccount>(1 << 30);
  std::shared_ptr<StagingPool> pool;
  explicit Fixture(uint64_t limit) { pool = StagingPool::Create(limit, account, {}, later.fn()); }
  std::shared_ptr<ChunkStaging> Chunk(uint32_t w, bool permanent = false) {
    auto s = ChunkStaging::Create(w, DType::kBf16, kN, permanent, pool, account, {}, "test chunk");
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? *s : nullptr;
  }
};

// Lands rank r's gradient of `step` into `place` and reports it.
bool Put(ChunkStaging& s, uint64_t step, uint32_t r, ChunkStaging::Landing place,
         const std::vector<uint16_t>& g) {
  std::memcpy(place.dst, g.data(), g.size() * 2);
  return s.Landed(step, r, true);
}

// The fused step over all W slots against the step from the staged inputs.
void ExpectSameStep(const std::vector<std::vector<uint16_t>>& grads,
                    const ChunkStaging::Inputs& in) {
  std::vector<const void*> slots;
  for (const auto& g : grads) slots.push_back(g.data());
  kernels::OptimizerHyper hyper;
  hyper.kind = kernels::OptimizerKind::kAdamW;
  hyper.lr = 1e-2f;
  auto run = [&](absl::Span<const void* const> gs, DType dt, std::vector<float>* master) {
    master->assign(kN, 1.0f);
    std::vector<float> m(kN), v(kN);
    kernels::StepInputs si;
    si.grads = gs;
    si.grad_dtype = dt;
    si.grad_scale = 1.0f / grads.size();
    ASSERT_TRUE(kernels::FusedStep(hyper, si, kN, {master->data(), m.data(), v.data()}, nullptr,
                                   DType::kFp32)
                    .ok());
  };
  std::vector<float> want, got;
  run(absl::MakeConstSpan(slots), DType::kBf16, &want);
  run(absl::MakeConstSpan(in.grads), in.dtype, &got);
  EXPECT_EQ(std::memcmp(want.data(), got.data(), kN * 4), 0);
}

TEST(StagingTest, FoldsOutOfOrderArrivalsInRankOrder) {
  Fixture f(uint64_t{1} << 30);
  // A job with the commit round: its sum is its own and its steps always
  // fold (a pool that holds W slots would hold them instead; see below).
  auto s = f.Chunk(4, /*permanent=*/true);
  ASSERT_TRUE(s->folds());
  std::vector<std::vector<uint16_t>> g;
  for (uint32_t r = 0; r < 4; ++r) g.push_back(Grad(kN, r + 1));
  const uint64_t step = 7;
  // Ranks 2 and 3 first: nothing to fold until rank 0 is in.
  EXPECT_FALSE(Put(*s, step, 2, s->Land(step, 2), g[2]));
  EXPECT_FALSE(Put(*s, step, 3, s->Land(step, 3), g[3]));
  // Nobody waits for room: landing asks for no fold (the step folds all
  // the slots in one pass); a fold can still be run.
  EXPECT_FALSE(Put(*s, step, 0, s->Land(step, 0), g[0]));
  s->Fold(nullptr);  // Folds rank 0 only (rank 1 is missing).
  const uint64_t before_last = f.pool->in_use();
  // The last push: the step folds 1, 2, 3 itself.
  EXPECT_FALSE(Put(*s, step, 1, s->Land(step, 1), g[1]));
  ChunkStaging::Inputs in = s->Use(step, {0, 1, 2, 3}, nullptr);
  ASSERT_TRUE(in.status.ok()) << in.status;
  ASSERT_EQ(in.grads.size(), 1u);
  EXPECT_EQ(in.dtype, DType::kFp32);
  ExpectSameStep(g, in);
  EXPECT_LT(f.pool->in_use(), before_last + kN * 2);  // Landings freed by the fold.
  s->StepDone(step);
  EXPECT_EQ(f.pool->in_use(), 0u);
}

TEST(StagingTest, TwoSlotsNeedNoFoldAndStepAsTheFusedSum) {
  Fixture f(uint64_t{1} << 30);
  auto s = f.Chunk(2);
  ASSERT_FALSE(s->folds());
  std::vector<std::vector<uint16_t>> g = {Grad(kN, 1), Grad(kN, 2)};
  EXPECT_FALSE(Put(*s, 1, 1, s->Land(1, 1), g[1]));
  EXPECT_FALSE(Put(*s, 1, 0, s->Land(1, 0), g[0]));
  ChunkStaging::Inputs in = s->Use(1, {0, 1}, nullptr);
  ASSERT_EQ(in.grads.size(), 2u);
  EXPECT_EQ(in.dtype, DType::kBf16);
  ExpectSameStep(g, in);
  EXPECT_EQ(f.pool->in_use(), kN * 4);
  s->StepDone(1);
  EXPECT_EQ(f.pool->in_use(), 0u);
}

// W = 4 would fold, but the pool holds the W slots (and its reserve): the
// step reads the pushes where they landed, in any order, with no fold pass
// and no fp32 sum taken.
TEST(StagingTest, WhenThePoolHoldsWSlotsAStepReadsThemWithoutAFold) {
  const uint64_t landing = kN * 2;
  Fixture f(4 * landing + landing);  // W slots + the reserve, exactly.
  auto s = f.Chunk(4);
  ASSERT_TRUE(s->folds());
  std::vector<std::vector<uint16_t>> g;
  for (uint32_t r = 0; r < 4; ++r) g.push_back(Grad(kN, 20 + r));
  const uint64_t step = 2;
  for (uint32_t r : {3u, 1u, 0u, 2u}) {
    ChunkStaging::Landing l = s->Land(step, r);
    ASSERT_NE(l.dst, nullptr) << "rank " << r;
    EXPECT_FALSE(Put(*s, step, r, l, g[r])) << "rank " << r << " asked for a fold";
  }
  EXPECT_EQ(f.pool->in_use(), 4 * landing);  // The slots; no sum.
  ChunkStaging::Inputs in = s->Use(step, {0, 1, 2, 3}, nullptr);
  ASSERT_TRUE(in.status.ok()) << in.status;
  ASSERT_EQ(in.grads.size(), 4u);
  EXPECT_EQ(in.dtype, DType::kBf16);
  ExpectSameStep(g, in);
  s->StepDone(step);
  EXPECT_EQ(f.pool->in_use(), 0u);
  EXPECT_EQ(f.pool->waits(), 0u);
}

// Room for one chunk's W slots and a sum besides: a second chunk's pushes
// wait for the first chunk's step to give its slots back instead of taking
// the sum and folding, then land in W slots of their own.
TEST(StagingTest, WhileWSlotsCouldFitAStepWaitsForThemInsteadOfFolding) {
  const uint64_t landing = kN * 2, sum = kN * 4;
  Fixture f(4 * landing + landing + sum);
  auto a = f.Chunk(4);
  auto b = f.Chunk(4);
  std::vector<std::vector<uint16_t>> g;
  for (uint32_t r = 0; r < 4; ++r) g.push_back(Grad(kN, 30 + r));
  std::vector<ChunkStaging::Landing> a_at;
  for (uint32_t r = 0; r < 4; ++r) {
    a_at.push_back(a->Land(1, r));
    ASSERT_NE(a_at.back().dst, nullptr);
  }
  int b_landed = 0;
  bool b_fold = false;
  for (uint32_t r = 0; r < 4; ++r) {
    ASSERT_EQ(b->Land(1, r).dst, nullptr) << "rank " << r << " of the second chunk took a sum";
    b->Wait(1, r, [&, r](ChunkStaging::Landing l) {
      ASSERT_NE(l.dst, nullptr);
      b_fold |= Put(*b, 1, r, l, g[r]);
      ++b_landed;
    });
  }
  f.later.RunAll();
  EXPECT_EQ(b_landed, 0);
  for (uint32_t r = 0; r < 4; ++r) EXPECT_FALSE(Put(*a, 1, r, a_at[r], g[r]));
  ASSERT_EQ(a->Use(1, {0, 1, 2, 3}, nullptr).grads.size(), 4u);
  a->StepDone(1);
  f.later.RunAll();
  ASSERT_EQ(b_landed, 4);
  EXPECT_FALSE(b_fold);
  EXPECT_EQ(f.pool->in_use(), 4 * landing);
  ChunkStaging::Inputs in = b->Use(1, {0, 1, 2, 3}, nullptr);
  ASSERT_TRUE(in.status.ok()) << in.status;
  ASSERT_EQ(in.grads.size(), 4u);
  EXPECT_EQ(in.dtype, DType::kBf16);
  ExpectSameStep(g, in);
  b->StepDone(1);
  EXPECT_EQ(f.pool->in_use(), 0u);
}

// A pool with room for one sum and one landing: out-of-order pushes wait,
// the in-order one lands, its fold frees room, and the waiters follow, so
// every push lands and the result is still the fused sum.
TEST(StagingTest, ABoundedPoolMakesPushesWaitAndNeverDeadlocks) {
  const uint64_t sum = kN * 4, landing = kN * 2;
  Fixture f(sum + landing);
  auto s = f.Chunk(4);
  std::vector<std::vector<uint16_t>> g;
  for (uint32_t r = 0; r < 4; ++r) g.push_back(Grad(kN, 10 + r));
  const uint64_t step = 3;
  int landed = 0;
  bool fold = false;
  auto go = [&](uint32_t r) {
    return [&, r](ChunkStaging::Landing l) {
      ASSERT_NE(l.dst, nullptr);
      fold |= Put(*s, step, r, l, g[r]);
      ++landed;
    };
  };
  // Ranks 3, 2, 1 arrive first: out of order, no room beyond the reserve.
  for (uint32_t r : {3u, 2u, 1u}) {
    ChunkStaging::Landing l = s->Land(step, r);
    EXPECT_EQ(l.dst, nullptr) << "rank " << r << " landed out of order into the reserve";
    s->Wait(step, r, go(r));
  }
  EXPECT_EQ(landed, 0);
  ChunkStaging::Landing l0 = s->Land(step, 0);
  if (l0.dst == nullptr) {
    s->Wait(step, 0, go(0));  // Others wait already: rank 0 gets the reserve first.
  } else {
    fold |= Put(*s, step, 0, l0, g[0]);
    ++landed;
  }
  // Drive folds and wake-ups until everything is in.
  for (int round = 0; round < 20 && landed < 4; ++round) {
    if (fold) {
      fold = false;
      s->Fold(nullptr);
    }
    f.later.RunAll();
  }
  ASSERT_EQ(landed, 4);
  EXPECT_LE(f.pool->held(), sum + landing);
  EXPECT_GT(f.pool->waits(), 0u);
  ChunkStaging::Inputs in = s->Use(step, {0, 1, 2, 3}, nullptr);
  ASSERT_TRUE(in.status.ok()) << in.status;
  EXPECT_EQ(in.dtype, DType::kFp32);  // W slots never fit: folded.
  ExpectSameStep(g, in);
  s->StepDone(step);
  EXPECT_EQ(f.pool->in_use(), 0u);
}

// Two chunks and room for one step: the second chunk's pushes wait for the
// first chunk's step to give its slots back, and the thread that finished
// the step lets them in (no wake-up queued behind other steps).
TEST(StagingTest, AChunkWaitsForAnotherChunksStepToFinish) {
  Fixture f(kN * 4);
  auto a = f.Chunk(2);
  auto b = f.Chunk(2);
  std::vector<uint16_t> g = Grad(kN, 5);
  EXPECT_NE(a->Land(1, 0).dst, nullptr);
  EXPECT_EQ(b->Land(1, 0).dst, nullptr);
  bool b_landed = false;
  b->Wait(1, 0, [&](ChunkStaging::Landing l) { b_landed = l.dst != nullptr; });
  a->Landed(1, 0, true);
  Put(*a, 1, 1, a->Land(1, 1), g);
  a->Use(1, {0, 1}, nullptr);
  f.later.RunAll();
  EXPECT_FALSE(b_landed);
  a->StepDone(1);
  EXPECT_TRUE(b_landed);
}

TEST(StagingTest, AbandonDropsWaitersAndGivesEverythingBack) {
  Fixture f(kN * 4 + kN * 2);
  auto s = f.Chunk(4);
  ASSERT_NE(s->Land(1, 0).dst, nullptr);  // Sum + the reserve taken.
  bool called = false;
  EXPECT_EQ(s->Land(1, 2).dst, nullptr);
  s->Wait(1, 2, [&](ChunkStaging::Landing) { called = true; });
  s->Abandon();
  f.later.RunAll();
  EXPECT_FALSE(called);
  EXPECT_EQ(f.pool->in_use(), 0u);
  EXPECT_EQ(s->Land(1, 1).dst, nullptr);  // Refuses everything after.
}

TEST(StagingTest, AChunkLargerThanThePoolIsRefusedWithWhatToRaise) {
  Fixture f(kN * 4);  // A sum fits, not a sum and a landing.
  auto s = ChunkStaging::Create(4, DType::kBf16, kN, false, f.pool, f.account, {}, "tensor 3");
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(s.status().message()).find("--staging_mb"), std::string::npos);
  EXPECT_NE(std::string(s.status().message()).find("tensor 3"), std::string::npos);
  // A job that holds its gradients for the commit only lands pushes here.
  auto held = ChunkStaging::Create(4, DType::kBf16, kN, true, f.pool, f.account, {}, "held");
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(f.account->used(), kN * 4);  // Its sum, with the chunk.
}

}  // namespace
}  // namespace server
}  // namespace optimus
