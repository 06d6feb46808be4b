// A reply batch that arrives while every batch buffer of the client is still
// in flight is kept (IncomingMessage::Keep) and is received into
// the first buffer given back, with that buffer's registration; every push
// is answered and training stays the reference bit for bit (client.cc,
// OnReplyBatch and GiveBatch).
//
// Real coordinator and shard, loopback and UCX (tests/harness). The worker's
// data-plane transport is wrapped so that the test decides when a batch
// goes out and when its send completes: a batch buffer is given back in its
// send's completion. A corked push of 1,024 small chunks becomes nine
// batches, each in a buffer of its own; they are held until all nine are
// built, then sent with their completions held, so no buffer is free when
// the reply batches come. The replies must wait, and go on when the
// completions are let go.
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "common/dtype.h"
#include "common/wire.h"
#include "gtest/gtest.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"
#include "tests/integration/client_test_workers.h"
#include "transport/transport.h"

namespace optimus {
namespace {

using client::Client;
using harness::Cluster;
using harness::TransportKind;

constexpr absl::Duration kWait = absl::Seconds(60);

// Shared by the test and the wrapped worker.
class Gate {
 public:
  // From now on kBatch sends wait here (Send) until SendHeld.
  void Hold() {
    absl::MutexLock lock(&mu_);
    holding_ = true;
  }
  // True (and the send is the gate's) while holding.
  bool Take(transport::Worker* inner, transport::EndpointRef ep, uint16_t am_id,
            absl::Span<const uint8_t> header, const void* payload, size_t payload_size,
            const transport::MemoryRegion* region, transport::DoneCallback done) {
    absl::MutexLock lock(&mu_);
    if (!holding_) return false;
    Held h;
    h.inner = inner;
    h.ep = ep;
    h.am_id = am_id;
    h.header.assign(header.begin(), header.end());
    h.payload = payload;
    h.payload_size = payload_size;
    h.region = region;
    h.done = std::move(done);
    sends_.push_back(std::move(h));
    return true;
  }
  // Batch sends not held that have not completed yet.
  void Started() {
    absl::MutexLock lock(&mu_);
    ++in_flight_;
  }
  void Finished() {
    absl::MutexLock lock(&mu_);
    --in_flight_;
  }
  // Waits until every batch send so far has completed (its buffer given
  // back).
  bool WaitIdle(absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
    return mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
  }
  int sends_held() {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(sends_.size());
  }
  // Sends the held batches; their completions are held until Release.
  void SendHeld() {
    std::vector<Held> sends;
    {
      absl::MutexLock lock(&mu_);
      sends.swap(sends_);
    }
    for (Held& h : sends) {
      transport::DoneCallback done = std::move(h.done);
      h.inner->Send(h.ep, h.am_id, h.header, h.payload, h.payload_size, h.region,
                    [this, done = std::move(done)](absl::Status s) mutable {
                      Completed(std::move(done), std::move(s));
                    });
    }
  }
  // Stops holding: sends what is held, runs the held completions.
  void Release() {
    SendHeld();
    std::vector<std::pair<transport::DoneCallback, absl::Status>> done;
    {
      absl::MutexLock lock(&mu_);
      holding_ = false;
      done.swap(completions_);
    }
    for (auto& [d, status] : done) d(status);
  }
  // A reply batch the client kept at its sender (no buffer was free), and
  // how it was received later.
  void Kept() {
    absl::MutexLock lock(&mu_);
    ++kept_;
  }
  void KeptReceived(bool registered) {
    absl::MutexLock lock(&mu_);
    ++kept_received_;
    if (!registered) ++kept_unregistered_;
  }
  int kept() {
    absl::MutexLock lock(&mu_);
    return kept_;
  }
  int kept_received() {
    absl::MutexLock lock(&mu_);
    return kept_received_;
  }
  int kept_unregistered() {
    absl::MutexLock lock(&mu_);
    return kept_unregistered_;
  }
  // Waits until `n` reply batches were kept.
  bool WaitKept(int n, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return kept_ >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }

 private:
  struct Held {
    transport::Worker* inner = nullptr;
    transport::EndpointRef ep;
    uint16_t am_id = 0;
    std::vector<uint8_t> header;
    const void* payload = nullptr;
    size_t payload_size = 0;
    const transport::MemoryRegion* region = nullptr;
    transport::DoneCallback done;
  };

