#include "cli/status.h"

#include <string>

#include "cli/drain.h"
#include "cli/output.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "yaml-cpp/yaml.h"

namespace optimus {

// The document `text` holds; discarded (and a test failure) when it is not
// valid JSON.
Json ParseOrFail(const std::string& text) {
  Json doc = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(doc.is_discarded()) << "not JSON: " << text;
  return doc;
}

namespace {

using ::testing::HasSubstr;

v1::StatusResponse Sample() {
  v1::StatusResponse st;
  v1::ShardStatus* s = st.add_shards();
  s->set_shard_id(1);
  s->mutable_capabilities()->set_kind(v1::SHARD_KIND_DPU);
  s->mutable_capabilities()->set_arch("aarch64");
  s->mutable_capabilities()->set_cores(8);
  s->mutable_capabilities()->set_hostname("bf-\"01\"\n");
  s->mutable_capabilities()->set_memory_limit_bytes(uint64_t{16} << 30);
  s->set_state(v1::SHARD_STATE_UP);
  s->set_memory_used_bytes(uint64_t{2} << 30);
  s->set_memory_planned_bytes(uint64_t{3} << 30);
  s->set_chunks_owned(12);
  s->set_transports("rc_mlx5,sysv,cma");
  s->set_lease_age_ms(250);
  v1::ShardStatus* h = st.add_shards();
  h->set_shard_id(2);
  h->mutable_capabilities()->set_kind(v1::SHARD_KIND_HOST);
  // More than 2^53: must survive as an exact integer.
  h->mutable_capabilities()->set_memory_limit_bytes((uint64_t{1} << 60) + 1);
  h->set_state(v1::SHARD_STATE_DOWN);
  h->set_lease_age_ms(3200);
  v1::JobStatus* j = st.add_jobs();
  j->set_job_id(5);
  j->set_name("llama-70b");
  j->set_state(v1::JOB_STATE_READY);
  j->set_world_size(8);
  j->set_workers_joined(3);
  j->set_current_step(41);
  j->set_num_tensors(723);
  j->set_num_params(70000000000);
  j->set_state_bytes(840000000000);
  j->set_map_epoch(2);
  return st;
}

TEST(HumanBytesTest, UsesBinaryUnits) {
  EXPECT_EQ(HumanBytes(0), "0 B");
  EXPECT_EQ(HumanBytes(1023), "1023 B");
  EXPECT_EQ(HumanBytes(1536), "1.5 KiB");
  EXPECT_EQ(HumanBytes(uint64_t{16} << 30), "16.0 GiB");
  EXPECT_EQ(HumanBytes(~uint64_t{0}), "16.0 EiB");
}

TEST(RenderStatusJsonTest, IsValidJsonWithNumbersAsNumbers) {
  const std::string text = RenderStatusJson(Sample());
  Json doc = ParseOrFail(text);
  ASSERT_FALSE(doc.is_discarded()) << "\n" << text;
  const Json& shards = doc["shards"];
  ASSERT_EQ(shards.size(), 2u);
  EXPECT_EQ(shards[0]["kind"].get<std::string>(), "dpu");
  EXPECT_EQ(shards[0]["hostname"].get<std::string>(), "bf-\"01\"\n");  // Escaped and back.
  EXPECT_EQ(shards[0]["state"].get<std::string>(), "up");
  EXPECT_TRUE(shards[0]["memory_used_bytes"].is_number_integer());
  EXPECT_EQ(shards[0]["memory_used_bytes"].get<uint64_t>(), uint64_t{2} << 30);
  EXPECT_EQ(shards[0]["memory_planned_bytes"].get<uint64_t>(), uint64_t{3} << 30);
  EXPECT_EQ(shards[0]["chunks_owned"].get<uint64_t>(), 12u);
  EXPECT_EQ(shards[0]["lease_age_ms"].get<uint64_t>(), 250u);
  EXPECT_EQ(shards[0]["transports"].get<std::string>(), "rc_mlx5,sysv,cma");
  EXPECT_EQ(shards[1]["transports"].get<std::string>(), "");
  EXPECT_EQ(shards[1]["kind"].get<std::string>(), "host");
  EXPECT_EQ(shards[1]["state"].get<std::string>(), "down");
  EXPECT_EQ(shards[1]["memory_limit_bytes"].get<uint64_t>(), (uint64_t{1} << 60) + 1);
  const Json& jobs = doc["jobs"];
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0]["name"].get<std::string>(), "llama-70b");
  EXPECT_EQ(jobs[0]["state"].get<std::string>(), "ready");
  EXPECT_EQ(jobs[0]["world_size"].get<uint64_t>(), 8u);
  EXPECT_EQ(jobs[0]["workers_joined"].get<uint64_t>(), 3u);
  EXPECT_EQ(jobs[0]["current_step"].get<uint64_t>(), 41u);
  EXPECT_EQ(jobs[0]["num_params"].get<uint64_t>(), 70000000000u);
  EXPECT_EQ(jobs[0]["state_bytes"].get<uint64_t>(), 840000000000u);
  EXPECT_EQ(jobs[0]["map_epoch"].get<uint64_t>(), 2u);
}

