// Tests of GradSumOfSquares, the gradient-norm pass of global gradient
// clipping: its value against double references, its bits across ISAs and
// thread counts, non-finite gradients, and agreement with the gradient that
// FusedStepScalar applies.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/optimizer_internal.h"
#include "kernels/cpu/passes.h"
#include "kernels/cpu/thread_pool.h"

namespace optimus {
namespace kernels {
namespace {

constexpr DType kAllDTypes[] = {DType::kFp32, DType::kBf16, DType::kFp16};
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNan = std::numeric_limits<float>::quiet_NaN();

// W gradient slots of one dtype, stored as raw bytes.
struct Slots {
  DType dtype = DType::kFp32;
  std::vector<std::vector<uint8_t>> bytes;

  void Put(size_t w, size_t i, float f) {
    if (dtype == DType::kFp32) {
      std::memcpy(bytes[w].data() + 4 * i, &f, 4);
    } else {
      const uint16_t h = dtype == DType::kBf16 ? FloatToBf16(f) : FloatToFp16(f);
      std::memcpy(bytes[w].data() + 2 * i, &h, 2);
    }
  }
  float At(size_t w, size_t i) const {
    if (dtype == DType::kFp32) {
      float f;
      std::memcpy(&f, bytes[w].data() + 4 * i, 4);
      return f;
    }
    uint16_t h;
    std::memcpy(&h, bytes[w].data() + 2 * i, 2);
    return dtype == DType::kBf16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
  }
  // Slot pointers `offset` elements in (unaligned loads for offset > 0).
  std::vector<const void*> Pointers(size_t offset = 0) const {
    std::vector<const void*> ptrs;
    for (const auto& b : bytes) ptrs.push_back(b.data() + offset * DTypeSize(dtype));
    return ptrs;
  }
};

// Normal values scaled by 2^-4..2^4, of similar magnitude so that the order
// of a sum changes its rounding, plus zeros of both signs and tiny values
// (fp16 subnormals). One element more than n, so that even an empty chunk
// has non-null slots.
Slots MakeSlots(DType dtype, size_t workers, size_t n, uint32_t seed) {
  ++n;
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::uniform_int_distribution<int> exp(-4, 4);
  Slots s;
  s.dtype = dtype;
  s.bytes.assign(workers, std::vector<uint8_t>(n * DTypeSize(dtype)));
  for (size_t w = 0; w < workers; ++w) {
    for (size_t i = 0; i < n; ++i) {
      const int kind = static_cast<int>(rng() % 64);
      const float x = dist(rng);
      s.Put(w, i, kind == 0 ? 0.0f : kind == 1 ? -0.0f
                  : kind == 2 ? std::ldexp(x, -20) : std::ldexp(x, exp(rng)));
    }
  }
  return s;
}

StepInputs InputsOf(const std::vector<const void*>& ptrs, DType dtype, float scale) {
  StepInputs in;
  in.grads = absl::MakeConstSpan(ptrs);
  in.grad_dtype = dtype;
  in.grad_scale = scale;
  return in;
}

// The gradient FusedStep applies, written out again: slots summed in rank
// order in fp32, then scaled in fp32.
std::vector<float> Gradient(const Slots& s, size_t offset, size_t n, float scale) {
  std::vector<float> g(n);
  for (size_t i = 0; i < n; ++i) {
    float sum = s.At(0, offset + i);
    for (size_t w = 1; w < s.bytes.size(); ++w) sum = sum + s.At(w, offset + i);
    g[i] = sum * scale;
  }
  return g;
}

// The reduction as the header documents it: blocks of 1024, 32 lanes by
// index within the block, lanes folded in halves, blocks added in order.
double DocumentedSum(const std::vector<float>& g) {
  double total = 0.0;
  for (size_t block = 0; block < g.size(); block += 1024) {
    double lanes[32] = {};
    for (size_t i = block; i < g.size() && i < block + 1024; ++i) {
      lanes[(i - block) % 32] += static_cast<double>(g[i]) * g[i];
    }
    for (size_t half = 16; half > 0; half /= 2) {
      for (size_t j = 0; j < half; ++j) lanes[j] += lanes[j + half];
    }
    total += lanes[0];
  }
  return total;
}

// A plain left-to-right double sum.
double NaiveSum(const std::vector<float>& g) {
  double total = 0.0;
  for (float x : g) total += static_cast<double>(x) * x;
  return total;
}

bool SameBits(double a, double b) { return std::memcmp(&a, &b, sizeof(a)) == 0; }

std::vector<std::string> AvailableIsas() {
  std::vector<std::string> isas;
  for (const char* isa : {"avx512", "avx2", "neon", "scalar"}) {
    if (internal::KernelsForIsa(isa).ok()) isas.push_back(isa);
  }
  return isas;
}

double MustSum(const StepInputs& in, size_t n, ThreadPool* pool) {
  absl::StatusOr<double> r = GradSumOfSquares(in, n, pool);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : std::nan("");
}

TEST(GradSumOfSquaresTest, MatchesDoubleReferences) {
  for (DType dtype : kAllDTypes) {
    for (size_t workers = 1; workers <= 4; ++workers) {
      for (size_t n : {1, 17, 1023, 1025, 100003}) {
        SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " W=", workers, " n=", n));
        const Slots s = MakeSlots(dtype, workers, n, static_cast<uint32_t>(n + workers));
        const float scale = 1.0f / static_cast<float>(workers);
        const std::vector<const void*> ptrs = s.Pointers();
        const double got = MustSum(InputsOf(ptrs, dtype, scale), n, nullptr);
        const std::vector<float> g = Gradient(s, 0, n, scale);
        EXPECT_TRUE(SameBits(got, DocumentedSum(g))) << got << " vs " << DocumentedSum(g);
        const double naive = NaiveSum(g);
        EXPECT_GT(naive, 0.0);
        // A left-to-right sum of n positive terms is within n * 2^-53 of the
        // exact one (relative); the blocked sum is closer.
        EXPECT_LE(std::fabs(got - naive), static_cast<double>(n) * 0x1p-53 * naive)
            << got << " vs " << naive;
      }
    }
  }
}

TEST(GradSumOfSquaresTest, EveryIsaGivesTheSameBits) {
  const std::vector<std::string> isas = AvailableIsas();
  std::cout << "ActiveIsa: " << ActiveIsa() << "; ISAs runnable here:";
  for (const auto& isa : isas) std::cout << " " << isa;
  std::cout << std::endl;
  for (DType dtype : kAllDTypes) {
    for (size_t workers = 1; workers <= 4; ++workers) {
      for (size_t n : {0, 1, 15, 31, 32, 33, 1000, 1023, 1024, 1025, 4099, 100003}) {
        const size_t offset = n % 3;
        const Slots s = MakeSlots(dtype, workers, n + offset, static_cast<uint32_t>(7 * n + workers));
        const std::vector<const void*> ptrs = s.Pointers(offset);
        const StepInputs in = InputsOf(ptrs, dtype, 0.3f);
        const double want = DocumentedSum(Gradient(s, offset, n, 0.3f));
        for (const std::string& isa : isas) {
          absl::StatusOr<double> got = internal::GradSumOfSquaresWithIsa(isa, in, n, nullptr);
          ASSERT_TRUE(got.ok()) << got.status();
          ASSERT_TRUE(SameBits(*got, want))
              << isa << " " << DTypeName(dtype) << " W=" << workers << " n=" << n << ": "
              << *got << " vs " << want;
        }
      }
    }
  }
}

TEST(GradSumOfSquaresTest, ThreadCountDoesNotChangeTheBits) {
  // Several 16384-element thread ranges, odd-sized and offset.
  const size_t n = 300007;
  const size_t offset = 3;
  for (DType dtype : kAllDTypes) {
    SCOPED_TRACE(DTypeName(dtype));
    const Slots s = MakeSlots(dtype, 3, n + offset, 21);
    const std::vector<const void*> ptrs = s.Pointers(offset);
    const StepInputs in = InputsOf(ptrs, dtype, 1.0f / 3);
    const double want = MustSum(in, n, nullptr);
    // The data is order-sensitive: a different order of the same additions
    // rounds differently, so a split that changed the order would show.
    ASSERT_FALSE(SameBits(want, NaiveSum(Gradient(s, offset, n, 1.0f / 3))));
    for (int threads = 1; threads <= 4; ++threads) {
      ThreadPool pool(threads);
      for (const std::string& isa : AvailableIsas()) {
        absl::StatusOr<double> got = internal::GradSumOfSquaresWithIsa(isa, in, n, &pool);
        ASSERT_TRUE(got.ok()) << got.status();
        EXPECT_TRUE(SameBits(*got, want)) << isa << " threads=" << threads << ": " << *got
                                          << " vs " << want;
      }
      EXPECT_TRUE(SameBits(MustSum(in, n, &pool), want)) << "threads=" << threads;
    }
  }
}

TEST(GradSumOfSquaresTest, NonFiniteInAnyOneSlotGivesNonFinite) {
  // At the start, in the vector body and in the scalar tail of the last
  // block; in every slot, on every ISA.
  const size_t n = 4099;
  for (DType dtype : kAllDTypes) {
    for (size_t workers = 1; workers <= 4; ++workers) {
      const Slots clean = MakeSlots(dtype, workers, n, static_cast<uint32_t>(workers));
      for (size_t slot = 0; slot < workers; ++slot) {
        for (float bad : {kInf, -kInf, kNan}) {
          for (size_t i : {size_t{0}, size_t{2050}, n - 1}) {
            Slots s = clean;
            s.Put(slot, i, bad);
            const std::vector<const void*> ptrs = s.Pointers();
            const StepInputs in = InputsOf(ptrs, dtype, 1.0f / static_cast<float>(workers));
            for (const std::string& isa : AvailableIsas()) {
              absl::StatusOr<double> got = internal::GradSumOfSquaresWithIsa(isa, in, n, nullptr);
              ASSERT_TRUE(got.ok()) << got.status();
              EXPECT_FALSE(std::isfinite(*got))
                  << isa << " " << DTypeName(dtype) << " W=" << workers << " slot=" << slot
                  << " value=" << bad << " at " << i << ": " << *got;
              if (std::isnan(bad)) {
                EXPECT_TRUE(std::isnan(*got)) << isa;
              }
            }
          }
        }
      }
    }
  }
}

TEST(GradSumOfSquaresTest, Fp32SumOverflowGivesNonFinite) {
  // 3e38 + 3e38 overflows fp32 before the 1/2 that would bring it back into
  // range: FusedStep would apply inf, so the pass must say so. One 3e38
  // alone is a finite gradient whose square (9e76) the double sum holds.
  const size_t n = 2000;
  for (size_t i : {size_t{5}, size_t{1999}}) {
    Slots s = MakeSlots(DType::kFp32, 2, n, 3);
    s.Put(0, i, 3e38f);
    s.Put(1, i, 3e38f);
    std::vector<const void*> ptrs = s.Pointers();
    for (const std::string& isa : AvailableIsas()) {
      absl::StatusOr<double> got =
          internal::GradSumOfSquaresWithIsa(isa, InputsOf(ptrs, DType::kFp32, 0.5f), n, nullptr);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_TRUE(std::isinf(*got)) << isa << " at " << i << ": " << *got;
    }
    s.Put(1, i, 0.0f);
    absl::StatusOr<double> finite = GradSumOfSquares(InputsOf(ptrs, DType::kFp32, 0.5f), n, nullptr);
    ASSERT_TRUE(finite.ok());
    EXPECT_TRUE(std::isfinite(*finite));
    EXPECT_GT(*finite, 2e76);
  }
}

TEST(GradSumOfSquaresTest, MatchesTheGradientFusedStepScalarApplies) {
  // SGD with lr 1, no momentum and no weight decay on master = 0 leaves
  // master = 0 - 1 * g = -g, the gradient FusedStepScalar applied, exactly.
  // The pass over that one fp32 slot (scale 1) squares the same values, so
  // it must give the same bits as the pass over the W slots.
  OptimizerHyper sgd;
  sgd.kind = OptimizerKind::kSgd;
  sgd.lr = 1.0f;
  sgd.momentum = 0.0f;
  sgd.weight_decay = 0.0f;
  const size_t n = 100003;
  for (DType dtype : kAllDTypes) {
    for (size_t workers : {1, 3}) {
      SCOPED_TRACE(absl::StrCat(DTypeName(dtype), " W=", workers));
      const Slots s = MakeSlots(dtype, workers, n, static_cast<uint32_t>(workers) + 40);
      const std::vector<const void*> ptrs = s.Pointers();
      StepInputs in = InputsOf(ptrs, dtype, 1.0f / static_cast<float>(workers));
      std::vector<float> master(n, 0.0f);
      ASSERT_TRUE(FusedStepScalar(sgd, in, n, ChunkState{master.data(), nullptr, nullptr},
                                  nullptr, DType::kFp32)
                      .ok());
      const std::vector<const void*> applied = {master.data()};
      const double of_applied = MustSum(InputsOf(applied, DType::kFp32, 1.0f), n, nullptr);
      const double pass = MustSum(in, n, nullptr);
      EXPECT_TRUE(SameBits(pass, of_applied)) << pass << " vs " << of_applied;
      EXPECT_LE(std::fabs(pass - NaiveSum(master)), static_cast<double>(n) * 0x1p-53 * pass);
    }
  }
}

TEST(GradSumOfSquaresTest, EmptyChunkIsZeroAndStepIsIgnored) {
  const float g = 2.0f;
  const void* slots[] = {&g};
  StepInputs in;
  in.grads = slots;
  in.step = 0;  // FusedStep would reject it; the pass does not use it
  absl::StatusOr<double> empty = GradSumOfSquares(in, 0, nullptr);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_TRUE(SameBits(*empty, 0.0));
  absl::StatusOr<double> one = GradSumOfSquares(in, 1, nullptr);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(*one, 4.0);
}

TEST(GradSumOfSquaresTest, BadInputsAreInvalidArgument) {
  const float g = 1.0f;
  const void* good[] = {&g};
  const void* with_null[] = {&g, nullptr};
  auto code_of = [](const StepInputs& in) {
    return GradSumOfSquares(in, 1, nullptr).status().code();
  };
  StepInputs in;
  EXPECT_EQ(code_of(in), absl::StatusCode::kInvalidArgument);  // no slots
  in.grads = with_null;
  EXPECT_EQ(code_of(in), absl::StatusCode::kInvalidArgument);
  in.grads = good;
  in.grad_dtype = static_cast<DType>(99);
  EXPECT_EQ(code_of(in), absl::StatusCode::kInvalidArgument);
  in.grad_dtype = DType::kFp32;
  in.grad_scale = kNan;
  EXPECT_EQ(code_of(in), absl::StatusCode::kInvalidArgument);
  in.grad_scale = kInf;
  EXPECT_EQ(code_of(in), absl::StatusCode::kInvalidArgument);
  in.grad_scale = 1.0f;
  EXPECT_TRUE(GradSumOfSquares(in, 1, nullptr).ok());
  EXPECT_EQ(internal::GradSumOfSquaresWithIsa("sse9", in, 1, nullptr).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(ReadGradsPassTest, OrsEveryBitOfEverySlot) {
  // The benchmarks' ceiling must really read every element: a single bit
  // set anywhere (vector body or tail, any slot) shows in the result.
  const size_t n = 70001;
  ThreadPool pool(2);
  for (DType dtype : kAllDTypes) {
    for (size_t i : {size_t{0}, size_t{40000}, n - 1}) {
      Slots s;
      s.dtype = dtype;
      s.bytes.assign(3, std::vector<uint8_t>(n * DTypeSize(dtype), 0));
      const uint32_t bit = dtype == DType::kFp32 ? 0x00400000u : 0x0040u;
      std::memcpy(s.bytes[2].data() + i * DTypeSize(dtype), &bit, DTypeSize(dtype));
      const std::vector<const void*> ptrs = s.Pointers();
      absl::StatusOr<uint32_t> got = ReadGradsPass(InputsOf(ptrs, dtype, 1.0f), n, &pool);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(*got, bit) << DTypeName(dtype) << " at " << i;
    }
  }
}

}  // namespace
}  // namespace kernels
}  // namespace optimus
