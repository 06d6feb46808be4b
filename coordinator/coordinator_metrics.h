// The coordinator's /metrics page (Prometheus text): shards by state and
// their usage, jobs and their replication, checkpoints, errors answered,
// and jobs deleted / shards forgotten. A pure function of what it is given;
// safe from any thread.
#ifndef OPTIMUS_COORDINATOR_COORDINATOR_METRICS_H_
#define OPTIMUS_COORDINATOR_COORDINATOR_METRICS_H_

#include <cstdint>
#include <string>

#include "absl/types/span.h"
#include "proto/optimus.pb.h"

namespace optimus {

struct CoordinatorMetricsInput {
  // Status with last_checkpoint filled.
  const v1::StatusResponse* status = nullptr;
  // RPCs answered with an error, by absl::StatusCode value (index 0 unused).
  absl::Span<const uint64_t> errors_by_code;
  uint64_t jobs_deleted = 0;
  uint64_t shards_forgotten = 0;
  // Jobs refused with RESOURCE_EXHAUSTED: over a job quota, a map too big
  // for one gRPC message, more than the shards can hold.
  uint64_t jobs_refused_quota = 0;
  uint64_t jobs_refused_map_size = 0;
  uint64_t jobs_refused_capacity = 0;
  // Calls dropped because their client had given up before they were
  // served; heartbeats answered from the lease table while planning held
  // the tables.
  uint64_t calls_dropped = 0;
  uint64_t heartbeats_deferred = 0;
  // Control calls being served now (waiting for the tables included).
  int calls_in_progress = 0;
  // GetJob maps cut and serialized, and answers sent from the bytes of an
  // earlier fetch of the same (job, epoch, shard).
  uint64_t map_parts_serialized = 0;
  uint64_t map_parts_reused = 0;
  // Shards sent to fetch a part after a wait (pacing: --map_fetches_per_s).
  uint64_t map_fetches_delayed = 0;
  // GetJob / GetShardMap refused with RESOURCE_EXHAUSTED for being past
  // --max_concurrent_map_reads.
  uint64_t map_reads_refused = 0;
};

std::string RenderCoordinatorMetrics(const CoordinatorMetricsInput& in);

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_COORDINATOR_METRICS_H_
