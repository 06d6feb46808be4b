// Jobs that end and shards that are gone, against a real coordinator over
// gRPC (its sweeper idle; the test drives leases with a fake clock): delete
// and its refusals, leave, what shards are told to release, a restore that
// takes over a FAILED job's name, DOWN shards forgotten on request or after
// the grace period, and tables that come back to their size after many jobs
// came and went.
#include <chrono>
#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/checkpoint_files.h"
#include "coordinator/coordinator.h"
#include "coordinator/state_store.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/optimizer_spec.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr absl::Duration kLease = absl::Seconds(2);
constexpr absl::Duration kGrace = absl::Minutes(10);

// A memory store whose saves can be made to fail (a full disk).
class FlakyStore : public StateStore {
 public:
  absl::Status Save(absl::string_view bytes) override {
    if (failing()) return absl::ResourceExhaustedError("No space left on device");
    return memory_.Save(bytes);
  }
  absl::StatusOr<std::optional<std::string>> Load() override { return memory_.Load(); }
  std::string Describe() const override { return "flaky memory"; }
  void set_failing(bool f) {
    absl::MutexLock lock(&mu_);
    failing_ = f;
  }

 private:
  bool failing() {
    absl::MutexLock lock(&mu_);
    return failing_;
  }
  MemoryStateStore memory_;
  absl::Mutex mu_;
  bool failing_ ABSL_GUARDED_BY(mu_) = false;
};

std::unique_ptr<grpc::ClientContext> Ctx() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return ctx;
}

class JobLifecycleTest : public ::testing::Test {
 protected:
  JobLifecycleTest() {
    const char* tmp = std::getenv("TEST_TMPDIR");
    checkpoint_dir_ = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/lifecycleXXXXXX");
    EXPECT_NE(mkdtemp(checkpoint_dir_.data()), nullptr);
  }
  void SetUp() override { Start(); }

