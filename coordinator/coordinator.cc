#include "coordinator/coordinator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <array>
#include <atomic>
#include <limits>
#include <utility>

#include <errno.h>
#include <sys/stat.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/dtype.h"
#include "common/durable_file.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/metrics.h"
#include "grpcpp/grpcpp.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {
namespace {

constexpr char kLog[] = "coord";

// Defaults filled into a stored JobSpec (see proto/optimus.proto).
constexpr float kDefaultBeta1 = 0.9f;
constexpr float kDefaultBeta2 = 0.999f;
constexpr float kDefaultEps = 1e-8f;

// gRPC message size limit of the server: a job's map travels whole in
// CreateJob/JoinJob/GetJob responses (see kMaxChunksPerJob).
constexpr int kMaxMessageBytes = 64 << 20;

// 2^56 elements is far beyond any model, and keeps every byte count derived
// from it (elements * bytes per element) inside 64 bits.
constexpr uint64_t kMaxJobElems = uint64_t{1} << 56;

// Every worker costs an aggregation slot per chunk on the shards; a million
// is beyond any cluster and keeps world_size * dtype bytes a small int.
constexpr uint32_t kMaxWorldSize = 1 << 20;

bool IsAdamLike(v1::OptimizerKind k) {
  return k == v1::OPTIMIZER_ADAM || k == v1::OPTIMIZER_ADAMW;
}

const char* KindName(v1::ShardKind k) {
  switch (k) {
    case v1::SHARD_KIND_DPU: return "dpu";
    case v1::SHARD_KIND_HOST: return "host";
    default: return "unspecified";
  }
}

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("invalid job spec: ", what));
}

// Validates `spec` in place and fills its defaults; returns each tensor's
// element count.
absl::StatusOr<std::vector<uint64_t>> ValidateAndFillSpec(v1::JobSpec& spec) {
  if (spec.world_size() < 1) return Invalid("world_size must be >= 1");
  if (spec.replication() > 1) {
    return Invalid(absl::StrCat("replication must be 0 or 1 (backups per chunk), got ",
                                spec.replication()));
  }
  if (spec.world_size() > kMaxWorldSize) {
    return Invalid(absl::StrCat("world_size must be <= ", kMaxWorldSize));
  }
  if (spec.tensors_size() < 1) return Invalid("at least one tensor is required");
  std::set<std::string> names;
  std::vector<uint64_t> num_elems;
  uint64_t total_elems = 0;
  for (int t = 0; t < spec.tensors_size(); ++t) {
    const v1::TensorSpec& tensor = spec.tensors(t);
    if (tensor.name().empty()) return Invalid(absl::StrCat("tensor ", t, " has an empty name"));
    if (!names.insert(tensor.name()).second) {
      return Invalid(absl::StrCat("tensor name \"", tensor.name(), "\" is used twice"));
    }
    // An empty shape is a scalar: one element.
    uint64_t n = 1;
    for (int64_t dim : tensor.shape()) {
      if (dim <= 0) {
        return Invalid(absl::StrCat("tensor \"", tensor.name(), "\" has dimension ", dim,
                                    "; every dimension must be positive"));
      }
      if (__builtin_mul_overflow(n, static_cast<uint64_t>(dim), &n) || n > kMaxJobElems) {
        return Invalid(absl::StrCat("tensor \"", tensor.name(), "\" is too large"));
      }
    }
    total_elems += n;
    if (total_elems > kMaxJobElems) return Invalid("the job has too many elements");
    num_elems.push_back(n);
  }
  if (spec.grad_dtype() == v1::DTYPE_UNSPECIFIED || !DTypeFromInt(spec.grad_dtype()).ok()) {
    return Invalid("grad_dtype must be FP32, BF16 or FP16");
  }
  if (spec.param_dtype() == v1::DTYPE_UNSPECIFIED || !DTypeFromInt(spec.param_dtype()).ok()) {
    return Invalid("param_dtype must be FP32, BF16 or FP16");
  }
  v1::OptimizerConfig& opt = *spec.mutable_optimizer();
  const v1::OptimizerKind kind = opt.kind();
  if (kind != v1::OPTIMIZER_ADAMW && kind != v1::OPTIMIZER_ADAM && kind != v1::OPTIMIZER_SGD &&
      kind != v1::OPTIMIZER_LION) {
    return Invalid("optimizer.kind must be ADAMW, ADAM, SGD or LION");
  }
  if (!(opt.lr() > 0) || !std::isfinite(opt.lr())) {
    return Invalid(absl::StrCat("optimizer.lr must be positive and finite, got ", opt.lr()));
  }
  if (!(opt.weight_decay() >= 0) || !std::isfinite(opt.weight_decay())) {
    return Invalid("optimizer.weight_decay must be >= 0 and finite");
  }
  if (!(opt.momentum() >= 0 && opt.momentum() < 1)) {
    return Invalid("optimizer.momentum must be in [0, 1)");
  }
  if (!(opt.grad_scale() >= 0) || !std::isfinite(opt.grad_scale())) {
    return Invalid("optimizer.grad_scale must be >= 0 and finite (0: 1/world_size)");
  }
  if (IsAdamLike(kind)) {
    if (!(opt.beta1() >= 0 && opt.beta1() < 1)) return Invalid("optimizer.beta1 must be in [0, 1)");
    if (!(opt.beta2() >= 0 && opt.beta2() < 1)) return Invalid("optimizer.beta2 must be in [0, 1)");
    if (!(opt.eps() >= 0) || !std::isfinite(opt.eps())) return Invalid("optimizer.eps must be >= 0");
    if (opt.beta1() == 0) opt.set_beta1(kDefaultBeta1);
    if (opt.beta2() == 0) opt.set_beta2(kDefaultBeta2);
    if (opt.eps() == 0) opt.set_eps(kDefaultEps);
  }
  if (kind == v1::OPTIMIZER_LION) {
    // Lion's own defaults (Chen et al. 2023): beta1 0.9, beta2 0.99.
    if (!(opt.beta1() >= 0 && opt.beta1() < 1)) return Invalid("optimizer.beta1 must be in [0, 1)");
    if (!(opt.beta2() >= 0 && opt.beta2() < 1)) return Invalid("optimizer.beta2 must be in [0, 1)");
    if (opt.beta1() == 0) opt.set_beta1(0.9f);
    if (opt.beta2() == 0) opt.set_beta2(0.99f);
  }
  if (opt.grad_scale() == 0) opt.set_grad_scale(1.0f / static_cast<float>(spec.world_size()));
  if (spec.max_chunk_bytes() == 0) spec.set_max_chunk_bytes(kDefaultMaxChunkBytes);
  if (spec.max_chunk_bytes() < 4) {
    return Invalid("max_chunk_bytes must be 0 (4 MiB) or at least 4 (one fp32 element)");
  }
  const uint64_t max_chunk_elems = spec.max_chunk_bytes() / 4;
  uint64_t num_chunks = 0;
  for (uint64_t n : num_elems) num_chunks += (n + max_chunk_elems - 1) / max_chunk_elems;
  if (num_chunks > kMaxChunksPerJob) {
    return Invalid(absl::StrCat("the job would have ", num_chunks, " chunks, more than ",
                                kMaxChunksPerJob, "; raise max_chunk_bytes"));
  }
  return num_elems;
}

}  // namespace

Coordinator::Coordinator(const CoordinatorOptions& options)
    : options_(options), checkpoints_(options.checkpoint_dir) {}

namespace {
// First word of the state file's header: names the format and its version.
constexpr absl::string_view kStateMagic = "OPTIMUS-COORD-STATE-1";
}  // namespace

absl::Time Coordinator::Now() const {
  return options_.clock ? options_.clock() : absl::Now();
}

