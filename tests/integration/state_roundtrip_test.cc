// A run moves off optimus and back on without restarting its moments: job
// "orig" trains 5 steps (AdamW, two parameter groups), is checkpointed and
// exported in the torch-optim layout (what torch.optim's state_dict looks
// like); a new job "moved" starts from that file through the libtorch
// adapter (ModuleSync::InitFromTorchOptimFile) and trains 3 more steps with
// the same gradients as "orig" does. Both end bit for bit equal: master
// values, moments and the per-tensor step counts (Adam's bias corrections)
// all came across.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "cli/export.h"
#include "client/client.h"
#include "client/torch/module_sync.h"
#include "gtest/gtest.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace {

using harness::Cluster;

constexpr uint32_t kWorkers = 2;
constexpr uint64_t kBefore = 5;  // Steps before the move.
constexpr uint64_t kAfter = 3;

// The module whose parameters are SmallJob's tensors.
struct Small : torch::nn::Module {
  Small() {
    register_parameter("weight", torch::zeros({200, 257}));
    register_parameter("bias", torch::zeros({37}));
  }
};

// Every rank: pull version `version0 + i`, push the harness gradient of
// step `grad_step0 + i` as step `version0 + i`, for i < n, at learning rate
// lr0 * (i + 1) (lr0 0: the job's).
absl::Status TrainShifted(Cluster& c, uint64_t version0, uint64_t grad_step0, uint64_t n,
                          float lr0 = 0.0f) {
  std::vector<absl::Status> st(kWorkers);
  std::vector<std::thread> th;
  for (uint32_t r = 0; r < kWorkers; ++r) {
    th.emplace_back([&, r] {
      client::Client* w = c.worker(r);
      std::vector<std::vector<uint8_t>> push(w->tensors().size());
      for (uint64_t i = 0; i < n; ++i) {
        std::vector<client::Ticket> tickets;
        for (uint32_t t = 0; t < w->tensors().size(); ++t) {
          auto p = c.PullFp32(t, version0 + i, r);
          if (!p.ok()) {
            st[r] = p.status();
            return;
          }
          push[t] = c.GradientBytes(r, t, *p, grad_step0 + i);
          client::PushOptions opts;
          opts.lr = lr0 * static_cast<float>(i + 1);
          auto tk = w->Push(t, version0 + i, push[t].data(), p->size(), opts);
          if (!tk.ok()) {
            st[r] = tk.status();
            return;
          }
          tickets.push_back(*tk);
        }
        for (client::Ticket tk : tickets) {
          if (absl::Status s = w->Wait(tk, absl::Seconds(30)); !s.ok()) {
            st[r] = s;
            return;
          }
        }
      }
    });
  }
  for (std::thread& t : th) t.join();
  for (const absl::Status& s : st) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

TEST(StateRoundTripTest, ExportedStateResumesBitForBit) {
  ASSERT_OK_AND_ASSIGN(std::string dir, harness::NewTempDir("roundtrip"));
  harness::ClusterOptions o;
  o.num_shards = 2;
  o.num_workers = kWorkers;
  o.checkpoint_dir = dir + "/ckpt";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Cluster> cluster, Cluster::Start(o));
  Cluster& c = *cluster;

  client::JobDef def = harness::SmallJob("orig", kWorkers);
  def.grad_dtype = DType::kFp32;
  def.param_dtype = DType::kFp32;
  client::SplitDecayGroups(&def, 0.1f);
  ASSERT_OK(c.CreateJob(def));
  ASSERT_OK(c.Train(1, kBefore));
  ASSERT_OK(c.WaitApplied("orig", kBefore));
  ASSERT_OK_AND_ASSIGN(v1::CheckpointInfo ck, c.CreateCheckpoint("orig"));
  ASSERT_OK_AND_ASSIGN(v1::CheckpointInfo done, c.WaitCheckpoint("orig", ck.checkpoint_id()));
  ASSERT_EQ(done.state(), v1::CHECKPOINT_STATE_COMPLETE) << done.error();
  ASSERT_EQ(done.step(), kBefore + 1);
  const std::string file = dir + "/orig.pt";
  ASSERT_OK(ExportCheckpointToTorch(done.path(), file, ExportFormat::kTorchOptim));
  ASSERT_OK(TrainShifted(c, kBefore + 1, kBefore + 1, kAfter));
  std::vector<std::vector<float>> want;
  for (uint32_t t = 0; t < def.tensors.size(); ++t) {
    ASSERT_OK_AND_ASSIGN(std::vector<float> v, c.PullFp32(t, kBefore + kAfter + 1));
    want.push_back(v);
  }
  ASSERT_OK(c.LeaveJob());

  // The same model as a new job, started from the exported state.
  client::JobDef moved = def;
  moved.name = "moved";
  ASSERT_OK(c.ConnectWorkers());
  ASSERT_OK(c.worker(0)->CreateJob(moved));
  {
    std::vector<absl::Status> joined(kWorkers);
    std::vector<std::thread> th;
    for (uint32_t r = 0; r < kWorkers; ++r) {
      th.emplace_back([&, r] { joined[r] = c.worker(r)->Join("moved", r, kWorkers); });
    }
    for (std::thread& t : th) t.join();
    for (const absl::Status& s : joined) ASSERT_OK(s);
  }
  Small module;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::ModuleSync> sync,
                       client::ModuleSync::Create(c.worker(0), &module));
  ASSERT_OK(sync->InitFromTorchOptimFile(file));
  // Version 1 of "moved" is version kBefore + 1 of "orig".
  ASSERT_OK(TrainShifted(c, 1, kBefore + 1, kAfter));
  for (uint32_t t = 0; t < def.tensors.size(); ++t) {
    ASSERT_OK_AND_ASSIGN(std::vector<float> got, c.PullFp32(t, kAfter + 1));
    EXPECT_EQ(got, want[t]) << "tensor " << t;
  }
  // A file for another optimizer's state is refused, and changes nothing.
  client::JobDef sgd = def;
  sgd.name = "sgd";
  sgd.optimizer.kind = client::Optimizer::kSgd;
  sgd.optimizer.momentum = 0.9f;
  sgd.param_groups.clear();
  for (client::TensorDef& t : sgd.tensors) t.group = 0;
  // ConnectWorkers replaces the clients: the ModuleSync borrowing worker 0
  // goes first (found by UBSan/ASan: its destructor used the freed client).
  sync.reset();
  ASSERT_OK(c.ConnectWorkers());
  ASSERT_OK(c.worker(0)->CreateJob(sgd));
  {
    std::vector<absl::Status> joined(kWorkers);
    std::vector<std::thread> th;
    for (uint32_t r = 0; r < kWorkers; ++r) {
      th.emplace_back([&, r] { joined[r] = c.worker(r)->Join("sgd", r, kWorkers); });
    }
    for (std::thread& t : th) t.join();
    for (const absl::Status& s : joined) ASSERT_OK(s);
  }
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<client::ModuleSync> sgd_sync,
                       client::ModuleSync::Create(c.worker(0), &module));
  EXPECT_FALSE(sgd_sync->InitFromTorchOptimFile(file).ok());
  EXPECT_FALSE(sgd_sync->InitFromTorchOptimFile(dir + "/missing.pt").ok());
}

