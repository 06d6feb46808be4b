// Coordinator: jobs. Create (and restore's create), join, leave, delete,
// and reading jobs and maps. See coordinator_core.h.
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/grpc_limits.h"
#include "common/logging.h"
#include "common/security.h"
#include "coordinator/coordinator_core.h"

namespace optimus {
namespace {
constexpr char kLog[] = "coord";

absl::Status NoJobNamed(const std::string& name) {
  return absl::NotFoundError(absl::StrCat("no job named \"", name, "\""));
}

// Primaries, and with replication a backup of each on another shard: a
// job asking for a backup per chunk gets one from the start, or is
// refused; it must not silently run without.
absl::StatusOr<std::vector<ChunkSpec>> Place(std::vector<ChunkSpec> chunks,
                                             const std::vector<ShardInfo>& live, bool replicated,
                                             uint64_t bytes_per_elem, uint64_t overhead) {
  absl::StatusOr<std::vector<ChunkSpec>> placed =
      PlaceChunks(std::move(chunks), live, bytes_per_elem, overhead);
  if (placed.ok() && replicated) {
    placed = PlaceBackups(*std::move(placed), live, bytes_per_elem, overhead);
  }
  return placed;
}

const char* JobStateName(v1::JobState s) {
  switch (s) {
    case v1::JOB_STATE_PENDING: return "PENDING";
    case v1::JOB_STATE_READY: return "READY";
    case v1::JOB_STATE_FAILED: return "FAILED";
    default: return "UNSPECIFIED";
  }
}
}  // namespace

absl::StatusOr<v1::CreateJobResponse> Coordinator::CreateJob(const v1::CreateJobRequest& req,
                                                             const Abandoned& abandoned) {
  return CreateJobInternal(req, nullptr, abandoned);
}

absl::StatusOr<v1::CreateJobResponse> Coordinator::CreateJobInternal(
    const v1::CreateJobRequest& req, const v1::RestoreSource* restore,
    const Abandoned& abandoned) {
  v1::JobSpec spec = req.spec();
  absl::StatusOr<CheckedSpec> checked = CheckAndFillSpec(spec, options_.job_limits);
  if (!checked.ok()) {
    if (checked.status().code() == absl::StatusCode::kResourceExhausted) {
      CountRefusal(JobRefusal::kQuota);
      OPTIMUS_LOG(Warning, kLog, "job refused name=", spec.name(), ": ",
                  checked.status().message());
    }
    return checked.status();
  }
  std::string token = req.job_token();
  if (!token.empty()) {
    if (absl::Status s = security::CheckToken(token); !s.ok()) return s;
  } else {
    absl::StatusOr<std::string> fresh = security::NewToken();
    if (!fresh.ok()) return fresh.status();
    token = *std::move(fresh);
  }
  const uint64_t bytes_per_elem = checked->bytes_per_elem;
  std::vector<ChunkSpec> chunks =
      SplitTensors(checked->tensor_num_elems, spec.max_chunk_bytes() / 4);
  // Workers read the spec and the whole map in one gRPC message (JoinJob,
  // GetJob), so do shards (their job loads): a job whose pair would not fit
  // (1 MiB kept for the rest: endpoints, state) could never run.
  const uint64_t message_bytes =
      spec.ByteSizeLong() + MapBytesBound(chunks, spec.replication() > 0) + (uint64_t{1} << 20);
  if (message_bytes > static_cast<uint64_t>(kMaxGrpcMessageBytes)) {
    CountRefusal(JobRefusal::kMapSize);
    OPTIMUS_LOG(Warning, kLog, "job refused name=", spec.name(), ": spec and map take up to ",
                message_bytes, " bytes");
    return absl::ResourceExhaustedError(absl::StrCat(
        "job \"", spec.name(), "\": its spec and shard map take up to ", message_bytes,
        " bytes with 1 MiB for the rest of a message, more than one gRPC message may carry (",
        kMaxGrpcMessageBytes, "); use fewer chunks (raise max_chunk_bytes) or shorter names"));
  }

  // Placement is planned with no lock held, over a copy of the candidates
  // taken under mu_ with the generation of what it depends on (the shards'
  // states, every job's planned bytes). The commit below checks that
  // generation: if a shard registered, drained or went down, or a job's
  // map changed meanwhile, the plan is stale and is made again, at most
  // kOffLockPlacements times off the lock, then once under it (so that
  // shards changing all the time cannot starve a job). Either way the
  // result is what planning under the lock at commit time would give.
  const bool replicated = spec.replication() == 1;
  uint64_t planned_gen = 0;
  absl::StatusOr<std::vector<ChunkSpec>> placed;
  for (int attempt = 0; attempt < kOffLockPlacements; ++attempt) {
    std::vector<ShardInfo> live;
    {
      absl::MutexLock lock(&mu_);
      const JobRecord* holder = jobs_.FindByName(spec.name());
      if (holder != nullptr &&
          !(restore != nullptr && holder->state == v1::JOB_STATE_FAILED)) {
        return absl::AlreadyExistsError(absl::StrCat(
            "a job named \"", spec.name(), "\" already exists (id ", holder->id, ")"));
      }
      live = PlacementCandidatesLocked();
      planned_gen = PlacementGenerationLocked();
    }
    placed = Place(chunks, live, replicated, bytes_per_elem, checked->chunk_overhead_bytes);
    if (options_.after_off_lock_placement) options_.after_off_lock_placement(attempt);
    absl::MutexLock lock(&mu_);
    if (PlacementGenerationLocked() == planned_gen) break;
    ++counters_.placement_retries;
  }

  absl::MutexLock commit(&commit_mu_);
  v1::CreateJobResponse resp;
  uint64_t job_id;
  uint64_t replaced = 0;  // A FAILED job whose name a restore takes over.
  absl::StatusOr<uint64_t> seq;
  std::shared_ptr<const MapSnapshot> snap;
  {
    absl::MutexLock lock(&mu_);
    if (abandoned && abandoned()) {
      return absl::CancelledError(absl::StrCat("job \"", spec.name(),
                                               "\" not created: the caller gave up first"));
    }
    Planning planning(&planning_);
    TakeDownShardsLocked(Now());  // No chunk goes to a shard whose lease expired.
    JobRecord* holder = jobs_.FindByName(spec.name());
    const bool takes_over =
        holder != nullptr && restore != nullptr && holder->state == v1::JOB_STATE_FAILED;
    if (holder != nullptr && !takes_over) {
      return absl::AlreadyExistsError(absl::StrCat("a job named \"", spec.name(),
                                                   "\" already exists (id ", holder->id, ")"));
    }
    if (PlacementGenerationLocked() != planned_gen) {
      // Still changing: planned here, under the lock, from what is now.
      placed = Place(std::move(chunks), PlacementCandidatesLocked(), replicated, bytes_per_elem,
                     checked->chunk_overhead_bytes);
      ++counters_.placements_under_lock;
    }
    if (!placed.ok()) {
      if (placed.status().code() == absl::StatusCode::kResourceExhausted) {
        ++counters_.jobs_refused[static_cast<int>(JobRefusal::kCapacity)];
      }
      OPTIMUS_LOG(Warning, kLog, "job refused name=", spec.name(), ": ",
                  placed.status().message());
      return absl::Status(placed.status().code(),
                          absl::StrCat("job \"", spec.name(), "\": ", placed.status().message()));
    }
    if (restore != nullptr) {
      // Backups load their chunks from the checkpoint too.
      for (const ChunkSpec& c : *placed) {
        for (uint64_t id : {c.shard_id, c.backup_shard_id}) {
          const ShardRecord* s = id != 0 ? shards_.Find(id) : nullptr;
          if (s != nullptr && !s->capabilities.checkpoints()) {
            return absl::FailedPreconditionError(
                absl::StrCat("cannot restore job \"", spec.name(), "\": shard ", id,
                             " was started without --checkpoint_dir"));
          }
        }
      }
    }
    JobRecord job;
    job.id = jobs_.TakeNextId();
    job.spec = spec;
    // A restore over a FAILED job keeps its token: its workers re-join.
    job.token = takes_over && req.job_token().empty() && !holder->token.empty() ? holder->token
                                                                                : token;
    resp.set_job_token(job.token);
    if (restore != nullptr) {
      job.restore = *restore;
      job.resume_step = restore->manifest().step();
    }
    job.bytes_per_elem = bytes_per_elem;
    job.num_params = checked->num_params;
    job.map.set_job_id(job.id);
    job.map.set_epoch(1);
    job.parts_since = 1;  // Every part is new at the first epoch.
    job.changes_since = 1;
    for (const ChunkSpec& c : *placed) {
      v1::ChunkPlacement* p = job.map.add_chunks();
      p->set_tensor(c.tensor);
      p->set_chunk(c.chunk);
      p->set_offset_elems(c.offset_elems);
      p->set_num_elems(c.num_elems);
      p->set_shard_id(c.shard_id);
      p->set_backup_shard_id(c.backup_shard_id);
    }
    job.load = ComputeLoad(*placed, bytes_per_elem, checked->chunk_overhead_bytes);
    SetEndpointsLocked(job);
    job.backup_seeded.assign(job.map.chunks_size(), false);
    OPTIMUS_LOG(Info, kLog, "job created id=", job.id, " name=", spec.name(),
                " world_size=", spec.world_size(), " tensors=", spec.tensors_size(),
                " params=", job.num_params, " chunks=", job.map.chunks_size(),
                " replication=", spec.replication(), " shards=", job.load.size(),
                " bytes_per_elem=", bytes_per_elem);
    resp.set_job_id(job.id);
    job_id = job.id;
    if (takes_over) {
      replaced = holder->id;
      holder->deleting = true;  // Out of the snapshot; deleted once it is durable.
    }
    // The map goes into the answer from the epoch's snapshot, with no lock.
    snap = SnapshotOf(jobs_.Add(std::move(job)));
    seq = SnapshotLocked();
  }
  if (absl::Status s = WaitDurable(seq); !s.ok()) {
    absl::MutexLock lock(&mu_);
    // Its id is not handed out again: shards may have seen it in the
    // meantime, and they are told to release it.
    jobs_.Remove(job_id);
    if (JobRecord* old = jobs_.Find(replaced); old != nullptr) {
      old->deleting = false;
      jobs_.ClaimName(old->spec.name(), old->id);
    }
    SaveLaterLocked();
    return s;
  }
  if (replaced != 0) {
    absl::MutexLock lock(&mu_);
    FinishDeleteLocked(replaced, "replaced by a job restored under its name");
  }
  *resp.mutable_map() = snap->map;
  return resp;
}

absl::StatusOr<v1::JoinJobResponse> Coordinator::JoinJob(const v1::JoinJobRequest& req) {
  absl::MutexLock commit(&commit_mu_);
  v1::JoinJobResponse resp;
  uint64_t job_id;
  absl::StatusOr<uint64_t> seq = 0;
  bool joined_now;
  std::shared_ptr<const MapSnapshot> snap;
  {
    absl::MutexLock lock(&mu_);
    JobRecord* job = jobs_.FindByName(req.job_name());
    if (job == nullptr) return NoJobNamed(req.job_name());
    if (req.world_size() != job->spec.world_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("job \"", req.job_name(), "\" has world_size ", job->spec.world_size(),
                       ", the worker says ", req.world_size()));
    }
    if (req.rank() >= job->spec.world_size()) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", req.rank(),
                                                     " is out of range for job \"",
                                                     req.job_name(), "\" with world_size ",
                                                     job->spec.world_size()));
    }
    job_id = job->id;
    joined_now = job->joined_ranks.insert(req.rank()).second;
    if (joined_now) {
      seq = SnapshotLocked();
      OPTIMUS_LOG(Info, kLog, "worker joined job=", job->id, " rank=", req.rank(), " joined=",
                  job->joined_ranks.size(), "/", job->spec.world_size());
    }
    resp.set_job_id(job->id);
    snap = SnapshotOf(*job);  // Copied below, with no lock held.
    resp.set_state(job->state);
    resp.set_current_step(ViewLocked(*job).min_applied_step);
    if (!data_plane_key_.empty()) {
      resp.set_data_plane_key(security::JobDataPlaneKey(data_plane_key_, job->id));
    }
  }
  *resp.mutable_spec() = snap->spec;
  *resp.mutable_map() = snap->map;
  resp.set_resume_step(snap->resume_step);
  if (snap->restore.has_value()) *resp.mutable_restore() = *snap->restore;
  if (absl::Status s = WaitDurable(seq); !s.ok()) {
    absl::MutexLock lock(&mu_);
    if (JobRecord* job = jobs_.Find(job_id); job != nullptr && joined_now) {
      job->joined_ranks.erase(req.rank());
    }
    SaveLaterLocked();
    return s;
  }
  return resp;
}