std::map<uint64_t, Coordinator::ShardLoad> Coordinator::ComputeLoad(const v1::ShardMap& map,
                                                                    uint64_t bytes_per_elem) {
  std::map<uint64_t, ShardLoad> load;
  for (const v1::ChunkPlacement& p : map.chunks()) {
    const uint64_t bytes = p.num_elems() * bytes_per_elem;
    ShardLoad& primary = load[p.shard_id()];
    primary.num_chunks += 1;
    primary.size_bytes += bytes;
    if (p.backup_shard_id() != 0) {
      // A backup is a complete copy that can be promoted: it costs the same.
      ShardLoad& backup = load[p.backup_shard_id()];
      backup.num_chunks += 1;
      backup.backup_chunks += 1;
      backup.size_bytes += bytes;
    }
  }
  return load;
}

void Coordinator::SetEndpointsLocked(JobRecord& job) const {
  job.map.clear_shards();
  for (const auto& [shard_id, load] : job.load) {
    auto it = shards_.find(shard_id);
    if (it == shards_.end()) continue;
    v1::ShardEndpoint* e = job.map.add_shards();
    e->set_shard_id(shard_id);
    e->set_data_address(it->second.capabilities.data_address());
    e->set_kind(it->second.capabilities.kind());
  }
}

std::string Coordinator::StatePath() const {
  return absl::StrCat(options_.state_dir, "/coordinator.state");
}

absl::Status Coordinator::PersistLocked() {
  if (options_.state_dir.empty()) return absl::OkStatus();
  v1::CoordinatorState state;
  state.set_next_shard_id(next_shard_id_);
  state.set_next_job_id(next_job_id_);
  for (const auto& [id, shard] : shards_) {
    v1::PersistedShard* s = state.add_shards();
    s->set_shard_id(id);
    *s->mutable_capabilities() = shard.capabilities;
    s->set_state(shard.state);
  }
  for (const auto& [id, job] : jobs_) {
    v1::PersistedJob* j = state.add_jobs();
    j->set_job_id(id);
    *j->mutable_spec() = job.spec;
    j->set_state(job.state);
    *j->mutable_map() = job.map;
    j->set_num_params(job.num_params);
    j->set_bytes_per_elem(job.bytes_per_elem);
    for (uint32_t r : job.joined_ranks) j->add_joined_ranks(r);
    j->set_resume_step(job.resume_step);
    if (job.restore.has_value()) *j->mutable_restore() = *job.restore;
  }
  std::string bytes;
  if (!state.SerializeToString(&bytes)) return absl::InternalError("serializing coordinator state");
  absl::Status s = WriteChecksummedFile(StatePath(), kStateMagic, bytes);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("saving coordinator state: ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status Coordinator::Recover() {
  if (options_.state_dir.empty()) return absl::OkStatus();
  if (::mkdir(options_.state_dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return ErrnoToStatus(errno, "creating state folder", options_.state_dir);
  }
  absl::StatusOr<std::string> bytes = ReadChecksummedFile(StatePath(), kStateMagic);
  if (absl::IsNotFound(bytes.status())) {
    OPTIMUS_LOG(Info, kLog, "no state in ", options_.state_dir, ": starting empty");
    return absl::OkStatus();
  }
  if (!bytes.ok()) return bytes.status();
  v1::CoordinatorState state;
  if (!state.ParseFromString(*bytes)) {
    return absl::DataLossError(absl::StrCat(StatePath(), " does not parse as CoordinatorState"));
  }
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  next_shard_id_ = state.next_shard_id();
  next_job_id_ = state.next_job_id();
  shards_.clear();
  jobs_.clear();
  job_ids_by_name_.clear();
  for (const v1::PersistedShard& s : state.shards()) {
    ShardRecord& r = shards_[s.shard_id()];
    r.id = s.shard_id();
    r.capabilities = s.capabilities();
    r.state = s.state();
    // A fresh lease, doubled: it may have kept running, and needs a moment
    // to reconnect.
    r.last_heartbeat = now + options_.lease;
  }
  for (const v1::PersistedJob& j : state.jobs()) {
    JobRecord& r = jobs_[j.job_id()];
    r.id = j.job_id();
    r.spec = j.spec();
    r.state = j.state();
    r.map = j.map();
    r.num_params = j.num_params();
    r.bytes_per_elem = j.bytes_per_elem();
    r.joined_ranks.insert(j.joined_ranks().begin(), j.joined_ranks().end());
    r.resume_step = std::max<uint64_t>(j.resume_step(), 1);
    if (j.has_restore()) r.restore = j.restore();
    // Backups count as much as primaries; whether they are in sync is
    // volatile and comes back with the next heartbeats.
    r.load = ComputeLoad(r.map, r.bytes_per_elem);
    r.backup_seeded.assign(r.map.chunks_size(), false);
    job_ids_by_name_[r.spec.name()] = r.id;
  }
  OPTIMUS_LOG(Info, kLog, "recovered state from ", StatePath(), ": ", shards_.size(),
              " shards, ", jobs_.size(), " jobs");
  return absl::OkStatus();
}

absl::StatusOr<v1::RegisterShardResponse> Coordinator::RegisterShard(
    const v1::RegisterShardRequest& req) {
  const v1::ShardCapabilities& caps = req.capabilities();
  if (caps.kind() != v1::SHARD_KIND_DPU && caps.kind() != v1::SHARD_KIND_HOST) {
    return absl::InvalidArgumentError("shard capabilities: kind must be DPU or HOST");
  }
  if (caps.memory_limit_bytes() == 0) {
    return absl::InvalidArgumentError("shard capabilities: memory_limit_bytes must be > 0");
  }
  if (caps.data_address().empty()) {
    return absl::InvalidArgumentError(
        "shard capabilities: data_address (the UCX worker address) is empty");
  }
  absl::MutexLock lock(&mu_);
  ShardRecord shard;
  shard.id = next_shard_id_++;
  shard.capabilities = caps;
  shard.last_heartbeat = Now();
  shards_[shard.id] = shard;
  if (absl::Status s = PersistLocked(); !s.ok()) {
    shards_.erase(shard.id);
    --next_shard_id_;
    return s;
  }
  OPTIMUS_LOG(Info, kLog, "shard registered id=", shard.id, " kind=", KindName(caps.kind()),
              " host=", caps.hostname(), " arch=", caps.arch(),
              " memory_limit_bytes=", caps.memory_limit_bytes());
  v1::RegisterShardResponse resp;
  resp.set_shard_id(shard.id);
  resp.set_lease_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.lease)));
  return resp;
}

v1::HeartbeatResponse Coordinator::Heartbeat(const v1::HeartbeatRequest& req) {
  v1::HeartbeatResponse resp;
  absl::MutexLock lock(&mu_);
  auto it = shards_.find(req.shard_id());
  // A DRAINING shard still holds chunks and keeps its lease.
  if (it == shards_.end() || it->second.state == v1::SHARD_STATE_DOWN) {
    resp.set_known(false);
    return resp;
  }
  ShardRecord& shard = it->second;
  shard.last_heartbeat = Now();
  shard.memory_used_bytes = req.memory_used_bytes();
  shard.chunks_reported = req.chunks_owned();
  for (const v1::ShardJobProgress& p : req.jobs()) {
    auto job_it = jobs_.find(p.job_id());
    if (job_it == jobs_.end()) continue;
    JobRecord& job = job_it->second;
    if (job.load.count(shard.id) == 0) {
      // Not a job of this shard (any more): once it has applied the map
      // that took its chunks, it need not be told again.
      if (p.map_epoch() >= job.map.epoch()) job.departed.erase(shard.id);
      continue;
    }
    job.progress[shard.id] = p;
    MarkSeededLocked(job, shard.id, p);
    MaybeMarkReadyLocked(job);
  }
  resp.set_known(true);
  for (const auto& [job_id, job] : jobs_) {
    if (job.state == v1::JOB_STATE_FAILED) continue;
    if (job.load.count(shard.id) == 0 &&
        (job.departed.count(shard.id) == 0 || !AllHoldersAtCurrentEpoch(job))) {
      continue;
    }
    v1::Assignment* a = resp.add_assignments();
    a->set_job_id(job_id);
    a->set_map_epoch(job.map.epoch());
  }
  for (v1::CheckpointOrder& o : checkpoints_.OnHeartbeat(shard.id, req.checkpoints())) {
    *resp.add_checkpoints() = std::move(o);
  }
  return resp;
}

