// End-to-end: a real coordinator (gRPC on localhost), two real shard servers
// and two worker clients in this process (tests/harness), each case once
// over the in-process loopback transport and once over UCX on loopback.
// Checks the training result against a single-process reference and that
// every kind of bad request is refused with a clear error and changes nothing.
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "client/client.h"
#include "common/dtype.h"
#include "common/http_server.h"
#include "common/wire.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/optimus.grpc.pb.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"
#include "transport/transport.h"

namespace optimus {
namespace {

using client::Client;
using client::JobDef;
using harness::Cluster;
using harness::TransportKind;

constexpr uint32_t kWorkers = 2;
constexpr absl::Duration kWait = absl::Seconds(20);

class ClusterTest : public ::testing::TestWithParam<TransportKind> {
 protected:
  void SetUp() override {
    harness::ClusterOptions o;
    o.transport = GetParam();
    o.num_shards = 2;
    o.num_workers = kWorkers;
    o.kernel_threads = KernelThreads();
    o.heartbeat_interval = absl::Milliseconds(100);
    o.sweep_interval = absl::Milliseconds(200);
    o.serve_metrics = true;
    o.wait = kWait;
    ASSERT_OK_AND_ASSIGN(cluster_, Cluster::Start(o));
    ASSERT_OK(cluster_->ConnectWorkers());
  }

  // Threads each shard splits one chunk's step over.
  virtual int KernelThreads() const { return 1; }

  Client* worker(uint32_t r) { return cluster_->worker(r); }

  // Two tensors; small chunks so both spread over both shards.
  JobDef MakeJob(const std::string& name, DType grad, DType param) {
    JobDef def = harness::SmallJob(name, kWorkers, /*max_chunk_bytes=*/64 * 1024);
    def.tensors = {{"weight", {300, 257}}, {"bias", {37}}};
    def.grad_dtype = grad;
    def.param_dtype = param;
    return def;
  }

  // Tensor t at `version`, as fp32, through rank r; empty (and a failure)
  // if the pull fails.
  std::vector<float> PullFp32(uint32_t r, uint32_t t, uint64_t version) {
    auto got = cluster_->PullFp32(t, version, r);
    EXPECT_TRUE(got.ok()) << got.status();
    return got.ok() ? *got : std::vector<float>();
  }

  std::vector<float> Reference(const JobDef& def, uint32_t t, uint64_t steps) {
    auto want = harness::ReferenceParams(def, t, steps);
    EXPECT_TRUE(want.ok()) << want.status();
    return want.ok() ? *want : std::vector<float>();
  }

