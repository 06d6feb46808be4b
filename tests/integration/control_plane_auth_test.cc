// The control plane under TLS, attacked from loopback: a cluster with a
// local CA (scripts/make_local_ca.sh) trains a victim job while callers
// without the right certificate or token try to register as a shard,
// heartbeat as another shard (or report a checkpoint for it), drain or forget shards, delete the victim,
// read or join it with another job's token. Each is refused (and counted),
// the shards stay UP, and the victim goes on training to exactly the
// reference parameters.
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/security.h"
#include "gtest/gtest.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace harness {
namespace {

class ControlPlaneAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(ca_, MakeTestCa(3));
    ClusterOptions o;
    o.num_shards = 2;
    o.num_workers = 2;
    o.tls_root = ca_;
    ASSERT_OK_AND_ASSIGN(o.checkpoint_dir, NewTempDir("auth-ckpt"));
    ASSERT_OK_AND_ASSIGN(cluster_, Cluster::Start(o));
    def_ = SmallJob("victim", 2);
    ASSERT_OK(cluster_->CreateJob(def_));
    ASSERT_OK(cluster_->Train(1, 3));
    victim_id_ = cluster_->worker(0)->job_id();
  }

  // A stub as `who` (a folder of the CA: admin, trainer, shard-2, worker).
  std::unique_ptr<v1::Coordinator::Stub> StubAs(const std::string& who) {
    security::TlsOptions t;
    t.dir = absl::StrCat(ca_, "/", who);
    auto ch = security::Dial(cluster_->coordinator_address(), t, "attacker");
    EXPECT_TRUE(ch.ok()) << ch.status();
    return v1::Coordinator::NewStub(*ch);
  }

  static std::unique_ptr<grpc::ClientContext> Ctx(const std::string& token = "") {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!token.empty()) ctx->AddMetadata("authorization", "Bearer " + token);
    return ctx;
  }

  // The victim is untouched: every shard still UP, and it trains on to
  // the reference's parameters bit for bit.
  void ExpectVictimUnharmed(uint64_t first_step, uint64_t last_step) {
    ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, cluster_->Status());
    ASSERT_EQ(st.shards_size(), 2) << "a shard appeared or vanished";
    for (const auto& s : st.shards()) EXPECT_EQ(s.state(), v1::SHARD_STATE_UP) << s.shard_id();
    ASSERT_OK(cluster_->Train(first_step, last_step));
    for (uint32_t t = 0; t < def_.tensors.size(); ++t) {
      ASSERT_OK_AND_ASSIGN(const std::vector<float> got, cluster_->PullFp32(t, last_step + 1));
      ASSERT_OK_AND_ASSIGN(const std::vector<float> want, ReferenceParams(def_, t, last_step));
      EXPECT_EQ(got, want) << "tensor " << t;
    }
  }

  std::string ca_;
  std::unique_ptr<Cluster> cluster_;
  client::JobDef def_;
  uint64_t victim_id_ = 0;
};

v1::RegisterShardRequest RogueShard() {
  v1::RegisterShardRequest req;
  req.mutable_capabilities()->set_kind(v1::SHARD_KIND_DPU);
  req.mutable_capabilities()->set_memory_limit_bytes(uint64_t{64} << 30);
  req.mutable_capabilities()->set_data_address("rogue");
  return req;
}

TEST_F(ControlPlaneAuthTest, RogueShardRegistrationIsRefused) {
  for (const std::string who : {"worker", "trainer", "admin"}) {
    v1::RegisterShardResponse resp;
    const absl::Status s = FromGrpc(StubAs(who)->RegisterShard(Ctx().get(), RogueShard(), &resp));
    if (who == "worker") {
      EXPECT_TRUE(absl::IsUnauthenticated(s)) << who << ": " << s;
    } else {
      EXPECT_TRUE(absl::IsPermissionDenied(s)) << who << ": " << s;
    }
  }
  // A job created now lands on the real shards only.
  ExpectVictimUnharmed(4, 6);
}

TEST_F(ControlPlaneAuthTest, PlainTextCallerGetsNowhere) {
  auto stub = v1::Coordinator::NewStub(grpc::CreateChannel(cluster_->coordinator_address(),
                                                           grpc::InsecureChannelCredentials()));
  v1::RegisterShardResponse resp;
  const absl::Status s = FromGrpc(stub->RegisterShard(Ctx().get(), RogueShard(), &resp));
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;  // No TLS handshake, no call.
  ExpectVictimUnharmed(4, 5);
}