TEST(RenderStatusJsonTest, EmptyClusterIsEmptyArrays) {
  Json doc = ParseOrFail(RenderStatusJson(v1::StatusResponse()));
  ASSERT_FALSE(doc.is_discarded());
  EXPECT_TRUE(doc["shards"].is_array());
  EXPECT_TRUE(doc["shards"].empty());
  EXPECT_TRUE(doc["jobs"].empty());
}

TEST(RenderStatusTableTest, ShowsHumanReadableRowsUnderAlignedHeaders) {
  const std::string table = RenderStatusTable(Sample());
  EXPECT_THAT(table, HasSubstr("SHARDS (2)"));
  EXPECT_THAT(table, HasSubstr("JOBS (1)"));
  EXPECT_THAT(table, HasSubstr("2.0 GiB / 16.0 GiB"));
  EXPECT_THAT(table, HasSubstr("250ms"));
  EXPECT_THAT(table, HasSubstr("3.2s"));
  EXPECT_THAT(table, HasSubstr("TRANSPORTS"));
  EXPECT_THAT(table, HasSubstr("rc_mlx5,sysv,cma"));
  EXPECT_THAT(table, HasSubstr("DOWN"));
  EXPECT_THAT(table, HasSubstr("llama-70b"));
  EXPECT_THAT(table, HasSubstr("3/8"));
  EXPECT_THAT(table, HasSubstr("782.3 GiB"));  // 840e9 state bytes.
  // Column alignment: "KIND" in the header starts where "dpu" starts below.
  const size_t header = table.find("ID  KIND");
  ASSERT_NE(header, std::string::npos);
  const size_t header_start = table.rfind('\n', header) + 1;
  const size_t row_start = table.find('\n', header) + 1;
  EXPECT_EQ(table.find("KIND", header_start) - header_start, table.find("dpu", row_start) - row_start);
}

// A name is whatever bytes a client sent: the JSON stays valid UTF-8 (bad
// bytes become U+FFFD) and the YAML says the same.
TEST(RenderStatusJsonTest, InvalidUtf8InANameStillGivesValidJsonAndYaml) {
  v1::StatusResponse st;
  v1::JobStatus* j = st.add_jobs();
  j->set_job_id(1);
  j->set_name(std::string("bad\xff\xfe-name-\xc3\xa9"));
  const std::string text = RenderStatusJson(st);
  Json doc = ParseOrFail(text);
  ASSERT_FALSE(doc.is_discarded());
  EXPECT_EQ(doc["jobs"][0]["name"].get<std::string>(), "bad\xef\xbf\xbd\xef\xbf\xbd-name-\xc3\xa9");
  const YAML::Node yaml = YAML::Load(ToYamlText(StatusToJson(st)));
  EXPECT_EQ(yaml["jobs"][0]["name"].as<std::string>(),
            "bad\xef\xbf\xbd\xef\xbf\xbd-name-\xc3\xa9");
}

}  // namespace
}  // namespace optimus

