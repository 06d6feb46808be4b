#include "coordinator/coordinator.h"

#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/map_delta.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/optimizer_spec.h"
#include "proto/optimus.grpc.pb.h"
#include "proto/optimus.pb.h"

namespace optimus {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kLease = absl::Milliseconds(300);
constexpr absl::Duration kSweep = absl::Milliseconds(50);

class CoordinatorTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoordinatorOptions options;
    options.lease = kLease;
    options.sweep_interval = kSweep;
    auto server = CoordinatorServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    ASSERT_GT(server_->port(), 0);
    channel_ = grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials());
    stub_ = v1::Coordinator::NewStub(channel_);
  }

  static std::unique_ptr<grpc::ClientContext> Ctx() {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return ctx;
  }

  static v1::ShardCapabilities Caps(v1::ShardKind kind, uint64_t memory_limit_bytes,
                                    const std::string& host = "node0") {
    v1::ShardCapabilities caps;
    caps.set_kind(kind);
    caps.set_arch(kind == v1::SHARD_KIND_DPU ? "aarch64" : "x86_64");
    caps.set_cores(8);
    caps.set_memory_limit_bytes(memory_limit_bytes);
    caps.set_data_address("ucx-address-of-" + host);
    caps.set_hostname(host);
    return caps;
  }

  grpc::Status Register(const v1::ShardCapabilities& caps, v1::RegisterShardResponse* resp) {
    v1::RegisterShardRequest req;
    *req.mutable_capabilities() = caps;
    return stub_->RegisterShard(Ctx().get(), req, resp);
  }

  uint64_t RegisterOk(const v1::ShardCapabilities& caps) {
    v1::RegisterShardResponse resp;
    grpc::Status s = Register(caps, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.shard_id();
  }

  v1::HeartbeatResponse Beat(uint64_t shard_id, uint64_t job_id = 0, uint64_t epoch = 0,
                             uint32_t chunks_loaded = 0, uint64_t applied_step = 0) {
    v1::HeartbeatRequest req;
    req.set_shard_id(shard_id);
    req.set_memory_used_bytes(1000 * shard_id);
    req.set_chunks_owned(chunks_loaded);
    req.set_transports(shard_id % 2 == 1 ? "sysv,cma" : "tcp");
    if (job_id != 0) {
      v1::ShardJobProgress* p = req.add_jobs();
      p->set_job_id(job_id);
      p->set_map_epoch(epoch);
      p->set_chunks_loaded(chunks_loaded);
      p->set_applied_step(applied_step);
    }
    v1::HeartbeatResponse resp;
    grpc::Status s = stub_->Heartbeat(Ctx().get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  // `shards` beat (reporting nothing) every sweep until the job's map has
  // moved past epoch 1, for at most 10 s; the map as read last.
  v1::ShardMap BeatUntilTheMapMoves(uint64_t job_id, const std::vector<uint64_t>& shards) {
    v1::ShardMap map;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while (absl::Now() < deadline) {
      for (uint64_t s : shards) Beat(s);
      v1::GetShardMapRequest req;
      req.set_job_id(job_id);
      grpc::Status s = stub_->GetShardMap(Ctx().get(), req, &map);
      EXPECT_TRUE(s.ok()) << s.error_message();
      if (!s.ok() || map.epoch() > 1) break;
      absl::SleepFor(kSweep);
    }
    return map;
  }

  // A valid AdamW job: tensors "w" [shape...] and "b" [4].
  static v1::JobSpec Spec(const std::string& name, uint32_t world_size,
                          std::vector<int64_t> w_shape = {16, 16}, uint64_t max_chunk_bytes = 256) {
    v1::JobSpec spec;
    spec.set_name(name);
    spec.set_world_size(world_size);
    v1::TensorSpec* w = spec.add_tensors();
    w->set_name("w");
    for (int64_t d : w_shape) w->add_shape(d);
    v1::TensorSpec* b = spec.add_tensors();
    b->set_name("b");
    b->add_shape(4);
    spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
    spec.mutable_optimizer()->set_lr(1e-3f);
    spec.set_grad_dtype(v1::DTYPE_BF16);
    spec.set_param_dtype(v1::DTYPE_BF16);
    spec.set_max_chunk_bytes(max_chunk_bytes);
    return spec;
  }

  // Gives `spec` groups "decay" (wd 0.1) and "no_decay" (wd 0, lr x0.5),
  // "w" in the first and "b" in the second.
  static v1::JobSpec& TwoGroups(v1::JobSpec& spec) {
    v1::ParamGroup* decay = spec.add_param_groups();
    decay->set_name("decay");
    decay->set_weight_decay(0.1f);
    v1::ParamGroup* no_decay = spec.add_param_groups();
    no_decay->set_name("no_decay");
    no_decay->set_weight_decay(0);
    no_decay->set_lr_mult(0.5f);
    spec.mutable_tensors(0)->set_group(0);
    spec.mutable_tensors(1)->set_group(1);
    return spec;
  }

  grpc::Status Create(const v1::JobSpec& spec, v1::CreateJobResponse* resp) {
    v1::CreateJobRequest req;
    *req.mutable_spec() = spec;
    return stub_->CreateJob(Ctx().get(), req, resp);
  }

  v1::StatusResponse GetStatus() {
    v1::StatusResponse resp;
    grpc::Status s = stub_->Status(Ctx().get(), v1::StatusRequest(), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  }

  v1::JobState JobState(uint64_t job_id) {
    v1::GetJobRequest req;
    req.set_job_id(job_id);
    v1::GetJobResponse resp;
    grpc::Status s = stub_->GetJob(Ctx().get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.state();
  }

  std::unique_ptr<CoordinatorServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

uint32_t ChunksOn(const v1::ShardMap& map, uint64_t shard_id) {
  uint32_t n = 0;
  for (const auto& c : map.chunks()) n += c.shard_id() == shard_id ? 1 : 0;
  return n;
}

TEST_F(CoordinatorTest, RegistrationValidatesCapabilitiesAndAssignsIds) {
  v1::RegisterShardResponse resp;
  v1::ShardCapabilities no_kind = Caps(v1::SHARD_KIND_DPU, 1 << 20);
  no_kind.set_kind(v1::SHARD_KIND_UNSPECIFIED);
  grpc::Status s = Register(no_kind, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("kind"));

  s = Register(Caps(v1::SHARD_KIND_DPU, 0), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("memory_limit_bytes"));

  v1::ShardCapabilities no_address = Caps(v1::SHARD_KIND_HOST, 1 << 20);
  no_address.clear_data_address();
  s = Register(no_address, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("data_address"));

  ASSERT_TRUE(Register(Caps(v1::SHARD_KIND_DPU, 1 << 20), &resp).ok());
  EXPECT_EQ(resp.shard_id(), 1u);
  EXPECT_EQ(resp.lease_ms(), 300u);
  EXPECT_EQ(RegisterOk(Caps(v1::SHARD_KIND_HOST, 1 << 20)), 2u);
  EXPECT_EQ(GetStatus().shards_size(), 2);  // Refused registrations left no trace.
}

// GetJob for_shard_id: a shard gets exactly the chunks it holds (primary
// or backup) and the endpoints of itself and of those chunks' other
// holders, with the size of the whole map; the whole map stays for callers
// that do not name a shard.
TEST_F(CoordinatorTest, AShardGetsOnlyItsPartOfTheMap) {
  std::vector<uint64_t> ids;
  for (int i = 0; i < 6; ++i) {
    ids.push_back(RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20, absl::StrCat("h", i))));
  }
  v1::JobSpec spec = Spec("parts", 2, {16, 64});
  spec.set_replication(1);
  v1::CreateJobResponse created;
  ASSERT_TRUE(Create(spec, &created).ok());
  auto get = [&](uint64_t for_shard_id) {
    v1::GetJobRequest req;
    req.set_job_id(created.job_id());
    req.set_for_shard_id(for_shard_id);
    v1::GetJobResponse resp;
    grpc::Status s = stub_->GetJob(Ctx().get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp;
  };
  const v1::GetJobResponse whole = get(0);
  EXPECT_FALSE(whole.has_summary());
  ASSERT_EQ(whole.spec().tensors_size(), 2);
  EXPECT_FALSE(whole.spec().tensors(0).name().empty());
  EXPECT_GT(whole.spec().tensors(1).shape_size(), 0);
  ASSERT_EQ(whole.map().chunks_size(), 17);  // 1024 / 64 + 1.
  ASSERT_EQ(whole.map().shards_size(), 6);
  std::map<uint64_t, std::string> address;
  for (const auto& e : whole.map().shards()) address[e.shard_id()] = e.data_address();
  for (uint64_t id : ids) {
    SCOPED_TRACE(absl::StrCat("shard ", id));
    const v1::GetJobResponse part = get(id);
    EXPECT_EQ(part.map().epoch(), whole.map().epoch());
    EXPECT_EQ(part.spec().name(), "parts");
    // The spec as a shard reads it: every tensor at its index with its
    // group and frozen flag, no names or shapes; the rest as it is.
    v1::JobSpec want_spec = whole.spec();
    for (v1::TensorSpec& t : *want_spec.mutable_tensors()) {
      t.clear_name();
      t.clear_shape();
    }
    EXPECT_EQ(part.spec().SerializeAsString(), want_spec.SerializeAsString());
    EXPECT_LT(part.spec().ByteSizeLong(), whole.spec().ByteSizeLong());
    EXPECT_EQ(part.summary().for_shard_id(), id);
    EXPECT_EQ(part.summary().chunks(), 17u);
    EXPECT_EQ(part.summary().shards(), 6u);
    std::vector<std::string> want_chunks;
    std::set<uint64_t> want_peers = {id};
    for (const auto& c : whole.map().chunks()) {
      if (c.shard_id() != id && c.backup_shard_id() != id) continue;
      want_chunks.push_back(c.SerializeAsString());
      want_peers.insert(c.shard_id() == id ? c.backup_shard_id() : c.shard_id());
    }
    ASSERT_FALSE(want_chunks.empty());
    std::vector<std::string> got_chunks;
    for (const auto& c : part.map().chunks()) got_chunks.push_back(c.SerializeAsString());
    EXPECT_EQ(got_chunks, want_chunks);
    std::set<uint64_t> got_peers;
    for (const auto& e : part.map().shards()) {
      EXPECT_TRUE(got_peers.insert(e.shard_id()).second) << "endpoint listed twice";
      EXPECT_EQ(e.data_address(), address[e.shard_id()]);
    }
    EXPECT_EQ(got_peers, want_peers);
    EXPECT_LT(part.ByteSizeLong(), whole.ByteSizeLong());
  }
  // A shard holding nothing of the job: no chunk, no endpoint.
  const uint64_t idle = RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20, "idle"));
  const v1::GetJobResponse none = get(idle);
  EXPECT_EQ(none.map().chunks_size(), 0);
  EXPECT_EQ(none.map().shards_size(), 0);
  EXPECT_EQ(none.map().epoch(), whole.map().epoch());
}

TEST_F(CoordinatorTest, UnknownShardIsToldToRegister) {
  EXPECT_FALSE(Beat(42).known());
  const uint64_t id = RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20));
  EXPECT_TRUE(Beat(id).known());
}