  std::unique_ptr<Cluster> cluster_;
};

std::string ParamName(const ::testing::TestParamInfo<TransportKind>& info) {
  return harness::TransportName(info.param);
}

TEST_P(ClusterTest, TwentyAdamWStepsMatchSingleProcessReference) {
  JobDef def = MakeJob("adamw-fp32", DType::kFp32, DType::kFp32);
  ASSERT_OK(cluster_->CreateJob(def));
  // The map spreads the job over both shards.
  EXPECT_GT(worker(0)->tensors()[0].num_chunks, 2u);
  ASSERT_OK(cluster_->Train(1, 20));
  for (uint32_t t = 0; t < 2; ++t) {
    std::vector<float> got = PullFp32(1, t, 21);
    std::vector<float> want = Reference(def, t, 20);
    ASSERT_EQ(got.size(), want.size());
    // Same summation order, same elementwise math: bitwise equal.
    EXPECT_EQ(harness::BitMismatches(got, want), 0u) << "tensor " << t;
    // And training moved the parameters.
    EXPECT_NE(got[5], harness::InitialValue(t, 5));
  }
  for (const auto& s : cluster_->ShardStats()) EXPECT_GT(s.steps_applied, 0u);
}

// Shards that split each chunk's step over a 2-thread pool, running Lion:
// the result must still be bitwise the single-threaded reference.
class ClusterWithKernelPoolTest : public ClusterTest {
 protected:
  int KernelThreads() const override { return 2; }
};

TEST_P(ClusterWithKernelPoolTest, LionSplitOverThreadsMatchesReferenceBitwise) {
  JobDef def = MakeJob("lion-pool", DType::kBf16, DType::kFp32);
  def.optimizer.kind = client::Optimizer::kLion;
  def.optimizer.lr = 1e-3f;
  def.optimizer.beta1 = 0.0f;  // 0: the coordinator fills Lion's defaults
  def.optimizer.beta2 = 0.0f;
  def.max_chunk_bytes = 256 * 1024;  // 65536 elements: large enough to split
  ASSERT_OK(cluster_->CreateJob(def));
  ASSERT_OK(cluster_->Train(1, 12));
  for (uint32_t t = 0; t < 2; ++t) {
    std::vector<float> got = PullFp32(0, t, 13);
    std::vector<float> want = Reference(def, t, 12);
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(harness::BitMismatches(got, want), 0u) << "tensor " << t;
    EXPECT_NE(got[5], harness::InitialValue(t, 5));
  }
}

TEST_P(ClusterTest, Bf16GradientsAndParametersMatchReference) {
  JobDef def = MakeJob("adamw-bf16", DType::kBf16, DType::kBf16);
  ASSERT_OK(cluster_->CreateJob(def));
  ASSERT_OK(cluster_->Train(1, 20));
  for (uint32_t t = 0; t < 2; ++t) {
    std::vector<float> got = PullFp32(0, t, 21);
    std::vector<float> want = Reference(def, t, 20);
    EXPECT_EQ(harness::BitMismatches(got, want), 0u) << "tensor " << t;
  }
}

// Sends raw requests to a shard and collects the replies.
class RawPeer {
 public:
  RawPeer(const transport::WorkerOptions& options, const std::string& shard_address) {
    auto w = transport::Worker::Create(options);
    EXPECT_TRUE(w.ok());
    worker_ = std::move(*w);
    worker_->SetHandler(wire::kAmReply, [this](transport::IncomingMessage& m) {
      auto r = wire::ParseReply(m.header());
      absl::MutexLock lock(&mu_);
      replies_.push_back(r.ok() ? *r : wire::Reply{});
    });
    EXPECT_TRUE(worker_->Start().ok());
    auto ep = worker_->Connect(shard_address);
    EXPECT_TRUE(ep.ok());
    ep_ = *ep;
  }

  // Sends header bytes + payload and waits for the one reply.
  wire::Reply Send(absl::Span<const uint8_t> header, const std::vector<uint8_t>& payload) {
    size_t before;
    {
      absl::MutexLock lock(&mu_);
      before = replies_.size();
    }
    worker_->Send(ep_, wire::kAmRequest, header, payload.empty() ? nullptr : payload.data(),
                  payload.size(), [](absl::Status) {});
    absl::MutexLock lock(&mu_);
    auto arrived = [&]() { return replies_.size() > before; };
    mu_.AwaitWithTimeout(absl::Condition(&arrived), kWait);
    EXPECT_GT(replies_.size(), before) << "no reply";
    return replies_.size() > before ? replies_[before] : wire::Reply{};
  }

