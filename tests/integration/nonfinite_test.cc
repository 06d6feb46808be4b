// A worker that pushes an inf or NaN never makes a shard publish one: the
// step is skipped by every chunk of the job (masters, moments, step counts
// untouched; the version still advances), every rank is told found_inf,
// training goes on, and the backup of a replicated job skipped the same
// step (after a failover the promoted backup serves the same values).
// Real coordinator, shards and clients over loopback and UCX.
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

#include "client/client.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace {

using client::Client;
using harness::Cluster;
using harness::TransportKind;

constexpr absl::Duration kWait = absl::Seconds(30);
constexpr uint32_t kWorkers = 2;

class NonFiniteTest : public ::testing::TestWithParam<TransportKind> {
 protected:
  void SetUp() override {
    harness::ClusterOptions o;
    o.transport = GetParam();
    o.num_shards = 2;
    o.num_workers = kWorkers;
    o.wait = kWait;
    auto c = Cluster::Start(o);
    ASSERT_TRUE(c.ok()) << c.status();
    cluster_ = *std::move(c);
  }

  // Every rank runs steps first..last: pull, the harness gradient (fp32
  // jobs here), poisoned where `poison` says (step, rank, tensor), push.
  // Returns each rank's reports, in step order.
  struct Poison {
    uint64_t step;
    uint32_t rank;
    uint32_t tensor;
    float value;
  };
  std::vector<std::vector<client::StepReport>> Run(uint64_t first, uint64_t last,
                                                    const std::vector<Poison>& poison,
                                                    absl::Status* status) {
    std::vector<std::vector<client::StepReport>> reports(kWorkers);
    std::vector<absl::Status> st(kWorkers);
    std::vector<std::thread> th;
    for (uint32_t r = 0; r < kWorkers; ++r) {
      th.emplace_back([&, r] {
        Client* w = cluster_->worker(r);
        const size_t nt = w->tensors().size();
        std::vector<std::vector<uint8_t>> push(nt);
        for (uint64_t s = first; s <= last; ++s) {
          std::vector<client::Ticket> tickets;
          for (uint32_t t = 0; t < nt; ++t) {
            auto p = cluster_->PullFp32(t, s, r);
            if (!p.ok()) {
              st[r] = p.status();
              return;
            }
            push[t] = cluster_->GradientBytes(r, t, *p, s);
            for (const Poison& x : poison) {
              if (x.step == s && x.rank == r && x.tensor == t) {
                std::memcpy(push[t].data() + 4 * (push[t].size() / 8), &x.value, 4);
              }
            }
            auto tk = w->Push(t, s, push[t].data(), p->size());
            if (!tk.ok()) {
              st[r] = tk.status();
              return;
            }
            tickets.push_back(*tk);
          }
          for (client::Ticket tk : tickets) {
            if (absl::Status ws = w->Wait(tk, kWait); !ws.ok()) {
              st[r] = ws;
              return;
            }
          }
          auto rep = w->StepResult(s, kWait);
          if (!rep.ok()) {
            st[r] = rep.status();
            return;
          }
          reports[r].push_back(*rep);
        }
      });
    }
    for (std::thread& t : th) t.join();
    *status = absl::OkStatus();
    for (const absl::Status& s : st) {
      if (!s.ok()) *status = s;
    }
    return reports;
  }

  static bool AllFinite(const std::vector<float>& v) {
    for (float x : v) {
      if (!std::isfinite(x)) return false;
    }
    return true;
  }

  std::unique_ptr<Cluster> cluster_;
};

TEST_P(NonFiniteTest, InfAndNaNStepsAreSkippedEverywhereAndReported) {
  client::JobDef def = harness::SmallJob("nonfinite", kWorkers);
  def.grad_dtype = DType::kFp32;
  def.replication = 1;  // The backup must skip the same steps.
  def.max_grad_norm = 1.0f;
  ASSERT_OK(cluster_->CreateJob(def));
  // Step 3: rank 1 pushes a NaN into "weight"; step 5: rank 0 an inf into
  // "bias". Everything else is finite.
  absl::Status s;
  auto reports = Run(1, 6,
                     {{3, 1, 0, std::nanf("")},
                      {5, 0, 1, std::numeric_limits<float>::infinity()}},
                     &s);
  ASSERT_OK(s);
  for (uint32_t r = 0; r < kWorkers; ++r) {
    ASSERT_EQ(reports[r].size(), 6u);
    for (uint64_t step = 1; step <= 6; ++step) {
      const client::StepReport& rep = reports[r][step - 1];
      const bool bad = step == 3 || step == 5;
      EXPECT_EQ(rep.found_inf, bad) << "rank " << r << " step " << step;
      EXPECT_EQ(rep.skipped, bad) << "rank " << r << " step " << step;
      EXPECT_EQ(std::isfinite(rep.grad_norm), !bad) << "rank " << r << " step " << step;
    }
  }
  // No version holds a non-finite value, and the step after the skipped
  // ones trained (SkippedStepPublishesTheSameValuesAsTheStepBefore checks
  // that a skipped step changes nothing).
  for (uint32_t t = 0; t < def.tensors.size(); ++t) {
    std::vector<std::vector<float>> v(8);
    for (uint64_t version = 6; version <= 7; ++version) {
      ASSERT_OK_AND_ASSIGN(v[version], cluster_->PullFp32(t, version));
      EXPECT_TRUE(AllFinite(v[version])) << "tensor " << t << " version " << version;
    }
    EXPECT_NE(v[7], v[6]) << "step 6 changed nothing";
  }
  ASSERT_OK_AND_ASSIGN(std::vector<float> before, cluster_->PullFp32(0, 7));
  // The backup skipped the same steps: after its primary dies, it serves
  // exactly what the primary published.
  ASSERT_OK(cluster_->KillShard(0));
  ASSERT_OK_AND_ASSIGN(std::vector<float> after, cluster_->PullFp32(0, 7));
  EXPECT_EQ(after, before);
  EXPECT_TRUE(AllFinite(after));
}

