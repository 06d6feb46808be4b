// The shard server alone, in-process: a fake coordinator link hands it jobs,
// maps and released jobs; a raw peer on the loopback transport sends it
// wire requests. Checks request handling (what is served, refused, parked)
// and that every job and chunk that leaves gives its memory back.
#include "server/shard_server.h"

#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/dtype.h"
#include "common/wire.h"
#include "gtest/gtest.h"
#include "kernels/cpu/optimizer.h"
#include "server/coordinator_link.h"
#include "transport/loopback.h"

namespace optimus {
namespace server {
namespace {

constexpr absl::Duration kWait = absl::Seconds(10);
constexpr uint64_t kJob = 5;
constexpr uint32_t kWorld = 2;
constexpr uint64_t kElems = 4096;  // One chunk of tensor 0.

class FakeLink : public CoordinatorLink {
 public:
  absl::StatusOr<Registered> Register(const ShardRegistration& r) override {
    absl::MutexLock lock(&mu_);
    address_ = r.data_address;
    cores_ = r.cores;
    known_ = true;
    return Registered{++shard_id_, 600};
  }
  absl::StatusOr<HeartbeatReply> Heartbeat(const HeartbeatReport& report) override {
    absl::MutexLock lock(&mu_);
    last_ = report;
    ++beats_;
    HeartbeatReply reply;
    reply.known = known_;
    if (assign_) {
      for (const auto& [id, d] : jobs_) {
        auto part = part_epochs_.find(id);
        reply.assignments.push_back({id, d.map.epoch,
                                     part == part_epochs_.end() ? 0 : part->second, fetch_after_});
      }
      if (assign_once_ && !jobs_.empty()) assign_ = false;
    }
    reply.released_jobs = released_;
    return reply;
  }
  absl::StatusOr<JobDescription> GetJob(uint64_t job_id, uint64_t for_shard_id) override {
    absl::MutexLock lock(&mu_);
    fetched_for_.push_back(for_shard_id);
    fetched_at_.push_back(absl::Now());
    if (fail_fetches_) return absl::UnavailableError("the test refuses every fetch");
    if (busy_fetches_ > 0) {
      --busy_fetches_;
      return absl::ResourceExhaustedError("the coordinator is serving its most map reads");
    }
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError("no such job");
    return it->second;
  }

  void SetJob(const JobDescription& d) {
    absl::MutexLock lock(&mu_);
    jobs_[d.config.job_id] = d;
  }
  // What heartbeats say of the job's part (Assignment.part_epoch; 0, the
  // default: not known).
  void SetPartEpoch(uint64_t job_id, uint64_t part_epoch) {
    absl::MutexLock lock(&mu_);
    part_epochs_[job_id] = part_epoch;
  }
  // Every assignment says: fetch after `wait` (Assignment.fetch_after_ms).
  void SetFetchAfter(absl::Duration wait) {
    absl::MutexLock lock(&mu_);
    fetch_after_ = wait;
  }
  std::vector<absl::Time> fetched_at() {
    absl::MutexLock lock(&mu_);
    return fetched_at_;
  }
  // While set, every GetJob fails (UNAVAILABLE).
  void FailFetches(bool fail) {
    absl::MutexLock lock(&mu_);
    fail_fetches_ = fail;
  }
  // The coordinator stops assigning the job (it moved to other shards).
  void Unassign(uint64_t job_id) {
    absl::MutexLock lock(&mu_);
    jobs_.erase(job_id);
  }
  void Delete(uint64_t job_id) {
    absl::MutexLock lock(&mu_);
    jobs_.erase(job_id);
    released_.push_back(job_id);
  }
  // The next `n` GetJobs are refused as a busy coordinator refuses them;
  // with `once`, a job is assigned in one heartbeat reply only (so that
  // only the shard itself can ask for it again).
  void RefuseFetches(int n, bool once) {
    absl::MutexLock lock(&mu_);
    busy_fetches_ = n;
    assign_once_ = once;
  }
  void Forget() {
    absl::MutexLock lock(&mu_);
    known_ = false;
  }
  uint64_t shard_id() {
    absl::MutexLock lock(&mu_);
    return shard_id_;
  }
  // The cores the shard registered with.
  uint32_t cores() {
    absl::MutexLock lock(&mu_);
    return cores_;
  }
  // The for_shard_id of every GetJob so far.
  std::vector<uint64_t> fetched_for() {
    absl::MutexLock lock(&mu_);
    return fetched_for_;
  }
  // Waits until `n` GetJobs were asked for in all.
  bool WaitFetches(size_t n) {
    absl::MutexLock lock(&mu_);
    auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return fetched_for_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&done), kWait);
  }
  // Waits for a heartbeat report that satisfies `pred`.
  bool WaitReport(const std::function<bool(const HeartbeatReport&)>& pred) {
    absl::MutexLock lock(&mu_);
    auto ok = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return beats_ > 0 && pred(last_); };
    return mu_.AwaitWithTimeout(absl::Condition(&ok), kWait);
  }

 private:
  absl::Mutex mu_;
  uint64_t shard_id_ ABSL_GUARDED_BY(mu_) = 0;
  bool known_ ABSL_GUARDED_BY(mu_) = true;
  std::string address_ ABSL_GUARDED_BY(mu_);
  uint32_t cores_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, JobDescription> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, uint64_t> part_epochs_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> released_ ABSL_GUARDED_BY(mu_);
  HeartbeatReport last_ ABSL_GUARDED_BY(mu_);
  uint64_t beats_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> fetched_for_ ABSL_GUARDED_BY(mu_);
  int busy_fetches_ ABSL_GUARDED_BY(mu_) = 0;
  bool assign_once_ ABSL_GUARDED_BY(mu_) = false;
  bool assign_ ABSL_GUARDED_BY(mu_) = true;
  bool fail_fetches_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration fetch_after_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
  std::vector<absl::Time> fetched_at_ ABSL_GUARDED_BY(mu_);
};