bool Coordinator::AllHoldersAtCurrentEpoch(const JobRecord& job) {
  for (const auto& [shard_id, load] : job.load) {
    auto p = job.progress.find(shard_id);
    if (p == job.progress.end() || p->second.map_epoch() < job.map.epoch()) return false;
  }
  return true;
}

void Coordinator::MarkSeededLocked(JobRecord& job, uint64_t shard_id,
                                   const v1::ShardJobProgress& p) {
  // Counts are over the map of p.map_epoch(): only a report on the current
  // map says something about the current backups. The report is per shard,
  // not per chunk, so the flags are set only once all of them are seeded
  // (a backup seeded once stays in step: the primary publishes a step only
  // after the backup acknowledged it). They are cleared when a chunk's
  // backup changes (CommitMapChangeLocked's callers).
  if (p.map_epoch() != job.map.epoch() || p.backup_chunks() == 0 ||
      p.backups_seeded() != p.backup_chunks()) {
    return;
  }
  auto load = job.load.find(shard_id);
  if (load == job.load.end() || load->second.backup_chunks != p.backup_chunks()) return;
  for (int i = 0; i < job.map.chunks_size(); ++i) {
    if (job.map.chunks(i).backup_shard_id() == shard_id) job.backup_seeded[i] = true;
  }
}

void Coordinator::MaybeMarkReadyLocked(JobRecord& job) {
  if (job.state != v1::JOB_STATE_PENDING) return;
  for (const auto& [shard_id, load] : job.load) {
    auto p = job.progress.find(shard_id);
    if (p == job.progress.end() || p->second.map_epoch() != job.map.epoch() ||
        p->second.chunks_loaded() != load.num_chunks) {
      return;
    }
  }
  job.state = v1::JOB_STATE_READY;
  OPTIMUS_LOG(Info, kLog, "job ready id=", job.id, " name=", job.spec.name(),
              " epoch=", job.map.epoch(), " shards=", job.load.size());
  // A restart before this is saved finds the job PENDING, and the next
  // heartbeats make it READY again: a failure here only costs a log line.
  if (absl::Status s = PersistLocked(); !s.ok()) {
    OPTIMUS_LOG(Warning, kLog, s.ToString());
  }
}

std::map<uint64_t, Coordinator::ShardLoad> Coordinator::PlannedLoadLocked() const {
  std::map<uint64_t, ShardLoad> total;
  for (const auto& [job_id, job] : jobs_) {
    if (job.state == v1::JOB_STATE_FAILED) continue;  // Its shards drop it.
    for (const auto& [shard_id, load] : job.load) {
      total[shard_id].num_chunks += load.num_chunks;
      total[shard_id].backup_chunks += load.backup_chunks;
      total[shard_id].size_bytes += load.size_bytes;
    }
    for (const auto& [shard_id, chunks] : job.departed) {
      total[shard_id].unreleased_chunks += chunks;
    }
  }
  return total;
}

std::vector<ShardInfo> Coordinator::PlacementCandidatesLocked() const {
  const std::map<uint64_t, ShardLoad> planned = PlannedLoadLocked();
  std::vector<ShardInfo> live;
  for (const auto& [id, shard] : shards_) {
    // DRAINING shards are being emptied and DOWN ones are gone.
    if (shard.state != v1::SHARD_STATE_UP) continue;
    auto p = planned.find(id);
    live.push_back({id, shard.capabilities.kind() == v1::SHARD_KIND_DPU,
                    shard.capabilities.memory_limit_bytes(),
                    p == planned.end() ? 0 : p->second.size_bytes});
  }
  return live;
}

uint64_t Coordinator::TakeSlot(const JobRecord& job, int index, uint64_t exclude_id,
                               std::vector<ShardInfo>& candidates) {
  const uint64_t bytes = job.map.chunks(index).num_elems() * job.bytes_per_elem;
  const int pick = PickShard(candidates, bytes, exclude_id);
  if (pick < 0) return 0;
  candidates[pick].memory_planned_bytes += bytes;
  return candidates[pick].id;
}

void Coordinator::CommitMapChangeLocked(JobRecord& job) {
  job.map.set_epoch(job.map.epoch() + 1);
  const std::map<uint64_t, ShardLoad> old_load = std::move(job.load);
  job.load = ComputeLoad(job.map, job.bytes_per_elem);
  // A live shard whose chunks all moved away must still learn the new map:
  // until it does, it would serve as a primary that no longer is one.
  for (const auto& [shard_id, load] : old_load) {
    auto sh = shards_.find(shard_id);
    if (job.load.count(shard_id) == 0 && sh != shards_.end() &&
        sh->second.state != v1::SHARD_STATE_DOWN) {
      job.departed[shard_id] = load.num_chunks;
    }
  }
  for (const auto& [shard_id, load] : job.load) job.departed.erase(shard_id);
  SetEndpointsLocked(job);
  job.backup_seeded.resize(job.map.chunks_size(), false);
  // Reports of shards that no longer hold chunks of the job would keep
  // counting in its step and readiness.
  for (auto it = job.progress.begin(); it != job.progress.end();) {
    it = job.load.count(it->first) == 0 ? job.progress.erase(it) : std::next(it);
  }
  checkpoints_.OnOwnersChanged(job.id, ViewLocked(job).owners);
}

absl::StatusOr<v1::CreateJobResponse> Coordinator::CreateJob(const v1::CreateJobRequest& req) {
  return CreateJobInternal(req, nullptr);
}

