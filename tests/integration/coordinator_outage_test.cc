// A coordinator outage does not touch training: workers and shards go on
// over the data plane, every shard stays live (its /healthz answers from its
// own state) while it is not ready (/readyz: no answered heartbeat within
// the lease), and when a coordinator comes back on the same address over
// the same state folder the job is READY again and its parameters are those
// of a run that never lost its coordinator.
#include <string>

#include "absl/strings/str_cat.h"
#include "common/http_server.h"
#include "gtest/gtest.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace harness {
namespace {

bool Live(int port) { return HttpGet(port, "/healthz").ok(); }
bool Ready(int port) { return HttpGet(port, "/readyz").ok(); }

TEST(CoordinatorOutageTest, TrainingAndShardsOutliveTheCoordinator) {
  ClusterOptions o;
  o.num_shards = 2;
  o.num_workers = 2;
  o.serve_metrics = true;
  ASSERT_OK_AND_ASSIGN(o.state_dir, NewTempDir("coord-state"));
  ASSERT_OK_AND_ASSIGN(auto c, Cluster::Start(o));
  const client::JobDef def = SmallJob("outage", 2);
  ASSERT_OK(c->CreateJob(def));
  ASSERT_OK(c->Train(1, 3));
  for (size_t i = 0; i < c->num_shards(); ++i) {
    const int port = c->shard(i)->metrics_port();
    ASSERT_OK(c->WaitUntil("shard ready", [&] { return Ready(port); }));
  }

  ASSERT_OK(c->StopCoordinator());
  // Training goes on without it.
  ASSERT_OK(c->Train(4, 8));
  // Each shard stops being ready once its lease has run out, and stays live.
  for (size_t i = 0; i < c->num_shards(); ++i) {
    const int port = c->shard(i)->metrics_port();
    bool live_throughout = true;
    ASSERT_OK(c->WaitUntil(absl::StrCat("shard ", i, " not ready"), [&] {
      live_throughout = live_throughout && Live(port);
      return !Ready(port);
    }));
    EXPECT_TRUE(live_throughout);
  }
  // Three more leases without a coordinator: still live, still training.
  absl::SleepFor(3 * o.lease);
  for (size_t i = 0; i < c->num_shards(); ++i) {
    EXPECT_TRUE(Live(c->shard(i)->metrics_port())) << "shard " << i;
  }
  ASSERT_OK(c->Train(9, 10));

  ASSERT_OK(c->RestartCoordinator());
  for (size_t i = 0; i < c->num_shards(); ++i) {
    const int port = c->shard(i)->metrics_port();
    ASSERT_OK(c->WaitUntil(absl::StrCat("shard ", i, " ready again"), [&] { return Ready(port); }));
  }
  ASSERT_OK(c->WaitStatus("job READY after the outage", [](const v1::StatusResponse& st) {
    return st.jobs_size() == 1 && st.jobs(0).state() == v1::JOB_STATE_READY;
  }));
  ASSERT_OK(c->Train(11, 12));
  for (uint32_t t = 0; t < def.tensors.size(); ++t) {
    ASSERT_OK_AND_ASSIGN(const std::vector<float> got, c->PullFp32(t, 13));
    ASSERT_OK_AND_ASSIGN(const std::vector<float> want, ReferenceParams(def, t, 12));
    EXPECT_EQ(got, want) << "tensor " << t;
  }
}

}  // namespace
}  // namespace harness
}  // namespace optimus