// A shard for these tests: a fake coordinator, a small budget, quick
// heartbeats, the data plane on `fabric`.
ShardServerOptions LoopbackShardOptions(std::shared_ptr<transport::LoopbackFabric> fabric) {
  ShardServerOptions o;
  o.coordinator_address = "fake";
  o.memory_limit_bytes = 64 << 20;
  o.heartbeat_interval = absl::Milliseconds(20);
  o.transport.loopback = std::move(fabric);
  o.transport.name = "shard";
  return o;
}

// A worker speaking raw wire requests to the shard.
class Peer {
 public:
  struct Answer {
    wire::Reply reply;
    std::vector<uint8_t> payload;
  };

  Peer(const std::shared_ptr<transport::LoopbackFabric>& fabric, const std::string& shard) {
    transport::WorkerOptions o;
    o.loopback = fabric;
    o.name = "peer";
    worker_ = *transport::Worker::Create(o);
    worker_->SetHandler(wire::kAmReply, [this](transport::IncomingMessage& m) {
      auto r = wire::ParseReply(m.header());
      auto buf = std::make_shared<std::vector<uint8_t>>(m.payload_size());
      const wire::Reply reply = r.ok() ? *r : wire::Reply{};
      m.ReceiveInto(buf->data(), [this, reply, buf](absl::Status) {
        absl::MutexLock lock(&mu_);
        answers_[reply.header.request_id] = Answer{reply, *buf};
      });
    });
    // Several answers in one message (to a batch sent with
    // kRequestBatchReplies): recorded as if each had come alone.
    worker_->SetHandler(wire::kAmReplyBatch, [this](transport::IncomingMessage& m) {
      auto h = wire::ParseReplyBatchHeader(m.header());
      ASSERT_TRUE(h.ok()) << h.status();
      auto buf = std::make_shared<std::vector<uint8_t>>(m.payload_size());
      const uint32_t count = h->count;
      m.ReceiveInto(buf->data(), [this, buf, count](absl::Status s) {
        ASSERT_TRUE(s.ok()) << s;
        auto items = wire::SplitReplyBatch(*buf, count);
        ASSERT_TRUE(items.ok()) << items.status();
        absl::MutexLock lock(&mu_);
        ++reply_batches_;
        for (absl::Span<const uint8_t> item : *items) {
          const wire::Reply reply = *wire::ParseReply(item);
          answers_[reply.header.request_id] = Answer{reply, {}};
        }
      });
    });
    EXPECT_TRUE(worker_->Start().ok());
    ep_ = *worker_->Connect(shard);
  }
  uint64_t reply_batches() {
    absl::MutexLock lock(&mu_);
    return reply_batches_;
  }

  void Post(wire::RequestHeader h, const void* payload = nullptr, size_t bytes = 0) {
    h.num_bytes = h.num_bytes != 0 ? h.num_bytes : bytes;
    worker_->Send(ep_, wire::kAmRequest, wire::AsBytes(h), payload, bytes, [](absl::Status) {});
  }
  // The answer to request `id`, or a reply with UNKNOWN status after kWait.
  Answer Await(uint64_t id, absl::Duration wait = kWait) {
    absl::MutexLock lock(&mu_);
    auto there = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return answers_.count(id) != 0; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&there), wait)) {
      Answer none;
      none.reply.status = absl::UnknownError("no answer");
      return none;
    }
    Answer a = answers_[id];
    answers_.erase(id);
    return a;
  }
  Answer Call(wire::RequestHeader h, const void* payload = nullptr, size_t bytes = 0) {
    Post(h, payload, bytes);
    return Await(h.request_id);
  }

 private:
  std::unique_ptr<transport::Worker> worker_;
  transport::EndpointRef ep_;
  absl::Mutex mu_;
  std::map<uint64_t, Answer> answers_ ABSL_GUARDED_BY(mu_);
  uint64_t reply_batches_ ABSL_GUARDED_BY(mu_) = 0;
};

JobDescription OneChunkJob(uint64_t primary, uint64_t epoch = 1) {
  JobDescription d;
  d.config.job_id = kJob;
  d.config.name = "unit";
  d.config.world_size = kWorld;
  d.config.grad_dtype = DType::kFp32;
  d.config.param_dtype = DType::kFp32;
  d.config.grad_scale = 1.0f / kWorld;
  d.config.hyper.kind = kernels::OptimizerKind::kAdamW;
  d.config.hyper.lr = 1e-2f;
  d.config.hyper.weight_decay = 0.01f;
  d.map.epoch = epoch;
  ChunkPlacement p;
  p.num_elems = kElems;
  p.primary = primary;
  d.map.chunks.push_back(p);
  return d;
}

class ShardServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fabric_ = transport::LoopbackFabric::Create();
    auto link = std::make_unique<FakeLink>();
    link_ = link.get();
    ShardServerOptions o = LoopbackShardOptions(fabric_);
    auto s = ShardServer::StartWithLink(o, std::move(link));
    ASSERT_TRUE(s.ok()) << s.status();
    shard_ = std::move(*s);
  }

  // Loads the job and waits until the shard reports it.
  void Load(const JobDescription& d) {
    link_->SetJob(d);
    ASSERT_TRUE(link_->WaitReport([&](const HeartbeatReport& r) {
      for (const JobReport& j : r.jobs) {
        if (j.job_id == d.config.job_id && j.map_epoch == d.map.epoch) return true;
      }
      return false;
    }));
  }

  // A kBatch's payload: the items' headers, then their payloads (fp32),
  // each push's and init's num_bytes set to its payload's size.
  using BatchItems = std::vector<std::pair<wire::RequestHeader, const std::vector<float>*>>;
  static std::vector<uint8_t> BatchBytes(BatchItems& items) {
    std::vector<uint8_t> bytes;
    for (auto& [h, payload] : items) {
      if (payload != nullptr) h.num_bytes = payload->size() * 4;
      const auto hb = wire::AsBytes(h);
      bytes.insert(bytes.end(), hb.begin(), hb.end());
    }
    for (auto& [h, payload] : items) {
      if (payload == nullptr) continue;
      const auto* p = reinterpret_cast<const uint8_t*>(payload->data());
      bytes.insert(bytes.end(), p, p + payload->size() * 4);
    }
    return bytes;
  }

  wire::RequestHeader Header(wire::Op op, uint64_t step, uint64_t id, uint64_t epoch = 1) {
    wire::RequestHeader h;
    h.op = static_cast<uint16_t>(op);
    h.job_id = kJob;
    h.map_epoch = epoch;
    h.step = step;
    h.dtype = static_cast<uint8_t>(DType::kFp32);
    h.num_bytes = kElems * 4;
    h.request_id = id;
    // What a client sends: the step's lr (here the job's).
    if (op == wire::Op::kPush) h.lr = 1e-2f;
    return h;
  }

  std::shared_ptr<transport::LoopbackFabric> fabric_;
  FakeLink* link_ = nullptr;
  std::unique_ptr<ShardServer> shard_;
};

std::vector<float> Ramp(float scale) {
  std::vector<float> v(kElems);
  for (size_t i = 0; i < kElems; ++i) v[i] = scale * static_cast<float>(i % 97) - 1.0f;
  return v;
}

// Version 2 of the one-chunk job from `init` and both ranks' gradients, by
// the shard's kernel in this process.
std::vector<float> FirstStep(const std::vector<float>& init, const std::vector<float>& g0,
                             const std::vector<float>& g1) {
  std::vector<float> master = init, m(kElems), v(kElems), want(kElems);
  const void* grads[] = {g0.data(), g1.data()};
  kernels::StepInputs in;
  in.grads = absl::MakeConstSpan(grads, 2);
  in.grad_dtype = DType::kFp32;
  in.grad_scale = 1.0f / kWorld;
  in.step = 1;
  EXPECT_TRUE(kernels::FusedStep(OneChunkJob(1).config.hyper, in, kElems,
                                 {master.data(), m.data(), v.data()}, want.data(), DType::kFp32)
                  .ok());
  return want;
}

// A malformed coordinator list is refused before the shard starts anything.
TEST(ShardServerStartTest, ABadCoordinatorListIsAClearError) {
  for (const char* bad : {"a:7070,,b:7070", "a:7070,b", "a:7070,a:7070"}) {
    ShardServerOptions o;
    o.coordinator_address = bad;
    o.tls.plaintext = true;
    o.memory_limit_bytes = 64 << 20;
    auto s = ShardServer::Start(o);
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad << ": " << s.status();
    EXPECT_NE(s.status().message().find("coordinator address"), absl::string_view::npos)
        << s.status();
  }
}

// Nice value of each of this process's threads, by thread id (a thread that
// ends while they are read is left out).
std::map<int, int> ThreadNices() {
  std::map<int, int> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    const int tid = std::stoi(e.path().filename().string());
    errno = 0;
    const int nice = getpriority(PRIO_PROCESS, static_cast<id_t>(tid));
    if (errno == 0) out[tid] = nice;
  }
  return out;
}

int ThreadsAt(int nice) {
  int n = 0;
  for (const auto& [tid, v] : ThreadNices()) n += v == nice ? 1 : 0;
  return n;
}

