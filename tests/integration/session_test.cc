// One-call setup (client/session.h) against a real coordinator and shards:
// ranks started in any order meet in one job, settings come from arguments,
// the environment or a job spec file, and mistakes are named.
#include "client/session.h"

#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace client {
namespace {

using harness::Cluster;
using harness::ClusterOptions;
using ::testing::HasSubstr;

std::vector<TensorDef> ModelTensors() {
  return {{"fc1.weight", {64, 32}}, {"fc1.bias", {64}}, {"fc2.weight", {8, 64}}, {"fc2.bias", {8}}};
}

class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    for (const char* v : {"OPTIMUS_COORDINATOR", "RANK", "WORLD_SIZE", "OPTIMUS_JOB",
                          "OPTIMUS_JOB_SPEC"}) {
      unsetenv(v);
    }
    ClusterOptions o;
    o.num_shards = 2;
    o.num_workers = 1;  // The harness wants one; the tests make their own clients.
    ASSERT_OK_AND_ASSIGN(cluster_, Cluster::Start(o));
  }

  SessionOptions Options(int64_t rank, int64_t world, const std::string& job) {
    SessionOptions o;
    o.coordinator = cluster_->coordinator_address();
    o.rank = rank;
    o.world_size = world;
    o.job_name = job;
    o.join_timeout = absl::Seconds(60);
    o.client.transport = cluster_->TransportOptions(absl::StrCat("worker", rank));
    return o;
  }

  JobDef Def() {
    JobDef def;
    def.tensors = ModelTensors();
    def.optimizer.lr = 1e-3f;
    return def;
  }

  std::unique_ptr<Cluster> cluster_;
};

TEST_F(SessionTest, RanksStartedInAnyOrderMeetInOneJob) {
  // Rank 1 starts first: it waits for rank 0 to create the job.
  absl::StatusOr<Session> s1 = absl::UnknownError("not run");
  std::thread t([&] { s1 = JoinOrCreate(Options(1, 2, "meet"), Def()); });
  auto s0 = JoinOrCreate(Options(0, 2, "meet"), Def());
  t.join();
  ASSERT_OK(s0.status());
  ASSERT_OK(s1.status());
  EXPECT_TRUE(s0->created);
  EXPECT_TRUE(s0->needs_init);
  EXPECT_FALSE(s1->created);
  EXPECT_FALSE(s1->needs_init);
  EXPECT_EQ(s0->client->job_id(), s1->client->job_id());
  EXPECT_EQ(s1->client->rank(), 1u);
  EXPECT_EQ(s1->client->world_size(), 2u);
  ASSERT_EQ(s1->client->tensors().size(), 4u);
  EXPECT_EQ(s1->client->tensors()[2].name, "fc2.weight");
  // The job works: rank 0 sends version 1, rank 1 reads it.
  std::vector<float> bias(8, 0.5f), got(8);
  ASSERT_OK(s0->client->InitTensor(3, bias.data(), bias.size()));
  for (uint32_t t2 = 0; t2 < 3; ++t2) {
    std::vector<float> zeros(s0->client->tensors()[t2].num_elems, 0.0f);
    ASSERT_OK(s0->client->InitTensor(t2, zeros.data(), zeros.size()));
  }
  std::vector<uint16_t> raw(8);
  ASSERT_OK_AND_ASSIGN(Ticket tk, s1->client->Pull(3, 1, raw.data(), raw.size()));
  ASSERT_OK(s1->client->Wait(tk, absl::Seconds(30)));
  EXPECT_EQ(raw[0], 0x3f00);  // bf16 0.5
}

TEST_F(SessionTest, TheEnvironmentFillsWhatTheArgumentsLeaveOut) {
  setenv("OPTIMUS_COORDINATOR", cluster_->coordinator_address().c_str(), 1);
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  setenv("OPTIMUS_JOB", "from-env", 1);
  SessionOptions o;  // Nothing set but the transport.
  o.client.transport = cluster_->TransportOptions("worker0");
  auto s = JoinOrCreate(o, Def());
  ASSERT_OK(s.status());
  EXPECT_EQ(s->job_name, "from-env");
  EXPECT_EQ(s->client->world_size(), 1u);
  EXPECT_TRUE(s->created);
}

TEST_F(SessionTest, AJobSpecFileSetsTheOptimizerGroupsAndClipping) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, harness::NewTempDir("spec"));
  const std::string path = dir + "/train.yaml";
  {
    std::ofstream out(path);
    out << "name: spec-job\n"
           "optimizer: {type: adamw, params: {lr: 3.0e-4, weight_decay: 0.1}}\n"
           "gradient_clipping: 1.0\n"
           "param_groups:\n"
           "  - {name: no_decay, match: '*.bias', weight_decay: 0}\n"
           "  - {name: decay}\n";
  }
  SessionOptions o = Options(0, 1, "");
  o.job_spec_path = path;
  auto s = JoinOrCreate(o, Def());
  ASSERT_OK(s.status());
  EXPECT_EQ(s->job_name, "spec-job");
  EXPECT_EQ(s->client->num_param_groups(), 2u);
  const auto& t = s->client->tensors();
  EXPECT_EQ(t[0].group, 1u);  // fc1.weight: decay.
  EXPECT_EQ(t[1].group, 0u);  // fc1.bias: no_decay.
  EXPECT_EQ(t[3].group, 0u);
  EXPECT_FLOAT_EQ(s->def.max_grad_norm, 1.0f);
  // Clipping is on: the job reports a StepResult (a job without a round
  // answers FAILED_PRECONDITION).
  auto r = s->client->StepResult(1, absl::Milliseconds(1));
  EXPECT_NE(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status();
}

TEST_F(SessionTest, AnExistingJobOfAnotherModelIsNamed) {
  ASSERT_OK(JoinOrCreate(Options(0, 1, "other"), Def()).status());
  JobDef different = Def();
  different.tensors[2].shape = {8, 65};
  auto s = JoinOrCreate(Options(0, 1, "other"), different);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("'fc2.weight' [8,64]"));
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("optimusctl job delete other"));
}

TEST_F(SessionTest, MissingOrInconsistentSettingsAreRefusedBeforeAnyContact) {
  SessionOptions none;
  auto s = JoinOrCreate(none, Def());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("OPTIMUS_COORDINATOR"));

  SessionOptions o = Options(-1, -1, "x");
  setenv("RANK", "1", 1);  // WORLD_SIZE missing.
  s = JoinOrCreate(o, Def());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("RANK and WORLD_SIZE"));
  setenv("WORLD_SIZE", "two", 1);
  s = JoinOrCreate(o, Def());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("$WORLD_SIZE='two'"));
  s = JoinOrCreate(Options(2, 2, "x"), Def());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("rank 2 of world size 2"));
  SessionOptions bad_spec = Options(0, 1, "x");
  bad_spec.job_spec_path = "/nonexistent/train.yaml";
  s = JoinOrCreate(bad_spec, Def());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
}

TEST_F(SessionTest, ARankWhoseJobNeverComesGivesUpWithTheReason) {
  SessionOptions o = Options(1, 2, "never-created");
  o.join_timeout = absl::Seconds(1);
  auto s = JoinOrCreate(o, Def());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("could not join job 'never-created'"));
}

}  // namespace
}  // namespace client
}  // namespace optimus