absl::StatusOr<v1::CreateJobResponse> Coordinator::CreateJobInternal(
    const v1::CreateJobRequest& req, const v1::RestoreSource* restore) {
  v1::JobSpec spec = req.spec();
  if (spec.name().empty()) return Invalid("name is empty");
  absl::StatusOr<std::vector<uint64_t>> num_elems = ValidateAndFillSpec(spec);
  if (!num_elems.ok()) return num_elems.status();

  const size_t grad_bytes = DTypeSize(*DTypeFromInt(spec.grad_dtype()));
  const size_t param_bytes = DTypeSize(*DTypeFromInt(spec.param_dtype()));
  const bool adam = IsAdamLike(spec.optimizer().kind());
  // A replicated chunk also holds the fp32 gradient sum its primary forwards
  // (both copies step from it): 4 more bytes per element on each.
  const uint64_t bytes_per_elem =
      StateBytesPerElem(static_cast<int>(spec.world_size()), grad_bytes, param_bytes, adam) +
      (spec.replication() > 0 ? 4 : 0);
  std::vector<ChunkSpec> chunks = SplitTensors(*num_elems, spec.max_chunk_bytes() / 4);

  absl::MutexLock lock(&mu_);
  auto taken = job_ids_by_name_.find(spec.name());
  // A restore may take over the name of a job that FAILED.
  const bool takes_over = taken != job_ids_by_name_.end() && restore != nullptr &&
                          jobs_.at(taken->second).state == v1::JOB_STATE_FAILED;
  if (taken != job_ids_by_name_.end() && !takes_over) {
    return absl::AlreadyExistsError(
        absl::StrCat("a job named \"", spec.name(), "\" already exists (id ",
                     job_ids_by_name_[spec.name()], ")"));
  }
  const std::vector<ShardInfo> live = PlacementCandidatesLocked();
  absl::StatusOr<std::vector<ChunkSpec>> placed = PlaceChunks(std::move(chunks), live, bytes_per_elem);
  // A job asking for a backup per chunk gets one from the start, or is
  // refused: it must not silently run without.
  if (placed.ok() && spec.replication() == 1) {
    placed = PlaceBackups(*std::move(placed), live, bytes_per_elem);
  }
  if (!placed.ok()) {
    OPTIMUS_LOG(Warning, kLog, "job refused name=", spec.name(), ": ", placed.status().message());
    return absl::Status(placed.status().code(),
                        absl::StrCat("job \"", spec.name(), "\": ", placed.status().message()));
  }

  if (restore != nullptr) {
    // Backups load their chunks from the checkpoint too.
    for (const ChunkSpec& c : *placed) {
      for (uint64_t id : {c.shard_id, c.backup_shard_id}) {
        if (id != 0 && !shards_.at(id).capabilities.checkpoints()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "cannot restore job \"", spec.name(), "\": shard ", id,
              " was started without --checkpoint_dir"));
        }
      }
    }
  }

  JobRecord job;
  job.id = next_job_id_++;
  job.spec = spec;
  if (restore != nullptr) {
    job.restore = *restore;
    job.resume_step = restore->manifest().step();
  }
  job.bytes_per_elem = bytes_per_elem;
  for (uint64_t n : *num_elems) job.num_params += n;
  job.map.set_job_id(job.id);
  job.map.set_epoch(1);
  for (const ChunkSpec& c : *placed) {
    v1::ChunkPlacement* p = job.map.add_chunks();
    p->set_tensor(c.tensor);
    p->set_chunk(c.chunk);
    p->set_offset_elems(c.offset_elems);
    p->set_num_elems(c.num_elems);
    p->set_shard_id(c.shard_id);
    p->set_backup_shard_id(c.backup_shard_id);
  }
  job.load = ComputeLoad(job.map, bytes_per_elem);
  SetEndpointsLocked(job);
  job.backup_seeded.assign(job.map.chunks_size(), false);
  OPTIMUS_LOG(Info, kLog, "job created id=", job.id, " name=", spec.name(),
              " world_size=", spec.world_size(), " tensors=", spec.tensors_size(),
              " params=", job.num_params, " chunks=", job.map.chunks_size(),
              " replication=", spec.replication(), " shards=", job.load.size(),
              " bytes_per_elem=", bytes_per_elem);
  v1::CreateJobResponse resp;
  resp.set_job_id(job.id);
  *resp.mutable_map() = job.map;
  const uint64_t job_id = job.id;
  const uint64_t replaced = takes_over ? taken->second : 0;
  job_ids_by_name_[spec.name()] = job_id;
  jobs_.emplace(job_id, std::move(job));
  if (absl::Status s = PersistLocked(); !s.ok()) {
    jobs_.erase(job_id);
    job_ids_by_name_.erase(spec.name());
    if (replaced != 0) job_ids_by_name_[spec.name()] = replaced;
    --next_job_id_;
    return s;
  }
  return resp;
}

absl::StatusOr<v1::JoinJobResponse> Coordinator::JoinJob(const v1::JoinJobRequest& req) {
  absl::MutexLock lock(&mu_);
  auto name_it = job_ids_by_name_.find(req.job_name());
  if (name_it == job_ids_by_name_.end()) {
    return absl::NotFoundError(absl::StrCat("no job named \"", req.job_name(), "\""));
  }
  JobRecord& job = jobs_.at(name_it->second);
  if (req.world_size() != job.spec.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("job \"", req.job_name(), "\" has world_size ", job.spec.world_size(),
                     ", the worker says ", req.world_size()));
  }
  if (req.rank() >= job.spec.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", req.rank(), " is out of range for job \"",
                                                   req.job_name(), "\" with world_size ",
                                                   job.spec.world_size()));
  }
  if (job.joined_ranks.insert(req.rank()).second) {
    if (absl::Status s = PersistLocked(); !s.ok()) {
      job.joined_ranks.erase(req.rank());
      return s;
    }
    OPTIMUS_LOG(Info, kLog, "worker joined job=", job.id, " rank=", req.rank(), " joined=",
                job.joined_ranks.size(), "/", job.spec.world_size());
  }
  v1::JoinJobResponse resp;
  resp.set_job_id(job.id);
  *resp.mutable_spec() = job.spec;
  *resp.mutable_map() = job.map;
  resp.set_state(job.state);
  resp.set_resume_step(job.resume_step);
  resp.set_current_step(ViewLocked(job).min_applied_step);
  if (job.restore.has_value()) *resp.mutable_restore() = *job.restore;
  return resp;
}

absl::StatusOr<v1::GetJobResponse> Coordinator::GetJob(uint64_t job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job with id ", job_id));
  v1::GetJobResponse resp;
  resp.set_job_id(job_id);
  *resp.mutable_spec() = it->second.spec;
  *resp.mutable_map() = it->second.map;
  resp.set_state(it->second.state);
  resp.set_resume_step(it->second.resume_step);
  resp.set_current_step(ViewLocked(it->second).min_applied_step);
  if (it->second.restore.has_value()) *resp.mutable_restore() = *it->second.restore;
  return resp;
}

absl::StatusOr<v1::ShardMap> Coordinator::GetShardMap(uint64_t job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job with id ", job_id));
  return it->second.map;
}

absl::StatusOr<std::optional<v1::ShardMap>> Coordinator::WaitForShardMap(uint64_t job_id,
                                                                         uint64_t after_epoch,
                                                                         absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  while (true) {
    if (shutting_down_) return absl::UnavailableError("coordinator is shutting down");
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job with id ", job_id));
    const JobRecord& job = it->second;
    if (job.map.epoch() > after_epoch) return std::optional<v1::ShardMap>(job.map);
    if (job.state == v1::JOB_STATE_FAILED) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", job_id, " failed: a shard holding its chunks went down"));
    }
    if (absl::Now() >= deadline) return std::optional<v1::ShardMap>();
    map_changed_.WaitWithDeadline(&mu_, deadline);
  }
}

v1::ShardStatus Coordinator::ShardStatusLocked(const ShardRecord& shard,
                                               const std::map<uint64_t, ShardLoad>& planned,
                                               absl::Time now) const {
  v1::ShardStatus s;
  s.set_shard_id(shard.id);
  *s.mutable_capabilities() = shard.capabilities;
  s.set_state(shard.state);
  s.set_memory_used_bytes(shard.memory_used_bytes);
  auto p = planned.find(shard.id);
  if (p != planned.end()) {
    s.set_memory_planned_bytes(p->second.size_bytes);
    // Chunks moved away still count until the shard has applied the map
    // that moved them: a drained shard (0 here) is safe to stop.
    s.set_chunks_owned(p->second.num_chunks + p->second.unreleased_chunks);
    s.set_backup_chunks(p->second.backup_chunks);
  }
  s.set_lease_age_ms(static_cast<uint64_t>(
      std::max<int64_t>(0, absl::ToInt64Milliseconds(now - shard.last_heartbeat))));
  return s;
}

