// End-to-end: a model of many small tensors trained with its pushes and
// pulls corked (Client::Cork): the small chunks go to each shard in a few
// batched messages instead of one message each, over loopback and UCX, and
// the result is still the single-process reference bit for bit.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/client.h"
#include "common/dtype.h"
#include "gtest/gtest.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace {

using client::Client;
using client::JobDef;
using harness::Cluster;
using harness::TransportKind;

constexpr uint32_t kWorkers = 2;
constexpr uint32_t kTensors = 300;
constexpr int64_t kElems = 64;

class BatchTest : public ::testing::TestWithParam<TransportKind> {
 protected:
  // Two shards and kWorkers connected workers on the test's transport.
  absl::StatusOr<std::unique_ptr<Cluster>> StartCluster() {
    harness::ClusterOptions o;
    o.transport = GetParam();
    o.num_shards = 2;
    o.num_workers = kWorkers;
    auto cluster = Cluster::Start(o);
    if (!cluster.ok()) return cluster.status();
    if (absl::Status s = (*cluster)->ConnectWorkers(); !s.ok()) return s;
    return cluster;
  }

  // The harness's small job, fp32 gradients and parameters; tensors set by
  // the test.
  static JobDef Fp32Job(const std::string& name) {
    JobDef def = harness::SmallJob(name, kWorkers);
    def.grad_dtype = DType::kFp32;
    def.param_dtype = DType::kFp32;
    def.tensors.clear();
    return def;
  }

  // kTensors small tensors trained for kSteps with corked pulls and pushes;
  // checks the result against the reference and the batches' counts.
  // Without a commit round (skip_nonfinite false), each push is answered as
  // it lands, while its batch is handled: those answers go back in reply
  // batches too.
  void TrainManySmallTensors(bool commit_round) {
    ASSERT_OK_AND_ASSIGN(auto cluster, StartCluster());
    JobDef def = Fp32Job("many-small");
    def.skip_nonfinite = commit_round;
    for (uint32_t t = 0; t < kTensors; ++t) {
      def.tensors.push_back({"t" + std::to_string(t), {kElems}});
    }
    ASSERT_OK(cluster->CreateJob(def));
    constexpr uint64_t kSteps = 4;
    std::vector<absl::Status> results(kWorkers);
    std::vector<std::thread> threads;
    for (uint32_t r = 0; r < kWorkers; ++r) {
      threads.emplace_back([&, r] {
        Client* c = cluster->worker(r);
        std::vector<std::vector<float>> params(kTensors, std::vector<float>(kElems));
        std::vector<std::vector<uint8_t>> grads(kTensors);
        auto wait_all = [&](const std::vector<client::Ticket>& tickets) {
          absl::Status first;
          for (client::Ticket t : tickets) {
            absl::Status s = c->Wait(t, absl::Seconds(30));
            if (first.ok()) first = s;
          }
          return first;
        };
        for (uint64_t step = 1; step <= kSteps; ++step) {
          std::vector<client::Ticket> tickets;
          {
            client::BatchScope batch(c);
            for (uint32_t t = 0; t < kTensors; ++t) {
              auto tk = c->Pull(t, step, params[t].data(), kElems);
              if (!tk.ok()) return void(results[r] = tk.status());
              tickets.push_back(*tk);
            }
          }
          if (absl::Status s = wait_all(tickets); !s.ok()) return void(results[r] = s);
          tickets.clear();
          {
            client::BatchScope batch(c);
            for (uint32_t t = 0; t < kTensors; ++t) {
              grads[t] = cluster->GradientBytes(r, t, params[t], step);
              auto tk = c->Push(t, step, grads[t].data(), kElems);
              if (!tk.ok()) return void(results[r] = tk.status());
              tickets.push_back(*tk);
            }
          }
          if (absl::Status s = wait_all(tickets); !s.ok()) return void(results[r] = s);
        }
      });
    }
    for (auto& t : threads) t.join();
    for (const absl::Status& s : results) ASSERT_OK(s);
    for (uint32_t t : {0u, 1u, kTensors / 2, kTensors - 1}) {
      ASSERT_OK_AND_ASSIGN(std::vector<float> got, cluster->PullFp32(t, kSteps + 1, 0));
      ASSERT_OK_AND_ASSIGN(std::vector<float> want, harness::ReferenceParams(def, t, kSteps));
      EXPECT_EQ(harness::BitMismatches(got, want), 0u) << "tensor " << t;
    }
    // 300 chunks per worker per step over 2 shards, each direction: a
    // handful of batches instead of 2 x 300 x 2 x 4 messages.
    uint64_t batches = 0, pushes = 0;
    for (const auto& s : cluster->ShardStats()) {
      batches += s.batches_received;
      pushes += s.pushes_received;
    }
    EXPECT_EQ(pushes, uint64_t{kWorkers} * kTensors * kSteps);
    EXPECT_GE(batches, uint64_t{kWorkers} * kSteps * 2);   // Pushes and pulls, both shards.
    EXPECT_LE(batches, uint64_t{kWorkers} * kSteps * 2 * 2);
    // Each worker waits for its batch's answers before it sends the next, and
    // every pushed gradient lands at once (its step's pull came first), so a
    // shard never holds more than one batch per worker: it receives them all
    // into the buffers it kept, instead of allocating one per batch.
    for (const auto& s : cluster->ShardStats()) {
      EXPECT_GE(s.batches_received, uint64_t{kWorkers} * kSteps * 2) << "shard " << s.shard_id;
      EXPECT_LE(s.batch_buffer_allocations, uint64_t{kWorkers}) << "shard " << s.shard_id;
    }
    if (commit_round) {
      // Pushes are answered after their chunks' reduces, by the step
      // threads: several in one message when a thread ran several reduces
      // in a row, which is up to the scheduler (//server:shard_server_test
      // holds a step thread to check it). Never more than one per push.
      uint64_t replies_batched = 0;
      for (const auto& s : cluster->ShardStats()) replies_batched += s.replies_batched;
      EXPECT_LE(replies_batched, pushes);
      return;
    }
    // The pushes' acks went back the same way: every one inside a reply
    // batch, one per batch of pushes, instead of one message per push.
    uint64_t reply_batches = 0, replies_batched = 0;
    for (const auto& s : cluster->ShardStats()) {
      reply_batches += s.reply_batches;
      replies_batched += s.replies_batched;
    }
    EXPECT_EQ(replies_batched, pushes);
    EXPECT_GE(reply_batches, uint64_t{kWorkers} * kSteps * 2);  // Each worker, step and shard.
    EXPECT_LE(reply_batches, batches);
  }
};

