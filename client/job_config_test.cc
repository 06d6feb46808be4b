#include "client/job_config.h"

#include <cstdio>
#include <fstream>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace optimus {
namespace client {
namespace {

using ::testing::HasSubstr;

constexpr char kYaml[] = R"(# A trainer's job spec.
name: gpt-small
world_size: 2
optimizer:
  type: AdamW
  params:
    lr: 6.0e-4
    betas: [0.9, 0.95]
    eps: 1e-8
    weight_decay: 0.1
gradient_clipping: 1.0
skip_nonfinite: true
dtypes: {grad: bf16, param: fp16}
chunk_payload_bytes: 2MiB
replication: 1
checkpoint: {every_steps: 50, keep_last: 2}
param_groups:
  - name: no_decay
    match: ["*.bias", "*norm*"]
    weight_decay: 0
  - name: decay
)";

constexpr char kJson[] = R"({
  "name": "gpt-small", "world_size": 2,
  "optimizer": {"type": "adamw", "params": {"lr": 0.0006, "betas": [0.9, 0.95],
                                             "eps": 1e-8, "weight_decay": 0.1}},
  "gradient_clipping": 1.0, "skip_nonfinite": true,
  "dtypes": {"grad": "bf16", "param": "fp16"},
  "chunk_payload_bytes": 2097152, "replication": 1,
  "checkpoint": {"every_steps": 50, "keep_last": 2},
  "param_groups": [{"name": "no_decay", "match": ["*.bias", "*norm*"], "weight_decay": 0},
                   {"name": "decay"}]
})";

void ExpectSpec(const JobConfig& c) {
  const JobDef& d = c.def;
  EXPECT_EQ(d.name, "gpt-small");
  EXPECT_TRUE(c.has_name);
  EXPECT_EQ(d.world_size, 2u);
  EXPECT_EQ(d.optimizer.kind, Optimizer::kAdamW);
  EXPECT_FLOAT_EQ(d.optimizer.lr, 6e-4f);
  EXPECT_FLOAT_EQ(d.optimizer.beta1, 0.9f);
  EXPECT_FLOAT_EQ(d.optimizer.beta2, 0.95f);
  EXPECT_FLOAT_EQ(d.optimizer.eps, 1e-8f);
  EXPECT_FLOAT_EQ(d.optimizer.weight_decay, 0.1f);
  EXPECT_FLOAT_EQ(d.max_grad_norm, 1.0f);
  EXPECT_TRUE(d.skip_nonfinite);
  EXPECT_EQ(d.grad_dtype, DType::kBf16);
  EXPECT_EQ(d.param_dtype, DType::kFp16);
  EXPECT_EQ(d.chunk_payload_bytes, 2u << 20);
  EXPECT_EQ(d.replication, 1u);
  EXPECT_EQ(d.checkpoint.every_steps, 50u);
  EXPECT_EQ(d.checkpoint.keep_last, 2u);
  ASSERT_EQ(d.param_groups.size(), 2u);
  EXPECT_EQ(d.param_groups[0].name, "no_decay");
  EXPECT_EQ(d.param_groups[0].weight_decay, 0.0f);
  EXPECT_EQ(d.param_groups[1].name, "decay");
  EXPECT_FALSE(d.param_groups[1].weight_decay.has_value());
  EXPECT_FALSE(c.has_tensors);
}

TEST(JobConfigTest, YamlAndJsonGiveTheSameJob) {
  auto y = ParseJobConfig(kYaml, "train.yaml");
  ASSERT_TRUE(y.ok()) << y.status();
  ExpectSpec(*y);
  auto j = ParseJobConfig(kJson, "train.json");
  ASSERT_TRUE(j.ok()) << j.status();
  ExpectSpec(*j);
}