v1::StatusResponse Coordinator::Status() {
  v1::StatusResponse resp;
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  const std::map<uint64_t, ShardLoad> planned = PlannedLoadLocked();
  for (const auto& [id, shard] : shards_) *resp.add_shards() = ShardStatusLocked(shard, planned, now);
  for (const auto& [id, job] : jobs_) {
    v1::JobStatus* j = resp.add_jobs();
    j->set_job_id(id);
    j->set_name(job.spec.name());
    j->set_state(job.state);
    j->set_world_size(job.spec.world_size());
    j->set_workers_joined(static_cast<uint32_t>(job.joined_ranks.size()));
    // Lowest step over the primaries; one that has not reported counts as 0.
    j->set_current_step(ViewLocked(job).min_applied_step);
    j->set_num_tensors(static_cast<uint32_t>(job.spec.tensors_size()));
    j->set_num_params(job.num_params);
    j->set_state_bytes(job.num_params * (IsAdamLike(job.spec.optimizer().kind()) ? 12 : 8));
    j->set_map_epoch(job.map.epoch());
    j->set_replication(job.spec.replication());
    j->set_num_chunks(static_cast<uint32_t>(job.map.chunks_size()));
    uint32_t with_backup = 0, in_sync = 0;
    for (int i = 0; i < job.map.chunks_size(); ++i) {
      if (job.map.chunks(i).backup_shard_id() == 0) continue;
      ++with_backup;
      if (job.backup_seeded[i]) ++in_sync;
    }
    j->set_chunks_with_backup(with_backup);
    j->set_backups_in_sync(in_sync);
  }
  return resp;
}

int Coordinator::SweepExpiredLeases(absl::Time now) {
  absl::MutexLock lock(&mu_);
  int marked_down = 0;
  for (auto& [id, shard] : shards_) {
    if (shard.state == v1::SHARD_STATE_DOWN || now - shard.last_heartbeat <= options_.lease) {
      continue;
    }
    const bool was_draining = shard.state == v1::SHARD_STATE_DRAINING;
    shard.state = v1::SHARD_STATE_DOWN;
    ++marked_down;
    for (auto& [job_id, job] : jobs_) job.departed.erase(id);
    OPTIMUS_LOG(Warning, kLog, "shard down id=", id, " host=", shard.capabilities.hostname(),
                was_draining ? " (was draining)" : "", ": no heartbeat for ",
                absl::FormatDuration(now - shard.last_heartbeat), " (lease ",
                absl::FormatDuration(options_.lease), ")");
  }
  // Every shard lost in this sweep is DOWN before any job is looked at: a
  // backup on a shard lost at the same time cannot be promoted. Jobs are
  // checked on every sweep, not only when a shard was just lost: a state
  // saved before a failover could be applied names DOWN shards too.
  std::vector<ShardInfo> candidates = PlacementCandidatesLocked();
  bool jobs_changed = false;
  for (auto& [job_id, job] : jobs_) jobs_changed |= FailoverLocked(job, candidates);
  if (marked_down > 0 || jobs_changed) {
    // A restarted coordinator gives every shard a fresh lease and marks the
    // dead ones down again, so a failed save here costs only a log line.
    if (absl::Status s = PersistLocked(); !s.ok()) OPTIMUS_LOG(Warning, kLog, s.ToString());
    map_changed_.SignalAll();
  }
  return marked_down;
}

bool Coordinator::FailoverLocked(JobRecord& job, std::vector<ShardInfo>& candidates) {
  if (job.state == v1::JOB_STATE_FAILED) return false;
  auto down = [&](uint64_t id) {
    auto it = shards_.find(id);
    return it == shards_.end() || it->second.state == v1::SHARD_STATE_DOWN;
  };
  std::set<uint64_t> lost;
  for (const auto& [shard_id, load] : job.load) {
    if (down(shard_id)) lost.insert(shard_id);
  }
  if (lost.empty()) return false;
  const std::string lost_names =
      absl::StrCat(lost.size() == 1 ? "shard " : "shards ", absl::StrJoin(lost, ","));

  // Can every chunk whose primary is lost be served by its backup?
  uint32_t lost_primaries = 0, unprotected = 0;
  for (int i = 0; i < job.map.chunks_size(); ++i) {
    const v1::ChunkPlacement& c = job.map.chunks(i);
    if (!down(c.shard_id())) continue;
    ++lost_primaries;
    if (c.backup_shard_id() == 0 || down(c.backup_shard_id()) || !job.backup_seeded[i]) {
      ++unprotected;
    }
  }
  if (unprotected > 0) {
    job.state = v1::JOB_STATE_FAILED;
    // Its shards drop it: its bytes are free for the jobs that follow.
    for (ShardInfo& s : candidates) {
      auto l = job.load.find(s.id);
      if (l != job.load.end()) s.memory_planned_bytes -= l->second.size_bytes;
    }
    checkpoints_.OnJobFailed(job.id, absl::StrCat(lost_names, " went down"));
    OPTIMUS_LOG(Error, kLog, "job failed id=", job.id, " name=", job.spec.name(), ": ",
                lost_names, " holding ", lost_primaries, " of its ", job.map.chunks_size(),
                " chunks as primary went down; ", unprotected,
                " of them had no in-sync backup on a live shard (replication ",
                job.spec.replication(), ")");
    return true;
  }

  uint32_t promoted = 0, backups_lost = 0;
  for (int i = 0; i < job.map.chunks_size(); ++i) {
    v1::ChunkPlacement* c = job.map.mutable_chunks(i);
    if (down(c->shard_id())) {
      c->set_shard_id(c->backup_shard_id());
      c->set_backup_shard_id(0);
      job.backup_seeded[i] = false;
      ++promoted;
    } else if (c->backup_shard_id() != 0 && down(c->backup_shard_id())) {
      c->set_backup_shard_id(0);
      job.backup_seeded[i] = false;
      ++backups_lost;
    }
  }
  uint32_t new_backups = 0, without = 0;
  if (job.spec.replication() == 1) {
    for (int i = 0; i < job.map.chunks_size(); ++i) {
      v1::ChunkPlacement* c = job.map.mutable_chunks(i);
      if (c->backup_shard_id() != 0) continue;
      const uint64_t b = TakeSlot(job, i, c->shard_id(), candidates);
      c->set_backup_shard_id(b);
      (b != 0 ? new_backups : without) += 1;
    }
  }
  CommitMapChangeLocked(job);
  OPTIMUS_LOG(Warning, kLog, "job ", job.spec.name(), ": ", lost_names,
              " lost; promoted backups for ", promoted, " chunks; new epoch ", job.map.epoch(),
              " (backups lost ", backups_lost, ", new backups ", new_backups,
              without > 0 ? absl::StrCat(", ", without, " chunks without a backup until a "
                                         "shard has room")
                          : std::string(),
              ")");
  return true;
}

