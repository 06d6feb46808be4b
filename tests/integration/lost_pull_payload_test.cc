// A pull whose payload is on its way when the shard that sent it dies is
// pulled again from the shard that takes the chunk over: the worker's step
// goes on, with the same values, instead of failing UNAVAILABLE
// ("rendezvous receive: UCX: Input/output error" in primary_kill_failover's
// eight-shard drill, when the SIGKILL landed inside a pull's rendezvous).
//
// Real coordinator and shards over the loopback transport (tests/harness).
// Rank 0's data-plane worker is wrapped so that the test decides when a
// rendezvous payload is received: it holds the payload (Keep), kills the
// shard that sent it, then lets the receive go on, which fails as it would
// over UCX (the sender is gone).
#include <cstdint>
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
#include "gtest/gtest.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"
#include "tests/integration/client_test_workers.h"
#include "transport/transport.h"

namespace optimus {
namespace {

using harness::Cluster;

constexpr absl::Duration kWait = absl::Seconds(30);

// A received rendezvous payload the test has not let land yet.
struct HeldReceive {
  std::unique_ptr<transport::PendingPayload> payload;
  void* dst = nullptr;
  const transport::MemoryRegion* region = nullptr;
  transport::DoneCallback done;
};

// What the wrapped worker holds and what became of it.
class Hold {
 public:
  void Arm() {
    absl::MutexLock lock(&mu_);
    armed_ = true;
  }
  // True once: for the first rendezvous payload received while armed.
  bool Claim() {
    absl::MutexLock lock(&mu_);
    if (!armed_) return false;
    armed_ = false;
    return true;
  }
  // The claimed payload, kept until Release.
  void Put(HeldReceive h) {
    {
      absl::MutexLock lock(&mu_);
      held_ = std::move(h);
    }
    taken_.Notify();
  }
  bool WaitTaken(absl::Duration timeout) { return taken_.WaitForNotificationWithTimeout(timeout); }
  // Lets the held payload land (or fail); records how its receive ended.
  // The payload object stays here until this Hold goes.
  void Release() {
    transport::PendingPayload* payload;
    void* dst;
    const transport::MemoryRegion* region;
    transport::DoneCallback done;
    {
      absl::MutexLock lock(&mu_);
      payload = held_.payload.get();
      dst = held_.dst;
      region = held_.region;
      done = std::move(held_.done);
    }
    payload->ReceiveInto(dst, region, [this, done](absl::Status s) {
      {
        absl::MutexLock lock(&mu_);
        held_status_ = s;
      }
      received_.Notify();
      done(std::move(s));
    });
  }
  // Once its receive ended: the payload must not outlive its worker.
  void Forget() {
    absl::MutexLock lock(&mu_);
    held_.payload.reset();
  }
  absl::Status HeldStatus(absl::Duration timeout) {
    if (!received_.WaitForNotificationWithTimeout(timeout)) {
      return absl::DeadlineExceededError("the held payload's receive never ended");
    }
    absl::MutexLock lock(&mu_);
    return held_status_;
  }

 private:
  absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  HeldReceive held_ ABSL_GUARDED_BY(mu_);
  absl::Status held_status_ ABSL_GUARDED_BY(mu_);
  absl::Notification taken_, received_;
};

class HoldingMessage : public testing_workers::ForwardingMessage {
 public:
  HoldingMessage(transport::IncomingMessage& inner, Hold* hold)
      : ForwardingMessage(inner), hold_(hold) {}
  using ForwardingMessage::ReceiveInto;
  void ReceiveInto(void* dst, const transport::MemoryRegion* region,
                   transport::DoneCallback done) override {
    if (inner_.is_rendezvous() && inner_.payload_size() > 0 && hold_->Claim()) {
      HeldReceive h;
      h.payload = inner_.Keep();
      h.dst = dst;
      h.region = region;
      h.done = std::move(done);
      return hold_->Put(std::move(h));
    }
    inner_.ReceiveInto(dst, region, std::move(done));
  }

 private:
  Hold* hold_;
};

class HoldingWorker : public testing_workers::ForwardingWorker {
 public:
  HoldingWorker(std::unique_ptr<transport::Worker> inner, std::shared_ptr<Hold> hold)
      : ForwardingWorker(std::move(inner)), hold_(std::move(hold)) {}
  void SetHandler(uint16_t am_id, transport::Handler handler) override {
    Hold* hold = hold_.get();
    inner_->SetHandler(am_id, [handler, hold](transport::IncomingMessage& m) {
      HoldingMessage held(m, hold);
      handler(held);
    });
  }

 private:
  std::shared_ptr<Hold> hold_;
};

TEST(LostPullPayloadTest, APullWhoseShardDiedMidTransferIsPulledAgainFromTheBackup) {
  auto hold = std::make_shared<Hold>();
  harness::ClusterOptions o;
  o.transport = harness::TransportKind::kLoopback;
  o.num_shards = 2;
  o.num_workers = 1;
  o.wait = kWait;
  o.make_worker = testing_workers::WrapEveryRank<HoldingWorker>(hold);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Cluster> cluster, Cluster::Start(o));

  // One tensor in one chunk, with a backup on the other shard; its bf16
  // parameters (16 KiB) travel by rendezvous over loopback (8 KiB and up).
  client::JobDef def;
  def.name = "lost-payload";
  def.world_size = 1;
  def.tensors = {{"w", {128, 64}}};
  def.optimizer.kind = client::Optimizer::kAdamW;
  def.grad_dtype = DType::kBf16;
  def.param_dtype = DType::kBf16;
  def.replication = 1;
  ASSERT_OK(cluster->CreateJob(def));
  ASSERT_OK(cluster->Train(1, 2));
  ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> expected, cluster->Pull(0, 3));
  ASSERT_EQ(expected.size(), 128u * 64u * 2u);

  // The shard holding the chunk.
  ASSERT_OK_AND_ASSIGN(const size_t primary, cluster->PrimaryOf(0));

  // Pull version 3 again; its payload is held until its shard is dead.
  hold->Arm();
  std::vector<uint8_t> got(expected.size(), 0);
  client::Client* w = cluster->worker(0);
  ASSERT_OK_AND_ASSIGN(client::Ticket t, w->Pull(0, 3, got.data(), 128 * 64));
  ASSERT_TRUE(hold->WaitTaken(kWait)) << "no rendezvous payload came for the pull";
  ASSERT_OK(cluster->KillShard(primary));
  hold->Release();
  // The payload was lost with its shard...
  const absl::Status lost = hold->HeldStatus(kWait);
  hold->Forget();
  EXPECT_TRUE(absl::IsUnavailable(lost)) << lost;
  // ...and the pull still completes, from the backup, with the same bytes.
  ASSERT_OK(w->Wait(t, kWait));
  EXPECT_EQ(got, expected);
  // Training goes on past the failover.
  ASSERT_OK(cluster->Train(3, 4));
}

}  // namespace
}  // namespace optimus
