// The client's data plane as its transport sees it (issue 12): the buffers
// it sends from and receives into are registered once and every transfer
// from or into them carries that registration; a request costs no heap
// allocation once warm. A real coordinator and shards (tests/harness, over
// loopback); the client's worker is wrapped (CountingWorker) or replaced
// (FakeShardWorker) through ClientOptions::make_worker.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "gtest/gtest.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"
#include "tests/integration/client_test_workers.h"

// Allocations made on the thread that set t_counting.
namespace {
thread_local bool t_counting = false;
thread_local uint64_t t_allocations = 0;
}  // namespace

void* operator new(size_t n) {
  if (t_counting) ++t_allocations;
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

namespace optimus {
namespace {

using harness::Cluster;
using testing_workers::CountingWorker;
using testing_workers::FakeShardWorker;
using testing_workers::TransportLog;

constexpr absl::Duration kWait = absl::Seconds(30);
constexpr uint16_t kBf16Small = 0x3a83;  // About 1e-3.

std::unique_ptr<Cluster> StartCluster(int shards) {
  harness::ClusterOptions o;
  o.transport = harness::TransportKind::kLoopback;
  o.num_shards = shards;
  o.num_workers = 1;
  auto c = Cluster::Start(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

client::ClientOptions CountingClient(Cluster* c, std::shared_ptr<TransportLog> log) {
  client::ClientOptions o;
  o.coordinator_address = c->coordinator_address();
  o.transport = c->TransportOptions("counted");
  o.make_worker = [log](const transport::WorkerOptions& w)
      -> absl::StatusOr<std::unique_ptr<transport::Worker>> {
    auto inner = transport::Worker::Create(w);
    if (!inner.ok()) return inner.status();
    return std::unique_ptr<transport::Worker>(new CountingWorker(std::move(*inner), log));
  };
  return o;
}

// Tensor "big" (512 Ki bf16 elements, 8 chunks of 128 KiB) and "small"
// (1000 elements, one chunk of 2000 bytes: below the cache's 64 KiB).
client::JobDef TwoTensorJob(const std::string& name, bool round) {
  client::JobDef def;
  def.name = name;
  def.world_size = 1;
  def.tensors = {{"big", {512, 1024}}, {"small", {1000}}};
  def.optimizer.lr = 1e-3f;
  def.chunk_payload_bytes = 128 * 1024;
  def.skip_nonfinite = round;
  return def;
}

absl::Status CreateAndInit(client::Client* c, const client::JobDef& def) {
  if (auto s = c->CreateJob(def); !s.ok()) return s;
  if (auto s = c->Join(def.name, 0, 1); !s.ok()) return s;
  for (uint32_t t = 0; t < c->tensors().size(); ++t) {
    std::vector<float> v(c->tensors()[t].num_elems, 0.5f);
    if (auto s = c->InitTensor(t, v.data(), v.size()); !s.ok()) return s;
  }
  return absl::OkStatus();
}

struct Buffers {
  std::vector<std::vector<uint16_t>> grads, params;
  explicit Buffers(const client::Client& c) {
    for (const auto& t : c.tensors()) {
      grads.emplace_back(t.num_elems, kBf16Small);
      params.emplace_back(t.num_elems, 0);
    }
  }
};

// One step: pull every tensor at version `step`, push every tensor's
// gradient for `step`.
absl::Status Step(client::Client* c, Buffers* b, uint64_t step,
                  std::vector<client::Ticket>* tickets) {
  const uint32_t n = static_cast<uint32_t>(c->tensors().size());
  for (int phase = 0; phase < 2; ++phase) {
    tickets->clear();
    for (uint32_t t = 0; t < n; ++t) {
      auto k = phase == 0 ? c->Pull(t, step, b->params[t].data(), b->params[t].size())
                          : c->Push(t, step, b->grads[t].data(), b->grads[t].size());
      if (!k.ok()) return k.status();
      tickets->push_back(*k);
    }
    for (client::Ticket k : *tickets) {
      if (auto s = c->Wait(k, kWait); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

uintptr_t Addr(const void* p) { return reinterpret_cast<uintptr_t>(p); }

// Transfers inside [p, p + bytes).
std::vector<TransportLog::Transfer> Within(const std::vector<TransportLog::Transfer>& all,
                                           const void* p, size_t bytes) {
  std::vector<TransportLog::Transfer> out;
  for (const auto& t : all) {
    if (t.begin >= Addr(p) && t.begin + t.bytes <= Addr(p) + bytes) out.push_back(t);
  }
  return out;
}

TEST(ClientRegistrationTest, EachBufferIsRegisteredOnceAndEveryTransferUsesIt) {
  auto cluster = StartCluster(2);
  ASSERT_NE(cluster, nullptr);
  auto log = std::make_shared<TransportLog>();
  ASSERT_OK_AND_ASSIGN(auto c, client::Client::Connect(CountingClient(cluster.get(), log)));
  ASSERT_OK(CreateAndInit(c.get(), TwoTensorJob("registered", /*round=*/true)));
  ASSERT_EQ(c->tensors()[0].num_chunks, 8u);
  // InitTensor's one-off buffers are not registered; only the client's
  // two batch buffers are (registered at Connect, 1 MiB each).
  ASSERT_EQ(log->registrations().size(), 2u);
  const size_t batch_bytes = log->registrations()[0].second + log->registrations()[1].second;
  log->Clear();
  Buffers b(*c);
  std::vector<client::Ticket> tickets;
  constexpr int kSteps = 20;
  for (uint64_t step = 1; step <= kSteps; ++step) ASSERT_OK(Step(c.get(), &b, step, &tickets));

  const size_t big_bytes = b.grads[0].size() * 2;
  const size_t small_bytes = b.grads[1].size() * 2;
  // Once each, whole: the big gradient and the big parameter buffer. The
  // small ones travel eagerly, unregistered.
  auto regs = log->registrations();
  ASSERT_EQ(regs.size(), 4u);
  EXPECT_EQ(regs[2], std::make_pair(Addr(b.params[0].data()), big_bytes));
  EXPECT_EQ(regs[3], std::make_pair(Addr(b.grads[0].data()), big_bytes));
  // Every chunk pushed from the big buffer carried its registration.
  auto big_sends = Within(log->sends(), b.grads[0].data(), big_bytes);
  ASSERT_EQ(big_sends.size(), 8u * kSteps);
  for (const auto& t : big_sends) {
    EXPECT_EQ(t.region_begin, Addr(b.grads[0].data()));
    EXPECT_EQ(t.region_bytes, big_bytes);
  }
  for (const auto& t : Within(log->sends(), b.grads[1].data(), small_bytes)) {
    EXPECT_EQ(t.region_begin, 0u);
  }
  // And every chunk pulled into the big buffer.
  auto big_receives = Within(log->receives(), b.params[0].data(), big_bytes);
  ASSERT_EQ(big_receives.size(), 8u * kSteps);
  for (const auto& t : big_receives) EXPECT_EQ(t.region_begin, Addr(b.params[0].data()));
  client::RegistrationStats s = c->registration_stats();
  EXPECT_EQ(s.registrations, 4u);
  EXPECT_EQ(s.misses, 2u);
  // (+2: each of the two batch buffers looks up its own registration when
  // it is made, to receive reply batches into.)
  EXPECT_EQ(s.hits, 2u * kSteps - 2 + 2);
  EXPECT_EQ(s.cached_bytes, 2 * big_bytes);

  // The user says the gradient buffer is gone: its registration goes, and
  // the next push from that address registers again.
  EXPECT_EQ(c->ForgetBuffer(b.grads[0].data(), big_bytes), 1u);
  ASSERT_OK(Step(c.get(), &b, kSteps + 1, &tickets));
  regs = log->registrations();
  ASSERT_EQ(regs.size(), 5u);
  EXPECT_EQ(regs[4], std::make_pair(Addr(b.grads[0].data()), big_bytes));

  // A buffer registered by the caller is used whatever its size.
  ASSERT_OK(c->RegisterBuffer(b.grads[1].data(), small_bytes));
  log->Clear();
  for (uint64_t step = kSteps + 2; step <= kSteps + 5; ++step) {
    ASSERT_OK(Step(c.get(), &b, step, &tickets));
  }
  EXPECT_EQ(log->registrations().size(), 6u);
  auto small_sends = Within(log->sends(), b.grads[1].data(), small_bytes);
  ASSERT_EQ(small_sends.size(), 4u);
  for (const auto& t : small_sends) EXPECT_EQ(t.region_begin, Addr(b.grads[1].data()));
  EXPECT_EQ(c->registration_stats().pinned_bytes, small_bytes + batch_bytes);
}

TEST(ClientRegistrationTest, WithoutTheCacheOnlyRegisteredBuffersCarryARegistration) {
  auto cluster = StartCluster(1);
  ASSERT_NE(cluster, nullptr);
  auto log = std::make_shared<TransportLog>();
  client::ClientOptions o = CountingClient(cluster.get(), log);
  o.registration_cache_bytes = 0;
  ASSERT_OK_AND_ASSIGN(auto c, client::Client::Connect(o));
  ASSERT_OK(CreateAndInit(c.get(), TwoTensorJob("uncached", /*round=*/false)));
  Buffers b(*c);
  const size_t big_bytes = b.grads[0].size() * 2;
  ASSERT_OK(c->RegisterBuffer(b.params[0].data(), big_bytes));
  std::vector<client::Ticket> tickets;
  for (uint64_t step = 1; step <= 5; ++step) ASSERT_OK(Step(c.get(), &b, step, &tickets));
  EXPECT_EQ(log->registrations().size(), 3u);  // The batch buffers and params[0].
  for (const auto& t : Within(log->sends(), b.grads[0].data(), big_bytes)) {
    EXPECT_EQ(t.region_begin, 0u);
  }
  auto received = Within(log->receives(), b.params[0].data(), big_bytes);
  ASSERT_EQ(received.size(), 8u * 5);
  for (const auto& t : received) EXPECT_EQ(t.region_begin, Addr(b.params[0].data()));
}

// The common path of a request allocates nothing once warm: issuing,
// sending, the reply, the payload, the ticket, the clipping round's partials
// and commits. Every shard is a FakeShardWorker answering on the caller's
// thread, so every allocation of the client shows on that thread.
class ClientAllocationTest : public ::testing::TestWithParam<bool> {};

TEST_P(ClientAllocationTest, NoHeapAllocationPerRequestOnceWarm) {
  const bool round = GetParam();
  auto cluster = StartCluster(1);  // Loads the job; the client never reaches it.
  ASSERT_NE(cluster, nullptr);
  client::ClientOptions o;
  o.coordinator_address = cluster->coordinator_address();
  o.make_worker = [](const transport::WorkerOptions&)
      -> absl::StatusOr<std::unique_ptr<transport::Worker>> {
    return std::unique_ptr<transport::Worker>(new FakeShardWorker(128 * 1024));
  };
  ASSERT_OK_AND_ASSIGN(auto c, client::Client::Connect(o));
  client::JobDef def = TwoTensorJob(round ? "alloc-round" : "alloc", round);
  for (int t = 0; t < 200; ++t) def.tensors.push_back({"t" + std::to_string(t), {4096}});
  ASSERT_OK(CreateAndInit(c.get(), def));
  Buffers b(*c);
  std::vector<client::Ticket> tickets;
  tickets.reserve(def.tensors.size());
  for (uint64_t step = 1; step <= 3; ++step) ASSERT_OK(Step(c.get(), &b, step, &tickets));
  constexpr uint64_t kSteps = 10;
  t_allocations = 0;
  t_counting = true;
  absl::Status failed;
  for (uint64_t step = 4; step < 4 + kSteps && failed.ok(); ++step) {
    failed = Step(c.get(), &b, step, &tickets);
  }
  t_counting = false;
  ASSERT_OK(failed);
  const uint64_t requests = kSteps * 2 * (8 + 1 + 200);
  EXPECT_EQ(t_allocations, 0u) << "over " << requests << " requests";
  if (round) {
    // Every chunk's partial (1 each) went into the step's norm.
    ASSERT_OK_AND_ASSIGN(client::StepReport r, c->StepResult(4 + kSteps - 1, kWait));
    EXPECT_DOUBLE_EQ(r.grad_norm, std::sqrt(8.0 + 1 + 200));
  }
}

INSTANTIATE_TEST_SUITE_P(RoundOrNot, ClientAllocationTest, ::testing::Bool());

}  // namespace
}  // namespace optimus