  // A held send's completion: kept while holding, else run.
  void Completed(transport::DoneCallback done, absl::Status s) {
    {
      absl::MutexLock lock(&mu_);
      if (holding_) {
        completions_.emplace_back(std::move(done), std::move(s));
        return;
      }
    }
    done(s);
  }

  absl::Mutex mu_;
  bool holding_ ABSL_GUARDED_BY(mu_) = false;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<Held> sends_ ABSL_GUARDED_BY(mu_);
  std::vector<std::pair<transport::DoneCallback, absl::Status>> completions_ ABSL_GUARDED_BY(mu_);
  int kept_ ABSL_GUARDED_BY(mu_) = 0;
  int kept_received_ ABSL_GUARDED_BY(mu_) = 0;
  int kept_unregistered_ ABSL_GUARDED_BY(mu_) = 0;
};

class WatchedPayload : public transport::PendingPayload {
 public:
  WatchedPayload(std::unique_ptr<transport::PendingPayload> inner, Gate* gate)
      : inner_(std::move(inner)), gate_(gate) {}
  size_t size() const override { return inner_->size(); }
  void ReceiveInto(void* dst, const transport::MemoryRegion* region,
                   transport::DoneCallback done) override {
    gate_->KeptReceived(region != nullptr);
    inner_->ReceiveInto(dst, region, std::move(done));
  }

 private:
  std::unique_ptr<transport::PendingPayload> inner_;
  Gate* gate_;
};

class ReplyBatchMessage : public testing_workers::ForwardingMessage {
 public:
  ReplyBatchMessage(transport::IncomingMessage& inner, Gate* gate)
      : ForwardingMessage(inner), gate_(gate) {}
  std::unique_ptr<transport::PendingPayload> Keep() override {
    std::unique_ptr<transport::PendingPayload> kept = inner_.Keep();
    if (kept == nullptr) return nullptr;
    gate_->Kept();
    return std::make_unique<WatchedPayload>(std::move(kept), gate_);
  }

 private:
  Gate* gate_;
};

// Hands kBatch request sends to the gate while it holds (it sends them and
// holds their completions); watches how reply batches are received.
class BatchGateWorker : public testing_workers::ForwardingWorker {
 public:
  BatchGateWorker(std::unique_ptr<transport::Worker> inner, std::shared_ptr<Gate> gate)
      : ForwardingWorker(std::move(inner)), gate_(std::move(gate)) {}

  void SetHandler(uint16_t am_id, transport::Handler handler) override {
    if (am_id != wire::kAmReplyBatch) return inner_->SetHandler(am_id, std::move(handler));
    inner_->SetHandler(
        am_id, testing_workers::WrapMessages<ReplyBatchMessage>(std::move(handler), gate_.get()));
  }
  using ForwardingWorker::Send;
  void Send(transport::EndpointRef ep, uint16_t am_id, absl::Span<const uint8_t> header,
            const void* payload, size_t payload_size, const transport::MemoryRegion* region,
            transport::DoneCallback done) override {
    auto h = wire::ParseRequestHeader(header);
    const bool batch =
        am_id == wire::kAmRequest && h.ok() && h->op == static_cast<uint16_t>(wire::Op::kBatch);
    if (!batch) {
      return inner_->Send(ep, am_id, header, payload, payload_size, region, std::move(done));
    }
    if (gate_->Take(inner_.get(), ep, am_id, header, payload, payload_size, region, done)) return;
    gate_->Started();
    Gate* gate = gate_.get();
    inner_->Send(ep, am_id, header, payload, payload_size, region,
                 [gate, done = std::move(done)](absl::Status s) {
                   done(s);
                   gate->Finished();
                 });
  }

 private:
  std::shared_ptr<Gate> gate_;
};

class ReplyBatchWaitTest : public ::testing::TestWithParam<TransportKind> {};

TEST_P(ReplyBatchWaitTest, RepliesWaitForABatchBufferAndAnswerEveryPush) {
  auto gate = std::make_shared<Gate>();
  harness::ClusterOptions o;
  o.transport = GetParam();
  o.num_shards = 1;
  o.num_workers = 1;
  o.wait = kWait;
  o.make_worker = testing_workers::WrapEveryRank<BatchGateWorker>(gate);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Cluster> cluster, Cluster::Start(o));
  // Whatever a failed check left held goes before the cluster stops.
  struct ReleaseAtExit {
    Gate* gate;
    ~ReleaseAtExit() { gate->Release(); }
  } release_at_exit{gate.get()};