absl::StatusOr<v1::LeaveJobResponse> Coordinator::LeaveJob(const v1::LeaveJobRequest& req) {
  absl::MutexLock commit(&commit_mu_);
  v1::LeaveJobResponse resp;
  uint64_t job_id;
  absl::StatusOr<uint64_t> seq = 0;
  bool left_now;
  {
    absl::MutexLock lock(&mu_);
    JobRecord* job = jobs_.FindByName(req.job_name());
    if (job == nullptr) return NoJobNamed(req.job_name());
    if (req.rank() >= job->spec.world_size()) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", req.rank(),
                                                     " is out of range for job \"",
                                                     req.job_name(), "\" with world_size ",
                                                     job->spec.world_size()));
    }
    job_id = job->id;
    left_now = job->joined_ranks.erase(req.rank()) > 0;
    if (left_now) {
      seq = SnapshotLocked();
      OPTIMUS_LOG(Info, kLog, "worker left job=", job->id, " rank=", req.rank(), " joined=",
                  job->joined_ranks.size(), "/", job->spec.world_size());
    }
    resp.set_workers_joined(static_cast<uint32_t>(job->joined_ranks.size()));
  }
  if (absl::Status s = WaitDurable(seq); !s.ok()) {
    absl::MutexLock lock(&mu_);
    if (JobRecord* job = jobs_.Find(job_id); job != nullptr && left_now) {
      job->joined_ranks.insert(req.rank());
    }
    SaveLaterLocked();
    return s;
  }
  return resp;
}

