// The shard registry on its own, with explicit times: ids, reports,
// marking shards DOWN and its shard-down listener, forgetting DOWN shards.
// (Leases and their expiry: lease_table_test.cc.)
#include "coordinator/shard_registry.h"

#include <vector>

#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace optimus {
namespace {

using ::testing::HasSubstr;

constexpr absl::Duration kLease = absl::Seconds(2);

v1::ShardCapabilities Caps() {
  v1::ShardCapabilities c;
  c.set_kind(v1::SHARD_KIND_DPU);
  c.set_memory_limit_bytes(1 << 20);
  c.set_data_address("ucx");
  return c;
}

TEST(ShardRegistryTest, MarkDownTellsTheListenerOnceAboutTheShardsItMarked) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  ShardRegistry r;
  std::vector<std::vector<uint64_t>> told;
  r.AddShardDownListener([&](const std::vector<uint64_t>& ids) { told.push_back(ids); });
  EXPECT_EQ(r.Register(Caps()).id, 1u);
  EXPECT_EQ(r.Register(Caps()).id, 2u);
  EXPECT_EQ(r.Register(Caps()).id, 3u);
  ASSERT_NE(r.Report(2, 5, 1), nullptr);
  // 9 is unknown: left out.
  EXPECT_EQ(r.MarkDown({1, 3, 9}, t0), 2);
  ASSERT_EQ(told.size(), 1u);
  EXPECT_EQ(told[0], (std::vector<uint64_t>{1, 3}));
  EXPECT_EQ(r.Find(1)->state, v1::SHARD_STATE_DOWN);
  EXPECT_EQ(r.Find(1)->down_since, t0);
  EXPECT_EQ(r.Find(2)->state, v1::SHARD_STATE_UP);
  EXPECT_EQ(r.Find(2)->memory_used_bytes, 5u);
  // A DOWN shard's report is not taken: it must register again.
  EXPECT_EQ(r.Report(1, 0, 0), nullptr);
  EXPECT_EQ(r.MarkDown({1, 3}, t0 + kLease), 0);  // Nothing new: no call.
  EXPECT_EQ(told.size(), 1u);
  EXPECT_EQ(r.Health().at(1), ShardHealth::kDown);
  EXPECT_EQ(r.Health().at(2), ShardHealth::kUp);
}

TEST(ShardRegistryTest, OnlyDownShardsAreForgottenAtOnceOrAfterTheGrace) {
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  ShardRegistry r;
  r.Register(Caps());
  r.Register(Caps());
  r.Register(Caps());
  r.Find(3)->state = v1::SHARD_STATE_DRAINING;
  EXPECT_EQ(r.Forget(9).status().code(), absl::StatusCode::kNotFound);
  auto up = r.Forget(1);
  EXPECT_EQ(up.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(up.status().message()), HasSubstr("shard 1 is UP"));
  EXPECT_EQ(r.Forget(3).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r.size(), 3u);

  const absl::Time down_at = t0 + kLease + absl::Seconds(1);
  ASSERT_EQ(r.MarkDown({1, 2}, down_at), 2);
  const absl::Duration grace = absl::Minutes(10);
  EXPECT_TRUE(r.ForgetDownLongerThan(grace, down_at + grace).empty());
  std::vector<ShardRecord> gone = r.ForgetDownLongerThan(grace, down_at + grace + absl::Seconds(1));
  ASSERT_EQ(gone.size(), 2u);
  EXPECT_EQ(gone[0].id, 1u);
  EXPECT_EQ(r.size(), 1u);
  // Ids are never reused.
  EXPECT_EQ(r.Register(Caps()).id, 4u);
  // Undoing a registration gives the last id back.
  r.Unregister(4);
  EXPECT_EQ(r.Register(Caps()).id, 4u);
}

}  // namespace
}  // namespace optimus
