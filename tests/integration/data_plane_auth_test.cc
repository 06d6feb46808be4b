// The data plane under TLS, attacked over real UCX on loopback: a victim job
// trains while an attacker, a legitimate worker of another job (it holds
// that job's token and so its data-plane key), and a peer with no
// credentials at all reach the victim's shards directly. A peer that
// proves nothing cannot finish its handshake; the other job's worker is
// refused every push, pull, init and forged replication seed for the
// victim; every refusal is counted; and the victim trains on to exactly
// the reference parameters. A shard's reply to a request sent to another
// shard (a forged "fenced") is dropped by the client.
#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/security.h"
#include "common/wire.h"
#include "gtest/gtest.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"
#include "tests/integration/client_test_workers.h"
#include "tests/integration/raw_hello.h"
#include "transport/transport.h"

namespace optimus {
namespace harness {
namespace {

constexpr absl::Duration kWait = absl::Seconds(20);

// A raw data-plane peer: sends hand-made requests, collects the replies.
class RawPeer {
 public:
  static absl::StatusOr<std::unique_ptr<RawPeer>> Create(transport::WorkerOptions o) {
    std::unique_ptr<RawPeer> p(new RawPeer());
    auto w = transport::Worker::Create(o);
    if (!w.ok()) return w.status();
    p->worker_ = *std::move(w);
    RawPeer* raw = p.get();
    p->worker_->SetHandler(wire::kAmReply, [raw](transport::IncomingMessage& m) {
      auto r = wire::ParseReply(m.header());
      absl::MutexLock lock(&raw->mu_);
      raw->replies_[r.ok() ? r->header.request_id : 0] = r.ok() ? r->status : r.status();
    });
    if (absl::Status s = p->worker_->Start(); !s.ok()) return s;
    return p;
  }
  transport::Worker* worker() { return worker_.get(); }
  // Sends `h` (with `payload`) and waits for its reply's status.
  absl::Status Call(transport::EndpointRef ep, wire::RequestHeader h,
                    const std::vector<uint8_t>& payload = {}) {
    h.request_id = ++next_id_;
    h.num_bytes = payload.size();
    worker_->Send(ep, wire::kAmRequest, wire::AsBytes(h), payload.empty() ? nullptr : payload.data(),
                  payload.size(), [](absl::Status) {});
    const uint64_t id = h.request_id;
    absl::MutexLock lock(&mu_);
    auto there = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return replies_.count(id) != 0; };
    if (!mu_.AwaitWithTimeout(absl::Condition(&there), kWait)) {
      return absl::DeadlineExceededError("no reply");
    }
    return replies_[id];
  }

 private:
  RawPeer() = default;
  std::unique_ptr<transport::Worker> worker_;
  absl::Mutex mu_;
  std::map<uint64_t, absl::Status> replies_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ = 0;
};

TEST(DataPlaneAuthTest, OtherJobsWorkersAndStrangersAreRefused) {
  ASSERT_OK_AND_ASSIGN(const std::string ca, MakeTestCa(2));
  ClusterOptions o;
  o.transport = TransportKind::kUcx;
  o.num_shards = 2;
  o.num_workers = 2;
  o.tls_root = ca;
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::Start(o));
  const client::JobDef def = SmallJob("victim", 2);
  ASSERT_OK(cluster->CreateJob(def));
  ASSERT_OK(cluster->Train(1, 3));
  const uint64_t victim = cluster->worker(0)->job_id();
  ASSERT_OK_AND_ASSIGN(v1::StatusResponse st0, cluster->Status());

  // The attacker: a trainer that made a job of its own and joined it, so it
  // holds a real data-plane key, for that job.
  security::TlsOptions trainer_tls;
  trainer_tls.dir = ca + "/trainer";
  ASSERT_OK_AND_ASSIGN(auto channel,
                       security::Dial(cluster->coordinator_address(), trainer_tls, "attacker"));
  auto stub = v1::Coordinator::NewStub(channel);
  v1::CreateJobRequest create;
  create.mutable_spec()->set_name("attacker");
  create.mutable_spec()->set_world_size(1);
  auto* t = create.mutable_spec()->add_tensors();
  t->set_name("w");
  t->add_shape(64);
  create.mutable_spec()->set_grad_dtype(v1::DTYPE_FP32);
  create.mutable_spec()->set_param_dtype(v1::DTYPE_FP32);
  create.mutable_spec()->mutable_optimizer()->set_kind(v1::OPTIMIZER_SGD);
  create.mutable_spec()->mutable_optimizer()->set_lr(0.1f);
  v1::CreateJobResponse created;
  {
    grpc::ClientContext ctx;
    ASSERT_OK(FromGrpc(stub->CreateJob(&ctx, create, &created)));
  }
  v1::JoinJobRequest join;
  join.set_job_name("attacker");
  join.set_rank(0);
  join.set_world_size(1);
  v1::JoinJobResponse joined;
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("authorization", "Bearer " + created.job_token());
    ASSERT_OK(FromGrpc(stub->JoinJob(&ctx, join, &joined)));
  }
  ASSERT_FALSE(joined.data_plane_key().empty());
  const std::string key = joined.data_plane_key();
  const uint64_t mine = joined.job_id();

