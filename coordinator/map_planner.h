// How a job's shard map changes when shards fail, drain or come back:
// failover (promote in-sync backups or fail the job), replication and drain
// moves (new backups, temporary backups, promotions off draining shards),
// and whether a drain can start at all. Pure functions over plain structs
// (no proto, no locks, no clock): the coordinator converts its records into
// these, plans, and writes the result back. They own nothing and are safe to
// call from any thread; `candidates` arguments are in/out (the bytes of each
// copy placed are added to the shard that takes it, so that several jobs
// planned in a row see each other's picks).
#ifndef OPTIMUS_COORDINATOR_MAP_PLANNER_H_
#define OPTIMUS_COORDINATOR_MAP_PLANNER_H_

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "coordinator/shard_map.h"
#include "kernels/optimizer_spec.h"

namespace optimus {

// What the planners need to know of a shard's lease. A shard absent from a
// ShardHealthMap (forgotten) counts as kDown.
enum class ShardHealth : uint8_t { kUp, kDraining, kDown };
using ShardHealthMap = std::map<uint64_t, ShardHealth>;

// One job's chunks as the planners see them.
struct JobLayout {
  // Primary in shard_id, backup (0: none) in backup_shard_id.
  std::vector<ChunkSpec> chunks;
  // By chunk index: the chunk's backup reported itself in sync with its
  // primary (it may be promoted). Same size as chunks.
  std::vector<bool> backup_in_sync;
  // Shard bytes one element of the job costs (primary or backup alike).
  uint64_t bytes_per_elem = 0;
  // Backups per chunk the job asked for: 0 or 1.
  uint32_t replication = 0;
  // Shard bytes one chunk costs beyond its elements (its bookkeeping;
  // tests of the placement arithmetic set 0).
  uint64_t chunk_overhead_bytes = kernels::kChunkOverheadBytes;
};

// What a job holds on one shard.
struct ShardLoad {
  uint32_t num_chunks = 0;     // As primary or backup.
  uint32_t backup_chunks = 0;  // Of num_chunks, as backup.
  uint64_t size_bytes = 0;     // A backup costs as much as a primary.
  // Chunks that a newer map moved away and the shard has not released yet
  // (not in num_chunks). Filled by the coordinator, never by ComputeLoad.
  uint32_t unreleased_chunks = 0;
};

// At least the bytes the chunks take in a serialized v1::ShardMap, whatever
// shards they land on (shard ids counted at their largest), so that a map
// too big for one gRPC message is refused before anything is placed.
uint64_t MapBytesBound(absl::Span<const ChunkSpec> chunks, bool replicated);

// Load by shard over the chunks' primaries and backups.
std::map<uint64_t, ShardLoad> ComputeLoad(
    absl::Span<const ChunkSpec> chunks, uint64_t bytes_per_elem,
    uint64_t chunk_overhead_bytes = kernels::kChunkOverheadBytes);

// Picks a shard for one more copy of `chunk` (never exclude_id: the holder
// of its other copy) with PickShard's rule and adds the chunk's bytes to
// it. Returns the shard id, or 0 when none has room.
uint64_t TakeSlot(const ChunkSpec& chunk, uint64_t bytes_per_elem, uint64_t chunk_overhead_bytes,
                  uint64_t exclude_id, std::vector<ShardInfo>& candidates);

struct FailoverPlan {
  enum class Outcome {
    kUnchanged,  // No shard holding the job's chunks is down.
    kFailed,     // A chunk lost its primary without an in-sync backup on a live shard.
    kFailedOver  // Every lost primary is replaced by its backup: `after` is the new layout.
  };
  Outcome outcome = Outcome::kUnchanged;
  std::set<uint64_t> lost_shards;  // Down shards that held primaries or backups.
  // kFailed: chunks whose primary is down, and of them those without an
  // in-sync backup on a live shard.
  uint32_t lost_primaries = 0;
  uint32_t unprotected = 0;
  // kFailedOver: backups promoted, backups dropped because their shard is
  // down, new backups placed (replication 1), and chunks left without one
  // because no live shard had room.
  uint32_t promoted = 0;
  uint32_t backups_lost = 0;
  uint32_t new_backups = 0;
  uint32_t without_backup = 0;
  JobLayout after;
};

// A job holding chunks on down shards:
//  - if every chunk whose primary is down has an in-sync backup on an UP or
//    DRAINING shard, fails over: those backups become primaries, backups on
//    down shards are dropped, and (replication 1) each chunk left without a
//    backup gets one among `candidates` (UP shards) other than its primary
//    where one fits (otherwise it stays without until a later
//    PlanReplication finds room);
//  - otherwise the job fails, and its bytes are taken off `candidates` (its
//    shards drop it).
// A backup lost on its own never fails a job.
FailoverPlan PlanFailover(const JobLayout& job, const ShardHealthMap& health,
                          std::vector<ShardInfo>& candidates);

struct ReplicationPlan {
  uint32_t promoted = 0;       // In-sync backups promoted off draining primaries.
  uint32_t moved_backups = 0;  // Backups moved off (or dropped from) draining shards.
  uint32_t temporary = 0;      // Backups added so that a draining primary can be promoted away.
  uint32_t new_backups = 0;    // Replication 1: backups placed where one was missing.
  bool changed() const { return promoted + moved_backups + temporary + new_backups > 0; }
  JobLayout after;             // The new layout when changed().
};

// One round of moves for a live job (at most one map change):
//  - a chunk whose backup is on a DRAINING shard gets a new backup elsewhere
//    (replication 0: just drops it unless its primary drains too, in which
//    case the new backup is the one to promote; with no room, it keeps the
//    old one for now);
//  - a chunk whose primary is DRAINING: its in-sync backup is promoted
//    (replication 1: and a new backup placed); without a backup it gets a
//    temporary one, which the primary seeds and a later round promotes;
//  - replication 1: a chunk without a backup gets one where it fits.
// New copies go to `candidates` (UP shards) with PickShard's rule.
ReplicationPlan PlanReplication(const JobLayout& job, const ShardHealthMap& health,
                                std::vector<ShardInfo>& candidates);

// A live job holding chunks on the shard to drain, for CheckDrainFits.
struct DrainJob {
  std::string name;  // For the error message.
  const JobLayout* layout = nullptr;  // Borrowed for the call.
};

// Whether every chunk on `shard_id` can get the new copy a drain needs on
// another UP shard: each chunk it holds needs one (not on the holder of its
// other copy), except a replication-0 chunk it is primary of whose backup
// is on an UP shard already (promoted as it is). `candidates` are the UP
// shards other than shard_id, with the bytes planned on them now.
// FAILED_PRECONDITION naming the first chunk that fits nowhere, with the
// free bytes over the candidates and the largest free space.
absl::Status CheckDrainFits(uint64_t shard_id, uint32_t chunks_held,
                            absl::Span<const DrainJob> jobs, const ShardHealthMap& health,
                            std::vector<ShardInfo> candidates);

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_MAP_PLANNER_H_
