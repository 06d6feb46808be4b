#include "server/coordinator_link.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_files.h"
#include "common/coordinator_channels.h"
#include "common/grpc_limits.h"
#include "common/grpc_status.h"
#include "common/security.h"
#include "grpcpp/grpcpp.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {
namespace server {
namespace {

// Proto messages are converted here and nowhere else in server/.

absl::StatusOr<JobConfig> ConfigFromSpec(uint64_t job_id, const v1::JobSpec& spec) {
  JobConfig c;
  c.job_id = job_id;
  c.name = spec.name();
  c.world_size = spec.world_size();
  c.replication = spec.replication();
  auto gd = DTypeFromInt(spec.grad_dtype());
  auto pd = DTypeFromInt(spec.param_dtype());
  auto kind = kernels::OptimizerKindFromInt(spec.optimizer().kind());
  if (!gd.ok()) return gd.status();
  if (!pd.ok()) return pd.status();
  if (!kind.ok()) return kind.status();
  if (c.world_size == 0) return absl::InvalidArgumentError("job has world_size 0");
  if (c.replication > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("job has replication ", c.replication, "; this shard supports 0 or 1"));
  }
  c.grad_dtype = *gd;
  c.param_dtype = *pd;
  const v1::OptimizerConfig& o = spec.optimizer();
  c.hyper.kind = *kind;
  c.hyper.lr = o.lr();
  c.hyper.beta1 = o.beta1();
  c.hyper.beta2 = o.beta2();
  c.hyper.eps = o.eps();
  c.hyper.weight_decay = o.weight_decay();
  c.hyper.momentum = o.momentum();
  if (auto s = kernels::FillDefaultsAndValidate(&c.hyper); !s.ok()) return s;
  c.grad_scale = o.grad_scale() > 0 ? o.grad_scale() : 1.0f / static_cast<float>(c.world_size);
  c.checkpoint_every_steps = spec.checkpoint_policy().every_steps();
  c.commit_round = spec.max_grad_norm() > 0 || !spec.keep_nonfinite();
  for (int i = 0; i < spec.tensors_size(); ++i) {
    const v1::TensorSpec& t = spec.tensors(i);
    JobConfig::Tensor tc;
    tc.hyper = c.hyper;
    tc.frozen = t.frozen();
    if (spec.param_groups_size() == 0 ? t.group() != 0
                                      : t.group() >= static_cast<uint32_t>(spec.param_groups_size())) {
      // A shard's part carries no tensor names (ShardSpecOf): the index.
      return absl::InvalidArgumentError(absl::StrCat("tensor ", i, " names group ",
                                                     t.group(), " of ", spec.param_groups_size()));
    }
    if (spec.param_groups_size() > 0) {
      const v1::ParamGroup& g = spec.param_groups(static_cast<int>(t.group()));
      kernels::GroupOverrides o;
      if (g.has_weight_decay()) o.weight_decay = g.weight_decay();
      if (g.has_lr_mult()) o.lr_mult = g.lr_mult();
      if (g.has_beta1()) o.beta1 = g.beta1();
      if (g.has_beta2()) o.beta2 = g.beta2();
      if (g.has_momentum()) o.momentum = g.momentum();
      if (absl::Status s = kernels::ValidateGroupOverrides(
              o, absl::StrCat("param_groups[", t.group(), "]"));
          !s.ok()) {
        return s;
      }
      tc.hyper = kernels::WithGroupOverrides(c.hyper, o);
      tc.lr_mult = o.lr_mult.value_or(1.0f);
    }
    c.tensors.push_back(tc);
  }
  return c;
}

ShardMapView MapFromProto(const v1::ShardMap& map) {
  ShardMapView v;
  v.epoch = map.epoch();
  v.chunks.reserve(map.chunks_size());
  for (const v1::ChunkPlacement& p : map.chunks()) {
    ChunkPlacement c;
    c.tensor = p.tensor();
    c.chunk = p.chunk();
    c.offset_elems = p.offset_elems();
    c.num_elems = p.num_elems();
    c.primary = p.shard_id();
    c.backup = p.backup_shard_id();
    v.chunks.push_back(c);
  }
  for (const v1::ShardEndpoint& e : map.shards()) v.addresses[e.shard_id()] = e.data_address();
  return v;
}

// Makes a new context with a deadline `seconds` from when it is made: each
// try of CallAround gets its own. Register, heartbeat and a job's fetch may
// all be repeated (a repeated registration leaves an unused id that goes
// DOWN after the lease, as after a coordinator restart).
struct Deadline {
  int seconds;
  std::unique_ptr<grpc::ClientContext> operator()() const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(seconds));
    return ctx;
  }
};

class GrpcCoordinatorLink : public CoordinatorLink {
 public:
  explicit GrpcCoordinatorLink(std::shared_ptr<CoordinatorChannels> channels)
      : stub_(std::move(channels)) {}

  // Reconnect quickly after a coordinator restart: gRPC's default backoff
  // grows to minutes, and the restarted coordinator expects a heartbeat
  // within two leases. Only the pause between attempts is shortened:
  // gRPC also reads GRPC_ARG_MIN_RECONNECT_BACKOFF_MS as the least time
  // one attempt (TCP connect + TLS handshake) is given, and a short one
  // there (it was 100 ms) cut every handshake of a loaded coordinator
  // short, so the shard never registered. That stays at gRPC's 20 s.
  // With several addresses CoordinatorChannels sets the same pauses.
  static grpc::ChannelArguments Args(size_t addresses) {
    grpc::ChannelArguments args = LimitedChannelArgs();
    if (addresses == 1) {
      args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
      args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
    }
    return args;
  }

