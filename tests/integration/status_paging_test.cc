// Status that scales (issue 16 item 5), against a real coordinator and real
// shards (tests/harness) and the real optimusctl binary: `shard list
// --state=...` shows exactly the shards in those states, and status comes
// in pages (the Status RPC's page_size / page_token) that put together give
// every shard once and every job once, whatever the page size.
#include <algorithm>
#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/harness/cluster.h"
#include "tests/harness/optimusctl_run.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace {

using harness::CliRun;
using harness::RunOptimusctl;

client::JobDef SmallJob() {
  client::JobDef def;
  def.name = "paged";
  def.world_size = 1;
  def.tensors = {{"weight", {256, 64}}, {"bias", {64}}};
  def.optimizer.kind = client::Optimizer::kAdamW;
  def.optimizer.lr = 1e-2f;
  def.grad_dtype = DType::kBf16;
  def.param_dtype = DType::kBf16;
  def.max_chunk_bytes = 4096;
  return def;
}

// The shard ids and states of a `-o json` document's "shards".
std::vector<std::pair<uint64_t, std::string>> Shards(const std::string& json_out) {
  std::vector<std::pair<uint64_t, std::string>> out;
  const nlohmann::json doc = nlohmann::json::parse(json_out, nullptr, false);
  if (!doc.is_object() || !doc.contains("shards")) return out;
  for (const auto& s : doc["shards"]) {
    out.emplace_back(s["shard_id"].get<uint64_t>(), s["state"].get<std::string>());
  }
  return out;
}

class StatusPagingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    harness::ClusterOptions o;
    o.num_shards = 6;
    o.num_workers = 1;
    ASSERT_OK_AND_ASSIGN(cluster_, harness::Cluster::Start(o));
    ASSERT_OK(cluster_->CreateJob(SmallJob()));
    // One shard draining, two dead: UP, DRAINING and DOWN all present.
    ASSERT_OK(cluster_->DrainShard(5).status());
    ASSERT_OK(cluster_->KillShard(1));
    ASSERT_OK(cluster_->KillShard(3));
    ASSERT_OK(cluster_->WaitStatus("two shards DOWN, one DRAINING",
                                   [](const v1::StatusResponse& st) {
                                     int down = 0, draining = 0;
                                     for (const auto& s : st.shards()) {
                                       down += s.state() == v1::SHARD_STATE_DOWN;
                                       draining += s.state() == v1::SHARD_STATE_DRAINING;
                                     }
                                     return down == 2 && draining == 1;
                                   }));
    ASSERT_OK_AND_ASSIGN(full_, cluster_->Status());
    ASSERT_EQ(full_.shards_size(), 6);
  }

  std::string Flags() const {
    return absl::StrCat("--coordinator=", cluster_->coordinator_address(),
                        " --insecure_plaintext");
  }

  // The ids the full status shows in `states`, in id order.
  std::vector<uint64_t> IdsIn(std::set<v1::ShardState> states) const {
    std::vector<uint64_t> ids;
    for (const auto& s : full_.shards()) {
      if (states.count(s.state()) != 0) ids.push_back(s.shard_id());
    }
    std::sort(ids.begin(), ids.end());
    return ids;
  }

  std::unique_ptr<harness::Cluster> cluster_;
  v1::StatusResponse full_;
};

