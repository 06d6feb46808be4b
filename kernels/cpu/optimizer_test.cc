#include "kernels/cpu/optimizer.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/cpu/optimizer_internal.h"
#include "kernels/cpu/thread_pool.h"

namespace optimus {
namespace kernels {
namespace {

constexpr DType kAllDTypes[] = {DType::kFp32, DType::kBf16, DType::kFp16};
constexpr OptimizerKind kAllKinds[] = {OptimizerKind::kAdamW, OptimizerKind::kAdam,
                                       OptimizerKind::kSgd, OptimizerKind::kLion};

const char* KindName(OptimizerKind k) {
  switch (k) {
    case OptimizerKind::kAdamW:
      return "adamw";
    case OptimizerKind::kAdam:
      return "adam";
    case OptimizerKind::kSgd:
      return "sgd";
    case OptimizerKind::kLion:
      return "lion";
  }
  return "?";
}

OptimizerHyper HyperFor(OptimizerKind kind) {
  OptimizerHyper h;
  h.kind = kind;
  switch (kind) {
    case OptimizerKind::kAdamW:
      h.lr = 1e-3f;
      h.weight_decay = 0.01f;
      break;
    case OptimizerKind::kAdam:
      h.lr = 2e-3f;
      h.beta1 = 0.8f;
      h.beta2 = 0.99f;
      h.weight_decay = 0.02f;
      break;
    case OptimizerKind::kSgd:
      h.lr = 0.01f;
      h.momentum = 0.9f;
      h.weight_decay = 1e-4f;
      break;
    case OptimizerKind::kLion:
      h.lr = 1e-4f;
      h.beta1 = 0.9f;
      h.beta2 = 0.99f;
      h.weight_decay = 0.1f;
      break;
  }
  return h;
}

// One gradient slot: num_elems values of `dtype`, stored as raw bytes.
std::vector<uint8_t> MakeGrad(DType dtype, size_t n, std::mt19937* rng,
                              float stddev) {
  std::normal_distribution<float> dist(0.0f, stddev);
  std::vector<uint8_t> bytes(n * DTypeSize(dtype));
  for (size_t i = 0; i < n; ++i) {
    const float f = dist(*rng);
    if (dtype == DType::kFp32) {
      std::memcpy(bytes.data() + 4 * i, &f, 4);
    } else {
      const uint16_t h = dtype == DType::kBf16 ? FloatToBf16(f) : FloatToFp16(f);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  return bytes;
}

double GradAt(const std::vector<uint8_t>& bytes, DType dtype, size_t i) {
  if (dtype == DType::kFp32) {
    float f;
    std::memcpy(&f, bytes.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return dtype == DType::kBf16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
}

uint16_t U16At(const std::vector<uint8_t>& bytes, size_t i) {
  uint16_t h;
  std::memcpy(&h, bytes.data() + 2 * i, 2);
  return h;
}

// Double-precision reference of the optimizers, written from the
// torch.optim formulas and, for Lion, the paper's Algorithm 2.
struct RefState {
  std::vector<double> p, m, v;
};

void RefStep(const OptimizerHyper& h, int64_t t,
             const std::vector<std::vector<uint8_t>>& grads, DType grad_dtype,
             float grad_scale, RefState* s) {
  const double lr = h.lr, wd = h.weight_decay, b1 = h.beta1, b2 = h.beta2,
               eps = h.eps, mom = h.momentum;
  const double bc1 = 1.0 - std::pow(b1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(b2, static_cast<double>(t));
  for (size_t i = 0; i < s->p.size(); ++i) {
    double g = 0;
    for (const auto& slot : grads) g += GradAt(slot, grad_dtype, i);
    g *= grad_scale;
    double& p = s->p[i];
    double& m = s->m[i];
    double& v = s->v[i];
    if (h.kind == OptimizerKind::kSgd) {
      g += wd * p;
      if (mom != 0) {
        m = mom * m + g;
        g = m;
      }
      p -= lr * g;
      continue;
    }
    if (h.kind == OptimizerKind::kLion) {
      const double c = b1 * m + (1 - b1) * g;
      const double sign = c > 0 ? 1.0 : (c < 0 ? -1.0 : 0.0);
      p = p * (1.0 - lr * wd) - lr * sign;
      m = b2 * m + (1 - b2) * g;
      continue;
    }
    if (h.kind == OptimizerKind::kAdamW) {
      p *= 1.0 - lr * wd;
    } else {
      g += wd * p;
    }
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    const double denom = std::sqrt(v) / std::sqrt(bc2) + eps;
    p -= lr / bc1 * m / denom;
  }
}

struct Chunk {
  std::vector<float> master, m, v;
  std::vector<uint8_t> out;
  Chunk(size_t n, DType out_dtype, std::mt19937* rng) {
    std::normal_distribution<float> dist(0.0f, 1.0f);
    master.resize(n);
    for (float& x : master) x = dist(*rng);
    m.assign(n, 0.0f);
    v.assign(n, 0.0f);
    out.assign(n * DTypeSize(out_dtype), 0xAB);
  }
  ChunkState state() { return ChunkState{master.data(), m.data(), v.data()}; }
};

std::vector<const void*> SlotPointers(const std::vector<std::vector<uint8_t>>& g) {
  std::vector<const void*> ptrs;
  for (const auto& slot : g) ptrs.push_back(slot.data());
  return ptrs;
}

void ExpectOutIsCastOfMaster(const Chunk& c, DType out_dtype) {
  for (size_t i = 0; i < c.master.size(); ++i) {
    const float p = c.master[i];
    switch (out_dtype) {
      case DType::kFp32: {
        float o;
        std::memcpy(&o, c.out.data() + 4 * i, 4);
        ASSERT_EQ(std::memcmp(&o, &p, 4), 0) << i;
        break;
      }
      case DType::kBf16:
        ASSERT_EQ(U16At(c.out, i), FloatToBf16(p)) << i;
        break;
      case DType::kFp16:
        ASSERT_EQ(U16At(c.out, i), FloatToFp16(p)) << i;
        break;
    }
  }
}

// Runs `steps` steps of FusedStep and of the double reference and compares.
void RunAgainstReference(OptimizerKind kind, DType grad_dtype, DType out_dtype,
                         size_t num_workers, size_t n, int steps) {
  SCOPED_TRACE(absl::StrCat(KindName(kind), " grad=", DTypeName(grad_dtype),
                            " out=", DTypeName(out_dtype), " W=", num_workers,
                            " n=", n));
  std::mt19937 rng(static_cast<uint32_t>(n * 131 + num_workers * 7 +
                                         static_cast<int>(kind)));
  const OptimizerHyper hyper = HyperFor(kind);
  Chunk chunk(n, out_dtype, &rng);
  RefState ref;
  ref.p.assign(chunk.master.begin(), chunk.master.end());
  ref.m.assign(n, 0.0);
  ref.v.assign(n, 0.0);
  // 1/W averages; an extra non-power-of-two factor exercises the scaling.
  const float grad_scale = 0.75f / static_cast<float>(num_workers);
  for (int t = 1; t <= steps; ++t) {
    std::vector<std::vector<uint8_t>> grads;
    for (size_t w = 0; w < num_workers; ++w) {
      grads.push_back(MakeGrad(grad_dtype, n, &rng, 0.5f));
    }
    const std::vector<const void*> ptrs = SlotPointers(grads);
    StepInputs in;
    in.grads = absl::MakeConstSpan(ptrs);
    in.grad_dtype = grad_dtype;
    in.grad_scale = grad_scale;
    in.step = t;
    ASSERT_TRUE(FusedStep(hyper, in, n, chunk.state(), chunk.out.data(), out_dtype).ok());
    RefStep(hyper, t, grads, grad_dtype, grad_scale, &ref);
  }
  // Lion moves p by +-lr depending on sign(c); where c is within rounding of
  // zero, fp32 and double can pick different signs. Allow that rarely, and
  // never by more than the size of the steps involved.
  size_t lion_sign_flips = 0;
  for (size_t i = 0; i < n; ++i) {
    const double tolerance = 1e-5 * std::fabs(ref.p[i]) + 1e-6;
    if (kind == OptimizerKind::kLion &&
        std::fabs(chunk.master[i] - ref.p[i]) > tolerance) {
      ASSERT_LE(std::fabs(chunk.master[i] - ref.p[i]), 2.0 * hyper.lr * steps + tolerance) << i;
      ++lion_sign_flips;
      continue;
    }
    ASSERT_NEAR(chunk.master[i], ref.p[i], tolerance) << i;
    if (kind != OptimizerKind::kSgd || hyper.momentum != 0) {
      ASSERT_NEAR(chunk.m[i], ref.m[i], 1e-5 * std::fabs(ref.m[i]) + 1e-6) << i;
    }
    if (kind == OptimizerKind::kAdamW || kind == OptimizerKind::kAdam) {
      ASSERT_NEAR(chunk.v[i], ref.v[i], 1e-5 * ref.v[i] + 1e-12) << i;
    }
  }
  EXPECT_LE(lion_sign_flips, n / 10000 + 1);
  ExpectOutIsCastOfMaster(chunk, out_dtype);
}

TEST(FusedStepTest, MatchesDoubleReferenceSmallSizes) {
  for (OptimizerKind kind : kAllKinds) {
    for (DType grad_dtype : kAllDTypes) {
      for (DType out_dtype : kAllDTypes) {
        for (size_t workers : {1, 2, 4}) {
          for (size_t n : {1, 7, 33, 1027}) {
            RunAgainstReference(kind, grad_dtype, out_dtype, workers, n, 12);
            if (HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

TEST(FusedStepTest, MatchesDoubleReferenceLargeOddSize) {
  // 1000003 elements: every kind and grad dtype, cycling W and out dtype.
  int combo = 0;
  for (OptimizerKind kind : kAllKinds) {
    for (DType grad_dtype : kAllDTypes) {
      const size_t workers = size_t{1} << (combo % 3);
      const DType out_dtype = kAllDTypes[(combo / 3 + combo) % 3];
      RunAgainstReference(kind, grad_dtype, out_dtype, workers, 1000003, 12);
      if (HasFatalFailure()) return;
      ++combo;
    }
  }
}

TEST(FusedStepTest, SgdWithoutMomentumNeedsNoState) {
  OptimizerHyper hyper;
  hyper.kind = OptimizerKind::kSgd;
  hyper.lr = 0.5f;
  std::vector<float> grad = {1.0f, -2.0f, 4.0f};
  std::vector<float> master = {1.0f, 1.0f, 1.0f};
  std::vector<float> out(3);
  const void* slots[] = {grad.data()};
  StepInputs in;
  in.grads = slots;
  ASSERT_TRUE(FusedStep(hyper, in, 3, ChunkState{master.data(), nullptr, nullptr},
                        out.data(), DType::kFp32)
                  .ok());
  EXPECT_EQ(master, (std::vector<float>{0.5f, 2.0f, -1.0f}));
  EXPECT_EQ(out, master);
}

bool SameBitsOrBothNan(float a, float b) {
  if (std::isnan(a) && std::isnan(b)) return true;
  return std::memcmp(&a, &b, 4) == 0;
}

bool SameHalfOrBothNan(uint16_t a, uint16_t b, DType d) {
  const float fa = d == DType::kBf16 ? Bf16ToFloat(a) : Fp16ToFloat(a);
  const float fb = d == DType::kBf16 ? Bf16ToFloat(b) : Fp16ToFloat(b);
  if (std::isnan(fa) && std::isnan(fb)) return true;
  return a == b;
}

// Fills a gradient slot with random values plus the awkward ones: zeros of
// both signs, infinities, NaN, fp16 subnormals and values that overflow fp16.
std::vector<uint8_t> MakeNastyGrad(DType dtype, size_t n, std::mt19937* rng) {
  std::vector<uint8_t> bytes = MakeGrad(dtype, n, rng, 1.0f);
  const float specials[] = {0.0f, -0.0f, 1e-7f, -3e-8f, 7e4f, -1e5f, 1e-30f,
                            std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN()};
  std::uniform_int_distribution<size_t> pick(0, n - 1);
  for (int j = 0; j < 20; ++j) {
    const float f = specials[j % 9];
    const size_t i = pick(*rng);
    if (dtype == DType::kFp32) {
      std::memcpy(bytes.data() + 4 * i, &f, 4);
    } else {
      const uint16_t h = dtype == DType::kBf16 ? FloatToBf16(f) : FloatToFp16(f);
      std::memcpy(bytes.data() + 2 * i, &h, 2);
    }
  }
  return bytes;
}

// Compares `isa` with the scalar path over several steps, bit for bit.
void CompareIsaWithScalar(const std::string& isa, OptimizerKind kind,
                          DType grad_dtype, DType out_dtype, size_t workers,
                          size_t n, size_t offset, bool nasty) {
  SCOPED_TRACE(absl::StrCat(isa, " ", KindName(kind), " grad=", DTypeName(grad_dtype),
                            " out=", DTypeName(out_dtype), " W=", workers, " n=", n,
                            " offset=", offset, nasty ? " nasty" : ""));
  std::mt19937 rng(static_cast<uint32_t>(n + workers * 1000 + offset));
  OptimizerHyper hyper = HyperFor(kind);
  // One guard element past the end checks that nothing writes beyond n.
  const size_t total = n + offset + 1;
  Chunk a(total, out_dtype, &rng);
  // Values large enough that bf16/fp16 outputs hit overflow and rounding.
  for (size_t i = 0; i < a.master.size(); i += 5) a.master[i] *= 70000.0f;
  Chunk b = a;
  const Chunk original = a;
  const size_t out_offset_bytes = offset * DTypeSize(out_dtype);
  for (int t = 1; t <= 4; ++t) {
    std::vector<std::vector<uint8_t>> grads;
    for (size_t w = 0; w < workers; ++w) {
      grads.push_back(nasty ? MakeNastyGrad(grad_dtype, total, &rng)
                            : MakeGrad(grad_dtype, total, &rng, 1.0f));
    }
    // Start `offset` elements in, so vector loads are unaligned.
    std::vector<const void*> ptrs;
    for (const auto& g : grads) ptrs.push_back(g.data() + offset * DTypeSize(grad_dtype));
    StepInputs in;
    in.grads = absl::MakeConstSpan(ptrs);
    in.grad_dtype = grad_dtype;
    in.grad_scale = 0.3f;
    in.step = t;
    ChunkState sa{a.master.data() + offset, a.m.data() + offset, a.v.data() + offset};
    ChunkState sb{b.master.data() + offset, b.m.data() + offset, b.v.data() + offset};
    ASSERT_TRUE(internal::FusedStepWithIsa(isa, hyper, in, n, sa,
                                           a.out.data() + out_offset_bytes, out_dtype)
                    .ok());
    ASSERT_TRUE(FusedStepScalar(hyper, in, n, sb, b.out.data() + out_offset_bytes,
                                out_dtype)
                    .ok());
  }
  for (size_t i : {size_t{0}, total - 1}) {
    if (i >= offset && i < offset + n) continue;
    ASSERT_EQ(a.master[i], original.master[i]) << "wrote outside the chunk: " << i;
    ASSERT_EQ(a.m[i], original.m[i]) << i;
    ASSERT_EQ(a.v[i], original.v[i]) << i;
    ASSERT_EQ(a.out[i * DTypeSize(out_dtype)], original.out[i * DTypeSize(out_dtype)]) << i;
  }
  for (size_t i = 0; i < total; ++i) {
    ASSERT_TRUE(SameBitsOrBothNan(a.master[i], b.master[i]))
        << i << ": " << a.master[i] << " vs " << b.master[i];
    ASSERT_TRUE(SameBitsOrBothNan(a.m[i], b.m[i])) << i;
    ASSERT_TRUE(SameBitsOrBothNan(a.v[i], b.v[i])) << i;
    if (out_dtype == DType::kFp32) {
      float oa, ob;
      std::memcpy(&oa, a.out.data() + 4 * i, 4);
      std::memcpy(&ob, b.out.data() + 4 * i, 4);
      ASSERT_TRUE(SameBitsOrBothNan(oa, ob)) << i;
    } else {
      ASSERT_TRUE(SameHalfOrBothNan(U16At(a.out, i), U16At(b.out, i), out_dtype)) << i;
    }
  }
}

std::vector<std::string> AvailableIsas() {
  std::vector<std::string> isas;
  for (const char* isa : {"avx512", "avx2", "neon", "scalar"}) {
    if (internal::KernelsForIsa(isa).ok()) isas.push_back(isa);
  }
  return isas;
}

TEST(FusedStepTest, EveryIsaIsBitwiseEqualToScalar) {
  const std::vector<std::string> isas = AvailableIsas();
  std::cout << "ActiveIsa: " << ActiveIsa() << "; ISAs runnable here:";
  for (const auto& isa : isas) std::cout << " " << isa;
  std::cout << std::endl;
  for (const std::string& isa : isas) {
    for (OptimizerKind kind : kAllKinds) {
      for (DType grad_dtype : kAllDTypes) {
        for (DType out_dtype : kAllDTypes) {
          for (size_t workers : {1, 2, 4}) {
            for (size_t n : {0, 1, 7, 8, 15, 16, 17, 1000}) {
              CompareIsaWithScalar(isa, kind, grad_dtype, out_dtype, workers, n,
                                   n % 3, /*nasty=*/false);
              if (HasFatalFailure()) return;
            }
            CompareIsaWithScalar(isa, kind, grad_dtype, out_dtype, workers, 4099,
                                 1, /*nasty=*/true);
            if (HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

TEST(FusedStepTest, DispatchedPathIsBitwiseEqualToScalar) {
  // FusedStep itself (whatever ActiveIsa picked) against FusedStepScalar.
  const size_t n = 100003;
  std::mt19937 rng(7);
  for (OptimizerKind kind : kAllKinds) {
    OptimizerHyper hyper = HyperFor(kind);
    Chunk a(n, DType::kBf16, &rng);
    Chunk b = a;
    for (int t = 1; t <= 3; ++t) {
      std::vector<std::vector<uint8_t>> grads = {MakeGrad(DType::kBf16, n, &rng, 1.0f),
                                                 MakeGrad(DType::kBf16, n, &rng, 1.0f)};
      const std::vector<const void*> ptrs = SlotPointers(grads);
      StepInputs in;
      in.grads = absl::MakeConstSpan(ptrs);
      in.grad_dtype = DType::kBf16;
      in.grad_scale = 0.5f;
      in.step = t;
      ASSERT_TRUE(FusedStep(hyper, in, n, a.state(), a.out.data(), DType::kBf16).ok());
      ASSERT_TRUE(FusedStepScalar(hyper, in, n, b.state(), b.out.data(), DType::kBf16).ok());
    }
    ASSERT_EQ(std::memcmp(a.master.data(), b.master.data(), 4 * n), 0);
    ASSERT_EQ(std::memcmp(a.m.data(), b.m.data(), 4 * n), 0);
    ASSERT_EQ(std::memcmp(a.v.data(), b.v.data(), 4 * n), 0);
    ASSERT_EQ(a.out, b.out);
  }
}

TEST(FusedStepTest, SplittingAChunkDoesNotChangeResults) {
  const size_t n = 1000;
  const size_t split = 373;  // odd, not a multiple of any vector width
  std::mt19937 rng(11);
  const OptimizerHyper hyper = HyperFor(OptimizerKind::kAdamW);
  Chunk whole(n, DType::kFp16, &rng);
  Chunk parts = whole;
  std::vector<std::vector<uint8_t>> grads = {MakeGrad(DType::kFp16, n, &rng, 1.0f),
                                             MakeGrad(DType::kFp16, n, &rng, 1.0f),
                                             MakeGrad(DType::kFp16, n, &rng, 1.0f)};
  StepInputs in;
  in.grad_dtype = DType::kFp16;
  in.grad_scale = 1.0f / 3;
  in.step = 5;
  std::vector<const void*> ptrs = SlotPointers(grads);
  in.grads = absl::MakeConstSpan(ptrs);
  ASSERT_TRUE(FusedStep(hyper, in, n, whole.state(), whole.out.data(), DType::kFp16).ok());
  ASSERT_TRUE(FusedStep(hyper, in, split, parts.state(), parts.out.data(), DType::kFp16).ok());
  std::vector<const void*> tail_ptrs;
  for (const auto& g : grads) tail_ptrs.push_back(g.data() + 2 * split);
  in.grads = absl::MakeConstSpan(tail_ptrs);
  ChunkState tail{parts.master.data() + split, parts.m.data() + split,
                  parts.v.data() + split};
  ASSERT_TRUE(FusedStep(hyper, in, n - split, tail, parts.out.data() + 2 * split,
                        DType::kFp16)
                  .ok());
  EXPECT_EQ(std::memcmp(whole.master.data(), parts.master.data(), 4 * n), 0);
  EXPECT_EQ(whole.out, parts.out);
}

TEST(FusedStepTest, LionByHand) {
  // m = 0 at first: c = 0.1 g, so p moves by exactly lr against the
  // gradient's sign (after decay), zero gradients leave p decayed only, and
  // m becomes 0.01 g.
  OptimizerHyper hyper;
  hyper.kind = OptimizerKind::kLion;
  hyper.lr = 0.25f;
  hyper.beta2 = 0.99f;
  hyper.weight_decay = 0.5f;
  std::vector<float> g = {3.0f, -0.5f, 0.0f};
  std::vector<float> master = {1.0f, 1.0f, 1.0f}, m(3, 0.0f);
  std::vector<float> out(3);
  const void* slots[] = {g.data()};
  StepInputs in;
  in.grads = slots;
  ASSERT_TRUE(FusedStep(hyper, in, 3, ChunkState{master.data(), m.data(), nullptr},
                        out.data(), DType::kFp32)
                  .ok());
  // decay: 1 * (1 - 0.25 * 0.5) = 0.875
  EXPECT_EQ(master, (std::vector<float>{0.875f - 0.25f, 0.875f + 0.25f, 0.875f}));
  EXPECT_NEAR(m[0], 0.03f, 1e-7);
  EXPECT_NEAR(m[1], -0.005f, 1e-8);
  EXPECT_EQ(m[2], 0.0f);
  EXPECT_EQ(out, master);
}

TEST(FusedStepTest, NullOutSkipsThePublishedCopy) {
  // A plain fp32 step (no published copy) updates the state exactly as a
  // step that also writes a copy.
  const size_t n = 50003;
  std::mt19937 rng(5);
  for (OptimizerKind kind : kAllKinds) {
    const OptimizerHyper hyper = HyperFor(kind);
    Chunk a(n, DType::kBf16, &rng);
    Chunk b = a;
    const std::vector<std::vector<uint8_t>> grads = {MakeGrad(DType::kFp32, n, &rng, 1.0f)};
    const std::vector<const void*> ptrs = SlotPointers(grads);
    StepInputs in;
    in.grads = absl::MakeConstSpan(ptrs);
    ASSERT_TRUE(FusedStep(hyper, in, n, a.state(), nullptr, DType::kBf16).ok());
    ASSERT_TRUE(FusedStep(hyper, in, n, b.state(), b.out.data(), DType::kBf16).ok());
    EXPECT_EQ(std::memcmp(a.master.data(), b.master.data(), 4 * n), 0) << KindName(kind);
    EXPECT_EQ(std::memcmp(a.m.data(), b.m.data(), 4 * n), 0) << KindName(kind);
    EXPECT_EQ(std::memcmp(a.v.data(), b.v.data(), 4 * n), 0) << KindName(kind);
    EXPECT_EQ(a.out, std::vector<uint8_t>(a.out.size(), 0xAB));  // untouched
  }
}

TEST(FusedStepTest, ThreadCountDoesNotChangeResults) {
  // Big enough for several ranges per thread count, odd-sized, and offset so
  // that the streaming-store heads are exercised; compared with the scalar
  // reference bit for bit.
  const size_t n = 300007;
  const size_t offset = 3;
  std::mt19937 rng(13);
  for (OptimizerKind kind : kAllKinds) {
    for (DType out_dtype : kAllDTypes) {
      SCOPED_TRACE(absl::StrCat(KindName(kind), " out=", DTypeName(out_dtype)));
      const OptimizerHyper hyper = HyperFor(kind);
      Chunk reference(n + offset, out_dtype, &rng);
      std::vector<std::vector<uint8_t>> grads;
      for (int w = 0; w < 3; ++w) grads.push_back(MakeNastyGrad(DType::kBf16, n + offset, &rng));
      std::vector<const void*> ptrs;
      for (const auto& g : grads) ptrs.push_back(g.data() + 2 * offset);
      StepInputs in;
      in.grads = absl::MakeConstSpan(ptrs);
      in.grad_dtype = DType::kBf16;
      in.grad_scale = 1.0f / 3;
      in.step = 2;
      const Chunk original = reference;
      const size_t out_offset = offset * DTypeSize(out_dtype);
      auto state_of = [&](Chunk& c) {
        return ChunkState{c.master.data() + offset, c.m.data() + offset,
                          c.v.data() + offset};
      };
      ASSERT_TRUE(FusedStepScalar(hyper, in, n, state_of(reference),
                                  reference.out.data() + out_offset, out_dtype)
                      .ok());
      for (int threads : {1, 2, 3, 8}) {
        ThreadPool pool(threads);
        Chunk c = original;
        ASSERT_TRUE(FusedStep(hyper, in, n, state_of(c), c.out.data() + out_offset,
                              out_dtype, &pool)
                        .ok());
        for (size_t i = 0; i < n + offset; ++i) {
          ASSERT_TRUE(SameBitsOrBothNan(c.master[i], reference.master[i]))
              << "threads=" << threads << " i=" << i;
          ASSERT_TRUE(SameBitsOrBothNan(c.m[i], reference.m[i])) << i;
          ASSERT_TRUE(SameBitsOrBothNan(c.v[i], reference.v[i])) << i;
        }
        if (out_dtype == DType::kFp32) {
          for (size_t i = 0; i < n + offset; ++i) {
            float x, y;
            std::memcpy(&x, c.out.data() + 4 * i, 4);
            std::memcpy(&y, reference.out.data() + 4 * i, 4);
            ASSERT_TRUE(SameBitsOrBothNan(x, y)) << i;
          }
        } else {
          for (size_t i = 0; i < n + offset; ++i) {
            ASSERT_TRUE(SameHalfOrBothNan(U16At(c.out, i), U16At(reference.out, i),
                                          out_dtype))
                << i;
          }
        }
      }
    }
  }
}

TEST(FusedStepTest, SumAndTouchKernelsMatchTheirDefinitions) {
  // The benchmarks' helpers: the gradient sum equals the fused pass's sum,
  // and the no-math loop with a zero mask leaves every value unchanged.
  const size_t n = 20011;
  std::mt19937 rng(17);
  std::vector<std::vector<uint8_t>> grads = {MakeGrad(DType::kBf16, n, &rng, 1.0f),
                                             MakeGrad(DType::kBf16, n, &rng, 1.0f)};
  const std::vector<const void*> ptrs = SlotPointers(grads);
  for (const std::string& isa : AvailableIsas()) {
    SCOPED_TRACE(isa);
    const internal::IsaKernels* k = *internal::KernelsForIsa(isa);
    internal::StepArgs args;
    args.grads = ptrs.data();
    args.num_workers = 2;
    args.grad_dtype = DType::kBf16;
    args.grad_scale = 0.5f;
    std::vector<float> sum(n);
    k->sum_grads(args, 0, n, sum.data());
    for (size_t i = 0; i < n; ++i) {
      const float want = (Bf16ToFloat(U16At(grads[0], i)) + Bf16ToFloat(U16At(grads[1], i))) * 0.5f;
      ASSERT_EQ(sum[i], want) << i;
    }
    Chunk c(n, DType::kBf16, &rng);
    for (float& x : c.m) x = 2.0f;
    const Chunk before = c;
    args.master = c.master.data();
    args.m = c.m.data();
    args.v = c.v.data();
    args.out = c.out.data();
    args.out_dtype = DType::kBf16;
    k->touch(args, 0, 0, n);
    ASSERT_EQ(c.master, before.master);
    ASSERT_EQ(c.m, before.m);
    ASSERT_EQ(c.v, before.v);
    for (size_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &c.master[i], 4);
      ASSERT_EQ(U16At(c.out, i), static_cast<uint16_t>(bits)) << i;
    }
  }
}

TEST(FusedStepTest, AdamWFirstStepByHand) {
  // Step 1 with m = v = 0: m = 0.1 g, v = 0.001 g^2, bias corrections make
  // m_hat / sqrt(v_hat) = sign(g), so p moves by ~lr against the gradient.
  OptimizerHyper hyper;  // AdamW defaults, weight_decay 0
  std::vector<float> g0 = {2.0f, -8.0f}, g1 = {2.0f, 0.0f};
  std::vector<float> master = {1.0f, -1.0f}, m(2, 0.0f), v(2, 0.0f);
  std::vector<uint16_t> out(2);
  const void* slots[] = {g0.data(), g1.data()};
  StepInputs in;
  in.grads = slots;
  in.grad_scale = 0.5f;
  ASSERT_TRUE(FusedStep(hyper, in, 2, ChunkState{master.data(), m.data(), v.data()},
                        out.data(), DType::kBf16)
                  .ok());
  EXPECT_NEAR(master[0], 1.0f - 1e-3f, 1e-7);
  EXPECT_NEAR(master[1], -1.0f + 1e-3f, 1e-7);
  EXPECT_NEAR(m[0], 0.2f, 1e-7);
  // 1 - beta2 is derived from the float 0.999f (as torch would from a double
  // equal to it): 1 - 0.999000012874603 = 0.000999987...
  EXPECT_NEAR(v[1], 16 * (1.0 - static_cast<double>(0.999f)), 1e-9);
  EXPECT_EQ(out[0], FloatToBf16(master[0]));
}

TEST(CastTest, MatchesScalarConversions) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> bits;
  for (size_t n : {0, 1, 7, 8, 9, 16, 17, 31, 1001}) {
    std::vector<float> src(n);
    for (float& f : src) {
      const uint32_t b = bits(rng);
      std::memcpy(&f, &b, 4);  // every class: NaN, inf, subnormal, ...
    }
    if (n > 3) {
      src[0] = 65520.0f;  // fp16 overflow tie
      src[1] = 1.0f + 0x1p-8f;  // bf16 tie
      src[2] = 0x1p-25f;  // fp16 subnormal tie
    }
    for (DType d : {DType::kBf16, DType::kFp16}) {
      std::vector<uint16_t> half(n, 0);
      CastFromFp32(src.data(), n, half.data(), d);
      std::vector<float> back(n, 0.0f);
      CastToFp32(half.data(), d, n, back.data());
      for (size_t i = 0; i < n; ++i) {
        const uint16_t want = d == DType::kBf16 ? FloatToBf16(src[i]) : FloatToFp16(src[i]);
        ASSERT_EQ(half[i], want) << DTypeName(d) << " " << i << " " << src[i];
        const float want_back = d == DType::kBf16 ? Bf16ToFloat(half[i]) : Fp16ToFloat(half[i]);
        ASSERT_TRUE(SameBitsOrBothNan(back[i], want_back)) << i;
      }
    }
    std::vector<float> copy(n, 1.0f);
    CastFromFp32(src.data(), n, copy.data(), DType::kFp32);
    // n == 0: empty vectors may hold null, which memcmp must not see (UBSan).
    if (n > 0) ASSERT_EQ(std::memcmp(copy.data(), src.data(), 4 * n), 0);
  }
}

// Every error must leave every buffer untouched.
class FusedStepErrorTest : public ::testing::Test {
 protected:
  static constexpr size_t kN = 19;
  FusedStepErrorTest()
      : grad_(kN, 1.0f), master_(kN, 2.0f), m_(kN, 3.0f), v_(kN, 4.0f), out_(kN, 5.0f) {
    slots_[0] = grad_.data();
    slots_[1] = grad_.data();
    in_.grads = absl::MakeConstSpan(slots_, 2);
  }
  ChunkState state() { return ChunkState{master_.data(), m_.data(), v_.data()}; }

  void ExpectInvalid(const OptimizerHyper& hyper, const StepInputs& in,
                     ChunkState state, void* out, DType out_dtype,
                     absl::string_view message_part) {
    for (bool scalar : {false, true}) {
      const absl::Status s =
          scalar ? FusedStepScalar(hyper, in, kN, state, out, out_dtype)
                 : FusedStep(hyper, in, kN, state, out, out_dtype);
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_NE(s.message().find(message_part), absl::string_view::npos) << s;
    }
    for (size_t i = 0; i < kN; ++i) {
      ASSERT_EQ(master_[i], 2.0f);
      ASSERT_EQ(m_[i], 3.0f);
      ASSERT_EQ(v_[i], 4.0f);
      ASSERT_EQ(out_[i], 5.0f);
    }
  }

  std::vector<float> grad_, master_, m_, v_, out_;
  const void* slots_[2];
  StepInputs in_;
  OptimizerHyper hyper_;
};

TEST_F(FusedStepErrorTest, EmptyGrads) {
  StepInputs in = in_;
  in.grads = {};
  ExpectInvalid(hyper_, in, state(), out_.data(), DType::kFp32, "grads is empty");
}

TEST_F(FusedStepErrorTest, NullGradSlot) {
  slots_[1] = nullptr;
  ExpectInvalid(hyper_, in_, state(), out_.data(), DType::kFp32, "worker rank 1");
}

TEST_F(FusedStepErrorTest, NullState) {
  ChunkState s = state();
  s.master = nullptr;
  ExpectInvalid(hyper_, in_, s, out_.data(), DType::kFp32, "state.master");
  s = state();
  s.m = nullptr;
  ExpectInvalid(hyper_, in_, s, out_.data(), DType::kFp32, "state.m");
  s = state();
  s.v = nullptr;
  ExpectInvalid(hyper_, in_, s, out_.data(), DType::kFp32, "state.v");
  OptimizerHyper sgd;
  sgd.kind = OptimizerKind::kSgd;
  sgd.momentum = 0.9f;
  s = state();
  s.m = nullptr;
  ExpectInvalid(sgd, in_, s, out_.data(), DType::kFp32, "momentum");
  OptimizerHyper lion;
  lion.kind = OptimizerKind::kLion;
  s = state();
  s.m = nullptr;
  ExpectInvalid(lion, in_, s, out_.data(), DType::kFp32, "state.m");
}

TEST_F(FusedStepErrorTest, BadHyperAndInputs) {
  OptimizerHyper h = hyper_;
  h.lr = -1.0f;
  ExpectInvalid(h, in_, state(), out_.data(), DType::kFp32, "lr");
  h = hyper_;
  h.lr = std::numeric_limits<float>::quiet_NaN();
  ExpectInvalid(h, in_, state(), out_.data(), DType::kFp32, "lr");
  h = hyper_;
  h.beta1 = 1.0f;
  ExpectInvalid(h, in_, state(), out_.data(), DType::kFp32, "beta1");
  h = hyper_;
  h.beta2 = -0.1f;
  ExpectInvalid(h, in_, state(), out_.data(), DType::kFp32, "beta2");
  h = hyper_;
  h.eps = -1e-8f;
  ExpectInvalid(h, in_, state(), out_.data(), DType::kFp32, "eps");
  h = hyper_;
  h.weight_decay = -0.1f;
  ExpectInvalid(h, in_, state(), out_.data(), DType::kFp32, "weight_decay");
  h = hyper_;
  h.kind = OptimizerKind::kLion;
  h.beta2 = 1.0f;
  ExpectInvalid(h, in_, state(), out_.data(), DType::kFp32, "beta2");
  h = hyper_;
  h.kind = static_cast<OptimizerKind>(9);
  ExpectInvalid(h, in_, state(), out_.data(), DType::kFp32, "optimizer kind");
  StepInputs in = in_;
  in.step = 0;
  ExpectInvalid(hyper_, in, state(), out_.data(), DType::kFp32, "step");
  in = in_;
  in.grad_scale = std::numeric_limits<float>::infinity();
  ExpectInvalid(hyper_, in, state(), out_.data(), DType::kFp32, "grad_scale");
  in = in_;
  in.grad_dtype = static_cast<DType>(0);
  ExpectInvalid(hyper_, in, state(), out_.data(), DType::kFp32, "grad_dtype");
  ExpectInvalid(hyper_, in_, state(), out_.data(), static_cast<DType>(7), "out_dtype");
}

TEST(FusedStepIsaTest, UnknownIsaIsNotFound) {
  EXPECT_EQ(internal::KernelsForIsa("sse9").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(internal::KernelsForIsa("scalar").ok());
  const absl::string_view active = ActiveIsa();
  EXPECT_TRUE(active == "avx512" || active == "avx2" || active == "neon" ||
              active == "scalar")
      << active;
}

}  // namespace
}  // namespace kernels
}  // namespace optimus
