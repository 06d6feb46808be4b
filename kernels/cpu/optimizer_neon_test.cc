// Tests of the NEON kernels for the aarch64 cross build run under qemu
// (aarch64_qemu_test.sh): NEON against the scalar reference bit for bit, for
// every optimizer, dtype, worker count and awkward size, plus the casts, the
// gradient sum, the gradient sum of squares (GradSumOfSquares' kernel) and
// thread-pool splits. A plain main with no gtest or abseil
// libraries: only header-only abseil is used, as Debian has no arm64 abseil
// or gtest without multiarch. Prints one line per group; exits 1 on failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "kernels/cpu/optimizer_internal.h"
#include "kernels/cpu/thread_pool.h"

#if !defined(__aarch64__)
#error "optimizer_neon_test.cc is built for aarch64 only"
#endif

namespace optimus {
namespace kernels {
namespace internal {
namespace {

int g_failures = 0;

#define CHECK_OR_FAIL(cond, ...)                      \
  do {                                                \
    if (!(cond)) {                                    \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      std::printf(__VA_ARGS__);                       \
      std::printf("\n");                              \
      ++g_failures;                                   \
      return;                                         \
    }                                                 \
  } while (0)

constexpr DType kDTypes[] = {DType::kFp32, DType::kBf16, DType::kFp16};
constexpr OptimizerKind kKinds[] = {OptimizerKind::kAdamW, OptimizerKind::kAdam,
                                    OptimizerKind::kSgd, OptimizerKind::kLion};

const char* Name(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::kAdamW: return "adamw";
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kSgd: return "sgd";
    case OptimizerKind::kLion: return "lion";
  }
  return "?";
}

// Per-step constants as PrepareStep derives them (optimizer.cc is not linked
// here: its validation needs abseil's Status library).
StepConstants Constants(OptimizerKind kind, int64_t t) {
  StepConstants k;
  k.kind = kind;
  k.apply_weight_decay = true;
  k.lr = kind == OptimizerKind::kLion ? 1e-4f : 1e-3f;
  k.weight_decay = kind == OptimizerKind::kSgd ? 1e-4f : 0.01f;
  k.decay_factor = static_cast<float>(1.0 - double{k.lr} * double{k.weight_decay});
  k.beta1 = 0.9f;
  k.one_minus_beta1 = static_cast<float>(1.0 - double{k.beta1});
  k.beta2 = kind == OptimizerKind::kLion ? 0.99f : 0.999f;
  k.one_minus_beta2 = static_cast<float>(1.0 - double{k.beta2});
  k.eps = 1e-8f;
  k.step_size = static_cast<float>(k.lr / (1.0 - std::pow(double{k.beta1}, t)));
  k.inv_sqrt_bias_correction2 =
      static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(double{k.beta2}, t)));
  k.use_momentum = kind == OptimizerKind::kSgd;
  k.momentum = 0.9f;
  return k;
}

void PutValue(std::vector<uint8_t>* bytes, DType d, size_t i, float f) {
  if (d == DType::kFp32) {
    std::memcpy(bytes->data() + 4 * i, &f, 4);
  } else {
    const uint16_t h = d == DType::kBf16 ? FloatToBf16(f) : FloatToFp16(f);
    std::memcpy(bytes->data() + 2 * i, &h, 2);
  }
}

// Random values plus zeros of both signs, infinities, NaN, fp16 subnormals
// and values that overflow fp16.
std::vector<uint8_t> Grad(DType d, size_t n, std::mt19937* rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<uint8_t> bytes(n * DTypeSize(d));
  for (size_t i = 0; i < n; ++i) PutValue(&bytes, d, i, dist(*rng));
  const float specials[] = {0.0f, -0.0f, 1e-7f, -3e-8f, 7e4f, -1e5f, 1e-30f,
                            INFINITY, NAN};
  if (n > 0) {
    std::uniform_int_distribution<size_t> pick(0, n - 1);
    for (int j = 0; j < 12; ++j) PutValue(&bytes, d, pick(*rng), specials[j % 9]);
  }
  return bytes;
}

bool SameFloat(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 4) == 0;
}

bool SameOut(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, DType d,
             size_t i) {
  if (d == DType::kFp32) {
    float x, y;
    std::memcpy(&x, a.data() + 4 * i, 4);
    std::memcpy(&y, b.data() + 4 * i, 4);
    return SameFloat(x, y);
  }
  uint16_t x, y;
  std::memcpy(&x, a.data() + 2 * i, 2);
  std::memcpy(&y, b.data() + 2 * i, 2);
  const float fx = d == DType::kBf16 ? Bf16ToFloat(x) : Fp16ToFloat(x);
  const float fy = d == DType::kBf16 ? Bf16ToFloat(y) : Fp16ToFloat(y);
  return (std::isnan(fx) && std::isnan(fy)) || x == y;
}

