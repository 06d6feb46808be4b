#include "common/model_presets.h"

#include <set>
#include <string>

#include "gtest/gtest.h"

namespace optimus {
namespace {

uint64_t ParamsOf(const char* name) {
  absl::StatusOr<ModelPreset> m = FindModelPreset(name);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? m->num_params() : 0;
}

// The totals the model cards publish (GPT-2 with its output layer tied to
// the token embedding).
TEST(ModelPresetsTest, ParameterCountsMatchThePublishedTotals) {
  EXPECT_EQ(ParamsOf("gpt2-124m"), 124439808u);
  EXPECT_EQ(ParamsOf("llama-7b"), 6738415616u);
  EXPECT_EQ(ParamsOf("llama-13b"), 13015864320u);
  EXPECT_EQ(ParamsOf("llama-70b"), 68976648192u);
}

TEST(ModelPresetsTest, Llama70bUsesGroupedQueryAttention) {
  absl::StatusOr<ModelPreset> m = FindModelPreset("LLaMA-70B");  // Case-insensitive.
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->tensors.size(), 80u * 9 + 3);
  for (const PresetTensor& t : m->tensors) {
    if (t.name == "model.layers.0.self_attn.k_proj.weight") {
      // 8 KV heads of 128: 1024 rows, against 8192 for the queries.
      EXPECT_EQ(t.shape, (std::vector<int64_t>{1024, 8192}));
    }
  }
}

TEST(ModelPresetsTest, EveryPresetHasUniqueNamesAndPositiveDimensions) {
  for (const std::string& name : ModelPresetNames()) {
    absl::StatusOr<ModelPreset> m = FindModelPreset(name);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->name, name);
    std::set<std::string> seen;
    for (const PresetTensor& t : m->tensors) {
      EXPECT_TRUE(seen.insert(t.name).second) << name << ": " << t.name << " twice";
      ASSERT_FALSE(t.shape.empty()) << t.name;
      for (int64_t d : t.shape) EXPECT_GT(d, 0) << t.name;
    }
  }
}

TEST(ModelPresetsTest, UnknownNameListsTheKnownOnes) {
  absl::StatusOr<ModelPreset> m = FindModelPreset("llama-8b");
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(m.status().message().find("llama-8b"), absl::string_view::npos);
  EXPECT_NE(m.status().message().find("gpt2-124m, llama-7b, llama-13b, llama-70b"),
            absl::string_view::npos);
}

}  // namespace
}  // namespace optimus
