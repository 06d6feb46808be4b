#include "client/client.h"
#include "client/job_spec.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/map_delta.h"
#include "common/busy_retry.h"
#include "common/coordinator_channels.h"
#include "common/grpc_limits.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/wire.h"
#include "grpcpp/grpcpp.h"
#include "kernels/optimizer_spec.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {
namespace client {
namespace {

constexpr char kLog[] = "client";
// How long requests may wait with no reply at all before the client asks
// the coordinator whether their chunks moved (RecoveryLoop).
constexpr absl::Duration kStuckCheck = absl::Seconds(2);

using Lease = RegistrationCache::Lease;

struct ChunkRoute {
  uint32_t chunk = 0;
  uint64_t offset_elems = 0;
  uint64_t num_elems = 0;
  uint64_t shard_id = 0;
  transport::EndpointRef ep;
};

// One Push, Pull or Init until Wait consumes it. A ticket is its slot's
// index in the low 32 bits and the slot's generation in the high ones.
struct TicketState {
  Ticket id = 0;  // 0: the slot is free.
  uint32_t gen = 0;
  uint32_t remaining = 0;
  absl::Status status;  // First error seen.
  wire::Op op = wire::Op::kPush;
  uint32_t tensor = 0;
  uint64_t step = 0;
};

// One chunk request: what its header is built from and where its payload is.
struct Pending {
  Ticket ticket = 0;            // 0: a background resend or commit nobody waits for.
  wire::Op op = wire::Op::kPush;
  uint32_t tensor = 0;
  uint32_t route = 0;           // Index into the tensor's routes.
  uint64_t step = 0;            // Push: step; pull: wanted version.
  const void* src = nullptr;    // Push/init: the whole tensor's buffer.
  void* dst = nullptr;          // Pull: the whole tensor's buffer.
  DType dtype = DType::kFp32;
  uint8_t flags = 0;            // wire::RequestFlags.
  bool receiving = false;       // Pull: the reply's payload is being received.
  uint32_t step_flags = 0;      // wire::StepFlags.
  float lr = 0.0f;              // Push: the step's lr; init with state: the last lr.
  float grad_mult = 0.0f;       // Push.
  float clip_coef = 0.0f;       // Commit.
  uint64_t optimizer_steps = 0; // Init with state.
  uint32_t arrays = 1;          // Init with state: arrays per element, chunk-major.
  uint64_t expected_bytes = 0;  // Pull: payload size.
  uint64_t offset_bytes = 0;    // Of the chunk in the tensor's buffer.
  void* ep = nullptr;           // The shard's endpoint, to fail it if the shard dies.
  uint64_t epoch = 0;           // Map epoch it was sent under.
  Lease lease;                  // The registration covering src or dst, if any.
  // A background resend of a retained push: its own copy of the chunk's
  // bytes, sent instead of src + offset_bytes. The caller may free the
  // tensor's buffer once the next version is pulled, and such a resend can
  // outlive that (stalled again by a second map change, or still being
  // sent when the pull completes).
  std::shared_ptr<const std::vector<uint8_t>> own_payload;
};

// A request waiting for a newer shard map before it is sent again.
struct Stalled {
  Pending p;
  uint64_t min_epoch = 0;
  absl::Time since;
  absl::Status why;
};

// A chunk request in flight lives in a slot from Issue until it is answered
// and the transport is done with its payload. A request id is the slot's
// index in the low 32 bits and the slot's generation (bumped at every reuse)
// in the high ones, so an answer to a reused slot's old request is not
// taken for the new one's.
struct Slot {
  // Guarded by ClientImpl::mu_.
  uint64_t id = 0;   // The live request's id; 0: none (free, or answered).
  uint32_t gen = 0;
  uint32_t index = 0;
  Pending p;
  // Parties still using the slot: the request until it is answered (or
  // stalled), and its Send until the transport's done callback (payload and
  // registration must stay until then). The last one to let go frees the
  // slot; a send completing OK lets go without the client's lock.
  std::atomic<uint32_t> holds{0};
};

// Slots in blocks that never move (a send's completion finds its slot
// without the client's lock); a free list reuses them, so the common path
// allocates nothing once the table has grown to the number of requests in
// flight. Take/Give/Reserve/size under the client's lock; At from any
// thread for an index handed out before.
class SlotTable {
 public:
  static constexpr uint32_t kBlockBits = 10;
  static constexpr uint32_t kBlockSize = 1u << kBlockBits;
  // 16 Mi requests in flight at most: a bound no training loop reaches.
  static constexpr uint32_t kMaxBlocks = 1u << 14;

  SlotTable() : blocks_(new std::atomic<Slot*>[kMaxBlocks]) {
    for (uint32_t i = 0; i < kMaxBlocks; ++i) blocks_[i].store(nullptr, std::memory_order_relaxed);
  }
  SlotTable(const SlotTable&) = delete;
  SlotTable& operator=(const SlotTable&) = delete;

  Slot* At(uint32_t index) const {
    const uint32_t b = index >> kBlockBits;
    if (b >= kMaxBlocks) return nullptr;
    Slot* block = blocks_[b].load(std::memory_order_acquire);
    return block == nullptr ? nullptr : &block[index & (kBlockSize - 1)];
  }
  // A free slot's index; false when the table is full.
  bool Take(uint32_t* index) {
    if (free_.empty() && !Grow()) return false;
    *index = free_.back();
    free_.pop_back();
    return true;
  }
  void Give(uint32_t index) { free_.push_back(index); }
  // Grows to at least n slots.
  void Reserve(size_t n) {
    while (size_ < n && Grow()) {
    }
  }
  uint32_t size() const { return size_; }

 private:
  bool Grow() {
    const uint32_t b = size_ >> kBlockBits;
    if (b >= kMaxBlocks) return false;
    owned_.emplace_back(new Slot[kBlockSize]);
    Slot* block = owned_.back().get();
    free_.reserve(free_.size() + kBlockSize);
    for (uint32_t i = kBlockSize; i-- > 0;) {
      block[i].index = size_ + i;
      free_.push_back(size_ + i);
    }
    blocks_[b].store(block, std::memory_order_release);
    size_ += kBlockSize;
    return true;
  }

  std::unique_ptr<std::atomic<Slot*>[]> blocks_;
  std::vector<std::unique_ptr<Slot[]>> owned_;
  std::vector<uint32_t> free_;
  uint32_t size_ = 0;
};

uint32_t SlotIndex(uint64_t id) { return static_cast<uint32_t>(id & 0xffffffffu); }

// A message ready to go: built under the client's lock, sent after it.
struct OutMsg {
  wire::RequestHeader h;
  transport::EndpointRef ep;
  const void* payload = nullptr;
  size_t payload_bytes = 0;
  const transport::MemoryRegion* region = nullptr;
  uint64_t id = 0;
};

// The messages one call sends once it has let go of the lock. Reuses one
// vector per thread and nesting depth (a send's callback may send again on
// the same thread), so that sending allocates nothing once warm.
constexpr int kOutboxDepths = 4;
thread_local std::vector<OutMsg> tls_outboxes[kOutboxDepths];
thread_local int tls_outbox_depth = 0;

class ClientImpl;

// Requests issued on this thread while a client is corked (Client::Cork).
struct Cork {
  ClientImpl* client = nullptr;
  int depth = 0;
  std::vector<OutMsg> msgs;
};
thread_local Cork tls_cork;

class Outbox {
 public:
  Outbox()
      : msgs_(tls_outbox_depth < kOutboxDepths ? &tls_outboxes[tls_outbox_depth] : &own_) {
    ++tls_outbox_depth;
    msgs_->clear();
  }
  ~Outbox() {
    msgs_->clear();
    --tls_outbox_depth;
  }
  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;
  OutMsg* Add() {
    msgs_->emplace_back();
    return &msgs_->back();
  }
  const std::vector<OutMsg>& msgs() const { return *msgs_; }

 private:
  std::vector<OutMsg>* msgs_;
  std::vector<OutMsg> own_;
};

// A pull reply's payload received under the client's lock (eager payloads):
// the transport runs the done callback before ReceiveInto returns, and the
// callback leaves the status here instead of taking the lock again.
struct SyncReceive {
  bool active = false;
  uint64_t id = 0;
  bool done = false;
  absl::Status status;
};
thread_local SyncReceive tls_sync_receive;

// One reply of a wire::kAmReplyBatch, handled as if it had come alone. Such
// replies carry no payload (acks and refusals).
class BatchedReply : public transport::IncomingMessage {
 public:
  BatchedReply(absl::Span<const uint8_t> header, transport::EndpointRef from,
               const std::string& identity)
      : header_(header), from_(from), identity_(identity) {}
  uint16_t am_id() const override { return wire::kAmReply; }
  absl::Span<const uint8_t> header() const override { return header_; }
  size_t payload_size() const override { return 0; }
  bool is_rendezvous() const override { return false; }
  transport::EndpointRef reply_endpoint() const override { return from_; }
  void ReceiveInto(void*, transport::DoneCallback done) override {
    done(absl::FailedPreconditionError("a batched reply carries no payload"));
  }
  std::unique_ptr<transport::PendingPayload> Keep() override { return nullptr; }
  const std::string& peer_identity() const override { return identity_; }

 private:
  absl::Span<const uint8_t> header_;
  transport::EndpointRef from_;
  const std::string& identity_;  // The batch's sender's, alive while it is handled.
};

// A push kept until the pull of the next version of its tensor completes,
// to send again (a copy of the bytes of each chunk that moved) if its
// chunk's shard changes.
struct Retained {
  bool valid = false;
  uint64_t step = 0;
  const void* src = nullptr;
  uint32_t step_flags = 0;
  float lr = 0.0f;
  float grad_mult = 0.0f;
};

// Every chunk's partial sum of squares of one step, by chunk, tensor-major
// (ClientImpl::chunk_base_).
struct Partials {
  std::vector<double> sums;
  std::vector<uint8_t> have;
};

// The clipping round of one step on this client: every chunk's partial sum
// of squares (from the push replies), then the decision it commits. Rounds
// sit in a ring of the last kRoundsKept steps (their reports); the partials
// of the few undecided ones in reused buffers, so a step allocates nothing
// once warm.
struct Round {
  uint64_t step = 0;  // 0: unused.
  int partials = -1;  // Index into ClientImpl::partials_ while undecided.
  uint64_t missing = 0;
  bool decided = false;
  StepReport report;
};

v1::OptimizerKind ToProto(Optimizer k) {
  switch (k) {
    case Optimizer::kAdamW: return v1::OPTIMIZER_ADAMW;
    case Optimizer::kAdam: return v1::OPTIMIZER_ADAM;
    case Optimizer::kSgd: return v1::OPTIMIZER_SGD;
    case Optimizer::kLion: return v1::OPTIMIZER_LION;
  }
  return v1::OPTIMIZER_UNSPECIFIED;
}

class ClientImpl : public Client {
 public:
  explicit ClientImpl(const ClientOptions& options) : options_(options) {}

