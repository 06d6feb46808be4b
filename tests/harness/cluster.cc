#include "tests/harness/cluster.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/dtype.h"
#include "common/grpc_limits.h"
#include "common/grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/optimizer_spec.h"

namespace optimus {
namespace harness {

namespace {

// Tensor t's element i is element i + t * kTensorStride of one long
// sequence, so that tensors of one job get different values.
constexpr size_t kTensorStride = 100000;

size_t NumElems(const client::TensorDef& t) {
  size_t n = 1;
  for (int64_t d : t.shape) n *= static_cast<size_t>(d);
  return n;
}

absl::StatusOr<kernels::OptimizerKind> KindOf(client::Optimizer o) {
  switch (o) {
    case client::Optimizer::kAdamW:
      return kernels::OptimizerKind::kAdamW;
    case client::Optimizer::kAdam:
      return kernels::OptimizerKind::kAdam;
    case client::Optimizer::kSgd:
      return kernels::OptimizerKind::kSgd;
    case client::Optimizer::kLion:
      return kernels::OptimizerKind::kLion;
  }
  return absl::InvalidArgumentError("unknown optimizer kind");
}

}  // namespace

std::string TransportName(TransportKind kind) {
  return kind == TransportKind::kLoopback ? "loopback" : "ucx";
}

float InitialValue(uint32_t tensor, size_t i) {
  return std::cos(0.37f * static_cast<float>(i + tensor * kTensorStride));
}

float Gradient(float param, uint64_t step, uint32_t rank, uint32_t tensor, size_t i) {
  return 0.5f * param + std::sin(0.001f * static_cast<float>(i + tensor * kTensorStride) +
                                 0.1f * step + rank);
}

size_t BitMismatches(const std::vector<float>& got, const std::vector<float>& want) {
  if (got.size() != want.size()) return SIZE_MAX;
  size_t n = 0;
  for (size_t i = 0; i < got.size(); ++i) n += std::memcmp(&got[i], &want[i], sizeof(float)) != 0;
  return n;
}

absl::StatusOr<std::vector<float>> ReferenceParams(const client::JobDef& def, uint32_t tensor,
                                                   uint64_t steps) {
  if (tensor >= def.tensors.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("job ", def.name, " has no tensor ", tensor));
  }
  if (def.world_size == 0) return absl::InvalidArgumentError("world_size 0");
  auto kind = KindOf(def.optimizer.kind);
  if (!kind.ok()) return kind.status();
  kernels::OptimizerHyper h;
  h.kind = *kind;
  h.lr = def.optimizer.lr;
  h.beta1 = def.optimizer.beta1;
  h.beta2 = def.optimizer.beta2;
  h.eps = def.optimizer.eps;
  h.weight_decay = def.optimizer.weight_decay;
  h.momentum = def.optimizer.momentum;
  // Zero fields take the kind's defaults, as the coordinator fills them.
  if (absl::Status s = kernels::FillDefaultsAndValidate(&h); !s.ok()) return s;
  const float grad_scale = def.optimizer.grad_scale > 0
                               ? def.optimizer.grad_scale
                               : 1.0f / static_cast<float>(def.world_size);

