// Applying a map delta (GetJobResponse.map_delta_from) to the whole map a
// worker holds: after a failover or drain the coordinator sends a worker
// the chunks that moved and their holders' endpoints, not the whole map.
#ifndef OPTIMUS_CLIENT_MAP_DELTA_H_
#define OPTIMUS_CLIENT_MAP_DELTA_H_

#include "absl/status/statusor.h"
#include "proto/optimus.pb.h"

namespace optimus {

// The whole map of delta.epoch(): `base` (the whole map of the delta's
// starting epoch) with each chunk the delta names placed as the delta
// says, and the endpoints of every shard the result's chunks name (the
// delta's for new shards, base's for the others; shards no chunk names
// any more are dropped). INVALID_ARGUMENT, changing nothing, when the
// delta is of another job, not newer than `base`, from another epoch than
// base's (ShardMap.delta_from, when set), names a chunk that
// `base` does not have or with another element range, or places a chunk
// on a shard it gives no endpoint for.
absl::StatusOr<v1::ShardMap> ApplyMapDelta(const v1::ShardMap& base, const v1::ShardMap& delta);

}  // namespace optimus

#endif  // OPTIMUS_CLIENT_MAP_DELTA_H_
