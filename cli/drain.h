// `optimusctl drain SHARD_ID [--wait]`: the coordinator's DrainShard RPC and
// the progress a waiting operator sees. DrainShardRpc makes one blocking
// call on its own channel; the other functions are pure. All are
// thread-safe.
#ifndef OPTIMUS_CLI_DRAIN_H_
#define OPTIMUS_CLI_DRAIN_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/optimus.pb.h"

namespace optimus {

// Marks the shard DRAINING, waiting at most `timeout`. UNAVAILABLE "cannot
// reach coordinator at ADDRESS: ..." when it cannot be reached; otherwise
// the coordinator's error (NOT_FOUND for an unknown shard,
// FAILED_PRECONDITION for a DOWN one or when its chunks fit nowhere else).
absl::StatusOr<v1::DrainShardResponse> DrainShardRpc(const std::string& address,
                                                     absl::Duration timeout, uint64_t shard_id);

// Where a drain stands, read from a StatusResponse.
struct DrainProgress {
  bool found = false;  // The coordinator knows the shard.
  v1::ShardState state = v1::SHARD_STATE_UNSPECIFIED;
  uint32_t chunks_left = 0;   // Primaries and backups it still holds.
  uint32_t backups_left = 0;  // Of chunks_left, backups.
  // Still DRAINING and holding no chunk: it can be stopped.
  bool drained() const {
    return found && state == v1::SHARD_STATE_DRAINING && chunks_left == 0;
  }
  // It went DOWN before it was drained: its chunks failed over, or their
  // jobs failed (a DOWN shard's count says nothing about that).
  bool lost() const { return found && state == v1::SHARD_STATE_DOWN; }
};
DrainProgress FindDrainProgress(const v1::StatusResponse& status, uint64_t shard_id);

// "shard 3: draining, 12 chunks left (4 of them backups)".
std::string RenderDrainProgress(uint64_t shard_id, const DrainProgress& p);

}  // namespace optimus

#endif  // OPTIMUS_CLI_DRAIN_H_