TEST_P(NonFiniteTest, SkippedStepPublishesTheSameValuesAsTheStepBefore) {
  client::JobDef def = harness::SmallJob("skip-same", kWorkers);
  def.grad_dtype = DType::kFp32;
  ASSERT_OK(cluster_->CreateJob(def));
  absl::Status s;
  Run(1, 2, {}, &s);
  ASSERT_OK(s);
  std::vector<std::vector<float>> v3;
  for (uint32_t t = 0; t < def.tensors.size(); ++t) {
    ASSERT_OK_AND_ASSIGN(std::vector<float> p, cluster_->PullFp32(t, 3));
    v3.push_back(p);
  }
  Run(3, 3, {{3, 0, 1, -std::numeric_limits<float>::infinity()}}, &s);
  ASSERT_OK(s);
  for (uint32_t t = 0; t < def.tensors.size(); ++t) {
    ASSERT_OK_AND_ASSIGN(std::vector<float> v4, cluster_->PullFp32(t, 4));
    EXPECT_EQ(v4, v3[t]) << "tensor " << t;
  }
}

// The opt-out does what it says: with keep_nonfinite the NaN is applied
// (so the skip above is the shards' doing, not an accident of the data).
TEST_P(NonFiniteTest, KeepNonFiniteAppliesThem) {
  client::JobDef def = harness::SmallJob("keep", kWorkers);
  def.grad_dtype = DType::kFp32;
  def.skip_nonfinite = false;
  def.max_grad_norm = 0.0f;
  ASSERT_OK(cluster_->CreateJob(def));
  std::vector<absl::Status> st(kWorkers);
  // No round: push and pull without StepResult.
  std::vector<std::thread> th;
  for (uint32_t r = 0; r < kWorkers; ++r) {
    th.emplace_back([&, r] {
      Client* w = cluster_->worker(r);
      auto p = cluster_->PullFp32(0, 1, r);
      if (!p.ok()) {
        st[r] = p.status();
        return;
      }
      std::vector<uint8_t> g = cluster_->GradientBytes(r, 0, *p, 1);
      if (r == 1) {
        const float nan = std::nanf("");
        std::memcpy(g.data(), &nan, 4);
      }
      auto tk = w->Push(0, 1, g.data(), p->size());
      if (!tk.ok()) {
        st[r] = tk.status();
        return;
      }
      st[r] = w->Wait(*tk, kWait);
      if (!st[r].ok()) return;
      auto pb = cluster_->PullFp32(1, 1, r);
      if (!pb.ok()) {
        st[r] = pb.status();
        return;
      }
      std::vector<uint8_t> gb = cluster_->GradientBytes(r, 1, *pb, 1);
      auto tb = w->Push(1, 1, gb.data(), pb->size());
      st[r] = tb.ok() ? w->Wait(*tb, kWait) : tb.status();
    });
  }
  for (std::thread& t : th) t.join();
  for (const absl::Status& s : st) ASSERT_OK(s);
  ASSERT_OK_AND_ASSIGN(std::vector<float> v2, cluster_->PullFp32(0, 2));
  EXPECT_FALSE(std::isfinite(v2[0]));
  EXPECT_EQ(cluster_->worker(0)->StepResult(1, kWait).status().code(),
            absl::StatusCode::kFailedPrecondition);
}

INSTANTIATE_TEST_SUITE_P(Transports, NonFiniteTest,
                         ::testing::Values(TransportKind::kLoopback, TransportKind::kUcx),
                         [](const ::testing::TestParamInfo<TransportKind>& i) {
                           return harness::TransportName(i.param);
                         });

}  // namespace
}  // namespace optimus