absl::StatusOr<v1::DeleteJobResponse> Coordinator::DeleteJob(const v1::DeleteJobRequest& req) {
  if (req.job_name().empty()) return absl::InvalidArgumentError("job_name is empty");
  absl::MutexLock commit(&commit_mu_);
  v1::DeleteJobResponse resp;
  absl::StatusOr<uint64_t> seq;
  {
    absl::MutexLock lock(&mu_);
    JobRecord* job = jobs_.FindByName(req.job_name());
    if (job == nullptr) return NoJobNamed(req.job_name());
    if (!req.force() && job->state != v1::JOB_STATE_FAILED && !job->joined_ranks.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "job \"", req.job_name(), "\" has ", job->joined_ranks.size(),
          " workers joined (ranks ", absl::StrJoin(job->joined_ranks, ","),
          "): they leave when training ends (Client::Leave); delete with force to end it "
          "under them (their requests then fail)"));
    }
    resp.set_job_id(job->id);
    resp.set_state(job->state);
    resp.set_workers_joined(static_cast<uint32_t>(job->joined_ranks.size()));
    uint64_t bytes = 0;
    for (const auto& [shard_id, load] : job->load) bytes += load.size_bytes;
    resp.set_state_bytes(bytes);
    job->deleting = true;
    seq = SnapshotLocked();
  }
  if (absl::Status s = WaitDurable(seq); !s.ok()) {
    absl::MutexLock lock(&mu_);
    if (JobRecord* job = jobs_.Find(resp.job_id()); job != nullptr) job->deleting = false;
    SaveLaterLocked();
    return s;
  }
  absl::MutexLock lock(&mu_);
  FinishDeleteLocked(resp.job_id(), req.force() ? "deleted (force)" : "deleted");
  return resp;
}