  // A coordinator over store_ (kept across restarts).
  void Start() {
    server_.reset();
    CoordinatorOptions options;
    options.lease = kLease;
    options.sweep_interval = absl::Hours(1);  // The test runs the sweeps.
    options.down_shard_grace = kGrace;
    options.checkpoint_dir = checkpoint_dir_;
    options.rollback_on_shard_loss = false;
    options.state_store = store_;
    options.clock = [this] {
      absl::MutexLock lock(&clock_mu_);
      return now_;
    };
    auto server = CoordinatorServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ = v1::Coordinator::NewStub(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  }
  Coordinator* core() { return server_->core(); }
  absl::Time Now() {
    absl::MutexLock lock(&clock_mu_);
    return now_;
  }
  void Advance(absl::Duration d) {
    absl::MutexLock lock(&clock_mu_);
    now_ += d;
  }

  uint64_t AddShard(uint64_t memory_limit_bytes = uint64_t{1} << 30) {
    v1::RegisterShardRequest req;
    v1::ShardCapabilities* c = req.mutable_capabilities();
    c->set_kind(v1::SHARD_KIND_DPU);
    c->set_memory_limit_bytes(memory_limit_bytes);
    c->set_data_address(absl::StrCat("ucx-", next_host_));
    c->set_hostname(absl::StrCat("node", next_host_++));
    c->set_checkpoints(true);
    v1::RegisterShardResponse resp;
    const grpc::Status s = stub_->RegisterShard(Ctx().get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.shard_id();
  }

  // One tensor of num_chunks * 64 elements, chunks of 64; world 2, AdamW,
  // bf16: 12 + 2*2 + 2*2 = 20 bytes per element.
  static v1::JobSpec Spec(const std::string& name, int num_chunks, uint32_t replication = 0) {
    v1::JobSpec s;
    s.set_name(name);
    s.set_world_size(2);
    v1::TensorSpec* w = s.add_tensors();
    w->set_name("w");
    w->add_shape(64 * num_chunks);
    s.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
    s.mutable_optimizer()->set_lr(1e-3f);
    s.set_grad_dtype(v1::DTYPE_BF16);
    s.set_param_dtype(v1::DTYPE_BF16);
    s.set_max_chunk_bytes(256);
    s.set_replication(replication);
    return s;
  }

  grpc::Status Create(const v1::JobSpec& spec, uint64_t* job_id = nullptr) {
    v1::CreateJobRequest req;
    *req.mutable_spec() = spec;
    v1::CreateJobResponse resp;
    grpc::Status s = stub_->CreateJob(Ctx().get(), req, &resp);
    if (job_id != nullptr) *job_id = resp.job_id();
    return s;
  }
  uint64_t CreateOk(const v1::JobSpec& spec) {
    uint64_t id = 0;
    const grpc::Status s = Create(spec, &id);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return id;
  }
  grpc::Status Join(const std::string& name, uint32_t rank) {
    v1::JoinJobRequest req;
    req.set_job_name(name);
    req.set_rank(rank);
    req.set_world_size(2);
    v1::JoinJobResponse resp;
    return stub_->JoinJob(Ctx().get(), req, &resp);
  }
  grpc::Status Leave(const std::string& name, uint32_t rank, uint32_t* joined = nullptr) {
    v1::LeaveJobRequest req;
    req.set_job_name(name);
    req.set_rank(rank);
    v1::LeaveJobResponse resp;
    grpc::Status s = stub_->LeaveJob(Ctx().get(), req, &resp);
    if (joined != nullptr) *joined = resp.workers_joined();
    return s;
  }
  grpc::Status Delete(const std::string& name, bool force = false,
                      v1::DeleteJobResponse* out = nullptr) {
    v1::DeleteJobRequest req;
    req.set_job_name(name);
    req.set_force(force);
    v1::DeleteJobResponse resp;
    grpc::Status s = stub_->DeleteJob(Ctx().get(), req, &resp);
    if (out != nullptr) *out = resp;
    return s;
  }
  grpc::Status Forget(uint64_t shard, v1::ForgetShardResponse* out = nullptr) {
    v1::ForgetShardRequest req;
    req.set_shard_id(shard);
    v1::ForgetShardResponse resp;
    grpc::Status s = stub_->ForgetShard(Ctx().get(), req, &resp);
    if (out != nullptr) *out = resp;
    return s;
  }
  v1::StatusResponse GetStatus() {
    v1::StatusResponse st;
    EXPECT_TRUE(stub_->Status(Ctx().get(), v1::StatusRequest(), &st).ok());
    return st;
  }
  v1::ShardMap Map(uint64_t job_id) {
    v1::GetShardMapRequest req;
    req.set_job_id(job_id);
    v1::ShardMap map;
    EXPECT_TRUE(stub_->GetShardMap(Ctx().get(), req, &map).ok()) << job_id;
    return map;
  }

  // A heartbeat from `shard` reporting every job it is assigned (learned
  // from a first, empty beat, as a real shard does) loaded, backups seeded
  // or not, plus `also` (jobs it still holds that it was not assigned).
  v1::HeartbeatResponse Beat(uint64_t shard, bool seeded = true,
                             const std::vector<uint64_t>& also = {}) {
    v1::HeartbeatRequest req;
    req.set_shard_id(shard);
    v1::HeartbeatResponse first;
    EXPECT_TRUE(stub_->Heartbeat(Ctx().get(), req, &first).ok());
    for (const auto& a : first.assignments()) {
      const v1::ShardMap map = Map(a.job_id());
      uint32_t primary = 0, backup = 0;
      for (const auto& c : map.chunks()) {
        primary += c.shard_id() == shard;
        backup += c.backup_shard_id() == shard;
      }
      v1::ShardJobProgress* p = req.add_jobs();
      p->set_job_id(a.job_id());
      p->set_map_epoch(map.epoch());
      p->set_chunks_loaded(primary + backup);
      p->set_primary_chunks(primary);
      p->set_backup_chunks(backup);
      p->set_backups_seeded(seeded ? backup : 0);
    }
    for (uint64_t id : also) {
      v1::ShardJobProgress* p = req.add_jobs();
      p->set_job_id(id);
      p->set_map_epoch(1);
    }
    v1::HeartbeatResponse resp;
    EXPECT_TRUE(stub_->Heartbeat(Ctx().get(), req, &resp).ok());
    return resp;
  }
  void BeatAll(const std::set<uint64_t>& shards, bool seeded = true) {
    for (uint64_t s : shards) Beat(s, seeded);
  }
  void KeepAlive(uint64_t shard) {
    v1::HeartbeatRequest req;
    req.set_shard_id(shard);
    v1::HeartbeatResponse resp;
    EXPECT_TRUE(stub_->Heartbeat(Ctx().get(), req, &resp).ok());
    EXPECT_TRUE(resp.known()) << shard;
  }
  // `dead` stop beating; the clock passes their lease while `alive` renew.
  void Kill(const std::set<uint64_t>& dead, const std::set<uint64_t>& alive) {
    Advance(kLease / 2);
    for (uint64_t s : alive) KeepAlive(s);
    Advance(kLease / 2 + absl::Milliseconds(1));
    for (uint64_t s : alive) KeepAlive(s);
    EXPECT_EQ(core()->SweepExpiredLeases(Now()), static_cast<int>(dead.size()));
  }

  std::shared_ptr<FlakyStore> store_ = std::make_shared<FlakyStore>();
  std::string checkpoint_dir_;
  absl::Mutex clock_mu_;
  absl::Time now_ ABSL_GUARDED_BY(clock_mu_) = absl::FromUnixSeconds(1'000'000);
  int next_host_ = 0;
  std::unique_ptr<CoordinatorServer> server_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

TEST_F(JobLifecycleTest, DeleteIsRefusedWhileWorkersAreJoinedUnlessForcedOrTheyLeft) {
  const uint64_t a = AddShard();
  const uint64_t job = CreateOk(Spec("llm", 4));
  ASSERT_TRUE(Join("llm", 0).ok());
  ASSERT_TRUE(Join("llm", 1).ok());

  grpc::Status s = Delete("llm");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("2 workers joined (ranks 0,1)"));
  EXPECT_EQ(GetStatus().jobs_size(), 1);  // Nothing changed.
  EXPECT_EQ(Delete("").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Delete("nope").error_code(), grpc::StatusCode::NOT_FOUND);

  uint32_t joined = 9;
  ASSERT_TRUE(Leave("llm", 0, &joined).ok());
  EXPECT_EQ(joined, 1u);
  ASSERT_TRUE(Leave("llm", 0, &joined).ok());  // Idempotent.
  EXPECT_EQ(joined, 1u);
  EXPECT_EQ(Leave("llm", 2).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Leave("nope", 0).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Delete("llm").error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  ASSERT_TRUE(Leave("llm", 1, &joined).ok());
  EXPECT_EQ(joined, 0u);

  v1::DeleteJobResponse deleted;
  ASSERT_TRUE(Delete("llm", false, &deleted).ok());
  EXPECT_EQ(deleted.job_id(), job);
  EXPECT_EQ(deleted.state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(deleted.workers_joined(), 0u);
  EXPECT_EQ(deleted.state_bytes(), 4u * (64 * 20 + kernels::ChunkOverheadBytes(2)));
  // Gone from status, its bytes free at once, its id unknown, its name free.
  const v1::StatusResponse st = GetStatus();
  EXPECT_EQ(st.jobs_size(), 0);
  EXPECT_EQ(st.shards(0).memory_planned_bytes(), 0u);
  EXPECT_EQ(st.shards(0).chunks_owned(), 0u);
  v1::GetJobRequest get;
  get.set_job_id(job);
  v1::GetJobResponse got;
  EXPECT_EQ(stub_->GetJob(Ctx().get(), get, &got).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Delete("llm").error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_GT(CreateOk(Spec("llm", 4)), job);

  // With force, a job is deleted under its workers.
  ASSERT_TRUE(Join("llm", 1).ok());
  ASSERT_TRUE(Delete("llm", /*force=*/true, &deleted).ok());
  EXPECT_EQ(deleted.workers_joined(), 1u);
  EXPECT_EQ(GetStatus().jobs_size(), 0);
  (void)a;
}

TEST_F(JobLifecycleTest, ShardsAreToldToReleaseExactlyTheJobsTheCoordinatorNoLongerHas) {
  const uint64_t a = AddShard();
  const uint64_t keep = CreateOk(Spec("keep", 2));
  const uint64_t gone = CreateOk(Spec("gone", 2));
  BeatAll({a});
  ASSERT_TRUE(Delete("gone").ok());

  // The shard still holds "gone" (and something no coordinator ever made).
  v1::HeartbeatResponse resp = Beat(a, true, {gone, 999});
  EXPECT_THAT(resp.released_jobs(), ElementsAre(gone, 999));
  ASSERT_EQ(resp.assignments_size(), 1);
  EXPECT_EQ(resp.assignments(0).job_id(), keep);
  // Once it has let go, nothing more.
  EXPECT_THAT(Beat(a).released_jobs(), IsEmpty());

  // A restarted coordinator (same durable state) does not know "gone"
  // either: a shard that missed the release hears it now.
  Start();
  resp = Beat(a, true, {gone});
  EXPECT_THAT(resp.released_jobs(), ElementsAre(gone));
  ASSERT_EQ(resp.assignments_size(), 1);
  EXPECT_EQ(resp.assignments(0).job_id(), keep);
}

TEST_F(JobLifecycleTest, WatchersOfADeletedJobEndWithNotFound) {
  AddShard();
  const uint64_t job = CreateOk(Spec("llm", 2));
  grpc::ClientContext ctx;
  v1::WatchShardMapRequest req;
  req.set_job_id(job);
  auto reader = stub_->WatchShardMap(&ctx, req);
  v1::ShardMap map;
  ASSERT_TRUE(reader->Read(&map));
  EXPECT_EQ(map.epoch(), 1u);
  ASSERT_TRUE(Delete("llm").ok());
  EXPECT_FALSE(reader->Read(&map));
  const grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(JobLifecycleTest, AFailedSaveLeavesTheJobAndItsWorkersAsTheyWere) {
  const uint64_t a = AddShard();
  const uint64_t job = CreateOk(Spec("llm", 2));
  ASSERT_TRUE(Join("llm", 0).ok());
  store_->set_failing(true);
  grpc::Status s = Leave("llm", 0);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("saving coordinator state"));
  EXPECT_EQ(GetStatus().jobs(0).workers_joined(), 1u);
  s = Delete("llm", /*force=*/true);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(GetStatus().jobs_size(), 1);
  EXPECT_THAT(Beat(a, true, {job}).released_jobs(), IsEmpty());
  // A job whose creation cannot be saved does not exist, and its id is not
  // handed out again (a shard may have seen it before it was undone).
  uint64_t refused_id = 0;
  EXPECT_EQ(Create(Spec("other", 2), &refused_id).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(GetStatus().jobs_size(), 1);
  store_->set_failing(false);
  EXPECT_EQ(CreateOk(Spec("other", 2)), job + 2);
  ASSERT_TRUE(Delete("other").ok());
  ASSERT_TRUE(Delete("llm", /*force=*/true).ok());
  // A coordinator restarted over the state does not bring it back.
  Start();
  EXPECT_EQ(GetStatus().jobs_size(), 0);
}

TEST_F(JobLifecycleTest, ARestoreThatTakesOverAFailedJobsNameDeletesTheFailedJob) {
  const uint64_t a = AddShard();
  const uint64_t b = AddShard();
  const uint64_t old_id = CreateOk(Spec("llm", 4));
  BeatAll({a, b});
  ASSERT_TRUE(Join("llm", 0).ok());
  // A complete checkpoint: each primary writes its chunks and reports them.
  v1::CreateCheckpointRequest ck;
  ck.set_job_name("llm");
  v1::CreateCheckpointResponse ck_resp;
  ASSERT_TRUE(stub_->CreateCheckpoint(Ctx().get(), ck, &ck_resp).ok());
  const v1::ShardMap map = Map(old_id);
  for (uint64_t shard : {a, b}) {
    v1::HeartbeatRequest hb;
    hb.set_shard_id(shard);
    v1::HeartbeatResponse orders;
    ASSERT_TRUE(stub_->Heartbeat(Ctx().get(), hb, &orders).ok());
    ASSERT_EQ(orders.checkpoints_size(), 1);
    v1::ShardCheckpointReport* r = hb.add_checkpoints();
    r->set_job_id(old_id);
    r->set_checkpoint_id(orders.checkpoints(0).checkpoint_id());
    r->set_done(true);
    const std::vector<float> values(64, 0.5f);
    const float* arrays[] = {values.data(), values.data(), values.data()};
    for (const auto& c : map.chunks()) {
      if (c.shard_id() != shard) continue;
      auto f = ckpt::WriteDataFile(absl::StrCat(checkpoint_dir_, "/", orders.checkpoints(0).path()),
                                   absl::StrCat("t", c.offset_elems()), c.tensor(),
                                   c.offset_elems(), c.num_elems(), arrays);
      ASSERT_TRUE(f.ok()) << f.status();
      // What the shards record since issue 11: shard b's ranges took the
      // last step (lr 2e-3), shard a's skipped it.
      f->set_optimizer_steps(shard == b ? 5 : 4);
      f->set_last_lr(shard == b ? 2e-3f : 1e-3f);
      *r->add_files() = *f;
    }
    v1::HeartbeatResponse ignored;
    ASSERT_TRUE(stub_->Heartbeat(Ctx().get(), hb, &ignored).ok());
  }
  // Shard b dies with chunks and no replica: the job fails.
  Kill({b}, {a});
  ASSERT_EQ(GetStatus().jobs(0).state(), v1::JOB_STATE_FAILED);

  v1::RestoreCheckpointRequest restore;
  restore.set_job_name("llm");
  v1::RestoreCheckpointResponse restored;
  const grpc::Status s = stub_->RestoreCheckpoint(Ctx().get(), restore, &restored);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const v1::StatusResponse st = GetStatus();
  ASSERT_EQ(st.jobs_size(), 1);
  EXPECT_EQ(st.jobs(0).name(), "llm");
  EXPECT_EQ(st.jobs(0).job_id(), restored.job_id());
  EXPECT_NE(restored.job_id(), old_id);
  // Workers and shards get the manifest with the restored job: its last lr
  // (the largest of its files') and each file's optimizer steps.
  v1::GetJobRequest get;
  get.set_job_id(restored.job_id());
  v1::GetJobResponse job;
  ASSERT_TRUE(stub_->GetJob(Ctx().get(), get, &job).ok());
  EXPECT_FLOAT_EQ(job.restore().manifest().last_lr(), 2e-3f);
  ASSERT_GT(job.restore().manifest().files_size(), 0);
  for (const v1::CheckpointFile& f : job.restore().manifest().files()) {
    EXPECT_GE(f.optimizer_steps(), 4u);
  }
  // The FAILED job is gone: the shard holding it lets it go.
  EXPECT_THAT(Beat(a, true, {old_id}).released_jobs(), ElementsAre(old_id));
  EXPECT_EQ(core()->counters().jobs_deleted, 1u);
}

TEST_F(JobLifecycleTest, DownShardsAreForgottenOnRequestOrAfterTheGracePeriod) {
  const uint64_t a = AddShard();
  const uint64_t b = AddShard();
  const uint64_t c = AddShard();
  const uint64_t d = AddShard();
  v1::DrainShardRequest drain;
  drain.set_shard_id(d);
  v1::DrainShardResponse drained;
  ASSERT_TRUE(stub_->DrainShard(Ctx().get(), drain, &drained).ok());

  v1::ForgetShardResponse forgotten;
  grpc::Status s = Forget(c, &forgotten);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("is UP"));
  s = Forget(d);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("is DRAINING"));
  EXPECT_EQ(Forget(99).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(GetStatus().shards_size(), 4);

  Kill({a, b}, {c, d});
  const absl::Time down_at = Now();
  ASSERT_TRUE(Forget(a, &forgotten).ok());
  EXPECT_EQ(forgotten.shard().shard_id(), a);
  EXPECT_EQ(forgotten.shard().state(), v1::SHARD_STATE_DOWN);
  EXPECT_EQ(GetStatus().shards_size(), 3);
  // A forgotten shard that comes back is told to register anew.
  v1::HeartbeatRequest hb;
  hb.set_shard_id(a);
  v1::HeartbeatResponse resp;
  ASSERT_TRUE(stub_->Heartbeat(Ctx().get(), hb, &resp).ok());
  EXPECT_FALSE(resp.known());

  // b is forgotten by the sweeper once it has been DOWN for the grace.
  Advance(kGrace - (Now() - down_at));
  KeepAlive(c);
  KeepAlive(d);
  EXPECT_EQ(core()->ForgetLongDownShards(Now()), 0);
  Advance(absl::Seconds(1));
  EXPECT_EQ(core()->ForgetLongDownShards(Now()), 1);
  const v1::StatusResponse st = GetStatus();
  ASSERT_EQ(st.shards_size(), 2);
  EXPECT_EQ(st.shards(0).shard_id(), c);
  EXPECT_EQ(AddShard(), d + 1);  // Ids are never reused.
  EXPECT_THAT(server_->RenderMetrics(), HasSubstr("optimus_coord_shards_forgotten_total 2"));
  // Durable: a restarted coordinator does not know them either.
  Start();
  EXPECT_EQ(GetStatus().shards_size(), 3);
}

TEST_F(JobLifecycleTest, TablesComeBackToTheirSizeAfterManyJobsIncludingFailedAndDrainedOnes) {
  const uint64_t a = AddShard();
  const uint64_t b = AddShard();
  BeatAll({a, b});
  const Coordinator::TableSizes base = core()->table_sizes();
  ASSERT_EQ(base.shards, 2u);
  ASSERT_EQ(base.jobs, 0u);
  std::set<uint64_t> live = {a, b};
  for (int i = 0; i < 20; ++i) {
    SCOPED_TRACE(absl::StrCat("job ", i, " kind ", i % 4));
    const std::string name = absl::StrCat("job-", i);
    uint64_t job = 0;
    switch (i % 4) {
      case 0: {  // Created, joined, trained (READY), left, deleted.
        job = CreateOk(Spec(name, 6));
        BeatAll(live);
        ASSERT_TRUE(Join(name, 0).ok());
        ASSERT_TRUE(Leave(name, 0).ok());
        break;
      }
      case 1: {  // FAILED: a shard holding its chunks dies (its worker stays
                 // joined; a FAILED job needs no force). The dead shard is
                 // forgotten.
        const uint64_t doomed = AddShard();
        job = CreateOk(Spec(name, 6));
        BeatAll({a, b, doomed});
        ASSERT_TRUE(Join(name, 0).ok());
        Kill({doomed}, live);
        ASSERT_EQ(GetStatus().jobs(0).state(), v1::JOB_STATE_FAILED);
        ASSERT_TRUE(Forget(doomed).ok());
        break;
      }
      case 2: {  // Drained: its chunks move off a shard that then leaves.
        const uint64_t leaving = AddShard();
        job = CreateOk(Spec(name, 6));
        BeatAll({a, b, leaving});
        v1::DrainShardRequest drain;
        drain.set_shard_id(leaving);
        v1::DrainShardResponse drained;
        ASSERT_TRUE(stub_->DrainShard(Ctx().get(), drain, &drained).ok());
        ASSERT_GT(drained.chunks_to_move(), 0u);
        ASSERT_EQ(core()->TickReplication(Now()), 1);  // Temporary backups.
        BeatAll({a, b, leaving}, /*seeded=*/true);
        ASSERT_EQ(core()->TickReplication(Now()), 1);  // Promoted.
        const v1::ShardMap moved = Map(job);
        for (const auto& c : moved.chunks()) ASSERT_NE(c.shard_id(), leaving);
        Kill({leaving}, live);
        ASSERT_TRUE(Forget(leaving).ok());
        break;
      }
      case 3: {  // Replicated, with a checkpoint in progress when deleted.
        job = CreateOk(Spec(name, 6, /*replication=*/1));
        BeatAll(live);
        v1::CreateCheckpointRequest ck;
        ck.set_job_name(name);
        v1::CreateCheckpointResponse ck_resp;
        ASSERT_TRUE(stub_->CreateCheckpoint(Ctx().get(), ck, &ck_resp).ok());
        EXPECT_EQ(core()->table_sizes().checkpoints.in_progress, 1u);
        break;
      }
    }
    ASSERT_TRUE(Delete(name).ok());
    core()->WaitForCheckpointFileWork();
    const Coordinator::TableSizes t = core()->table_sizes();
    EXPECT_EQ(t.shards, base.shards);
    EXPECT_EQ(t.jobs, 0u);
    EXPECT_EQ(t.job_names, 0u);
    EXPECT_EQ(t.progress_reports, 0u);
    EXPECT_EQ(t.departed, 0u);
    EXPECT_EQ(t.checkpoints.in_progress, 0u);
    EXPECT_EQ(t.checkpoints.policies, 0u);
    EXPECT_EQ(t.checkpoints.paces, 0u);
    EXPECT_EQ(t.checkpoints.names, 0u);
    const v1::StatusResponse st = GetStatus();
    EXPECT_EQ(st.jobs_size(), 0);
    ASSERT_EQ(st.shards_size(), 2);
    for (const auto& s : st.shards()) {
      EXPECT_EQ(s.memory_planned_bytes(), 0u);
      EXPECT_EQ(s.chunks_owned(), 0u);
    }
    // Whatever a shard still holds of the deleted job is released.
    EXPECT_THAT(Beat(a, true, {job}).released_jobs(), ElementsAre(job));
  }
  EXPECT_EQ(core()->counters().jobs_deleted, 20u);
  // The checkpoint folders of the deleted jobs hold no partial checkpoint.
  for (int i = 3; i < 20; i += 4) {
    EXPECT_THAT(ckpt::ListDir(absl::StrCat(checkpoint_dir_, "/job-", i)), IsEmpty()) << i;
  }
}

}  // namespace
}  // namespace optimus