// --step_nice: what `ps -L -o tid,ni` shows an operator. The step threads
// and the kernel pool's background threads run that much nicer than the
// process; the progress thread, the heartbeats and the caller do not.
TEST(ShardServerStartTest, StepAndKernelThreadsRunNicerThanTheRest) {
  const int base = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
  if (base > 14) GTEST_SKIP() << "this test runs at nice " << base << ": no room below 19";
  const int nicer = base + 5;
  ASSERT_EQ(ThreadsAt(nicer), 0);
  ShardServerOptions o = LoopbackShardOptions(transport::LoopbackFabric::Create());
  o.step_threads = 2;
  o.kernel_threads = 3;  // The step thread that splits a step runs one range.
  o.step_nice = 5;
  auto s = ShardServer::StartWithLink(o, std::make_unique<FakeLink>());
  ASSERT_TRUE(s.ok()) << s.status();
  // Each thread lowers its own priority as it starts.
  const absl::Time deadline = absl::Now() + kWait;
  while (ThreadsAt(nicer) < 4 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(ThreadsAt(nicer), 4);
  int rest = 0;
  for (const auto& [tid, nice] : ThreadNices()) {
    if (nice == nicer) continue;
    EXPECT_EQ(nice, base) << "thread " << tid;
    ++rest;
  }
  EXPECT_GE(rest, 2);  // This thread and the shard's progress thread at least.
  s->reset();
  EXPECT_EQ(ThreadsAt(nicer), 0);
}

// --step_nice below 0, steps first: only the data plane's progress thread
// runs nicer; the step threads and the kernel pool keep the process's
// priority.
TEST(ShardServerStartTest, NegativeStepNiceRunsOnlyTheProgressThreadNicer) {
  const int base = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
  if (base > 14) GTEST_SKIP() << "this test runs at nice " << base << ": no room below 19";
  const int nicer = base + 5;
  ASSERT_EQ(ThreadsAt(nicer), 0);
  ShardServerOptions o = LoopbackShardOptions(transport::LoopbackFabric::Create());
  o.step_threads = 2;
  o.kernel_threads = 3;
  o.step_nice = -5;
  auto s = ShardServer::StartWithLink(o, std::make_unique<FakeLink>());
  ASSERT_TRUE(s.ok()) << s.status();
  const absl::Time deadline = absl::Now() + kWait;
  while (ThreadsAt(nicer) < 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(ThreadsAt(nicer), 1);
  int rest = 0;
  for (const auto& [tid, nice] : ThreadNices()) {
    if (nice == nicer) continue;
    EXPECT_EQ(nice, base) << "thread " << tid;
    ++rest;
  }
  EXPECT_GE(rest, 5);  // This thread, 2 step threads, 2 kernel threads at least.
  s->reset();
  EXPECT_EQ(ThreadsAt(nicer), 0);
}

// A shard pinned to one CPU (taskset, a cpuset, a pod's CPU limit) sizes
// its step and kernel pools and registers its cores by the CPUs it may use,
// not by the machine's: one step thread and no kernel background thread
// here, where the machine's count would give two and one on 2 cores.
TEST(ShardServerStartTest, PoolsAndRegisteredCoresFollowTheCpusItMayUse) {
  if (std::thread::hardware_concurrency() < 2) GTEST_SKIP() << "needs 2 or more cores";
  const int base = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
  if (base > 14) GTEST_SKIP() << "this test runs at nice " << base << ": no room below 19";
  const int nicer = base + 5;
  ASSERT_EQ(ThreadsAt(nicer), 0);
  auto link = std::make_unique<FakeLink>();
  FakeLink* fake = link.get();
  absl::StatusOr<std::unique_ptr<ShardServer>> s = absl::UnknownError("not started");
  // Threads inherit their creator's affinity: start the shard from a thread
  // pinned to one of the CPUs this test may use.
  std::thread starter([&] {
    cpu_set_t mine;
    CPU_ZERO(&mine);
    ASSERT_EQ(sched_getaffinity(0, sizeof(mine), &mine), 0);
    cpu_set_t one;
    CPU_ZERO(&one);
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &mine)) {
        CPU_SET(c, &one);
        break;
      }
    }
    ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
    ShardServerOptions o = LoopbackShardOptions(transport::LoopbackFabric::Create());
    o.step_threads = 0;  // One per core it may use.
    o.kernel_threads = 0;
    o.step_nice = 5;
    s = ShardServer::StartWithLink(o, std::move(link));
  });
  starter.join();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(fake->cores(), 1u);
  // Each pool thread lowers its own priority as it starts: wait for the
  // first, then give a second one (the bug: a pool per machine core) a
  // second to show up.
  absl::Time deadline = absl::Now() + kWait;
  while (ThreadsAt(nicer) < 1 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  deadline = absl::Now() + absl::Seconds(1);
  while (ThreadsAt(nicer) < 2 && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(ThreadsAt(nicer), 1);
  s->reset();
}

TEST_F(ShardServerTest, ServesTheStepTorchWouldComputeAndRefusesBadRequests) {
  Load(OneChunkJob(link_->shard_id()));
  Peer peer(fabric_, shard_->data_address());
  const std::vector<float> init = Ramp(0.01f);
  ASSERT_TRUE(peer.Call(Header(wire::Op::kInit, 1, 1), init.data(), kElems * 4).reply.status.ok());
  // Init only once.
  EXPECT_EQ(peer.Call(Header(wire::Op::kInit, 1, 2), init.data(), kElems * 4).reply.status.code(),
            absl::StatusCode::kAlreadyExists);

  // A pull of version 2 is parked until both workers pushed step 1.
  peer.Post(Header(wire::Op::kPull, 2, 10));
  const std::vector<float> g0 = Ramp(0.002f), g1 = Ramp(-0.003f);
  wire::RequestHeader push = Header(wire::Op::kPush, 1, 20);
  ASSERT_TRUE(peer.Call(push, g0.data(), kElems * 4).reply.status.ok());
  // The same push again is a duplicate, not a second gradient.
  Peer::Answer dup = peer.Call(Header(wire::Op::kPush, 1, 21), g0.data(), kElems * 4);
  EXPECT_TRUE(dup.reply.status.ok());
  EXPECT_NE(dup.reply.header.flags & wire::kReplyDuplicate, 0u);
  // Bad pushes change nothing.
  wire::RequestHeader bad = Header(wire::Op::kPush, 1, 30);
  bad.rank = kWorld;
  EXPECT_EQ(peer.Call(bad, g1.data(), kElems * 4).reply.status.code(),
            absl::StatusCode::kInvalidArgument);
  bad = Header(wire::Op::kPush, 1, 31);
  bad.rank = 1;
  EXPECT_EQ(peer.Call(bad, g1.data(), kElems * 4 - 4).reply.status.code(),
            absl::StatusCode::kInvalidArgument);
  bad = Header(wire::Op::kPush, 2, 32);
  bad.rank = 1;
  EXPECT_EQ(peer.Call(bad, g1.data(), kElems * 4).reply.status.code(),
            absl::StatusCode::kOutOfRange);
  bad = Header(wire::Op::kPush, 1, 33, /*epoch=*/0);
  bad.rank = 1;
  Peer::Answer stale = peer.Call(bad, g1.data(), kElems * 4);
  EXPECT_EQ(stale.reply.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(stale.reply.header.flags & wire::kReplyRefreshMap, 0u);
  bad = Header(wire::Op::kPush, 1, 34);
  bad.job_id = 99;
  EXPECT_EQ(peer.Call(bad, g1.data(), kElems * 4).reply.status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(peer.Await(10, absl::Milliseconds(50)).reply.status.code(),
            absl::StatusCode::kUnknown)
      << "the parked pull must wait for rank 1";

  wire::RequestHeader push1 = Header(wire::Op::kPush, 1, 40);
  push1.rank = 1;
  ASSERT_TRUE(peer.Call(push1, g1.data(), kElems * 4).reply.status.ok());
  Peer::Answer v2 = peer.Await(10);
  ASSERT_TRUE(v2.reply.status.ok()) << v2.reply.status;
  EXPECT_EQ(v2.reply.header.param_version, 2u);
  ASSERT_EQ(v2.payload.size(), kElems * 4);

  // The same step in one process, with the shard's kernel.
  const std::vector<float> want = FirstStep(init, g0, g1);
  EXPECT_EQ(std::memcmp(v2.payload.data(), want.data(), kElems * 4), 0) << "not bitwise";
  EXPECT_EQ(shard_->stats().steps_applied, 1u);
  EXPECT_EQ(shard_->stats().pushes_duplicate, 1u);
}

// Several requests in one message (small chunks batched per shard): each is
// answered with its own id as if it had come alone, in the batch's order;
// a malformed batch is refused whole and changes nothing.
TEST_F(ShardServerTest, ABatchIsHandledAsItsRequestsAndABadBatchChangesNothing) {
  Load(OneChunkJob(link_->shard_id()));
  Peer peer(fabric_, shard_->data_address());
  const std::vector<float> init = Ramp(0.01f);
  const std::vector<float> g0 = Ramp(0.002f), g1 = Ramp(-0.003f);
  auto batch = [&](BatchItems items, uint64_t id) {
    std::vector<uint8_t> bytes = BatchBytes(items);
    wire::RequestHeader b = Header(wire::Op::kBatch, items.size(), id);
    b.num_bytes = bytes.size();
    auto owned = std::make_shared<std::vector<uint8_t>>(std::move(bytes));
    peer.Post(b, owned->data(), owned->size());
    return owned;  // Kept by the caller until the answers are in.
  };
  // Init, a pull of version 2 (parked), both ranks' pushes: one message.
  wire::RequestHeader push1 = Header(wire::Op::kPush, 1, 4);
  push1.rank = 1;
  auto b1 = batch({{Header(wire::Op::kInit, 1, 1), &init},
                   {Header(wire::Op::kPull, 2, 2), nullptr},
                   {Header(wire::Op::kPush, 1, 3), &g0},
                   {push1, &g1}},
                  100);
  for (uint64_t id : {1, 3, 4}) {
    EXPECT_TRUE(peer.Await(id).reply.status.ok()) << "request " << id;
  }
  Peer::Answer v2 = peer.Await(2);
  ASSERT_TRUE(v2.reply.status.ok()) << v2.reply.status;
  ASSERT_EQ(v2.payload.size(), kElems * 4);
  const std::vector<float> want = FirstStep(init, g0, g1);
  EXPECT_EQ(std::memcmp(v2.payload.data(), want.data(), kElems * 4), 0) << "not bitwise";
  EXPECT_EQ(peer.Await(100, absl::Milliseconds(50)).reply.status.code(), absl::StatusCode::kUnknown)
      << "a good batch is answered per request, not as a whole";

  // Bad batches: refused with the batch's id; step 2's pushes are not taken.
  wire::RequestHeader nested = Header(wire::Op::kBatch, 1, 11);
  nested.num_bytes = 0;
  auto b2 = batch({{Header(wire::Op::kPush, 2, 10), &g0}, {nested, nullptr}}, 200);
  Peer::Answer refused = peer.Await(200);
  EXPECT_EQ(refused.reply.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.reply.status.message().find("request 1 of a batch is a batch"),
            std::string::npos)
      << refused.reply.status;
  // Its push hears why too, and was not taken.
  EXPECT_EQ(peer.Await(10).reply.status.code(), absl::StatusCode::kInvalidArgument);
  wire::RequestHeader short_push = Header(wire::Op::kPush, 2, 12);
  auto b3 = batch({{short_push, &g0}}, 300);
  (void)b3;
  wire::RequestHeader wrong = Header(wire::Op::kBatch, 2, 301);  // Says 2, carries 1.
  std::vector<uint8_t> one(wire::AsBytes(short_push).begin(), wire::AsBytes(short_push).end());
  wrong.num_bytes = one.size();
  EXPECT_EQ(peer.Call(wrong, one.data(), one.size()).reply.status.code(),
            absl::StatusCode::kInvalidArgument);
  // b3 was well formed: its push is taken and answered; the refused
  // batches took nothing.
  EXPECT_TRUE(peer.Await(12).reply.status.ok());
  EXPECT_EQ(shard_->stats().steps_applied, 1u);
  // Its sender did not ask for reply batches (kRequestBatchReplies): it
  // got none.
  EXPECT_EQ(peer.reply_batches(), 0u);
  EXPECT_EQ(shard_->stats().reply_batches, 0u);
}

// A batch whose sender takes reply batches: the answers without payload
// that its requests get while it is handled (an init's, two pushes', a
// refusal with its message) come back as one message; a pull's version,
// which has a payload, on its own.
TEST_F(ShardServerTest, ABatchsAcksComeBackInOneMessageWhenItsSenderTakesThem) {
  Load(OneChunkJob(link_->shard_id()));
  Peer peer(fabric_, shard_->data_address());
  const std::vector<float> init = Ramp(0.01f);
  const std::vector<float> g0 = Ramp(0.002f), g1 = Ramp(-0.003f);
  wire::RequestHeader push1 = Header(wire::Op::kPush, 1, 4);
  push1.rank = 1;
  wire::RequestHeader unknown = Header(wire::Op::kPull, 1, 5);
  unknown.tensor = 99;
  BatchItems items = {{Header(wire::Op::kInit, 1, 1), &init},
                      {Header(wire::Op::kPull, 1, 2), nullptr},
                      {Header(wire::Op::kPush, 1, 3), &g0},
                      {push1, &g1},
                      {unknown, nullptr}};
  const std::vector<uint8_t> bytes = BatchBytes(items);
  wire::RequestHeader b = Header(wire::Op::kBatch, items.size(), 1);
  b.num_bytes = bytes.size();
  b.flags = wire::kRequestBatchReplies;
  peer.Post(b, bytes.data(), bytes.size());
  for (uint64_t id : {1, 3, 4}) {
    EXPECT_TRUE(peer.Await(id).reply.status.ok()) << "request " << id;
  }
  Peer::Answer refused = peer.Await(5);
  EXPECT_FALSE(refused.reply.status.ok());
  EXPECT_NE(refused.reply.status.message().find("99"), std::string::npos) << refused.reply.status;
  Peer::Answer v1 = peer.Await(2);
  ASSERT_TRUE(v1.reply.status.ok()) << v1.reply.status;
  EXPECT_EQ(v1.payload.size(), kElems * 4);
  EXPECT_EQ(peer.reply_batches(), 1u);
  EXPECT_EQ(shard_->stats().reply_batches, 1u);
  EXPECT_EQ(shard_->stats().replies_batched, 4u);
}

// A commit round's acks leave the step threads (after each chunk's reduce).
// A step thread holds those whose pushes said they take reply batches and
// sends them together when its queue runs dry; the others go alone.
TEST_F(ShardServerTest, AStepThreadsAcksComeBackTogetherToSendersThatTakeThem) {
  // One step thread, held while the pushes land, and a hold longer than the
  // test: what is queued behind the hold runs in one go.
  shard_.reset();
  auto link = std::make_unique<FakeLink>();
  link_ = link.get();
  ShardServerOptions o = LoopbackShardOptions(fabric_);
  o.step_threads = 1;
  o.step_reply_hold = absl::Seconds(600);
  auto started = ShardServer::StartWithLink(o, std::move(link));
  ASSERT_TRUE(started.ok()) << started.status();
  shard_ = std::move(*started);

  constexpr uint32_t kChunks = 8;
  JobDescription d = OneChunkJob(link_->shard_id());
  d.config.world_size = 1;
  d.config.grad_scale = 1.0f;
  d.config.commit_round = true;
  d.map.chunks.clear();
  for (uint32_t c = 0; c < kChunks; ++c) {
    ChunkPlacement p;
    p.chunk = c;
    p.offset_elems = c * kElems;
    p.num_elems = kElems;
    p.primary = link_->shard_id();
    d.map.chunks.push_back(p);
  }
  Load(d);
  Peer peer(fabric_, shard_->data_address());
  const std::vector<float> init = Ramp(0.01f), g = Ramp(0.002f);
  for (uint32_t c = 0; c < kChunks; ++c) {
    wire::RequestHeader h = Header(wire::Op::kInit, 1, 100 + c);
    h.chunk = c;
    ASSERT_TRUE(peer.Call(h, init.data(), kElems * 4).reply.status.ok()) << "chunk " << c;
  }
  std::function<void()> release = shard_->HoldStepThreadsForTest();
  // Chunks 0-3 pushed by a sender that takes reply batches, 4-7 by one that
  // does not (an older client).
  BatchItems items;
  for (uint32_t c = 0; c < kChunks; ++c) {
    wire::RequestHeader h = Header(wire::Op::kPush, 1, 200 + c);
    h.chunk = c;
    h.rank = 0;
    if (c < 4) h.flags = wire::kRequestBatchReplies;
    items.push_back({h, &g});
  }
  const std::vector<uint8_t> bytes = BatchBytes(items);
  wire::RequestHeader b = Header(wire::Op::kBatch, items.size(), 200);
  b.num_bytes = bytes.size();
  b.flags = wire::kRequestBatchReplies;
  peer.Post(b, bytes.data(), bytes.size());
  const absl::Time deadline = absl::Now() + kWait;
  while (shard_->stats().pushes_received < kChunks && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(2));
  }
  ASSERT_EQ(shard_->stats().pushes_received, kChunks);
  // Nothing is answered before the reduce.
  EXPECT_EQ(peer.reply_batches(), 0u);
  release();
  for (uint32_t c = 0; c < kChunks; ++c) {
    Peer::Answer a = peer.Await(200 + c);
    EXPECT_TRUE(a.reply.status.ok()) << "chunk " << c << ": " << a.reply.status;
    // Each carries its chunk's partial (the round's norm).
    EXPECT_NE(a.reply.header.flags & wire::kReplyPartial, 0u) << "chunk " << c;
  }
  EXPECT_EQ(peer.reply_batches(), 1u);
  EXPECT_EQ(shard_->stats().reply_batches, 1u);
  EXPECT_EQ(shard_->stats().replies_batched, 4u);
}

// Found by //tests/fuzz:shard_requests under ASan: items' payload counts
// that wrap around 2^64 passed the batch's total check, and the first
// push read past the end of the batch.
TEST_F(ShardServerTest, BatchWhosePayloadCountsWrapAroundIsRefused) {
  Load(OneChunkJob(link_->shard_id()));
  Peer peer(fabric_, shard_->data_address());
  const std::vector<float> init = Ramp(0.01f);
  ASSERT_TRUE(peer.Call(Header(wire::Op::kInit, 1, 1), init.data(), kElems * 4).reply.status.ok());
  // Two pushes whose counts sum to 0 mod 2^64, and no payload at all.
  wire::RequestHeader p0 = Header(wire::Op::kPush, 1, 2);
  wire::RequestHeader p1 = Header(wire::Op::kPush, 1, 3);
  p1.rank = 1;
  p1.num_bytes = 0 - p0.num_bytes;
  std::vector<uint8_t> bytes(wire::AsBytes(p0).begin(), wire::AsBytes(p0).end());
  bytes.insert(bytes.end(), wire::AsBytes(p1).begin(), wire::AsBytes(p1).end());
  wire::RequestHeader b = Header(wire::Op::kBatch, 2, 2);
  b.num_bytes = bytes.size();
  Peer::Answer refused = peer.Call(b, bytes.data(), bytes.size());
  EXPECT_EQ(refused.reply.status.code(), absl::StatusCode::kInvalidArgument) << refused.reply.status;
  EXPECT_EQ(shard_->stats().pushes_received, 0u);
}

TEST_F(ShardServerTest, DeletedJobGivesEveryByteBackAndAnswersItsParkedPulls) {
  const uint64_t baseline = shard_->stats().memory_used_bytes;
  Load(OneChunkJob(link_->shard_id()));
  EXPECT_GT(shard_->stats().memory_used_bytes, baseline);
  Peer peer(fabric_, shard_->data_address());
  const std::vector<float> init = Ramp(0.01f);
  ASSERT_TRUE(peer.Call(Header(wire::Op::kInit, 1, 1), init.data(), kElems * 4).reply.status.ok());
  peer.Post(Header(wire::Op::kPull, 2, 2));  // Parked: nobody pushes.
  link_->Delete(kJob);
  Peer::Answer parked = peer.Await(2);
  EXPECT_EQ(parked.reply.status.code(), absl::StatusCode::kNotFound) << parked.reply.status;
  ASSERT_TRUE(link_->WaitReport([](const HeartbeatReport& r) { return r.jobs.empty(); }));
  EXPECT_EQ(shard_->stats().memory_used_bytes, baseline);
  EXPECT_EQ(shard_->stats().jobs, 0u);
  EXPECT_EQ(peer.Call(Header(wire::Op::kPull, 1, 3)).reply.status.code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ShardServerTest, ChunkMovedAwayIsFreedAndItsPullsAskForTheNewMap) {
  const uint64_t baseline = shard_->stats().memory_used_bytes;
  Load(OneChunkJob(link_->shard_id()));
  Peer peer(fabric_, shard_->data_address());
  const std::vector<float> init = Ramp(0.01f);
  ASSERT_TRUE(peer.Call(Header(wire::Op::kInit, 1, 1), init.data(), kElems * 4).reply.status.ok());
  peer.Post(Header(wire::Op::kPull, 2, 2));
  // Epoch 2 places the chunk on shard 77.
  Load(OneChunkJob(77, /*epoch=*/2));
  Peer::Answer parked = peer.Await(2);
  EXPECT_EQ(parked.reply.status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(parked.reply.header.flags & wire::kReplyRefreshMap, 0u);
  EXPECT_EQ(shard_->stats().memory_used_bytes, baseline);
  EXPECT_EQ(shard_->stats().chunks_owned, 0u);
  // A request under the new map for a chunk that is not here: unknown.
  EXPECT_EQ(peer.Call(Header(wire::Op::kPull, 1, 3, /*epoch=*/2)).reply.status.code(),
            absl::StatusCode::kNotFound);
}

// The coordinator sends a shard only its part of the map: a shard all of
// whose chunks moved away gets a map with no chunk at all at the new epoch.
TEST_F(ShardServerTest, AsksForItsOwnPartOfTheMapAndLetsGoUnderAnEmptyPart) {
  const uint64_t baseline = shard_->stats().memory_used_bytes;
  const uint64_t me = link_->shard_id();
  Load(OneChunkJob(me));
  EXPECT_EQ(shard_->stats().chunks_owned, 1u);
  Peer peer(fabric_, shard_->data_address());
  const std::vector<float> init = Ramp(0.01f);
  ASSERT_TRUE(peer.Call(Header(wire::Op::kInit, 1, 1), init.data(), kElems * 4).reply.status.ok());
  JobDescription moved = OneChunkJob(me, /*epoch=*/2);
  moved.map.chunks.clear();
  Load(moved);
  EXPECT_EQ(shard_->stats().chunks_owned, 0u);
  EXPECT_EQ(shard_->stats().memory_used_bytes, baseline);
  // A request under the new map for the chunk: not here.
  EXPECT_EQ(peer.Call(Header(wire::Op::kPull, 1, 2, /*epoch=*/2)).reply.status.code(),
            absl::StatusCode::kNotFound);
  const std::vector<uint64_t> asked = link_->fetched_for();
  ASSERT_FALSE(asked.empty());
  for (uint64_t id : asked) EXPECT_EQ(id, me);
}

// A new epoch that left this shard's part as it was (the heartbeat's
// part_epoch is at or before the loaded epoch: another shard's chunks
// moved) is taken without fetching the map, and requests are served under
// it and fenced under the old one; an epoch that changed the part, or a
// part_epoch not known (0), is fetched.
TEST_F(ShardServerTest, ANewEpochThatLeftThePartAsItWasIsTakenWithoutAFetch) {
  const uint64_t me = link_->shard_id();
  Load(OneChunkJob(me));
  Peer peer(fabric_, shard_->data_address());
  const std::vector<float> init = Ramp(0.01f);
  ASSERT_TRUE(peer.Call(Header(wire::Op::kInit, 1, 1), init.data(), kElems * 4).reply.status.ok());

  // Every fetch fails meanwhile: the shard reaches epoch 2 without one.
  link_->FailFetches(true);
  link_->SetPartEpoch(kJob, 1);
  Load(OneChunkJob(me, /*epoch=*/2));
  link_->FailFetches(false);
  EXPECT_EQ(shard_->stats().chunks_owned, 1u);
  Peer::Answer pulled = peer.Call(Header(wire::Op::kPull, 1, 2, /*epoch=*/2));
  ASSERT_TRUE(pulled.reply.status.ok()) << pulled.reply.status;
  ASSERT_EQ(pulled.payload.size(), kElems * 4);
  EXPECT_EQ(std::memcmp(pulled.payload.data(), init.data(), kElems * 4), 0);
  EXPECT_EQ(peer.Call(Header(wire::Op::kPull, 1, 3, /*epoch=*/1)).reply.status.code(),
            absl::StatusCode::kFailedPrecondition);

  // A changed part, and a part of unknown age, are fetched: with fetches
  // failing, the shard stays at epoch 2.
  for (uint64_t part_epoch : {uint64_t{3}, uint64_t{0}}) {
    link_->FailFetches(true);
    link_->SetPartEpoch(kJob, part_epoch);
    link_->SetJob(OneChunkJob(me, /*epoch=*/3));
    const size_t fetched = link_->fetched_for().size();
    ASSERT_TRUE(link_->WaitFetches(fetched + 1)) << "part_epoch " << part_epoch;
    EXPECT_TRUE(link_->WaitReport([](const HeartbeatReport& r) {
      return r.jobs.size() == 1 && r.jobs[0].map_epoch == 2;
    })) << "part_epoch " << part_epoch;
    link_->FailFetches(false);
  }
  Load(OneChunkJob(me, /*epoch=*/3));
}

// A heartbeat reply that gives the shard a later slot for its fetch (the
// coordinator's pacing of a new job over many shards): the shard fetches
// no sooner than that, and loads the job then.
TEST_F(ShardServerTest, AFetchWaitsForTheSlotTheCoordinatorGave) {
  link_->SetFetchAfter(absl::Milliseconds(400));
  const absl::Time assigned = absl::Now();
  Load(OneChunkJob(link_->shard_id()));
  const std::vector<absl::Time> at = link_->fetched_at();
  ASSERT_FALSE(at.empty());
  EXPECT_GE(at.front() - assigned, absl::Milliseconds(400));
  EXPECT_EQ(shard_->stats().chunks_owned, 1u);
}

// A coordinator busy with a fetch storm refuses the shard's first fetches
// (RESOURCE_EXHAUSTED), and assigns the job in one heartbeat only: the
// shard asks again by itself, after its backoff, and loads the job.
TEST_F(ShardServerTest, AFetchRefusedAsBusyIsTriedAgainByTheShard) {
  link_->RefuseFetches(3, /*once=*/true);
  Load(OneChunkJob(link_->shard_id()));
  EXPECT_EQ(link_->fetched_for().size(), 4u);
}

TEST_F(ShardServerTest, ForgottenShardDropsEverythingAndRegistersAgain) {
  const uint64_t baseline = shard_->stats().memory_used_bytes;
  const uint64_t first_id = link_->shard_id();
  Load(OneChunkJob(first_id));
  EXPECT_GT(shard_->stats().memory_used_bytes, baseline);
  link_->Forget();
  ASSERT_TRUE(link_->WaitReport([&](const HeartbeatReport& r) { return r.shard_id != first_id; }));
  EXPECT_EQ(shard_->stats().memory_used_bytes, baseline);
  EXPECT_NE(shard_->shard_id(), first_id);
}

// A shard declared down drops its jobs; a worker that still has the map
// placing a chunk there is told to fetch a newer map (the job moved on),
// not "unknown job", which would end its step. A job it never had is
// still unknown.
TEST_F(ShardServerTest, AJobDroppedWhenDeclaredDownSendsItsRequestsBackToTheMap) {
  const uint64_t first_id = link_->shard_id();
  Load(OneChunkJob(first_id));
  Peer peer(fabric_, shard_->data_address());
  const std::vector<float> init = Ramp(0.01f);
  ASSERT_TRUE(peer.Call(Header(wire::Op::kInit, 1, 1), init.data(), kElems * 4).reply.status.ok());
  link_->Unassign(kJob);
  link_->Forget();
  ASSERT_TRUE(link_->WaitReport([&](const HeartbeatReport& r) { return r.shard_id != first_id; }));
  const Peer::Answer moved = peer.Call(Header(wire::Op::kPull, 1, 2));
  EXPECT_EQ(moved.reply.status.code(), absl::StatusCode::kFailedPrecondition) << moved.reply.status;
  EXPECT_NE(moved.reply.header.flags & wire::kReplyRefreshMap, 0u);
  wire::RequestHeader other = Header(wire::Op::kPull, 1, 3);
  other.job_id = kJob + 1;
  EXPECT_EQ(peer.Call(other).reply.status.code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace server
}  // namespace optimus