struct Chunk {
  std::vector<float> master, m, v;
  std::vector<uint8_t> out;
};

Chunk MakeChunk(size_t n, std::mt19937* rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  Chunk c;
  for (size_t i = 0; i < n; ++i) {
    c.master.push_back(i % 5 == 0 ? dist(*rng) * 70000.0f : dist(*rng));
  }
  c.m.assign(n, 0.0f);
  c.v.assign(n, 0.0f);
  c.out.assign(n * 4, 0xAB);
  return c;
}

// Runs 4 steps with `step` (NEON, or NEON split over a pool) and with the
// scalar reference, then compares everything bit for bit. has_out false
// runs without a published copy.
void CompareWithScalar(OptimizerKind kind, DType gd, DType od, bool has_out,
                       size_t workers, size_t n, size_t offset, ThreadPool* pool) {
  std::mt19937 rng(static_cast<uint32_t>(n * 7 + workers * 1000 + offset));
  const size_t total = n + offset + 1;  // one guard element past the end
  Chunk a = MakeChunk(total, &rng);
  Chunk b = a;
  const Chunk original = a;
  const size_t ob = DTypeSize(od);
  for (int t = 1; t <= 4; ++t) {
    std::vector<std::vector<uint8_t>> grads;
    for (size_t w = 0; w < workers; ++w) grads.push_back(Grad(gd, total, &rng));
    std::vector<const void*> ptrs;
    for (const auto& g : grads) ptrs.push_back(g.data() + offset * DTypeSize(gd));
    StepArgs args;
    args.k = Constants(kind, t);
    args.grads = ptrs.data();
    args.num_workers = workers;
    args.grad_dtype = gd;
    args.grad_scale = 0.3f;
    args.out_dtype = od;
    StepArgs sa = args, sb = args;
    sa.master = a.master.data() + offset;
    sa.m = a.m.data() + offset;
    sa.v = a.v.data() + offset;
    sa.out = has_out ? a.out.data() + offset * ob : nullptr;
    sb.master = b.master.data() + offset;
    sb.m = b.m.data() + offset;
    sb.v = b.v.data() + offset;
    sb.out = has_out ? b.out.data() + offset * ob : nullptr;
    if (pool != nullptr) {
      pool->ParallelFor(n, 16384, [&](size_t begin, size_t end) {
        StepRangeNeon(sa, begin, end);
      });
    } else {
      StepRangeNeon(sa, 0, n);
    }
    StepRangeScalar(sb, 0, n);
  }
  for (size_t i : {size_t{0}, total - 1}) {
    if (i >= offset && i < offset + n) continue;
    CHECK_OR_FAIL(std::memcmp(&a.master[i], &original.master[i], 4) == 0 &&
                      a.m[i] == original.m[i] && a.v[i] == original.v[i],
                  "%s wrote outside the chunk at %zu", Name(kind), i);
  }
  for (size_t i = 0; i < total; ++i) {
    CHECK_OR_FAIL(SameFloat(a.master[i], b.master[i]) && SameFloat(a.m[i], b.m[i]) &&
                      SameFloat(a.v[i], b.v[i]) && SameOut(a.out, b.out, od, i),
                  "%s grad=%s out=%s%s W=%zu n=%zu offset=%zu: element %zu differs "
                  "(master %.9g vs %.9g)",
                  Name(kind), DTypeName(gd).data(), DTypeName(od).data(),
                  has_out ? "" : "(none)", workers, n, offset, i, a.master[i],
                  b.master[i]);
  }
}

void TestStepMatchesScalar() {
  int cases = 0;
  for (OptimizerKind kind : kKinds) {
    for (DType gd : kDTypes) {
      for (DType od : kDTypes) {
        for (size_t workers : {1, 2, 4}) {
          for (size_t n : {0, 1, 7, 8, 9, 17, 1000, 4099}) {
            CompareWithScalar(kind, gd, od, true, workers, n, n % 3, nullptr);
            ++cases;
          }
        }
      }
      CompareWithScalar(kind, gd, DType::kFp32, false, 2, 1001, 1, nullptr);
      ++cases;
    }
  }
  std::printf("step: %d cases, NEON vs scalar bit for bit\n", cases);
}

