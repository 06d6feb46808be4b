#include "server/shard_metrics.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace optimus {
namespace server {

std::string RenderShardMetrics(const ShardMetrics& s, const ShardGauges& g) {
  MetricsText m;
  m.BuildInfo("optimus-shard");
  const MetricLabels id = {{"shard_id", absl::StrCat(g.shard_id)}};
  s.step_latency.Render(&m, "optimus_shard_step_seconds",
                        "Latency of one fused optimizer step over one chunk.");
  s.publish_tail.Render(&m, "optimus_shard_publish_tail_seconds",
                        "From the last push of a chunk's step landing to the version being "
                        "pullable.");
  s.step_queue.Render(&m, "optimus_shard_step_queue_seconds",
                      "From the last push of a chunk's step landing to its optimizer pass "
                      "starting (waiting for a step thread, the last fold).");
  m.Counter("optimus_shard_steps_total", "Chunk steps applied.", s.steps_applied.load(), id);
  m.Counter("optimus_shard_optimizer_params_total",
            "Parameters updated by the optimizer (rate = optimizer throughput).",
            s.params_stepped.load(), id);
  m.Counter("optimus_shard_pushed_bytes_total", "Gradient bytes received from workers.",
            s.pushed_bytes.load(), id);
  m.Counter("optimus_shard_pulled_bytes_total", "Parameter bytes sent to workers.",
            s.pulled_bytes.load(), id);
  m.Counter("optimus_shard_data_plane_refused_total",
            "Data-plane handshakes refused and messages dropped from peers that proved nothing.",
            g.unproved_refused, id);
  m.Counter("optimus_shard_identity_refused_total",
            "Requests whose sender proved another job, rank or shard than they name.",
            s.requests_refused_identity.load(), id);
  m.Counter("optimus_shard_duplicate_pushes_total", "Repeated pushes acknowledged and dropped.",
            s.pushes_duplicate.load(), id);
  m.Counter("optimus_shard_checkpoint_stall_seconds_total",
            "Time steps and requests waited for checkpoint copies of their chunk.",
            static_cast<double>(s.checkpoint_stall_ns.load()) / 1e9, id);
  m.Counter("optimus_shard_forwards_total", "Steps and seeds sent to backups (replication).",
            s.forwards_sent.load(), id);
  m.Counter("optimus_shard_backup_steps_total", "Forwarded steps this shard applied as a backup.",
            s.backup_steps.load(), id);
  m.Counter("optimus_shard_backup_seeds_total",
            "Chunk states this shard received as a new backup.", s.seeds_received.load(), id);
  m.Counter("optimus_shard_map_fetches_total",
            "Parts of a job's map fetched from the coordinator.", s.map_fetches.load(), id);
  m.Counter("optimus_shard_map_epochs_unchanged_total",
            "New map epochs taken without a fetch: they left this shard's part as it was.",
            s.map_epochs_unchanged.load(), id);
  m.Gauge("optimus_shard_memory_used_bytes", "Bytes of job state allocated.",
          g.memory_used_bytes, id);
  m.Gauge("optimus_shard_memory_limit_bytes", "State budget of this shard.",
          g.memory_limit_bytes, id);
  m.Gauge("optimus_shard_staging_limit_bytes",
          "Budget of the gradient staging pool (pushes in flight).",
          g.staging_limit_bytes, id);
  m.Gauge("optimus_shard_staging_in_use_bytes", "Staging buffers holding gradients now.",
          g.staging_in_use_bytes, id);
  m.Gauge("optimus_shard_staging_held_bytes", "Staging buffers allocated (in use or kept).",
          g.staging_held_bytes, id);
  m.Counter("optimus_shard_staging_waits_total",
            "Times a push or a step waited for room in the staging pool.", g.staging_waits, id);
  m.Counter("optimus_shard_batches_total",
            "Messages carrying several requests (small chunks batched per shard).",
            s.batches_received.load(), id);
  m.Counter("optimus_shard_reply_batches_total",
            "Messages carrying several replies without payload (acks to a batch's pushes).",
            s.reply_batches.load(), id);
  m.Counter("optimus_shard_replies_batched_total", "Replies sent inside reply batches.",
            s.replies_batched.load(), id);
  m.Counter("optimus_shard_batch_buffer_allocations_total",
            "Batch receive buffers allocated because no kept one was free.",
            g.batch_buffer_allocations, id);
  m.Counter("optimus_shard_folds_total", "Passes folding landed gradients into a running sum.",
            s.folds.load(), id);
  m.Gauge("optimus_shard_chunks_owned", "Chunks held for all jobs.", g.chunks_owned, id);
  m.Gauge("optimus_shard_jobs", "Jobs with state on this shard.", g.jobs, id);
  m.Gauge("optimus_shard_lease_age_seconds", "Time since the last accepted heartbeat.",
          g.lease_age_seconds, id);
  m.Gauge("optimus_shard_parked_pulls",
          "Pulls waiting for their version or being sent (limits: --max_parked_pulls, "
          "--max_parked_pulls_per_peer).",
          g.parked_pulls, id);
  m.Gauge("optimus_shard_peers_with_parked_pulls", "Peers with pulls waiting or being sent.",
          g.peers_with_parked_pulls, id);
  m.Gauge("optimus_shard_inflight_bytes",
          "Temporary buffers of requests being received (limit: --max_inflight_mb).",
          g.inflight_bytes, id);
  m.Gauge("optimus_shard_transport_peers",
          "Data-plane peers known (limit: --max_peers; dead ones are forgotten).",
          g.transport_peers, id);
  const char* kRefusalsHelp =
      "Requests refused with RESOURCE_EXHAUSTED for being over a limit, by limit.";
  const std::pair<const char*, uint64_t> refusals[] = {
      {"parked_pulls", g.parked_pull_refusals},
      {"inflight_bytes", g.inflight_refusals},
      {"peers", g.transport_hellos_refused},
  };
  for (const auto& [limit, count] : refusals) {
    m.Counter("optimus_shard_limit_refusals_total", kRefusalsHelp, count,
              {{"shard_id", absl::StrCat(g.shard_id)}, {"limit", limit}});
  }
  for (int c = 1; c < ShardMetrics::kNumCodes; ++c) {
    m.Counter("optimus_shard_errors_total", "Requests refused, by error kind.", s.errors[c].load(),
              {{"shard_id", absl::StrCat(g.shard_id)},
               {"kind", absl::StatusCodeToString(static_cast<absl::StatusCode>(c))}});
  }
  return m.text();
}

}  // namespace server
}  // namespace optimus
