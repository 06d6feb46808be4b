// CreateJob plans placement with no lock held and commits it only if no
// shard or job changed meanwhile. These tests change the shards at the one
// moment that matters, from the options' after_off_lock_placement hook
// (called between the plan and its commit; no timing involved), and check
// that the job is placed as if it had been planned at commit time.
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "coordinator/coordinator.h"
#include "coordinator/test_fixtures.h"
#include "gtest/gtest.h"
#include "proto/optimus.pb.h"

namespace optimus {
namespace {

using coord_test::OneTensorJob;
using coord_test::DpuRegistration;

constexpr absl::Duration kLease = absl::Seconds(2);


class OffLockPlacementTest : public ::testing::Test {
 protected:
  OffLockPlacementTest() {
    options_.lease = kLease;
    options_.clock = [this] { return now_; };
    options_.after_off_lock_placement = [this](int attempt) {
      attempts_.push_back(attempt);
      if (during_planning_) during_planning_(attempt);
    };
  }
  void SetUp() override {
    coord_ = std::make_unique<Coordinator>(options_);
    ASSERT_TRUE(coord_->Recover().ok());
  }

  uint64_t AddShard(uint64_t memory_limit_bytes = uint64_t{1} << 30) {
    auto resp = coord_->RegisterShard(DpuRegistration(next_name_++, memory_limit_bytes));
    EXPECT_TRUE(resp.ok()) << resp.status();
    return resp->shard_id();
  }

  // Chunks (primary or backup) by shard in the job's current map.
  std::map<uint64_t, int> Holders(uint64_t job_id) {
    std::map<uint64_t, int> held;
    auto map = coord_->GetShardMap(job_id);
    EXPECT_TRUE(map.ok()) << map.status();
    for (const auto& c : map->chunks()) {
      ++held[c.shard_id()];
      if (c.backup_shard_id() != 0) ++held[c.backup_shard_id()];
    }
    return held;
  }