  const size_t n = NumElems(def.tensors[tensor]);
  std::vector<float> master(n), m(n, 0.f), v(n, 0.f), published(n);
  for (size_t i = 0; i < n; ++i) master[i] = InitialValue(tensor, i);
  std::vector<uint8_t> out(n * DTypeSize(def.param_dtype));
  kernels::CastFromFp32(master.data(), n, out.data(), def.param_dtype);
  kernels::CastToFp32(out.data(), def.param_dtype, n, published.data());
  std::vector<std::vector<uint8_t>> grads(def.world_size,
                                          std::vector<uint8_t>(n * DTypeSize(def.grad_dtype)));
  std::vector<float> g(n);
  for (uint64_t step = 1; step <= steps; ++step) {
    std::vector<const void*> ptrs;
    for (uint32_t r = 0; r < def.world_size; ++r) {
      for (size_t i = 0; i < n; ++i) g[i] = Gradient(published[i], step, r, tensor, i);
      kernels::CastFromFp32(g.data(), n, grads[r].data(), def.grad_dtype);
      ptrs.push_back(grads[r].data());
    }
    kernels::StepInputs in;
    in.grads = ptrs;
    in.grad_dtype = def.grad_dtype;
    in.grad_scale = grad_scale;
    in.step = static_cast<int64_t>(step);
    absl::Status s = kernels::FusedStepScalar(h, in, n, {master.data(), m.data(), v.data()},
                                              out.data(), def.param_dtype);
    if (!s.ok()) return s;
    kernels::CastToFp32(out.data(), def.param_dtype, n, published.data());
  }
  return published;
}

client::JobDef SmallJob(const std::string& name, uint32_t world_size, uint64_t max_chunk_bytes) {
  client::JobDef def;
  def.name = name;
  def.world_size = world_size;
  def.tensors = {{"weight", {200, 257}}, {"bias", {37}}};
  def.optimizer.kind = client::Optimizer::kAdamW;
  def.optimizer.lr = 1e-2f;
  def.optimizer.weight_decay = 0.1f;
  def.grad_dtype = DType::kBf16;
  def.param_dtype = DType::kBf16;
  def.max_chunk_bytes = max_chunk_bytes;
  return def;
}

uint64_t ResidentBytes() {
  long pages = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
  std::fclose(f);
  return static_cast<uint64_t>(resident) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
}

absl::StatusOr<std::string> NewTempDir(absl::string_view prefix) {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string tmpl = absl::StrCat(base != nullptr ? base : "/tmp", "/", prefix, "XXXXXX");
  if (mkdtemp(tmpl.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", tmpl, ": ", std::strerror(errno)));
  }
  return tmpl;
}

absl::StatusOr<int> FreePortBelowEphemeral() {
  // Below the ephemeral range: a port nothing listens on for a while must
  // not be taken meanwhile by an outgoing connection's local end.
  int low = 32768;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r"); f != nullptr) {
    if (std::fscanf(f, "%d", &low) != 1) low = 32768;
    std::fclose(f);
  }
  if (low <= 10100) return absl::InternalError("the ephemeral port range starts too low");
  std::mt19937 rng(static_cast<uint32_t>(getpid()) ^
                   static_cast<uint32_t>(absl::ToUnixNanos(absl::Now())));
  std::uniform_int_distribution<int> pick(10000, low - 1);
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = pick(rng);
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) break;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (free) return port;
  }
  return absl::InternalError("no free port below the ephemeral range");
}

// ---- Cluster ----------------------------------------------------------------

Cluster::Cluster(const ClusterOptions& options) : options_(options) {}

absl::StatusOr<std::string> MakeTestCa(int shards) {
  auto dir = NewTempDir("ca");
  if (!dir.ok()) return dir.status();
  const char* runfiles = std::getenv("TEST_SRCDIR");
  const std::string script =
      absl::StrCat(runfiles != nullptr ? runfiles : ".", "/optimus/scripts/make_local_ca.sh");
  const std::string cmd = absl::StrCat(script, " ", *dir, " --shards ", shards, " >/dev/null");
  if (std::system(cmd.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("`", cmd, "` failed (is openssl installed?)"));
  }
  return *dir;
}

security::TlsOptions Cluster::TlsFor(const std::string& who) const {
  security::TlsOptions t;
  if (options_.tls_root.empty()) {
    t.plaintext = true;
  } else {
    t.dir = absl::StrCat(options_.tls_root, "/", who);
  }
  return t;
}

