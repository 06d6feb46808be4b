// The coordinator's durable state: a restarted coordinator (a new core over
// the same state folder) knows every shard, job, map and joined worker; a
// corrupted state file is refused by name; a save that fails changes nothing.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_files.h"
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

// A FAILED job is rolled back at most once, restarts included: the attempt
// is saved before it is made (one that took the coordinator down is not
// repeated at every restart), and a failed one is recorded with its reason,
// which status shows.
TEST(DurableStateTest, ARollbackIsTriedOnceAndItsFailureIsRemembered) {
  const std::string dir = FreshDir("rollback");
  const std::string ckpt_dir = FreshDir("rollback-ckpt");
  CoordinatorOptions o = Options(dir);
  o.checkpoint_dir = ckpt_dir;  // Empty: the job has no checkpoint to go back to.
  {
    Coordinator c(o);
    ASSERT_TRUE(c.Recover().ok());
    ASSERT_EQ(c.RegisterShard(Shard("a"))->shard_id(), 1u);
    ASSERT_TRUE(c.CreateJob(Job("llm")).ok());
    // The only shard's lease runs out: the job FAILED.
    EXPECT_EQ(c.SweepExpiredLeases(absl::Now() + absl::Hours(1)), 1);
    ASSERT_EQ(c.Status().jobs(0).state(), v1::JOB_STATE_FAILED);
    EXPECT_EQ(c.RollbackFailedJobs(), 0);
    const v1::JobStatus j = c.Status().jobs(0);
    EXPECT_THAT(j.rollback_error(), HasSubstr("NOT_FOUND")) << j.rollback_error();
    EXPECT_EQ(c.RollbackFailedJobs(), 0);  // Not tried again.
  }
  // Now a complete checkpoint of the job exists, so a new attempt would
  // succeed: the restarted coordinator must still not make one.
  const std::string folder = absl::StrCat(ckpt_dir, "/llm/", ckpt::FolderName(5));
  ASSERT_TRUE(ckpt::MakeDirs(folder).ok());
  v1::CheckpointManifest m;
  m.set_format_version(ckpt::kFormatVersion);
  m.set_job_name("llm");
  m.set_checkpoint_id(5);
  m.set_step(5);
  *m.mutable_spec() = Job("llm").spec();
  m.set_dtype("fp32");
  for (const char* a : {"master", "exp_avg", "exp_avg_sq"}) m.add_arrays(a);
  const std::vector<float> zeros(700000, 0.0f);
  const float* arrays[] = {zeros.data(), zeros.data(), zeros.data()};
  auto file = ckpt::WriteDataFile(folder, "w.0", 0, 0, zeros.size(), arrays);
  ASSERT_TRUE(file.ok()) << file.status();
  *m.add_files() = *file;
  ASSERT_TRUE(ckpt::WriteManifest(folder, m).ok());

  Coordinator c(o);
  ASSERT_TRUE(c.Recover().ok());
  ASSERT_EQ(c.Status().jobs_size(), 1);
  EXPECT_EQ(c.Status().jobs(0).state(), v1::JOB_STATE_FAILED);
  EXPECT_FALSE(c.Status().jobs(0).rollback_error().empty());
  v1::RegisterShardRequest b = Shard("b");
  b.mutable_capabilities()->set_checkpoints(true);
  ASSERT_TRUE(c.RegisterShard(b).ok());
  // The restarted coordinator does not try again.
  EXPECT_EQ(c.RollbackFailedJobs(), 0);
  EXPECT_EQ(c.Status().jobs_size(), 1);
  // An operator still can (the checkpoint is good): optimusctl checkpoint
  // restore does this.
  v1::RestoreCheckpointRequest req;
  req.set_job_name("llm");
  req.set_new_job_name("llm-restored");
  auto restored = c.RestoreCheckpoint(req);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->resume_step(), 5u);
}

TEST(DurableStateTest, RestartKeepsBackupsAndDrainingShards) {
  const std::string dir = FreshDir("replication");
  v1::ShardMap map_before;
  v1::StatusResponse st_before;
  {
    Coordinator c(Options(dir));
    ASSERT_TRUE(c.Recover().ok());
    for (const char* host : {"a", "b", "c"}) ASSERT_TRUE(c.RegisterShard(Shard(host)).ok());
    v1::CreateJobRequest job = Job("llm");
    job.mutable_spec()->set_replication(1);
    auto created = c.CreateJob(job);
    ASSERT_TRUE(created.ok()) << created.status();
    map_before = created->map();
    v1::DrainShardRequest drain;
    drain.set_shard_id(3);
    ASSERT_TRUE(c.DrainShard(drain).ok());
    // Every shard reports its backups seeded.
    for (uint64_t id = 1; id <= 3; ++id) {
      v1::HeartbeatRequest beat;
      beat.set_shard_id(id);
      v1::ShardJobProgress* p = beat.add_jobs();
      p->set_job_id(created->job_id());
      p->set_map_epoch(1);
      uint32_t backups = 0, total = 0;
      for (const auto& ch : map_before.chunks()) {
        backups += ch.backup_shard_id() == id;
        total += (ch.backup_shard_id() == id) + (ch.shard_id() == id);
      }
      p->set_chunks_loaded(total);
      p->set_backup_chunks(backups);
      p->set_backups_seeded(backups);
      c.Heartbeat(beat);
    }
    st_before = c.Status();
    ASSERT_EQ(st_before.jobs(0).backups_in_sync(), st_before.jobs(0).num_chunks());
  }

  Coordinator c(Options(dir));
  ASSERT_TRUE(c.Recover().ok());
  const v1::StatusResponse st = c.Status();
  ASSERT_EQ(st.shards_size(), 3);
  EXPECT_EQ(st.shards(2).state(), v1::SHARD_STATE_DRAINING);
  for (int i = 0; i < 3; ++i) {
    // Backups still count in chunks and memory.
    EXPECT_EQ(st.shards(i).chunks_owned(), st_before.shards(i).chunks_owned()) << i;
    EXPECT_EQ(st.shards(i).backup_chunks(), st_before.shards(i).backup_chunks()) << i;
    EXPECT_GT(st.shards(i).backup_chunks(), 0u) << i;
    EXPECT_EQ(st.shards(i).memory_planned_bytes(), st_before.shards(i).memory_planned_bytes());
  }
  auto map = c.GetShardMap(st.jobs(0).job_id());
  ASSERT_TRUE(map.ok());
  EXPECT_EQ(map->SerializeAsString(), map_before.SerializeAsString());
  EXPECT_EQ(st.jobs(0).replication(), 1u);
  EXPECT_EQ(st.jobs(0).chunks_with_backup(), st.jobs(0).num_chunks());
  // Whether backups are in sync is not saved: the next heartbeats say.
  EXPECT_EQ(st.jobs(0).backups_in_sync(), 0u);
  // The draining shard heartbeats under its id and still gets its job.
  v1::HeartbeatRequest beat;
  beat.set_shard_id(3);
  v1::HeartbeatResponse resp = c.Heartbeat(beat);
  EXPECT_TRUE(resp.known());
  EXPECT_EQ(resp.assignments_size(), 1);
  // New jobs avoid it.
  auto other = c.CreateJob(Job("other"));
  ASSERT_TRUE(other.ok()) << other.status();
  for (const auto& ch : other->map().chunks()) EXPECT_NE(ch.shard_id(), 3u);
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
