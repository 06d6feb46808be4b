#include "client/client.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
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

struct ChunkRoute {
  uint32_t chunk = 0;
  uint64_t offset_elems = 0;
  uint64_t num_elems = 0;
  uint64_t shard_id = 0;
  transport::EndpointRef ep;
};

struct TicketState {
  uint32_t remaining = 0;
  absl::Status status;  // First error seen.
  wire::Op op = wire::Op::kPush;
  uint32_t tensor = 0;
  uint64_t step = 0;
};

// One chunk request in flight (or waiting to be sent again).
struct Pending {
  Ticket ticket = 0;            // 0: a background resend nobody waits for.
  wire::Op op = wire::Op::kPush;
  uint32_t tensor = 0;
  uint32_t route = 0;           // Index into the tensor's routes.
  uint64_t step = 0;            // Push: step; pull: wanted version.
  const void* src = nullptr;    // Push/init: the whole tensor's buffer.
  void* dst = nullptr;          // Pull: the whole tensor's buffer.
  DType dtype = DType::kFp32;
  uint8_t flags = 0;            // wire::RequestFlags.
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
  // Waiting to be sent again: the map epoch needed first, since when, why.
  uint64_t min_epoch = 0;
  absl::Time stalled_since;
  absl::Status why;
};

// A push kept until the pull of the next version of its tensor completes,
// to send again if its chunk's shard changes.
struct Retained {
  bool valid = false;
  uint64_t step = 0;
  const void* src = nullptr;
  uint32_t step_flags = 0;
  float lr = 0.0f;
  float grad_mult = 0.0f;
};