absl::StatusOr<std::unique_ptr<Cluster>> Cluster::Start(const ClusterOptions& options) {
  if (options.num_shards < 0 || options.num_workers == 0) {
    return absl::InvalidArgumentError("a cluster needs num_shards >= 0 and num_workers >= 1");
  }
  ClusterOptions resolved = options;
  if (!resolved.tls_root.empty() && resolved.job_token.empty()) {
    auto token = security::NewToken();
    if (!token.ok()) return token.status();
    resolved.job_token = *token;
  }
  std::unique_ptr<Cluster> c(new Cluster(resolved));
  if (options.transport == TransportKind::kLoopback) {
    c->fabric_ = transport::LoopbackFabric::Create(options.loopback);
  }
  int standby_port = 0;
  if (options.standby_address) {
    if (options.state_dir.empty()) {
      return absl::InvalidArgumentError("standby_address needs a state_dir");
    }
    absl::StatusOr<int> port = FreePortBelowEphemeral();
    if (!port.ok()) return port.status();
    standby_port = *port;
  }
  if (auto s = c->StartCoordinator("127.0.0.1:0"); !s.ok()) return s;
  c->coord_targets_ = c->coord_address_;
  if (options.standby_address) {
    c->first_address_ = c->coord_address_;
    c->standby_listen_ = absl::StrCat("127.0.0.1:", standby_port);
    c->coord_targets_ = absl::StrCat("localhost:", standby_port, ",", c->coord_address_);
  }
  for (int i = 0; i < options.num_shards; ++i) {
    if (auto s = c->AddShard(); !s.ok()) return s.status();
  }
  return c;
}

absl::Status Cluster::StartCoordinator(const std::string& address) {
  CoordinatorOptions copts;
  copts.listen_address = address;
  copts.tls = TlsFor("coordinator");
  copts.lease = options_.lease;
  copts.sweep_interval = options_.sweep_interval;
  copts.checkpoint_dir = options_.checkpoint_dir;
  copts.state_dir = options_.state_dir;
  copts.job_limits = options_.job_limits;
  if (options_.max_concurrent_map_reads > 0) {
    copts.max_concurrent_map_reads = options_.max_concurrent_map_reads;
  }
  if (options_.max_queued_map_reads >= 0) {
    copts.max_queued_map_reads = options_.max_queued_map_reads;
  }
  copts.while_reading_map = options_.while_reading_map;
  if (options_.serve_metrics) copts.metrics_address = "127.0.0.1:0";
  auto coord = CoordinatorServer::Start(copts);
  if (!coord.ok()) return coord.status();
  coord_ = std::move(*coord);
  coord_address_ = coord_->address();
  auto channel = security::Dial(coord_address_, TlsFor("admin"), "test harness");
  if (!channel.ok()) return channel.status();
  stub_ = v1::Coordinator::NewStub(*channel);
  return absl::OkStatus();
}

absl::Status Cluster::StopCoordinator() {
  if (options_.state_dir.empty()) {
    return absl::FailedPreconditionError("StopCoordinator needs ClusterOptions.state_dir");
  }
  if (coord_ == nullptr) return absl::FailedPreconditionError("the coordinator is stopped");
  coord_.reset();
  return absl::OkStatus();
}

absl::Status Cluster::RestartCoordinator() {
  if (coord_ != nullptr) return absl::FailedPreconditionError("the coordinator is running");
  return StartCoordinator(coord_address_);
}

absl::Status Cluster::MoveCoordinator() {
  if (!options_.standby_address) {
    return absl::FailedPreconditionError("MoveCoordinator needs ClusterOptions.standby_address");
  }
  coord_.reset();
  return StartCoordinator(coord_address_ == standby_listen_ ? first_address_ : standby_listen_);
}

Cluster::~Cluster() {
  workers_.clear();
  last_push_.clear();
  shards_.clear();
  coord_.reset();
}