namespace optimus {
namespace {

TEST(RenderStatusTest, ShowsEachJobsLastCheckpoint) {
  v1::StatusResponse st;
  v1::JobStatus* a = st.add_jobs();
  a->set_job_id(1);
  a->set_name("with");
  v1::CheckpointInfo* c = a->mutable_last_checkpoint();
  c->set_checkpoint_id(3);
  c->set_step(1200);
  c->set_state(v1::CHECKPOINT_STATE_FAILED);
  c->set_error("cannot write /ckpt/x: No space left on device");
  v1::JobStatus* b = st.add_jobs();
  b->set_job_id(2);
  b->set_name("without");
  const std::string table = RenderStatusTable(st);
  EXPECT_THAT(table, ::testing::HasSubstr("LAST CHECKPOINT"));
  EXPECT_THAT(table, ::testing::HasSubstr("#3 step 1200 FAILED"));
  Json doc = ParseOrFail(RenderStatusJson(st));
  ASSERT_FALSE(doc.is_discarded());
  const Json& jobs = doc["jobs"];
  EXPECT_EQ(jobs[0]["last_checkpoint"]["step"].get<uint64_t>(), 1200u);
  EXPECT_EQ(jobs[0]["last_checkpoint"]["state"].get<std::string>(), "failed");
  EXPECT_EQ(jobs[0]["last_checkpoint"]["error"].get<std::string>(),
            "cannot write /ckpt/x: No space left on device");
  EXPECT_TRUE(jobs[1]["last_checkpoint"].is_null());
}

}  // namespace
}  // namespace optimus

