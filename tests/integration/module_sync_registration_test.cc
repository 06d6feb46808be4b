// ModuleSync registers its staging buffers once, at Create: every step's
// pushes and pulls then use those two registrations and nothing else is
// registered, however many steps run; destroying it forgets them (issue 12).
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "client/client.h"
#include "client/torch/module_sync.h"
#include "common/huge_pages.h"
#include "gtest/gtest.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"
#include "tests/integration/client_test_workers.h"

namespace optimus {
namespace {

using testing_workers::CountingWorker;
using testing_workers::TransportLog;

struct Mlp : torch::nn::Module {
  Mlp() {
    fc1 = register_module("fc1", torch::nn::Linear(64, 256));
    fc2 = register_module("fc2", torch::nn::Linear(256, 64));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

absl::StatusOr<std::unique_ptr<harness::Cluster>> StartCluster() {
  harness::ClusterOptions co;
  co.transport = harness::TransportKind::kLoopback;
  co.num_shards = 2;
  co.num_workers = 1;
  return harness::Cluster::Start(co);
}

// A client whose transport records what it registers.
absl::StatusOr<std::unique_ptr<client::Client>> ConnectCounting(
    const harness::Cluster& cluster, std::shared_ptr<TransportLog> log) {
  client::ClientOptions o;
  o.coordinator_address = cluster.coordinator_address();
  o.transport = cluster.TransportOptions("module");
  o.make_worker = [log](const transport::WorkerOptions& w)
      -> absl::StatusOr<std::unique_ptr<transport::Worker>> {
    auto inner = transport::Worker::Create(w);
    if (!inner.ok()) return inner.status();
    return std::unique_ptr<transport::Worker>(new CountingWorker(std::move(*inner), log));
  };
  return client::Client::Connect(o);
}

TEST(ModuleSyncRegistrationTest, StagingBuffersAreRegisteredOnceAtCreate) {
  ASSERT_OK_AND_ASSIGN(auto cluster, StartCluster());
  auto log = std::make_shared<TransportLog>();
  ASSERT_OK_AND_ASSIGN(auto c, ConnectCounting(*cluster, log));
  // The client's own: the two buffers small requests are batched in (Cork).
  ASSERT_EQ(log->registrations().size(), 2u);
  torch::manual_seed(1);
  Mlp model;
  client::JobDef def;
  def.name = "mlp";
  def.world_size = 1;
  def.tensors = client::TensorDefsFromModule(model);
  def.optimizer.lr = 1e-2f;
  def.chunk_payload_bytes = 8 * 1024;  // Several chunks per weight.
  ASSERT_OK(c->CreateJob(def));
  ASSERT_OK(c->Join("mlp", 0, 1));
  ASSERT_OK_AND_ASSIGN(auto sync, client::ModuleSync::Create(c.get(), &model));
  // Two registrations, one arena per dtype, covering every parameter (after
  // the batch buffer's).
  auto regs = log->registrations();
  ASSERT_EQ(regs.size(), 4u);
  regs.erase(regs.begin(), regs.begin() + 2);
  size_t elems = 0;
  for (const auto& p : model.parameters()) elems += static_cast<size_t>(p.numel());
  for (const auto& r : regs) EXPECT_GE(r.second, elems * 2);  // bf16.
  ASSERT_OK(sync->InitFromModule());
  log->Clear();

  constexpr int kSteps = 10;
  torch::Tensor x = torch::randn({32, 64});
  torch::Tensor y = torch::randn({32, 64});
  for (int step = 1; step <= kSteps; ++step) {
    ASSERT_OK(sync->PullParams(step, absl::Seconds(30)));
    model.zero_grad();
    torch::mse_loss(model.forward(x), y).backward();
    ASSERT_OK(sync->PushGrads(step, absl::Seconds(30)));
    // Nothing is registered per step: the steps may add batch buffers only
    // while more batches are in flight at once than the two made at Connect
    // (each PullParams and PushGrads sends one per shard, and a buffer comes
    // back when its send completes, which may be after the replies), and
    // the client keeps four. Registering per step would pass this bound by
    // the second step.
    ASSERT_LE(log->registrations().size(), 2u + 4u) << "after step " << step;
  }
  // Every payload went from or into an arena (or, batched, from a batch
  // buffer), with its registration.
  const auto sends = log->sends();
  const auto receives = log->receives();
  EXPECT_GE(sends.size(), static_cast<size_t>(kSteps));
  EXPECT_GE(receives.size(), static_cast<size_t>(kSteps) * model.parameters().size());
  for (const auto* transfers : {&sends, &receives}) {
    for (const auto& t : *transfers) {
      ASSERT_NE(t.region_begin, 0u);
      EXPECT_GE(t.begin, t.region_begin);
      EXPECT_LE(t.begin + t.bytes, t.region_begin + t.region_bytes);
    }
  }
  size_t registered = 0;
  for (const auto& r : log->registrations()) registered += r.second;
  EXPECT_EQ(c->registration_stats().pinned_bytes, registered);
  sync.reset();
  // The arenas are forgotten; the client keeps its batch buffers.
  EXPECT_EQ(c->registration_stats().pinned_bytes, registered - regs[0].second - regs[1].second);
}

// The arenas start on a 2 MiB boundary and, from 2 MiB on, are advised for
// transparent huge pages: over 4 KiB pages every shared-memory transfer
// walks and pins each page (docs/benchmarks.md, "Huge pages"). Training
// through them still matches local AdamW.
TEST(ModuleSyncRegistrationTest, LargeArenasAreHugePageEligible) {
  const std::string mode = TransparentHugePageMode();
  if (mode != "madvise" && mode != "always") {
    GTEST_SKIP() << "transparent huge pages are '" << mode << "' here";
  }
  ASSERT_OK_AND_ASSIGN(auto cluster, StartCluster());
  auto log = std::make_shared<TransportLog>();
  ASSERT_OK_AND_ASSIGN(auto c, ConnectCounting(*cluster, log));
  torch::manual_seed(2);
  torch::nn::Linear layer(1024, 1536);  // 1.57 M parameters: 3 MiB of bf16.
  client::JobDef def;
  def.name = "wide";
  def.world_size = 1;
  def.tensors = client::TensorDefsFromModule(*layer);
  def.optimizer.lr = 1e-2f;
  ASSERT_OK(c->CreateJob(def));
  ASSERT_OK(c->Join("wide", 0, 1));
  const size_t before = log->registrations().size();
  ASSERT_OK_AND_ASSIGN(auto sync, client::ModuleSync::Create(c.get(), layer.get()));
  auto regs = log->registrations();
  ASSERT_EQ(regs.size(), before + 2);
  for (size_t i = before; i < regs.size(); ++i) {
    EXPECT_GE(regs[i].second, size_t{3} << 20);
    EXPECT_EQ(regs[i].first % kHugePageBytes, 0u);
    EXPECT_TRUE(HugePageEligible(reinterpret_cast<const void*>(regs[i].first)));
  }
  // One step through the arenas: the weights move as local AdamW moves them.
  torch::Tensor w0 = layer->weight.detach().clone();
  ASSERT_OK(sync->InitFromModule());
  ASSERT_OK(sync->PullParams(1, absl::Seconds(30)));
  layer->zero_grad();
  torch::Tensor x = torch::randn({8, 1024});
  layer->forward(x).pow(2).mean().backward();
  torch::Tensor g = layer->weight.grad().detach().clone();
  ASSERT_OK(sync->PushGrads(1, absl::Seconds(30)));
  ASSERT_OK(sync->PullParams(2, absl::Seconds(30)));
  torch::Tensor local = w0.clone().set_requires_grad(true);
  torch::optim::AdamW adamw({local}, torch::optim::AdamWOptions(1e-2).weight_decay(0));
  local.mutable_grad() = g;
  adamw.step();
  // Published in bf16: equal to local AdamW within bf16's rounding.
  EXPECT_LT((layer->weight.detach() - local.detach()).abs().max().item<float>(), 5e-4f);
  EXPECT_GT((layer->weight.detach() - w0).abs().max().item<float>(), 5e-3f);  // It moved.
}

}  // namespace
}  // namespace optimus
