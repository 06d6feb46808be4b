// Map reads under a fetch storm: each shard's part of a job's map is
// serialized once per epoch and reused by later fetches of the same epoch
// (the core, directly), and the gRPC service answers GetJob from those
// bytes, the same message a parse of the core's GetJob gives; a real
// coordinator serves at most max_concurrent_map_reads map reads at once,
// lets max_queued_map_reads more wait, and refuses the others at once with
// RESOURCE_EXHAUSTED, changing nothing.
#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "coordinator/coordinator.h"
#include "coordinator/coordinator_core.h"
#include "coordinator/grpc_service.h"
#include "coordinator/test_fixtures.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/optimus.grpc.pb.h"
#include "proto/optimus.pb.h"

namespace optimus {
namespace {

using coord_test::DpuRegistration;
using coord_test::OneTensorJob;
using ::testing::HasSubstr;

std::unique_ptr<grpc::ClientContext> Ctx() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  return ctx;
}

class MapBytesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    CoordinatorOptions options;
    options.clock = [this] { return now_; };
    core_ = std::make_unique<Coordinator>(options);
    for (int i = 0; i < 3; ++i) {
      auto r = core_->RegisterShard(DpuRegistration(i));
      ASSERT_TRUE(r.ok()) << r.status();
      shards_.push_back(r->shard_id());
    }
    auto job = core_->CreateJob(OneTensorJob("storm", 12));
    ASSERT_TRUE(job.ok()) << job.status();
    job_id_ = job->job_id();
  }

  absl::Time now_ = absl::FromUnixSeconds(1000);
  std::unique_ptr<Coordinator> core_;
  std::vector<uint64_t> shards_;
  uint64_t job_id_ = 0;
};

TEST_F(MapBytesTest, APartIsSerializedOncePerEpochAndEqualsTheCut) {
  const uint64_t s = shards_[0];
  auto first = core_->GetJobSerialized(job_id_, s);
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ(core_->counters().map_parts_serialized, 1u);
  EXPECT_EQ(core_->counters().map_parts_reused, 0u);

  // The same epoch and shard again: the same bytes, not cut again.
  auto second = core_->GetJobSerialized(job_id_, s);
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(*second->map, *first->map);
  EXPECT_EQ(*second->spec, *first->spec);
  EXPECT_EQ(second->head.SerializeAsString(), first->head.SerializeAsString());
  EXPECT_EQ(core_->counters().map_parts_serialized, 1u);
  EXPECT_EQ(core_->counters().map_parts_reused, 1u);

  // The bytes are what the cut gives: head + spec + map parse into the
  // core's GetJob answer for that shard.
  auto cut = core_->GetJob(job_id_, s);
  ASSERT_TRUE(cut.ok()) << cut.status();
  v1::GetJobResponse rebuilt = first->head;
  ASSERT_TRUE(rebuilt.mutable_spec()->ParseFromString(*first->spec));
  ASSERT_TRUE(rebuilt.mutable_map()->ParseFromString(*first->map));
  EXPECT_EQ(rebuilt.SerializeAsString(), cut->SerializeAsString());
  EXPECT_GT(rebuilt.map().chunks_size(), 0);
  EXPECT_EQ(rebuilt.summary().for_shard_id(), s);

  // Another shard's part, and the whole map, are parts of their own.
  auto other = core_->GetJobSerialized(job_id_, shards_[1]);
  auto whole = core_->GetJobSerialized(job_id_, 0);
  ASSERT_TRUE(other.ok() && whole.ok());
  EXPECT_NE(*other->map, *first->map);
  v1::ShardMap whole_map;
  ASSERT_TRUE(whole_map.ParseFromString(*whole->map));
  EXPECT_EQ(whole_map.chunks_size(), 12);
  EXPECT_EQ(core_->counters().map_parts_serialized, 3u);
}

TEST_F(MapBytesTest, ANewEpochGivesTheNewPartAndDropsTheOldBytes) {
  const uint64_t s = shards_[0];
  auto old = core_->GetJobSerialized(job_id_, s);
  ASSERT_TRUE(old.ok()) << old.status();
  v1::ShardMap old_map;
  ASSERT_TRUE(old_map.ParseFromString(*old->map));
  ASSERT_EQ(old_map.epoch(), 1u);
  ASSERT_GT(old_map.chunks_size(), 0);
  // Held by the epoch's snapshot and by us.
  EXPECT_EQ(old->map.use_count(), 2);

  // Draining the shard moves its chunks: epoch 2.
  v1::DrainShardRequest drain;
  drain.set_shard_id(s);
  ASSERT_TRUE(core_->DrainShard(drain).ok());
  ASSERT_EQ(core_->TickReplication(now_), 1);

  auto fresh = core_->GetJobSerialized(job_id_, s);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  v1::ShardMap fresh_map;
  ASSERT_TRUE(fresh_map.ParseFromString(*fresh->map));
  EXPECT_EQ(fresh_map.epoch(), 2u);
  EXPECT_EQ(core_->counters().map_parts_serialized, 2u);
  auto cut = core_->GetJob(job_id_, s);
  ASSERT_TRUE(cut.ok());
  EXPECT_EQ(fresh_map.SerializeAsString(), cut->map().SerializeAsString());
  EXPECT_NE(*fresh->map, *old->map);
  // The epoch-1 snapshot, and its bytes, are gone: only we hold them.
  EXPECT_EQ(old->map.use_count(), 1);
}

