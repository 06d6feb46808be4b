// Runs //bench:control_plane at N=20 for a few seconds (a real
// optimus-coord child, 20 simulated shards) and checks that its JSON line
// says what a healthy small cluster does: every shard registered, none
// wrongly declared DOWN, the job READY, the killed shard DOWN, and figures
// in range. No figure is compared with a speed: the machine may be busy.
#include <string>

#include <gtest/gtest.h>

#include "bench/smoke_test_util.h"
#include "common/json.h"

namespace optimus {
namespace {

std::string RunBench(const std::string& args) {
  return bench::RunBenchCommand(bench::RunfilesRoot() + "/bench/control_plane " + args);
}

TEST(ControlPlaneSmokeTest, TwentyShardsOneLineThatMakesSense) {
  const std::string out = RunBench(
      "--shards=20 --steady_s=2 --jobs=small --ready_timeout_s=120 --channels=4");
  ASSERT_FALSE(out.empty());
  // One line per N.
  ASSERT_EQ(out.find('\n'), out.size() - 1) << out;
  const nlohmann::json line = nlohmann::json::parse(out, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(line.is_object()) << out;
  EXPECT_FALSE(line.contains("error")) << out;
  EXPECT_EQ(line.value("bench", ""), "control_plane");
  EXPECT_EQ(line.value("shards", 0), 20);
  EXPECT_EQ(line.value("lease_ms", 0), 2000);
  // Nobody wrongly DOWN, nobody told to register again.
  ASSERT_TRUE(line.contains("false_down")) << out;
  EXPECT_EQ(line["false_down"].get<int>(), 0) << out;
  EXPECT_EQ(line.value("false_down_steady", -1), 0) << out;
  EXPECT_EQ(line.value("told_to_register", -1), 0) << out;
  // The coordinator served heartbeats, and 20 shards need 30 a second.
  EXPECT_DOUBLE_EQ(line.value("heartbeats_per_s_needed", 0.0), 30.0);
  EXPECT_GT(line.value("heartbeats_per_s_served", 0.0), 0.0) << out;
  EXPECT_GT(line.value("heartbeat_p50_ms", 0.0), 0.0) << out;
  EXPECT_GE(line.value("heartbeat_p99_ms", 0.0), line.value("heartbeat_p50_ms", 0.0)) << out;
  // The job: created, READY, its map fetched by the shards holding it.
  ASSERT_TRUE(line.contains("jobs") && line["jobs"].size() == 1) << out;
  const nlohmann::json& job = line["jobs"][0];
  EXPECT_EQ(job.value("state", ""), "JOB_STATE_READY") << out;
  EXPECT_GT(job.value("params", uint64_t{0}), uint64_t{8'000'000'000}) << out;
  EXPECT_LT(job.value("params", uint64_t{0}), uint64_t{9'500'000'000}) << out;
  EXPECT_GT(job.value("chunks", 0), 0) << out;
  EXPECT_GE(job.value("ready_s", 0.0), job.value("create_s", -1.0)) << out;
  EXPECT_GE(line.value("map_fetches", 0), 20) << out;
  // Each shard fetched its own part of the map, and nothing of others'
  // (READY above says the parts held every chunk the job placed).
  EXPECT_TRUE(line.value("per_shard_maps", false)) << out;
  EXPECT_EQ(line.value("map_fetch_foreign_chunks", -1), 0) << out;
  EXPECT_GT(line.value("map_fetch_kb_mean", 0.0), 0.0) << out;
  // 1% of 20 rounds up to one shard, marked DOWN.
  EXPECT_EQ(line.value("killed", 0), 1) << out;
  EXPECT_EQ(line.value("killed_already_down", -1), 0) << out;
  EXPECT_TRUE(line.contains("killed_down_s")) << out;
  // The status call and the coordinator's process figures.
  EXPECT_GT(line.value("status_bytes", 0), 0) << out;
  EXPECT_GT(line.value("coord_threads", 0), 0) << out;
  EXPECT_GT(line.value("coord_rss_mb", 0.0), 0.0) << out;
  EXPECT_GT(line.value("coord_peak_threads", 0), 0) << out;
}

TEST(ControlPlaneSmokeTest, BadFlagIsAClearError) {
  int status = 0;
  const std::string out = bench::CommandOutput(
      bench::RunfilesRoot() + "/bench/control_plane --shards=20,x 2>&1", &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(out.find("--shards: \"x\""), std::string::npos) << out;
}

}  // namespace
}  // namespace optimus
