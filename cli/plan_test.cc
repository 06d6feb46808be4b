#include "cli/plan.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/model_presets.h"
#include "coordinator/shard_map.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/optimizer_spec.h"

namespace optimus {
namespace plan {
namespace {

using ::testing::HasSubstr;

// The OptimusNIC paper's worked example (section 4.1): LLaMA-70B on two
// DGX A100 nodes, DP=2 TP=2 PP=4, ZeRO-3.
PlanInput PaperLayout() {
  PlanInput in;
  in.model_name = "70e9";
  in.dp = 2;
  in.tp = 2;
  in.pp = 4;
  in.zero_stage = 3;
  return in;
}

double ValueOf(const PlanReport& r, const char* section, const char* key) {
  const PlanLine* l = r.Find(section, key);
  EXPECT_NE(l, nullptr) << section << "." << key;
  return l == nullptr ? -1 : l->value;
}

const PlanLine& LineOf(const PlanReport& r, const char* section, const char* key) {
  static const PlanLine kNone;
  const PlanLine* l = r.Find(section, key);
  EXPECT_NE(l, nullptr) << section << "." << key;
  return l == nullptr ? kNone : *l;
}

TEST(PlanTest, PaperExampleWithSeventyBillionParametersGivesThePapersNumbers) {
  PlanInput in = PaperLayout();
  in.num_params = 70000000000;
  absl::StatusOr<PlanReport> r = ComputePlan(in);
  ASSERT_TRUE(r.ok()) << r.status();
  // 1120 GB of model states for the whole model (16 B per parameter).
  EXPECT_EQ(ValueOf(*r, "model", "model_states_bytes"), 1120e9);
  EXPECT_EQ(ValueOf(*r, "model", "gpus"), 16);
  // 70 B / (TP 2 x PP 4) = 8.75 B parameters per GPU, 140 GB of states.
  EXPECT_EQ(ValueOf(*r, "per_gpu", "params"), 8.75e9);
  EXPECT_EQ(LineOf(*r, "per_gpu", "params").text, "8.75 B params");
  EXPECT_EQ(ValueOf(*r, "per_gpu", "model_states_bytes"), 140e9);
  EXPECT_EQ(LineOf(*r, "per_gpu", "model_states_bytes").text, "140.00 GB");
  // ZeRO-3 over DP=2: 70 GB per GPU.
  EXPECT_EQ(ValueOf(*r, "per_gpu", "total_bytes"), 70e9);
  // The optimizer state to offload: 8.75 B x 8 B (fp32 m, v) / 2 = 35 GB;
  // with the fp32 master copy, 8.75 B x 12 B / 2 = 52.5 GB.
  const PlanLine& mv = LineOf(*r, "per_gpu", "offload_optimizer_state_bytes");
  EXPECT_EQ(mv.value, 35e9);
  EXPECT_EQ(mv.text, "35.00 GB");
  EXPECT_THAT(mv.accounting, HasSubstr("8.75 B params x 8 B (fp32 m, v) / 2 (ZeRO-3 over DP 2)"));
  const PlanLine& with_master = LineOf(*r, "per_gpu", "offload_with_master_bytes");
  EXPECT_EQ(with_master.value, 52.5e9);
  EXPECT_EQ(with_master.text, "52.50 GB");
  EXPECT_THAT(with_master.accounting, HasSubstr("x 12 B (fp32 master + fp32 m, v) / 2"));
  // What stays on the GPU with optimus: bf16 weights and gradients / 2.
  EXPECT_EQ(ValueOf(*r, "per_gpu", "with_optimus_bytes"), 17.5e9);
  // Every figure says how it was computed.
  for (const PlanSection& s : r->sections) {
    for (const PlanLine& l : s.lines) {
      EXPECT_FALSE(l.accounting.empty()) << s.key << "." << l.key;
      EXPECT_FALSE(l.text.empty()) << s.key << "." << l.key;
    }
  }
}

TEST(PlanTest, PaperExampleWithThePresetIsWithinTwoPercent) {
  absl::StatusOr<ModelPreset> m = FindModelPreset("llama-70b");
  ASSERT_TRUE(m.ok()) << m.status();
  PlanInput in = PaperLayout();
  in.model_name = m->name;
  for (const PresetTensor& t : m->tensors) in.tensor_num_elems.push_back(t.num_elems());
  absl::StatusOr<PlanReport> r = ComputePlan(in);
  ASSERT_TRUE(r.ok()) << r.status();
  // The exact figure: 68,976,648,192 / 8.
  EXPECT_EQ(ValueOf(*r, "per_gpu", "params"), 68976648192.0 / 8);
  for (auto [key, paper] : std::vector<std::pair<const char*, double>>{
           {"params", 8.75e9},
           {"model_states_bytes", 140e9},
           {"total_bytes", 70e9},
           {"offload_optimizer_state_bytes", 35e9},
           {"offload_with_master_bytes", 52.5e9}}) {
    EXPECT_NEAR(ValueOf(*r, "per_gpu", key), paper, 0.02 * paper) << key;
  }
}

TEST(PlanTest, EachZeroStagePartitionsOneMoreKindOfState) {
  PlanInput in = PaperLayout();
  in.num_params = 70000000000;
  // 8.75 B params per GPU: weights 17.5 GB, grads 17.5 GB, m+v 70 GB,
  // master 35 GB before partitioning over DP 2.
  const double want[4] = {140e9, 17.5e9 + 17.5e9 + 52.5e9, 17.5e9 + 8.75e9 + 52.5e9, 70e9};
  for (uint32_t z = 0; z <= 3; ++z) {
    in.zero_stage = z;
    absl::StatusOr<PlanReport> r = ComputePlan(in);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(ValueOf(*r, "per_gpu", "total_bytes"), want[z]) << "ZeRO-" << z;
  }
  // No master copy (fp32 training): nothing of it to offload.
  in.master_dtype.reset();
  absl::StatusOr<PlanReport> r = ComputePlan(in);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(ValueOf(*r, "per_gpu", "master_bytes"), 0);
  EXPECT_EQ(ValueOf(*r, "per_gpu", "offload_with_master_bytes"), 35e9);
}

// The shard count is the coordinator's: placement succeeds on that many
// shards and fails on one fewer.
TEST(PlanTest, ShardsNeededIsTheSmallestCountThePlacementAccepts) {
  absl::StatusOr<ModelPreset> m = FindModelPreset("gpt2-124m");
  ASSERT_TRUE(m.ok());
  PlanInput in;
  in.model_name = m->name;
  for (const PresetTensor& t : m->tensors) in.tensor_num_elems.push_back(t.num_elems());
  in.dp = 4;
  in.dpu_memory_bytes = uint64_t{256} << 20;
  absl::StatusOr<PlanReport> r = ComputePlan(in);
  ASSERT_TRUE(r.ok()) << r.status();
  const uint64_t capacity = (uint64_t{256} << 20) - (uint64_t{256} << 20) / 8;
  EXPECT_EQ(ValueOf(*r, "shards", "dpu_shard_capacity_bytes"), static_cast<double>(capacity));
  const std::vector<ChunkSpec> chunks = SplitTensors(in.tensor_num_elems, (uint64_t{4} << 20) / 2);
  EXPECT_EQ(ValueOf(*r, "shards", "chunks"), static_cast<double>(chunks.size()));
  for (uint32_t rep : {0u, 1u}) {
    const uint64_t bpe = kernels::ShardBytesPerElem(kernels::OptimizerKind::kAdamW, 4,
                                                    DType::kBf16, DType::kBf16, rep > 0, true);
    const double n = ValueOf(*r, "shards", rep ? "dpu_shards_needed_replication_1"
                                               : "dpu_shards_needed_replication_0");
    ASSERT_GE(n, 2) << "the test needs a model larger than one shard";
    auto place = [&](uint64_t count) {
      std::vector<ShardInfo> shards(count);
      for (uint64_t i = 0; i < count; ++i) shards[i] = {i + 1, true, capacity, 0};
      absl::StatusOr<std::vector<ChunkSpec>> p =
          PlaceChunks(chunks, shards, bpe, kernels::ChunkOverheadBytes(4));
      if (p.ok() && rep > 0) p = PlaceBackups(*p, shards, bpe, kernels::ChunkOverheadBytes(4));
      return p.ok();
    };
    EXPECT_TRUE(place(static_cast<uint64_t>(n))) << "replication " << rep;
    EXPECT_FALSE(place(static_cast<uint64_t>(n) - 1)) << "replication " << rep;
  }
  // 20 B per parameter at W=4: 12 (master, m, v) + 4 (two bf16 copies) + 4
  // (the fp32 sum of 4 bf16 gradients, held for the commit round).
  EXPECT_EQ(ValueOf(*r, "shards", "bytes_per_elem"), 20);
  EXPECT_THAT(LineOf(*r, "shards", "bytes_per_elem").accounting,
              HasSubstr("12 (fp32 master, m, v) + 4 (two bf16 published versions) + 4"));
}

TEST(PlanTest, Llama70bSpillsPastSixteenDpusUnlessHostsTakeTheRest) {
  absl::StatusOr<ModelPreset> m = FindModelPreset("llama-70b");
  ASSERT_TRUE(m.ok());
  PlanInput in = PaperLayout();
  in.model_name = m->name;
  for (const PresetTensor& t : m->tensors) in.tensor_num_elems.push_back(t.num_elems());
  absl::StatusOr<PlanReport> r = ComputePlan(in);
  ASSERT_TRUE(r.ok()) << r.status();
  // 69 B x 20 B is ~1.38 TB; 16 BlueField-3 budgets of 26000 MiB plan 16 x 23.9 GB.
  EXPECT_EQ(ValueOf(*r, "cluster", "fits"), 0);
  EXPECT_GT(ValueOf(*r, "shards", "dpu_shards_needed_replication_0"), 16);
  const double spill = ValueOf(*r, "cluster", "host_memory_needed_bytes");
  const double dpus = 16 * ValueOf(*r, "shards", "dpu_shard_capacity_bytes");
  const double all = ValueOf(*r, "shards", "total_bytes");
  // The DPUs fill first; two nodes' host shards take the rest (x 8/7 for
  // their staging), give or take a chunk (42 MB) per shard.
  EXPECT_NEAR(spill * 2 * 7 / 8, all - dpus, 20 * 20.0 * (2 << 20));
  EXPECT_LE(ValueOf(*r, "cluster", "dpu_shard_bytes"),
            ValueOf(*r, "shards", "dpu_shard_capacity_bytes"));

  in.host_memory_bytes = uint64_t{1} << 40;  // 1 TiB per node.
  r = ComputePlan(in);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(ValueOf(*r, "cluster", "fits"), 1);
  EXPECT_EQ(LineOf(*r, "cluster", "fits").text, "yes, with host shards");
  EXPECT_GT(ValueOf(*r, "cluster", "host_shard_bytes"), 0);
  EXPECT_NE(r->Find("step_time", "host_step_seconds"), nullptr);

  in.host_memory_bytes = uint64_t{64} << 30;  // Too little.
  r = ComputePlan(in);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(ValueOf(*r, "cluster", "fits"), 0);
  EXPECT_THAT(LineOf(*r, "cluster", "fits").accounting, HasSubstr("does not fit"));
}

TEST(PlanTest, StepTimeScalesTheMeasuredBytesPerCore) {
  absl::StatusOr<KernelBench> bench = ParseKernelBench(
      "{\"bench\": \"adamw_fp32\", \"threads\": 2, \"gparams_per_s\": 9}\n"
      "\n"
      "{\"bench\": \"server_step\", \"sweep\": \"headline\", \"workers\": 2, \"threads\": 2, "
      "\"gparams_per_s\": 2.0}\n",
      "bench.jsonl");
  ASSERT_TRUE(bench.ok()) << bench.status();
  ASSERT_EQ(bench->figures.size(), 1u);
  // 2 G elements/s on 2 threads, 2 x 2 + 26 = 30 B each: 30 GB/s per core.
  EXPECT_DOUBLE_EQ(bench->figures[0].bytes_per_s_per_core(), 30e9);
  PlanInput in;
  in.model_name = "test";
  in.num_params = 1000000000;
  in.dp = 2;
  in.dpu_memory_bytes = uint64_t{64} << 30;
  in.dpu_cores = 4;
  in.kernel = *bench;
  absl::StatusOr<PlanReport> r = ComputePlan(in);
  ASSERT_TRUE(r.ok()) << r.status();
  // The same W and dtypes as measured: 1 G elements/s per core; the
  // fullest of the 2 DPUs (half the model, give or take a chunk) steps its
  // elements on 4 cores.
  EXPECT_DOUBLE_EQ(ValueOf(*r, "step_time", "elems_per_s_per_core"), 1e9);
  const double elems = ValueOf(*r, "cluster", "dpu_optimizer_state_bytes") / 12;
  EXPECT_NEAR(elems, 0.5e9, 2 << 20);
  EXPECT_DOUBLE_EQ(ValueOf(*r, "step_time", "dpu_step_seconds"), elems / 4e9);
  EXPECT_THAT(LineOf(*r, "step_time", "kernel_bytes_per_s_per_core").accounting,
              HasSubstr("bench.jsonl, line 3"));
  // fp32 gradients move 2 B more per worker: 34 B per element.
  in.grad_dtype = DType::kFp32;
  r = ComputePlan(in);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_DOUBLE_EQ(ValueOf(*r, "step_time", "elems_per_s_per_core"), 30e9 / 34);
}

TEST(PlanTest, TheRecordedKernelFiguresParse) {
  const KernelBench& b = DefaultKernelBench();
  ASSERT_GE(b.figures.size(), 4u);
  EXPECT_THAT(b.source, HasSubstr("2026-11-23"));
  EXPECT_EQ(b.figures[1].workers, 2u);
  EXPECT_DOUBLE_EQ(b.figures[1].gparams_per_s, 1.218);
}

TEST(PlanTest, BadKernelBenchFilesNameTheLine) {
  absl::StatusOr<KernelBench> b = ParseKernelBench("{\"bench\": \"server_step\"}\nnot json\n", "k");
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("k:1: server_step line without"));
  b = ParseKernelBench("{\"bench\": \"grad_norm\"}\nnot json\n", "k");
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("k:2: not a JSON object"));
  b = ParseKernelBench("{\"bench\": \"grad_norm\"}\n", "k");
  ASSERT_FALSE(b.ok());
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("no server_step line"));
}

TEST(PlanTest, OutOfRangeInputsNameTheFlag) {
  PlanInput in;
  in.num_params = 1000;
  struct Case {
    void (*set)(PlanInput*);
    const char* want;
  } cases[] = {
      {[](PlanInput* i) { i->dp = 0; }, "--dp"},
      {[](PlanInput* i) { i->zero_stage = 4; }, "--zero"},
      {[](PlanInput* i) { i->replication = 2; }, "--replication"},
      {[](PlanInput* i) { i->num_params = 0; }, "no parameters"},
  };
  for (const Case& c : cases) {
    PlanInput bad = in;
    c.set(&bad);
    absl::StatusOr<PlanReport> r = ComputePlan(bad);
    ASSERT_FALSE(r.ok()) << c.want;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.want));
  }
}

}  // namespace
}  // namespace plan
}  // namespace optimus