int Coordinator::TickReplication(absl::Time now) {
  (void)now;  // Decisions depend on reports and states, not on time.
  absl::MutexLock lock(&mu_);
  std::vector<ShardInfo> candidates = PlacementCandidatesLocked();
  auto draining = [&](uint64_t id) {
    auto it = shards_.find(id);
    return it != shards_.end() && it->second.state == v1::SHARD_STATE_DRAINING;
  };
  int changed_jobs = 0;
  for (auto& [job_id, job] : jobs_) {
    if (job.state == v1::JOB_STATE_FAILED) continue;
    const bool rep1 = job.spec.replication() == 1;
    uint32_t promoted = 0, moved_backups = 0, temporary = 0, new_backups = 0;
    for (int i = 0; i < job.map.chunks_size(); ++i) {
      v1::ChunkPlacement* c = job.map.mutable_chunks(i);
      const uint64_t primary = c->shard_id(), backup = c->backup_shard_id();
      if (backup != 0 && draining(backup)) {
        // The backup leaves first; with the primary draining too, the new
        // backup is the one that will be promoted once in sync.
        if (rep1 || draining(primary)) {
          const uint64_t b = TakeSlot(job, i, primary, candidates);
          if (b == 0 && draining(primary)) continue;  // Keep it until a shard has room.
          c->set_backup_shard_id(b);
        } else {
          c->set_backup_shard_id(0);
        }
        job.backup_seeded[i] = false;
        ++moved_backups;
      } else if (draining(primary)) {
        if (backup == 0) {
          // No copy to promote: a temporary backup, which the primary
          // seeds at its next step.
          const uint64_t b = TakeSlot(job, i, primary, candidates);
          if (b == 0) continue;
          c->set_backup_shard_id(b);
          job.backup_seeded[i] = false;
          ++temporary;
        } else if (job.backup_seeded[i]) {
          c->set_shard_id(backup);
          c->set_backup_shard_id(rep1 ? TakeSlot(job, i, backup, candidates) : 0);
          job.backup_seeded[i] = false;
          ++promoted;
          if (c->backup_shard_id() != 0) ++new_backups;
        }
        // Otherwise wait for the backup to report in sync.
      } else if (rep1 && backup == 0) {
        const uint64_t b = TakeSlot(job, i, primary, candidates);
        if (b == 0) continue;
        c->set_backup_shard_id(b);
        job.backup_seeded[i] = false;
        ++new_backups;
      }
    }
    if (promoted + moved_backups + temporary + new_backups == 0) continue;
    CommitMapChangeLocked(job);
    ++changed_jobs;
    OPTIMUS_LOG(Info, kLog, "job ", job.spec.name(), ": promoted ", promoted,
                " backups of chunks on draining shards, moved ", moved_backups,
                " backups off draining shards, placed ", temporary, " temporary and ",
                new_backups, " new backups; new epoch ", job.map.epoch());
  }
  if (changed_jobs > 0) {
    if (absl::Status s = PersistLocked(); !s.ok()) OPTIMUS_LOG(Warning, kLog, s.ToString());
    map_changed_.SignalAll();
  }
  const std::map<uint64_t, ShardLoad> planned = PlannedLoadLocked();
  for (auto& [id, shard] : shards_) {
    if (shard.state != v1::SHARD_STATE_DRAINING || shard.drained_logged) continue;
    auto p = planned.find(id);
    if (p != planned.end() && p->second.num_chunks + p->second.unreleased_chunks > 0) continue;
    shard.drained_logged = true;
    OPTIMUS_LOG(Info, kLog, "shard ", id, " drained: it holds no chunk and can be stopped");
  }
  return changed_jobs;
}

absl::StatusOr<v1::DrainShardResponse> Coordinator::DrainShard(
    const v1::DrainShardRequest& req) {
  absl::MutexLock lock(&mu_);
  auto it = shards_.find(req.shard_id());
  if (it == shards_.end()) {
    return absl::NotFoundError(absl::StrCat("no shard with id ", req.shard_id()));
  }
  ShardRecord& shard = it->second;
  if (shard.state == v1::SHARD_STATE_DOWN) {
    return absl::FailedPreconditionError(
        absl::StrCat("shard ", shard.id, " is DOWN: it holds nothing to drain"));
  }
  const std::map<uint64_t, ShardLoad> planned = PlannedLoadLocked();
  auto held = planned.find(shard.id);
  const uint32_t chunks_held = held == planned.end() ? 0 : held->second.num_chunks;
  v1::DrainShardResponse resp;
  if (shard.state == v1::SHARD_STATE_DRAINING) {
    *resp.mutable_shard() = ShardStatusLocked(shard, planned, Now());
    // After a coordinator restart the count at the start is not known.
    resp.set_chunks_to_move(shard.drain_chunks_at_start != 0 ? shard.drain_chunks_at_start
                                                              : chunks_held);
    return resp;
  }

  // Each chunk it holds needs one new copy on another UP shard (not the
  // holder of its other copy), except a replication-0 chunk whose primary
  // it is and that already has a backup elsewhere (promoted as it is).
  // Checked with the placement rule over what is planned now, so that the
  // drain does not start what it cannot finish.
  std::vector<ShardInfo> candidates = PlacementCandidatesLocked();
  candidates.erase(std::remove_if(candidates.begin(), candidates.end(),
                                  [&](const ShardInfo& s) { return s.id == shard.id; }),
                   candidates.end());
  const std::vector<ShardInfo> others = candidates;  // Before this check's picks.
  uint64_t bytes_to_move = 0;
  for (const auto& [job_id, job] : jobs_) {
    if (job.state == v1::JOB_STATE_FAILED || job.load.count(shard.id) == 0) continue;
    for (int i = 0; i < job.map.chunks_size(); ++i) {
      const v1::ChunkPlacement& c = job.map.chunks(i);
      uint64_t other;
      if (c.shard_id() == shard.id) {
        other = c.backup_shard_id();
        auto o = shards_.find(other);
        const bool backup_usable = o != shards_.end() && o->second.state == v1::SHARD_STATE_UP;
        if (backup_usable && job.spec.replication() == 0) continue;
      } else if (c.backup_shard_id() == shard.id) {
        other = c.shard_id();
      } else {
        continue;
      }
      const uint64_t bytes = c.num_elems() * job.bytes_per_elem;
      bytes_to_move += bytes;
      if (TakeSlot(job, i, other, candidates) != 0) continue;
      uint64_t free_total = 0, free_largest = 0;
      for (const ShardInfo& s : others) {
        const uint64_t f =
            s.memory_planned_bytes >= s.memory_limit_bytes ? 0
                                                           : s.memory_limit_bytes - s.memory_planned_bytes;
        free_total += f;
        free_largest = std::max(free_largest, f);
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot drain shard ", shard.id, ": its ", chunks_held,
          " chunks need room on other live shards, and chunk (tensor ", c.tensor(), ", chunk ",
          c.chunk(), ") of job \"", job.spec.name(), "\" (", bytes,
          " bytes) fits on no live shard that is not draining",
          other != 0 ? absl::StrCat(" other than shard ", other, ", which holds its other copy")
                     : "",
          ", after ", bytes_to_move - bytes, " bytes of its other chunks; ",
          free_total, " bytes free over ", candidates.size(),
          " live shards that are not draining, largest free ", free_largest,
          " bytes; add a shard or free memory first"));
    }
  }

  shard.state = v1::SHARD_STATE_DRAINING;
  if (absl::Status s = PersistLocked(); !s.ok()) {
    shard.state = v1::SHARD_STATE_UP;
    return s;
  }
  shard.drain_chunks_at_start = chunks_held;
  shard.drained_logged = false;
  OPTIMUS_LOG(Info, kLog, "shard ", shard.id, " draining: ", chunks_held,
              " chunks (", held == planned.end() ? 0 : held->second.backup_chunks,
              " of them backups) move to other shards");
  *resp.mutable_shard() = ShardStatusLocked(shard, planned, Now());
  resp.set_chunks_to_move(chunks_held);
  return resp;
}

CheckpointJobView Coordinator::ViewLocked(const JobRecord& job) const {
  CheckpointJobView v;
  v.job_id = job.id;
  v.spec = job.spec;
  v.state = job.state;
  v.resume_step = job.resume_step;
  uint64_t min_applied = std::numeric_limits<uint64_t>::max();
  for (const auto& [shard_id, load] : job.load) {
    // Checkpoint parts and the job's step come from the primaries: a
    // backup writes no part, and a new one reports no step until seeded.
    if (load.num_chunks == load.backup_chunks) continue;
    v.owners.insert(shard_id);
    auto sh = shards_.find(shard_id);
    if (sh == shards_.end() || !sh->second.capabilities.checkpoints()) {
      v.owners_without_checkpoint_dir.insert(shard_id);
    }
    auto p = job.progress.find(shard_id);
    const uint64_t applied = p == job.progress.end() ? 0 : p->second.applied_step();
    min_applied = std::min(min_applied, applied);
    if (p != job.progress.end()) {
      v.max_applied_step = std::max(v.max_applied_step, p->second.max_applied_step());
    }
  }
  v.min_applied_step = v.owners.empty() ? 0 : min_applied;
  return v;
}