TEST(JobConfigTest, UnsetFieldsKeepTheDefaults) {
  auto c = ParseJobConfig("optimizer: {type: sgd, params: {lr: 0.1, momentum: 0.9}}\n", "x");
  ASSERT_TRUE(c.ok()) << c.status();
  const JobDef defaults;
  EXPECT_EQ(c->def.optimizer.kind, Optimizer::kSgd);
  EXPECT_FLOAT_EQ(c->def.optimizer.momentum, 0.9f);
  EXPECT_EQ(c->def.grad_dtype, defaults.grad_dtype);
  EXPECT_EQ(c->def.skip_nonfinite, defaults.skip_nonfinite);
  EXPECT_EQ(c->def.max_grad_norm, 0.0f);
  EXPECT_FALSE(c->has_name);
  EXPECT_FALSE(c->has_world_size);
}

TEST(JobConfigTest, ErrorsNameTheLineAndTheField) {
  struct Case {
    const char* text;
    const char* want;
  } cases[] = {
      {"name: a\noptimizr: {type: adamw}\n", "spec.yaml:2: optimizr: unknown field"},
      {"optimizer:\n  type: adamw\n  params:\n    lr: fast\n",
       "spec.yaml:4: optimizer.params.lr: expected a number, got 'fast'"},
      {"optimizer: {type: rmsprop}\n", "spec.yaml:1: optimizer.type: unknown optimizer 'rmsprop'"},
      {"dtypes:\n  grad: int8\n", "spec.yaml:2: dtypes.grad: unknown dtype 'int8'"},
      {"optimizer: {params: {betas: [0.9]}}\n", "optimizer.params.betas: expected [beta1, beta2]"},
      {"optimizer: {params: {betas: [0.9, 1.5]}}\n", "optimizer.params.betas[1]: must be in [0, 1)"},
      {"optimizer: {params: {lr: -1}}\n", "optimizer.params.lr: must be >= 0"},
      {"world_size: 0\n", "world_size: must be 1..65536"},
      {"replication: 2\n", "replication: must be 0 or 1"},
      {"chunk_payload_bytes: lots\n", "chunk_payload_bytes: expected a size"},
      {"name: a\nname: b\n", "name: given twice"},
      {"param_groups:\n  - name: a\n  - name: b\n", "only one group may leave out `match`"},
      {"tensors:\n  - {name: w, shape: [4, 0]}\n", "spec.yaml:2: tensors[0].shape[1]: must be >= 1"},
      {"tensors:\n  - {name: w, shape: [4], group: nope}\n",
       "tensors[0].group: no parameter group named 'nope'"},
      {"{\"name\": \"a\",\n \"world_size\": }\n",
       "spec.yaml:2: world_size: expected a whole number >= 0, got nothing"},
      {"{\"name\": \"a\",\n \"tensors\": [1, 2}\n", "spec.yaml:2: not valid YAML or JSON"},
      {"", "the document is empty"},
      {"- 1\n- 2\n", "expected a mapping, got a list"},
      {"name: a\nmodel: llama-8b\n",
       "spec.yaml:2: model: unknown model preset 'llama-8b' (known: gpt2-124m, llama-7b, "
       "llama-13b, llama-70b)"},
      {"model: gpt2-124m\ntensors:\n  - {name: w, shape: [4]}\n",
       "spec.yaml:3: tensors: give either `model` (a preset) or `tensors`, not both"},
      {"model: [llama-7b]\n", "spec.yaml:1: model: expected a non-empty string, got a list"},
  };
  for (const Case& c : cases) {
    auto r = ParseJobConfig(c.text, "spec.yaml");
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.want)) << c.text;
  }
}

TEST(JobConfigTest, TensorsWithGroupsByName) {
  auto c = ParseJobConfig(R"(
param_groups:
  - {name: frozen_embed, match: "embed.*", lr_mult: 0.1}
  - {name: rest}
tensors:
  - {name: embed.weight, shape: [100, 16]}
  - {name: head.weight, shape: [16, 100], group: frozen_embed, frozen: true}
  - {name: head.bias, shape: [100]}
)",
                          "t.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  ASSERT_TRUE(c->has_tensors);
  JobDef def = c->def;
  ASSERT_TRUE(AssignGroups(*c, &def).ok());
  ASSERT_EQ(def.tensors.size(), 3u);
  EXPECT_EQ(def.tensors[0].group, 0u);  // Matched "embed.*".
  EXPECT_EQ(def.tensors[1].group, 0u);  // Explicit.
  EXPECT_TRUE(def.tensors[1].frozen);
  EXPECT_EQ(def.tensors[2].group, 1u);  // The default group.
  EXPECT_EQ(def.tensors[2].shape, std::vector<int64_t>{100});
  EXPECT_EQ(def.param_groups.size(), 2u);
}