namespace optimus {
namespace {

v1::JobStatus Replicated(uint32_t replication, uint32_t chunks, uint32_t with_backup,
                         uint32_t in_sync) {
  v1::JobStatus j;
  j.set_job_id(1);
  j.set_name("j");
  j.set_replication(replication);
  j.set_num_chunks(chunks);
  j.set_chunks_with_backup(with_backup);
  j.set_backups_in_sync(in_sync);
  return j;
}

TEST(ReplicaHealthTest, SaysWhetherALostShardCostsAStep) {
  EXPECT_EQ(ReplicaHealth(Replicated(0, 40, 0, 0)), "-");
  EXPECT_STREQ(ReplicaHealthWord(Replicated(0, 40, 0, 0)), "none");
  EXPECT_EQ(ReplicaHealth(Replicated(0, 40, 3, 1)), "moving 3");  // A drain in progress.
  EXPECT_EQ(ReplicaHealth(Replicated(1, 40, 40, 40)), "40/40 in sync");
  EXPECT_STREQ(ReplicaHealthWord(Replicated(1, 40, 40, 40)), "in_sync");
  EXPECT_EQ(ReplicaHealth(Replicated(1, 40, 40, 38)), "syncing 38/40");
  EXPECT_EQ(ReplicaHealth(Replicated(1, 40, 38, 38)), "degraded 38/40");
  EXPECT_STREQ(ReplicaHealthWord(Replicated(1, 40, 38, 38)), "degraded");
}

TEST(RenderStatusTest, ShowsDrainingShardsBackupsAndReplicas) {
  v1::StatusResponse st;
  v1::ShardStatus* s = st.add_shards();
  s->set_shard_id(4);
  s->mutable_capabilities()->set_kind(v1::SHARD_KIND_DPU);
  s->set_state(v1::SHARD_STATE_DRAINING);
  s->set_chunks_owned(9);
  s->set_backup_chunks(4);
  *st.add_jobs() = Replicated(1, 40, 38, 38);
  *st.add_jobs() = Replicated(0, 12, 0, 0);
  const std::string table = RenderStatusTable(st);
  EXPECT_THAT(table, HasSubstr("DRAINING"));
  EXPECT_THAT(table, HasSubstr("BACKUPS"));
  EXPECT_THAT(table, HasSubstr("REPLICAS"));
  EXPECT_THAT(table, HasSubstr("degraded 38/40"));
  // The shard row: 9 chunks, 4 of them backups, in their own columns.
  EXPECT_THAT(table, ::testing::ContainsRegex("DRAINING +0 B / 0 B +0 B +9 +4 "));

  Json doc = ParseOrFail(RenderStatusJson(st));
  ASSERT_FALSE(doc.is_discarded());
  const Json& shard = doc["shards"][0];
  EXPECT_EQ(shard["state"].get<std::string>(), "draining");
  EXPECT_EQ(shard["chunks_owned"].get<uint64_t>(), 9u);
  EXPECT_EQ(shard["backup_chunks"].get<uint64_t>(), 4u);
  const Json& job = doc["jobs"][0];
  EXPECT_EQ(job["replication"].get<uint64_t>(), 1u);
  EXPECT_EQ(job["num_chunks"].get<uint64_t>(), 40u);
  EXPECT_EQ(job["chunks_with_backup"].get<uint64_t>(), 38u);
  EXPECT_EQ(job["backups_in_sync"].get<uint64_t>(), 38u);
  EXPECT_EQ(job["replicas"].get<std::string>(), "degraded");
  EXPECT_EQ(doc["jobs"][1]["replicas"].get<std::string>(), "none");
}

// Two jobs as the coordinator reports them: "grouped" (AdamW, groups
// "decay" with its own beta2 and "no_decay" with wd 0 and lr x0.5, one
// frozen tensor, clipping at 1, non-finite steps kept) and "plain" (SGD
// with momentum 0.9, the implicit group only, non-finite steps skipped).
v1::StatusResponse WithOptimizers() {
  v1::StatusResponse st;
  v1::JobStatus* g = st.add_jobs();
  g->set_job_id(1);
  g->set_name("grouped");
  v1::OptimizerConfig* opt = g->mutable_optimizer();
  opt->set_kind(v1::OPTIMIZER_ADAMW);
  opt->set_lr(3e-4f);
  opt->set_beta1(0.9f);
  opt->set_beta2(0.999f);
  opt->set_eps(1e-8f);
  opt->set_weight_decay(0.01f);
  v1::ParamGroupStatus* decay = g->add_param_groups();
  decay->mutable_group()->set_name("decay");
  decay->mutable_group()->set_weight_decay(0.1f);
  decay->mutable_group()->set_beta2(0.95f);
  decay->set_num_tensors(3);
  decay->set_num_elems(1000);
  v1::ParamGroupStatus* no_decay = g->add_param_groups();
  no_decay->mutable_group()->set_name("no_decay");
  no_decay->mutable_group()->set_weight_decay(0);
  no_decay->mutable_group()->set_lr_mult(0.5f);
  no_decay->set_num_tensors(2);
  no_decay->set_num_elems(24);
  g->set_frozen_tensors(1);
  g->set_max_grad_norm(1.0f);
  g->set_keep_nonfinite(true);
  v1::JobStatus* p = st.add_jobs();
  p->set_job_id(2);
  p->set_name("plain");
  p->mutable_optimizer()->set_kind(v1::OPTIMIZER_SGD);
  p->mutable_optimizer()->set_lr(0.1f);
  p->mutable_optimizer()->set_momentum(0.9f);
  v1::ParamGroupStatus* implicit = p->add_param_groups();
  implicit->set_num_tensors(4);
  implicit->set_num_elems(4096);
  return st;
}

TEST(RenderStatusTest, ShowsParamGroupsFrozenTensorsClippingAndNonFinite) {
  const std::string table = RenderStatusTable(WithOptimizers());
  EXPECT_THAT(table, HasSubstr("OPTIMIZERS (2)"));
  EXPECT_THAT(table, HasSubstr("BETAS/MOMENTUM"));
  // grouped: the job's columns on its first group's row, then the group's
  // own values (beta2 0.95, wd 0.1) and the optimizer's where unset (lr x1).
  EXPECT_THAT(table, ::testing::ContainsRegex(
                         "grouped +adamw +0.0003 +1 +keep +1 +0 decay +3 +1000 +1 +0.1 +0.9, 0.95"));
  EXPECT_THAT(table, ::testing::ContainsRegex("\n +1 no_decay +2 +24 +0.5 +0 +0.9, 0.999\n"));
  EXPECT_THAT(table, ::testing::ContainsRegex(
                         "plain +sgd +0.1 +- +skip +0 +0 +4 +4096 +1 +0 +momentum 0.9"));
  // A coordinator that reports no optimizer: no OPTIMIZERS section.
  EXPECT_THAT(RenderStatusTable(Sample()), ::testing::Not(HasSubstr("OPTIMIZERS")));

  Json doc = ParseOrFail(RenderStatusJson(WithOptimizers()));
  ASSERT_FALSE(doc.is_discarded());
  const Json& g = doc["jobs"][0];
  EXPECT_EQ(g["optimizer"]["kind"].get<std::string>(), "adamw");
  EXPECT_EQ(g["optimizer"]["lr"].get<double>(), 0.0003);
  // Floats in their shortest form, not the float's full binary expansion.
  EXPECT_THAT(RenderStatusJson(WithOptimizers()), HasSubstr("\"lr\":0.0003,"));
  EXPECT_EQ(g["frozen_tensors"].get<uint64_t>(), 1u);
  EXPECT_EQ(g["max_grad_norm"].get<double>(), 1);
  EXPECT_FALSE(g["skip_nonfinite"].get<bool>());
  EXPECT_TRUE(g["skip_nonfinite"].is_boolean());
  ASSERT_EQ(g["param_groups"].size(), 2u);
  const Json& decay = g["param_groups"][0];
  EXPECT_EQ(decay["name"].get<std::string>(), "decay");
  EXPECT_EQ(decay["num_tensors"].get<uint64_t>(), 3u);
  EXPECT_EQ(decay["num_elems"].get<uint64_t>(), 1000u);
  EXPECT_EQ(decay["weight_decay"].get<double>(), 0.1);
  EXPECT_EQ(decay["beta2"].get<double>(), 0.95);
  EXPECT_EQ(decay["lr_mult"].get<double>(), 1);
  ASSERT_EQ(decay["overrides"].size(), 2u);
  EXPECT_EQ(decay["overrides"][0].get<std::string>(), "weight_decay");
  EXPECT_EQ(decay["overrides"][1].get<std::string>(), "beta2");
  const Json& no_decay = g["param_groups"][1];
  EXPECT_EQ(no_decay["index"].get<uint64_t>(), 1u);
  EXPECT_EQ(no_decay["lr_mult"].get<double>(), 0.5);
  EXPECT_EQ(no_decay["weight_decay"].get<double>(), 0);
  EXPECT_EQ(no_decay["beta2"].get<double>(), 0.999);
  const Json& p = doc["jobs"][1];
  EXPECT_EQ(p["optimizer"]["kind"].get<std::string>(), "sgd");
  EXPECT_EQ(p["optimizer"]["momentum"].get<double>(), 0.9);
  EXPECT_TRUE(p["skip_nonfinite"].get<bool>());
  EXPECT_EQ(p["max_grad_norm"].get<double>(), 0);
  ASSERT_EQ(p["param_groups"].size(), 1u);
  EXPECT_EQ(p["param_groups"][0]["name"].get<std::string>(), "");
  EXPECT_EQ(p["param_groups"][0]["num_elems"].get<uint64_t>(), 4096u);
  EXPECT_TRUE(p["param_groups"][0]["overrides"].empty());
}

TEST(DrainProgressTest, DrainedOnlyWhileDrainingWithNoChunkLeft) {
  v1::StatusResponse st;
  v1::ShardStatus* s = st.add_shards();
  s->set_shard_id(2);
  s->set_state(v1::SHARD_STATE_DRAINING);
  s->set_chunks_owned(5);
  s->set_backup_chunks(2);
  DrainProgress p = FindDrainProgress(st, 2);
  EXPECT_TRUE(p.found);
  EXPECT_FALSE(p.drained());
  EXPECT_FALSE(p.lost());
  EXPECT_EQ(RenderDrainProgress(2, p), "shard 2: draining, 5 chunks left (2 of them backups)");
  s->set_chunks_owned(0);
  s->set_backup_chunks(0);
  EXPECT_TRUE(FindDrainProgress(st, 2).drained());
  // DOWN before the drain finished: its jobs' chunks no longer count on it,
  // which is not a drain.
  s->set_state(v1::SHARD_STATE_DOWN);
  p = FindDrainProgress(st, 2);
  EXPECT_FALSE(p.drained());
  EXPECT_TRUE(p.lost());
  EXPECT_FALSE(FindDrainProgress(st, 3).found);
}

}  // namespace
}  // namespace optimus