absl::StatusOr<v1::CreateCheckpointResponse> Coordinator::CreateCheckpoint(
    const v1::CreateCheckpointRequest& req) {
  absl::MutexLock lock(&mu_);
  auto name_it = job_ids_by_name_.find(req.job_name());
  if (name_it == job_ids_by_name_.end()) {
    return absl::NotFoundError(absl::StrCat("no job named \"", req.job_name(), "\""));
  }
  absl::StatusOr<v1::CheckpointInfo> info =
      checkpoints_.Create(ViewLocked(jobs_.at(name_it->second)));
  if (!info.ok()) return info.status();
  v1::CreateCheckpointResponse resp;
  *resp.mutable_checkpoint() = *std::move(info);
  return resp;
}

v1::ListCheckpointsResponse Coordinator::ListCheckpoints(const v1::ListCheckpointsRequest& req) {
  v1::ListCheckpointsResponse resp;
  if (req.job_name().find('/') != std::string::npos) return resp;
  for (v1::CheckpointInfo& c : checkpoints_.List(req.job_name())) {
    *resp.add_checkpoints() = std::move(c);
  }
  return resp;
}

absl::StatusOr<v1::RestoreCheckpointResponse> Coordinator::RestoreCheckpoint(
    const v1::RestoreCheckpointRequest& req) {
  // Reading and checking every file takes a while: no lock is held for it.
  v1::CheckpointInfo info;
  absl::StatusOr<v1::RestoreSource> src =
      checkpoints_.PrepareRestore(req.job_name(), req.checkpoint_id(), &info);
  if (!src.ok()) return src.status();
  v1::CreateJobRequest create;
  *create.mutable_spec() = src->manifest().spec();
  create.mutable_spec()->set_name(req.new_job_name().empty() ? req.job_name()
                                                             : req.new_job_name());
  if (req.max_chunk_bytes() != 0) create.mutable_spec()->set_max_chunk_bytes(req.max_chunk_bytes());
  absl::StatusOr<v1::CreateJobResponse> job = CreateJobInternal(create, &*src);
  if (!job.ok()) return job.status();
  OPTIMUS_LOG(Info, kLog, "job ", job->job_id(), " (", create.spec().name(),
              ") restored from ", info.path(), " at step ", src->manifest().step());
  v1::RestoreCheckpointResponse resp;
  resp.set_job_id(job->job_id());
  resp.set_resume_step(src->manifest().step());
  *resp.mutable_checkpoint() = info;
  return resp;
}

int Coordinator::RollbackFailedJobs() {
  if (!options_.rollback_on_shard_loss || !checkpoints_.enabled()) return 0;
  std::vector<std::string> names;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, job] : jobs_) {
      if (job.state != v1::JOB_STATE_FAILED || job.rollback_tried) continue;
      job.rollback_tried = true;
      auto holder = job_ids_by_name_.find(job.spec.name());
      if (holder != job_ids_by_name_.end() && holder->second == id) {
        names.push_back(job.spec.name());
      }
    }
  }
  int restored = 0;
  for (const std::string& name : names) {
    v1::RestoreCheckpointRequest req;
    req.set_job_name(name);
    absl::StatusOr<v1::RestoreCheckpointResponse> r = RestoreCheckpoint(req);
    if (!r.ok()) {
      OPTIMUS_LOG(Error, kLog, "job ", name, " failed and cannot roll back: ",
                  r.status().ToString());
      continue;
    }
    ++restored;
    OPTIMUS_LOG(Warning, kLog, "job ", name, " rolled back to checkpoint ",
                r->checkpoint().checkpoint_id(), ": new job id ", r->job_id(),
                "; workers re-join and resume at step ", r->resume_step());
  }
  return restored;
}

void Coordinator::FillLastCheckpoints(v1::StatusResponse* status) {
  if (!checkpoints_.enabled()) return;
  for (v1::JobStatus& j : *status->mutable_jobs()) {
    std::optional<v1::CheckpointInfo> last = checkpoints_.Last(j.name());
    if (last.has_value()) *j.mutable_last_checkpoint() = *std::move(last);
  }
}

void Coordinator::TickCheckpoints(absl::Time now) {
  if (!checkpoints_.enabled()) return;
  absl::MutexLock lock(&mu_);
  std::vector<CheckpointJobView> views;
  for (const auto& [id, job] : jobs_) {
    if (job.state == v1::JOB_STATE_FAILED) continue;
    views.push_back(ViewLocked(job));
  }
  checkpoints_.Tick(views, now);
}

void Coordinator::BeginShutdown() {
  absl::MutexLock lock(&mu_);
  shutting_down_ = true;
  map_changed_.SignalAll();
}

// ---------------------------------------------------------------------------
// gRPC adapter: converts statuses and nothing else.

class CoordinatorServer::Service final : public v1::Coordinator::Service {
 public:
  explicit Service(Coordinator* core) : core_(core) {}

  // Errors answered, by absl::StatusCode value.
  static constexpr int kNumCodes = 17;
  uint64_t errors(int code) const { return errors_[code].load(); }

  grpc::Status RegisterShard(grpc::ServerContext*, const v1::RegisterShardRequest* req,
                             v1::RegisterShardResponse* resp) override {
    return Reply(core_->RegisterShard(*req), resp);
  }
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                         v1::HeartbeatResponse* resp) override {
    *resp = core_->Heartbeat(*req);
    return grpc::Status::OK;
  }
  grpc::Status CreateJob(grpc::ServerContext*, const v1::CreateJobRequest* req,
                         v1::CreateJobResponse* resp) override {
    return Reply(core_->CreateJob(*req), resp);
  }
  grpc::Status JoinJob(grpc::ServerContext*, const v1::JoinJobRequest* req,
                       v1::JoinJobResponse* resp) override {
    return Reply(core_->JoinJob(*req), resp);
  }
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest* req,
                      v1::GetJobResponse* resp) override {
    return Reply(core_->GetJob(req->job_id()), resp);
  }
  grpc::Status GetShardMap(grpc::ServerContext*, const v1::GetShardMapRequest* req,
                           v1::ShardMap* resp) override {
    return Reply(core_->GetShardMap(req->job_id()), resp);
  }
  grpc::Status WatchShardMap(grpc::ServerContext* ctx, const v1::WatchShardMapRequest* req,
                             grpc::ServerWriter<v1::ShardMap>* writer) override {
    // The sync API has no cancellation callback: wait in short slices and
    // poll IsCancelled() between them.
    constexpr absl::Duration kPollInterval = absl::Milliseconds(100);
    uint64_t after_epoch = req->after_epoch();
    while (!ctx->IsCancelled()) {
      absl::StatusOr<std::optional<v1::ShardMap>> map =
          core_->WaitForShardMap(req->job_id(), after_epoch, kPollInterval);
      if (!map.ok()) return ToGrpc(map.status());
      if (!map->has_value()) continue;
      if (!writer->Write(**map)) return grpc::Status::OK;  // Client went away.
      after_epoch = (*map)->epoch();
    }
    return grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled by the client");
  }
  grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*,
                      v1::StatusResponse* resp) override {
    *resp = core_->Status();
    core_->FillLastCheckpoints(resp);
    return grpc::Status::OK;
  }
  grpc::Status CreateCheckpoint(grpc::ServerContext*, const v1::CreateCheckpointRequest* req,
                                v1::CreateCheckpointResponse* resp) override {
    return Reply(core_->CreateCheckpoint(*req), resp);
  }
  grpc::Status ListCheckpoints(grpc::ServerContext*, const v1::ListCheckpointsRequest* req,
                               v1::ListCheckpointsResponse* resp) override {
    *resp = core_->ListCheckpoints(*req);
    return grpc::Status::OK;
  }
  grpc::Status RestoreCheckpoint(grpc::ServerContext*, const v1::RestoreCheckpointRequest* req,
                                 v1::RestoreCheckpointResponse* resp) override {
    return Reply(core_->RestoreCheckpoint(*req), resp);
  }
  grpc::Status DrainShard(grpc::ServerContext*, const v1::DrainShardRequest* req,
                          v1::DrainShardResponse* resp) override {
    return Reply(core_->DrainShard(*req), resp);
  }

 private:
  template <typename T>
  grpc::Status Reply(absl::StatusOr<T> result, T* resp) {
    if (!result.ok()) {
      const int code = static_cast<int>(result.status().code());
      if (code > 0 && code < kNumCodes) errors_[code].fetch_add(1);
      return ToGrpc(result.status());
    }
    *resp = *std::move(result);
    return grpc::Status::OK;
  }

  Coordinator* const core_;
  std::array<std::atomic<uint64_t>, kNumCodes> errors_{};
};

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const CoordinatorOptions& options) {
  if (options.lease <= absl::ZeroDuration() || options.sweep_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("coordinator options: lease and sweep_interval must be > 0");
  }
  const size_t colon = options.listen_address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address \"", options.listen_address, "\" is not HOST:PORT"));
  }
  std::unique_ptr<CoordinatorServer> s(new CoordinatorServer());
  s->host_ = options.listen_address.substr(0, colon);
  if (s->host_.empty() || s->host_ == "0.0.0.0" || s->host_ == "[::]" || s->host_ == "*") {
    s->host_ = "127.0.0.1";
  }
  s->core_ = std::make_unique<Coordinator>(options);
  if (absl::Status r = s->core_->Recover(); !r.ok()) return r;
  s->service_ = std::make_unique<Service>(s->core_.get());
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, grpc::InsecureServerCredentials(), &s->port_);
  builder.RegisterService(s->service_.get());
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("coordinator cannot listen on ", options.listen_address));
  }
  Coordinator* core = s->core_.get();
  absl::Notification* stop = &s->stop_sweeper_;
  const absl::Duration interval = options.sweep_interval;
  s->sweeper_ = std::thread([core, stop, interval] {
    while (!stop->WaitForNotificationWithTimeout(interval)) {
      core->SweepExpiredLeases(core->Now());
      core->TickReplication(core->Now());
      core->TickCheckpoints(absl::Now());
      core->RollbackFailedJobs();
    }
  });
  if (!options.metrics_address.empty()) {
    CoordinatorServer* raw = s.get();
    auto http = HttpServer::Start(
        options.metrics_address,
        {{"/metrics", [raw] { return HttpResponse{200, "text/plain; version=0.0.4",
                                                  raw->RenderMetrics()}; }},
         {"/healthz", [] { return HttpResponse{200, "text/plain", "ok\n"}; }}});
    if (!http.ok()) return http.status();
    s->http_ = std::move(*http);
  }
  OPTIMUS_LOG(Info, kLog, "coordinator listening on ", s->address(),
              " lease=", absl::FormatDuration(options.lease));
  return s;
}