TEST_P(BatchTest, ManySmallTensorsGoInBatchesAndTrainExactlyTheReference) {
  TrainManySmallTensors(/*commit_round=*/true);
}

TEST_P(BatchTest, WithoutACommitRoundABatchOfPushesIsAnsweredInOneMessage) {
  TrainManySmallTensors(/*commit_round=*/false);
}

// A corked push of a large tensor in small chunks: one Uncork sends many
// batches at once, more than the client keeps buffers for, so it registers
// new batch buffers while the transport's progress thread hands finished
// ones back. That used to deadlock on the registration cache's mutex
// (a registration waits for the progress thread while holding it; the
// progress thread, giving a buffer back, waited for the mutex): bench/
// dataplane hung on its first corked push of 64 KiB chunks (batched then).
// Every step must finish, and train exactly the reference.
TEST_P(BatchTest, CorkedBurstsOfBatchesFinishAndTrainExactlyTheReference) {
  ASSERT_OK_AND_ASSIGN(auto cluster, StartCluster());
  JobDef def = Fp32Job("corked-bursts");
  // 8 Mi fp32 elements in chunks of kBatchItemBytes: 4,096 chunks, each
  // small enough to be batched; 32 MiB of pushes per worker per step, about
  // 33 batches of 1 MiB, far more than the 4 buffers the client keeps.
  constexpr int64_t kBig = int64_t{8} << 20;
  def.max_chunk_bytes = 0;  // Chunks cut by chunk_payload_bytes.
  def.chunk_payload_bytes = Client::kBatchItemBytes;
  def.tensors = {{"big", {kBig}}};
  ASSERT_OK(cluster->CreateJob(def));
  constexpr uint64_t kSteps = 6;
  std::vector<absl::Status> results(kWorkers);
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < kWorkers; ++r) {
    threads.emplace_back([&, r] {
      Client* c = cluster->worker(r);
      std::vector<float> params(kBig);
      std::vector<uint8_t> grads;
      for (uint64_t step = 1; step <= kSteps; ++step) {
        absl::StatusOr<client::Ticket> tk;
        {
          client::BatchScope batch(c);
          tk = c->Pull(0, step, params.data(), kBig);
        }
        if (!tk.ok()) return void(results[r] = tk.status());
        if (absl::Status s = c->Wait(*tk, absl::Seconds(60)); !s.ok()) {
          return void(results[r] = s);
        }
        grads = cluster->GradientBytes(r, 0, params, step);
        {
          client::BatchScope batch(c);
          tk = c->Push(0, step, grads.data(), kBig);
        }
        if (!tk.ok()) return void(results[r] = tk.status());
        if (absl::Status s = c->Wait(*tk, absl::Seconds(60)); !s.ok()) {
          return void(results[r] = s);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : results) ASSERT_OK(s);
  ASSERT_OK_AND_ASSIGN(std::vector<float> got, cluster->PullFp32(0, kSteps + 1, 0));
  ASSERT_OK_AND_ASSIGN(std::vector<float> want, harness::ReferenceParams(def, 0, kSteps));
  EXPECT_EQ(harness::BitMismatches(got, want), 0u);
  // The pushes went in batches (several per worker per step), not one
  // message per chunk.
  uint64_t batches = 0;
  for (const auto& s : cluster->ShardStats()) batches += s.batches_received;
  EXPECT_GE(batches, uint64_t{kWorkers} * kSteps * 8);
}

INSTANTIATE_TEST_SUITE_P(Transports, BatchTest,
                         ::testing::Values(TransportKind::kLoopback, TransportKind::kUcx),
                         [](const ::testing::TestParamInfo<TransportKind>& info) {
                           return harness::TransportName(info.param);
                         });

}  // namespace
}  // namespace optimus