void Coordinator::FinishDeleteLocked(uint64_t job_id, const char* why) {
  std::optional<JobRecord> job = jobs_.Remove(job_id);
  if (!job.has_value()) return;
  checkpoints_.OnJobDeleted(job_id);
  if (jobs_.FindByName(job->spec.name()) == nullptr) {
    checkpoints_.ForgetJobName(job->spec.name());
  }
  ++counters_.jobs_deleted;
  map_changed_.SignalAll();  // Its watchers end with NOT_FOUND.
  OPTIMUS_LOG(Info, kLog, "job ", why, ": id=", job_id, " name=", job->spec.name(),
              " state=", JobStateName(job->state), " workers_joined=", job->joined_ranks.size(),
              " shards=", job->load.size(), "; its shards release it at their next heartbeat");
}

absl::StatusOr<v1::GetJobResponse> Coordinator::GetJob(uint64_t job_id, uint64_t for_shard_id) {
  // Under the lock only what changes between epochs; the map is copied (or
  // cut down to one shard's part) from its snapshot after the lock is let
  // go, so that N holders fetching one epoch cost the lock O(N), not
  // O(N x map).
  std::shared_ptr<const MapSnapshot> snap;
  v1::GetJobResponse resp;
  {
    absl::MutexLock lock(&mu_);
    JobRecord* job = jobs_.Find(job_id);
    if (job == nullptr) return absl::NotFoundError(absl::StrCat("no job with id ", job_id));
    snap = SnapshotOf(*job);
    resp.set_state(job->state);
    // A shard does not read it, and it costs a look at every holder.
    if (for_shard_id == 0) resp.set_current_step(ViewLocked(*job).min_applied_step);
  }
  resp.set_job_id(job_id);
  *resp.mutable_spec() = for_shard_id == 0 ? snap->spec : ShardSpecOf(snap->spec);
  if (for_shard_id == 0) {
    *resp.mutable_map() = snap->map;
  } else {
    *resp.mutable_map() = ShardViewOf(*snap, for_shard_id);
    v1::MapSummary* summary = resp.mutable_summary();
    summary->set_for_shard_id(for_shard_id);
    summary->set_chunks(static_cast<uint32_t>(snap->map.chunks_size()));
    summary->set_shards(static_cast<uint32_t>(snap->map.shards_size()));
  }
  resp.set_resume_step(snap->resume_step);
  if (snap->restore.has_value()) *resp.mutable_restore() = *snap->restore;
  return resp;
}