TEST_F(ControlPlaneAuthTest, HeartbeatAsAnotherShardIsRefusedAndFailureStillDetected) {
  // shard-2's certificate is valid, but it did not register shard 1.
  const uint64_t target = cluster_->shard(0)->shard_id();
  auto impostor = StubAs("shard-2");
  v1::HeartbeatRequest hb;
  hb.set_shard_id(target);
  v1::HeartbeatResponse resp;
  absl::Status s = FromGrpc(impostor->Heartbeat(Ctx().get(), hb, &resp));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  // Without a certificate at all.
  s = FromGrpc(StubAs("worker")->Heartbeat(Ctx().get(), hb, &resp));
  EXPECT_TRUE(absl::IsUnauthenticated(s)) << s;
  ExpectVictimUnharmed(4, 5);

  // The impostor keeps beating for shard 0 after it dies: it is still
  // marked DOWN once its lease runs out.
  ASSERT_OK(cluster_->KillShard(0));
  std::atomic<bool> stop{false};
  std::thread beating([&] {
    while (!stop.load()) {
      v1::HeartbeatResponse r;
      (void)impostor->Heartbeat(Ctx().get(), hb, &r);
      absl::SleepFor(absl::Milliseconds(50));
    }
  });
  const absl::Status down = cluster_->WaitStatus("shard 0 DOWN", [&](const v1::StatusResponse& st) {
    for (const auto& sh : st.shards()) {
      if (sh.shard_id() == target) return sh.state() == v1::SHARD_STATE_DOWN;
    }
    return false;
  });
  stop = true;
  beating.join();
  ASSERT_OK(down);
}

// A checkpoint report naming a file outside the checkpoint's folder (the
// `../../dev/zero` that once crash-looped the coordinator), sent in a
// heartbeat by a certificate that did not register the shard it speaks
// for: refused, and the checkpoint in progress completes from the real
// shards' reports. (A shard that owns chunks and lies fails the checkpoint
// instead: coordinator/checkpoints_test.cc.)
TEST_F(ControlPlaneAuthTest, ForgedCheckpointReportIsRefused) {
  ASSERT_OK(cluster_->WaitApplied("victim", 3));
  ASSERT_OK_AND_ASSIGN(v1::CheckpointInfo info, cluster_->CreateCheckpoint("victim"));
  v1::HeartbeatRequest hb;
  hb.set_shard_id(cluster_->shard(0)->shard_id());
  v1::ShardCheckpointReport* r = hb.add_checkpoints();
  r->set_job_id(victim_id_);
  r->set_checkpoint_id(info.checkpoint_id());
  r->set_done(true);
  v1::CheckpointFile* f = r->add_files();
  f->set_name("../../../../dev/zero");
  f->set_num_elems(1);
  f->set_num_arrays(3);
  f->set_size_bytes(uint64_t{1} << 40);
  for (const std::string who : {"shard-2", "trainer", "admin", "worker"}) {
    v1::HeartbeatResponse resp;
    const absl::Status s = FromGrpc(StubAs(who)->Heartbeat(Ctx().get(), hb, &resp));
    if (who == "worker") {
      EXPECT_TRUE(absl::IsUnauthenticated(s)) << who << ": " << s;
    } else {
      EXPECT_TRUE(absl::IsPermissionDenied(s)) << who << ": " << s;
    }
  }
  // The shards wait at step 3 (no training meanwhile, so they cannot pass
  // the checkpoint's step before its order reaches them).
  ASSERT_OK_AND_ASSIGN(v1::CheckpointInfo done,
                       cluster_->WaitCheckpoint("victim", info.checkpoint_id()));
  EXPECT_EQ(done.state(), v1::CHECKPOINT_STATE_COMPLETE) << done.error();
  EXPECT_EQ(done.step(), info.step());
  ExpectVictimUnharmed(4, 6);
}

