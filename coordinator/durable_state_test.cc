// The coordinator's durable state: a restarted coordinator (a new core over
// the same state folder) knows every shard, job, map and joined worker; a
// corrupted state file is refused by name; a save that fails changes nothing.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/durable_file.h"
#include "coordinator/coordinator.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/optimus.pb.h"

namespace optimus {
namespace {

using ::testing::HasSubstr;

std::string FreshDir(const std::string& name) {
  const char* t = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(t != nullptr ? t : "/tmp", "/", name);
  ::mkdir(dir.c_str(), 0755);
  ::unlink((dir + "/coordinator.state").c_str());
  return dir;
}

CoordinatorOptions Options(const std::string& dir) {
  CoordinatorOptions o;
  o.state_dir = dir;
  return o;
}

v1::RegisterShardRequest Shard(const std::string& host) {
  v1::RegisterShardRequest req;
  v1::ShardCapabilities* c = req.mutable_capabilities();
  c->set_kind(v1::SHARD_KIND_HOST);
  c->set_memory_limit_bytes(64 << 20);
  c->set_data_address("ucx-" + host);
  c->set_hostname(host);
  return req;
}

v1::CreateJobRequest Job(const std::string& name) {
  v1::CreateJobRequest req;
  v1::JobSpec* s = req.mutable_spec();
  s->set_name(name);
  s->set_world_size(2);
  v1::TensorSpec* t = s->add_tensors();
  t->set_name("w");
  t->add_shape(1000);
  t->add_shape(700);
  s->mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  s->mutable_optimizer()->set_lr(1e-3f);
  s->set_grad_dtype(v1::DTYPE_BF16);
  s->set_param_dtype(v1::DTYPE_BF16);
  s->set_max_chunk_bytes(256 * 1024);
  return req;
}

v1::JoinJobRequest Join(const std::string& name, uint32_t rank) {
  v1::JoinJobRequest req;
  req.set_job_name(name);
  req.set_rank(rank);
  req.set_world_size(2);
  return req;
}

TEST(DurableStateTest, RestartKnowsShardsJobsMapsAndWorkers) {
  const std::string dir = FreshDir("restart");
  v1::ShardMap map_before;
  {
    Coordinator c(Options(dir));
    ASSERT_TRUE(c.Recover().ok());
    ASSERT_EQ(c.RegisterShard(Shard("a"))->shard_id(), 1u);
    ASSERT_EQ(c.RegisterShard(Shard("b"))->shard_id(), 2u);
    auto job = c.CreateJob(Job("llm"));
    ASSERT_TRUE(job.ok()) << job.status();
    map_before = job->map();
    ASSERT_TRUE(c.JoinJob(Join("llm", 0)).ok());
  }  // The coordinator is gone; only the folder remains.

  Coordinator c(Options(dir));
  ASSERT_TRUE(c.Recover().ok());
  v1::StatusResponse st = c.Status();
  ASSERT_EQ(st.shards_size(), 2);
  EXPECT_EQ(st.shards(0).state(), v1::SHARD_STATE_UP);
  EXPECT_EQ(st.shards(1).capabilities().hostname(), "b");
  ASSERT_EQ(st.jobs_size(), 1);
  EXPECT_EQ(st.jobs(0).name(), "llm");
  EXPECT_EQ(st.jobs(0).workers_joined(), 1u);
  EXPECT_EQ(st.jobs(0).num_params(), 700000u);

  auto map = c.GetShardMap(st.jobs(0).job_id());
  ASSERT_TRUE(map.ok());
  EXPECT_EQ(map->SerializeAsString(), map_before.SerializeAsString());

  // The old shards heartbeat under their ids and get their assignment.
  v1::HeartbeatRequest beat;
  beat.set_shard_id(2);
  v1::HeartbeatResponse resp = c.Heartbeat(beat);
  EXPECT_TRUE(resp.known());
  ASSERT_EQ(resp.assignments_size(), 1);
  EXPECT_EQ(resp.assignments(0).job_id(), st.jobs(0).job_id());

  // Ids are never reused and names stay taken.
  EXPECT_EQ(c.RegisterShard(Shard("c"))->shard_id(), 3u);
  EXPECT_EQ(c.CreateJob(Job("llm")).status().code(), absl::StatusCode::kAlreadyExists);
  auto second = c.CreateJob(Job("other"));
  ASSERT_TRUE(second.ok());
  EXPECT_GT(second->job_id(), st.jobs(0).job_id());
  // Rank 1 joins the recovered job.
  EXPECT_TRUE(c.JoinJob(Join("llm", 1)).ok());
}

TEST(DurableStateTest, CorruptedStateIsRefusedNamingTheFile) {
  const std::string dir = FreshDir("corrupt");
  {
    Coordinator c(Options(dir));
    ASSERT_TRUE(c.Recover().ok());
    ASSERT_TRUE(c.RegisterShard(Shard("a")).ok());
    ASSERT_TRUE(c.CreateJob(Job("llm")).ok());
  }
  const std::string path = dir + "/coordinator.state";
  std::string raw = *ReadWholeFile(path);
  raw[raw.size() / 2] ^= 0x20;
  ASSERT_TRUE(WriteFileAtomically(path, raw).ok());

  Coordinator c(Options(dir));
  absl::Status s = c.Recover();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), HasSubstr(path));
  EXPECT_EQ(c.Status().jobs_size(), 0);
  // A server over that folder does not start.
  CoordinatorOptions o = Options(dir);
  EXPECT_FALSE(CoordinatorServer::Start(o).ok());
}

TEST(DurableStateTest, FailedSaveIsReportedAndChangesNothing) {
  const std::string dir = FreshDir("failed_save");
  Coordinator c(Options(dir));
  ASSERT_TRUE(c.Recover().ok());
  ASSERT_TRUE(c.RegisterShard(Shard("a")).ok());
  // The save's temporary file cannot be created (a folder is in the way).
  const std::string blocker = dir + "/coordinator.state.tmp";
  ASSERT_EQ(::mkdir(blocker.c_str(), 0755), 0);

  auto job = c.CreateJob(Job("llm"));
  EXPECT_FALSE(job.ok());
  EXPECT_THAT(std::string(job.status().message()), HasSubstr("saving coordinator state"));
  EXPECT_EQ(c.Status().jobs_size(), 0);
  EXPECT_FALSE(c.RegisterShard(Shard("b")).ok());
  EXPECT_EQ(c.Status().shards_size(), 1);

  ::rmdir(blocker.c_str());
  // Nothing was half-done: the job can be created now, and the next shard
  // gets the next id.
  EXPECT_TRUE(c.CreateJob(Job("llm")).ok());
  EXPECT_EQ(c.RegisterShard(Shard("b"))->shard_id(), 2u);
  Coordinator again(Options(dir));
  ASSERT_TRUE(again.Recover().ok());
  EXPECT_EQ(again.Status().jobs_size(), 1);
  EXPECT_EQ(again.Status().shards_size(), 2);
}

}  // namespace
}  // namespace optimus
