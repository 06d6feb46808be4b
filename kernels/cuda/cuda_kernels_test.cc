#include "kernels/cuda/cuda_kernels.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "absl/status/status.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/cpu/optimizer.h"

namespace optimus {
namespace kernels {
namespace {

#define SKIP_WITHOUT_CUDA()                                     \
  do {                                                          \
    const absl::Status cuda_ = CudaAvailable();                 \
    if (!cuda_.ok()) GTEST_SKIP() << "no CUDA device: " << cuda_; \
  } while (0)

// CPU reference: the same fp32 multiply and rounding, squares summed in fp64.
GradStats ReferenceUnscale(std::vector<uint16_t>* half, std::vector<float>* f32, DType dtype,
                           float inv_scale) {
  GradStats stats;
  const size_t n = dtype == DType::kFp32 ? f32->size() : half->size();
  for (size_t i = 0; i < n; ++i) {
    float x, stored;
    if (dtype == DType::kFp32) {
      x = (*f32)[i];
      stored = x * inv_scale;
      (*f32)[i] = stored;
    } else {
      const uint16_t h = (*half)[i];
      x = dtype == DType::kBf16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
      const float y = x * inv_scale;
      (*half)[i] = dtype == DType::kBf16 ? FloatToBf16(y) : FloatToFp16(y);
      stored = dtype == DType::kBf16 ? Bf16ToFloat((*half)[i]) : Fp16ToFloat((*half)[i]);
    }
    if (!std::isfinite(x) || !std::isfinite(stored)) stats.found_nonfinite = true;
    stats.sum_squares += static_cast<double>(stored) * stored;
  }
  return stats;
}

TEST(CudaKernelsTest, AvailabilityIsReported) {
  const absl::Status s = CudaAvailable();
  if (!s.ok()) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    // Without a device every kernel call says so rather than crashing.
    std::vector<float> g(4, 1.0f);
    EXPECT_EQ(UnscaleGrads(g.data(), DType::kFp32, g.size(), 0.5f).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(g[0], 1.0f);
    GTEST_SKIP() << "no CUDA device: " << s;
  }
}

TEST(CudaKernelsTest, InvalidArgumentsNeedNoDevice) {
  std::vector<float> buf(8, 1.0f);
  EXPECT_EQ(UnscaleGrads(nullptr, DType::kFp32, 8, 1.0f).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(UnscaleGrads(buf.data(), static_cast<DType>(9), 8, 1.0f).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(UnscaleGrads(buf.data(), DType::kFp32, 8, std::nanf("")).status().code(),
            absl::StatusCode::kInvalidArgument);
  OptimizerHyper sgd;
  sgd.kind = OptimizerKind::kSgd;
  EXPECT_EQ(AdamWStepCuda(sgd, 1, buf.data(), buf.data(), buf.data(), buf.data(), 8).code(),
            absl::StatusCode::kInvalidArgument);
  OptimizerHyper adamw;
  EXPECT_EQ(AdamWStepCuda(adamw, 0, buf.data(), buf.data(), buf.data(), buf.data(), 8).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AdamWStepCuda(adamw, 1, buf.data(), nullptr, buf.data(), buf.data(), 8).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CudaKernelsTest, UnscaleMatchesCpu) {
  SKIP_WITHOUT_CUDA();
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 1000.0f);
  for (DType dtype : {DType::kFp32, DType::kBf16, DType::kFp16}) {
    for (size_t n : {size_t{1}, size_t{1000}, (size_t{1} << 22) + 17}) {
      SCOPED_TRACE(testing::Message() << DTypeName(dtype) << " n=" << n);
      std::vector<float> f32(dtype == DType::kFp32 ? n : 0);
      std::vector<uint16_t> half(dtype == DType::kFp32 ? 0 : n);
      for (size_t i = 0; i < n; ++i) {
        const float x = dist(rng);
        if (dtype == DType::kFp32) f32[i] = x;
        else half[i] = dtype == DType::kBf16 ? FloatToBf16(x) : FloatToFp16(x);
      }
      std::vector<float> f32_ref = f32;
      std::vector<uint16_t> half_ref = half;
      const float inv_scale = 1.0f / 1024.0f * 3.0f;
      const GradStats want = ReferenceUnscale(&half_ref, &f32_ref, dtype, inv_scale);
      void* data = dtype == DType::kFp32 ? static_cast<void*>(f32.data()) : half.data();
      absl::StatusOr<GradStats> got = UnscaleGrads(data, dtype, n, inv_scale);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_FALSE(got->found_nonfinite);
      EXPECT_NEAR(got->sum_squares, want.sum_squares, 1e-12 * want.sum_squares);
      EXPECT_EQ(f32, f32_ref);
      EXPECT_EQ(half, half_ref);
    }
  }
}

TEST(CudaKernelsTest, UnscaleFindsNonfinite) {
  SKIP_WITHOUT_CUDA();
  std::vector<uint16_t> fp16(100000, FloatToFp16(1.0f));
  fp16[77777] = 0x7c00;  // +inf
  absl::StatusOr<GradStats> got = UnscaleGrads(fp16.data(), DType::kFp16, fp16.size(), 0.5f);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->found_nonfinite);
  // Overflow caused by the scaling itself also counts.
  std::vector<uint16_t> bf16(1000, FloatToBf16(1e38f));
  got = UnscaleGrads(bf16.data(), DType::kBf16, bf16.size(), 10.0f);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->found_nonfinite);
  std::vector<float> nan(3, 1.0f);
  nan[2] = std::numeric_limits<float>::quiet_NaN();
  got = UnscaleGrads(nan.data(), DType::kFp32, nan.size(), 1.0f);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE(got->found_nonfinite);
}

TEST(CudaKernelsTest, AdamWIsBitwiseEqualToCpuScalar) {
  SKIP_WITHOUT_CUDA();
  const size_t n = (1u << 20) + 3;
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f);
  for (float& x : master) x = dist(rng);
  std::vector<float> cpu_master = master, cpu_m = m, cpu_v = v, cpu_out(n);
  for (float wd : {0.0f, 0.05f}) {
    OptimizerHyper hyper;
    hyper.lr = 3e-4f;
    hyper.weight_decay = wd;
    for (int64_t t = 1; t <= 5; ++t) {
      std::vector<float> grad(n);
      for (float& g : grad) g = dist(rng) * 0.01f;
      ASSERT_TRUE(AdamWStepCuda(hyper, t, master.data(), m.data(), v.data(), grad.data(), n).ok());
      const void* slots[] = {grad.data()};
      StepInputs in;
      in.grads = slots;
      in.step = t;
      ASSERT_TRUE(FusedStepScalar(hyper, in, n,
                                  ChunkState{cpu_master.data(), cpu_m.data(), cpu_v.data()},
                                  cpu_out.data(), DType::kFp32)
                      .ok());
    }
  }
  EXPECT_EQ(std::memcmp(master.data(), cpu_master.data(), 4 * n), 0);
  EXPECT_EQ(std::memcmp(m.data(), cpu_m.data(), 4 * n), 0);
  EXPECT_EQ(std::memcmp(v.data(), cpu_v.data(), 4 * n), 0);
}

}  // namespace
}  // namespace kernels
}  // namespace optimus