absl::StatusOr<Coordinator::SerializedJob> Coordinator::GetJobSerialized(uint64_t job_id,
                                                                         uint64_t for_shard_id,
                                                                         uint64_t known_epoch) {
  std::shared_ptr<const MapSnapshot> snap;
  SerializedJob out;
  {
    absl::MutexLock lock(&mu_);
    JobRecord* job = jobs_.Find(job_id);
    if (job == nullptr) return absl::NotFoundError(absl::StrCat("no job with id ", job_id));
    snap = SnapshotOf(*job);
    out.head.set_state(job->state);
    if (for_shard_id == 0) out.head.set_current_step(ViewLocked(*job).min_applied_step);
  }
  out.head.set_job_id(job_id);
  if (for_shard_id != 0) {
    v1::MapSummary* summary = out.head.mutable_summary();
    summary->set_for_shard_id(for_shard_id);
    summary->set_chunks(static_cast<uint32_t>(snap->map.chunks_size()));
    summary->set_shards(static_cast<uint32_t>(snap->map.shards_size()));
  }
  out.head.set_resume_step(snap->resume_step);
  if (snap->restore.has_value()) *out.head.mutable_restore() = *snap->restore;
  // A worker that holds the spec and the map of known_epoch: no spec, and
  // the delta from its epoch when the snapshot can make one.
  const bool has_spec = for_shard_id == 0 && known_epoch != 0;
  if (has_spec) {
    if (std::shared_ptr<const std::string> delta = DeltaBytes(*snap, known_epoch)) {
      out.head.set_map_delta_from(known_epoch);
      out.map = std::move(delta);
      return out;
    }
  }
  {
    absl::MutexLock lock(&snap->bytes_mu);
    out.spec = for_shard_id == 0 ? snap->spec_bytes : snap->shard_spec_bytes;
    auto it = snap->part_bytes.find(for_shard_id);
    if (it != snap->part_bytes.end()) out.map = it->second;
  }
  if (out.map != nullptr && (out.spec != nullptr || has_spec)) {
    map_parts_reused_.fetch_add(1);
  } else {
    // Made with no lock held: fetches of other shards' parts go on
    // meanwhile. Two first fetches of one part may both make it; the first
    // one kept wins, and the bytes are the same.
    std::shared_ptr<const std::string> spec = out.spec;
    if (spec == nullptr && !has_spec) {
      spec = std::make_shared<const std::string>(
          for_shard_id == 0 ? snap->spec.SerializeAsString()
                            : ShardSpecOf(snap->spec).SerializeAsString());
    }
    std::shared_ptr<const std::string> part = out.map;
    if (part == nullptr) {
      part = std::make_shared<const std::string>(
          for_shard_id == 0 ? snap->map.SerializeAsString()
                            : ShardViewOf(*snap, for_shard_id).SerializeAsString());
      map_parts_serialized_.fetch_add(1);
    } else {
      map_parts_reused_.fetch_add(1);
    }
    absl::MutexLock lock(&snap->bytes_mu);
    std::shared_ptr<const std::string>& kept =
        for_shard_id == 0 ? snap->spec_bytes : snap->shard_spec_bytes;
    if (kept == nullptr) kept = std::move(spec);
    out.spec = kept;
    out.map = snap->part_bytes.try_emplace(for_shard_id, std::move(part)).first->second;
  }
  if (has_spec) out.spec = nullptr;
  return out;
}