  ~ClientImpl() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;  // Failed requests are answered, no longer stalled.
    }
    if (recovery_.joinable()) recovery_.join();
    // Registrations must not outlive the worker: let go of those no
    // transfer uses (the transport keeps none of a request waiting only for
    // its reply), then destroy the worker, whose cancelled transfers let go
    // of theirs on the way.
    {
      absl::MutexLock lock(&mu_);
      stalled_.clear();
      for (uint32_t i = 0; i < slots_.size(); ++i) {
        Slot* s = slots_.At(i);
        if (s->id != 0 && !s->p.receiving && s->holds.load(std::memory_order_acquire) == 1) {
          s->p.lease.reset();
        }
      }
    }
    {
      absl::MutexLock lock(&batch_mu_);
      tearing_down_ = true;
      for (auto& b : batch_free_) b->own.reset();
      deferred_replies_.clear();  // Dropped: their senders' sends complete.
    }
    if (cache_ != nullptr) cache_->Clear();
    // Joins the progress thread: no reply handler runs after this. Handlers
    // still running while it is destroyed may send (their sends fail), so
    // worker_ keeps pointing at it until it is gone.
    delete worker_.get();
    (void)worker_.release();
  }

  absl::Status Init() {
    transport::WorkerOptions wopts = options_.transport;
    // A shard that dies fails (or, with a replica, re-routes) the requests
    // waiting for its replies at once, instead of leaving them to time out.
    wopts.on_peer_failure = [this](transport::EndpointRef ep, const absl::Status& why) {
      OnPeerFailure(ep, why);
    };
    // A worker talks only to the shards it connects to: nothing else gets
    // a message (a forged reply) through to it.
    wopts.verify_peer = [](absl::string_view, absl::string_view, absl::string_view) {
      return absl::PermissionDeniedError("a worker accepts no connections");
    };
    // To each shard: "worker:<job>:<rank>" and the HMAC of its challenge
    // under the job's data-plane key (from JoinJob).
    wopts.prove = [this](absl::string_view challenge) {
      absl::MutexLock lock(&identity_mu_);
      std::string proof;
      if (!data_plane_key_.empty()) {
        proof = security::DataPlaneProof(data_plane_key_, challenge, data_plane_identity_);
      }
      return std::make_pair(data_plane_identity_, proof);
    };
    auto worker = options_.make_worker ? options_.make_worker(wopts)
                                       : transport::Worker::Create(wopts);
    if (!worker.ok()) return worker.status();
    worker_ = std::move(*worker);
    worker_->SetHandler(wire::kAmReply, [this](transport::IncomingMessage& m) { OnReply(m); });
    worker_->SetHandler(wire::kAmReplyBatch,
                        [this](transport::IncomingMessage& m) { OnReplyBatch(m); });
    if (auto s = worker_->Start(); !s.ok()) return s;
    RegistrationCache::Options copts;
    copts.capacity_bytes = options_.registration_cache_bytes;
    copts.min_bytes = options_.registration_min_bytes;
    transport::Worker* w = worker_.get();
    cache_ = std::make_unique<RegistrationCache>(
        [w](void* data, size_t bytes) { return w->RegisterMemory(data, bytes); }, copts);
    // Registered now, not mid-training: two, for a step's pull batches
    // still completing while its push batches go out.
    {
      std::unique_ptr<BatchSend> first = TakeBatch();
      GiveBatch(TakeBatch().release());
      GiveBatch(first.release());
    }
    auto channels =
        CoordinatorChannels::Dial(options_.coordinator_address, options_.tls, "optimus client");
    if (!channels.ok()) return channels.status();
    stub_ = std::make_unique<LeaderStub<v1::Coordinator>>(*std::move(channels));
    {
      absl::MutexLock lock(&mu_);
      token_ = options_.job_token;
      if (token_.empty()) {
        const char* env = std::getenv(security::kJobTokenEnv);
        if (env != nullptr) token_ = env;
      }
    }
    recovery_ = std::thread([this] { RecoveryLoop(); });
    return absl::OkStatus();
  }