  CoordinatorOptions options_;
  absl::Time now_ = absl::FromUnixSeconds(1000);
  std::unique_ptr<Coordinator> coord_;
  int next_name_ = 0;
  std::vector<int> attempts_;
  std::function<void(int)> during_planning_;
};

TEST_F(OffLockPlacementTest, QuietShardsCommitTheFirstPlan) {
  for (int i = 0; i < 3; ++i) AddShard();
  auto job = coord_->CreateJob(OneTensorJob("quiet", 9));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(attempts_, std::vector<int>({0}));
  EXPECT_EQ(coord_->counters().placement_retries, 0u);
  EXPECT_EQ(coord_->counters().placements_under_lock, 0u);
  EXPECT_EQ(Holders(job->job_id()).size(), 3u);
}

// A shard that registers while the plan is made gets its share: the first
// plan (without it) is thrown away.
TEST_F(OffLockPlacementTest, AShardRegisteredDuringPlanningIsPlacedOn) {
  for (int i = 0; i < 2; ++i) AddShard();
  uint64_t late = 0;
  during_planning_ = [&](int attempt) {
    if (attempt == 0) late = AddShard();
  };
  auto job = coord_->CreateJob(OneTensorJob("late", 9));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(attempts_, std::vector<int>({0, 1}));
  EXPECT_EQ(coord_->counters().placement_retries, 1u);
  const std::map<uint64_t, int> held = Holders(job->job_id());
  ASSERT_EQ(held.count(late), 1u) << "the shard registered during planning holds nothing";
  EXPECT_EQ(held.at(late), 3);
}

// A job that did not fit when planned fits once a big shard registered: it
// is not refused on a stale plan.
TEST_F(OffLockPlacementTest, ARefusalPlannedBeforeAShardRegisteredIsNotTheAnswer) {
  AddShard(/*memory_limit_bytes=*/4096);  // Holds no chunk.
  uint64_t big = 0;
  during_planning_ = [&](int attempt) {
    if (attempt == 0) big = AddShard();
  };
  auto job = coord_->CreateJob(OneTensorJob("fits-later", 4));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(Holders(job->job_id()), (std::map<uint64_t, int>{{big, 4}}));
  EXPECT_EQ(coord_->counters().jobs_refused[static_cast<int>(Coordinator::JobRefusal::kCapacity)],
            0u);
}

// A shard that starts draining while the plan is made gets nothing.
TEST_F(OffLockPlacementTest, AShardDrainedDuringPlanningGetsNothing) {
  const uint64_t a = AddShard(), b = AddShard(), c = AddShard();
  during_planning_ = [&](int attempt) {
    if (attempt != 0) return;
    v1::DrainShardRequest req;
    req.set_shard_id(b);
    auto drained = coord_->DrainShard(req);
    ASSERT_TRUE(drained.ok()) << drained.status();
  };
  auto job = coord_->CreateJob(OneTensorJob("drain", 8, /*replication=*/1));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(coord_->counters().placement_retries, 1u);
  const std::map<uint64_t, int> held = Holders(job->job_id());
  EXPECT_EQ(held.count(b), 0u) << "chunks placed on draining shard " << b;
  EXPECT_EQ(held.at(a) + held.at(c), 16);
}

// A shard whose lease runs out while the plan is made gets nothing.
TEST_F(OffLockPlacementTest, AShardDownDuringPlanningGetsNothing) {
  const uint64_t a = AddShard(), b = AddShard();
  during_planning_ = [&](int attempt) {
    if (attempt != 0) return;
    now_ += kLease + absl::Seconds(1);
    v1::HeartbeatRequest beat;
    beat.set_shard_id(a);
    ASSERT_TRUE(coord_->Heartbeat(beat).known());
    ASSERT_EQ(coord_->SweepExpiredLeases(now_), 1);  // b.
  };
  auto job = coord_->CreateJob(OneTensorJob("down", 6));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(Holders(job->job_id()), (std::map<uint64_t, int>{{a, 6}}));
  (void)b;
}

// Another job created while the plan is made: its bytes count, as if the
// two had been created one after the other.
TEST_F(OffLockPlacementTest, AJobCreatedDuringPlanningIsPlannedAround) {
  const uint64_t a = AddShard(), b = AddShard();
  bool nested = false;
  during_planning_ = [&](int attempt) {
    if (attempt != 0 || nested) return;
    nested = true;
    auto other = coord_->CreateJob(OneTensorJob("first", 3));  // 2 chunks on a, 1 on b.
    ASSERT_TRUE(other.ok()) << other.status();
  };
  auto job = coord_->CreateJob(OneTensorJob("second", 3));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(coord_->counters().placement_retries, 1u);
  // Planned around "first": b, a, b. A stale plan (as if "first" did not
  // exist) would have put a, b, a: 4 chunks on a and 2 on b in all.
  std::map<uint64_t, int> total;
  for (uint64_t id : {uint64_t{1}, job->job_id()}) {
    for (const auto& [shard, n] : Holders(id)) total[shard] += n;
  }
  EXPECT_EQ(total, (std::map<uint64_t, int>{{a, 3}, {b, 3}}));
}

// Shards that keep changing cannot starve a job: after kOffLockPlacements
// stale plans it is planned under the lock, over every shard there is.
TEST_F(OffLockPlacementTest, ShardsThatKeepChangingArePlannedUnderTheLock) {
  AddShard();
  std::set<uint64_t> added;
  during_planning_ = [&](int) { added.insert(AddShard()); };
  auto job = coord_->CreateJob(OneTensorJob("busy", 12));
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(static_cast<int>(attempts_.size()), Coordinator::kOffLockPlacements);
  EXPECT_EQ(coord_->counters().placement_retries,
            static_cast<uint64_t>(Coordinator::kOffLockPlacements));
  EXPECT_EQ(coord_->counters().placements_under_lock, 1u);
  const std::map<uint64_t, int> held = Holders(job->job_id());
  for (uint64_t id : added) EXPECT_EQ(held.count(id), 1u) << "shard " << id << " holds nothing";
  EXPECT_EQ(held.size(), 1 + added.size());
}

// The error contract holds with planning off the lock: a name taken while
// the plan was made is refused at the commit, and nothing is added.
TEST_F(OffLockPlacementTest, ANameTakenDuringPlanningIsRefused) {
  AddShard();
  bool nested = false;
  during_planning_ = [&](int attempt) {
    if (attempt != 0 || nested) return;
    nested = true;
    ASSERT_TRUE(coord_->CreateJob(OneTensorJob("same", 2)).ok());
  };
  auto job = coord_->CreateJob(OneTensorJob("same", 3));
  EXPECT_EQ(job.status().code(), absl::StatusCode::kAlreadyExists) << job.status();
  EXPECT_EQ(coord_->table_sizes().jobs, 1u);
}

}  // namespace
}  // namespace optimus