  // One tensor of 1,024 small chunks (8 KiB of fp32 gradient each, small
  // enough to go in a batch); no commit round, so each batch of pushes is
  // answered in one reply batch as it lands.
  client::JobDef def = harness::SmallJob("reply-batch-wait", 1);
  def.grad_dtype = DType::kFp32;
  def.param_dtype = DType::kFp32;
  def.skip_nonfinite = false;
  constexpr int64_t kElems = int64_t{2} << 20;
  def.max_chunk_bytes = 0;  // Chunks cut by chunk_payload_bytes.
  def.chunk_payload_bytes = Client::kBatchItemBytes;
  def.tensors = {{"w", {kElems}}};
  ASSERT_OK(cluster->CreateJob(def));
  Client* c = cluster->worker(0);

  constexpr uint64_t kSteps = 3;
  std::vector<float> params(kElems);
  std::vector<uint8_t> grads;
  for (uint64_t step = 1; step <= kSteps; ++step) {
    absl::StatusOr<client::Ticket> tk;
    {
      client::BatchScope batch(c);
      tk = c->Pull(0, step, params.data(), kElems);
    }
    ASSERT_OK(tk.status());
    ASSERT_OK(c->Wait(*tk, kWait));
    grads = cluster->GradientBytes(0, 0, params, step);
    // Step 2's push: its batches are taken (each into a batch buffer of
    // its own) and held before any goes out, then sent with their
    // completions held: no buffer is free when the answers come.
    const bool held = step == 2;
    if (held) {
      // The pull's batch has given its buffer back: every buffer is free.
      ASSERT_TRUE(gate->WaitIdle(kWait));
      gate->Hold();
    }
    {
      client::BatchScope batch(c);
      tk = c->Push(0, step, grads.data(), kElems);
    }
    ASSERT_OK(tk.status());
    if (held) {
      // Earlier steps' replies may have waited too (as the scheduler had
      // it); all were received before their pushes were answered.
      const int kept_before = gate->kept();
      EXPECT_EQ(gate->kept_received(), kept_before);
      const int batches = gate->sends_held();
      // More batches than the client keeps free buffers (4).
      EXPECT_GT(batches, 4);
      gate->SendHeld();
      // Each batch is answered in a reply batch, which finds no free
      // buffer and is kept (IncomingMessage::Keep) until one comes back.
      const bool kept = gate->WaitKept(kept_before + batches, kWait);
      EXPECT_TRUE(kept) << gate->kept() - kept_before << " of " << batches << " reply batches kept";
      EXPECT_EQ(gate->kept_received(), kept_before)
          << "a reply batch was received with no buffer free";
      EXPECT_FALSE(c->Wait(*tk, absl::ZeroDuration()).ok())
          << "the push was answered while its answers had nowhere to land";
      // The sends complete: each buffer given back takes a waiting batch.
      gate->Release();
      if (!kept) break;
    }
    ASSERT_OK(c->Wait(*tk, kWait));
  }

  // Every kept reply batch was received, into a registered batch buffer.
  EXPECT_GT(gate->kept(), 0);
  EXPECT_EQ(gate->kept_received(), gate->kept());
  EXPECT_EQ(gate->kept_unregistered(), 0);
  // No step lost or doubled.
  ASSERT_OK_AND_ASSIGN(std::vector<float> got, cluster->PullFp32(0, kSteps + 1, 0));
  ASSERT_OK_AND_ASSIGN(std::vector<float> want, harness::ReferenceParams(def, 0, kSteps));
  EXPECT_EQ(harness::BitMismatches(got, want), 0u);
}

INSTANTIATE_TEST_SUITE_P(Transports, ReplyBatchWaitTest,
                         ::testing::Values(TransportKind::kLoopback, TransportKind::kUcx),
                         [](const ::testing::TestParamInfo<TransportKind>& info) {
                           return harness::TransportName(info.param);
                         });

}  // namespace
}  // namespace optimus