transport::WorkerOptions Cluster::TransportOptions(const std::string& name) const {
  transport::WorkerOptions o;
  o.name = name;
  if (options_.transport == TransportKind::kLoopback) {
    o.loopback = fabric_;
  } else {
    o.net_devices = "lo";  // Nothing leaves the machine.
  }
  return o;
}

absl::StatusOr<v1::StatusResponse> Cluster::Status() {
  v1::StatusResponse resp;
  grpc::ClientContext ctx;
  absl::Status s = FromGrpc(stub_->Status(&ctx, v1::StatusRequest(), &resp));
  if (!s.ok()) return s;
  return resp;
}

// ---- Shards ----

absl::StatusOr<size_t> Cluster::AddShard() {
  server::ShardServerOptions s;
  s.coordinator_address = coord_targets_;
  s.tls = TlsFor(absl::StrCat("shard-", shards_.size()));
  s.memory_limit_bytes = options_.shard_memory_limit_bytes;
  s.kernel_threads = options_.kernel_threads;
  s.step_threads = options_.step_threads;
  s.staging_bytes = options_.staging_bytes;
  s.heartbeat_interval = options_.heartbeat_interval;
  s.transport = TransportOptions(absl::StrCat("shard", shards_.size()));
  s.checkpoint_dir = options_.checkpoint_dir;
  s.checkpoint_max_bytes_per_second = options_.checkpoint_max_bytes_per_second;
  if (options_.max_parked_pulls_per_peer > 0) {
    s.max_parked_pulls_per_peer = options_.max_parked_pulls_per_peer;
  }
  if (options_.max_parked_pulls > 0) s.max_parked_pulls = options_.max_parked_pulls;
  if (options_.max_peers > 0) s.transport.max_peers = options_.max_peers;
  if (options_.serve_metrics) s.metrics_address = "127.0.0.1:0";
  auto shard = server::ShardServer::Start(s);
  if (!shard.ok()) {
    return absl::Status(shard.status().code(), absl::StrCat("starting shard ", shards_.size(),
                                                            ": ", shard.status().message()));
  }
  shards_.push_back(std::move(*shard));
  return shards_.size() - 1;
}

absl::Status Cluster::KillShard(size_t i) {
  if (i >= shards_.size()) {
    return absl::OutOfRangeError(absl::StrCat("no shard ", i, " (", shards_.size(), " shards)"));
  }
  shards_[i]->Shutdown();
  return absl::OkStatus();
}

std::vector<server::ShardServerStats> Cluster::ShardStats() const {
  std::vector<server::ShardServerStats> out;
  for (const auto& s : shards_) out.push_back(s->stats());
  return out;
}

std::vector<uint64_t> Cluster::ShardMemoryUsed() const {
  std::vector<uint64_t> out;
  for (const auto& s : shards_) out.push_back(s->stats().memory_used_bytes);
  return out;
}