// A job that is gone (deleted, or replaced by its own roll-back before its
// workers saw it FAILED) reads as NOT_FOUND to its token holders, which is
// how their clients learn to re-join by name; an id never issued stays
// refused, so a token cannot read a job created after the check.
TEST_F(ControlPlaneAuthTest, AGoneJobIsNotFoundForItsTokenAndUnissuedIdsAreRefused) {
  const std::string token = cluster_->worker(0)->job_token();
  ASSERT_FALSE(token.empty());
  auto stub = StubAs("worker");
  v1::GetJobRequest get;
  get.set_job_id(victim_id_ + 1000);
  v1::GetJobResponse job;
  absl::Status s = FromGrpc(stub->GetJob(Ctx(token).get(), get, &job));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  v1::DeleteJobRequest del;
  del.set_job_name("victim");
  del.set_force(true);
  v1::DeleteJobResponse deleted;
  ASSERT_OK(FromGrpc(cluster_->stub()->DeleteJob(Ctx().get(), del, &deleted)));
  get.set_job_id(victim_id_);
  s = FromGrpc(stub->GetJob(Ctx(token).get(), get, &job));
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  // Without the token it is still refused, gone or not.
  s = FromGrpc(stub->GetJob(Ctx().get(), get, &job));
  EXPECT_TRUE(absl::IsUnauthenticated(s) || absl::IsPermissionDenied(s)) << s;
}

// One shard's part of the map (GetJob for_shard_id) is for that shard or
// an admin: another shard's certificate, or the job's own token, is
// refused. (The cluster's shards fetch their parts with their own
// certificates: the victim trains.)
TEST_F(ControlPlaneAuthTest, AShardsPartOfTheMapIsForThatShardOnly) {
  const uint64_t target = cluster_->shard(0)->shard_id();
  v1::GetJobRequest get;
  get.set_job_id(victim_id_);
  get.set_for_shard_id(target);
  v1::GetJobResponse job;
  absl::Status s = FromGrpc(StubAs("shard-2")->GetJob(Ctx().get(), get, &job));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  s = FromGrpc(StubAs("worker")->GetJob(Ctx(cluster_->worker(0)->job_token()).get(), get, &job));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  ASSERT_OK(FromGrpc(StubAs("admin")->GetJob(Ctx().get(), get, &job)));
  EXPECT_EQ(job.summary().for_shard_id(), target);
  EXPECT_GT(job.map().chunks_size(), 0);
  for (const auto& c : job.map().chunks()) {
    EXPECT_TRUE(c.shard_id() == target || c.backup_shard_id() == target);
  }
  ExpectVictimUnharmed(4, 5);
}

TEST_F(ControlPlaneAuthTest, AdminOperationsNeedTheAdminRole) {
  // A worker holding the victim's own token, and a trainer certificate.
  const std::string token = cluster_->worker(0)->job_token();
  ASSERT_FALSE(token.empty());
  for (const std::string who : {"worker", "trainer", "shard-2"}) {
    auto stub = StubAs(who);
    v1::DrainShardRequest drain;
    drain.set_shard_id(cluster_->shard(0)->shard_id());
    v1::DrainShardResponse dr;
    absl::Status s = FromGrpc(stub->DrainShard(Ctx(token).get(), drain, &dr));
    EXPECT_TRUE(absl::IsPermissionDenied(s)) << who << " drain: " << s;
    v1::ForgetShardRequest forget;
    forget.set_shard_id(cluster_->shard(1)->shard_id());
    v1::ForgetShardResponse fr;
    s = FromGrpc(stub->ForgetShard(Ctx(token).get(), forget, &fr));
    EXPECT_TRUE(absl::IsPermissionDenied(s)) << who << " forget: " << s;
    v1::DeleteJobRequest del;
    del.set_job_name("victim");
    del.set_force(true);
    v1::DeleteJobResponse delr;
    s = FromGrpc(stub->DeleteJob(Ctx(token).get(), del, &delr));
    EXPECT_TRUE(absl::IsPermissionDenied(s)) << who << " delete: " << s;
    v1::RestoreCheckpointRequest restore;
    restore.set_job_name("victim");
    v1::RestoreCheckpointResponse rr;
    s = FromGrpc(stub->RestoreCheckpoint(Ctx(token).get(), restore, &rr));
    EXPECT_TRUE(absl::IsPermissionDenied(s)) << who << " restore: " << s;
  }
  // Without certificate or token: not even authenticated.
  v1::DrainShardRequest drain;
  drain.set_shard_id(cluster_->shard(0)->shard_id());
  v1::DrainShardResponse dr;
  const absl::Status s = FromGrpc(StubAs("worker")->DrainShard(Ctx().get(), drain, &dr));
  EXPECT_TRUE(absl::IsUnauthenticated(s)) << s;
  ExpectVictimUnharmed(4, 6);
}

