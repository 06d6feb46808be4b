// Coordinator: shard maps. Planned load and placement candidates, and
// carrying out the map planners' failover and replication/drain plans (the
// decisions themselves are in map_planner.cc). See coordinator_core.h.
#include <iterator>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "coordinator/coordinator_core.h"
#include "coordinator/map_planner.h"

namespace optimus {
namespace {
constexpr char kLog[] = "coord";

bool HoldsChunksOn(const JobRecord& job, const ShardHealthMap& health, ShardHealth which) {
  for (const auto& [shard_id, load] : job.load) {
    auto h = health.find(shard_id);
    const ShardHealth state = h == health.end() ? ShardHealth::kDown : h->second;
    if (state == which) return true;
  }
  return false;
}
}  // namespace

std::map<uint64_t, ShardLoad> Coordinator::PlannedLoadLocked() const {
  std::map<uint64_t, ShardLoad> total;
  for (const auto& [job_id, job] : jobs_.all()) {
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
  for (const auto& [id, shard] : shards_.all()) {
    // DRAINING shards are being emptied and DOWN ones are gone.
    if (shard.state != v1::SHARD_STATE_UP) continue;
    auto p = planned.find(id);
    live.push_back({id, shard.capabilities.kind() == v1::SHARD_KIND_DPU,
                    shard.capabilities.memory_limit_bytes(),
                    p == planned.end() ? 0 : p->second.size_bytes,
                    FailureDomainOf(shard.capabilities.failure_domain(),
                                    shard.capabilities.hostname())});
  }
  return live;
}

void Coordinator::SetEndpointsLocked(JobRecord& job) const {
  job.map.clear_shards();
  for (const auto& [shard_id, load] : job.load) {
    const ShardRecord* shard = shards_.Find(shard_id);
    if (shard == nullptr) continue;
    v1::ShardEndpoint* e = job.map.add_shards();
    e->set_shard_id(shard_id);
    e->set_data_address(shard->capabilities.data_address());
    e->set_kind(shard->capabilities.kind());
  }
}

void Coordinator::CommitMapChangeLocked(JobRecord& job, const JobLayout& before) {
  job.map.set_epoch(job.map.epoch() + 1);
  jobs_.Touch();  // Its load moved: placement planned before must plan again.
  const std::map<uint64_t, ShardLoad> old_load = std::move(job.load);
  job.load = ComputeLoad(LayoutOfJob(job).chunks, job.bytes_per_elem,
                         kernels::ChunkOverheadBytes(job.spec.world_size()));
  // A live shard whose chunks all moved away must still learn the new map:
  // until it does, it would serve as a primary that no longer is one.
  for (const auto& [shard_id, load] : old_load) {
    const ShardRecord* shard = shards_.Find(shard_id);
    if (job.load.count(shard_id) == 0 && shard != nullptr &&
        shard->state != v1::SHARD_STATE_DOWN) {
      job.departed[shard_id] = load.num_chunks;
    }
  }
  for (const auto& [shard_id, load] : job.load) job.departed.erase(shard_id);
  SetEndpointsLocked(job);
  jobs_.IndexHolders(job);  // New holders get the job from their heartbeats.
  job.backup_seeded.resize(job.map.chunks_size(), false);
  // Reports of shards that no longer hold chunks of the job would keep
  // counting in its step and readiness.
  for (auto it = job.progress.begin(); it != job.progress.end();) {
    it = job.load.count(it->first) == 0 ? job.progress.erase(it) : std::next(it);
  }
  RecordPartChanges(before, job);
  job.fetch_slots.clear();
  checkpoints_.OnOwnersChanged(job.id, ViewLocked(job).owners);
}

bool Coordinator::FailoverJobsLocked() {
  // This runs at every lease sweep (a few times a second), and almost
  // always finds no job holding chunks on a DOWN shard. Whether one does
  // changes only with the shards' states (the registry's generation) or a
  // job's holders (the job table's): when neither moved since a pass that
  // found none, there is nothing to look at. At 16,384 shards a pass made
  // the shards' health and placement candidates each time, with the
  // tables held and heartbeats deferred meanwhile.
  const std::pair<uint64_t, uint64_t> generations{shards_.generation(), jobs_.generation()};
  if (failover_idle_at_ == generations) return false;
  const ShardHealthMap health = shards_.Health();
  std::optional<std::vector<ShardInfo>> candidates;  // Made for the first job that needs them.
  bool changed = false;
  bool any_down_holder = false;
  for (auto& [job_id, job] : jobs_.all()) {
    if (job.state == v1::JOB_STATE_FAILED || !HoldsChunksOn(job, health, ShardHealth::kDown)) {
      continue;
    }
    any_down_holder = true;
    if (!candidates.has_value()) candidates = PlacementCandidatesLocked();
    const JobLayout before = LayoutOfJob(job);
    const FailoverPlan plan = PlanFailover(before, health, *candidates);
    const std::string lost = absl::StrCat(plan.lost_shards.size() == 1 ? "shard " : "shards ",
                                          absl::StrJoin(plan.lost_shards, ","));
    switch (plan.outcome) {
      case FailoverPlan::Outcome::kUnchanged:
        continue;
      case FailoverPlan::Outcome::kFailed:
        job.state = v1::JOB_STATE_FAILED;
        jobs_.Touch();  // Its bytes are no longer planned.
        checkpoints_.OnJobFailed(job.id, absl::StrCat(lost, " went down"));
        OPTIMUS_LOG(Error, kLog, "job failed id=", job.id, " name=", job.spec.name(), ": ", lost,
                    " holding ", plan.lost_primaries, " of its ", job.map.chunks_size(),
                    " chunks as primary went down; ", plan.unprotected,
                    " of them had no in-sync backup on a live shard (replication ",
                    job.spec.replication(), ")");
        break;
      case FailoverPlan::Outcome::kFailedOver:
        ApplyLayout(plan.after, job);
        CommitMapChangeLocked(job, before);
        OPTIMUS_LOG(Warning, kLog, "job ", job.spec.name(), ": ", lost,
                    " lost; promoted backups for ", plan.promoted, " chunks; new epoch ",
                    job.map.epoch(), " (backups lost ", plan.backups_lost, ", new backups ",
                    plan.new_backups,
                    plan.without_backup > 0
                        ? absl::StrCat(", ", plan.without_backup,
                                       " chunks without a backup until a shard has room")
                        : std::string(),
                    ")");
        break;
    }
    changed = true;
  }
  // Nothing looked at changed anything: the same generations need no pass.
  if (!any_down_holder) failover_idle_at_ = generations;
  return changed;
}

int Coordinator::TickReplication(absl::Time now) {
  (void)now;  // Decisions depend on reports and states, not on time.
  absl::MutexLock commit(&commit_mu_);
  absl::MutexLock lock(&mu_);
  Planning planning(&planning_);
  const ShardHealthMap health = shards_.Health();
  std::optional<std::vector<ShardInfo>> candidates;  // Made for the first job that needs them.
  int changed_jobs = 0;
  for (auto& [job_id, job] : jobs_.all()) {
    if (job.state == v1::JOB_STATE_FAILED) continue;
    // Only a job with chunks on a draining shard, or (replication 1) chunks
    // without a backup, has anything to move.
    uint64_t with_backup = 0;
    for (const auto& [shard_id, load] : job.load) with_backup += load.backup_chunks;
    const bool missing_backups =
        job.spec.replication() == 1 && with_backup < static_cast<uint64_t>(job.map.chunks_size());
    if (!missing_backups && !HoldsChunksOn(job, health, ShardHealth::kDraining)) continue;
    if (!candidates.has_value()) candidates = PlacementCandidatesLocked();
    const JobLayout before = LayoutOfJob(job);
    const ReplicationPlan plan = PlanReplication(before, health, *candidates);
    if (!plan.changed()) continue;
    ApplyLayout(plan.after, job);
    CommitMapChangeLocked(job, before);
    ++changed_jobs;
    OPTIMUS_LOG(Info, kLog, "job ", job.spec.name(), ": promoted ", plan.promoted,
                " backups of chunks on draining shards, moved ", plan.moved_backups,
                " backups off draining shards, placed ", plan.temporary, " temporary and ",
                plan.new_backups, " new backups; new epoch ", job.map.epoch());
  }
  if (changed_jobs > 0) {
    SaveLaterLocked();
    map_changed_.SignalAll();
  }
  std::optional<std::map<uint64_t, ShardLoad>> planned;  // Made once a shard drains.
  for (auto& [id, shard] : shards_.mutable_all()) {
    if (shard.state != v1::SHARD_STATE_DRAINING || shard.drained_logged) continue;
    if (!planned.has_value()) planned = PlannedLoadLocked();
    auto p = planned->find(id);
    if (p != planned->end() && p->second.num_chunks + p->second.unreleased_chunks > 0) continue;
    shard.drained_logged = true;
    OPTIMUS_LOG(Info, kLog, "shard ", id, " drained: it holds no chunk and can be stopped");
  }
  return changed_jobs;
}

}  // namespace optimus