  // The victim's first chunk and its shard.
  ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, cluster->Status());
  v1::GetJobRequest get;
  get.set_job_id(victim);
  v1::GetJobResponse job;
  {
    grpc::ClientContext ctx;
    ASSERT_OK(FromGrpc(cluster->stub()->GetJob(&ctx, get, &job)));
  }
  const v1::ChunkPlacement chunk = job.map().chunks(0);
  std::string shard_address;
  for (const auto& e : job.map().shards()) {
    if (e.shard_id() == chunk.shard_id()) shard_address = e.data_address();
  }
  ASSERT_FALSE(shard_address.empty());
  server::ShardServer* target = nullptr;
  for (size_t i = 0; i < cluster->num_shards(); ++i) {
    if (cluster->shard(i)->shard_id() == chunk.shard_id()) target = cluster->shard(i);
  }
  ASSERT_NE(target, nullptr);

  // 1. A stranger with no proof: its handshake is refused, it gets nowhere.
  {
    ASSERT_OK_AND_ASSIGN(auto stranger, RawPeer::Create(cluster->TransportOptions("stranger")));
    auto ep = stranger->worker()->Connect(shard_address);
    ASSERT_FALSE(ep.ok());
    EXPECT_TRUE(absl::IsUnauthenticated(ep.status())) << ep.status();
    // Claiming to be the victim's rank 0, with a made-up proof.
    transport::WorkerOptions liar = cluster->TransportOptions("liar");
    liar.prove = [victim](absl::string_view) {
      return std::make_pair(security::WorkerIdentity(victim, 0), std::string(32, 'x'));
    };
    ASSERT_OK_AND_ASSIGN(auto impostor, RawPeer::Create(liar));
    ep = impostor->worker()->Connect(shard_address);
    ASSERT_FALSE(ep.ok());
    EXPECT_TRUE(absl::IsUnauthenticated(ep.status())) << ep.status();
  }
  EXPECT_GE(target->stats().unproved_refused, 2u);

  // 2. The other job's worker: its handshake succeeds (as itself), and then
  // every request for the victim is refused.
  transport::WorkerOptions wo = cluster->TransportOptions("other-job");
  wo.prove = [key, mine](absl::string_view challenge) {
    const std::string id = security::WorkerIdentity(mine, 0);
    return std::make_pair(id, security::DataPlaneProof(key, challenge, id));
  };
  ASSERT_OK_AND_ASSIGN(auto attacker, RawPeer::Create(wo));
  ASSERT_OK_AND_ASSIGN(transport::EndpointRef ep, attacker->worker()->Connect(shard_address));
  const uint64_t refused_before = target->stats().requests_refused_identity;
  wire::RequestHeader h;
  h.job_id = victim;
  h.map_epoch = job.map().epoch();
  h.tensor = chunk.tensor();
  h.chunk = chunk.chunk();
  h.rank = 0;
  h.dtype = static_cast<uint8_t>(DType::kBf16);
  // A pull of the victim's parameters.
  h.op = static_cast<uint16_t>(wire::Op::kPull);
  h.step = 4;
  absl::Status s = attacker->Call(ep, h);
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << "pull: " << s;
  // A push for the victim's next step, before its real workers push it
  // (it would otherwise take rank 0's slot).
  h.op = static_cast<uint16_t>(wire::Op::kPush);
  h.step = 4;
  h.lr = 1e-2f;
  s = attacker->Call(ep, h, std::vector<uint8_t>(chunk.num_elems() * 2, 0x7f));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << "push: " << s;
  // Initial values over the victim's.
  h.op = static_cast<uint16_t>(wire::Op::kInit);
  h.step = 1;
  h.dtype = static_cast<uint8_t>(DType::kFp32);
  s = attacker->Call(ep, h, std::vector<uint8_t>(chunk.num_elems() * 4, 0));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << "init: " << s;
  // A replication seed claiming to come from the chunk's primary.
  h.op = static_cast<uint16_t>(wire::Op::kReplicate);
  h.rank = static_cast<uint32_t>(chunk.shard_id());
  h.flags = wire::kReplicateState;
  h.step = 4;
  s = attacker->Call(ep, h, std::vector<uint8_t>(chunk.num_elems() * 12, 0));
  EXPECT_TRUE(absl::IsPermissionDenied(s)) << "replicate: " << s;
  EXPECT_GE(target->stats().requests_refused_identity, refused_before + 4);

  // The victim never noticed: same shards, and its parameters are the
  // reference's after more steps.
  ASSERT_OK_AND_ASSIGN(v1::StatusResponse st1, cluster->Status());
  EXPECT_EQ(st1.shards_size(), st0.shards_size());
  ASSERT_OK(cluster->Train(4, 8));
  for (uint32_t i = 0; i < def.tensors.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(const std::vector<float> got, cluster->PullFp32(i, 9));
    ASSERT_OK_AND_ASSIGN(const std::vector<float> want, ReferenceParams(def, i, 8));
    EXPECT_EQ(got, want) << "tensor " << i;
  }
}