TEST_F(CoordinatorTest, JobBecomesReadyWhenEveryOwningShardHasLoadedTheCurrentEpoch) {
  const uint64_t a = RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20, "a"));
  const uint64_t b = RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20, "b"));
  v1::CreateJobResponse created;
  ASSERT_TRUE(Create(Spec("llm", 2), &created).ok());
  EXPECT_EQ(created.job_id(), 1u);
  const v1::ShardMap& map = created.map();
  EXPECT_EQ(map.epoch(), 1u);
  // 256 + 4 elements in chunks of 64 (256 bytes of fp32): 4 + 1 chunks.
  ASSERT_EQ(map.chunks_size(), 5);
  const uint32_t on_a = ChunksOn(map, a), on_b = ChunksOn(map, b);
  ASSERT_GT(on_a, 0u);
  ASSERT_GT(on_b, 0u);
  ASSERT_EQ(map.shards_size(), 2);
  EXPECT_EQ(map.shards(0).data_address(), "ucx-address-of-a");
  EXPECT_EQ(map.shards(1).kind(), v1::SHARD_KIND_DPU);
  EXPECT_EQ(JobState(1), v1::JOB_STATE_PENDING);

  // The shards are told to load the job.
  v1::HeartbeatResponse hb = Beat(a);
  ASSERT_EQ(hb.assignments_size(), 1);
  EXPECT_EQ(hb.assignments(0).job_id(), 1u);
  EXPECT_EQ(hb.assignments(0).map_epoch(), 1u);

  Beat(a, 1, 1, on_a);
  EXPECT_EQ(JobState(1), v1::JOB_STATE_PENDING);  // b has not loaded yet.
  Beat(b, 1, 1, on_b - 1);
  EXPECT_EQ(JobState(1), v1::JOB_STATE_PENDING);  // b is missing a chunk.
  Beat(b, 1, 0, on_b);
  EXPECT_EQ(JobState(1), v1::JOB_STATE_PENDING);  // Wrong epoch.
  Beat(b, 1, 1, on_b);
  EXPECT_EQ(JobState(1), v1::JOB_STATE_READY);
}