  absl::StatusOr<Registered> Register(const ShardRegistration& r) override {
    v1::RegisterShardRequest req;
    v1::ShardCapabilities* caps = req.mutable_capabilities();
    caps->set_kind(r.is_dpu ? v1::SHARD_KIND_DPU : v1::SHARD_KIND_HOST);
    caps->set_arch(r.arch);
    caps->set_cores(r.cores);
    caps->set_memory_limit_bytes(r.memory_limit_bytes);
    caps->set_staging_bytes(r.staging_bytes);
    caps->set_data_address(r.data_address);
    caps->set_hostname(r.hostname);
    caps->set_failure_domain(r.failure_domain);
    caps->set_checkpoints(r.checkpoints);
    v1::RegisterShardResponse resp;
    absl::Status s = FromGrpc(
        stub_.CallAround(&v1::Coordinator::Stub::RegisterShard, Deadline{5}, req, &resp));
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("registering with coordinator at ",
                                                 stub_.channels().addresses(), ": ",
                                                 s.message()));
    }
    return Registered{resp.shard_id(), static_cast<int64_t>(resp.lease_ms()),
                      resp.data_plane_key()};
  }

  absl::StatusOr<HeartbeatReply> Heartbeat(const HeartbeatReport& r) override {
    v1::HeartbeatRequest req;
    req.set_shard_id(r.shard_id);
    req.set_memory_used_bytes(r.memory_used_bytes);
    req.set_chunks_owned(r.chunks_owned);
    req.set_transports(r.transports);
    for (const JobReport& j : r.jobs) {
      v1::ShardJobProgress* p = req.add_jobs();
      p->set_job_id(j.job_id);
      p->set_map_epoch(j.map_epoch);
      p->set_applied_step(j.applied_step);
      p->set_max_applied_step(j.max_applied_step);
      p->set_chunks_loaded(j.primary_chunks + j.backup_chunks);
      p->set_primary_chunks(j.primary_chunks);
      p->set_backup_chunks(j.backup_chunks);
      p->set_backups_seeded(j.backups_seeded);
      p->set_primaries_replicated(j.primaries_replicated);
    }
    for (const CheckpointReport& c : r.checkpoints) {
      v1::ShardCheckpointReport* p = req.add_checkpoints();
      p->set_job_id(c.job_id);
      p->set_checkpoint_id(c.checkpoint_id);
      p->set_done(c.done);
      p->set_error(c.error);
      p->set_missed_step(c.missed_step);
      for (const v1::CheckpointFile& f : c.files) *p->add_files() = f;
    }
    v1::HeartbeatResponse resp;
    if (absl::Status s = FromGrpc(
            stub_.CallAround(&v1::Coordinator::Stub::Heartbeat, Deadline{2}, req, &resp));
        !s.ok()) {
      return s;
    }
    HeartbeatReply out;
    out.known = resp.known();
    for (const v1::Assignment& a : resp.assignments()) {
      out.assignments.push_back({a.job_id(), a.map_epoch(), a.part_epoch(),
                                 absl::Milliseconds(a.fetch_after_ms())});
    }
    for (const v1::CheckpointOrder& o : resp.checkpoints()) {
      out.checkpoints.push_back(
          CheckpointOrder{o.job_id(), o.checkpoint_id(), o.step(), o.path(), o.policy()});
    }
    out.released_jobs.assign(resp.released_jobs().begin(), resp.released_jobs().end());
    return out;
  }

  absl::StatusOr<JobDescription> GetJob(uint64_t job_id, uint64_t shard_id) override {
    v1::GetJobRequest req;
    req.set_job_id(job_id);
    req.set_for_shard_id(shard_id);
    v1::GetJobResponse resp;
    if (absl::Status s =
            FromGrpc(stub_.CallAround(&v1::Coordinator::Stub::GetJob, Deadline{5}, req, &resp));
        !s.ok()) {
      return s;
    }
    absl::StatusOr<JobConfig> config = ConfigFromSpec(job_id, resp.spec());
    if (!config.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("job ", job_id, " (", resp.spec().name(), "): ", config.status().message()));
    }
    JobDescription d;
    d.config = *std::move(config);
    d.map = MapFromProto(resp.map());
    if (resp.has_restore()) {
      absl::StatusOr<std::vector<uint64_t>> steps =
          ckpt::OptimizerStepsOf(resp.restore().path(), resp.restore().manifest());
      if (!steps.ok()) return steps.status();
      d.restore = RestoreSource{resp.restore().path(), resp.restore().manifest(),
                                resp.resume_step(), *std::move(steps)};
    }
    return d;
  }

 private:
  LeaderStub<v1::Coordinator> stub_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<CoordinatorLink>> NewGrpcCoordinatorLink(
    const std::string& address, const security::TlsOptions& tls_options) {
  absl::StatusOr<std::vector<std::string>> list = ParseCoordinatorAddresses(address);
  if (!list.ok()) return list.status();
  absl::StatusOr<security::TlsMaterial> tls =
      security::LoadTls(tls_options, /*need_cert=*/true, "optimus-shard");
  if (!tls.ok()) return tls.status();
  absl::StatusOr<std::shared_ptr<CoordinatorChannels>> channels = CoordinatorChannels::Create(
      address, security::ChannelCredentials(*tls), GrpcCoordinatorLink::Args(list->size()));
  if (!channels.ok()) return channels.status();
  return std::unique_ptr<CoordinatorLink>(
      std::make_unique<GrpcCoordinatorLink>(*std::move(channels)));
}

}  // namespace server
}  // namespace optimus