std::shared_ptr<const std::string> Coordinator::DeltaBytes(const MapSnapshot& snap,
                                                           uint64_t from) {
  {
    absl::MutexLock lock(&snap.bytes_mu);
    auto it = snap.delta_bytes.find(from);
    if (it != snap.delta_bytes.end()) {
      map_parts_reused_.fetch_add(1);
      return it->second;
    }
  }
  std::optional<v1::ShardMap> delta = DeltaOf(snap, from);
  if (!delta.has_value()) return nullptr;
  auto bytes = std::make_shared<const std::string>(delta->SerializeAsString());
  map_parts_serialized_.fetch_add(1);
  absl::MutexLock lock(&snap.bytes_mu);
  return snap.delta_bytes.try_emplace(from, std::move(bytes)).first->second;
}

absl::StatusOr<v1::ShardMap> Coordinator::GetShardMap(uint64_t job_id) {
  std::shared_ptr<const MapSnapshot> snap;
  {
    absl::MutexLock lock(&mu_);
    JobRecord* job = jobs_.Find(job_id);
    if (job == nullptr) return absl::NotFoundError(absl::StrCat("no job with id ", job_id));
    snap = SnapshotOf(*job);
  }
  return snap->map;
}

absl::StatusOr<std::optional<v1::ShardMap>> Coordinator::WaitForShardMap(uint64_t job_id,
                                                                         uint64_t after_epoch,
                                                                         absl::Duration timeout,
                                                                         bool delta) {
  const absl::Time deadline = absl::Now() + timeout;
  std::shared_ptr<const MapSnapshot> snap;
  {
    absl::MutexLock lock(&mu_);
    while (true) {
      if (shutting_down_) return absl::UnavailableError("coordinator is shutting down");
      JobRecord* job = jobs_.Find(job_id);
      if (job == nullptr) return absl::NotFoundError(absl::StrCat("no job with id ", job_id));
      if (job->map.epoch() > after_epoch) {
        snap = SnapshotOf(*job);
        break;
      }
      if (job->state == v1::JOB_STATE_FAILED) {
        return absl::FailedPreconditionError(
            absl::StrCat("job ", job_id, " failed: a shard holding its chunks went down"));
      }
      if (absl::Now() >= deadline) return std::optional<v1::ShardMap>();
      map_changed_.WaitWithDeadline(&mu_, deadline);
    }
  }
  if (delta) {
    if (std::optional<v1::ShardMap> d = DeltaOf(*snap, after_epoch); d.has_value()) {
      return std::optional<v1::ShardMap>(*std::move(d));
    }
  }
  return std::optional<v1::ShardMap>(snap->map);
}

bool Coordinator::JobTokenMatches(uint64_t job_id, const std::string& token) {
  absl::MutexLock lock(&mu_);
  const JobRecord* job = jobs_.Find(job_id);
  return job != nullptr && !job->token.empty() && security::TokensEqual(job->token, token);
}

bool Coordinator::JobGone(uint64_t job_id) {
  absl::MutexLock lock(&mu_);
  return job_id != 0 && job_id < jobs_.next_id() && jobs_.Find(job_id) == nullptr;
}

std::optional<bool> Coordinator::JobTokenMatchesByName(const std::string& name,
                                                       const std::string& token) {
  absl::MutexLock lock(&mu_);
  const JobRecord* job = jobs_.FindByName(name);
  if (job == nullptr) return std::nullopt;
  return !job->token.empty() && security::TokensEqual(job->token, token);
}

}  // namespace optimus