TEST_F(CoordinatorTest, ExpiredLeaseMarksShardDownAndFailsItsJobs) {
  const uint64_t a = RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20, "a"));
  const absl::Time b_registered = absl::Now();
  const uint64_t b = RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20, "b"));
  v1::CreateJobResponse created;
  ASSERT_TRUE(Create(Spec("llm", 1), &created).ok());
  const uint64_t job = created.job_id();
  ASSERT_GT(ChunksOn(created.map(), b), 0u);

  // A keeps beating every lease/6; B never does.
  absl::Time b_down_at = absl::InfiniteFuture();
  bool a_stayed_up = true;
  while (absl::Now() - b_registered < kLease + kSweep + absl::Seconds(2)) {
    EXPECT_TRUE(Beat(a).known());
    v1::StatusResponse st = GetStatus();
    if (st.shards(0).state() != v1::SHARD_STATE_UP) a_stayed_up = false;
    if (st.shards(1).state() == v1::SHARD_STATE_DOWN) {
      b_down_at = absl::Now();
      break;
    }
    absl::SleepFor(kLease / 6);
  }
  EXPECT_TRUE(a_stayed_up);
  ASSERT_NE(b_down_at, absl::InfiniteFuture()) << "shard b never marked DOWN";
  EXPECT_GE(b_down_at - b_registered, kLease);
  // Within lease + sweep, plus slack for a loaded test machine.
  EXPECT_LE(b_down_at - b_registered, kLease + kSweep + absl::Milliseconds(300));

  EXPECT_EQ(JobState(job), v1::JOB_STATE_FAILED);
  // B must register again, under a new id; A is no longer assigned the job.
  EXPECT_FALSE(Beat(b).known());
  EXPECT_EQ(Beat(a).assignments_size(), 0);
  EXPECT_EQ(RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20, "b")), 3u);
  // The failed job's memory is no longer planned anywhere.
  const v1::StatusResponse st = GetStatus();
  for (const auto& s : st.shards()) EXPECT_EQ(s.memory_planned_bytes(), 0u);
}

