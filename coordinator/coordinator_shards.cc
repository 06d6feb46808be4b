// Coordinator: shards. Registration, heartbeats (leases, progress, READY,
// released jobs), the lease sweep, drain, and forgetting DOWN shards. See
// coordinator_core.h.
#include <algorithm>
#include <set>
#include <thread>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "coordinator/coordinator_core.h"

namespace optimus {
namespace {
constexpr char kLog[] = "coord";

const char* KindName(v1::ShardKind k) {
  switch (k) {
    case v1::SHARD_KIND_DPU: return "dpu";
    case v1::SHARD_KIND_HOST: return "host";
    default: return "unspecified";
  }
}
}  // namespace

absl::StatusOr<v1::RegisterShardResponse> Coordinator::RegisterShard(
    const v1::RegisterShardRequest& req, const std::string& identity, const Abandoned& abandoned) {
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
  // Shared: registrations wait to be durable together, and one write of
  // the state covers every one made before it (the writer skips to the
  // newest snapshot). Changes that undo themselves otherwise than by
  // dropping what they added hold commit_mu_ alone.
  absl::ReaderMutexLock commit(&commit_mu_);
  uint64_t id;
  absl::StatusOr<uint64_t> seq;
  {
    absl::MutexLock lock(&mu_);
    // Its id would be used up and the state written for nobody.
    if (abandoned && abandoned()) {
      return absl::CancelledError("shard not registered: the caller gave up first");
    }
    id = shards_.Register(caps).id;
    shards_.Find(id)->identity = identity;
    leases_.AddLive(id, Now(), caps.hostname(), identity);
    seq = SnapshotLocked();
  }
  if (absl::Status s = WaitDurable(seq); !s.ok()) {
    absl::MutexLock lock(&mu_);
    shards_.Unregister(id);
    leases_.Remove(id);
    SaveLaterLocked();
    return s;
  }
  OPTIMUS_LOG(Info, kLog, "shard registered id=", id, " identity=", identity,
              " kind=", KindName(caps.kind()),
              " host=", caps.hostname(), " arch=", caps.arch(),
              " memory_limit_bytes=", caps.memory_limit_bytes());
  v1::RegisterShardResponse resp;
  resp.set_shard_id(id);
  resp.set_lease_ms(static_cast<uint32_t>(absl::ToInt64Milliseconds(options_.lease)));
  resp.set_data_plane_key(data_plane_key());
  return resp;
}

bool Coordinator::LockTablesForHeartbeat() {
  if (mu_.TryLock()) return true;
  // Other heartbeats or a read hold the tables for microseconds; planning
  // may hold them for seconds. Spin (yielding to the holder) for a moment
  // unless it is planning, then give up: a callback thread that slept or
  // queued here would hold up every heartbeat behind it.
  const absl::Time give_up = absl::Now() + absl::Milliseconds(1);
  do {
    if (planning_.load(std::memory_order_relaxed) > 0) return false;
    std::this_thread::yield();
    if (mu_.TryLock()) return true;
  } while (absl::Now() < give_up);
  return false;
}

v1::HeartbeatResponse Coordinator::Heartbeat(const v1::HeartbeatRequest& req) {
  v1::HeartbeatResponse resp;
  // The lease first, under the lease table's lock alone: a shard that
  // beats is alive, whatever the tables are busy with.
  if (leases_.Renew(req.shard_id(), Now()) != LeaseTable::Renewal::kRenewed) {
    resp.set_known(false);
    return resp;
  }
  if (!LockTablesForHeartbeat()) {
    heartbeats_deferred_.fetch_add(1, std::memory_order_relaxed);
    return leases_.LastReply(req.shard_id());
  }
  HeartbeatLocked(req, &resp);
  mu_.Unlock();
  return resp;
}

void Coordinator::HeartbeatLocked(const v1::HeartbeatRequest& req, v1::HeartbeatResponse* out) {
  v1::HeartbeatResponse& resp = *out;
  ShardRecord* shard =
      shards_.Report(req.shard_id(), req.memory_used_bytes(), req.chunks_owned());
  if (shard == nullptr || leases_.IsDown(req.shard_id())) {
    resp.set_known(false);
    return;
  }
  shard->transports = req.transports();
  const uint64_t shard_id = shard->id;
  bool became_ready = false;
  std::set<uint64_t> released;
  for (const v1::ShardJobProgress& p : req.jobs()) {
    JobRecord* job = jobs_.Find(p.job_id());
    if (job == nullptr) {
      // Deleted, replaced by a restore, or never known here: whatever the
      // shard holds of it is garbage.
      released.insert(p.job_id());
      continue;
    }
    if (job->load.count(shard_id) == 0) {
      // Not a job of this shard (any more): once it has applied the map
      // that took its chunks, it need not be told again.
      if (p.map_epoch() >= job->map.epoch()) job->departed.erase(shard_id);
      continue;
    }
    RecordProgress(*job, shard_id, p);
    MarkSeeded(*job, shard_id, p);
    became_ready |= MaybeMarkReadyLocked(*job);
  }
  // A restart before this is saved finds the job PENDING, and the next
  // heartbeats make it READY again: nobody waits for this save.
  if (became_ready) SaveLaterLocked();
  resp.set_known(true);
  for (uint64_t id : released) resp.add_released_jobs(id);
  // The jobs this shard holds chunks of or departed from, from the index
  // (not a walk over every job); entries it no longer has to do with go.
  if (const std::set<uint64_t>* mine = jobs_.JobsOf(shard_id); mine != nullptr) {
    std::vector<uint64_t> stale;
    for (uint64_t job_id : *mine) {
      JobRecord* job = jobs_.Find(job_id);
      const bool holds = job != nullptr && job->load.count(shard_id) != 0;
      const bool departed = job != nullptr && job->departed.count(shard_id) != 0;
      if (!holds && !departed) {
        stale.push_back(job_id);
        continue;
      }
      if (job->state == v1::JOB_STATE_FAILED) continue;
      if (!holds && !AllHoldersAtEpoch(*job)) continue;
      const uint64_t part_epoch = PartEpochOf(*job, shard_id);
      v1::Assignment* a = resp.add_assignments();
      a->set_job_id(job_id);
      a->set_map_epoch(job->map.epoch());
      a->set_part_epoch(part_epoch);
      // A shard sent to fetch a part (it has not loaded the newest epoch
      // that changed it) costs the coordinator a map read: it gets a slot.
      if (options_.map_fetches_per_s > 0) {
        uint64_t loaded = 0;
        for (const v1::ShardJobProgress& p : req.jobs()) {
          if (p.job_id() == job_id) loaded = p.map_epoch();
        }
        const bool fetches = loaded < job->map.epoch() && (part_epoch == 0 || loaded < part_epoch);
        if (fetches) {
          auto [slot, fresh] = job->fetch_slots.try_emplace(shard_id);
          if (fresh) slot->second = NextMapFetchSlotLocked();
          const absl::Duration wait = slot->second - Now();
          if (wait > absl::ZeroDuration()) {
            a->set_fetch_after_ms(static_cast<uint32_t>(
                std::min<int64_t>(absl::ToInt64Milliseconds(absl::Ceil(wait, absl::Milliseconds(1))),
                                  UINT32_MAX)));
            if (fresh) ++counters_.map_fetches_delayed;
          }
        }
      }
    }
    for (uint64_t job_id : stale) jobs_.Unindex(shard_id, job_id);
  }
  std::map<uint64_t, CheckpointJobView> views;  // Of the jobs the reports name.
  for (const v1::ShardCheckpointReport& r : req.checkpoints()) {
    if (views.count(r.job_id()) != 0) continue;
    if (const JobRecord* job = jobs_.Find(r.job_id()); job != nullptr) {
      views.emplace(r.job_id(), ViewLocked(*job));
    }
  }
  for (v1::CheckpointOrder& o : checkpoints_.OnHeartbeat(shard_id, req.checkpoints(), views)) {
    *resp.add_checkpoints() = std::move(o);
  }
  leases_.SetLastReply(shard_id, resp);
}

absl::Time Coordinator::NextMapFetchSlotLocked() {
  const absl::Duration every = absl::Seconds(1.0 / options_.map_fetches_per_s);
  const absl::Time now = Now();
  // After a quiet spell, half a second's worth of slots are free at once.
  const absl::Time slot = std::max(next_map_fetch_slot_, now - absl::Milliseconds(500));
  next_map_fetch_slot_ = slot + every;
  return std::max(slot, now);
}

void Coordinator::MarkSeeded(JobRecord& job, uint64_t shard_id, const v1::ShardJobProgress& p) {
  // Counts are over the map of p.map_epoch(): only a report on the current
  // map says something about the current backups. The report is per shard,
  // not per chunk, so the flags are set only once all of them are seeded
  // (a backup seeded once stays in step: the primary publishes a step only
  // after the backup acknowledged it). They are cleared when a chunk's
  // backup changes (the planners do), which comes with a new epoch: so
  // a shard's flags are set once per epoch, over its own backups only.
  if (p.map_epoch() != job.map.epoch() || p.backup_chunks() == 0 ||
      p.backups_seeded() != p.backup_chunks()) {
    return;
  }
  auto load = job.load.find(shard_id);
  if (load == job.load.end() || load->second.backup_chunks != p.backup_chunks()) return;
  JobRecord::HolderCounts& c = CountsAtEpoch(job);
  if (!c.seeded.insert(shard_id).second) return;
  auto mine = c.backups_of.find(shard_id);
  if (mine == c.backups_of.end()) return;
  for (int i : mine->second) job.backup_seeded[i] = true;
}

bool Coordinator::MaybeMarkReadyLocked(JobRecord& job) {
  if (job.state != v1::JOB_STATE_PENDING || !AllHoldersLoaded(job)) return false;
  job.state = v1::JOB_STATE_READY;
  OPTIMUS_LOG(Info, kLog, "job ready id=", job.id, " name=", job.spec.name(),
              " epoch=", job.map.epoch(), " shards=", job.load.size());
  return true;
}

void Coordinator::OnShardsDownLocked(const std::vector<uint64_t>& shard_ids) {
  // A dead shard will never apply the map that took its chunks away.
  for (uint64_t id : shard_ids) {
    for (auto& [job_id, job] : jobs_.all()) job.departed.erase(id);
  }
}

void Coordinator::DropShardFromJobsLocked(uint64_t shard_id) {
  for (auto& [job_id, job] : jobs_.all()) {
    DropProgress(job, shard_id);
    job.departed.erase(shard_id);
  }
  jobs_.UnindexShard(shard_id);
}

int Coordinator::SweepLeases(absl::Time now) { return leases_.SweepExpired(now); }

int Coordinator::TakeDownShardsLocked(absl::Time now, bool check_jobs) {
  const std::vector<uint64_t> down = leases_.TakeDown();
  // Every shard lost since the last call is DOWN before any job is looked
  // at: a backup on a shard lost at the same time cannot be promoted.
  const int marked = down.empty() ? 0 : shards_.MarkDown(down, now);
  const bool jobs_changed = (marked > 0 || check_jobs) && FailoverJobsLocked();
  if (marked > 0 || jobs_changed) {
    // A restarted coordinator gives every shard a fresh lease and marks the
    // dead ones down again, so nobody waits for this save.
    SaveLaterLocked();
    map_changed_.SignalAll();
  }
  return marked;
}

int Coordinator::SweepExpiredLeases(absl::Time now) {
  SweepLeases(now);
  absl::MutexLock commit(&commit_mu_);
  absl::MutexLock lock(&mu_);
  Planning planning(&planning_);
  // Jobs are checked on every sweep, not only when a shard was just lost:
  // a state saved before a failover could be applied names DOWN shards too.
  // (FailoverJobsLocked skips the look while nothing changed since one that
  // found no job on a DOWN shard.)
  return TakeDownShardsLocked(now, /*check_jobs=*/true);
}

int Coordinator::ForgetLongDownShards(absl::Time now) {
  if (options_.down_shard_grace == absl::InfiniteDuration()) return 0;
  absl::MutexLock commit(&commit_mu_);
  absl::MutexLock lock(&mu_);
  const std::vector<ShardRecord> gone =
      shards_.ForgetDownLongerThan(options_.down_shard_grace, now);
  for (const ShardRecord& shard : gone) {
    DropShardFromJobsLocked(shard.id);
    leases_.Remove(shard.id);
    ++counters_.shards_forgotten;
    OPTIMUS_LOG(Info, kLog, "shard forgotten id=", shard.id,
                " host=", shard.capabilities.hostname(), ": DOWN for ",
                absl::FormatDuration(now - shard.down_since), " (grace ",
                absl::FormatDuration(options_.down_shard_grace), ")");
  }
  if (!gone.empty()) SaveLaterLocked();
  return static_cast<int>(gone.size());
}

absl::StatusOr<v1::ForgetShardResponse> Coordinator::ForgetShard(
    const v1::ForgetShardRequest& req) {
  absl::MutexLock commit(&commit_mu_);
  v1::ForgetShardResponse resp;
  ShardRecord record;
  absl::StatusOr<uint64_t> seq;
  {
    absl::MutexLock lock(&mu_);
    // A shard whose lease expired is DOWN, even before the next sweep.
    TakeDownShardsLocked(Now());
    const ShardRecord* shard = shards_.Find(req.shard_id());
    if (shard != nullptr) *resp.mutable_shard() = ShardStatusLocked(*shard, PlannedLoadLocked(), Now());
    absl::StatusOr<ShardRecord> forgotten = shards_.Forget(req.shard_id());
    if (!forgotten.ok()) return forgotten.status();
    record = *std::move(forgotten);
    seq = SnapshotLocked();
  }
  if (absl::Status s = WaitDurable(seq); !s.ok()) {
    absl::MutexLock lock(&mu_);
    shards_.Restore(std::move(record));
    SaveLaterLocked();
    return s;
  }
  absl::MutexLock lock(&mu_);
  DropShardFromJobsLocked(record.id);
  leases_.Remove(record.id);
  ++counters_.shards_forgotten;
  OPTIMUS_LOG(Info, kLog, "shard forgotten id=", record.id,
              " host=", record.capabilities.hostname(), " (by request)");
  return resp;
}

absl::StatusOr<v1::DrainShardResponse> Coordinator::DrainShard(const v1::DrainShardRequest& req) {
  absl::MutexLock commit(&commit_mu_);
  v1::DrainShardResponse resp;
  absl::StatusOr<uint64_t> seq;
  uint32_t chunks_held = 0, backups_held = 0;
  {
    absl::MutexLock lock(&mu_);
    TakeDownShardsLocked(Now());  // Not a shard whose lease expired.
    ShardRecord* shard = shards_.Find(req.shard_id());
    if (shard == nullptr) {
      return absl::NotFoundError(absl::StrCat("no shard with id ", req.shard_id()));
    }
    if (shard->state == v1::SHARD_STATE_DOWN) {
      return absl::FailedPreconditionError(
          absl::StrCat("shard ", shard->id, " is DOWN: it holds nothing to drain"));
    }
    const std::map<uint64_t, ShardLoad> planned = PlannedLoadLocked();
    if (auto held = planned.find(shard->id); held != planned.end()) {
      chunks_held = held->second.num_chunks;
      backups_held = held->second.backup_chunks;
    }
    if (shard->state == v1::SHARD_STATE_DRAINING) {
      *resp.mutable_shard() = ShardStatusLocked(*shard, planned, Now());
      // After a coordinator restart the count at the start is not known.
      resp.set_chunks_to_move(shard->drain_chunks_at_start != 0 ? shard->drain_chunks_at_start
                                                                 : chunks_held);
      return resp;
    }
    // Checked with the placement rule over what is planned now, so that the
    // drain does not start what it cannot finish.
    Planning planning(&planning_);
    std::vector<ShardInfo> candidates = PlacementCandidatesLocked();
    candidates.erase(std::remove_if(candidates.begin(), candidates.end(),
                                    [&](const ShardInfo& s) { return s.id == shard->id; }),
                     candidates.end());
    std::vector<JobLayout> layouts;
    std::vector<std::string> names;
    for (const auto& [job_id, job] : jobs_.all()) {
      if (job.state == v1::JOB_STATE_FAILED || job.load.count(shard->id) == 0) continue;
      layouts.push_back(LayoutOfJob(job));
      names.push_back(job.spec.name());
    }
    std::vector<DrainJob> drain_jobs;
    for (size_t i = 0; i < layouts.size(); ++i) drain_jobs.push_back({names[i], &layouts[i]});
    if (absl::Status s = CheckDrainFits(shard->id, chunks_held, drain_jobs, shards_.Health(),
                                        std::move(candidates));
        !s.ok()) {
      return s;
    }
    shard->state = v1::SHARD_STATE_DRAINING;
    shards_.Touch();  // No longer a placement candidate.
    shard->drain_chunks_at_start = chunks_held;
    shard->drained_logged = false;
    *resp.mutable_shard() = ShardStatusLocked(*shard, planned, Now());
    resp.set_chunks_to_move(chunks_held);
    seq = SnapshotLocked();
  }
  if (absl::Status s = WaitDurable(seq); !s.ok()) {
    absl::MutexLock lock(&mu_);
    ShardRecord* shard = shards_.Find(req.shard_id());
    if (shard != nullptr && shard->state == v1::SHARD_STATE_DRAINING) {
      shard->state = v1::SHARD_STATE_UP;
      shards_.Touch();
      shard->drain_chunks_at_start = 0;
    }
    SaveLaterLocked();
    return s;
  }
  OPTIMUS_LOG(Info, kLog, "shard ", req.shard_id(), " draining: ", chunks_held, " chunks (",
              backups_held, " of them backups) move to other shards");
  return resp;
}

}  // namespace optimus

namespace optimus {

bool Coordinator::ShardIdentityMatches(uint64_t shard_id, const std::string& identity) {
  // From the lease table, so that a heartbeat's check does not wait for
  // the tables either. An unknown id is told so by Heartbeat (known=false):
  // it registers again.
  return leases_.IdentityMatches(shard_id, identity);
}

}  // namespace optimus