void TestThreadSplitMatchesScalar() {
  int cases = 0;
  for (int threads : {2, 3}) {
    ThreadPool pool(threads);
    for (OptimizerKind kind : kKinds) {
      CompareWithScalar(kind, DType::kBf16, DType::kBf16, true, 4, 100003, 3, &pool);
      ++cases;
    }
  }
  std::printf("thread split: %d cases, NEON on 2-3 threads vs scalar bit for bit\n", cases);
}

void TestDoubleReference() {
  // Sanity check of both paths against double math, one step from m = v = 0.
  const size_t n = 1000;
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kLion}) {
    std::vector<float> g(n), master(n), m(n, 0.0f), v(n, 0.0f);
    for (size_t i = 0; i < n; ++i) {
      g[i] = dist(rng);
      master[i] = dist(rng);
    }
    const std::vector<float> p0 = master;
    const void* slots[] = {g.data()};
    StepArgs args;
    args.k = Constants(kind, 1);
    args.grads = slots;
    args.num_workers = 1;
    args.grad_dtype = DType::kFp32;
    args.grad_scale = 1.0f;
    args.master = master.data();
    args.m = m.data();
    args.v = v.data();
    StepRangeNeon(args, 0, n);
    const double lr = args.k.lr, wd = args.k.weight_decay;
    for (size_t i = 0; i < n; ++i) {
      // Both AdamW's first step (m_hat / sqrt(v_hat) = sign(g)) and Lion's
      // (sign(0.1 g)) move p by lr against the gradient after decay.
      const double sign = g[i] > 0 ? 1.0 : (g[i] < 0 ? -1.0 : 0.0);
      const double want = p0[i] * (1.0 - lr * wd) - lr * sign;
      CHECK_OR_FAIL(std::fabs(master[i] - want) < 1e-6 + 1e-6 * std::fabs(want),
                    "%s element %zu: %.9g, want %.9g", Name(kind), i, master[i], want);
    }
  }
  std::printf("double reference: first AdamW and Lion steps match\n");
}

void TestCastsAndSum() {
  std::mt19937 rng(5);
  std::uniform_int_distribution<uint32_t> bits;
  for (size_t n : {0, 1, 7, 8, 9, 31, 4097}) {
    std::vector<float> src(n);
    for (float& f : src) {
      const uint32_t b = bits(rng);
      std::memcpy(&f, &b, 4);  // every class: NaN, inf, subnormal, ...
    }
    if (n > 3) {
      src[0] = 65520.0f;         // fp16 overflow tie
      src[1] = 1.0f + 0x1p-8f;   // bf16 tie
      src[2] = 0x1p-25f;         // fp16 subnormal tie
    }
    for (DType d : {DType::kBf16, DType::kFp16}) {
      std::vector<uint16_t> half(n), want(n);
      CastFromFp32Neon(src.data(), 0, n, half.data(), d);
      CastFromFp32Scalar(src.data(), 0, n, want.data(), d);
      for (size_t i = 0; i < n; ++i) {
        CHECK_OR_FAIL(half[i] == want[i], "cast to %s of %a: %04x, want %04x",
                      DTypeName(d).data(), src[i], half[i], want[i]);
      }
      std::vector<float> back(n), back_want(n);
      CastToFp32Neon(half.data(), d, 0, n, back.data());
      CastToFp32Scalar(half.data(), d, 0, n, back_want.data());
      for (size_t i = 0; i < n; ++i) {
        CHECK_OR_FAIL(SameFloat(back[i], back_want[i]), "cast from %s at %zu",
                      DTypeName(d).data(), i);
      }
    }
    for (DType d : kDTypes) {
      std::vector<std::vector<uint8_t>> grads = {Grad(d, n, &rng), Grad(d, n, &rng),
                                                 Grad(d, n, &rng)};
      const void* slots[] = {grads[0].data(), grads[1].data(), grads[2].data()};
      StepArgs args;
      args.grads = slots;
      args.num_workers = 3;
      args.grad_dtype = d;
      args.grad_scale = 1.0f / 3;
      std::vector<float> sum(n), want(n);
      SumGradsNeon(args, 0, n, sum.data());
      SumGradsScalar(args, 0, n, want.data());
      for (size_t i = 0; i < n; ++i) {
        CHECK_OR_FAIL(SameFloat(sum[i], want[i]), "sum of %s at %zu",
                      DTypeName(d).data(), i);
      }
    }
  }
  std::printf("casts and gradient sum: NEON vs scalar bit for bit\n");
}