TEST(JobConfigTest, ModelTensorsJoinGroupsByPattern) {
  auto c = ParseJobConfig("param_groups:\n  - {name: no_decay, match: ['*.bias', '*ln*'], "
                          "weight_decay: 0}\n",
                          "g.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  JobDef def;
  def.tensors = {{"fc1.weight", {4, 4}}, {"fc1.bias", {4}}, {"ln1.weight", {4}}};
  ASSERT_TRUE(AssignGroups(*c, &def).ok());
  // No group without `match`: the unmatched tensor goes to an added
  // "default" group with the optimizer's own settings.
  ASSERT_EQ(def.param_groups.size(), 2u);
  EXPECT_EQ(def.param_groups[1].name, "default");
  EXPECT_FALSE(def.param_groups[1].weight_decay.has_value());
  EXPECT_EQ(def.tensors[0].group, 1u);
  EXPECT_EQ(def.tensors[1].group, 0u);
  EXPECT_EQ(def.tensors[2].group, 0u);
}

TEST(JobConfigTest, AGroupMatchingNothingIsAnError) {
  auto c = ParseJobConfig("param_groups:\n  - {name: nd, match: '*.biass'}\n  - {name: rest}\n",
                          "g.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  JobDef def;
  def.tensors = {{"fc.weight", {4, 4}}, {"fc.bias", {4}}};
  absl::Status s = AssignGroups(*c, &def);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("'nd' matches no tensor"));
}

// `model:` instead of `tensors:`: the job gets the preset's tensors, from
// YAML and JSON alike, and groups match them by pattern as any tensors.
TEST(JobConfigTest, AModelPresetGivesItsTensors) {
  for (const char* text : {"name: l7\nmodel: llama-7b\nparam_groups:\n"
                           "  - {name: no_decay, match: '*norm*', weight_decay: 0}\n"
                           "  - {name: decay}\n",
                           "{\"name\": \"l7\", \"model\": \"LLaMA-7B\", \"param_groups\": "
                           "[{\"name\": \"no_decay\", \"match\": \"*norm*\", \"weight_decay\": 0}, "
                           "{\"name\": \"decay\"}]}"}) {
    auto c = ParseJobConfig(text, "m.yaml");
    ASSERT_TRUE(c.ok()) << c.status();
    EXPECT_EQ(c->model, "llama-7b");
    ASSERT_TRUE(c->has_tensors);
    uint64_t params = 0;
    for (const TensorDef& t : c->def.tensors) {
      uint64_t n = 1;
      for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
      params += n;
    }
    EXPECT_EQ(params, 6738415616u);  // LLaMA-2 7B's published total.
    ASSERT_EQ(c->def.tensors.size(), 32u * 9 + 3);
    EXPECT_EQ(c->def.tensors[0].name, "model.embed_tokens.weight");
    EXPECT_EQ(c->def.tensors[0].shape, (std::vector<int64_t>{32000, 4096}));
    JobDef def = c->def;
    ASSERT_TRUE(AssignGroups(*c, &def).ok());
    EXPECT_EQ(def.tensors[0].group, 1u);                   // decay
    EXPECT_EQ(def.tensors.back().group, 1u);               // lm_head.weight
    EXPECT_EQ(def.tensors[def.tensors.size() - 2].group, 0u);  // model.norm.weight
  }
}

TEST(JobConfigTest, LoadsFilesAndNamesThemInErrors) {
  const std::string path = std::string(getenv("TEST_TMPDIR")) + "/bad.json";
  {
    std::ofstream out(path);
    out << "{\n  \"optimizer\": {\"type\": \"adamw\"},\n  \"dtypes\": {\"grad\": \"fp8\"}\n}\n";
  }
  auto r = LoadJobConfig(path);
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(std::string(r.status().message()), HasSubstr(path + ":3: dtypes.grad"));
  auto missing = LoadJobConfig(path + ".nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace client
}  // namespace optimus
