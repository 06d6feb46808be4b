// Shards, workers and optimusctl given two coordinator addresses follow the
// one that listens. Real coordinators (one at a time, over one state
// folder, as a leader and its standby over etcd look from outside: the
// standby does not listen until it leads), real shards and workers, TLS.
// The standby's address is listed first and dialled by name
// ("localhost:B,127.0.0.1:A"), so every first call finds nobody there and
// TLS checks the certificate by a DNS name on one address and an IP on the
// other. The etcd-backed drill with real processes is
// tests/fault/leader_kill_drill_test.sh.
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "client/session.h"
#include "tests/harness/cluster.h"
#include "tests/harness/optimusctl_run.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace harness {
namespace {

using ::testing::HasSubstr;

class CoordinatorTakeoverTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_OK_AND_ASSIGN(ca_, MakeTestCa(3));
    ClusterOptions o;
    o.num_shards = 3;
    o.num_workers = 2;
    o.tls_root = ca_;
    o.standby_address = true;
    ASSERT_OK_AND_ASSIGN(o.state_dir, NewTempDir("coord-state"));
    // Shards registered through the standby-first list: each first tried
    // the address where nobody listens.
    ASSERT_OK_AND_ASSIGN(cluster_, Cluster::Start(o));
  }

  // Every shard UP at the coordinator that listens now, and the job READY
  // there with every shard's progress at `step`: only heartbeats sent to
  // it after it started can tell it that.
  void ExpectFollowed(const std::string& job, uint64_t step) {
    ASSERT_OK(cluster_->WaitApplied(job, step));
    ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, cluster_->Status());
    int up = 0;
    for (const auto& s : st.shards()) up += s.state() != v1::SHARD_STATE_DOWN;
    EXPECT_EQ(up, st.shards_size()) << "a shard did not follow the coordinator";
    ASSERT_EQ(st.jobs_size(), 1);
    EXPECT_EQ(st.jobs(0).state(), v1::JOB_STATE_READY);
  }

  std::string ca_;
  std::unique_ptr<Cluster> cluster_;
};

TEST_F(CoordinatorTakeoverTest, ShardsWorkersAndOptimusctlFollowTheCoordinatorThatListens) {
  const std::string first = cluster_->listening_address();
  EXPECT_THAT(cluster_->coordinator_address(), HasSubstr("localhost:"));
  const client::JobDef def = SmallJob("takeover", 2);
  // CreateJob and both joins went to the standby's address first.
  ASSERT_OK(cluster_->CreateJob(def));
  uint64_t step = 0;
  ASSERT_OK(cluster_->Train(step + 1, step + 5));
  step += 5;
  ExpectFollowed("takeover", step);

  // The takeover: the coordinator at the second address now.
  ASSERT_OK(cluster_->MoveCoordinator());
  EXPECT_NE(cluster_->listening_address(), first);
  ASSERT_OK(cluster_->Train(step + 1, step + 5));
  step += 5;
  ExpectFollowed("takeover", step);

  // A drain under the new coordinator: the workers get the new maps from
  // it (their requests to the drained shard are refused and re-sent where
  // the map they fetch says).
  ASSERT_OK_AND_ASSIGN(v1::DrainShardResponse drain, cluster_->DrainShard(0));
  EXPECT_GT(drain.chunks_to_move(), 0u);
  const uint64_t drained = cluster_->shard(0)->shard_id();
  bool empty = false;
  for (int extra = 0; extra < 200 && !empty; ++extra) {
    ++step;
    ASSERT_OK(cluster_->Train(step, step));
    ASSERT_OK_AND_ASSIGN(v1::StatusResponse s, cluster_->Status());
    for (const auto& sh : s.shards()) {
      if (sh.shard_id() == drained) empty = sh.chunks_owned() == 0;
    }
  }
  ASSERT_TRUE(empty) << "the drain under the new coordinator never finished";

  // And back: a second takeover, to the first address.
  ASSERT_OK(cluster_->MoveCoordinator());
  EXPECT_EQ(cluster_->listening_address(), first);
  ASSERT_OK(cluster_->Train(step + 1, step + 5));
  step += 5;
  ExpectFollowed("takeover", step);

  // optimusctl with both addresses, in either order.
  const std::string a = cluster_->coordinator_address();
  const std::string b = a.substr(a.find(',') + 1) + "," + a.substr(0, a.find(','));
  for (const std::string& list : {a, b}) {
    const CliRun r = RunOptimusctl(
        absl::StrCat("--coordinator=", list, " --tls_dir=", ca_, "/admin status -o json"));
    EXPECT_EQ(r.exit_code, 0) << list << ": " << r.err;
    EXPECT_THAT(r.out, HasSubstr("\"takeover\"")) << list;
  }

  // No step lost through two takeovers and a drain.
  for (uint32_t t = 0; t < def.tensors.size(); ++t) {
    ASSERT_OK_AND_ASSIGN(const std::vector<float> got, cluster_->PullFp32(t, step + 1));
    ASSERT_OK_AND_ASSIGN(const std::vector<float> want, ReferenceParams(def, t, step));
    EXPECT_EQ(got, want) << "tensor " << t;
  }
  // The workers' own calls reach the coordinator that listens now.
  for (uint32_t r = 0; r < 2; ++r) EXPECT_OK(cluster_->worker(r)->Leave());
  ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, cluster_->Status());
  ASSERT_EQ(st.jobs_size(), 1);
  EXPECT_EQ(st.jobs(0).workers_joined(), 0u);
}

// While no coordinator listens at all (between the leader's death and the
// standby's election), a trainer that starts keeps trying: it creates its
// job and joins once one listens, at whichever address, and the shards,
// following it too, load the job.
TEST_F(CoordinatorTakeoverTest, ATrainerStartingInTheGapReachesTheNewLeader) {
  ASSERT_OK(cluster_->StopCoordinator());
  client::SessionOptions o;
  o.coordinator = cluster_->coordinator_address();
  o.rank = 0;
  o.world_size = 1;
  o.job_name = "gap";
  o.client.tls.dir = ca_ + "/trainer";
  o.client.job_token = cluster_->options().job_token;
  o.client.transport = cluster_->TransportOptions("late-worker");
  absl::StatusOr<client::Session> session = absl::UnknownError("not run");
  std::thread trainer([&] { session = client::JoinOrCreate(o, SmallJob("gap", 1)); });
  // Not a timing check: only so that the trainer's first tries find nobody.
  absl::SleepFor(absl::Milliseconds(500));
  ASSERT_OK(cluster_->MoveCoordinator());
  trainer.join();
  ASSERT_OK(session.status());
  EXPECT_TRUE(session->created);
  EXPECT_GT(session->client->job_id(), 0u);
  EXPECT_EQ(session->client->tensors().size(), 2u);
}

// A trainer given a malformed list learns it at once, naming the entry.
TEST(CoordinatorListTest, AClientRefusesABadListBeforeStartingAnything) {
  client::ClientOptions o;
  o.coordinator_address = "coord-a:7070,coord-b";
  o.tls.plaintext = true;
  auto c = client::Client::Connect(o);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("\"coord-b\""));
  EXPECT_THAT(std::string(c.status().message()), HasSubstr("no port"));
}

}  // namespace
}  // namespace harness
}  // namespace optimus