TEST_F(MapBytesTest, AnUnknownJobIsNotFound) {
  auto r = core_->GetJobSerialized(job_id_ + 7, shards_[0]);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(r.status().message(), HasSubstr(absl::StrCat(job_id_ + 7)));
}

// Registers three DPU shards and creates job `name` on them.
void ThreeShardsAndAJob(v1::Coordinator::Stub& stub, const std::string& name,
                        std::vector<uint64_t>* shards, v1::CreateJobResponse* created) {
  for (int i = 0; i < 3; ++i) {
    v1::RegisterShardRequest req = DpuRegistration(i);
    v1::RegisterShardResponse resp;
    ASSERT_TRUE(stub.RegisterShard(Ctx().get(), req, &resp).ok());
    shards->push_back(resp.shard_id());
  }
  ASSERT_TRUE(stub.CreateJob(Ctx().get(), OneTensorJob(name, 9, 1), created).ok());
}

// Over gRPC: the answer built from the cached bytes is the message the
// core's GetJob gives, for a shard's part and for the whole map, and the
// second fetch is served from the first one's bytes.
TEST(MapReadsOverGrpcTest, GetJobAnswersFromTheEpochsBytes) {
  CoordinatorOptions options;
  auto server = CoordinatorServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Coordinator::NewStub(channel);
  std::vector<uint64_t> shards;
  v1::CreateJobResponse created;
  ASSERT_NO_FATAL_FAILURE(ThreeShardsAndAJob(*stub, "wire", &shards, &created));
  Coordinator* core = (*server)->core();
  for (uint64_t for_shard : {shards[1], uint64_t{0}}) {
    SCOPED_TRACE(absl::StrCat("for_shard_id ", for_shard));
    v1::GetJobRequest req;
    req.set_job_id(created.job_id());
    req.set_for_shard_id(for_shard);
    v1::GetJobResponse a, b;
    ASSERT_TRUE(stub->GetJob(Ctx().get(), req, &a).ok());
    const uint64_t reused = core->counters().map_parts_reused;
    ASSERT_TRUE(stub->GetJob(Ctx().get(), req, &b).ok());
    EXPECT_EQ(core->counters().map_parts_reused, reused + 1);
    auto want = core->GetJob(created.job_id(), for_shard);
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(a.SerializeAsString(), want->SerializeAsString());
    EXPECT_EQ(b.SerializeAsString(), a.SerializeAsString());
    EXPECT_TRUE(a.has_spec());
    EXPECT_EQ(a.spec().name(), "wire");
    EXPECT_EQ(a.map().epoch(), 1u);
    EXPECT_GT(a.map().chunks_size(), 0);
  }
  EXPECT_THAT((*server)->RenderMetrics(),
              HasSubstr("optimus_coord_map_parts_serialized_total 2"));
}