  // Every control-plane call: its deadline, and the job token if there is one.
  void SetDeadline(grpc::ClientContext* ctx) const {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      absl::ToChronoMilliseconds(options_.rpc_timeout));
    const std::string token = job_token();
    if (!token.empty()) ctx->AddMetadata(security::kAuthorizationKey, "Bearer " + token);
  }

  std::string job_token() const override {
    absl::MutexLock lock(&mu_);
    return token_;
  }

  absl::Status Annotate(const absl::Status& s, absl::string_view what) const {
    if (s.ok()) return s;
    return absl::Status(s.code(), absl::StrCat(what, " (coordinator ",
                                               options_.coordinator_address, "): ", s.message()));
  }

  // One control-plane call through whichever coordinator leads: with
  // several addresses, one that does not answer (UNAVAILABLE) is followed
  // at once by a try at the next. Every call here may be repeated
  // (CreateJob's repeat answers ALREADY_EXISTS, which JoinOrCreate takes
  // as "join it").
  template <class Request, class Response>
  absl::Status CallCoordinator(
      grpc::Status (v1::Coordinator::Stub::*method)(grpc::ClientContext*, const Request&,
                                                   Response*),
      const Request& request, Response* response) {
    return FromGrpc(stub_->CallAround(
        method,
        [this] {
          auto ctx = std::make_unique<grpc::ClientContext>();
          SetDeadline(ctx.get());
          return ctx;
        },
        request, response));
  }

  absl::Status CreateJob(const JobDef& def) override {
    v1::CreateJobRequest req;
    *req.mutable_spec() = ToJobSpec(def);
    req.set_job_token(job_token());
    v1::CreateJobResponse resp;
    absl::Status s = CallCoordinator(&v1::Coordinator::Stub::CreateJob, req, &resp);
    if (s.ok() && !resp.job_token().empty()) {
      absl::MutexLock lock(&mu_);
      token_ = resp.job_token();
    }
    return Annotate(s, absl::StrCat("creating job '", def.name, "'"));
  }

  absl::Status Join(const std::string& name, uint32_t rank, uint32_t world_size) override {
    {
      absl::MutexLock lock(&mu_);
      if (joined_) return absl::FailedPreconditionError("this client already joined a job");
    }
    v1::JoinJobRequest req;
    req.set_job_name(name);
    req.set_rank(rank);
    req.set_world_size(world_size);
    v1::JoinJobResponse join;
    // Every rank of a big job joins at once, with the shards fetching their
    // maps: a coordinator that refuses a call as busy is asked again after
    // a jittered wait, within ready_timeout from now.
    const absl::Time give_up = absl::Now() + options_.ready_timeout;
    {
      auto s = RetryWhileBusy(
          [&] { return CallCoordinator(&v1::Coordinator::Stub::JoinJob, req, &join); }, give_up);
      if (!s.ok()) return Annotate(s, absl::StrCat("joining job '", name, "'"));
    }
    {
      absl::MutexLock lock(&identity_mu_);
      data_plane_identity_ = security::WorkerIdentity(join.job_id(), rank);
      data_plane_key_ = join.data_plane_key();
    }
    // Wait for the shards to load the job.
    v1::GetJobResponse job;
    for (;;) {
      auto s = FetchJob(join.job_id(), &job, give_up);
      if (!s.ok()) return Annotate(s, "waiting for the job to be ready");
      if (job.state() == v1::JOB_STATE_READY) break;
      if (job.state() == v1::JOB_STATE_FAILED) {
        return absl::UnavailableError(absl::StrCat("job '", name, "' failed (a shard is down)"));
      }
      if (absl::Now() > give_up) {
        return absl::DeadlineExceededError(absl::StrCat(
            "job '", name, "' not ready after ", absl::FormatDuration(options_.ready_timeout),
            ": its shards have not loaded it"));
      }
      absl::SleepFor(absl::Milliseconds(50));
    }
    return Adopt(job, rank);
  }

  // A fetch the coordinator refuses as busy (past its bound on map reads)
  // is tried again after jittered, growing waits until `give_up`; the
  // default, now, tries once.
  // With known_epoch (the map this client holds, with the spec), the
  // answer leaves the spec out and its map may be a delta from that epoch
  // (GetJobResponse.map_delta_from; WholeMapOf).
  absl::Status FetchJob(uint64_t job_id, v1::GetJobResponse* job,
                        absl::Time give_up = absl::InfinitePast(), uint64_t known_epoch = 0) {
    v1::GetJobRequest greq;
    greq.set_job_id(job_id);
    greq.set_known_epoch(known_epoch);
    return RetryWhileBusy(
        [&] { return CallCoordinator(&v1::Coordinator::Stub::GetJob, greq, job); }, give_up);
  }

  // Routes for every tensor under `map`, connecting to shards not seen yet.
  absl::StatusOr<std::vector<std::vector<ChunkRoute>>> BuildRoutes(
      const v1::ShardMap& map, const std::vector<TensorInfo>& tensors) {
    for (const auto& se : map.shards()) {
      if (eps_.count(se.shard_id()) != 0) continue;
      auto ep = worker_->Connect(se.data_address());
      if (!ep.ok()) {
        return absl::Status(ep.status().code(), absl::StrCat("connecting to shard ",
                                                             se.shard_id(), ": ",
                                                             ep.status().message()));
      }
      eps_[se.shard_id()] = *ep;
    }
    std::vector<std::vector<ChunkRoute>> routes(tensors.size());
    for (const auto& c : map.chunks()) {
      if (c.tensor() >= routes.size()) {
        return absl::InternalError(absl::StrCat("shard map names tensor ", c.tensor(),
                                                " but the job has ", routes.size()));
      }
      auto it = eps_.find(c.shard_id());
      if (it == eps_.end()) {
        return absl::InternalError(absl::StrCat("shard map places chunk on unknown shard ",
                                                c.shard_id()));
      }
      routes[c.tensor()].push_back(
          ChunkRoute{c.chunk(), c.offset_elems(), c.num_elems(), c.shard_id(), it->second});
    }
    for (size_t t = 0; t < routes.size(); ++t) {
      std::sort(routes[t].begin(), routes[t].end(),
                [](const ChunkRoute& a, const ChunkRoute& b) { return a.chunk < b.chunk; });
      uint64_t covered = 0;
      for (const auto& r : routes[t]) {
        if (r.offset_elems != covered) {
          return absl::InternalError(absl::StrCat("shard map for tensor ", tensors[t].name,
                                                  " has a gap or overlap at ", covered));
        }
        covered += r.num_elems;
      }
      if (covered != tensors[t].num_elems) {
        return absl::InternalError(absl::StrCat("shard map covers ", covered, " of ",
                                                tensors[t].num_elems, " elements of tensor ",
                                                tensors[t].name));
      }
    }
    return routes;
  }

  absl::Status Adopt(const v1::GetJobResponse& job, uint32_t rank) {
    const v1::JobSpec& spec = job.spec();
    auto gd = DTypeFromInt(spec.grad_dtype());
    auto pd = DTypeFromInt(spec.param_dtype());
    if (!gd.ok()) return gd.status();
    if (!pd.ok()) return pd.status();
    auto kind = kernels::OptimizerKindFromInt(spec.optimizer().kind());
    if (!kind.ok()) return kind.status();
    std::vector<TensorInfo> tensors;
    std::vector<bool> frozen;
    for (const auto& t : spec.tensors()) {
      frozen.push_back(t.frozen());
      TensorInfo info;
      info.name = t.name();
      info.group = t.group();
      info.frozen = t.frozen();
      info.num_elems = 1;
      for (int64_t d : t.shape()) {
        info.shape.push_back(d);
        info.num_elems *= static_cast<uint64_t>(d);
      }
      tensors.push_back(std::move(info));
    }
    auto routes = BuildRoutes(job.map(), tensors);
    if (!routes.ok()) return routes.status();
    for (size_t t = 0; t < tensors.size(); ++t) {
      tensors[t].num_chunks = static_cast<uint32_t>((*routes)[t].size());
    }
    absl::MutexLock lock(&mu_);
    job_id_ = job.job_id();
    job_name_ = spec.name();
    replication_ = spec.replication();
    epoch_ = job.map().epoch();
    map_ = job.map();
    rank_ = rank;
    world_size_ = spec.world_size();
    resume_step_ = std::max<uint64_t>(job.resume_step(), 1);
    resume_lr_ = job.has_restore() ? job.restore().manifest().last_lr() : 0.0f;
    round_ = spec.max_grad_norm() > 0 || !spec.keep_nonfinite();
    max_grad_norm_ = spec.max_grad_norm();
    skip_nonfinite_ = !spec.keep_nonfinite();
    num_arrays_ = kernels::LayoutOf(*kind).num_arrays;
    num_groups_ = static_cast<uint32_t>(spec.param_groups_size());
    switch (*kind) {
      case kernels::OptimizerKind::kAdamW: optimizer_ = Optimizer::kAdamW; break;
      case kernels::OptimizerKind::kAdam: optimizer_ = Optimizer::kAdam; break;
      case kernels::OptimizerKind::kSgd: optimizer_ = Optimizer::kSgd; break;
      case kernels::OptimizerKind::kLion: optimizer_ = Optimizer::kLion; break;
    }
    default_lr_ = spec.optimizer().lr();
    frozen_ = std::move(frozen);
    grad_dtype_ = *gd;
    param_dtype_ = *pd;
    tensors_ = std::move(tensors);
    routes_ = *std::move(routes);
    retained_.assign(tensors_.size(), Retained{});
    chunk_base_.assign(1, 0);
    for (const auto& r : routes_) chunk_base_.push_back(chunk_base_.back() + r.size());
    // Room for every chunk's push, pull and commit in flight at once.
    const uint64_t chunks = chunk_base_.back();
    slots_.Reserve(std::min<uint64_t>(3 * chunks + 64, uint64_t{1} << 20));
    tickets_.reserve(2 * tensors_.size() + 64);
    joined_ = true;
    joined_flag_.store(true, std::memory_order_release);
    OPTIMUS_LOG(Debug, kLog, "joined job ", job_id_, " as rank ", rank_, " of ", world_size_);
    return absl::OkStatus();
  }

  absl::Status Leave() override {
    {
      absl::MutexLock lock(&mu_);
      if (!joined_) return absl::FailedPreconditionError("join a job first");
    }
    v1::LeaveJobRequest req;
    req.set_job_name(job_name_);
    req.set_rank(rank_);
    // LeaveJob is idempotent: a connection the coordinator's restart broke
    // (UNAVAILABLE, e.g. "Broken pipe" on the first RPC after it) is tried
    // again on a fresh one, within rpc_timeout; so is a leader that died
    // (the next try goes to the next address: a standby taking over).
    const absl::Time give_up = absl::Now() + options_.rpc_timeout;
    absl::Duration pause = absl::Milliseconds(100);
    absl::Status s;
    for (;;) {
      v1::LeaveJobResponse resp;
      s = CallCoordinator(&v1::Coordinator::Stub::LeaveJob, req, &resp);
      if (!absl::IsUnavailable(s) || absl::Now() + pause > give_up) break;
      absl::SleepFor(pause);
      pause = std::min(pause * 2, absl::Seconds(1));
    }
    return Annotate(s, absl::StrCat("leaving job '", job_name_, "'"));
  }

  const std::vector<TensorInfo>& tensors() const override { return tensors_; }

  absl::StatusOr<uint32_t> TensorIndex(const std::string& name) const override {
    for (size_t i = 0; i < tensors_.size(); ++i) {
      if (tensors_[i].name == name) return static_cast<uint32_t>(i);
    }
    return absl::NotFoundError(absl::StrCat("no tensor named '", name, "' in the job"));
  }
  uint32_t rank() const override { return rank_; }
  uint32_t world_size() const override { return world_size_; }
  DType grad_dtype() const override { return grad_dtype_; }
  DType param_dtype() const override { return param_dtype_; }
  uint64_t resume_step() const override { return resume_step_; }
  float resume_lr() const override { return resume_lr_; }
  Optimizer optimizer() const override { return optimizer_; }
  uint32_t num_param_groups() const override { return num_groups_; }
  uint64_t job_id() const override { return job_id_; }
  uint64_t map_epoch() const override {
    absl::MutexLock lock(&mu_);
    return epoch_;
  }
  uint64_t requests_resent() const override {
    absl::MutexLock lock(&mu_);
    return resent_;
  }
  uint64_t replies_refused() const override {
    return replies_refused_.load(std::memory_order_relaxed);
  }
  std::string transports_in_use() const override { return worker_->transports_in_use(); }

  // ---- Requests, tickets and their slots --------------------------------------
  // The common path of a request takes the client's lock once when it is
  // issued (for all chunks of the tensor), once when its reply comes (an
  // eager pull payload is copied under that same lock), and not at all when
  // its send completes; it allocates nothing once the tables have grown.

  // Checks a tensor index and size against the joined job (fixed by Join,
  // read without the lock once joined_flag_ is set).
  absl::Status CheckTensor(uint32_t tensor, size_t num_elems) const {
    if (!joined_flag_.load(std::memory_order_acquire)) {
      return absl::FailedPreconditionError("join a job first");
    }
    if (tensor >= tensors_.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor index ", tensor, " out of range (job has ", tensors_.size(), ")"));
    }
    if (num_elems != tensors_[tensor].num_elems) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", tensors_[tensor].name, " has ",
                                                     tensors_[tensor].num_elems,
                                                     " elements, got ", num_elems));
    }
    return absl::OkStatus();
  }

  Ticket NewTicketLocked(wire::Op op, uint32_t tensor, uint64_t step, uint32_t chunks)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    uint32_t index;
    if (!free_tickets_.empty()) {
      index = free_tickets_.back();
      free_tickets_.pop_back();
    } else {
      index = static_cast<uint32_t>(tickets_.size());
      tickets_.emplace_back();
    }
    TicketState& t = tickets_[index];
    t.gen = t.gen == 0xffffffffu ? 1 : t.gen + 1;
    t.id = (static_cast<uint64_t>(t.gen) << 32) | index;
    t.remaining = chunks;
    t.status = absl::OkStatus();
    t.op = op;
    t.tensor = tensor;
    t.step = step;
    return t.id;
  }

  TicketState* FindTicketLocked(Ticket ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const uint32_t index = static_cast<uint32_t>(ticket & 0xffffffffu);
    if (ticket == 0 || index >= tickets_.size() || tickets_[index].id != ticket) return nullptr;
    return &tickets_[index];
  }

  void FreeTicketLocked(TicketState* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    free_tickets_.push_back(static_cast<uint32_t>(t->id & 0xffffffffu));
    t->id = 0;
    t->status = absl::OkStatus();
  }

  // Registers one chunk request under the current map and builds its
  // message into `out`, to be sent once the lock is released (SendAll).
  // 0 when no slot is left (16 Mi requests in flight).
  uint64_t AddLocked(Pending p, Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    uint32_t index;
    if (!slots_.Take(&index)) return 0;
    const ChunkRoute& r = routes_[p.tensor][p.route];
    p.ep = r.ep.ep;
    p.epoch = epoch_;
    p.expected_bytes = p.op == wire::Op::kPull ? r.num_elems * DTypeSize(p.dtype) : 0;
    p.offset_bytes = r.offset_elems * DTypeSize(p.dtype) * p.arrays;
    Slot& s = *slots_.At(index);
    s.gen = s.gen == 0xffffffffu ? 1 : s.gen + 1;
    s.id = (static_cast<uint64_t>(s.gen) << 32) | index;
    s.p = std::move(p);
    s.holds.store(2, std::memory_order_relaxed);  // The request and its send.
    Build(s, r, out->Add());
    return s.id;
  }

  // The message of the request in slot `s` (under the lock).
  void Build(const Slot& s, const ChunkRoute& r, OutMsg* m) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Pending& p = s.p;
    const size_t elem_bytes = DTypeSize(p.dtype);
    wire::RequestHeader& h = m->h;
    h.op = static_cast<uint16_t>(p.op);
    h.job_id = job_id_;
    h.map_epoch = p.epoch;
    h.tensor = p.tensor;
    h.chunk = r.chunk;
    h.step = p.step;
    h.rank = rank_;
    h.dtype = static_cast<uint8_t>(p.dtype);
    h.flags = p.flags;
    h.step_flags = p.step_flags;
    h.lr = p.lr;
    h.grad_mult = p.grad_mult;
    h.clip_coef = p.clip_coef;
    h.optimizer_steps = p.optimizer_steps;
    h.num_bytes = r.num_elems * elem_bytes * p.arrays;
    h.request_id = s.id;
    const bool no_payload = p.op == wire::Op::kPull || p.op == wire::Op::kCommit ||
                            (p.step_flags & wire::kPushNoGrad) != 0;
    if (no_payload) {
      if (p.op != wire::Op::kPull) h.num_bytes = 0;
      m->payload = nullptr;
      m->payload_bytes = 0;
      m->region = nullptr;
    } else if (p.own_payload != nullptr) {
      m->payload = p.own_payload->data();
      m->payload_bytes = p.own_payload->size();
      m->region = nullptr;
    } else {
      m->payload = static_cast<const uint8_t*>(p.src) + p.offset_bytes;
      m->payload_bytes = r.num_elems * elem_bytes * p.arrays;
      m->region = p.lease.region();
    }
    m->ep.ep = p.ep;
    m->id = s.id;
  }

  // Sends what AddLocked built; called without the lock. A slot's payload
  // and registration stay until its send's done callback (the slot's send
  // hold).
  void SendAll(const Outbox& out) {
    if (tls_cork.client == this && tls_cork.depth > 0) {
      // Corked: sent (batched) at Uncork.
      tls_cork.msgs.insert(tls_cork.msgs.end(), out.msgs().begin(), out.msgs().end());
      return;
    }
    for (const OutMsg& m : out.msgs()) SendOne(m);
  }

  void SendOne(const OutMsg& m) {
    worker_->Send(m.ep, wire::kAmRequest, wire::AsBytes(m.h), m.payload, m.payload_bytes,
                  m.region, [this, id = m.id](absl::Status s) { OnSent(id, std::move(s)); });
  }

  void Cork() override {
    if (tls_cork.depth > 0 && tls_cork.client != this) {
      // Another client is corked on this thread: send its requests first.
      ClientImpl* other = tls_cork.client;
      tls_cork.depth = 1;
      other->Uncork();
    }
    tls_cork.client = this;
    ++tls_cork.depth;
  }

  void Uncork() override {
    if (tls_cork.client != this || tls_cork.depth == 0) return;
    if (--tls_cork.depth > 0) return;
    std::vector<OutMsg> msgs;
    msgs.swap(tls_cork.msgs);
    tls_cork.client = nullptr;
    SendBatched(msgs);
    msgs.clear();
    if (tls_cork.msgs.empty()) tls_cork.msgs.swap(msgs);  // Keep the capacity.
  }

  // A batch on its way: a registered buffer to build it in and the ids of
  // its requests. Reused, buffer, registration and the ids' capacity, so
  // that a batch neither registers memory nor allocates per send.
  struct BatchSend {
    std::unique_ptr<uint8_t[]> buffer;
    // The whole buffer's registration, taken when it was made (off the
    // progress thread) and kept: batches are sent from it, and reply batches
    // received into it on the progress thread, which must not call into the
    // cache (GiveBatch).
    RegistrationCache::Lease own;
    std::vector<uint64_t> ids;
  };

  // A reply batch waiting for a free batch buffer to be received into.
  struct DeferredReplies {
    std::shared_ptr<transport::PendingPayload> payload;  // Kept alive until received.
    uint32_t count = 0;
    transport::EndpointRef from;
    std::string identity;
  };

  // A free BatchSend, or a new one (more are made only while more batches
  // are in flight at once). Called where the caller holds no lock
  // (Uncork), never on the transport's progress thread: registering waits
  // for that thread. BatchSends given back beyond kKeptBatchBuffers are
  // unregistered and freed here, not in GiveBatch.
  std::unique_ptr<BatchSend> TakeBatch() {
    std::unique_ptr<BatchSend> b;
    std::vector<std::unique_ptr<BatchSend>> extra;
    {
      absl::MutexLock lock(&batch_mu_);
      if (!batch_free_.empty()) {
        b = std::move(batch_free_.back());
        batch_free_.pop_back();
      }
      while (batch_free_.size() > kKeptBatchBuffers) {
        extra.push_back(std::move(batch_free_.back()));
        batch_free_.pop_back();
      }
    }
    for (const auto& e : extra) {
      e->own.reset();
      cache_->Forget(e->buffer.get(), kBatchBytes);
    }
    if (b != nullptr) return b;
    b = std::make_unique<BatchSend>();
    b->buffer.reset(new uint8_t[kBatchBytes]);
    if (absl::Status s = cache_->Pin(b->buffer.get(), kBatchBytes); !s.ok()) {
      OPTIMUS_LOG(Warning, kLog, "batch buffer not registered: ", s.ToString());
    } else {
      b->own = cache_->Lookup(b->buffer.get(), kBatchBytes);
    }
    return b;
  }

  // Runs in a batch's send-done callback, on the transport's progress
  // thread: it must not call into the registration cache, whose mutex a
  // registration on another thread (TakeBatch's Pin, a Push's Acquire)
  // holds while it waits for this thread. So the batch is only listed;
  // TakeBatch trims the list.
  // A reply batch that waited for a buffer is received into this one
  // instead.
  void GiveBatch(BatchSend* b) {
    b->ids.clear();
    DeferredReplies next;
    {
      absl::MutexLock lock(&batch_mu_);
      // The worker is being destroyed: no registration may outlive it.
      if (tearing_down_) b->own.reset();
      if (deferred_replies_.empty() || tearing_down_) {
        batch_free_.emplace_back(b);
        return;
      }
      next = std::move(deferred_replies_.front());
      deferred_replies_.pop_front();
    }
    ReceiveReplies(b, std::move(next.payload), nullptr, next.count, next.from, next.identity);
  }

  // A free batch buffer (with its registration) to receive a reply batch
  // into, without making one: null when none is free.
  BatchSend* TakeFreeBatch() {
    absl::MutexLock lock(&batch_mu_);
    if (batch_free_.empty() || tearing_down_) return nullptr;
    BatchSend* b = batch_free_.back().release();
    batch_free_.pop_back();
    return b;
  }

  // Small requests to one shard go in one kBatch message (up to kMaxBatch
  // requests and kBatchBytes); the rest one by one. The scratch lists are
  // this thread's, kept between calls.
  void SendBatched(const std::vector<OutMsg>& msgs) {
    thread_local std::vector<char> sent;
    thread_local std::vector<size_t> group;
    sent.assign(msgs.size(), 0);
    for (size_t i = 0; i < msgs.size(); ++i) {
      if (sent[i]) continue;
      if (msgs[i].payload_bytes > kBatchItemBytes) {
        SendOne(msgs[i]);
        sent[i] = 1;
        continue;
      }
      // Gather this shard's small requests from here on.
      group.clear();
      size_t bytes = 0;
      for (size_t j = i; j < msgs.size() && group.size() < wire::kMaxBatch; ++j) {
        if (sent[j] || msgs[j].ep.ep != msgs[i].ep.ep || msgs[j].payload_bytes > kBatchItemBytes) {
          continue;
        }
        const size_t item = sizeof(wire::RequestHeader) + msgs[j].payload_bytes;
        if (!group.empty() && bytes + item > kBatchBytes) break;
        group.push_back(j);
        bytes += item;
      }
      for (size_t j : group) sent[j] = 1;
      if (group.size() == 1) {
        SendOne(msgs[group[0]]);
        continue;
      }
      BatchSend* batch = TakeBatch().release();
      batch->ids.reserve(group.size());
      uint8_t* at = batch->buffer.get();
      for (size_t j : group) {
        std::memcpy(at, &msgs[j].h, sizeof(wire::RequestHeader));
        at += sizeof(wire::RequestHeader);
        batch->ids.push_back(msgs[j].id);
      }
      for (size_t j : group) {
        if (msgs[j].payload_bytes == 0) continue;
        std::memcpy(at, msgs[j].payload, msgs[j].payload_bytes);
        at += msgs[j].payload_bytes;
      }
      wire::RequestHeader h = msgs[group[0]].h;  // Job, epoch, dtype; its id.
      h.op = static_cast<uint16_t>(wire::Op::kBatch);
      h.step = group.size();
      h.num_bytes = bytes;
      // The shard may answer the batch's pushes in one message.
      h.flags = wire::kRequestBatchReplies;
      h.step_flags = 0;
      h.lr = h.grad_mult = h.clip_coef = 0.0f;
      batches_sent_.fetch_add(1, std::memory_order_relaxed);
      // The payloads were copied into the batch: each request's own buffer
      // is free once the batch is sent, as for a send of its own. (Two
      // pointers: the callback fits in std::function without allocating.)
      worker_->Send(msgs[i].ep, wire::kAmRequest, wire::AsBytes(h), batch->buffer.get(), bytes,
                    batch->own.region(), [this, batch](absl::Status s) {
                      for (uint64_t id : batch->ids) OnSent(id, s);
                      GiveBatch(batch);
                    });
    }
  }

  void OnSent(uint64_t id, absl::Status s) {
    Slot* slot = slots_.At(SlotIndex(id));
    if (s.ok()) {
      if (slot->holds.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        absl::MutexLock lock(&mu_);
        FreeLocked(slot);
      }
      return;
    }
    absl::MutexLock lock(&mu_);
    // A pull whose payload is being received was sent: its receive answers.
    if (slot->id == id && !slot->p.receiving) FailedLocked(slot, s, /*peer_failed=*/true, 0);
    ReleaseLocked(slot);
  }

  void ReleaseLocked(Slot* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (s->holds.fetch_sub(1, std::memory_order_acq_rel) == 1) FreeLocked(s);
  }

  void FreeLocked(Slot* s) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    s->id = 0;
    s->p = Pending{};  // Lets go of its registration.
    slots_.Give(s->index);
  }

  // The request in slot `s` is answered with `status` (its last chunk
  // completes its ticket).
  void AnswerLocked(Slot* s, const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    s->id = 0;
    FinishLocked(s->p, status);
    ReleaseLocked(s);
  }

  // One chunk of p's ticket is done; the first error wins.
  void FinishLocked(const Pending& p, const absl::Status& status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (p.ticket == 0) {
      if (!status.ok()) {
        OPTIMUS_LOG(Warning, kLog, "background request (a resent push or a commit) failed: ",
                    status.ToString());
      }
      return;
    }
    TicketState* t = FindTicketLocked(p.ticket);
    if (t == nullptr) return;
    if (!status.ok() && t->status.ok()) t->status = status;
    if (--t->remaining == 0 && t->status.ok() && t->op == wire::Op::kPull) {
      // The next version of this tensor is in hand: its push is applied.
      Retained& r = retained_[t->tensor];
      if (r.valid && r.step + 1 <= t->step) r.valid = false;
    }
  }

  // The request in slot `s` failed. When its shard was lost or said the map
  // moved on, it waits for a newer map and is sent again; otherwise its
  // ticket fails.
  void FailedLocked(Slot* s, const absl::Status& why, bool peer_failed, uint32_t reply_flags)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const bool refresh = (reply_flags & wire::kReplyRefreshMap) != 0;
    // A lost peer is judged by the coordinator: a replica takes over or a
    // drain moved the chunk (a newer map: send again), or the job FAILED
    // (the recovery thread fails the ticket then, as soon as it is known).
    if ((!refresh && !peer_failed) || stopping_) return AnswerLocked(s, why);
    // A shard that has not loaded our (newer) map yet: send again under the
    // same map. Otherwise wait for a map newer than the one it was sent under.
    const bool shard_behind = refresh && why.code() == absl::StatusCode::kUnavailable;
    Stalled st;
    st.p = s->p;
    st.p.receiving = false;
    st.min_epoch = shard_behind ? s->p.epoch : s->p.epoch + 1;
    st.since = absl::Now();
    st.why = why;
    OPTIMUS_LOG(Debug, kLog, "request ", s->id, " waits for map epoch ", st.min_epoch, ": ",
                why.ToString());
    stalled_.emplace(next_stalled_++, std::move(st));
    s->id = 0;
    ReleaseLocked(s);
  }

  // Sends one request per chunk of `tensor` and returns the ticket.
  // `proto` carries the fields every chunk request shares.
  absl::StatusOr<Ticket> Issue(wire::Op op, uint32_t tensor, uint64_t step, const void* src,
                               void* dst, size_t num_elems, DType dtype,
                               const Pending& proto = Pending{}) {
    if (auto s = CheckTensor(tensor, num_elems); !s.ok()) return s;
    // The buffer's registration: a user's Push/Pull buffer through the
    // cache; an Init's one-off buffer only if it lies in a registered range.
    const void* buf = src != nullptr ? src : dst;
    const size_t bytes = num_elems * DTypeSize(dtype) * proto.arrays;
    Lease lease;
    if (buf != nullptr && op != wire::Op::kInit) {
      auto l = cache_->Acquire(buf, bytes);
      if (l.ok()) {
        lease = *std::move(l);
      } else if (!registration_warned_.exchange(true)) {
        OPTIMUS_LOG(Warning, kLog, "sending without a registration (the transport registers "
                    "per transfer): ", l.status().ToString());
      }
    } else if (buf != nullptr) {
      lease = cache_->Lookup(buf, bytes);
    }
    Outbox out;
    Ticket ticket;
    {
      absl::MutexLock lock(&mu_);
      if (op == wire::Op::kPush && round_) StartRoundLocked(step);
      const uint32_t n = static_cast<uint32_t>(routes_[tensor].size());
      ticket = NewTicketLocked(op, tensor, step, n);
      Pending p = proto;
      p.ticket = ticket;
      p.op = op;
      p.tensor = tensor;
      p.step = step;
      p.src = src;
      p.dst = dst;
      p.dtype = dtype;
      p.lease = lease;
      for (uint32_t i = 0; i < n; ++i) {
        p.route = i;
        if (AddLocked(p, &out) == 0) {
          TicketState* t = FindTicketLocked(ticket);
          t->remaining -= n - i;
          if (t->status.ok()) {
            t->status = absl::ResourceExhaustedError("too many requests in flight");
          }
          break;
        }
      }
      if (op == wire::Op::kPush) {
        retained_[tensor] =
            Retained{true, step, src, proto.step_flags, proto.lr, proto.grad_mult};
      }
    }
    SendAll(out);
    return ticket;
  }

  absl::Status InitTensor(uint32_t tensor, const float* values, size_t num_elems) override {
    auto t = Issue(wire::Op::kInit, tensor, 0, values, nullptr, num_elems, DType::kFp32);
    if (!t.ok()) return t.status();
    return Wait(*t, options_.rpc_timeout);
  }

  absl::Status InitTensorState(uint32_t tensor, const TensorState& state,
                               size_t num_elems) override {
    if (auto s = CheckTensor(tensor, num_elems); !s.ok()) return s;
    const uint32_t arrays = num_arrays_;  // Fixed by Join.
    const float* src[3] = {state.master, state.m, state.v};
    for (uint32_t a = 0; a < arrays; ++a) {
      if (src[a] == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "InitTensorState: the job's optimizer keeps ", arrays, " arrays per element; ",
            a == 0 ? "master" : a == 1 ? "m" : "v", " is null"));
      }
    }
    if (state.steps > 0 && frozen_[tensor]) {
      return absl::InvalidArgumentError(absl::StrCat("tensor ", tensors_[tensor].name,
                                                     " is frozen: it takes no optimizer steps"));
    }
    // Chunk-major: each chunk's request carries its range of every array.
    std::vector<float> staging(num_elems * arrays);
    {
      absl::MutexLock lock(&mu_);
      size_t at = 0;
      for (const ChunkRoute& r : routes_[tensor]) {
        for (uint32_t a = 0; a < arrays; ++a) {
          std::memcpy(staging.data() + at, src[a] + r.offset_elems, r.num_elems * 4);
          at += r.num_elems;
        }
      }
    }
    Pending proto;
    proto.step_flags = wire::kInitState;
    proto.optimizer_steps = state.steps;
    proto.lr = state.last_lr;
    proto.arrays = arrays;
    auto t = Issue(wire::Op::kInit, tensor, 0, staging.data(), nullptr, num_elems, DType::kFp32,
                   proto);
    if (!t.ok()) return t.status();
    return Wait(*t, options_.rpc_timeout);
  }

  using Client::Push;
  absl::StatusOr<Ticket> Push(uint32_t tensor, uint64_t step, const void* grad, size_t num_elems,
                              const PushOptions& options) override {
    if (step == 0) return absl::InvalidArgumentError("steps start at 1");
    // Resolved here (the wire carries the step's lr as it is), so that
    // ranks that leave it unset and ranks that spell out the job's value
    // agree.
    const float lr = options.lr.value_or(default_lr_);
    if (!std::isfinite(lr) || lr < 0.0f) {
      return absl::InvalidArgumentError(absl::StrCat("push lr ", lr, " is not >= 0"));
    }
    if (!std::isfinite(options.grad_mult) || options.grad_mult < 0.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat("push grad_mult ", options.grad_mult, " is not >= 0"));
    }
    Pending proto;
    proto.lr = lr;
    proto.grad_mult = options.grad_mult > 0.0f ? options.grad_mult : 1.0f;
    // Fixed by Join (read without the lock, as tensors_).
    if (tensor < frozen_.size() && frozen_[tensor]) grad = nullptr;
    if (grad == nullptr) proto.step_flags |= wire::kPushNoGrad;
    // Its ack may come inside a reply batch (a commit round's acks leave the
    // shard's step threads several at a time), received into a registered
    // batch buffer (OnReplyBatch).
    proto.flags |= wire::kRequestBatchReplies;
    return Issue(wire::Op::kPush, tensor, step, grad, nullptr, num_elems, grad_dtype_, proto);
  }

  // ---- The clipping round ----------------------------------------------------

  Round* FindRoundLocked(uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Round& r = rounds_[step % kRoundsKept];
    return r.step == step ? &r : nullptr;
  }

  // Starts step's round unless it has one; a step older than the one in its
  // place of the ring gets none (as one forgotten).
  void StartRoundLocked(uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Round& r = rounds_[step % kRoundsKept];
    if (r.step >= step) return;
    ReleasePartialsLocked(&r);
    const size_t chunks = chunk_base_.back();
    if (free_partials_.empty()) {
      free_partials_.push_back(static_cast<int>(partials_.size()));
      partials_.emplace_back();
    }
    r.partials = free_partials_.back();
    free_partials_.pop_back();
    Partials& p = partials_[r.partials];
    p.sums.assign(chunks, 0.0);
    p.have.assign(chunks, 0);
    r.step = step;
    r.missing = chunks;
    r.decided = false;
    r.report = StepReport{};
  }

  void ReleasePartialsLocked(Round* r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (r->partials < 0) return;
    free_partials_.push_back(r->partials);
    r->partials = -1;
  }

  // A chunk's partial for `step` arrived. When it was the last one, decides
  // the step and adds the commits to `out`.
  void RecordPartialLocked(uint32_t tensor, uint32_t route, uint64_t step, double partial,
                           Outbox* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Round* round = FindRoundLocked(step);
    if (round == nullptr || round->partials < 0 || tensor + 1 >= chunk_base_.size()) return;
    Round& r = *round;
    Partials& p = partials_[r.partials];
    const uint64_t c = chunk_base_[tensor] + route;
    if (c >= chunk_base_[tensor + 1] || p.have[c]) return;
    p.have[c] = 1;
    p.sums[c] = partial;
    if (--r.missing != 0) return;
    // Every rank adds the same partials in the same order (tensor, then
    // chunk): the same norm and the same decision on every rank.
    double total = 0.0;
    for (double x : p.sums) total += x;
    ReleasePartialsLocked(&r);
    r.report.grad_norm = std::sqrt(total);
    r.report.found_inf = !std::isfinite(total);
    r.report.skipped = r.report.found_inf && skip_nonfinite_;
    float coef = 1.0f;
    if (max_grad_norm_ > 0.0f && !r.report.found_inf) {
      // clip_grad_norm_: max_norm / (total_norm + 1e-6), clamped to 1, in fp32.
      const float c = max_grad_norm_ / (static_cast<float>(r.report.grad_norm) + 1e-6f);
      coef = std::min(c, 1.0f);
    }
    r.report.clip_coef = coef;
    r.decided = true;
    if (stopping_) return;  // The client is being destroyed: nobody to commit for.
    for (uint32_t t = 0; t < routes_.size(); ++t) {
      for (uint32_t i = 0; i < routes_[t].size(); ++i) {
        if (AddLocked(CommitFor(t, i, step, r.report), out) == 0) {
          OPTIMUS_LOG(Error, kLog, "step ", step, ": no slot left for a commit");
        }
      }
    }
  }

  Pending CommitFor(uint32_t tensor, uint32_t route, uint64_t step, const StepReport& rep) const {
    Pending p;
    p.op = wire::Op::kCommit;
    p.tensor = tensor;
    p.route = route;
    p.step = step;
    p.dtype = DType::kFp32;
    p.clip_coef = rep.clip_coef;
    if (rep.skipped) p.step_flags |= wire::kStepSkip;
    return p;
  }

  bool RoundDecided(uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const Round* r = FindRoundLocked(step);
    return r == nullptr || r->decided;
  }

  absl::StatusOr<StepReport> StepResult(uint64_t step, absl::Duration timeout) override {
    absl::MutexLock lock(&mu_);
    if (!joined_) return absl::FailedPreconditionError("join a job first");
    if (!round_) {
      return absl::FailedPreconditionError(
          "the job neither clips (max_grad_norm) nor skips non-finite steps: no step report");
    }
    if (FindRoundLocked(step) == nullptr) {
      return absl::NotFoundError(absl::StrCat("no pushes of step ", step, " on this client (or "
                                              "too long ago: the last ", kRoundsKept, " are kept)"));
    }
    struct Args {
      ClientImpl* self;
      uint64_t step;
    } args{this, step};
    const bool done = mu_.AwaitWithTimeout(
        absl::Condition(
            +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->self->RoundDecided(a->step); },
            &args),
        timeout);
    const Round* r = FindRoundLocked(step);
    if (r == nullptr) return absl::NotFoundError(absl::StrCat("step ", step, " forgotten"));
    if (!done) {
      return absl::DeadlineExceededError(absl::StrCat(
          "step ", step, ": ", r->missing,
          " chunks have not answered this rank's pushes yet (every tensor must be pushed, by "
          "every rank) after ", absl::FormatDuration(timeout)));
    }
    return r->report;
  }

  absl::StatusOr<Ticket> Pull(uint32_t tensor, uint64_t version, void* dst,
                              size_t num_elems) override {
    if (version == 0) return absl::InvalidArgumentError("versions start at 1 (initial values)");
    return Issue(wire::Op::kPull, tensor, version, nullptr, dst, num_elems, param_dtype_);
  }

  bool TicketDone(Ticket t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const TicketState* ts = FindTicketLocked(t);
    return ts == nullptr || ts->remaining == 0;
  }

  absl::Status Wait(Ticket ticket, absl::Duration timeout) override {
    absl::MutexLock lock(&mu_);
    if (FindTicketLocked(ticket) == nullptr) {
      return absl::NotFoundError(absl::StrCat("unknown ticket ", ticket,
                                              " (never issued, or already waited for)"));
    }
    struct Args {
      ClientImpl* self;
      Ticket t;
    } args{this, ticket};
    const bool done = mu_.AwaitWithTimeout(
        absl::Condition(
            +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->self->TicketDone(a->t); },
            &args),
        timeout);
    TicketState* t = FindTicketLocked(ticket);
    if (!done) {
      return absl::DeadlineExceededError(absl::StrCat(
          "ticket ", ticket, " not done after ", absl::FormatDuration(timeout), " (",
          t->remaining, " chunks outstanding)"));
    }
    absl::Status s = t->status;
    FreeTicketLocked(t);
    return s;
  }

  absl::Status RegisterBuffer(const void* data, size_t size_bytes) override {
    return cache_->Pin(data, size_bytes);
  }

  size_t ForgetBuffer(const void* data, size_t size_bytes) override {
    return cache_->Forget(data, size_bytes);
  }

  RegistrationStats registration_stats() const override { return cache_->stats(); }

  void OnPeerFailure(transport::EndpointRef ep, const absl::Status& why) {
    absl::MutexLock lock(&mu_);
    for (uint32_t i = 0; i < slots_.size(); ++i) {
      Slot* s = slots_.At(i);
      // A payload being received fails by itself (its done callback).
      if (s->id != 0 && s->p.ep == ep.ep && !s->p.receiving) {
        FailedLocked(s, why, /*peer_failed=*/true, 0);
      }
    }
  }

  // A pull's payload landed (or failed), later than its reply.
  void OnReceived(uint64_t id, absl::Status s) {
    SyncReceive& sync = tls_sync_receive;
    if (sync.active && sync.id == id) {  // Inside OnReply's ReceiveInto.
      sync.done = true;
      sync.status = std::move(s);
      return;
    }
    absl::MutexLock lock(&mu_);
    Slot* slot = slots_.At(SlotIndex(id));
    if (slot == nullptr || slot->id != id) return;
    // UNAVAILABLE: the shard died while its payload was on the way (the
    // transport's word for a failed peer; OnPeerFailure leaves requests
    // being received to this callback). Pulled again once the map has moved
    // the chunk, like a request the failure caught before its reply.
    if (absl::IsUnavailable(s)) return FailedLocked(slot, s, /*peer_failed=*/true, 0);
    AnswerLocked(slot, s);
  }

  // A shard's answer: one lock, in which the request is found and answered
  // (an eager pull payload copied too). A rendezvous pull payload is
  // received after the lock is released, and answered when it lands.
  void OnReply(transport::IncomingMessage& msg) {
    auto reply = wire::ParseReply(msg.header());
    if (!reply.ok()) {
      OPTIMUS_LOG(Warning, kLog, "dropping malformed reply: ", reply.status().ToString());
      return;
    }
    const uint64_t id = reply->header.request_id;
    Slot* slot = slots_.At(SlotIndex(id));
    Outbox commits;
    void* dst = nullptr;  // Set: a rendezvous payload to receive after the lock.
    const transport::MemoryRegion* region = nullptr;
    {
      absl::MutexLock lock(&mu_);
      last_reply_ = absl::Now();
      if (slot == nullptr || slot->id != id) {
        OPTIMUS_LOG(Debug, kLog, "reply for unknown request ", id, ": ",
                    reply->status.ToString());
        return;
      }
      Pending& p = slot->p;
      if (msg.reply_endpoint().ep != p.ep) {
        // Request ids are not secrets: only the shard a request went to
        // answers it (an error such as "fenced" included).
        replies_refused_.fetch_add(1, std::memory_order_relaxed);
        OPTIMUS_LOG(Warning, kLog, "dropping a reply to request ", id,
                    " from a shard it was not sent to (", msg.peer_identity(), "): ",
                    reply->status.ToString());
        return;
      }
      if (!reply->status.ok()) {
        return FailedLocked(slot, reply->status, /*peer_failed=*/false, reply->header.flags);
      }
      if (p.op == wire::Op::kPush && (reply->header.flags & wire::kReplyPartial) != 0) {
        RecordPartialLocked(p.tensor, p.route, p.step, reply->header.grad_sum_squares, &commits);
        AnswerLocked(slot, reply->status);
      } else if (p.op != wire::Op::kPull) {
        return AnswerLocked(slot, reply->status);
      } else if (msg.payload_size() != p.expected_bytes || reply->header.param_version != p.step) {
        return AnswerLocked(slot, absl::InternalError(absl::StrCat(
                                      "pull reply carries ", msg.payload_size(),
                                      " bytes of version ", reply->header.param_version,
                                      ", expected ", p.expected_bytes, " bytes of version ",
                                      p.step)));
      } else {
        void* into = static_cast<uint8_t*>(p.dst) + p.offset_bytes;
        region = p.lease.region();
        // Failing the request while its payload is received (a peer
        // failure) would free the registration under the transfer: the
        // receive's callback answers it.
        p.receiving = true;
        if (!msg.is_rendezvous()) {
          // Eager: a copy, normally done before ReceiveInto returns, and
          // then answered under this same lock.
          SyncReceive& sync = tls_sync_receive;
          sync = SyncReceive{true, id, false, absl::OkStatus()};
          msg.ReceiveInto(into, region,
                          [this, id](absl::Status s) { OnReceived(id, std::move(s)); });
          sync.active = false;
          if (sync.done) return AnswerLocked(slot, sync.status);
        } else {
          dst = into;
        }
      }
    }
    if (dst != nullptr) {
      msg.ReceiveInto(dst, region, [this, id](absl::Status s) { OnReceived(id, std::move(s)); });
    }
    SendAll(commits);
  }

  // Several replies without payload in one message (the acks to a batch's
  // pushes): each handled as OnReply handles one. A malformed batch is
  // dropped whole, as a malformed reply is.
  void OnReplyBatch(transport::IncomingMessage& msg) {
    auto h = wire::ParseReplyBatchHeader(msg.header());
    if (h.ok() && msg.payload_size() != h->num_bytes) {
      h = absl::InvalidArgumentError(absl::StrCat("reply batch carries ", msg.payload_size(),
                                                  " bytes, its header says ", h->num_bytes));
    }
    if (!h.ok()) {
      OPTIMUS_LOG(Warning, kLog, "dropping malformed reply batch: ", h.status().ToString());
      return;
    }
    const uint32_t count = h->count;
    const transport::EndpointRef from = msg.reply_endpoint();
    if (h->num_bytes <= kBatchBytes) {
      // Into a registered batch buffer (a rendezvous then registers
      // nothing); if none is free, the batch waits at its sender until a
      // buffer comes back (GiveBatch).
      if (BatchSend* b = TakeFreeBatch()) {
        return ReceiveReplies(b, nullptr, &msg, count, from, msg.peer_identity());
      }
      if (std::unique_ptr<transport::PendingPayload> kept = msg.Keep()) {
        DeferredReplies d{std::move(kept), count, from, msg.peer_identity()};
        BatchSend* b = nullptr;
        {
          absl::MutexLock lock(&batch_mu_);
          if (!tearing_down_) {
            if (batch_free_.empty()) {
              deferred_replies_.push_back(std::move(d));
              return;
            }
            // One came back meanwhile.
            b = batch_free_.back().release();
            batch_free_.pop_back();
          }
        }
        if (b == nullptr) return;  // Shutting down: dropped with the worker.
        return ReceiveReplies(b, std::move(d.payload), nullptr, count, from, d.identity);
      }
    }
    // Larger than a batch buffer (refusals with long messages): on the heap.
    auto replies = std::make_shared<std::vector<uint8_t>>(h->num_bytes);
    msg.ReceiveInto(replies->data(), [this, replies, count, from,
                                      identity = msg.peer_identity()](absl::Status s) {
      HandleReplies(s, *replies, count, from, identity);
    });
  }

  // Receives a reply batch (from `msg`, or kept as `kept`) into b, handles
  // it, and gives b back. Small batches come eagerly (handled before the
  // receive returns); larger ones by rendezvous, handled when they land.
  void ReceiveReplies(BatchSend* b, std::shared_ptr<transport::PendingPayload> kept,
                      transport::IncomingMessage* msg, uint32_t count,
                      transport::EndpointRef from, const std::string& identity) {
    const size_t bytes = kept != nullptr ? kept->size() : msg->payload_size();
    auto done = [this, b, bytes, count, from, identity, kept](absl::Status s) {
      HandleReplies(s, absl::Span<const uint8_t>(b->buffer.get(), bytes), count, from, identity);
      GiveBatch(b);
    };
    if (kept != nullptr) {
      transport::PendingPayload* p = kept.get();
      p->ReceiveInto(b->buffer.get(), b->own.region(), std::move(done));
    } else {
      msg->ReceiveInto(b->buffer.get(), b->own.region(), std::move(done));
    }
  }

  void HandleReplies(const absl::Status& s, absl::Span<const uint8_t> replies, uint32_t count,
                     transport::EndpointRef from, const std::string& identity) {
    if (!s.ok()) {
      OPTIMUS_LOG(Warning, kLog, "reply batch lost on the way: ", s.ToString());
      return;
    }
    auto items = wire::SplitReplyBatch(replies, count);
    if (!items.ok()) {
      OPTIMUS_LOG(Warning, kLog, "dropping malformed reply batch: ", items.status().ToString());
      return;
    }
    for (absl::Span<const uint8_t> item : *items) {
      BatchedReply one(item, from, identity);
      OnReply(one);
    }
  }

  // ---- Failover ------------------------------------------------------------
  // A thread that, while requests are stalled, polls the coordinator for the
  // job's map, adopts a newer one (connecting to new shards), sends again the
  // pushes whose chunk changed shard, and re-sends the stalled requests.

  bool HasStalledOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !stalled_.empty();
  }

  bool AnyOutstandingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (uint32_t i = 0; i < slots_.size(); ++i) {
      if (slots_.At(i)->id != 0) return true;
    }
    return false;
  }

  void RecoveryLoop() {
    for (;;) {
      uint64_t job_id, known_epoch;
      {
        absl::MutexLock lock(&mu_);
        if (!mu_.AwaitWithTimeout(absl::Condition(this, &ClientImpl::HasStalledOrStopping),
                                  kStuckCheck)) {
          // Nothing failed, but requests have waited with no reply at all
          // for a while: the map may have moved their chunks while the shard
          // holding them cannot say so (cut off from the coordinator, it
          // never learns it was replaced). Ask the coordinator; AdoptMap
          // re-sends what moved.
          if (!joined_ || absl::Now() - last_reply_ < kStuckCheck || !AnyOutstandingLocked()) {
            continue;
          }
        }
        if (stopping_) return;
        job_id = job_id_;
        known_epoch = epoch_;
      }
      v1::GetJobResponse job;
      absl::Status fetched = FetchJob(job_id, &job, absl::InfinitePast(), known_epoch);
      if (fetched.ok() && job.state() == v1::JOB_STATE_FAILED) {
        FailAllStalled(absl::UnavailableError(absl::StrCat(
            "job '", job_name_, "' failed: a shard holding its chunks was lost without a "
            "usable replica; re-join the job the coordinator restores from its checkpoint")));
        continue;
      }
      // The job is gone: deleted (optimusctl job delete), or, once FAILED,
      // replaced by the restore that took over its name (a rollback does
      // that within a sweep of the failure, so the FAILED state may never
      // be seen here). No new map will come for it.
      if (absl::IsNotFound(fetched)) {
        FailAllStalled(absl::UnavailableError(absl::StrCat(
            "job '", job_name_, "' (id ", job_id, ") is gone from the coordinator: deleted, "
            "or replaced by the job restored from its checkpoint after it failed; re-join the "
            "job by name")));
        continue;
      }
      if (fetched.ok()) {
        uint64_t epoch;
        {
          absl::MutexLock lock(&mu_);
          epoch = epoch_;
        }
        if (job.map().epoch() > epoch) {
          absl::StatusOr<v1::ShardMap> whole = WholeMapOf(job);
          absl::Status s = whole.ok() ? AdoptMap(*whole) : whole.status();
          if (!s.ok()) {
            OPTIMUS_LOG(Warning, kLog, "cannot use map epoch ", job.map().epoch(), ": ",
                        s.ToString());
          }
        }
      } else {
        OPTIMUS_LOG(Debug, kLog, "failover: coordinator: ", fetched.ToString());
      }
      Outbox resend;
      {
        absl::MutexLock lock(&mu_);
        const absl::Time now = absl::Now();
        for (auto it = stalled_.begin(); it != stalled_.end();) {
          Stalled& st = it->second;
          if (st.min_epoch <= epoch_) {
            if (st.p.op == wire::Op::kPush) st.p.flags |= wire::kRequestResend;
            if (AddLocked(st.p, &resend) == 0) {
              FinishLocked(st.p, absl::ResourceExhaustedError("too many requests in flight"));
            }
            ++resent_;
            it = stalled_.erase(it);
          } else if (now - st.since > options_.ready_timeout) {
            FinishLocked(st.p, absl::UnavailableError(absl::StrCat(
                                   "no new shard map for job '", job_name_, "' within ",
                                   absl::FormatDuration(options_.ready_timeout), " after: ",
                                   st.why.message())));
            it = stalled_.erase(it);
          } else {
            ++it;
          }
        }
      }
      SendAll(resend);
      if (resend.msgs().empty()) absl::SleepFor(absl::Milliseconds(10));
    }
  }

  void FailAllStalled(const absl::Status& why) {
    absl::MutexLock lock(&mu_);
    for (auto& [seq, st] : stalled_) FinishLocked(st.p, why);
    stalled_.clear();
  }

  // The whole map a GetJob answer gives: its map, or the delta it carries
  // applied to the map this client holds (which must be the delta's
  // starting epoch: otherwise the next round asks again).
  absl::StatusOr<v1::ShardMap> WholeMapOf(const v1::GetJobResponse& job) {
    if (job.map_delta_from() == 0) return job.map();
    absl::MutexLock lock(&mu_);
    if (job.map_delta_from() != epoch_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "a map delta from epoch ", job.map_delta_from(), " for a client at epoch ", epoch_));
    }
    absl::StatusOr<v1::ShardMap> whole = ApplyMapDelta(map_, job.map());
    if (whole.ok()) {
      OPTIMUS_LOG(Info, kLog, "job ", job_id_, " rank ", rank_, ": map epoch ", epoch_, " -> ",
                  whole->epoch(), " from a delta of ", job.map().chunks_size(), " of ",
                  whole->chunks_size(), " chunks");
    }
    return whole;
  }

  // Switches to a newer map and sends again the retained pushes whose chunk
  // is now on another shard (the old one may have taken them and died).
  absl::Status AdoptMap(const v1::ShardMap& map) {
    auto routes = BuildRoutes(map, tensors_);
    if (!routes.ok()) return routes.status();
    Outbox resend;
    {
      absl::MutexLock lock(&mu_);
      if (map.epoch() <= epoch_) return absl::OkStatus();
      // Failover and drains move chunks, never re-cut them: a request is
      // re-sent as the same element range.
      for (size_t t = 0; t < routes->size(); ++t) {
        bool same = (*routes)[t].size() == routes_[t].size();
        for (size_t i = 0; same && i < routes_[t].size(); ++i) {
          same = (*routes)[t][i].offset_elems == routes_[t][i].offset_elems &&
                 (*routes)[t][i].num_elems == routes_[t][i].num_elems;
        }
        if (!same) {
          return absl::InternalError(absl::StrCat("map epoch ", map.epoch(), " cuts tensor ",
                                                  tensors_[t].name, " differently"));
        }
      }
      std::vector<std::vector<ChunkRoute>> old = std::move(routes_);
      routes_ = *std::move(routes);
      OPTIMUS_LOG(Info, kLog, "job ", job_id_, " rank ", rank_, ": map epoch ", epoch_, " -> ",
                  map.epoch());
      epoch_ = map.epoch();
      map_ = map;
      // Requests still waiting on a chunk's old shard go to its new one
      // (through the recovery thread, as after a peer failure): a deposed
      // primary that is alive but cut off from the coordinator never hears
      // of the new map, and would hold a parked pull, or a push waiting for
      // its step, forever.
      for (uint32_t i = 0; i < slots_.size(); ++i) {
        Slot* s = slots_.At(i);
        if (s->id == 0 || s->p.receiving || s->p.epoch >= epoch_) continue;
        const uint64_t was = old[s->p.tensor][s->p.route].shard_id;
        const uint64_t now = routes_[s->p.tensor][s->p.route].shard_id;
        if (was == now) continue;
        FailedLocked(s, absl::UnavailableError(absl::StrCat(
                            "chunk moved from shard ", was, " to shard ", now,
                            " under map epoch ", epoch_)),
                     /*peer_failed=*/true, 0);
      }
      for (uint32_t t = 0; t < routes_.size(); ++t) {
        const Retained& r = retained_[t];
        if (!r.valid) continue;
        for (uint32_t i = 0; i < routes_[t].size(); ++i) {
          if (routes_[t][i].shard_id == old[t][i].shard_id) continue;
          Pending p;
          p.op = wire::Op::kPush;
          p.tensor = t;
          p.route = i;
          p.step = r.step;
          p.dtype = grad_dtype_;
          p.flags = wire::kRequestResend | wire::kRequestBatchReplies;
          p.step_flags = r.step_flags;
          p.lr = r.lr;
          p.grad_mult = r.grad_mult;
          if ((r.step_flags & wire::kPushNoGrad) == 0) {
            // Copied now, while the caller must still keep the buffer
            // (retained: the next version is not pulled yet, and that pull
            // completes under this lock): the resend is not bounded by it.
            const size_t elem_bytes = DTypeSize(grad_dtype_);
            const uint8_t* from = static_cast<const uint8_t*>(r.src) +
                                  routes_[t][i].offset_elems * elem_bytes;
            p.own_payload = std::make_shared<const std::vector<uint8_t>>(
                from, from + routes_[t][i].num_elems * elem_bytes);
          }
          if (AddLocked(std::move(p), &resend) == 0) {
            OPTIMUS_LOG(Error, kLog, "no slot left to send a push again");
          }
          ++resent_;
          // The step's commit too, if this rank decided it already (the
          // new primary may not have had it).
          const Round* round = FindRoundLocked(r.step);
          if (round != nullptr && round->decided) {
            if (AddLocked(CommitFor(t, i, r.step, round->report), &resend) == 0) {
              OPTIMUS_LOG(Error, kLog, "no slot left to send a commit again");
            }
          }
        }
      }
    }
    SendAll(resend);
    return absl::OkStatus();
  }


 private:
  const ClientOptions options_;
  std::unique_ptr<transport::Worker> worker_;
  // Registers through worker_; set by Init, before any request.
  std::unique_ptr<RegistrationCache> cache_;
  std::atomic<bool> registration_warned_{false};
  std::atomic<uint64_t> batches_sent_{0};  // kBatch messages (Cork).
  std::atomic<uint64_t> replies_refused_{0};
  static constexpr size_t kBatchBytes = wire::kBatchBytes;
  static constexpr size_t kKeptBatchBuffers = 4;
  absl::Mutex batch_mu_;
  // Batches not in flight: kKeptBatchBuffers after a TakeBatch, more
  // until the next one after a burst of batches.
  std::vector<std::unique_ptr<BatchSend>> batch_free_ ABSL_GUARDED_BY(batch_mu_);
  // Reply batches waiting for a free batch buffer (OnReplyBatch).
  std::deque<DeferredReplies> deferred_replies_ ABSL_GUARDED_BY(batch_mu_);
  // Set before the worker is destroyed: batch buffers let go of their
  // registrations, and reply batches are no longer received into them.
  bool tearing_down_ ABSL_GUARDED_BY(batch_mu_) = false;
  // Set by Start; its calls are thread-safe.
  std::unique_ptr<LeaderStub<v1::Coordinator>> stub_;
  std::thread recovery_;
  // Endpoints by shard id; used by Join and the recovery thread only.
  std::map<uint64_t, transport::EndpointRef> eps_;

  // Fixed by Join; read without the lock afterwards (joined_flag_ is set
  // last, with release, and never cleared).
  std::atomic<bool> joined_flag_{false};
  uint64_t job_id_ = 0;
  std::string job_name_;
  uint32_t replication_ = 0;
  uint32_t rank_ = 0;
  uint32_t world_size_ = 0;
  uint64_t resume_step_ = 1;
  float resume_lr_ = 0.0f;
  bool round_ = false;
  float max_grad_norm_ = 0.0f;
  bool skip_nonfinite_ = true;
  uint32_t num_arrays_ = 1;
  uint32_t num_groups_ = 0;
  Optimizer optimizer_ = Optimizer::kAdamW;
  float default_lr_ = 0.0f;
  std::vector<bool> frozen_;
  DType grad_dtype_ = DType::kBf16;
  DType param_dtype_ = DType::kBf16;
  std::vector<TensorInfo> tensors_;
  // Index of each tensor's first chunk among all chunks (tensor-major), and
  // the number of chunks last.
  std::vector<uint64_t> chunk_base_ = std::vector<uint64_t>(1, 0);

  mutable absl::Mutex mu_;
  std::string token_ ABSL_GUARDED_BY(mu_);
  // What this worker proves to shards (set by Join; read on the transport's
  // thread during Connect, which may run while mu_ is held).
  absl::Mutex identity_mu_;
  std::string data_plane_identity_ ABSL_GUARDED_BY(identity_mu_);
  std::string data_plane_key_ ABSL_GUARDED_BY(identity_mu_);
  bool joined_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  // The whole map of epoch_: what a delta from the coordinator applies to.
  v1::ShardMap map_ ABSL_GUARDED_BY(mu_);
  std::vector<std::vector<ChunkRoute>> routes_ ABSL_GUARDED_BY(mu_);
  std::vector<Retained> retained_ ABSL_GUARDED_BY(mu_);
  uint64_t resent_ ABSL_GUARDED_BY(mu_) = 0;
  // Tickets by index (Ticket's low 32 bits), and the free ones.
  std::vector<TicketState> tickets_ ABSL_GUARDED_BY(mu_);
  std::vector<uint32_t> free_tickets_ ABSL_GUARDED_BY(mu_);
  // Chunk requests in flight. Take/Give and the slots' fields under mu_;
  // SlotTable::At and Slot::holds from any thread (see Slot).
  SlotTable slots_;
  // Requests waiting for a newer map, in the order they stalled.
  std::map<uint64_t, Stalled> stalled_ ABSL_GUARDED_BY(mu_);
  // When the last reply came (RecoveryLoop's check for a map that moved
  // under requests nobody refuses).
  absl::Time last_reply_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  uint64_t next_stalled_ ABSL_GUARDED_BY(mu_) = 0;
  static constexpr size_t kRoundsKept = 64;
  std::vector<Round> rounds_ ABSL_GUARDED_BY(mu_) = std::vector<Round>(kRoundsKept);
  std::vector<Partials> partials_ ABSL_GUARDED_BY(mu_);
  std::vector<int> free_partials_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