int CoordinatorServer::metrics_port() const { return http_ != nullptr ? http_->port() : 0; }

std::string CoordinatorServer::RenderMetrics() const {
  v1::StatusResponse st = core_->Status();
  core_->FillLastCheckpoints(&st);
  MetricsText m;
  int up = 0, down = 0, draining = 0;
  for (const auto& sh : st.shards()) {
    (sh.state() == v1::SHARD_STATE_UP ? up
     : sh.state() == v1::SHARD_STATE_DRAINING ? draining
                                              : down)++;
    const MetricLabels id = {{"shard_id", absl::StrCat(sh.shard_id())},
                             {"kind", sh.capabilities().kind() == v1::SHARD_KIND_DPU ? "dpu"
                                                                                     : "host"}};
    m.Gauge("optimus_coord_shard_up", "1 while the shard holds its lease (draining too).",
            sh.state() != v1::SHARD_STATE_DOWN ? 1 : 0, id);
    m.Gauge("optimus_coord_shard_draining", "1 while the shard is being drained.",
            sh.state() == v1::SHARD_STATE_DRAINING ? 1 : 0, id);
    m.Gauge("optimus_coord_shard_lease_age_seconds", "Time since the shard's last heartbeat.",
            sh.lease_age_ms() / 1000.0, id);
    m.Gauge("optimus_coord_shard_memory_used_bytes", "State bytes the shard reports allocated.",
            sh.memory_used_bytes(), id);
    m.Gauge("optimus_coord_shard_memory_limit_bytes", "The shard's state budget.",
            sh.capabilities().memory_limit_bytes(), id);
    m.Gauge("optimus_coord_shard_chunks_owned", "Chunks placed on the shard.", sh.chunks_owned(),
            id);
    m.Gauge("optimus_coord_shard_backup_chunks",
            "Of the chunks placed on the shard, those it holds as a backup.", sh.backup_chunks(),
            id);
  }
  m.Gauge("optimus_coord_shards", "Registered shards by state.", up, {{"state", "up"}});
  m.Gauge("optimus_coord_shards", "Registered shards by state.", down, {{"state", "down"}});
  m.Gauge("optimus_coord_shards", "Registered shards by state.", draining,
          {{"state", "draining"}});
  for (const auto& j : st.jobs()) {
    const MetricLabels id = {{"job", j.name()}};
    m.Gauge("optimus_coord_job_step", "Lowest step applied over the job's shards.",
            j.current_step(), id);
    m.Gauge("optimus_coord_job_ready", "1 while the job is READY.",
            j.state() == v1::JOB_STATE_READY ? 1 : 0, id);
    m.Gauge("optimus_coord_job_workers_joined", "Workers that joined the job.",
            j.workers_joined(), id);
    m.Gauge("optimus_coord_job_state_bytes", "fp32 master + moment bytes of the job.",
            j.state_bytes(), id);
    m.Gauge("optimus_coord_job_replication", "Backups per chunk the job asked for (0 or 1).",
            j.replication(), id);
    m.Gauge("optimus_coord_job_chunks", "Chunks of the job.", j.num_chunks(), id);
    m.Gauge("optimus_coord_job_chunks_with_backup",
            "Chunks of the job whose map names a backup (replication 1; below "
            "optimus_coord_job_chunks: degraded).",
            j.chunks_with_backup(), id);
    m.Gauge("optimus_coord_job_backups_in_sync",
            "Backups of the job reported seeded: chunks whose lost primary is replaced "
            "without losing a step.",
            j.backups_in_sync(), id);
    if (j.has_last_checkpoint()) {
      const v1::CheckpointInfo& c = j.last_checkpoint();
      m.Gauge("optimus_coord_job_last_checkpoint_step",
              "Step of the job's newest checkpoint (any state).", c.step(), id);
      m.Gauge("optimus_coord_job_last_checkpoint_failed",
              "1 when the job's newest checkpoint FAILED (see optimusctl checkpoint list).",
              c.state() == v1::CHECKPOINT_STATE_FAILED ? 1 : 0, id);
    }
  }
  for (int c = 1; c < Service::kNumCodes; ++c) {
    m.Counter("optimus_coord_errors_total", "RPCs answered with an error, by kind.",
              service_->errors(c),
              {{"kind", absl::StatusCodeToString(static_cast<absl::StatusCode>(c))}});
  }
  return m.text();
}

std::string CoordinatorServer::address() const { return absl::StrCat(host_, ":", port_); }

void CoordinatorServer::Shutdown() {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  http_.reset();
  core_->BeginShutdown();  // Ends WatchShardMap streams.
  // Gives in-flight unary calls a moment, then cancels what is left.
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  server_->Wait();
  stop_sweeper_.Notify();
  if (sweeper_.joinable()) sweeper_.join();
  OPTIMUS_LOG(Info, kLog, "coordinator stopped");
}

CoordinatorServer::~CoordinatorServer() {
  if (server_ != nullptr) Shutdown();
}

}  // namespace optimus