 private:
  std::unique_ptr<transport::Worker> worker_;
  transport::EndpointRef ep_;
  absl::Mutex mu_;
  std::vector<wire::Reply> replies_ ABSL_GUARDED_BY(mu_);
};

TEST_P(ClusterTest, BadRequestsAreRefusedAndChangeNothing) {
  JobDef def = MakeJob("bad-input", DType::kFp32, DType::kFp32);
  // Without the clipping round a push is answered as soon as it lands, so
  // one thread can push for rank 0 alone below (with the round, the answer
  // waits for every rank's push of the chunk; tests/torch_compare and
  // clip_test cover that path).
  def.skip_nonfinite = false;
  ASSERT_OK(cluster_->CreateJob(def));
  ASSERT_OK(cluster_->Train(1, 3));  // Chunks are at version 4, waiting for step 4.
  const std::vector<float> before_w = PullFp32(0, 0, 4);
  const std::vector<float> before_b = PullFp32(0, 1, 4);

  Client* c0 = worker(0);
  const size_t nb = c0->tensors()[1].num_elems;
  std::vector<uint8_t> grad(nb * 4, 0);

  // Stale step through the client API: step 3 is applied.
  {
    auto t = c0->Push(1, 3, grad.data(), nb);
    ASSERT_TRUE(t.ok());
    absl::Status s = c0->Wait(*t, kWait);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("already applied"), absl::string_view::npos) << s;
  }
  // More than one ahead.
  {
    auto t = c0->Push(1, 6, grad.data(), nb);
    ASSERT_TRUE(t.ok());
    absl::Status s = c0->Wait(*t, kWait);
    EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
  }
  // A version no longer held, and one too far ahead.
  {
    std::vector<uint8_t> dst(nb * 4);
    auto t = c0->Pull(1, 1, dst.data(), nb);
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(c0->Wait(*t, kWait).code(), absl::StatusCode::kFailedPrecondition);
    t = c0->Pull(1, 9, dst.data(), nb);
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(c0->Wait(*t, kWait).code(), absl::StatusCode::kOutOfRange);
  }
  // Wrong element count is caught by the client before anything is sent.
  EXPECT_EQ(c0->Push(1, 4, grad.data(), nb - 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c0->Push(7, 4, grad.data(), nb).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c0->Wait(123456, absl::Milliseconds(1)).code(), absl::StatusCode::kNotFound);

  // Raw requests straight to each shard, bypassing the client's checks.
  auto stub = v1::Coordinator::NewStub(
      grpc::CreateChannel(cluster_->coordinator_address(), grpc::InsecureChannelCredentials()));
  v1::JoinJobRequest jreq;
  jreq.set_job_name(def.name);
  jreq.set_rank(0);
  jreq.set_world_size(kWorkers);
  v1::JoinJobResponse job;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub->JoinJob(&ctx, jreq, &job).ok());
  }
  ASSERT_EQ(job.map().shards_size(), 2);
  int bias_refusals = 0;
  for (const auto& shard : job.map().shards()) {
    RawPeer peer(cluster_->TransportOptions("raw"), shard.data_address());
    wire::RequestHeader h;
    h.op = static_cast<uint16_t>(wire::Op::kPush);
    h.job_id = job.job_id();
    h.map_epoch = job.map().epoch();
    h.tensor = 1;
    h.chunk = 0;
    h.step = 4;
    h.rank = 0;
    h.dtype = static_cast<uint8_t>(DType::kFp32);
    h.num_bytes = nb * 4;
    h.request_id = 77;

    // Malformed header (too short): refused, request id unknown (0).
    wire::Reply r = peer.Send(wire::AsBytes(h).subspan(0, 20), grad);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;

    wire::RequestHeader bad = h;
    bad.job_id = 999;
    r = peer.Send(wire::AsBytes(bad), grad);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kNotFound) << r.status;
    EXPECT_NE(r.status.message().find("unknown job"), absl::string_view::npos);
    EXPECT_EQ(r.header.request_id, 77u);

