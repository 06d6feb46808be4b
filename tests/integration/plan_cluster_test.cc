// `optimusctl plan` and a real coordinator agree: the number of shards the
// plan says a job needs is the number the coordinator places it on (one
// fewer is refused for lack of memory), the job then trains, and the bytes
// the coordinator planned on the shards are the plan's, without and with
// replication.
#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/strings/str_cat.h"
#include "cli/plan.h"
#include "gtest/gtest.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace harness {
namespace {

// Small shards, so that a few-MB job needs several of them.
constexpr uint64_t kShardMemory = uint64_t{16} << 20;

client::JobDef Job(uint32_t replication) {
  client::JobDef def;
  def.name = absl::StrCat("planned-r", replication);
  def.world_size = 2;
  def.tensors = {{"embed", {4000, 256}}, {"w1", {1024, 1024}}, {"w2", {1024, 1024}},
                 {"bias", {1024}}};
  def.optimizer.kind = client::Optimizer::kAdamW;
  def.optimizer.lr = 1e-3f;
  def.grad_dtype = DType::kBf16;
  def.param_dtype = DType::kBf16;
  def.chunk_payload_bytes = 256 << 10;  // 128 Ki elements: several chunks per shard.
  def.replication = replication;
  return def;
}

TEST(PlanClusterTest, ThePlannedShardCountIsWhatTheCoordinatorAccepts) {
  for (uint32_t rep : {0u, 1u}) {
    SCOPED_TRACE(absl::StrCat("replication ", rep));
    const client::JobDef def = Job(rep);
    plan::PlanInput in;
    in.model_name = def.name;
    for (const client::TensorDef& t : def.tensors) {
      uint64_t n = 1;
      for (int64_t d : t.shape) n *= static_cast<uint64_t>(d);
      in.tensor_num_elems.push_back(n);
    }
    in.dp = def.world_size;
    in.dpu_memory_bytes = kShardMemory;  // The shards' budget, staging included.
    in.chunk_payload_bytes = def.chunk_payload_bytes;
    in.replication = rep;
    in.holds_grads = def.skip_nonfinite || def.max_grad_norm > 0;
    absl::StatusOr<plan::PlanReport> report = plan::ComputePlan(in);
    ASSERT_TRUE(report.ok()) << report.status();
    const plan::PlanLine* needed = report->Find(
        "shards", rep ? "dpu_shards_needed_replication_1" : "dpu_shards_needed_replication_0");
    ASSERT_NE(needed, nullptr);
    const int n = static_cast<int>(needed->value);
    ASSERT_GE(n, 3) << "the job should need several shards: " << needed->accounting;
    std::printf("replication %u: plan says %d shards (%s)\n", rep, n, needed->accounting.c_str());

    ClusterOptions o;
    o.num_shards = n - 1;
    o.num_workers = def.world_size;
    o.shard_memory_limit_bytes = kShardMemory;
    ASSERT_OK_AND_ASSIGN(auto c, Cluster::Start(o));
    const absl::Status refused = c->CreateJob(def);
    EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;

    ASSERT_OK(c->AddShard().status());
    ASSERT_OK(c->CreateJob(def));
    ASSERT_OK(c->Train(1, 2));
    ASSERT_OK_AND_ASSIGN(v1::StatusResponse status, c->Status());
    uint64_t planned = 0;
    int holding = 0;
    for (const v1::ShardStatus& s : status.shards()) {
      planned += s.memory_planned_bytes();
      if (s.memory_planned_bytes() > 0) ++holding;
    }
    const plan::PlanLine* total = report->Find("shards", "total_bytes");
    ASSERT_NE(total, nullptr);
    EXPECT_EQ(planned, static_cast<uint64_t>(total->value));
    EXPECT_EQ(holding, n);
  }
}

}  // namespace
}  // namespace harness
}  // namespace optimus