TEST_F(CoordinatorTest, CreateJobRejectsInvalidSpecsWithClearMessages) {
  RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20));
  struct Case {
    std::string what;
    std::function<void(v1::JobSpec&)> mutate;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"empty name", [](v1::JobSpec& s) { s.set_name(""); }, "name"},
      {"world size 0", [](v1::JobSpec& s) { s.set_world_size(0); }, "world_size"},
      {"no tensors", [](v1::JobSpec& s) { s.clear_tensors(); }, "tensor"},
      {"empty tensor name", [](v1::JobSpec& s) { s.mutable_tensors(1)->set_name(""); }, "empty name"},
      {"duplicate tensor", [](v1::JobSpec& s) { s.mutable_tensors(1)->set_name("w"); },
       "\"w\" is used twice"},
      {"zero dim", [](v1::JobSpec& s) { s.mutable_tensors(0)->set_shape(1, 0); }, "dimension 0"},
      {"negative dim", [](v1::JobSpec& s) { s.mutable_tensors(0)->set_shape(0, -3); },
       "dimension -3"},
      {"no grad dtype", [](v1::JobSpec& s) { s.clear_grad_dtype(); }, "grad_dtype"},
      {"no param dtype", [](v1::JobSpec& s) { s.clear_param_dtype(); }, "param_dtype"},
      {"no optimizer", [](v1::JobSpec& s) { s.mutable_optimizer()->clear_kind(); }, "optimizer.kind"},
      {"zero lr", [](v1::JobSpec& s) { s.mutable_optimizer()->set_lr(0); }, "optimizer.lr"},
      {"negative lr", [](v1::JobSpec& s) { s.mutable_optimizer()->set_lr(-1); }, "optimizer.lr"},
      // Parameter groups (two: "decay" and "no_decay"), clipping.
      {"group without groups", [](v1::JobSpec& s) { s.mutable_tensors(1)->set_group(1); },
       "tensor \"b\" has group 1 but the job has no param_groups"},
      {"group out of range",
       [](v1::JobSpec& s) {
         TwoGroups(s);
         s.mutable_tensors(0)->set_group(2);
       },
       "tensor \"w\" has group 2 but the job has 2 param_groups"},
      {"negative group weight decay",
       [](v1::JobSpec& s) { TwoGroups(s).mutable_param_groups(1)->set_weight_decay(-0.5f); },
       "param_groups[1].weight_decay must be >= 0"},
      {"infinite group weight decay",
       [](v1::JobSpec& s) { TwoGroups(s).mutable_param_groups(0)->set_weight_decay(INFINITY); },
       "param_groups[0].weight_decay"},
      {"zero lr_mult", [](v1::JobSpec& s) { TwoGroups(s).mutable_param_groups(1)->set_lr_mult(0); },
       "param_groups[1].lr_mult must be positive"},
      {"nan lr_mult", [](v1::JobSpec& s) { TwoGroups(s).mutable_param_groups(0)->set_lr_mult(NAN); },
       "param_groups[0].lr_mult"},
      {"beta1 of 1", [](v1::JobSpec& s) { TwoGroups(s).mutable_param_groups(0)->set_beta1(1); },
       "param_groups[0].beta1 must be in [0, 1)"},
      {"negative beta2", [](v1::JobSpec& s) { TwoGroups(s).mutable_param_groups(1)->set_beta2(-0.1f); },
       "param_groups[1].beta2"},
      {"momentum of 1.5",
       [](v1::JobSpec& s) { TwoGroups(s).mutable_param_groups(1)->set_momentum(1.5f); },
       "param_groups[1].momentum"},
      {"duplicate group name",
       [](v1::JobSpec& s) { TwoGroups(s).mutable_param_groups(1)->set_name("decay"); },
       "param_groups[1].name \"decay\" is used twice"},
      {"negative max_grad_norm", [](v1::JobSpec& s) { s.set_max_grad_norm(-1); }, "max_grad_norm"},
      {"infinite max_grad_norm", [](v1::JobSpec& s) { s.set_max_grad_norm(INFINITY); },
       "max_grad_norm"},
  };
  for (const Case& c : cases) {
    v1::JobSpec spec = Spec("job", 2);
    c.mutate(spec);
    v1::CreateJobResponse resp;
    grpc::Status s = Create(spec, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.what;
    EXPECT_THAT(s.error_message(), HasSubstr(c.message)) << c.what;
  }
  EXPECT_EQ(GetStatus().jobs_size(), 0);

  v1::CreateJobResponse resp;
  ASSERT_TRUE(Create(Spec("job", 2), &resp).ok());
  grpc::Status dup = Create(Spec("job", 4), &resp);
  EXPECT_EQ(dup.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_THAT(dup.error_message(), HasSubstr("\"job\""));
}

TEST_F(CoordinatorTest, CreateJobFillsDefaults) {
  RegisterOk(Caps(v1::SHARD_KIND_DPU, uint64_t{1} << 30));
  v1::JobSpec spec = Spec("job", 4);
  spec.set_max_chunk_bytes(0);
  v1::CreateJobResponse created;
  ASSERT_TRUE(Create(spec, &created).ok());
  v1::GetJobRequest req;
  req.set_job_id(created.job_id());
  v1::GetJobResponse got;
  ASSERT_TRUE(stub_->GetJob(Ctx().get(), req, &got).ok());
  EXPECT_FLOAT_EQ(got.spec().optimizer().beta1(), 0.9f);
  EXPECT_FLOAT_EQ(got.spec().optimizer().beta2(), 0.999f);
  EXPECT_FLOAT_EQ(got.spec().optimizer().eps(), 1e-8f);
  EXPECT_FLOAT_EQ(got.spec().optimizer().grad_scale(), 0.25f);
  // 4 MiB of bf16 payload: 2 Mi elements, 8 MiB of fp32 state.
  EXPECT_EQ(got.spec().chunk_payload_bytes(), 4u << 20);
  EXPECT_EQ(got.spec().max_chunk_bytes(), 8u << 20);
  EXPECT_EQ(got.map().chunks_size(), 2);  // One chunk per (small) tensor.
}

TEST_F(CoordinatorTest, CreateJobWithoutShardsOrRoomIsRefused) {
  v1::CreateJobResponse resp;
  grpc::Status none = Create(Spec("job", 1), &resp);
  EXPECT_EQ(none.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(none.error_message(), HasSubstr("no live shards"));

  RegisterOk(Caps(v1::SHARD_KIND_DPU, 40000));
  RegisterOk(Caps(v1::SHARD_KIND_HOST, 20000));
  // world 1, bf16/bf16 AdamW: 12 + 2 + 4 = 18 bytes per element, and
  // ChunkOverheadBytes(1) per chunk: 1000 + 4 elements in 16 + 1 chunks of
  // at most 64 elements = 18072 + 17 x 8320 = 159512 bytes against 60000
  // free.
  grpc::Status full = Create(Spec("big", 1, {1000}), &resp);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(full.error_message(), HasSubstr("needs 159512 bytes"));
  EXPECT_THAT(full.error_message(), HasSubstr("8320 per chunk"));
  EXPECT_THAT(full.error_message(), HasSubstr("60000 bytes free over 2 live shards"));
  EXPECT_THAT(full.error_message(), HasSubstr("largest free 40000 bytes"));
  // A refused job leaves its name free.
  EXPECT_TRUE(Create(Spec("big", 1, {100}), &resp).ok());
}

TEST_F(CoordinatorTest, JoinJobChecksNameWorldSizeAndRank) {
  RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20));
  v1::CreateJobResponse created;
  ASSERT_TRUE(Create(Spec("llm", 2), &created).ok());

  auto join = [&](const std::string& name, uint32_t rank, uint32_t world,
                  v1::JoinJobResponse* resp) {
    v1::JoinJobRequest req;
    req.set_job_name(name);
    req.set_rank(rank);
    req.set_world_size(world);
    return stub_->JoinJob(Ctx().get(), req, resp);
  };
  v1::JoinJobResponse resp;
  EXPECT_EQ(join("nope", 0, 2, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::Status s = join("llm", 0, 3, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("world_size 2"));
  s = join("llm", 2, 2, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("rank 2"));

  ASSERT_TRUE(join("llm", 1, 2, &resp).ok());
  EXPECT_EQ(resp.job_id(), created.job_id());
  EXPECT_EQ(resp.state(), v1::JOB_STATE_PENDING);
  EXPECT_FLOAT_EQ(resp.spec().optimizer().grad_scale(), 0.5f);
  EXPECT_EQ(resp.map().chunks_size(), created.map().chunks_size());
  ASSERT_TRUE(join("llm", 1, 2, &resp).ok());  // Idempotent.
  EXPECT_EQ(GetStatus().jobs(0).workers_joined(), 1u);
  ASSERT_TRUE(join("llm", 0, 2, &resp).ok());
  EXPECT_EQ(GetStatus().jobs(0).workers_joined(), 2u);
}

TEST_F(CoordinatorTest, GetJobAndShardMapOfUnknownJobAreNotFound) {
  v1::GetJobRequest req;
  req.set_job_id(7);
  v1::GetJobResponse resp;
  EXPECT_EQ(stub_->GetJob(Ctx().get(), req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  v1::GetShardMapRequest map_req;
  map_req.set_job_id(7);
  v1::ShardMap map;
  EXPECT_EQ(stub_->GetShardMap(Ctx().get(), map_req, &map).error_code(),
            grpc::StatusCode::NOT_FOUND);
}

TEST_F(CoordinatorTest, StatusReportsShardsAndJobs) {
  const uint64_t dpu = RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20, "bf2"));
  const uint64_t host = RegisterOk(Caps(v1::SHARD_KIND_HOST, 1 << 30, "cpu"));
  v1::CreateJobResponse created;
  // 64*64 + 4 = 4100 params, world 2: 12 + 2*2 + 2*2 = 20 bytes per element.
  ASSERT_TRUE(Create(Spec("llm", 2, {64, 64}, 4096), &created).ok());
  const uint32_t chunks = static_cast<uint32_t>(created.map().chunks_size());
  EXPECT_EQ(ChunksOn(created.map(), host), 0u);  // The DPU has room for all.
  Beat(dpu, created.job_id(), 1, chunks, /*applied_step=*/7);

  v1::StatusResponse st = GetStatus();
  ASSERT_EQ(st.shards_size(), 2);
  const v1::ShardStatus& s0 = st.shards(0);
  EXPECT_EQ(s0.shard_id(), dpu);
  EXPECT_EQ(s0.capabilities().kind(), v1::SHARD_KIND_DPU);
  EXPECT_EQ(s0.capabilities().hostname(), "bf2");
  EXPECT_EQ(s0.state(), v1::SHARD_STATE_UP);
  EXPECT_EQ(s0.memory_used_bytes(), 1000 * dpu);  // As reported.
  EXPECT_EQ(s0.memory_planned_bytes(), 4100u * 20 + chunks * kernels::ChunkOverheadBytes(2));
  EXPECT_EQ(s0.chunks_owned(), chunks);
  EXPECT_EQ(s0.transports(), dpu % 2 == 1 ? "sysv,cma" : "tcp");  // As reported.
  EXPECT_LT(s0.lease_age_ms(), 300u);
  EXPECT_EQ(st.shards(1).memory_planned_bytes(), 0u);
  EXPECT_EQ(st.shards(1).transports(), "");  // Has not beaten yet.

  ASSERT_EQ(st.jobs_size(), 1);
  const v1::JobStatus& j = st.jobs(0);
  EXPECT_EQ(j.name(), "llm");
  EXPECT_EQ(j.state(), v1::JOB_STATE_READY);
  EXPECT_EQ(j.world_size(), 2u);
  EXPECT_EQ(j.workers_joined(), 0u);
  EXPECT_EQ(j.current_step(), 7u);
  EXPECT_EQ(j.num_tensors(), 2u);
  EXPECT_EQ(j.num_params(), 4100u);
  EXPECT_EQ(j.state_bytes(), 4100u * 12);
  EXPECT_EQ(j.map_epoch(), 1u);
}

TEST_F(CoordinatorTest, StatusShowsParamGroupsFrozenTensorsAndClipping) {
  RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20));
  v1::CreateJobResponse created;
  v1::JobSpec plain = Spec("plain", 1, {8, 8});
  plain.mutable_optimizer()->set_weight_decay(0.01f);
  ASSERT_TRUE(Create(plain, &created).ok());
  v1::JobSpec grouped = Spec("grouped", 1, {8, 8});
  TwoGroups(grouped);
  grouped.mutable_param_groups(0)->set_beta2(0.95f);
  v1::TensorSpec* emb = grouped.add_tensors();
  emb->set_name("emb");
  emb->add_shape(10);
  emb->set_group(1);
  emb->set_frozen(true);
  grouped.set_max_grad_norm(1.0f);
  grouped.set_keep_nonfinite(true);
  ASSERT_TRUE(Create(grouped, &created).ok());
  // Unnamed groups may repeat; only names are unique.
  v1::JobSpec unnamed = Spec("unnamed", 1);
  TwoGroups(unnamed).mutable_param_groups(0)->clear_name();
  unnamed.mutable_param_groups(1)->clear_name();
  ASSERT_TRUE(Create(unnamed, &created).ok());

  v1::StatusResponse st = GetStatus();
  ASSERT_EQ(st.jobs_size(), 3);
  const v1::JobStatus& p = st.jobs(0);
  EXPECT_EQ(p.optimizer().kind(), v1::OPTIMIZER_ADAMW);
  EXPECT_FLOAT_EQ(p.optimizer().weight_decay(), 0.01f);
  EXPECT_FLOAT_EQ(p.optimizer().beta2(), 0.999f);  // Defaults filled.
  ASSERT_EQ(p.param_groups_size(), 1);  // The implicit group holds everything.
  EXPECT_FALSE(p.param_groups(0).group().has_weight_decay());
  EXPECT_EQ(p.param_groups(0).num_tensors(), 2u);
  EXPECT_EQ(p.param_groups(0).num_elems(), 64u + 4);
  EXPECT_EQ(p.frozen_tensors(), 0u);
  EXPECT_EQ(p.max_grad_norm(), 0.0f);
  EXPECT_FALSE(p.keep_nonfinite());

  const v1::JobStatus& g = st.jobs(1);
  ASSERT_EQ(g.param_groups_size(), 2);
  EXPECT_EQ(g.param_groups(0).group().name(), "decay");
  EXPECT_FLOAT_EQ(g.param_groups(0).group().weight_decay(), 0.1f);
  EXPECT_FLOAT_EQ(g.param_groups(0).group().beta2(), 0.95f);
  EXPECT_FALSE(g.param_groups(0).group().has_lr_mult());
  EXPECT_EQ(g.param_groups(0).num_tensors(), 1u);
  EXPECT_EQ(g.param_groups(0).num_elems(), 64u);
  EXPECT_EQ(g.param_groups(1).group().name(), "no_decay");
  EXPECT_FLOAT_EQ(g.param_groups(1).group().lr_mult(), 0.5f);
  EXPECT_EQ(g.param_groups(1).num_tensors(), 2u);  // "b" and the frozen "emb".
  EXPECT_EQ(g.param_groups(1).num_elems(), 4u + 10);
  EXPECT_EQ(g.frozen_tensors(), 1u);
  EXPECT_FLOAT_EQ(g.max_grad_norm(), 1.0f);
  EXPECT_TRUE(g.keep_nonfinite());
  EXPECT_EQ(st.jobs(2).param_groups_size(), 2);
}