TEST_F(ControlPlaneAuthTest, AnotherJobsTokenReadsAndJoinsOnlyItsJob) {
  // The attacker is a trainer that created a job of its own.
  auto trainer = StubAs("trainer");
  v1::CreateJobRequest create;
  create.mutable_spec()->set_name("attacker");
  create.mutable_spec()->set_world_size(1);
  auto* t = create.mutable_spec()->add_tensors();
  t->set_name("w");
  t->add_shape(64);
  create.mutable_spec()->mutable_optimizer()->set_kind(v1::OPTIMIZER_SGD);
  create.mutable_spec()->mutable_optimizer()->set_lr(0.1f);
  create.mutable_spec()->set_grad_dtype(v1::DTYPE_FP32);
  create.mutable_spec()->set_param_dtype(v1::DTYPE_FP32);
  v1::CreateJobResponse created;
  ASSERT_OK(FromGrpc(trainer->CreateJob(Ctx().get(), create, &created)));
  const std::string mine = created.job_token();
  ASSERT_EQ(mine.size(), 64u);
  EXPECT_NE(mine, cluster_->worker(0)->job_token());

  auto worker = StubAs("worker");
  v1::GetJobRequest get;
  get.set_job_id(victim_id_);
  v1::GetJobResponse job;
  absl::Status s = FromGrpc(worker->GetJob(Ctx(mine).get(), get, &job));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  v1::GetShardMapRequest map_req;
  map_req.set_job_id(victim_id_);
  v1::ShardMap map;
  s = FromGrpc(worker->GetShardMap(Ctx(mine).get(), map_req, &map));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  v1::JoinJobRequest join;
  join.set_job_name("victim");
  join.set_rank(1);
  join.set_world_size(2);
  v1::JoinJobResponse joined;
  s = FromGrpc(worker->JoinJob(Ctx(mine).get(), join, &joined));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  v1::LeaveJobRequest leave;
  leave.set_job_name("victim");
  v1::LeaveJobResponse left;
  s = FromGrpc(worker->LeaveJob(Ctx(mine).get(), leave, &left));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  v1::CreateCheckpointRequest ckpt;
  ckpt.set_job_name("victim");
  v1::CreateCheckpointResponse cr;
  s = FromGrpc(worker->CreateCheckpoint(Ctx(mine).get(), ckpt, &cr));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  // Its own job: readable. Status shows it alone, and no shard.
  get.set_job_id(created.job_id());
  ASSERT_OK(FromGrpc(worker->GetJob(Ctx(mine).get(), get, &job)));
  v1::StatusResponse st;
  ASSERT_OK(FromGrpc(worker->Status(Ctx(mine).get(), v1::StatusRequest(), &st)));
  ASSERT_EQ(st.jobs_size(), 1);
  EXPECT_EQ(st.jobs(0).name(), "attacker");
  EXPECT_EQ(st.shards_size(), 0);
  // A guessed token of the right length is no better.
  s = FromGrpc(worker->JoinJob(Ctx(std::string(64, '0')).get(), join, &joined));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  // A job not created yet: NOT_FOUND, so that ranks wait for rank 0.
  join.set_job_name("not-yet");
  s = FromGrpc(worker->JoinJob(Ctx(mine).get(), join, &joined));
  EXPECT_TRUE(absl::IsNotFound(s)) << s;
  ExpectVictimUnharmed(4, 6);
}

TEST_F(ControlPlaneAuthTest, CreatingJobsNeedsTrainerOrAdmin) {
  v1::CreateJobRequest create;
  create.mutable_spec()->set_name("squatter");
  create.mutable_spec()->set_world_size(1);
  auto* t = create.mutable_spec()->add_tensors();
  t->set_name("w");
  t->add_shape(64);
  v1::CreateJobResponse resp;
  absl::Status s = FromGrpc(StubAs("worker")->CreateJob(Ctx().get(), create, &resp));
  EXPECT_TRUE(absl::IsUnauthenticated(s)) << s;
  s = FromGrpc(StubAs("shard-2")->CreateJob(Ctx().get(), create, &resp));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << s;
  // A creator-chosen token must be a real secret.
  create.set_job_token("short");
  s = FromGrpc(StubAs("trainer")->CreateJob(Ctx().get(), create, &resp));
  EXPECT_TRUE(absl::IsInvalidArgument(s)) << s;
  ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, cluster_->Status());
  EXPECT_EQ(st.jobs_size(), 1);
}

}  // namespace
}  // namespace harness
}  // namespace optimus