absl::StatusOr<v1::DrainShardResponse> Cluster::DrainShard(size_t i) {
  if (i >= shards_.size()) {
    return absl::OutOfRangeError(absl::StrCat("no shard ", i, " (", shards_.size(), " shards)"));
  }
  v1::DrainShardRequest req;
  req.set_shard_id(shards_[i]->shard_id());
  v1::DrainShardResponse resp;
  grpc::ClientContext ctx;
  absl::Status s = FromGrpc(stub_->DrainShard(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<size_t> Cluster::PrimaryOf(int chunk) {
  if (workers_.empty() || workers_[0]->job_id() == 0) {
    return absl::FailedPreconditionError("no joined job: CreateJob or JoinJob first");
  }
  v1::GetShardMapRequest req;
  req.set_job_id(workers_[0]->job_id());
  v1::ShardMap map;
  grpc::ClientContext ctx;
  absl::Status fetched = FromGrpc(stub_->GetShardMap(&ctx, req, &map));
  if (!fetched.ok()) return fetched;
  if (chunk < 0 || chunk >= map.chunks_size()) {
    return absl::OutOfRangeError(
        absl::StrCat("no chunk ", chunk, " in a map of ", map.chunks_size()));
  }
  for (size_t i = 0; i < shards_.size(); ++i) {
    if (shards_[i]->shard_id() == map.chunks(chunk).shard_id()) return i;
  }
  return absl::NotFoundError(absl::StrCat("chunk ", chunk, " is on shard ",
                                          map.chunks(chunk).shard_id(),
                                          ", which this cluster did not start"));
}

// ---- Workers and jobs ----

absl::Status Cluster::ConnectWorkers() {
  workers_.clear();  // Before their push buffers.
  joined_job_.clear();
  last_push_.assign(options_.num_workers, {});
  for (uint32_t r = 0; r < options_.num_workers; ++r) {
    client::ClientOptions o;
    o.coordinator_address = coord_targets_;
    o.tls = TlsFor("trainer");
    o.job_token = options_.job_token;
    o.transport = TransportOptions(absl::StrCat("worker", r));
    if (options_.make_worker) {
      o.make_worker = [make = options_.make_worker, r](const transport::WorkerOptions& w) {
        return make(r, w);
      };
    }
    auto c = client::Client::Connect(o);
    if (!c.ok()) {
      return absl::Status(c.status().code(),
                          absl::StrCat("connecting worker ", r, ": ", c.status().message()));
    }
    workers_.push_back(std::move(*c));
  }
  return absl::OkStatus();
}

absl::Status Cluster::JoinAll(const std::string& name) {
  joined_job_ = name;
  for (uint32_t r = 0; r < options_.num_workers; ++r) {
    absl::Status s = workers_[r]->Join(name, r, options_.num_workers);
    if (!s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("rank ", r, " joining ", name, ": ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status Cluster::CreateJob(const client::JobDef& def) {
  if (def.world_size != options_.num_workers) {
    return absl::InvalidArgumentError(absl::StrCat("job ", def.name, " has world size ",
                                                   def.world_size, " but the cluster runs ",
                                                   options_.num_workers, " workers"));
  }
  if (absl::Status s = ConnectWorkers(); !s.ok()) return s;
  if (absl::Status s = workers_[0]->CreateJob(def); !s.ok()) return s;
  if (absl::Status s = JoinAll(def.name); !s.ok()) return s;
  client::Client* c = workers_[0].get();
  for (uint32_t t = 0; t < c->tensors().size(); ++t) {
    std::vector<float> v(c->tensors()[t].num_elems);
    for (size_t i = 0; i < v.size(); ++i) v[i] = InitialValue(t, i);
    if (absl::Status s = c->InitTensor(t, v.data(), v.size()); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("initial values of tensor ", t, ": ",
                                                 s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status Cluster::JoinJob(const std::string& name) {
  if (absl::Status s = ConnectWorkers(); !s.ok()) return s;
  return JoinAll(name);
}

absl::Status Cluster::LeaveJob() {
  if (joined_job_.empty()) return absl::FailedPreconditionError("no job joined");
  for (uint32_t r = 0; r < workers_.size(); ++r) {
    v1::LeaveJobRequest req;
    req.set_job_name(joined_job_);
    req.set_rank(r);
    v1::LeaveJobResponse resp;
    grpc::ClientContext ctx;
    absl::Status s = FromGrpc(stub_->LeaveJob(&ctx, req, &resp));
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("rank ", r, " leaving ", joined_job_, ": ",
                                                 s.message()));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::DeleteJobResponse> Cluster::DeleteJob(const std::string& name, bool force) {
  v1::DeleteJobRequest req;
  req.set_job_name(name);
  req.set_force(force);
  v1::DeleteJobResponse resp;
  grpc::ClientContext ctx;
  absl::Status s = FromGrpc(stub_->DeleteJob(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<std::vector<uint8_t>> Cluster::Pull(uint32_t tensor, uint64_t version,
                                                   uint32_t rank) {
  if (rank >= workers_.size()) {
    return absl::FailedPreconditionError(absl::StrCat("no worker of rank ", rank));
  }
  client::Client* c = workers_[rank].get();
  if (tensor >= c->tensors().size()) {
    return absl::InvalidArgumentError(absl::StrCat("no tensor ", tensor));
  }
  const size_t n = c->tensors()[tensor].num_elems;
  std::vector<uint8_t> raw(n * DTypeSize(c->param_dtype()));
  auto ticket = c->Pull(tensor, version, raw.data(), n);
  if (!ticket.ok()) return ticket.status();
  absl::Status s = c->Wait(*ticket, options_.wait);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("rank ", rank, " pull of tensor ", tensor,
                                               " version ", version, ": ", s.message()));
  }
  return raw;
}

absl::StatusOr<std::vector<float>> Cluster::PullFp32(uint32_t tensor, uint64_t version,
                                                     uint32_t rank) {
  auto raw = Pull(tensor, version, rank);
  if (!raw.ok()) return raw.status();
  const client::Client* c = workers_[rank].get();
  std::vector<float> out(c->tensors()[tensor].num_elems);
  kernels::CastToFp32(raw->data(), c->param_dtype(), out.size(), out.data());
  return out;
}

std::vector<uint8_t> Cluster::GradientBytes(uint32_t rank, uint32_t tensor,
                                            const std::vector<float>& params, uint64_t step) {
  if (rank >= workers_.size()) return {};
  const client::Client* c = workers_[rank].get();
  std::vector<float> g(params.size());
  for (size_t i = 0; i < g.size(); ++i) g[i] = Gradient(params[i], step, rank, tensor, i);
  std::vector<uint8_t> out(g.size() * DTypeSize(c->grad_dtype()));
  kernels::CastFromFp32(g.data(), g.size(), out.data(), c->grad_dtype());
  return out;
}

absl::Status Cluster::RunWorker(uint32_t rank, uint64_t first_step, uint64_t last_step,
                                std::vector<absl::Time>* step_done) {
  if (rank >= workers_.size()) {
    return absl::FailedPreconditionError(absl::StrCat("no worker of rank ", rank));
  }
  client::Client* c = workers_[rank].get();
  std::vector<std::vector<uint8_t>>& pushed = last_push_[rank];
  pushed.resize(c->tensors().size());
  for (uint64_t step = first_step; step <= last_step; ++step) {
    for (uint32_t t = 0; t < c->tensors().size(); ++t) {
      auto params = PullFp32(t, step, rank);
      if (!params.ok()) return params.status();
      // Replaces the previous push of t, whose next version was just pulled.
      pushed[t] = GradientBytes(rank, t, *params, step);
      auto ticket = c->Push(t, step, pushed[t].data(), params->size());
      if (!ticket.ok()) return ticket.status();
      absl::Status s = c->Wait(*ticket, options_.wait);
      if (!s.ok()) {
        return absl::Status(s.code(), absl::StrCat("rank ", rank, " push of tensor ", t,
                                                   " step ", step, ": ", s.message()));
      }
    }
    if (step_done != nullptr) step_done->push_back(absl::Now());
  }
  return absl::OkStatus();
}

absl::Status Cluster::Train(uint64_t first_step, uint64_t last_step,
                            std::vector<absl::Time>* rank0_step_done) {
  if (workers_.size() != options_.num_workers) {
    return absl::FailedPreconditionError("no workers: CreateJob or JoinJob first");
  }
  std::vector<absl::Status> results(workers_.size());
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < workers_.size(); ++r) {
    threads.emplace_back([this, r, first_step, last_step, rank0_step_done, &results] {
      results[r] = RunWorker(r, first_step, last_step, r == 0 ? rank0_step_done : nullptr);
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// ---- Checkpoints ----

absl::StatusOr<v1::CheckpointInfo> Cluster::CreateCheckpoint(const std::string& job) {
  v1::CreateCheckpointRequest req;
  req.set_job_name(job);
  v1::CreateCheckpointResponse resp;
  grpc::ClientContext ctx;
  absl::Status s = FromGrpc(stub_->CreateCheckpoint(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp.checkpoint();
}

absl::StatusOr<std::vector<v1::CheckpointInfo>> Cluster::ListCheckpoints(const std::string& job) {
  v1::ListCheckpointsRequest req;
  req.set_job_name(job);
  v1::ListCheckpointsResponse resp;
  grpc::ClientContext ctx;
  absl::Status s = FromGrpc(stub_->ListCheckpoints(&ctx, req, &resp));
  if (!s.ok()) return s;
  return std::vector<v1::CheckpointInfo>(resp.checkpoints().begin(), resp.checkpoints().end());
}

absl::StatusOr<v1::CheckpointInfo> Cluster::WaitCheckpoint(const std::string& job, uint64_t id,
                                                           absl::Duration timeout) {
  v1::CheckpointInfo last;
  absl::Status list_error;
  absl::Status s = WaitUntil(
      absl::StrCat("checkpoint ", id, " of ", job, " to finish"),
      [&] {
        auto list = ListCheckpoints(job);
        if (!list.ok()) {
          list_error = list.status();
          return true;
        }
        bool busy = false, found = false;
        for (const auto& c : *list) {
          if (c.checkpoint_id() < id) continue;
          found = true;
          last = c;
          busy |= c.state() == v1::CHECKPOINT_STATE_IN_PROGRESS;
        }
        return found && !busy;
      },
      timeout);
  if (!list_error.ok()) return list_error;
  if (!s.ok()) return s;
  return last;
}

absl::StatusOr<v1::RestoreCheckpointResponse> Cluster::RestoreCheckpoint(
    const std::string& job, uint64_t id, const std::string& new_name, uint64_t max_chunk_bytes) {
  v1::RestoreCheckpointRequest req;
  req.set_job_name(job);
  req.set_checkpoint_id(id);
  req.set_new_job_name(new_name);
  req.set_max_chunk_bytes(max_chunk_bytes);
  v1::RestoreCheckpointResponse resp;
  grpc::ClientContext ctx;
  absl::Status s = FromGrpc(stub_->RestoreCheckpoint(&ctx, req, &resp));
  if (!s.ok()) return s;
  return resp;
}

// ---- Waiting ----

absl::Status Cluster::WaitUntil(absl::string_view what, const std::function<bool()>& done,
                                absl::Duration timeout) {
  if (timeout == absl::ZeroDuration()) timeout = options_.wait;
  const absl::Time give_up = absl::Now() + timeout;
  for (;;) {
    if (done()) return absl::OkStatus();
    if (absl::Now() >= give_up) {
      return absl::DeadlineExceededError(
          absl::StrCat("waited ", absl::FormatDuration(timeout), " for ", what));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

absl::Status Cluster::WaitStatus(absl::string_view what,
                                 const std::function<bool(const v1::StatusResponse&)>& pred,
                                 absl::Duration timeout) {
  absl::Status rpc_error;
  absl::Status s = WaitUntil(
      what,
      [&] {
        auto st = Status();
        if (!st.ok()) {
          rpc_error = st.status();
          return true;
        }
        return pred(*st);
      },
      timeout);
  if (!rpc_error.ok()) return rpc_error;
  return s;
}

absl::Status Cluster::WaitApplied(const std::string& job, uint64_t step) {
  return WaitStatus(absl::StrCat("job ", job, " to report step ", step, " applied"),
                    [&](const v1::StatusResponse& st) {
                      for (const auto& j : st.jobs()) {
                        if (j.name() == job && j.current_step() >= step) return true;
                      }
                      return false;
                    });
}

}  // namespace harness
}  // namespace optimus
