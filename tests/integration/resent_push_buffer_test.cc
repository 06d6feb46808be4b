// A push the client sends again after a map change (its chunk moved to
// another shard) does not read the caller's buffer once the caller may
// free it: the pull of the tensor's next version ends that (client.h). The
// sanitizers' CI run caught coordinator_takeover_test's drain re-sending a
// push from a gradient buffer the harness had already replaced
// (heap-use-after-free in the recovery thread).
//
// Real coordinator and shards over the loopback transport (tests/harness).
// Rank 0's data-plane worker is wrapped so that the test decides when the
// re-sent push goes out: it holds the Send (as a slow rendezvous would:
// the payload is read when it goes), lets the pull of the next version
// complete from the chunk's new shard, overwrites the gradient buffer as a
// caller may, and only then lets the re-sent push go, recording the bytes
// it carried.
#include <cstdint>
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "common/dtype.h"
#include "common/wire.h"
#include "gtest/gtest.h"
#include "proto/optimus.pb.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"
#include "tests/integration/client_test_workers.h"
#include "transport/transport.h"

namespace optimus {
namespace {

using harness::Cluster;

constexpr absl::Duration kWait = absl::Seconds(30);

// The first re-sent push sent while armed, held until Release.
class HeldResend {
 public:
  void Arm() {
    absl::MutexLock lock(&mu_);
    armed_ = true;
  }
  // True (and the send is now this object's) for the first re-sent push
  // while armed.
  bool Take(transport::Worker* inner, transport::EndpointRef ep, uint16_t am_id,
            absl::Span<const uint8_t> header, const void* payload, size_t payload_size,
            transport::DoneCallback done) {
    auto h = wire::ParseRequestHeader(header);
    if (!h.ok() || payload_size == 0 || h->op != static_cast<uint16_t>(wire::Op::kPush) ||
        (h->flags & wire::kRequestResend) == 0) {
      return false;
    }
    {
      absl::MutexLock lock(&mu_);
      if (!armed_) return false;
      armed_ = false;
      inner_ = inner;
      ep_ = ep;
      am_id_ = am_id;
      header_.assign(header.begin(), header.end());
      payload_ = payload;
      payload_size_ = payload_size;
      done_ = std::move(done);
    }
    taken_.Notify();
    return true;
  }
  bool WaitTaken(absl::Duration timeout) { return taken_.WaitForNotificationWithTimeout(timeout); }
  // Sends the held push now; returns the payload bytes it carried.
  std::vector<uint8_t> Release() {
    absl::MutexLock lock(&mu_);
    const auto* p = static_cast<const uint8_t*>(payload_);
    std::vector<uint8_t> sent(p, p + payload_size_);
    inner_->Send(ep_, am_id_, header_, payload_, payload_size_, std::move(done_));
    return sent;
  }

 private:
  absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  transport::Worker* inner_ ABSL_GUARDED_BY(mu_) = nullptr;
  transport::EndpointRef ep_ ABSL_GUARDED_BY(mu_);
  uint16_t am_id_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint8_t> header_ ABSL_GUARDED_BY(mu_);
  const void* payload_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t payload_size_ ABSL_GUARDED_BY(mu_) = 0;
  transport::DoneCallback done_ ABSL_GUARDED_BY(mu_);
  absl::Notification taken_;
};

class ResendHoldingWorker : public testing_workers::ForwardingWorker {
 public:
  ResendHoldingWorker(std::unique_ptr<transport::Worker> inner, std::shared_ptr<HeldResend> held)
      : ForwardingWorker(std::move(inner)), held_(std::move(held)) {}
  using ForwardingWorker::Send;
  void Send(transport::EndpointRef ep, uint16_t am_id, absl::Span<const uint8_t> header,
            const void* payload, size_t payload_size, const transport::MemoryRegion* region,
            transport::DoneCallback done) override {
    // A held send goes out without the region: the caller's registration
    // may be gone by then, and the loopback transport needs none.
    if (held_->Take(inner_.get(), ep, am_id, header, payload, payload_size, done)) return;
    inner_->Send(ep, am_id, header, payload, payload_size, region, std::move(done));
  }