bool SameDouble(double a, double b) {
  return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 8) == 0;
}

// Block sums of GradSquares on `args` over n elements: NEON (split over the
// pool's 16384-element ranges if pool is non-null) or scalar.
std::vector<double> BlockSums(const StepArgs& args, size_t n, bool neon, ThreadPool* pool) {
  std::vector<double> sums((n + kNormBlockElems - 1) / kNormBlockElems, -1.0);
  if (!neon) {
    GradSquaresScalar(args, 0, n, sums.data());
  } else if (pool != nullptr) {
    pool->ParallelFor(n, 16384, [&](size_t begin, size_t end) {
      GradSquaresNeon(args, begin, end, sums.data());
    });
  } else {
    GradSquaresNeon(args, 0, n, sums.data());
  }
  return sums;
}

void TestGradSquares() {
  int cases = 0;
  std::mt19937 rng(9);
  for (DType d : kDTypes) {
    for (size_t workers : {1, 2, 3, 4}) {
      for (size_t n : {0, 1, 15, 31, 32, 33, 1000, 1023, 1024, 1025, 4099}) {
        const size_t offset = n % 3;
        // Grad() puts infinities and NaN in some blocks: those blocks must
        // be non-finite on both paths, the others equal bit for bit.
        std::vector<std::vector<uint8_t>> grads;
        for (size_t w = 0; w < workers; ++w) grads.push_back(Grad(d, n + offset + 1, &rng));
        std::vector<const void*> ptrs;
        for (const auto& g : grads) ptrs.push_back(g.data() + offset * DTypeSize(d));
        StepArgs args;
        args.grads = ptrs.data();
        args.num_workers = workers;
        args.grad_dtype = d;
        args.grad_scale = 0.3f;
        const std::vector<double> neon = BlockSums(args, n, true, nullptr);
        const std::vector<double> scalar = BlockSums(args, n, false, nullptr);
        for (size_t b = 0; b < neon.size(); ++b) {
          CHECK_OR_FAIL(SameDouble(neon[b], scalar[b]),
                        "grad squares %s W=%zu n=%zu block %zu: %.17g vs %.17g",
                        DTypeName(d).data(), workers, n, b, neon[b], scalar[b]);
        }
        ++cases;
      }
    }
  }
  // Clean data, several thread ranges: the blocks' sums, added in order,
  // are the same bits on 1-3 threads and within rounding of a double sum.
  const size_t n = 100003;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<std::vector<uint8_t>> grads(3, std::vector<uint8_t>(2 * n));
  for (auto& g : grads) {
    for (size_t i = 0; i < n; ++i) PutValue(&g, DType::kBf16, i, dist(rng));
  }
  const void* slots[] = {grads[0].data(), grads[1].data(), grads[2].data()};
  StepArgs args;
  args.grads = slots;
  args.num_workers = 3;
  args.grad_dtype = DType::kBf16;
  args.grad_scale = 1.0f / 3;
  double naive = 0.0;
  for (size_t i = 0; i < n; ++i) {
    float g = 0.0f;
    for (const auto& slot : grads) {
      uint16_t h;
      std::memcpy(&h, slot.data() + 2 * i, 2);
      g = g + Bf16ToFloat(h);  // 0 + x is x: the same as starting at slot 0
    }
    g = g * args.grad_scale;
    naive += static_cast<double>(g) * g;
  }
  double want = 0.0;
  for (double s : BlockSums(args, n, false, nullptr)) want = want + s;
  CHECK_OR_FAIL(std::fabs(want - naive) <= n * 0x1p-53 * naive,
                "grad squares: %.17g, double reference %.17g", want, naive);
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    double got = 0.0;
    for (double s : BlockSums(args, n, true, &pool)) got = got + s;
    CHECK_OR_FAIL(SameDouble(got, want), "grad squares on %d threads: %.17g vs %.17g",
                  threads, got, want);
    ++cases;
  }
  std::printf("grad squares: %d cases, NEON vs scalar bit for bit\n", cases);
}

}  // namespace
}  // namespace internal
}  // namespace kernels
}  // namespace optimus

int main() {
  using namespace optimus::kernels::internal;
  TestStepMatchesScalar();
  TestThreadSplitMatchesScalar();
  TestDoubleReference();
  TestCastsAndSum();
  TestGradSquares();
  if (g_failures > 0) {
    std::printf("%d FAILED\n", g_failures);
    return 1;
  }
  std::printf("PASS\n");
  return 0;
}