    bad = h;
    bad.tensor = 5;
    r = peer.Send(wire::AsBytes(bad), grad);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kNotFound) << r.status;

    // An older map: refused as stale, and the sender is told to refresh.
    bad = h;
    bad.map_epoch = h.map_epoch - 1;
    r = peer.Send(wire::AsBytes(bad), grad);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
    EXPECT_NE(r.status.message().find("stale shard map"), absl::string_view::npos) << r.status;
    EXPECT_EQ(r.header.flags & wire::kReplyRefreshMap, wire::kReplyRefreshMap);

    // A map newer than the shard's (which the coordinator never published):
    // retryable, the shard refreshes its map.
    bad = h;
    bad.map_epoch = h.map_epoch + 5;
    r = peer.Send(wire::AsBytes(bad), grad);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kUnavailable) << r.status;
    EXPECT_NE(r.status.message().find("has not loaded map epoch"), absl::string_view::npos)
        << r.status;

    // Only the shard holding the bias chunk can judge the payload itself.
    r = peer.Send(wire::AsBytes(h), std::vector<uint8_t>(nb * 4 - 4));
    if (r.status.code() == absl::StatusCode::kNotFound) continue;  // Not this shard.
    ++bias_refusals;
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
    EXPECT_NE(r.status.message().find("bytes"), absl::string_view::npos) << r.status;

    bad = h;
    bad.dtype = static_cast<uint8_t>(DType::kBf16);
    bad.num_bytes = nb * 2;
    r = peer.Send(wire::AsBytes(bad), std::vector<uint8_t>(nb * 2));
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
    EXPECT_NE(r.status.message().find("dtype"), absl::string_view::npos) << r.status;

    bad = h;
    bad.rank = 9;
    r = peer.Send(wire::AsBytes(bad), grad);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;

    // A forged replication forward (from "shard 999") to the primary of an
    // unreplicated chunk: refused as fenced, nothing applied.
    bad = h;
    bad.op = static_cast<uint16_t>(wire::Op::kReplicate);
    bad.rank = 999;
    bad.flags = wire::kReplicateSum;
    r = peer.Send(wire::AsBytes(bad), grad);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kFailedPrecondition) << r.status;
    EXPECT_NE(r.status.message().find("is not its backup"), absl::string_view::npos) << r.status;
    EXPECT_EQ(r.header.flags & wire::kReplyFenced, wire::kReplyFenced);
  }
  EXPECT_EQ(bias_refusals, 1);

  // Nothing changed: version 4 is intact and still the latest.
  EXPECT_EQ(PullFp32(1, 0, 4), before_w);
  EXPECT_EQ(PullFp32(1, 1, 4), before_b);

  // A duplicate push is dropped, not added twice: rank 0 pushes step 4 twice.
  {
    Client* c = worker(0);
    std::vector<uint8_t> g = cluster_->GradientBytes(0, 1, before_b, 4);
    for (int i = 0; i < 2; ++i) {
      auto t = c->Push(1, 4, g.data(), nb);
      ASSERT_TRUE(t.ok());
      EXPECT_TRUE(c->Wait(*t, kWait).ok());
    }
  }
  // The servers kept running: the rest of step 4 and steps 5-6 complete and
  // the result equals the reference that never saw the bad requests.
  {
    Client* c = worker(0);
    std::vector<uint8_t> g = cluster_->GradientBytes(0, 0, before_w, 4);
    auto t = c->Push(0, 4, g.data(), before_w.size());
    ASSERT_TRUE(t.ok());
    ASSERT_TRUE(c->Wait(*t, kWait).ok());
  }
  absl::Status rank1_result;
  std::thread rank1([this, &rank1_result] { rank1_result = cluster_->RunWorker(1, 4, 6); });
  // Rank 0 already pushed step 4; it continues from 5.
  EXPECT_OK(cluster_->RunWorker(0, 5, 6));
  rank1.join();
  EXPECT_OK(rank1_result);
  for (uint32_t t = 0; t < 2; ++t) {
    EXPECT_EQ(PullFp32(0, t, 7), Reference(def, t, 6)) << "tensor " << t;
  }
  // The shards counted what they refused and the one dropped duplicate.
  uint64_t rejected = 0, duplicates = 0;
  for (const auto& s : cluster_->ShardStats()) {
    rejected += s.requests_rejected;
    duplicates += s.pushes_duplicate;
  }
  EXPECT_GE(rejected, 12u);
  EXPECT_EQ(duplicates, 1u);
}

// Sum of the samples of `name` (any labels) whose label text contains `match`.
double MetricSum(const std::string& text, const std::string& name, const std::string& match = "") {
  double sum = 0;
  bool found = false;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.empty() || line[0] == '#') continue;
    const size_t name_end = line.find_first_of("{ ");
    if (line.substr(0, name_end) != name) continue;
    if (!match.empty() && line.find(match) == std::string::npos) continue;
    sum += std::stod(line.substr(line.rfind(' ') + 1));
    found = true;
  }
  EXPECT_TRUE(found) << "no sample of " << name << " " << match << " in:\n" << text;
  return sum;
}

std::string Scrape(int port) {
  auto body = HttpGet(port, "/metrics");
  EXPECT_TRUE(body.ok()) << body.status();
  return body.ok() ? *body : "";
}