 private:
  std::shared_ptr<HeldResend> held_;
};

TEST(ResentPushBufferTest, APushSentAgainAfterADrainCarriesItsBytesNotTheReusedBuffer) {
  auto held = std::make_shared<HeldResend>();
  harness::ClusterOptions o;
  o.transport = harness::TransportKind::kLoopback;
  o.num_shards = 3;  // Room for the chunk's copies away from the drained one.
  o.num_workers = 1;
  o.wait = kWait;
  o.make_worker = testing_workers::WrapEveryRank<ResendHoldingWorker>(held);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Cluster> cluster, Cluster::Start(o));

  // One tensor in one chunk, with a backup on the other shard.
  client::JobDef def;
  def.name = "resent-push";
  def.world_size = 1;
  def.tensors = {{"w", {64, 32}}};
  def.optimizer.kind = client::Optimizer::kAdamW;
  def.grad_dtype = DType::kBf16;
  def.param_dtype = DType::kBf16;
  def.replication = 1;
  ASSERT_OK(cluster->CreateJob(def));
  ASSERT_OK(cluster->Train(1, 1));

  // Step 2 from the test's own buffer: the client retains it until
  // version 3 is pulled.
  client::Client* w = cluster->worker(0);
  ASSERT_OK_AND_ASSIGN(std::vector<float> params2, cluster->PullFp32(0, 2));
  std::vector<uint8_t> grad = cluster->GradientBytes(0, 0, params2, 2);
  const std::vector<uint8_t> pushed = grad;
  ASSERT_OK_AND_ASSIGN(client::Ticket push, w->Push(0, 2, grad.data(), params2.size()));
  ASSERT_OK(w->Wait(push, kWait));
  ASSERT_OK(cluster->WaitApplied(def.name, 2));

  // Drain the chunk's shard; wait until it has let go of the chunk, so
  // that the next pull, still under the old map, is refused there and the
  // client takes the new map, sending step 2's push again to the backup
  // that took the chunk over.
  ASSERT_OK_AND_ASSIGN(const size_t primary, cluster->PrimaryOf(0));
  const uint64_t drained = cluster->shard(primary)->shard_id();
  held->Arm();
  ASSERT_OK_AND_ASSIGN(v1::DrainShardResponse drain, cluster->DrainShard(primary));
  ASSERT_EQ(drain.chunks_to_move(), 1u);
  ASSERT_OK(cluster->WaitStatus("the drained shard to hold no chunk",
                                [&](const v1::StatusResponse& s) {
                                  for (const auto& sh : s.shards()) {
                                    if (sh.shard_id() == drained) return sh.chunks_owned() == 0;
                                  }
                                  return false;
                                }));

  // Version 3 comes from the new primary while the re-sent push is held.
  std::vector<uint8_t> params3(params2.size() * DTypeSize(def.param_dtype));
  ASSERT_OK_AND_ASSIGN(client::Ticket pull, w->Pull(0, 3, params3.data(), params2.size()));
  ASSERT_TRUE(held->WaitTaken(kWait)) << "the client never sent step 2's push again";
  ASSERT_OK(w->Wait(pull, kWait));

  // The caller's buffer is its own again: reused for other bytes.
  std::fill(grad.begin(), grad.end(), 0xA5);
  const std::vector<uint8_t> sent = held->Release();
  EXPECT_EQ(sent, pushed) << "the re-sent push carried the buffer's new bytes";

  // Training goes on under the new map, with no step lost or doubled.
  ASSERT_OK(cluster->Train(3, 4));
  ASSERT_OK_AND_ASSIGN(std::vector<float> got, cluster->PullFp32(0, 5));
  ASSERT_OK_AND_ASSIGN(std::vector<float> want, harness::ReferenceParams(def, 0, 4));
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace optimus