// The clipping round of one step on this client: every chunk's partial sum
// of squares (from the push replies), then the decision it commits.
struct Round {
  std::vector<std::vector<double>> partials;  // [tensor][route]
  std::vector<std::vector<bool>> have;
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
      stopping_ = true;
    }
    if (recovery_.joinable()) recovery_.join();
    // Joins the progress thread: no reply handler runs after this.
    worker_.reset();
  }

  absl::Status Init() {
    transport::WorkerOptions wopts = options_.transport;
    // A shard that dies fails (or, with a replica, re-routes) the requests
    // waiting for its replies at once, instead of leaving them to time out.
    wopts.on_peer_failure = [this](transport::EndpointRef ep, const absl::Status& why) {
      OnPeerFailure(ep, why);
    };
    auto worker = transport::Worker::Create(wopts);
    if (!worker.ok()) return worker.status();
    worker_ = std::move(*worker);
    worker_->SetHandler(wire::kAmReply, [this](transport::IncomingMessage& m) { OnReply(m); });
    if (auto s = worker_->Start(); !s.ok()) return s;
    channel_ = grpc::CreateChannel(options_.coordinator_address,
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Coordinator::NewStub(channel_);
    recovery_ = std::thread([this] { RecoveryLoop(); });
    return absl::OkStatus();
  }

  void SetDeadline(grpc::ClientContext* ctx) const {
    ctx->set_deadline(std::chrono::system_clock::now() +
                      absl::ToChronoMilliseconds(options_.rpc_timeout));
  }

  absl::Status Annotate(const absl::Status& s, absl::string_view what) const {
    if (s.ok()) return s;
    return absl::Status(s.code(), absl::StrCat(what, " (coordinator ",
                                               options_.coordinator_address, "): ", s.message()));
  }

  absl::Status CreateJob(const JobDef& def) override {
    v1::CreateJobRequest req;
    v1::JobSpec* spec = req.mutable_spec();
    spec->set_name(def.name);
    spec->set_world_size(def.world_size);
    for (const TensorDef& t : def.tensors) {
      auto* ts = spec->add_tensors();
      ts->set_name(t.name);
      for (int64_t d : t.shape) ts->add_shape(d);
      ts->set_group(t.group);
      ts->set_frozen(t.frozen);
    }
    for (const ParamGroup& g : def.param_groups) {
      auto* pg = spec->add_param_groups();
      pg->set_name(g.name);
      if (g.weight_decay) pg->set_weight_decay(*g.weight_decay);
      if (g.lr_mult) pg->set_lr_mult(*g.lr_mult);
      if (g.beta1) pg->set_beta1(*g.beta1);
      if (g.beta2) pg->set_beta2(*g.beta2);
      if (g.momentum) pg->set_momentum(*g.momentum);
    }
    spec->set_max_grad_norm(def.max_grad_norm);
    spec->set_keep_nonfinite(!def.skip_nonfinite);
    auto* o = spec->mutable_optimizer();
    o->set_kind(ToProto(def.optimizer.kind));
    o->set_lr(def.optimizer.lr);
    o->set_beta1(def.optimizer.beta1);
    o->set_beta2(def.optimizer.beta2);
    o->set_eps(def.optimizer.eps);
    o->set_weight_decay(def.optimizer.weight_decay);
    o->set_momentum(def.optimizer.momentum);
    o->set_grad_scale(def.optimizer.grad_scale);
    spec->set_grad_dtype(static_cast<v1::DType>(def.grad_dtype));
    spec->set_param_dtype(static_cast<v1::DType>(def.param_dtype));
    spec->set_max_chunk_bytes(def.max_chunk_bytes);
    spec->set_chunk_payload_bytes(def.chunk_payload_bytes);
    spec->mutable_checkpoint_policy()->set_every_steps(def.checkpoint.every_steps);
    spec->mutable_checkpoint_policy()->set_every_seconds(def.checkpoint.every_seconds);
    spec->mutable_checkpoint_policy()->set_keep_last(def.checkpoint.keep_last);
    spec->set_replication(def.replication);
    v1::CreateJobResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    return Annotate(FromGrpc(stub_->CreateJob(&ctx, req, &resp)),
                    absl::StrCat("creating job '", def.name, "'"));
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
    {
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      auto s = FromGrpc(stub_->JoinJob(&ctx, req, &join));
      if (!s.ok()) return Annotate(s, absl::StrCat("joining job '", name, "'"));
    }
    // Wait for the shards to load the job.
    v1::GetJobResponse job;
    const absl::Time give_up = absl::Now() + options_.ready_timeout;
    for (;;) {
      auto s = FetchJob(join.job_id(), &job);
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

  absl::Status FetchJob(uint64_t job_id, v1::GetJobResponse* job) {
    v1::GetJobRequest greq;
    greq.set_job_id(job_id);
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    return FromGrpc(stub_->GetJob(&ctx, greq, job));
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
    joined_ = true;
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
    v1::LeaveJobResponse resp;
    grpc::ClientContext ctx;
    SetDeadline(&ctx);
    return Annotate(FromGrpc(stub_->LeaveJob(&ctx, req, &resp)),
                    absl::StrCat("leaving job '", job_name_, "'"));
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
  std::string transports_in_use() const override { return worker_->transports_in_use(); }

  absl::Status CheckTensor(uint32_t tensor, size_t num_elems) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!joined_) return absl::FailedPreconditionError("join a job first");
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

  // Registers one chunk request under the current map; the caller sends it
  // with SendPending after dropping the lock.
  uint64_t AddPendingLocked(Pending p) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const ChunkRoute& r = routes_[p.tensor][p.route];
    p.ep = r.ep.ep;
    p.epoch = epoch_;
    p.expected_bytes = p.op == wire::Op::kPull ? r.num_elems * DTypeSize(p.dtype) : 0;
    p.offset_bytes = r.offset_elems * DTypeSize(p.dtype) * p.arrays;
    const uint64_t id = next_request_++;
    pending_[id] = p;
    return id;
  }

  // Sends pending request `id` (registered by AddPendingLocked).
  void SendPending(uint64_t id) {
    wire::RequestHeader h;
    const void* payload = nullptr;
    size_t payload_bytes = 0;
    transport::EndpointRef ep;
    {
      absl::MutexLock lock(&mu_);
      auto it = pending_.find(id);
      if (it == pending_.end()) return;
      const Pending& p = it->second;
      const ChunkRoute& r = routes_[p.tensor][p.route];
      const size_t elem_bytes = DTypeSize(p.dtype);
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
      h.request_id = id;
      const bool no_payload = p.op == wire::Op::kPull || p.op == wire::Op::kCommit ||
                              (p.step_flags & wire::kPushNoGrad) != 0;
      if (no_payload) {
        if (p.op != wire::Op::kPull) h.num_bytes = 0;
      } else {
        payload = static_cast<const uint8_t*>(p.src) + r.offset_elems * elem_bytes * p.arrays;
        payload_bytes = r.num_elems * elem_bytes * p.arrays;
      }
      ep.ep = p.ep;
    }
    worker_->Send(ep, wire::kAmRequest, wire::AsBytes(h), payload, payload_bytes,
                  [this, id](absl::Status s) {
                    if (!s.ok()) Failed(id, s, /*peer_failed=*/true, 0);
                  });
  }

  // Sends one request per chunk of `tensor` and returns the ticket.
  // `proto` carries the fields every chunk request shares.
  absl::StatusOr<Ticket> Issue(wire::Op op, uint32_t tensor, uint64_t step, const void* src,
                               void* dst, size_t num_elems, DType dtype,
                               const Pending& proto = Pending{}) {
    Ticket ticket;
    std::vector<uint64_t> ids;
    {
      absl::MutexLock lock(&mu_);
      if (auto s = CheckTensor(tensor, num_elems); !s.ok()) return s;
      if (op == wire::Op::kPush && round_) StartRoundLocked(step);
      ticket = next_ticket_++;
      const uint32_t n = static_cast<uint32_t>(routes_[tensor].size());
      TicketState& ts = tickets_[ticket];
      ts.remaining = n;
      ts.op = op;
      ts.tensor = tensor;
      ts.step = step;
      for (uint32_t i = 0; i < n; ++i) {
        Pending p = proto;
        p.ticket = ticket;
        p.op = op;
        p.tensor = tensor;
        p.route = i;
        p.step = step;
        p.src = src;
        p.dst = dst;
        p.dtype = dtype;
        ids.push_back(AddPendingLocked(p));
      }
      if (op == wire::Op::kPush) {
        retained_[tensor] =
            Retained{true, step, src, proto.step_flags, proto.lr, proto.grad_mult};
      }
    }
    for (uint64_t id : ids) SendPending(id);
    return ticket;
  }

  absl::Status InitTensor(uint32_t tensor, const float* values, size_t num_elems) override {
    auto t = Issue(wire::Op::kInit, tensor, 0, values, nullptr, num_elems, DType::kFp32);
    if (!t.ok()) return t.status();
    return Wait(*t, options_.rpc_timeout);
  }

  absl::Status InitTensorState(uint32_t tensor, const TensorState& state,
                               size_t num_elems) override {
    uint32_t arrays;
    {
      absl::MutexLock lock(&mu_);
      if (auto s = CheckTensor(tensor, num_elems); !s.ok()) return s;
      arrays = num_arrays_;
    }
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
    if (!std::isfinite(options.lr) || options.lr < 0.0f) {
      return absl::InvalidArgumentError(absl::StrCat("push lr ", options.lr, " is not >= 0"));
    }
    if (!std::isfinite(options.grad_mult) || options.grad_mult < 0.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat("push grad_mult ", options.grad_mult, " is not >= 0"));
    }
    Pending proto;
    // Resolved here, so that ranks that leave it 0 and ranks that spell out
    // the job's value agree.
    proto.lr = options.lr > 0.0f ? options.lr : default_lr_;
    proto.grad_mult = options.grad_mult > 0.0f ? options.grad_mult : 1.0f;
    // Fixed by Join (read without the lock, as tensors_).
    if (tensor < frozen_.size() && frozen_[tensor]) grad = nullptr;
    if (grad == nullptr) proto.step_flags |= wire::kPushNoGrad;
    return Issue(wire::Op::kPush, tensor, step, grad, nullptr, num_elems, grad_dtype_, proto);
  }

  // ---- The clipping round ----------------------------------------------------

  void StartRoundLocked(uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (rounds_.count(step) != 0) return;
    Round& r = rounds_[step];
    r.partials.resize(routes_.size());
    r.have.resize(routes_.size());
    for (size_t t = 0; t < routes_.size(); ++t) {
      r.partials[t].assign(routes_[t].size(), 0.0);
      r.have[t].assign(routes_[t].size(), false);
      r.missing += routes_[t].size();
    }
    while (rounds_.size() > kRoundsKept) rounds_.erase(rounds_.begin());
  }

  // A chunk's partial for `step` arrived. When it was the last one, decides
  // the step and returns the commits to send.
  std::vector<uint64_t> RecordPartialLocked(uint32_t tensor, uint32_t route, uint64_t step,
                                            double partial) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<uint64_t> commits;
    auto it = rounds_.find(step);
    if (it == rounds_.end()) return commits;
    Round& r = it->second;
    if (tensor >= r.have.size() || route >= r.have[tensor].size() || r.have[tensor][route]) {
      return commits;
    }
    r.have[tensor][route] = true;
    r.partials[tensor][route] = partial;
    if (--r.missing != 0) return commits;
    // Every rank adds the same partials in the same order: the same norm
    // and the same decision on every rank.
    double total = 0.0;
    for (const auto& per : r.partials) {
      for (double x : per) total += x;
    }
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
    for (uint32_t t = 0; t < routes_.size(); ++t) {
      for (uint32_t i = 0; i < routes_[t].size(); ++i) {
        commits.push_back(AddPendingLocked(CommitFor(t, i, step, r.report)));
      }
    }
    return commits;
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

  bool RoundDecided(uint64_t step) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = rounds_.find(step);
    return it == rounds_.end() || it->second.decided;
  }

  absl::StatusOr<StepReport> StepResult(uint64_t step, absl::Duration timeout) override {
    absl::MutexLock lock(&mu_);
    if (!joined_) return absl::FailedPreconditionError("join a job first");
    if (!round_) {
      return absl::FailedPreconditionError(
          "the job neither clips (max_grad_norm) nor skips non-finite steps: no step report");
    }
    if (rounds_.count(step) == 0) {
      return absl::NotFoundError(absl::StrCat("no pushes of step ", step, " on this client (or "
                                              "too long ago: the last ", kRoundsKept, " are kept)"));
    }
    struct Args {
      const ClientImpl* self;
      uint64_t step;
    } args{this, step};
    const bool done = mu_.AwaitWithTimeout(
        absl::Condition(
            +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->self->RoundDecided(a->step); },
            &args),
        timeout);
    auto it = rounds_.find(step);
    if (it == rounds_.end()) return absl::NotFoundError(absl::StrCat("step ", step, " forgotten"));
    if (!done) {
      return absl::DeadlineExceededError(absl::StrCat(
          "step ", step, ": ", it->second.missing,
          " chunks have not answered this rank's pushes yet (every tensor must be pushed, by "
          "every rank) after ", absl::FormatDuration(timeout)));
    }
    return it->second.report;
  }

  absl::StatusOr<Ticket> Pull(uint32_t tensor, uint64_t version, void* dst,
                              size_t num_elems) override {
    if (version == 0) return absl::InvalidArgumentError("versions start at 1 (initial values)");
    return Issue(wire::Op::kPull, tensor, version, nullptr, dst, num_elems, param_dtype_);
  }

  bool TicketDone(Ticket t) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = tickets_.find(t);
    return it == tickets_.end() || it->second.remaining == 0;
  }

  absl::Status Wait(Ticket ticket, absl::Duration timeout) override {
    absl::MutexLock lock(&mu_);
    if (tickets_.find(ticket) == tickets_.end()) {
      return absl::NotFoundError(absl::StrCat("unknown ticket ", ticket,
                                              " (never issued, or already waited for)"));
    }
    struct Args {
      const ClientImpl* self;
      Ticket t;
    } args{this, ticket};
    const bool done = mu_.AwaitWithTimeout(
        absl::Condition(
            +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->self->TicketDone(a->t); },
            &args),
        timeout);
    if (!done) {
      return absl::DeadlineExceededError(absl::StrCat(
          "ticket ", ticket, " not done after ", absl::FormatDuration(timeout), " (",
          tickets_[ticket].remaining, " chunks outstanding)"));
    }
    absl::Status s = tickets_[ticket].status;
    tickets_.erase(ticket);
    return s;
  }

  void OnPeerFailure(transport::EndpointRef ep, const absl::Status& why) {
    std::vector<uint64_t> ids;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [id, p] : pending_) {
        if (p.ep == ep.ep) ids.push_back(id);
      }
    }
    for (uint64_t id : ids) Failed(id, why, /*peer_failed=*/true, 0);
  }

  // A chunk request failed. When its shard was lost or said the map moved
  // on, it waits for a newer map and is sent again; otherwise its ticket
  // fails.
  void Failed(uint64_t id, const absl::Status& why, bool peer_failed, uint32_t reply_flags) {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(id);
    if (it == pending_.end()) return;
    Pending& p = it->second;
    const bool refresh = (reply_flags & wire::kReplyRefreshMap) != 0;
    // A lost peer is judged by the coordinator: a replica takes over or a
    // drain moved the chunk (a newer map: send again), or the job FAILED
    // (the recovery thread fails the ticket then, as soon as it is known).
    if (!refresh && !peer_failed) return CompleteLocked(id, why);
    // A shard that has not loaded our (newer) map yet: send again under the
    // same map. Otherwise wait for a map newer than the one it was sent under.
    const bool shard_behind = refresh && why.code() == absl::StatusCode::kUnavailable;
    p.min_epoch = shard_behind ? p.epoch : p.epoch + 1;
    p.stalled_since = absl::Now();
    p.why = why;
    stalled_[id] = p;
    pending_.erase(it);
    OPTIMUS_LOG(Debug, kLog, "request ", id, " waits for map epoch ", p.min_epoch, ": ",
                why.ToString());
  }

  // Resolves one chunk request; the first error wins for its ticket.
  void CompleteLocked(uint64_t request_id, const absl::Status& s)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = pending_.find(request_id);
    if (it == pending_.end()) return;  // Already completed (send error + reply).
    const Ticket ticket = it->second.ticket;
    pending_.erase(it);
    if (ticket == 0) {
      if (!s.ok()) {
        OPTIMUS_LOG(Warning, kLog, "background request (a resent push or a commit) failed: ",
                    s.ToString());
      }
      return;
    }
    auto& t = tickets_[ticket];
    if (!s.ok() && t.status.ok()) t.status = s;
    if (--t.remaining == 0 && t.status.ok() && t.op == wire::Op::kPull) {
      // The next version of this tensor is in hand: its push is applied.
      Retained& r = retained_[t.tensor];
      if (r.valid && r.step + 1 <= t.step) r.valid = false;
    }
  }

  void Complete(uint64_t request_id, const absl::Status& s) {
    absl::MutexLock lock(&mu_);
    CompleteLocked(request_id, s);
  }

  void OnReply(transport::IncomingMessage& msg) {
    auto reply = wire::ParseReply(msg.header());
    if (!reply.ok()) {
      OPTIMUS_LOG(Warning, kLog, "dropping malformed reply: ", reply.status().ToString());
      return;
    }
    const uint64_t id = reply->header.request_id;
    Pending p;
    {
      absl::MutexLock lock(&mu_);
      auto it = pending_.find(id);
      if (it == pending_.end()) {
        OPTIMUS_LOG(Debug, kLog, "reply for unknown request ", id, ": ",
                    reply->status.ToString());
        return;
      }
      p = it->second;
    }
    if (!reply->status.ok()) {
      return Failed(id, reply->status, /*peer_failed=*/false, reply->header.flags);
    }
    if (p.op == wire::Op::kPush && (reply->header.flags & wire::kReplyPartial) != 0) {
      std::vector<uint64_t> commits;
      {
        absl::MutexLock lock(&mu_);
        commits = RecordPartialLocked(p.tensor, p.route, p.step, reply->header.grad_sum_squares);
        CompleteLocked(id, reply->status);
      }
      for (uint64_t c : commits) SendPending(c);
      return;
    }
    if (p.op != wire::Op::kPull) return Complete(id, reply->status);
    if (msg.payload_size() != p.expected_bytes || reply->header.param_version != p.step) {
      return Complete(id, absl::InternalError(absl::StrCat(
                              "pull reply carries ", msg.payload_size(), " bytes of version ",
                              reply->header.param_version, ", expected ", p.expected_bytes,
                              " bytes of version ", p.step)));
    }
    msg.ReceiveInto(static_cast<uint8_t*>(p.dst) + p.offset_bytes,
                    [this, id](absl::Status s) { Complete(id, s); });
  }

  // ---- Failover ------------------------------------------------------------
  // A thread that, while requests are stalled, polls the coordinator for the
  // job's map, adopts a newer one (connecting to new shards), sends again the
  // pushes whose chunk changed shard, and re-sends the stalled requests.

  bool HasStalledOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !stalled_.empty();
  }

  void RecoveryLoop() {
    for (;;) {
      uint64_t job_id;
      {
        absl::MutexLock lock(&mu_);
        mu_.Await(absl::Condition(this, &ClientImpl::HasStalledOrStopping));
        if (stopping_) return;
        job_id = job_id_;
      }
      v1::GetJobResponse job;
      absl::Status fetched = FetchJob(job_id, &job);
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
          if (absl::Status s = AdoptMap(job.map()); !s.ok()) {
            OPTIMUS_LOG(Warning, kLog, "cannot use map epoch ", job.map().epoch(), ": ",
                        s.ToString());
          }
        }
      } else {
        OPTIMUS_LOG(Debug, kLog, "failover: coordinator: ", fetched.ToString());
      }
      std::vector<uint64_t> resend;
      std::vector<std::pair<uint64_t, absl::Status>> expired;
      {
        absl::MutexLock lock(&mu_);
        const absl::Time now = absl::Now();
        for (auto it = stalled_.begin(); it != stalled_.end();) {
          Pending p = it->second;
          if (p.min_epoch <= epoch_) {
            p.min_epoch = 0;
            if (p.op == wire::Op::kPush) p.flags |= wire::kRequestResend;
            resend.push_back(AddPendingLocked(p));
            ++resent_;
            it = stalled_.erase(it);
          } else if (now - p.stalled_since > options_.ready_timeout) {
            // Park it as pending again so CompleteLocked resolves its ticket.
            const uint64_t id = next_request_++;
            pending_[id] = p;
            expired.emplace_back(
                id, absl::UnavailableError(absl::StrCat(
                        "no new shard map for job '", job_name_, "' within ",
                        absl::FormatDuration(options_.ready_timeout), " after: ",
                        p.why.message())));
            it = stalled_.erase(it);
          } else {
            ++it;
          }
        }
        for (const auto& [id, s] : expired) CompleteLocked(id, s);
      }
      for (uint64_t id : resend) SendPending(id);
      if (resend.empty()) absl::SleepFor(absl::Milliseconds(10));
    }
  }

  void FailAllStalled(const absl::Status& why) {
    absl::MutexLock lock(&mu_);
    std::vector<uint64_t> ids;
    for (auto& [id, p] : stalled_) {
      const uint64_t nid = next_request_++;
      pending_[nid] = p;
      ids.push_back(nid);
    }
    stalled_.clear();
    for (uint64_t id : ids) CompleteLocked(id, why);
  }

  // Switches to a newer map and sends again the retained pushes whose chunk
  // is now on another shard (the old one may have taken them and died).
  absl::Status AdoptMap(const v1::ShardMap& map) {
    auto routes = BuildRoutes(map, tensors_);
    if (!routes.ok()) return routes.status();
    std::vector<uint64_t> resend;
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
          p.src = r.src;
          p.dtype = grad_dtype_;
          p.flags = wire::kRequestResend;
          p.step_flags = r.step_flags;
          p.lr = r.lr;
          p.grad_mult = r.grad_mult;
          resend.push_back(AddPendingLocked(p));
          ++resent_;
          // The step's commit too, if this rank decided it already (the
          // new primary may not have had it).
          auto round = rounds_.find(r.step);
          if (round != rounds_.end() && round->second.decided) {
            resend.push_back(AddPendingLocked(CommitFor(t, i, r.step, round->second.report)));
          }
        }
      }
    }
    for (uint64_t id : resend) SendPending(id);
    return absl::OkStatus();
  }

 private:
  const ClientOptions options_;
  std::unique_ptr<transport::Worker> worker_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::thread recovery_;
  // Endpoints by shard id; used by Join and the recovery thread only.
  std::map<uint64_t, transport::EndpointRef> eps_;

  // Fixed by Join; read without the lock afterwards (joined_ is set last
  // under mu_ and never cleared).
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

  mutable absl::Mutex mu_;
  bool joined_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::vector<ChunkRoute>> routes_ ABSL_GUARDED_BY(mu_);
  std::vector<Retained> retained_ ABSL_GUARDED_BY(mu_);
  uint64_t resent_ ABSL_GUARDED_BY(mu_) = 0;
  Ticket next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_request_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<Ticket, TicketState> tickets_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Pending> stalled_ ABSL_GUARDED_BY(mu_);
  static constexpr size_t kRoundsKept = 64;
  std::map<uint64_t, Round> rounds_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

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
  auto c = std::make_unique<ClientImpl>(options);
  if (auto s = c->Init(); !s.ok()) return s;
  return std::unique_ptr<Client>(std::move(c));
}

}  // namespace client
}  // namespace optimus