// A real coordinator serving at most `bound` map reads at once with
// `queued` more waiting, its tables held (as a long planning pass holds
// them) while `bound + queued + more` reads arrive: `more` of them must be
// refused at once with RESOURCE_EXHAUSTED, saying to retry; the others
// are all answered once the tables are free; a refused read retried then
// is answered; and nothing changed.
void ReadsDuringAHeldTable(int bound, int queued, int more) {
  CoordinatorOptions options;
  options.max_concurrent_map_reads = bound;
  options.max_queued_map_reads = queued;
  auto server = CoordinatorServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials());
  auto stub = v1::Coordinator::NewStub(channel);
  std::vector<uint64_t> shards;
  v1::CreateJobResponse created;
  ASSERT_NO_FATAL_FAILURE(ThreeShardsAndAJob(*stub, "bounded", &shards, &created));
  Coordinator* core = (*server)->core();
  // The jobs, and the shards' ids and states (lease ages move on).
  auto state = [core] {
    const v1::StatusResponse st = core->Status();
    std::string out;
    for (const auto& j : st.jobs()) out += j.SerializeAsString();
    for (const auto& sh : st.shards()) out += absl::StrCat(";", sh.shard_id(), "=", sh.state());
    return out;
  };
  const std::string state_before = state();

  // Even calls fetch a shard's part, odd ones the whole map.
  auto read = [&](int i, std::string* error, std::string* retry_after) {
    auto ctx = Ctx();
    grpc::Status s;
    if (i % 2 == 0) {
      v1::GetJobRequest req;
      req.set_job_id(created.job_id());
      req.set_for_shard_id(shards[static_cast<size_t>(i / 2) % shards.size()]);
      v1::GetJobResponse resp;
      s = stub->GetJob(ctx.get(), req, &resp);
      if (s.ok() && resp.map().epoch() != 1) s = grpc::Status(grpc::StatusCode::INTERNAL, "epoch");
    } else {
      v1::GetShardMapRequest req;
      req.set_job_id(created.job_id());
      v1::ShardMap resp;
      s = stub->GetShardMap(ctx.get(), req, &resp);
      if (s.ok() && resp.chunks_size() != 9) s = grpc::Status(grpc::StatusCode::INTERNAL, "map");
    }
    *error = s.error_message();
    auto md = ctx->GetServerTrailingMetadata().find(CoordinatorService::kRetryAfterKey);
    if (md != ctx->GetServerTrailingMetadata().end()) {
      *retry_after = std::string(md->second.data(), md->second.size());
    }
    return s.error_code();
  };

  const int n = bound + queued + more;
  std::vector<grpc::StatusCode> codes(n, grpc::StatusCode::UNKNOWN);
  std::vector<std::string> errors(n), retry_after(n);
  std::atomic<int> refused{0}, answered{0};
  std::vector<std::thread> threads;
  {
    coord_test::TablesHeld held(core);
    for (int i = 0; i < n; ++i) {
      threads.emplace_back([&, i] {
        codes[i] = read(i, &errors[i], &retry_after[i]);
        (codes[i] == grpc::StatusCode::RESOURCE_EXHAUSTED ? refused : answered).fetch_add(1);
      });
    }
    // The reads past the bound and the queue come back while the others
    // wait for the tables (hang guard only: they need no time).
    const absl::Time guard = absl::Now() + absl::Seconds(30);
    while (refused.load() < more && absl::Now() < guard) absl::SleepFor(absl::Milliseconds(5));
    ASSERT_EQ(refused.load(), more) << "reads past the bound were not refused at once";
    EXPECT_EQ(answered.load(), 0);
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(refused.load(), more);
  EXPECT_EQ(answered.load(), bound + queued);
  for (int i = 0; i < n; ++i) {
    SCOPED_TRACE(absl::StrCat("read ", i, ": ", errors[i]));
    if (codes[i] == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      EXPECT_THAT(errors[i], HasSubstr("retry after about 100 ms"));
      EXPECT_THAT(errors[i], HasSubstr("--max_concurrent_map_reads"));
      EXPECT_THAT(errors[i], HasSubstr("--max_queued_map_reads"));
      EXPECT_EQ(retry_after[i], "100");
      // Retried now that the coordinator is free: answered.
      std::string error, ignored;
      EXPECT_EQ(read(i, &error, &ignored), grpc::StatusCode::OK) << error;
    } else {
      EXPECT_EQ(codes[i], grpc::StatusCode::OK);
    }
  }
  EXPECT_EQ(state(), state_before);
  EXPECT_THAT((*server)->RenderMetrics(),
              HasSubstr(absl::StrCat("optimus_coord_map_reads_refused_total ", more)));
}

// No queue: the reads past the bound are refused.
TEST(MapReadsOverGrpcTest, ReadsPastTheBoundAreRefusedAtOnceAndNoneIsLost) {
  ReadsDuringAHeldTable(/*bound=*/2, /*queued=*/0, /*more=*/4);
}

// With a queue, reads past the bound wait their turn and are answered
// (one call each, no retry); only those past the queue too are refused.
TEST(MapReadsOverGrpcTest, ReadsPastTheBoundWaitInTheQueueAndOnlyThosePastItAreRefused) {
  ReadsDuringAHeldTable(/*bound=*/2, /*queued=*/5, /*more=*/3);
}

TEST(MapReadsOverGrpcTest, ANegativeQueueIsRefusedAtStart) {
  CoordinatorOptions options;
  options.max_queued_map_reads = -1;
  auto server = CoordinatorServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(server.status().message(), HasSubstr("max_queued_map_reads"));
}

TEST(MapReadsOverGrpcTest, ABoundBelowOneIsRefusedAtStart) {
  CoordinatorOptions options;
  options.max_concurrent_map_reads = 0;
  auto server = CoordinatorServer::Start(options);
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(server.status().message(), HasSubstr("max_concurrent_map_reads"));
}

}  // namespace
}  // namespace optimus
