#include "client/client.h"

#include <chrono>
#include <cstring>
#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/wire.h"
#include "grpcpp/grpcpp.h"
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
};

// One chunk request in flight.
struct Pending {
  Ticket ticket = 0;
  wire::Op op = wire::Op::kPush;
  void* dst = nullptr;          // Pull: where the chunk's bytes go.
  uint64_t expected_bytes = 0;  // Pull: payload size.
  uint64_t version = 0;         // Pull: wanted version.
  void* ep = nullptr;           // The shard's endpoint, to fail it if the shard dies.
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
    // Joins the progress thread: no reply handler runs after this.
    worker_.reset();
  }

  absl::Status Init() {
    transport::WorkerOptions wopts = options_.transport;
    // A shard that dies fails the requests waiting for its replies at once,
    // instead of leaving their tickets to time out.
    wopts.on_peer_failure = [this](transport::EndpointRef ep, const absl::Status& why) {
      FailRequestsTo(ep, why);
    };
    auto worker = transport::Worker::Create(wopts);
    if (!worker.ok()) return worker.status();
    worker_ = std::move(*worker);
    worker_->SetHandler(wire::kAmReply, [this](transport::IncomingMessage& m) { OnReply(m); });
    if (auto s = worker_->Start(); !s.ok()) return s;
    channel_ = grpc::CreateChannel(options_.coordinator_address,
                                   grpc::InsecureChannelCredentials());
    stub_ = v1::Coordinator::NewStub(channel_);
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
    }
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
    spec->mutable_checkpoint_policy()->set_every_steps(def.checkpoint.every_steps);
    spec->mutable_checkpoint_policy()->set_every_seconds(def.checkpoint.every_seconds);
    spec->mutable_checkpoint_policy()->set_keep_last(def.checkpoint.keep_last);
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
      v1::GetJobRequest greq;
      greq.set_job_id(join.job_id());
      grpc::ClientContext ctx;
      SetDeadline(&ctx);
      auto s = FromGrpc(stub_->GetJob(&ctx, greq, &job));
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

  absl::Status Adopt(const v1::GetJobResponse& job, uint32_t rank) {
    const v1::JobSpec& spec = job.spec();
    auto gd = DTypeFromInt(spec.grad_dtype());
    auto pd = DTypeFromInt(spec.param_dtype());
    if (!gd.ok()) return gd.status();
    if (!pd.ok()) return pd.status();
    std::map<uint64_t, transport::EndpointRef> eps;
    for (const auto& se : job.map().shards()) {
      auto ep = worker_->Connect(se.data_address());
      if (!ep.ok()) {
        return absl::Status(ep.status().code(), absl::StrCat("connecting to shard ",
                                                             se.shard_id(), ": ",
                                                             ep.status().message()));
      }
      eps[se.shard_id()] = *ep;
    }
    std::vector<TensorInfo> tensors;
    std::vector<std::vector<ChunkRoute>> routes(spec.tensors_size());
    for (const auto& t : spec.tensors()) {
      TensorInfo info;
      info.name = t.name();
      info.num_elems = 1;
      for (int64_t d : t.shape()) {
        info.shape.push_back(d);
        info.num_elems *= static_cast<uint64_t>(d);
      }
      tensors.push_back(std::move(info));
    }
    for (const auto& c : job.map().chunks()) {
      if (c.tensor() >= routes.size()) {
        return absl::InternalError(absl::StrCat("shard map names tensor ", c.tensor(),
                                                " but the job has ", routes.size()));
      }
      auto it = eps.find(c.shard_id());
      if (it == eps.end()) {
        return absl::InternalError(absl::StrCat("shard map places chunk on unknown shard ",
                                                c.shard_id()));
      }
      routes[c.tensor()].push_back(
          ChunkRoute{c.chunk(), c.offset_elems(), c.num_elems(), c.shard_id(), it->second});
    }
    for (size_t t = 0; t < routes.size(); ++t) {
      std::sort(routes[t].begin(), routes[t].end(),
                [](const ChunkRoute& a, const ChunkRoute& b) { return a.chunk < b.chunk; });
      tensors[t].num_chunks = static_cast<uint32_t>(routes[t].size());
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
    absl::MutexLock lock(&mu_);
    job_id_ = job.job_id();
    epoch_ = job.map().epoch();
    rank_ = rank;
    world_size_ = spec.world_size();
    resume_step_ = std::max<uint64_t>(job.resume_step(), 1);
    grad_dtype_ = *gd;
    param_dtype_ = *pd;
    tensors_ = std::move(tensors);
    routes_ = std::move(routes);
    joined_ = true;
    OPTIMUS_LOG(Debug, kLog, "joined job ", job_id_, " as rank ", rank_, " of ", world_size_);
    return absl::OkStatus();
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

  absl::Status CheckTensor(uint32_t tensor, size_t num_elems) const {
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

  // Sends one request per chunk of `tensor` and returns the ticket.
  absl::StatusOr<Ticket> Issue(wire::Op op, uint32_t tensor, uint64_t step, const void* src,
                               void* dst, size_t num_elems, DType dtype) {
    {
      absl::MutexLock lock(&mu_);
      if (auto s = CheckTensor(tensor, num_elems); !s.ok()) return s;
    }
    const auto& routes = routes_[tensor];
    const size_t elem_bytes = DTypeSize(dtype);
    Ticket ticket;
    std::vector<uint64_t> ids(routes.size());
    {
      absl::MutexLock lock(&mu_);
      ticket = next_ticket_++;
      tickets_[ticket].remaining = static_cast<uint32_t>(routes.size());
      for (size_t i = 0; i < routes.size(); ++i) {
        ids[i] = next_request_++;
        Pending p;
        p.ticket = ticket;
        p.op = op;
        p.version = step;
        if (op == wire::Op::kPull) {
          p.dst = static_cast<uint8_t*>(dst) + routes[i].offset_elems * elem_bytes;
          p.expected_bytes = routes[i].num_elems * elem_bytes;
        }
        p.ep = routes[i].ep.ep;
        pending_[ids[i]] = p;
      }
    }
    for (size_t i = 0; i < routes.size(); ++i) {
      const ChunkRoute& r = routes[i];
      wire::RequestHeader h;
      h.op = static_cast<uint16_t>(op);
      h.job_id = job_id_;
      h.map_epoch = epoch_;
      h.tensor = tensor;
      h.chunk = r.chunk;
      h.step = step;
      h.rank = rank_;
      h.dtype = static_cast<uint8_t>(dtype);
      h.num_bytes = r.num_elems * elem_bytes;
      h.request_id = ids[i];
      const void* payload = nullptr;
      size_t payload_bytes = 0;
      if (op != wire::Op::kPull) {
        payload = static_cast<const uint8_t*>(src) + r.offset_elems * elem_bytes;
        payload_bytes = r.num_elems * elem_bytes;
      }
      const uint64_t id = ids[i];
      worker_->Send(r.ep, wire::kAmRequest, wire::AsBytes(h), payload, payload_bytes,
                    [this, id](absl::Status s) {
                      if (!s.ok()) Complete(id, s);
                    });
    }
    return ticket;
  }

  absl::Status InitTensor(uint32_t tensor, const float* values, size_t num_elems) override {
    auto t = Issue(wire::Op::kInit, tensor, 0, values, nullptr, num_elems, DType::kFp32);
    if (!t.ok()) return t.status();
    return Wait(*t, options_.rpc_timeout);
  }

  absl::StatusOr<Ticket> Push(uint32_t tensor, uint64_t step, const void* grad,
                              size_t num_elems) override {
    if (step == 0) return absl::InvalidArgumentError("steps start at 1");
    return Issue(wire::Op::kPush, tensor, step, grad, nullptr, num_elems, grad_dtype_);
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

  // Fails every request still waiting for a reply over `ep`.
  void FailRequestsTo(transport::EndpointRef ep, const absl::Status& why) {
    std::vector<uint64_t> ids;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& [id, p] : pending_) {
        if (p.ep == ep.ep) ids.push_back(id);
      }
    }
    const absl::Status s = absl::UnavailableError(
        absl::StrCat("shard failed with the request in flight: ", why.message()));
    for (uint64_t id : ids) Complete(id, s);
  }

  // Resolves one chunk request; the first error wins for its ticket.
  void Complete(uint64_t request_id, const absl::Status& s) {
    absl::MutexLock lock(&mu_);
    auto it = pending_.find(request_id);
    if (it == pending_.end()) return;  // Already completed (send error + reply).
    auto& t = tickets_[it->second.ticket];
    if (!s.ok() && t.status.ok()) t.status = s;
    --t.remaining;
    pending_.erase(it);
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
        OPTIMUS_LOG(Warning, kLog, "reply for unknown request ", id, ": ",
                    reply->status.ToString());
        return;
      }
      p = it->second;
    }
    if (!reply->status.ok() || p.op != wire::Op::kPull) return Complete(id, reply->status);
    if (msg.payload_size() != p.expected_bytes || reply->header.param_version != p.version) {
      return Complete(id, absl::InternalError(absl::StrCat(
                              "pull reply carries ", msg.payload_size(), " bytes of version ",
                              reply->header.param_version, ", expected ", p.expected_bytes,
                              " bytes of version ", p.version)));
    }
    msg.ReceiveInto(p.dst, [this, id](absl::Status s) { Complete(id, s); });
  }

 private:
  const ClientOptions options_;
  std::unique_ptr<transport::Worker> worker_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;

  // Fixed by Join; read without the lock afterwards (joined_ is set last
  // under mu_ and never cleared).
  uint64_t job_id_ = 0;
  uint64_t epoch_ = 0;
  uint32_t rank_ = 0;
  uint32_t world_size_ = 0;
  uint64_t resume_step_ = 1;
  DType grad_dtype_ = DType::kBf16;
  DType param_dtype_ = DType::kBf16;
  std::vector<TensorInfo> tensors_;
  std::vector<std::vector<ChunkRoute>> routes_;

  mutable absl::Mutex mu_;
  bool joined_ ABSL_GUARDED_BY(mu_) = false;
  Ticket next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_request_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<Ticket, TicketState> tickets_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, Pending> pending_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

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
