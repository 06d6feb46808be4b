// Coordinator: the status of every shard and job, as `optimusctl status`
// and /metrics show it. See coordinator_core.h.
#include <algorithm>

#include "coordinator/coordinator_core.h"
#include "coordinator/job_spec.h"

namespace optimus {

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
  for (const auto& [id, shard] : shards_.all()) {
    *resp.add_shards() = ShardStatusLocked(shard, planned, now);
  }
  for (const auto& [id, job] : jobs_.all()) {
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
    j->set_state_bytes(job.num_params * StateBytesPerElemOf(job.spec.optimizer().kind()));
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

}  // namespace optimus
