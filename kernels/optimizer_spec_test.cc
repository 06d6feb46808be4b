#include "kernels/optimizer_spec.h"

#include <cmath>
#include <string>

#include "gtest/gtest.h"

namespace optimus {
namespace kernels {
namespace {

TEST(OptimizerSpecTest, LionGetsItsOwnBetasNotAdams) {
  OptimizerHyper h;
  h.kind = OptimizerKind::kLion;
  h.beta1 = 0;
  h.beta2 = 0;
  h.eps = 0;
  ASSERT_TRUE(FillDefaultsAndValidate(&h).ok());
  EXPECT_FLOAT_EQ(h.beta1, 0.9f);
  EXPECT_FLOAT_EQ(h.beta2, 0.99f);
}

TEST(OptimizerSpecTest, AdamDefaultsAreTorchs) {
  for (OptimizerKind k : {OptimizerKind::kAdam, OptimizerKind::kAdamW}) {
    OptimizerHyper h;
    h.kind = k;
    h.lr = 0;
    h.beta1 = 0;
    h.beta2 = 0;
    h.eps = 0;
    ASSERT_TRUE(FillDefaultsAndValidate(&h).ok());
    EXPECT_FLOAT_EQ(h.lr, 1e-3f);
    EXPECT_FLOAT_EQ(h.beta1, 0.9f);
    EXPECT_FLOAT_EQ(h.beta2, 0.999f);
    EXPECT_FLOAT_EQ(h.eps, 1e-8f);
  }
}

TEST(OptimizerSpecTest, ExplicitValuesAreKept) {
  OptimizerHyper h;
  h.kind = OptimizerKind::kLion;
  h.lr = 3e-4f;
  h.beta1 = 0.95f;
  h.beta2 = 0.98f;
  ASSERT_TRUE(FillDefaultsAndValidate(&h).ok());
  EXPECT_FLOAT_EQ(h.lr, 3e-4f);
  EXPECT_FLOAT_EQ(h.beta1, 0.95f);
  EXPECT_FLOAT_EQ(h.beta2, 0.98f);
}

TEST(OptimizerSpecTest, OutOfRangeFieldsAreNamed) {
  struct Case {
    void (*set)(OptimizerHyper*);
    const char* field;
  } cases[] = {
      {[](OptimizerHyper* h) { h->lr = -1; }, "lr"},
      {[](OptimizerHyper* h) { h->lr = INFINITY; }, "lr"},
      {[](OptimizerHyper* h) { h->beta1 = 1.0f; }, "beta1"},
      {[](OptimizerHyper* h) { h->beta2 = -0.5f; }, "beta2"},
      {[](OptimizerHyper* h) { h->eps = NAN; }, "eps"},
      {[](OptimizerHyper* h) { h->weight_decay = -1; }, "weight_decay"},
      {[](OptimizerHyper* h) { h->momentum = 1.5f; }, "momentum"},
  };
  for (const Case& c : cases) {
    OptimizerHyper h;
    c.set(&h);
    absl::Status s = FillDefaultsAndValidate(&h);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(std::string(s.message()).find(c.field), std::string::npos) << s;
  }
}

TEST(OptimizerSpecTest, GroupOverridesAreCheckedOnlyWhenSet) {
  EXPECT_TRUE(ValidateGroupOverrides(GroupOverrides{}, "param_groups[0]").ok());
  GroupOverrides zeros;  // Explicit zeros are in range (lr_mult aside).
  zeros.weight_decay = 0;
  zeros.beta1 = 0;
  zeros.beta2 = 0;
  zeros.momentum = 0;
  zeros.lr_mult = 0.5f;
  EXPECT_TRUE(ValidateGroupOverrides(zeros, "param_groups[0]").ok());
  struct Case {
    void (*set)(GroupOverrides*);
    const char* want;
  } cases[] = {
      {[](GroupOverrides* g) { g->weight_decay = -0.1f; }, "param_groups[2].weight_decay"},
      {[](GroupOverrides* g) { g->weight_decay = INFINITY; }, "param_groups[2].weight_decay"},
      {[](GroupOverrides* g) { g->lr_mult = 0; }, "param_groups[2].lr_mult"},
      {[](GroupOverrides* g) { g->lr_mult = NAN; }, "param_groups[2].lr_mult"},
      {[](GroupOverrides* g) { g->beta1 = 1.0f; }, "param_groups[2].beta1"},
      {[](GroupOverrides* g) { g->beta2 = -0.5f; }, "param_groups[2].beta2"},
      {[](GroupOverrides* g) { g->momentum = 1.0f; }, "param_groups[2].momentum"},
  };
  for (const Case& c : cases) {
    GroupOverrides g;
    c.set(&g);
    absl::Status s = ValidateGroupOverrides(g, "param_groups[2]");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.want;
    EXPECT_NE(std::string(s.message()).find(c.want), std::string::npos) << s;
  }
}

TEST(OptimizerSpecTest, LayoutNamesMatchTorchState) {
  EXPECT_EQ(LayoutOf(OptimizerKind::kAdamW).num_arrays, 3u);
  EXPECT_STREQ(LayoutOf(OptimizerKind::kAdamW).names[2], "exp_avg_sq");
  EXPECT_EQ(LayoutOf(OptimizerKind::kSgd).num_arrays, 2u);
  EXPECT_STREQ(LayoutOf(OptimizerKind::kSgd).names[1], "momentum_buffer");
  EXPECT_EQ(LayoutOf(OptimizerKind::kLion).num_arrays, 2u);
  EXPECT_FALSE(LayoutOf(OptimizerKind::kLion).has_v());
  EXPECT_TRUE(LayoutOf(OptimizerKind::kAdam).has_v());
}

TEST(OptimizerSpecTest, ShardBytesPerElement) {
  // AdamW, bf16 published, gradients in the staging pool: 12 + 2*2 = 16,
  // whatever the number of workers.
  for (uint32_t w : {1u, 4u, 8u, 64u}) {
    EXPECT_EQ(ShardBytesPerElem(OptimizerKind::kAdamW, w, DType::kBf16, DType::kBf16, false, false),
              16u);
  }
  // The same replicated: + the 4 B fp32 gradient sum.
  EXPECT_EQ(ShardBytesPerElem(OptimizerKind::kAdamW, 4, DType::kBf16, DType::kBf16, true, false),
            20u);
  // Holding gradients until the commit: W=2 bf16 slots (4 B), or one fp32
  // sum from W=3 on (4 B, not 6).
  EXPECT_EQ(ShardBytesPerElem(OptimizerKind::kAdamW, 2, DType::kBf16, DType::kBf16, false, true),
            20u);
  EXPECT_EQ(ShardBytesPerElem(OptimizerKind::kAdamW, 8, DType::kBf16, DType::kBf16, false, true),
            20u);
  EXPECT_EQ(ShardBytesPerElem(OptimizerKind::kAdamW, 1, DType::kBf16, DType::kBf16, false, true),
            18u);
  // SGD, 1 worker, fp32 everywhere, holding: 8 + 8 + 4 = 20.
  EXPECT_EQ(ShardBytesPerElem(OptimizerKind::kSgd, 1, DType::kFp32, DType::kFp32, false, true),
            20u);
  EXPECT_FALSE(FoldsGradients(2, DType::kBf16));
  EXPECT_TRUE(FoldsGradients(3, DType::kBf16));
  EXPECT_TRUE(FoldsGradients(2, DType::kFp32));
}

TEST(OptimizerSpecTest, KindFromInt) {
  EXPECT_EQ(*OptimizerKindFromInt(4), OptimizerKind::kLion);
  EXPECT_FALSE(OptimizerKindFromInt(0).ok());
  EXPECT_FALSE(OptimizerKindFromInt(9).ok());
}

}  // namespace
}  // namespace kernels
}  // namespace optimus