TEST_F(CoordinatorTest, WatchStreamsTheCurrentMapAndEndsOnShutdown) {
  RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20));
  v1::CreateJobResponse created;
  ASSERT_TRUE(Create(Spec("llm", 1), &created).ok());

  grpc::ClientContext ctx;
  v1::WatchShardMapRequest req;
  req.set_job_id(created.job_id());
  auto reader = stub_->WatchShardMap(&ctx, req);
  v1::ShardMap map;
  ASSERT_TRUE(reader->Read(&map));
  EXPECT_EQ(map.epoch(), 1u);
  EXPECT_EQ(map.chunks_size(), created.map().chunks_size());

  std::thread stopper([this] {
    absl::SleepFor(absl::Milliseconds(200));
    server_->Shutdown();
  });
  const absl::Time start = absl::Now();
  EXPECT_FALSE(reader->Read(&map));  // No new epoch: blocks until shutdown.
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(150));
  grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  stopper.join();
}

TEST_F(CoordinatorTest, WatchOfAFailedJobEnds) {
  RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20));
  v1::CreateJobResponse created;
  ASSERT_TRUE(Create(Spec("llm", 1), &created).ok());
  grpc::ClientContext ctx;
  v1::WatchShardMapRequest req;
  req.set_job_id(created.job_id());
  req.set_after_epoch(1);
  auto reader = stub_->WatchShardMap(&ctx, req);
  v1::ShardMap map;
  EXPECT_FALSE(reader->Read(&map));  // The only shard never beats: the job fails.
  grpc::Status s = reader->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("failed"));
}