TEST_P(ClusterTest, MetricsMoveAsTrainingRuns) {
  JobDef def = MakeJob("metrics", DType::kBf16, DType::kBf16);
  ASSERT_OK(cluster_->CreateJob(def));
  ASSERT_OK(cluster_->Train(1, 2));
  // Train returns once step 2 is pushed; a chunk publishes it a little
  // later (after the clipping round's commit): wait for version 3 before
  // counting steps.
  for (uint32_t t = 0; t < def.tensors.size(); ++t) ASSERT_OK(cluster_->PullFp32(t, 3).status());
  auto total = [&](const std::string& name, const std::string& match = "") {
    double sum = 0;
    for (size_t i = 0; i < cluster_->num_shards(); ++i) {
      sum += MetricSum(Scrape(cluster_->shard(i)->metrics_port()), name, match);
    }
    return sum;
  };
  const double steps1 = total("optimus_shard_steps_total");
  const double pushed1 = total("optimus_shard_pushed_bytes_total");
  const double pulled1 = total("optimus_shard_pulled_bytes_total");
  const double params1 = total("optimus_shard_optimizer_params_total");
  const double hist1 = total("optimus_shard_step_seconds_count");
  const double stale1 = total("optimus_shard_errors_total", "FAILED_PRECONDITION");
  EXPECT_GT(steps1, 0);
  EXPECT_EQ(total("optimus_shard_memory_limit_bytes"), 2.0 * (256 << 20));
  EXPECT_GT(total("optimus_shard_memory_used_bytes"), 0);
  EXPECT_EQ(total("optimus_shard_chunks_owned"), 6);
  ASSERT_OK(cluster_->Train(3, 5));
  for (uint32_t t = 0; t < def.tensors.size(); ++t) ASSERT_OK(cluster_->PullFp32(t, 6).status());
  // A stale push shows up as an error of its kind.
  {
    std::vector<uint8_t> g(37 * 2);
    auto t = worker(0)->Push(1, 2, g.data(), 37);
    ASSERT_TRUE(t.ok());
    EXPECT_EQ(worker(0)->Wait(*t, kWait).code(), absl::StatusCode::kFailedPrecondition);
  }
  // 3 more steps of 6 chunks, and the bytes that moved for them.
  EXPECT_EQ(total("optimus_shard_steps_total") - steps1, 3 * 6);
  EXPECT_EQ(total("optimus_shard_pushed_bytes_total") - pushed1, 3.0 * 2 * 77137 * 2);
  EXPECT_GE(total("optimus_shard_pulled_bytes_total") - pulled1, 3.0 * 2 * 77137 * 2);
  EXPECT_EQ(total("optimus_shard_optimizer_params_total") - params1, 3.0 * 77137);
  EXPECT_EQ(total("optimus_shard_step_seconds_count") - hist1, 3 * 6);
  EXPECT_EQ(total("optimus_shard_errors_total", "FAILED_PRECONDITION") - stale1, 1);
  for (size_t i = 0; i < cluster_->num_shards(); ++i) {
    server::ShardServer* s = cluster_->shard(i);
    EXPECT_LT(MetricSum(Scrape(s->metrics_port()), "optimus_shard_lease_age_seconds"), 2.0);
    auto health = HttpGet(s->metrics_port(), "/healthz");
    EXPECT_TRUE(health.ok()) << health.status();
  }
  // The coordinator sees the job's progress from the shards' heartbeats.
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  double step = 0;
  while (absl::Now() < give_up) {
    step = MetricSum(Scrape(cluster_->coordinator()->metrics_port()), "optimus_coord_job_step", "metrics");
    if (step >= 5) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(step, 5);
  const std::string coord = Scrape(cluster_->coordinator()->metrics_port());
  EXPECT_EQ(MetricSum(coord, "optimus_coord_shards", "up"), 2);
  EXPECT_EQ(MetricSum(coord, "optimus_coord_job_workers_joined", "metrics"), 2);
  EXPECT_EQ(MetricSum(coord, "optimus_coord_shard_chunks_owned"), 6);
  EXPECT_TRUE(HttpGet(cluster_->coordinator()->metrics_port(), "/healthz").ok());
}

TEST_P(ClusterTest, JobTooBigIsRefusedWithNumbers) {
  JobDef def = MakeJob("too-big", DType::kFp32, DType::kFp32);
  def.tensors = {{"huge", {1 << 20, 64}}};  // 64 Mi params, ~1.4 GB of state.
  absl::Status s = worker(0)->CreateJob(def);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("bytes"), absl::string_view::npos) << s;
}

INSTANTIATE_TEST_SUITE_P(Transports, ClusterTest,
                         ::testing::Values(TransportKind::kLoopback, TransportKind::kUcx),
                         ParamName);
INSTANTIATE_TEST_SUITE_P(Transports, ClusterWithKernelPoolTest,
                         ::testing::Values(TransportKind::kLoopback, TransportKind::kUcx),
                         ParamName);

}  // namespace
}  // namespace optimus
