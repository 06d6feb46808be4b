// A fetch storm against a real coordinator that serves one map read at a
// time and lets none wait (max_concurrent_map_reads 1, max_queued_map_reads
// 0), with real shard servers and clients in this process: while a map
// read holds the only slot, every other
// shard's and rank's map fetch is refused with RESOURCE_EXHAUSTED. The
// shards (their loader) and the ranks (Client::Join) try again after
// jittered waits, so once the slot is free every shard loads the job,
// every rank joins, and a step trains.
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace {

using harness::Cluster;
using harness::ClusterOptions;

constexpr int kShards = 4;
constexpr uint32_t kRanks = 4;

// Keeps the coordinator's one map-read slot taken while closed: the map
// read that takes it waits in the coordinator's test hook.
class Gate {
 public:
  void Close() {
    absl::MutexLock lock(&mu_);
    closed_ = true;
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    closed_ = false;
  }
  // The coordinator's while_reading_map hook.
  void Pass() {
    absl::MutexLock lock(&mu_);
    if (!closed_) return;
    ++waiting_;
    mu_.Await(absl::Condition(
        +[](bool* closed) { return !*closed; }, &closed_));
    --waiting_;
  }
  bool Holding() {
    absl::MutexLock lock(&mu_);
    return waiting_ > 0;
  }

 private:
  absl::Mutex mu_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;
};

class FetchStormTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ClusterOptions o;
    o.num_shards = kShards;
    o.num_workers = kRanks;
    o.max_concurrent_map_reads = 1;
    o.max_queued_map_reads = 0;  // None waits: the others are refused.
    o.while_reading_map = [this] { gate_.Pass(); };
    ASSERT_OK_AND_ASSIGN(cluster_, Cluster::Start(o));
  }

  void TearDown() override {
    gate_.Open();
    if (holder_.joinable()) holder_.join();
  }

  // A map read (of a job that does not exist) takes the only slot and
  // waits at the gate until it opens.
  void TakeTheSlot() {
    gate_.Close();
    holder_ = std::thread([this] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
      v1::GetShardMapRequest req;
      req.set_job_id(999999);
      v1::ShardMap map;
      cluster_->stub()->GetShardMap(&ctx, req, &map);
    });
    ASSERT_OK(cluster_->WaitUntil("a map read holding the only slot",
                                  [this] { return gate_.Holding(); }));
  }
  void FreeTheSlot() {
    gate_.Open();
    holder_.join();
  }

  uint64_t Refused() { return cluster_->coordinator()->map_reads_refused(); }

  v1::JobStatus JobNamed(const std::string& name) {
    absl::StatusOr<v1::StatusResponse> st = cluster_->Status();
    EXPECT_TRUE(st.ok()) << st.status();
    if (!st.ok()) return v1::JobStatus();
    for (const auto& j : st->jobs()) {
      if (j.name() == name) return j;
    }
    return v1::JobStatus();
  }

  Gate gate_;
  std::unique_ptr<Cluster> cluster_;
  std::thread holder_;
};

TEST_F(FetchStormTest, RefusedShardsAndRanksRetryAndAllEndUpLoadedAndJoined) {
  const std::string name = "storm";
  ASSERT_OK(cluster_->ConnectWorkers());

  // The shards: the new job's parts cannot be read while the slot is taken.
  TakeTheSlot();
  ASSERT_OK(cluster_->worker(0)->CreateJob(harness::SmallJob(name, kRanks)));
  ASSERT_OK(cluster_->WaitUntil("every shard refused twice",
                                [&] { return Refused() >= 2 * kShards; }));
  EXPECT_EQ(JobNamed(name).state(), v1::JOB_STATE_PENDING);
  FreeTheSlot();
  ASSERT_OK(cluster_->WaitStatus("the job READY", [&](const v1::StatusResponse& st) {
    for (const auto& j : st.jobs()) {
      if (j.name() == name) return j.state() == v1::JOB_STATE_READY;
    }
    return false;
  }));

  // The ranks: every one joins at once while the slot is taken; each is
  // refused at least once in Join's fetch of the job, and none gives up.
  TakeTheSlot();
  const uint64_t before = Refused();
  std::vector<absl::Status> joined(kRanks, absl::UnknownError("not done"));
  std::vector<std::thread> ranks;
  for (uint32_t r = 0; r < kRanks; ++r) {
    ranks.emplace_back([&, r] { joined[r] = cluster_->worker(r)->Join(name, r, kRanks); });
  }
  ASSERT_OK(cluster_->WaitUntil("a refused fetch per rank",
                                [&] { return Refused() >= before + kRanks; }));
  FreeTheSlot();
  for (auto& t : ranks) t.join();
  for (uint32_t r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    EXPECT_OK(joined[r]);
  }
  EXPECT_EQ(JobNamed(name).workers_joined(), kRanks);

  // And the job trains.
  client::Client* c = cluster_->worker(0);
  for (uint32_t t = 0; t < c->tensors().size(); ++t) {
    std::vector<float> v(c->tensors()[t].num_elems);
    for (size_t i = 0; i < v.size(); ++i) v[i] = harness::InitialValue(t, i);
    ASSERT_OK(c->InitTensor(t, v.data(), v.size()));
  }
  ASSERT_OK(cluster_->Train(1, 1));
}

}  // namespace
}  // namespace optimus
