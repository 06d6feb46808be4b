// The map planners on their own, table-driven: for each situation (which
// shards are up, draining or down, where each chunk's copies are, which
// backups are in sync, how much room is left), the map the job gets and
// what is counted.
#include "coordinator/map_planner.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/optimizer_spec.h"

namespace optimus {
namespace {

using ::testing::HasSubstr;

using H = ShardHealth;

// A chunk of 10 elements at 1 byte each: 10 bytes per copy (no per-chunk
// bookkeeping: these tests check the planning arithmetic; what the
// coordinator adds per chunk is checked in ComputeLoadTest).
struct C {
  uint64_t primary;
  uint64_t backup;
  bool in_sync;
};

JobLayout Layout(const std::vector<C>& chunks, uint32_t replication) {
  JobLayout job;
  job.bytes_per_elem = 1;
  job.chunk_overhead_bytes = 0;
  job.replication = replication;
  uint32_t index = 0;
  for (const C& c : chunks) {
    ChunkSpec s;
    s.tensor = 0;
    s.chunk = index++;
    s.offset_elems = 10 * s.chunk;
    s.num_elems = 10;
    s.shard_id = c.primary;
    s.backup_shard_id = c.backup;
    job.chunks.push_back(s);
    job.backup_in_sync.push_back(c.in_sync);
  }
  return job;
}

// UP shards with `room` bytes each (nothing planned), as placement
// candidates.
std::vector<ShardInfo> Room(const std::vector<uint64_t>& ids, uint64_t room) {
  std::vector<ShardInfo> out;
  for (uint64_t id : ids) out.push_back({id, /*is_dpu=*/true, room, 0});
  return out;
}

std::vector<std::pair<uint64_t, uint64_t>> Copies(const JobLayout& job) {
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (const ChunkSpec& c : job.chunks) out.push_back({c.shard_id, c.backup_shard_id});
  return out;
}

TEST(ComputeLoadTest, BackupsCostAsMuchAsPrimaries) {
  const JobLayout job = Layout({{1, 2, false}, {1, 0, false}, {2, 3, false}}, 1);
  const auto load = ComputeLoad(job.chunks, 3, /*chunk_overhead_bytes=*/0);
  ASSERT_EQ(load.size(), 3u);
  EXPECT_EQ(load.at(1).num_chunks, 2u);
  EXPECT_EQ(load.at(1).backup_chunks, 0u);
  EXPECT_EQ(load.at(1).size_bytes, 60u);
  EXPECT_EQ(load.at(2).num_chunks, 2u);
  EXPECT_EQ(load.at(2).backup_chunks, 1u);
  EXPECT_EQ(load.at(3).backup_chunks, 1u);
  EXPECT_EQ(load.at(3).size_bytes, 30u);
}

TEST(ComputeLoadTest, EveryCopyAlsoCostsTheChunksBookkeeping) {
  const JobLayout job = Layout({{1, 2, false}, {1, 0, false}}, 1);
  const auto load = ComputeLoad(job.chunks, 3);  // The default overhead.
  EXPECT_EQ(load.at(1).size_bytes, 2 * (30 + kernels::kChunkOverheadBytes));
  EXPECT_EQ(load.at(2).size_bytes, 30 + kernels::kChunkOverheadBytes);
}

struct FailoverCase {
  std::string what;
  ShardHealthMap health;
  std::vector<C> chunks;
  uint32_t replication;
  std::vector<ShardInfo> candidates;
  FailoverPlan::Outcome outcome;
  std::vector<std::pair<uint64_t, uint64_t>> after;  // kFailedOver only.
  uint32_t promoted, backups_lost, new_backups, without_backup, unprotected;
};

TEST(PlanFailoverTest, Table) {
  using O = FailoverPlan::Outcome;
  const std::vector<FailoverCase> cases = {
      {"nothing down", {{1, H::kUp}, {2, H::kUp}}, {{1, 2, true}, {2, 0, false}}, 0,
       Room({1, 2}, 100), O::kUnchanged, {}, 0, 0, 0, 0, 0},
      {"lost primary, backup in sync: promoted", {{1, H::kDown}, {2, H::kUp}},
       {{1, 2, true}, {2, 0, false}}, 0, Room({2}, 100), O::kFailedOver, {{2, 0}, {2, 0}},
       1, 0, 0, 0, 0},
      {"replication 1: the promoted chunk gets a new backup", {{1, H::kDown}, {2, H::kUp}, {3, H::kUp}},
       {{1, 2, true}, {2, 3, true}}, 1, Room({2, 3}, 100), O::kFailedOver, {{2, 3}, {2, 3}},
       1, 0, 1, 0, 0},
      {"replication 1 with no room: stays without a backup", {{1, H::kDown}, {2, H::kUp}},
       {{1, 2, true}}, 1, Room({2}, 100), O::kFailedOver, {{2, 0}}, 1, 0, 0, 1, 0},
      {"backup not in sync: the job fails", {{1, H::kDown}, {2, H::kUp}},
       {{1, 2, false}, {2, 1, true}}, 1, Room({2}, 100), O::kFailed, {}, 0, 0, 0, 0, 1},
      {"no backup: the job fails", {{1, H::kDown}, {2, H::kUp}}, {{1, 0, false}, {2, 0, false}},
       0, Room({2}, 100), O::kFailed, {}, 0, 0, 0, 0, 1},
      {"primary and backup lost together: the job fails", {{1, H::kDown}, {2, H::kDown}, {3, H::kUp}},
       {{1, 2, true}}, 1, Room({3}, 100), O::kFailed, {}, 0, 0, 0, 0, 1},
      {"a forgotten shard counts as down", {{2, H::kUp}}, {{1, 2, true}}, 0, Room({2}, 100),
       O::kFailedOver, {{2, 0}}, 1, 0, 0, 0, 0},
      {"in-sync backup on a draining shard may be promoted", {{1, H::kDown}, {2, H::kDraining}},
       {{1, 2, true}}, 0, {}, O::kFailedOver, {{2, 0}}, 1, 0, 0, 0, 0},
      {"only a backup lost, replication 0: dropped", {{1, H::kUp}, {2, H::kDown}},
       {{1, 2, true}}, 0, Room({1}, 100), O::kFailedOver, {{1, 0}}, 0, 1, 0, 0, 0},
      {"only a backup lost, replication 1: replaced", {{1, H::kUp}, {2, H::kDown}, {3, H::kUp}},
       {{1, 2, true}}, 1, Room({1, 3}, 100), O::kFailedOver, {{1, 3}}, 0, 1, 1, 0, 0},
  };
  for (const FailoverCase& c : cases) {
    SCOPED_TRACE(c.what);
    const JobLayout job = Layout(c.chunks, c.replication);
    std::vector<ShardInfo> candidates = c.candidates;
    const FailoverPlan plan = PlanFailover(job, c.health, candidates);
    EXPECT_EQ(plan.outcome, c.outcome);
    EXPECT_EQ(plan.unprotected, c.unprotected);
    if (c.outcome != O::kFailedOver) continue;
    EXPECT_EQ(Copies(plan.after), c.after);
    EXPECT_EQ(plan.promoted, c.promoted);
    EXPECT_EQ(plan.backups_lost, c.backups_lost);
    EXPECT_EQ(plan.new_backups, c.new_backups);
    EXPECT_EQ(plan.without_backup, c.without_backup);
    // A chunk whose copies changed is not in sync until its shard says so.
    for (size_t i = 0; i < job.chunks.size(); ++i) {
      if (Copies(plan.after)[i] != Copies(job)[i]) {
        EXPECT_FALSE(plan.after.backup_in_sync[i]) << i;
      }
    }
  }
}

TEST(PlanFailoverTest, AFailedJobsBytesAreFreeForTheJobsThatFollow) {
  const JobLayout job = Layout({{1, 0, false}, {2, 0, false}}, 0);
  std::vector<ShardInfo> candidates = {{2, true, 100, 30}, {3, true, 100, 5}};
  const FailoverPlan plan = PlanFailover(job, {{1, H::kDown}, {2, H::kUp}, {3, H::kUp}}, candidates);
  EXPECT_EQ(plan.outcome, FailoverPlan::Outcome::kFailed);
  EXPECT_EQ(plan.lost_primaries, 1u);
  EXPECT_EQ(candidates[0].memory_planned_bytes, 20u);  // Its 10 bytes on shard 2 are free.
  EXPECT_EQ(candidates[1].memory_planned_bytes, 5u);
}

TEST(PlanFailoverTest, NewBackupsCountOnTheShardThatTakesThem) {
  const JobLayout job = Layout({{1, 2, true}, {1, 2, true}}, 1);
  std::vector<ShardInfo> candidates = Room({2, 3, 4}, 100);
  const FailoverPlan plan =
      PlanFailover(job, {{1, H::kDown}, {2, H::kUp}, {3, H::kUp}, {4, H::kUp}}, candidates);
  ASSERT_EQ(plan.outcome, FailoverPlan::Outcome::kFailedOver);
  // Balanced by planned bytes: the second backup goes where the first did not.
  EXPECT_EQ(Copies(plan.after), (std::vector<std::pair<uint64_t, uint64_t>>{{2, 3}, {2, 4}}));
  EXPECT_EQ(candidates[1].memory_planned_bytes, 10u);
  EXPECT_EQ(candidates[2].memory_planned_bytes, 10u);
}

TEST(PlanFailoverTest, NewBackupsLeaveThePromotedPrimarysFailureDomain) {
  // Shard 2 (the backup, promoted) shares a server with 3; 4 is elsewhere.
  const JobLayout job = Layout({{1, 2, true}, {1, 2, true}}, 1);
  std::vector<ShardInfo> candidates = Room({2, 3, 4}, 100);
  candidates[0].domain = candidates[1].domain = 50;
  candidates[2].domain = 60;
  const FailoverPlan plan =
      PlanFailover(job, {{1, H::kDown}, {2, H::kUp}, {3, H::kUp}, {4, H::kUp}}, candidates);
  ASSERT_EQ(plan.outcome, FailoverPlan::Outcome::kFailedOver);
  // Both on 4, though balance alone would have put one on 3.
  EXPECT_EQ(Copies(plan.after), (std::vector<std::pair<uint64_t, uint64_t>>{{2, 4}, {2, 4}}));
}

struct ReplicationCase {
  std::string what;
  ShardHealthMap health;
  std::vector<C> chunks;
  uint32_t replication;
  std::vector<ShardInfo> candidates;
  std::vector<std::pair<uint64_t, uint64_t>> after;
  uint32_t promoted, moved_backups, temporary, new_backups;
};

TEST(PlanReplicationTest, Table) {
  const std::vector<ReplicationCase> cases = {
      {"nothing to do", {{1, H::kUp}, {2, H::kUp}}, {{1, 2, true}, {2, 0, false}}, 0,
       Room({1, 2}, 100), {{1, 2}, {2, 0}}, 0, 0, 0, 0},
      {"draining primary without backup: a temporary one", {{1, H::kDraining}, {2, H::kUp}},
       {{1, 0, false}}, 0, Room({2}, 100), {{1, 2}}, 0, 0, 1, 0},
      {"draining primary, no room for a temporary backup: wait", {{1, H::kDraining}, {2, H::kUp}},
       {{1, 0, false}}, 0, Room({2}, 5), {{1, 0}}, 0, 0, 0, 0},
      {"draining primary, backup not in sync yet: wait", {{1, H::kDraining}, {2, H::kUp}},
       {{1, 2, false}}, 0, Room({2}, 100), {{1, 2}}, 0, 0, 0, 0},
      {"draining primary, backup in sync, replication 0: promoted alone",
       {{1, H::kDraining}, {2, H::kUp}}, {{1, 2, true}}, 0, Room({2}, 100), {{2, 0}}, 1, 0, 0, 0},
      {"draining primary, backup in sync, replication 1: promoted with a new backup",
       {{1, H::kDraining}, {2, H::kUp}, {3, H::kUp}}, {{1, 2, true}}, 1, Room({2, 3}, 100),
       {{2, 3}}, 1, 0, 0, 1},
      {"draining backup, replication 0: dropped", {{1, H::kUp}, {2, H::kDraining}},
       {{1, 2, true}}, 0, Room({1}, 100), {{1, 0}}, 0, 1, 0, 0},
      {"draining backup, replication 1: moved", {{1, H::kUp}, {2, H::kDraining}, {3, H::kUp}},
       {{1, 2, true}}, 1, Room({1, 3}, 100), {{1, 3}}, 0, 1, 0, 0},
      {"both draining, no room: kept", {{1, H::kDraining}, {2, H::kDraining}, {3, H::kUp}},
       {{1, 2, true}}, 0, Room({3}, 5), {{1, 2}}, 0, 0, 0, 0},
      {"both draining: the backup moves first", {{1, H::kDraining}, {2, H::kDraining}, {3, H::kUp}},
       {{1, 2, true}}, 0, Room({3}, 100), {{1, 3}}, 0, 1, 0, 0},
      {"replication 1, a chunk without backup gets one", {{1, H::kUp}, {2, H::kUp}},
       {{1, 0, false}}, 1, Room({1, 2}, 100), {{1, 2}}, 0, 0, 0, 1},
      {"replication 1, no room for the missing backup", {{1, H::kUp}, {2, H::kUp}},
       {{1, 0, false}}, 1, Room({1, 2}, 5), {{1, 0}}, 0, 0, 0, 0},
  };
  for (const ReplicationCase& c : cases) {
    SCOPED_TRACE(c.what);
    const JobLayout job = Layout(c.chunks, c.replication);
    std::vector<ShardInfo> candidates = c.candidates;
    const ReplicationPlan plan = PlanReplication(job, c.health, candidates);
    EXPECT_EQ(Copies(plan.after), c.after);
    EXPECT_EQ(plan.promoted, c.promoted);
    EXPECT_EQ(plan.moved_backups, c.moved_backups);
    EXPECT_EQ(plan.temporary, c.temporary);
    EXPECT_EQ(plan.new_backups, c.new_backups);
    EXPECT_EQ(plan.changed(), c.after != Copies(job));
  }
}

TEST(CheckDrainFitsTest, EachChunkNeedsRoomExceptAPromotableReplicationZeroPrimary) {
  const ShardHealthMap health = {{1, H::kUp}, {2, H::kUp}, {3, H::kUp}};
  // Shard 1 holds: a primary with an UP backup (replication 0: promoted as
  // it is), a primary without backup, and a backup.
  const JobLayout a = Layout({{1, 2, true}, {1, 0, false}}, 0);
  const JobLayout b = Layout({{3, 1, true}}, 1);
  const std::vector<DrainJob> jobs = {{"a", &a}, {"b", &b}};
  // 20 bytes must move (the chunk without backup, and b's backup, which may
  // not land on shard 3, its primary).
  EXPECT_TRUE(CheckDrainFits(1, 3, jobs, health, Room({2, 3}, 20)).ok());
  const absl::Status s = CheckDrainFits(1, 3, jobs, health, {{2, true, 10, 0}, {3, true, 100, 0}});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("cannot drain shard 1: its 3 chunks"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("chunk (tensor 0, chunk 0) of job \"b\" (10 bytes)"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("other than shard 3, which holds its other copy"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("after 10 bytes of its other chunks"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("110 bytes free over 2 live shards"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("largest free 100 bytes"));
  // A replication-1 primary needs a new copy even with an UP backup.
  const JobLayout c = Layout({{1, 2, true}}, 1);
  const std::vector<DrainJob> rep1 = {{"c", &c}};
  EXPECT_FALSE(CheckDrainFits(1, 1, rep1, health, Room({2}, 100)).ok());
  EXPECT_TRUE(CheckDrainFits(1, 1, rep1, health, Room({2, 3}, 100)).ok());
}

}  // namespace
}  // namespace optimus
