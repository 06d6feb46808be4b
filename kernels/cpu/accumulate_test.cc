// AccumulateGrads, the shard's fold of gradient slots into an fp32 running
// sum as pushes land: folding the W slots in any number of rank-ordered
// pieces and then stepping from the sum (one fp32 slot) must give exactly
// the bits of FusedStep over the W slots (the state, the published copy and
// the clipping round's sum of squares), for every dtype, thread count and
// non-finite input; the replicas and the torch comparisons depend on it.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/passes.h"
#include "kernels/cpu/thread_pool.h"

namespace optimus {
namespace kernels {
namespace {

std::vector<uint8_t> RandomSlot(DType dtype, size_t n, std::mt19937* rng, bool specials) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 30);
  std::vector<uint8_t> out(n * DTypeSize(dtype));
  for (size_t i = 0; i < n; ++i) {
    // Wide magnitudes make the order of the adds visible in the bits.
    float f = std::ldexp(normal(*rng), exponent(*rng) / 3);
    if (specials && i % 997 == 5) f = std::numeric_limits<float>::infinity();
    if (specials && i % 1009 == 7) f = std::numeric_limits<float>::quiet_NaN();
    if (dtype == DType::kFp32) {
      std::memcpy(out.data() + 4 * i, &f, 4);
    } else {
      const uint16_t h = dtype == DType::kBf16 ? FloatToBf16(f) : FloatToFp16(f);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

struct State {
  std::vector<float> master, m, v;
  std::vector<uint16_t> out;
  explicit State(size_t n) : master(n, 0.5f), m(n, 0.01f), v(n, 0.001f), out(n) {}
  ChunkState chunk() { return ChunkState{master.data(), m.data(), v.data()}; }
};

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// Folds `slots` into acc in pieces cut at `cuts` (rank indices), then steps.
void FoldThenStep(const std::vector<const void*>& slots, DType dtype, size_t n,
                  const std::vector<size_t>& cuts, ThreadPool* pool, State* s, double* squares) {
  std::vector<float> acc(n, 123.0f);  // Garbage: `start` must ignore it.
  size_t from = 0;
  bool start = true;
  for (size_t cut : cuts) {
    ASSERT_TRUE(AccumulateGrads(acc.data(), start,
                                absl::MakeConstSpan(slots.data() + from, cut - from), dtype, n,
                                pool)
                    .ok());
    start = false;
    from = cut;
  }
  OptimizerHyper hyper;
  hyper.kind = OptimizerKind::kAdamW;
  hyper.lr = 1e-3f;
  hyper.weight_decay = 0.01f;
  const void* sum[1] = {acc.data()};
  StepInputs in;
  in.grads = absl::MakeConstSpan(sum, 1);
  in.grad_dtype = DType::kFp32;
  in.grad_scale = 0.125f;
  in.step = 3;
  *squares = *GradSumOfSquares(in, n, pool);
  ASSERT_TRUE(FusedStep(hyper, in, n, s->chunk(), s->out.data(), DType::kBf16, pool).ok());
}

TEST(AccumulateGradsTest, FoldingInPiecesStepsExactlyAsTheFusedSum) {
  std::mt19937 rng(7);
  const size_t n = 70000;  // Several split grains and a ragged tail.
  ThreadPool pool4(4);
  for (DType dtype : {DType::kBf16, DType::kFp16, DType::kFp32}) {
    for (size_t w : {1, 2, 3, 5, 8}) {
      for (bool specials : {false, true}) {
        std::vector<std::vector<uint8_t>> bytes;
        std::vector<const void*> slots;
        for (size_t r = 0; r < w; ++r) bytes.push_back(RandomSlot(dtype, n, &rng, specials));
        for (const auto& b : bytes) slots.push_back(b.data());
        // The reference: the fused step over all W slots.
        OptimizerHyper hyper;
        hyper.kind = OptimizerKind::kAdamW;
        hyper.lr = 1e-3f;
        hyper.weight_decay = 0.01f;
        StepInputs in;
        in.grads = absl::MakeConstSpan(slots);
        in.grad_dtype = dtype;
        in.grad_scale = 0.125f;
        in.step = 3;
        State want(n);
        ASSERT_TRUE(FusedStep(hyper, in, n, want.chunk(), want.out.data(), DType::kBf16).ok());
        const double want_squares = *GradSumOfSquares(in, n, nullptr);
        // Every way of cutting the ranks into consecutive pieces (one per
        // landing), on one thread and on four.
        for (uint32_t mask = 0; mask < (1u << (w - 1)); ++mask) {
          std::vector<size_t> cuts;
          for (size_t r = 1; r < w; ++r) {
            if (mask & (1u << (r - 1))) cuts.push_back(r);
          }
          cuts.push_back(w);
          for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &pool4}) {
            SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " W=", w, " specials=", specials,
                                      " cuts mask=", mask, " threads=", pool ? 4 : 1));
            State got(n);
            double squares = 0;
            FoldThenStep(slots, dtype, n, cuts, pool, &got, &squares);
            EXPECT_TRUE(SameBits(got.master, want.master));
            EXPECT_TRUE(SameBits(got.m, want.m));
            EXPECT_TRUE(SameBits(got.v, want.v));
            EXPECT_EQ(std::memcmp(got.out.data(), want.out.data(), n * 2), 0);
            if (std::isnan(want_squares)) {
              EXPECT_TRUE(std::isnan(squares));
            } else {
              EXPECT_EQ(squares, want_squares);
            }
          }
        }
      }
    }
  }
}

TEST(AccumulateGradsTest, StartWithNoSlotsZeroesAndBadInputIsRefused) {
  std::vector<float> acc(100, 5.0f);
  ASSERT_TRUE(AccumulateGrads(acc.data(), true, {}, DType::kBf16, acc.size(), nullptr).ok());
  for (float f : acc) EXPECT_EQ(f, 0.0f);
  std::vector<uint16_t> slot(100, FloatToBf16(1.5f));
  const void* one[1] = {slot.data()};
  ASSERT_TRUE(AccumulateGrads(acc.data(), false, one, DType::kBf16, 100, nullptr).ok());
  ASSERT_TRUE(AccumulateGrads(acc.data(), false, one, DType::kBf16, 100, nullptr).ok());
  for (float f : acc) EXPECT_EQ(f, 3.0f);
  EXPECT_FALSE(AccumulateGrads(nullptr, true, one, DType::kBf16, 100, nullptr).ok());
  const void* null_slot[1] = {nullptr};
  EXPECT_FALSE(AccumulateGrads(acc.data(), false, null_slot, DType::kBf16, 100, nullptr).ok());
  EXPECT_FALSE(
      AccumulateGrads(acc.data(), false, one, static_cast<DType>(77), 100, nullptr).ok());
  for (float f : acc) EXPECT_EQ(f, 3.0f);  // Refusals change nothing.
}

}  // namespace
}  // namespace kernels
}  // namespace optimus