TEST_F(CoordinatorTest, DrainOverGrpcMovesChunksWhileTheShardsBeatAndShowsInMetrics) {
  const uint64_t a = RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20, "a"));
  const uint64_t b = RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20, "b"));
  v1::CreateJobResponse created;
  ASSERT_TRUE(Create(Spec("llm", 1), &created).ok());
  const uint32_t on_a = ChunksOn(created.map(), a);
  ASSERT_GT(on_a, 0u);

  auto drain = [&](uint64_t id, v1::DrainShardResponse* resp) {
    v1::DrainShardRequest req;
    req.set_shard_id(id);
    return stub_->DrainShard(Ctx().get(), req, resp);
  };
  v1::DrainShardResponse resp;
  grpc::Status s = drain(77, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_THAT(s.error_message(), HasSubstr("77"));
  ASSERT_TRUE(drain(a, &resp).ok());
  EXPECT_EQ(resp.shard().shard_id(), a);
  EXPECT_EQ(resp.shard().state(), v1::SHARD_STATE_DRAINING);
  EXPECT_EQ(resp.chunks_to_move(), on_a);

  // The sweeper gives a's chunks a temporary backup on b (replication 0:
  // a stays primary until b reports them seeded).
  const v1::ShardMap map = BeatUntilTheMapMoves(created.job_id(), {a, b});
  ASSERT_EQ(map.epoch(), 2u);
  for (const auto& c : map.chunks()) {
    EXPECT_EQ(c.backup_shard_id(), c.shard_id() == a ? b : 0u);
  }

  const std::string metrics = server_->RenderMetrics();
  EXPECT_THAT(metrics, HasSubstr("optimus_coord_shards{state=\"draining\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("optimus_coord_shards{state=\"up\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("optimus_coord_shard_draining{shard_id=\"1\",kind=\"dpu\"} 1"));
  EXPECT_THAT(metrics, HasSubstr("optimus_coord_shard_up{shard_id=\"1\",kind=\"dpu\"} 1"));
  EXPECT_THAT(metrics, HasSubstr(absl::StrCat(
                           "optimus_coord_shard_backup_chunks{shard_id=\"2\",kind=\"dpu\"} ", on_a)));
  EXPECT_THAT(metrics,
              HasSubstr(absl::StrCat("optimus_coord_job_chunks_with_backup{job_name=\"llm\"} ", on_a)));
  EXPECT_THAT(metrics, HasSubstr("optimus_coord_job_backups_in_sync{job_name=\"llm\"} 0"));
  EXPECT_THAT(metrics, HasSubstr("optimus_coord_job_chunks{job_name=\"llm\"} 5"));
  EXPECT_THAT(metrics, HasSubstr("optimus_coord_job_replication{job_name=\"llm\"} 0"));
}

// A watch with deltas sends the whole map first, then only what each new
// epoch changed (ShardMap.delta_from): here a drain that gives the
// draining shard's chunks a backup on the other one. Applied to the first
// map, the delta gives the new map.
TEST_F(CoordinatorTest, WatchWithDeltasSendsWhatEachEpochChanged) {
  const uint64_t a = RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20, "a"));
  const uint64_t b = RegisterOk(Caps(v1::SHARD_KIND_DPU, 1 << 20, "b"));
  v1::CreateJobResponse created;
  ASSERT_TRUE(Create(Spec("llm", 1), &created).ok());
  const uint32_t on_a = ChunksOn(created.map(), a);
  ASSERT_GT(on_a, 0u);
  ASSERT_LT(on_a, static_cast<uint32_t>(created.map().chunks_size()));

  grpc::ClientContext ctx;
  v1::WatchShardMapRequest req;
  req.set_job_id(created.job_id());
  req.set_deltas(true);
  auto reader = stub_->WatchShardMap(&ctx, req);
  v1::ShardMap first;
  ASSERT_TRUE(reader->Read(&first));
  EXPECT_EQ(first.epoch(), 1u);
  EXPECT_EQ(first.delta_from(), 0u);
  EXPECT_EQ(first.chunks_size(), created.map().chunks_size());

  v1::DrainShardRequest dreq;
  dreq.set_shard_id(a);
  v1::DrainShardResponse dresp;
  ASSERT_TRUE(stub_->DrainShard(Ctx().get(), dreq, &dresp).ok());
  const v1::ShardMap now = BeatUntilTheMapMoves(created.job_id(), {a, b});
  ASSERT_EQ(now.epoch(), 2u);
  v1::ShardMap delta;
  ASSERT_TRUE(reader->Read(&delta));
  EXPECT_EQ(delta.epoch(), 2u);
  EXPECT_EQ(delta.delta_from(), 1u);
  EXPECT_EQ(delta.chunks_size(), static_cast<int>(on_a));  // a's chunks got a backup.
  for (const auto& c : delta.chunks()) {
    EXPECT_EQ(c.shard_id(), a);
    EXPECT_EQ(c.backup_shard_id(), b);
  }
  EXPECT_EQ(delta.shards_size(), 0);  // a and b held chunks before.
  absl::StatusOr<v1::ShardMap> applied = ApplyMapDelta(first, delta);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_EQ(applied->SerializeAsString(), now.SerializeAsString());
  ctx.TryCancel();
}

TEST(CoordinatorServerTest, UnusableAddressIsAnError) {
  CoordinatorOptions options;
  options.listen_address = "256.1.1.1:0";
  auto server = CoordinatorServer::Start(options);
  EXPECT_FALSE(server.ok());
}

}  // namespace
}  // namespace optimus
