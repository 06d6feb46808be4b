// The shard's counters and its Prometheus page: every component bumps the
// counters it owns here; /metrics renders them with the gauges the caller
// passes in (memory, chunks, lease age). Counters are atomics: safe from any
// thread, no lock.
#ifndef OPTIMUS_SERVER_SHARD_METRICS_H_
#define OPTIMUS_SERVER_SHARD_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "common/metrics.h"

namespace optimus {
namespace server {

struct ShardMetrics {
  std::atomic<uint64_t> steps_applied{0};       // Chunk steps published, summed over chunks.
  std::atomic<uint64_t> params_stepped{0};      // Elements the optimizer updated.
  std::atomic<uint64_t> pushes_received{0};
  std::atomic<uint64_t> pushes_duplicate{0};
  std::atomic<uint64_t> pushed_bytes{0};
  std::atomic<uint64_t> pulls_served{0};
  std::atomic<uint64_t> pulled_bytes{0};
  std::atomic<uint64_t> requests_rejected{0};   // Requests refused with an error.
  // Requests whose sender proved another identity than the job and rank (or
  // the primary shard) they name.
  std::atomic<uint64_t> requests_refused_identity{0};
  std::atomic<uint64_t> checkpoint_stall_ns{0};
  std::atomic<uint64_t> forwards_sent{0};       // Sums and seeds sent to backups.
  std::atomic<uint64_t> backup_steps{0};        // Forwarded steps applied as a backup.
  std::atomic<uint64_t> seeds_received{0};
  static constexpr int kNumCodes = 17;          // absl::StatusCode values 0..16.
  std::array<std::atomic<uint64_t>, kNumCodes> errors{};  // Replies by error code.
  Histogram step_latency;                       // One chunk's fused step.
  // From the last push of a chunk's step landing to the version being
  // pullable (the fold of the last push, the optimizer pass and the cast;
  // steps published without waiting for a backup).
  Histogram publish_tail;
  // The part of publish_tail before the step starts: waiting for a step
  // thread (behind other chunks' steps and folds) and the last push's fold.
  Histogram step_queue;
  std::atomic<uint64_t> folds{0};               // Fold passes (staging.h).
  std::atomic<uint64_t> batches_received{0};    // wire::Op::kBatch messages.
  // wire::kAmReplyBatch messages sent, and the replies they carried.
  std::atomic<uint64_t> reply_batches{0};
  std::atomic<uint64_t> replies_batched{0};
  // Map parts fetched from the coordinator (GetJob calls answered), and new
  // map epochs taken without a fetch (this shard's part was unchanged).
  std::atomic<uint64_t> map_fetches{0};
  std::atomic<uint64_t> map_epochs_unchanged{0};

  void CountError(const absl::Status& status) {
    const int code = static_cast<int>(status.code());
    if (code > 0 && code < kNumCodes) errors[code].fetch_add(1, std::memory_order_relaxed);
  }
};

// Gauges that are read at scrape time.
struct ShardGauges {
  uint64_t shard_id = 0;
  uint64_t memory_used_bytes = 0;
  uint64_t memory_limit_bytes = 0;
  uint32_t chunks_owned = 0;
  uint32_t jobs = 0;
  double lease_age_seconds = 0;
  uint64_t staging_limit_bytes = 0;
  uint64_t staging_in_use_bytes = 0;
  uint64_t staging_held_bytes = 0;
  uint64_t staging_waits = 0;
  uint64_t batch_buffer_allocations = 0;  // ReceiveBufferPool::allocations.
  // Data-plane handshakes refused and messages dropped from peers that
  // proved nothing (transport::Worker::refused_messages).
  uint64_t unproved_refused = 0;
  // server/peer_limits.h.
  uint64_t parked_pulls = 0;
  uint64_t peers_with_parked_pulls = 0;
  uint64_t parked_pull_refusals = 0;
  uint64_t inflight_bytes = 0;
  uint64_t inflight_refusals = 0;
  // The data plane's peers (transport::Worker::peer_count) and hellos it
  // refused for being over its peer limit.
  uint64_t transport_peers = 0;
  uint64_t transport_hellos_refused = 0;
};

std::string RenderShardMetrics(const ShardMetrics& m, const ShardGauges& g);

}  // namespace server
}  // namespace optimus

#endif  // OPTIMUS_SERVER_SHARD_METRICS_H_