TEST_F(StatusPagingTest, ShardListFiltersByState) {
  CliRun r = RunOptimusctl(Flags() + " shard list --state=down -o json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::vector<uint64_t> ids;
  for (const auto& [id, state] : Shards(r.out)) {
    EXPECT_EQ(state, "down");
    ids.push_back(id);
  }
  EXPECT_EQ(ids, IdsIn({v1::SHARD_STATE_DOWN}));
  EXPECT_EQ(ids.size(), 2u);

  // Several states, comma-separated or repeated, any case; pages of one.
  for (const std::string& states : {std::string("--state=up,draining"),
                                    std::string("--state UP --state Draining")}) {
    r = RunOptimusctl(absl::StrCat(Flags(), " shard list ", states, " --page_size=1 -o json"));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    ids.clear();
    for (const auto& [id, state] : Shards(r.out)) {
      EXPECT_TRUE(state == "up" || state == "draining") << state;
      ids.push_back(id);
    }
    EXPECT_EQ(ids, IdsIn({v1::SHARD_STATE_UP, v1::SHARD_STATE_DRAINING})) << states;
  }

  // The table shows the same shards.
  r = RunOptimusctl(Flags() + " shard list --state=draining");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("DRAINING"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(" UP "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("DOWN"), std::string::npos) << r.out;
}

TEST_F(StatusPagingTest, ABadStateIsAUsageError) {
  CliRun r = RunOptimusctl(Flags() + " shard list --state=sleeping");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("\"sleeping\" is not a shard state (up, down or draining)"),
            std::string::npos)
      << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
}

TEST_F(StatusPagingTest, StatusInPagesShowsEveryShardAndJobOnce) {
  for (int page_size : {0, 1, 2, 4, 1000}) {
    CliRun r = RunOptimusctl(absl::StrCat(Flags(), " status --page_size=", page_size, " -o json"));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    std::vector<uint64_t> ids;
    for (const auto& [id, state] : Shards(r.out)) ids.push_back(id);
    EXPECT_EQ(ids, IdsIn({v1::SHARD_STATE_UP, v1::SHARD_STATE_DOWN, v1::SHARD_STATE_DRAINING}))
        << "page_size " << page_size;
    const nlohmann::json doc = nlohmann::json::parse(r.out, nullptr, false);
    ASSERT_TRUE(doc.is_object()) << r.out;
    ASSERT_EQ(doc["jobs"].size(), 1u) << "page_size " << page_size;
    EXPECT_EQ(doc["jobs"][0]["name"], "paged");
  }
}

TEST_F(StatusPagingTest, TheRpcPagesByShardIdWithJobsOnTheFirstPage) {
  v1::StatusRequest req;
  req.set_page_size(4);
  std::vector<uint64_t> ids;
  int pages = 0, pages_with_jobs = 0;
  for (;;) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::StatusResponse resp;
    const grpc::Status s = cluster_->stub()->Status(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ++pages;
    pages_with_jobs += resp.jobs_size() > 0;
    EXPECT_LE(resp.shards_size(), 4);
    EXPECT_EQ(resp.matching_shards(), 6u);
    for (const auto& sh : resp.shards()) ids.push_back(sh.shard_id());
    if (resp.next_page_token().empty()) break;
    req.set_page_token(resp.next_page_token());
  }
  EXPECT_EQ(pages, 2);
  EXPECT_EQ(pages_with_jobs, 1);
  EXPECT_EQ(ids, IdsIn({v1::SHARD_STATE_UP, v1::SHARD_STATE_DOWN, v1::SHARD_STATE_DRAINING}));

  // The filter on the server: DOWN ones only, counted.
  v1::StatusRequest down;
  down.add_shard_states(v1::SHARD_STATE_DOWN);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::StatusResponse resp;
    ASSERT_TRUE(cluster_->stub()->Status(&ctx, down, &resp).ok());
    EXPECT_EQ(resp.matching_shards(), 2u);
    ASSERT_EQ(resp.shards_size(), 2);
    for (const auto& sh : resp.shards()) EXPECT_EQ(sh.state(), v1::SHARD_STATE_DOWN);
    EXPECT_TRUE(resp.next_page_token().empty());
  }

  // A token the coordinator did not give is refused, saying so.
  v1::StatusRequest bad;
  bad.set_page_token("page-two");
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::StatusResponse resp;
  const grpc::Status s = cluster_->stub()->Status(&ctx, bad, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("page_token \"page-two\""), std::string::npos)
      << s.error_message();
}

}  // namespace
}  // namespace optimus