// The schedule resumes where it was: a checkpoint records the last step's
// learning rate and a restored job hands it to its workers.
TEST(StateRoundTripTest, RestoreHandsTheLastLearningRateToWorkers) {
  ASSERT_OK_AND_ASSIGN(std::string dir, harness::NewTempDir("resume-lr"));
  harness::ClusterOptions o;
  o.num_shards = 2;
  o.num_workers = kWorkers;
  o.checkpoint_dir = dir;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Cluster> cluster, Cluster::Start(o));
  Cluster& c = *cluster;
  client::JobDef def = harness::SmallJob("sched", kWorkers);
  ASSERT_OK(c.CreateJob(def));
  EXPECT_EQ(c.worker(0)->resume_lr(), 0.0f);  // A new job.
  // Steps 1..3 at lr 0.25, 0.5, 0.75.
  ASSERT_OK(TrainShifted(c, 1, 1, 3, 0.25f));
  ASSERT_OK(c.WaitApplied("sched", 3));
  ASSERT_OK_AND_ASSIGN(v1::CheckpointInfo ck, c.CreateCheckpoint("sched"));
  ASSERT_OK_AND_ASSIGN(v1::CheckpointInfo done, c.WaitCheckpoint("sched", ck.checkpoint_id()));
  ASSERT_EQ(done.state(), v1::CHECKPOINT_STATE_COMPLETE) << done.error();
  ASSERT_OK(c.LeaveJob());
  ASSERT_OK(c.RestoreCheckpoint("sched", done.checkpoint_id(), "sched-again").status());
  ASSERT_OK(c.JoinJob("sched-again"));
  for (uint32_t r = 0; r < kWorkers; ++r) {
    EXPECT_EQ(c.worker(r)->resume_step(), 4u);
    EXPECT_EQ(c.worker(r)->resume_lr(), 0.75f);
  }
}

}  // namespace
}  // namespace optimus