// Hellos whose "address" is garbage (the bytes that once aborted UCX inside
// ucp_ep_create), each followed by a request as if the handshake had been
// done: the shard never opens those addresses (the peers proved nothing),
// drops the requests, counts them, and its job trains on untouched.
TEST(DataPlaneAuthTest, GarbageHelloAddressesNeverReachUcx) {
  ASSERT_OK_AND_ASSIGN(const std::string ca, MakeTestCa(1));
  ClusterOptions o;
  o.transport = TransportKind::kUcx;
  o.num_shards = 1;
  o.num_workers = 1;
  o.tls_root = ca;
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::Start(o));
  const client::JobDef def = SmallJob("victim", 1);
  ASSERT_OK(cluster->CreateJob(def));
  ASSERT_OK(cluster->Train(1, 2));
  server::ShardServer* shard = cluster->shard(0);
  const uint64_t refused_before = shard->stats().unproved_refused;

  wire::RequestHeader h;
  h.op = static_cast<uint16_t>(wire::Op::kPull);
  h.job_id = cluster->worker(0)->job_id();
  h.map_epoch = 1;
  h.step = 3;
  h.request_id = 1;
  const std::string request(reinterpret_cast<const char*>(&h), sizeof(h));
  constexpr uint32_t kUcxRequestAmId = 4 + wire::kAmRequest;  // transport/ucx.cc's shift.
  {
    HelloFlood raw(shard->data_address());
    uint64_t instance = 0xbad0000000000000ull;
    for (size_t size : {size_t{1}, size_t{7}, size_t{64}, size_t{300}, size_t{5000},
                        size_t{9000}}) {
      std::string garbage(size, '\0');
      for (size_t i = 0; i < size; ++i) garbage[i] = static_cast<char>((i * 131 + size) & 0xff);
      raw.SendAs(++instance, garbage, kUcxRequestAmId, request);
      raw.SendAs(++instance, std::string(size, '\xff'), kUcxRequestAmId, request);
    }
    raw.Progress(absl::Milliseconds(200));
  }
  // Every request was dropped (and every impossible size too).
  ASSERT_OK(cluster->WaitUntil("the garbage counted", [&] {
    return shard->stats().unproved_refused >= refused_before + 12;
  }));
  ASSERT_OK(cluster->Train(3, 5));
  for (uint32_t i = 0; i < def.tensors.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(const std::vector<float> got, cluster->PullFp32(i, 6));
    ASSERT_OK_AND_ASSIGN(const std::vector<float> want, ReferenceParams(def, i, 5));
    EXPECT_EQ(got, want) << "tensor " << i;
  }
}

// A shard answering (here: fencing) requests that were sent to another
// shard. Request ids are not secrets, so a compromised or confused shard
// could guess them; the client takes an answer only from the shard the
// request went to. ForgingWorker wraps the worker's real UCX worker and,
// before each push or pull goes out, hands the client a "fenced" reply to
// it that comes from another shard's endpoint.
class ForgingWorker : public testing_workers::ForwardingWorker {
 public:
  explicit ForgingWorker(std::unique_ptr<transport::Worker> inner)
      : ForwardingWorker(std::move(inner)) {}
  uint64_t forged() const { return forged_.load(); }

