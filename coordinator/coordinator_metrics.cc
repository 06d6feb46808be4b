#include "coordinator/coordinator_metrics.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/metrics.h"

namespace optimus {

std::string RenderCoordinatorMetrics(const CoordinatorMetricsInput& in) {
  const v1::StatusResponse& st = *in.status;
  MetricsText m;
  m.BuildInfo("optimus-coord");
  int up = 0, down = 0, draining = 0;
  for (const auto& sh : st.shards()) {
    (sh.state() == v1::SHARD_STATE_UP         ? up
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
    const MetricLabels id = {{"job_name", j.name()}};
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
  m.Counter("optimus_coord_jobs_deleted_total",
            "Jobs deleted (optimusctl job delete, or a FAILED job replaced by its restore).",
            in.jobs_deleted);
  m.Counter("optimus_coord_shards_forgotten_total",
            "DOWN shards removed from the tables (optimusctl shard forget, or the grace period).",
            in.shards_forgotten);
  m.Counter("optimus_coord_calls_dropped_total",
            "Calls answered CANCELLED without being served: their client had cancelled or "
            "passed its deadline (the coordinator was overloaded or planning).",
            in.calls_dropped);
  m.Gauge("optimus_coord_calls_in_progress",
          "Control calls (registrations, job and checkpoint changes, status) being served "
          "now, those waiting for the tables behind a long placement included; map reads, "
          "heartbeats and watches are not counted here.",
          in.calls_in_progress);
  m.Counter("optimus_coord_heartbeats_deferred_total",
            "Heartbeats that renewed their lease but found the tables held by planning: "
            "answered with the shard's last reply, their report taken at the next heartbeat.",
            in.heartbeats_deferred);
  m.Counter("optimus_coord_map_fetches_delayed_total",
            "Shards sent to fetch a new map part after a wait (a later slot, past "
            "--map_fetches_per_s), so that a new job's fetches spread out.",
            in.map_fetches_delayed);
  m.Counter("optimus_coord_map_parts_serialized_total",
            "GetJob maps (a shard's part, or the whole) cut and serialized: once per job, "
            "epoch and shard.",
            in.map_parts_serialized);
  m.Counter("optimus_coord_map_parts_reused_total",
            "GetJob answers sent from the bytes an earlier fetch of the same job, epoch and "
            "shard made (repeated or retried fetches).",
            in.map_parts_reused);
  m.Counter("optimus_coord_map_reads_refused_total",
            "GetJob / GetShardMap refused with RESOURCE_EXHAUSTED: --max_concurrent_map_reads "
            "were being served (a fetch storm); their callers retry with backoff.",
            in.map_reads_refused);
  const char* kRefusedHelp =
      "CreateJob / restore refused with RESOURCE_EXHAUSTED, by the limit it hit (quota: "
      "--max_chunks_per_job, --max_tensors_per_job, --max_job_bytes; map_size: the gRPC "
      "message limit; capacity: the shards' memory).";
  m.Counter("optimus_coord_jobs_refused_total", kRefusedHelp, in.jobs_refused_quota,
            {{"limit", "quota"}});
  m.Counter("optimus_coord_jobs_refused_total", kRefusedHelp, in.jobs_refused_map_size,
            {{"limit", "map_size"}});
  m.Counter("optimus_coord_jobs_refused_total", kRefusedHelp, in.jobs_refused_capacity,
            {{"limit", "capacity"}});
  for (size_t c = 1; c < in.errors_by_code.size(); ++c) {
    m.Counter("optimus_coord_errors_total", "RPCs answered with an error, by kind.",
              in.errors_by_code[c],
              {{"kind", absl::StatusCodeToString(static_cast<absl::StatusCode>(c))}});
  }
  return m.text();
}

}  // namespace optimus