v1::JobSpec ToJobSpec(const JobDef& def) {
  v1::JobSpec spec;
  spec.set_name(def.name);
  spec.set_world_size(def.world_size);
  for (const TensorDef& t : def.tensors) {
    auto* ts = spec.add_tensors();
    ts->set_name(t.name);
    for (int64_t d : t.shape) ts->add_shape(d);
    ts->set_group(t.group);
    ts->set_frozen(t.frozen);
  }
  for (const ParamGroup& g : def.param_groups) {
    auto* pg = spec.add_param_groups();
    pg->set_name(g.name);
    if (g.weight_decay) pg->set_weight_decay(*g.weight_decay);
    if (g.lr_mult) pg->set_lr_mult(*g.lr_mult);
    if (g.beta1) pg->set_beta1(*g.beta1);
    if (g.beta2) pg->set_beta2(*g.beta2);
    if (g.momentum) pg->set_momentum(*g.momentum);
  }
  spec.set_max_grad_norm(def.max_grad_norm);
  spec.set_keep_nonfinite(!def.skip_nonfinite);
  auto* o = spec.mutable_optimizer();
  o->set_kind(ToProto(def.optimizer.kind));
  o->set_lr(def.optimizer.lr);
  o->set_beta1(def.optimizer.beta1);
  o->set_beta2(def.optimizer.beta2);
  o->set_eps(def.optimizer.eps);
  o->set_weight_decay(def.optimizer.weight_decay);
  o->set_momentum(def.optimizer.momentum);
  o->set_grad_scale(def.optimizer.grad_scale);
  spec.set_grad_dtype(static_cast<v1::DType>(def.grad_dtype));
  spec.set_param_dtype(static_cast<v1::DType>(def.param_dtype));
  spec.set_max_chunk_bytes(def.max_chunk_bytes);
  spec.set_chunk_payload_bytes(def.chunk_payload_bytes);
  spec.mutable_checkpoint_policy()->set_every_steps(def.checkpoint.every_steps);
  spec.mutable_checkpoint_policy()->set_every_seconds(def.checkpoint.every_seconds);
  spec.mutable_checkpoint_policy()->set_keep_last(def.checkpoint.keep_last);
  spec.set_replication(def.replication);
  return spec;
}

void SplitDecayGroups(JobDef* def, float weight_decay) {
  ParamGroup decay;
  decay.name = "decay";
  decay.weight_decay = weight_decay;
  ParamGroup no_decay;
  no_decay.name = "no_decay";
  no_decay.weight_decay = 0.0f;
  def->param_groups = {decay, no_decay};
  for (TensorDef& t : def->tensors) t.group = t.shape.size() < 2 ? 1 : 0;
}

absl::StatusOr<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  if (options.coordinator_address.empty()) {
    return absl::InvalidArgumentError("ClientOptions.coordinator_address is required");
  }
  // A bad address list is refused before anything (the data plane) starts.
  if (auto list = ParseCoordinatorAddresses(options.coordinator_address); !list.ok()) {
    return list.status();
  }
  auto c = std::make_unique<ClientImpl>(options);
  if (auto s = c->Init(); !s.ok()) return s;
  return std::unique_ptr<Client>(std::move(c));
}

}  // namespace client
}  // namespace optimus
