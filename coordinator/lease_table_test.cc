// The lease table on its own, with explicit times: renewal, the expiry
// sweep, handing DOWN shards to the tables once, identities, and the last
// reply a heartbeat gets while the tables are busy.
#include "coordinator/lease_table.h"

#include <vector>

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace optimus {
namespace {

constexpr absl::Duration kLease = absl::Seconds(2);

TEST(LeaseTableTest, LeasesExpireInOneSweepAndAreHandedToTheTablesOnce) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  LeaseTable t(kLease);
  t.AddLive(1, t0, "node1", "");
  t.AddLive(2, t0, "node2", "");
  t.AddLive(3, t0, "node3", "");
  EXPECT_EQ(t.Renew(2, t0 + kLease), LeaseTable::Renewal::kRenewed);
  EXPECT_EQ(t.SweepExpired(t0 + kLease), 0);  // Exactly the lease: still alive.
  EXPECT_TRUE(t.TakeDown().empty());
  EXPECT_EQ(t.SweepExpired(t0 + kLease + absl::Milliseconds(1)), 2);
  EXPECT_TRUE(t.IsDown(1));
  EXPECT_FALSE(t.IsDown(2));
  EXPECT_EQ(t.TakeDown(), (std::vector<uint64_t>{1, 3}));
  EXPECT_TRUE(t.TakeDown().empty());  // Once.
  // A DOWN shard is not renewed: it must register again.
  EXPECT_EQ(t.Renew(1, t0 + 2 * kLease), LeaseTable::Renewal::kDown);
  EXPECT_EQ(t.Renew(9, t0 + 2 * kLease), LeaseTable::Renewal::kUnknown);
  EXPECT_EQ(t.SweepExpired(t0 + 2 * kLease), 0);  // Nothing new.
  EXPECT_EQ(t.LastRenewal(2), t0 + kLease);
  EXPECT_FALSE(t.LastRenewal(9).has_value());
  // A shard forgotten before the tables took it is not handed over.
  t.AddLive(4, t0, "node4", "");
  EXPECT_EQ(t.SweepExpired(t0 + 3 * kLease), 2);  // 2 and 4.
  t.Remove(4);
  EXPECT_EQ(t.TakeDown(), (std::vector<uint64_t>{2}));
  EXPECT_EQ(t.Renew(4, t0 + 3 * kLease), LeaseTable::Renewal::kUnknown);
}

TEST(LeaseTableTest, RecoveredShardsKeepTheirStateAndIdentity) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  LeaseTable t(kLease);
  // Recovery gives a live shard a lease from later than now.
  t.AddLive(1, t0 + kLease, "node1", "shard:a");
  t.AddDown(2, t0, "node2", "shard:b");
  EXPECT_EQ(t.SweepExpired(t0 + 2 * kLease), 0);
  EXPECT_TRUE(t.TakeDown().empty());  // The tables know 2 is DOWN already.
  EXPECT_EQ(t.Renew(2, t0), LeaseTable::Renewal::kDown);
  EXPECT_TRUE(t.IdentityMatches(1, "shard:a"));
  EXPECT_FALSE(t.IdentityMatches(1, "shard:b"));
  EXPECT_TRUE(t.IdentityMatches(2, "shard:b"));
  EXPECT_TRUE(t.IdentityMatches(7, "anyone"));  // Unknown: told to register.
}

TEST(LeaseTableTest, TheLastReplyKeepsAssignmentsAndOrdersButNotReleasedJobs) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  LeaseTable t(kLease);
  t.AddLive(1, t0, "node1", "");
  EXPECT_TRUE(t.LastReply(1).known());  // Before any full reply.
  EXPECT_EQ(t.LastReply(1).assignments_size(), 0);
  v1::HeartbeatResponse full;
  full.set_known(true);
  v1::Assignment* a = full.add_assignments();
  a->set_job_id(5);
  a->set_map_epoch(3);
  full.add_checkpoints()->set_job_id(5);
  full.add_released_jobs(4);
  t.SetLastReply(1, full);
  const v1::HeartbeatResponse kept = t.LastReply(1);
  EXPECT_TRUE(kept.known());
  ASSERT_EQ(kept.assignments_size(), 1);
  EXPECT_EQ(kept.assignments(0).map_epoch(), 3u);
  EXPECT_EQ(kept.checkpoints_size(), 1);
  EXPECT_EQ(kept.released_jobs_size(), 0);  // Told once, by a full reply.
  EXPECT_FALSE(t.LastReply(2).known());
  ASSERT_EQ(t.SweepExpired(t0 + 2 * kLease), 1);
  EXPECT_FALSE(t.LastReply(1).known());
}

}  // namespace
}  // namespace optimus