  void SetHandler(uint16_t am_id, transport::Handler handler) override {
    if (am_id == wire::kAmReply) {
      absl::MutexLock lock(&mu_);
      reply_handler_ = handler;
    }
    inner_->SetHandler(am_id, std::move(handler));
  }
  using ForwardingWorker::Connect;
  absl::StatusOr<transport::EndpointRef> Connect(const std::string& peer,
                                                 const std::string& identity) override {
    auto ep = inner_->Connect(peer, identity);
    if (ep.ok()) {
      absl::MutexLock lock(&mu_);
      shards_.push_back(*ep);
    }
    return ep;
  }
  using ForwardingWorker::Send;
  void Send(transport::EndpointRef ep, uint16_t am_id, absl::Span<const uint8_t> header,
            const void* payload, size_t payload_size, const transport::MemoryRegion* region,
            transport::DoneCallback done) override {
    auto h = wire::ParseRequestHeader(header);
    if (am_id == wire::kAmRequest && h.ok() &&
        (h->op == static_cast<uint16_t>(wire::Op::kPush) ||
         h->op == static_cast<uint16_t>(wire::Op::kPull))) {
      transport::EndpointRef other;
      transport::Handler handler;
      {
        absl::MutexLock lock(&mu_);
        for (const auto& s : shards_) {
          if (s.ep != ep.ep) other = s;
        }
        handler = reply_handler_;
      }
      if (other.valid() && handler) {
        ForgedReply m(wire::EncodeReply(h->request_id,
                                        absl::FailedPreconditionError("fenced: a newer primary"),
                                        0, wire::kReplyFenced),
                      other);
        handler(m);
        forged_.fetch_add(1);
      }
    }
    inner_->Send(ep, am_id, header, payload, payload_size, region, std::move(done));
  }

 private:
  class ForgedReply : public transport::IncomingMessage {
   public:
    ForgedReply(std::string header, transport::EndpointRef from)
        : header_(std::move(header)), from_(from) {}
    uint16_t am_id() const override { return wire::kAmReply; }
    absl::Span<const uint8_t> header() const override {
      return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(header_.data()),
                                       header_.size());
    }
    size_t payload_size() const override { return 0; }
    bool is_rendezvous() const override { return false; }
    transport::EndpointRef reply_endpoint() const override { return from_; }
    const std::string& peer_identity() const override { return identity_; }
    void ReceiveInto(void*, transport::DoneCallback done) override { done(absl::OkStatus()); }
    void ReceiveInto(void*, const transport::MemoryRegion*, transport::DoneCallback done) override {
      done(absl::OkStatus());
    }
    std::unique_ptr<transport::PendingPayload> Keep() override { return nullptr; }

   private:
    std::string header_;
    transport::EndpointRef from_;
    const std::string identity_ = "shard:forger";
  };

  absl::Mutex mu_;
  std::vector<transport::EndpointRef> shards_ ABSL_GUARDED_BY(mu_);
  transport::Handler reply_handler_ ABSL_GUARDED_BY(mu_);
  std::atomic<uint64_t> forged_{0};
};

TEST(DataPlaneAuthTest, RepliesFromAShardARequestWasNotSentToAreDropped) {
  ASSERT_OK_AND_ASSIGN(const std::string ca, MakeTestCa(2));
  ClusterOptions o;
  o.transport = TransportKind::kUcx;
  o.num_shards = 2;
  o.num_workers = 2;
  o.tls_root = ca;
  std::vector<ForgingWorker*> forgers(2, nullptr);
  o.make_worker = [&forgers](uint32_t rank, const transport::WorkerOptions& w)
      -> absl::StatusOr<std::unique_ptr<transport::Worker>> {
    auto inner = transport::Worker::Create(w);
    if (!inner.ok()) return inner.status();
    auto f = std::make_unique<ForgingWorker>(std::move(*inner));
    forgers[rank] = f.get();
    return std::unique_ptr<transport::Worker>(std::move(f));
  };
  ASSERT_OK_AND_ASSIGN(auto cluster, Cluster::Start(o));
  const client::JobDef def = SmallJob("victim", 2);
  ASSERT_OK(cluster->CreateJob(def));
  ASSERT_OK(cluster->Train(1, 6));
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_NE(forgers[r], nullptr);
    EXPECT_GT(forgers[r]->forged(), 0u) << "rank " << r;
    // Every forgery was dropped (and counted) by the client it reached.
    EXPECT_EQ(cluster->worker(r)->replies_refused(), forgers[r]->forged()) << "rank " << r;
  }
  for (uint32_t i = 0; i < def.tensors.size(); ++i) {
    ASSERT_OK_AND_ASSIGN(const std::vector<float> got, cluster->PullFp32(i, 7));
    ASSERT_OK_AND_ASSIGN(const std::vector<float> want, ReferenceParams(def, i, 6));
    EXPECT_EQ(got, want) << "tensor " << i;
  }
}

}  // namespace
}  // namespace harness
}  // namespace optimus
