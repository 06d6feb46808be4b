#include "coordinator/map_planner.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/optimizer_spec.h"

namespace optimus {
namespace {

bool IsDown(const ShardHealthMap& health, uint64_t id) {
  auto it = health.find(id);
  return it == health.end() || it->second == ShardHealth::kDown;
}

bool IsDraining(const ShardHealthMap& health, uint64_t id) {
  auto it = health.find(id);
  return it != health.end() && it->second == ShardHealth::kDraining;
}

bool IsUp(const ShardHealthMap& health, uint64_t id) {
  auto it = health.find(id);
  return it != health.end() && it->second == ShardHealth::kUp;
}

}  // namespace

namespace {
uint64_t VarintBytes(uint64_t v) {
  uint64_t n = 1;
  while (v >= 0x80) {
    v >>= 7;
    ++n;
  }
  return n;
}
}  // namespace

uint64_t MapBytesBound(absl::Span<const ChunkSpec> chunks, bool replicated) {
  // Per field a one-byte tag and its varint; a shard id at most 10 bytes;
  // per placement its tag and a length of at most 2 bytes (< 16 KiB).
  constexpr uint64_t kIdBytes = 1 + 10;
  uint64_t total = 0;
  for (const ChunkSpec& c : chunks) {
    total += 3 + (1 + VarintBytes(c.tensor)) + (1 + VarintBytes(c.chunk)) +
             (1 + VarintBytes(c.offset_elems)) + (1 + VarintBytes(c.num_elems)) + kIdBytes +
             (replicated ? kIdBytes : 0);
  }
  return total;
}

std::map<uint64_t, ShardLoad> ComputeLoad(absl::Span<const ChunkSpec> chunks,
                                          uint64_t bytes_per_elem,
                                          uint64_t chunk_overhead_bytes) {
  std::map<uint64_t, ShardLoad> load;
  for (const ChunkSpec& c : chunks) {
    const uint64_t bytes = c.num_elems * bytes_per_elem + chunk_overhead_bytes;
    ShardLoad& primary = load[c.shard_id];
    primary.num_chunks += 1;
    primary.size_bytes += bytes;
    if (c.backup_shard_id != 0) {
      // A backup is a complete copy that can be promoted: it costs the same.
      ShardLoad& backup = load[c.backup_shard_id];
      backup.num_chunks += 1;
      backup.backup_chunks += 1;
      backup.size_bytes += bytes;
    }
  }
  return load;
}

uint64_t TakeSlot(const ChunkSpec& chunk, uint64_t bytes_per_elem, uint64_t chunk_overhead_bytes,
                  uint64_t exclude_id, std::vector<ShardInfo>& candidates) {
  const uint64_t bytes = chunk.num_elems * bytes_per_elem + chunk_overhead_bytes;
  // The other copy's failure domain, when its shard is a candidate (UP):
  // the new copy goes outside it where another domain has room.
  uint64_t exclude_domain = 0;
  for (const ShardInfo& s : candidates) {
    if (exclude_id != 0 && s.id == exclude_id) exclude_domain = s.domain;
  }
  const int pick = PickShard(candidates, bytes, exclude_id, exclude_domain);
  if (pick < 0) return 0;
  candidates[pick].memory_planned_bytes += bytes;
  return candidates[pick].id;
}

FailoverPlan PlanFailover(const JobLayout& job, const ShardHealthMap& health,
                          std::vector<ShardInfo>& candidates) {
  FailoverPlan plan;
  const std::map<uint64_t, ShardLoad> load = ComputeLoad(job.chunks, job.bytes_per_elem, job.chunk_overhead_bytes);
  for (const auto& [shard_id, l] : load) {
    if (IsDown(health, shard_id)) plan.lost_shards.insert(shard_id);
  }
  if (plan.lost_shards.empty()) return plan;

  // Can every chunk whose primary is lost be served by its backup?
  for (size_t i = 0; i < job.chunks.size(); ++i) {
    const ChunkSpec& c = job.chunks[i];
    if (!IsDown(health, c.shard_id)) continue;
    ++plan.lost_primaries;
    if (c.backup_shard_id == 0 || IsDown(health, c.backup_shard_id) || !job.backup_in_sync[i]) {
      ++plan.unprotected;
    }
  }
  if (plan.unprotected > 0) {
    plan.outcome = FailoverPlan::Outcome::kFailed;
    // Its shards drop it: its bytes are free for the jobs that follow.
    for (ShardInfo& s : candidates) {
      auto l = load.find(s.id);
      if (l != load.end()) s.memory_planned_bytes -= l->second.size_bytes;
    }
    return plan;
  }

  plan.outcome = FailoverPlan::Outcome::kFailedOver;
  plan.after = job;
  for (size_t i = 0; i < plan.after.chunks.size(); ++i) {
    ChunkSpec& c = plan.after.chunks[i];
    if (IsDown(health, c.shard_id)) {
      c.shard_id = c.backup_shard_id;
      c.backup_shard_id = 0;
      plan.after.backup_in_sync[i] = false;
      ++plan.promoted;
    } else if (c.backup_shard_id != 0 && IsDown(health, c.backup_shard_id)) {
      c.backup_shard_id = 0;
      plan.after.backup_in_sync[i] = false;
      ++plan.backups_lost;
    }
  }
  if (job.replication == 1) {
    for (ChunkSpec& c : plan.after.chunks) {
      if (c.backup_shard_id != 0) continue;
      c.backup_shard_id =
          TakeSlot(c, job.bytes_per_elem, job.chunk_overhead_bytes, c.shard_id, candidates);
      (c.backup_shard_id != 0 ? plan.new_backups : plan.without_backup) += 1;
    }
  }
  return plan;
}

ReplicationPlan PlanReplication(const JobLayout& job, const ShardHealthMap& health,
                                std::vector<ShardInfo>& candidates) {
  ReplicationPlan plan;
  plan.after = job;
  const bool rep1 = job.replication == 1;
  const uint64_t bpe = job.bytes_per_elem;
  for (size_t i = 0; i < plan.after.chunks.size(); ++i) {
    ChunkSpec& c = plan.after.chunks[i];
    const uint64_t primary = c.shard_id, backup = c.backup_shard_id;
    if (backup != 0 && IsDraining(health, backup)) {
      // The backup leaves first; with the primary draining too, the new
      // backup is the one that will be promoted once in sync.
      if (rep1 || IsDraining(health, primary)) {
        const uint64_t b = TakeSlot(c, bpe, job.chunk_overhead_bytes, primary, candidates);
        if (b == 0 && IsDraining(health, primary)) continue;  // Keep it until a shard has room.
        c.backup_shard_id = b;
      } else {
        c.backup_shard_id = 0;
      }
      plan.after.backup_in_sync[i] = false;
      ++plan.moved_backups;
    } else if (IsDraining(health, primary)) {
      if (backup == 0) {
        // No copy to promote: a temporary backup, which the primary seeds
        // at its next step.
        const uint64_t b = TakeSlot(c, bpe, job.chunk_overhead_bytes, primary, candidates);
        if (b == 0) continue;
        c.backup_shard_id = b;
        plan.after.backup_in_sync[i] = false;
        ++plan.temporary;
      } else if (plan.after.backup_in_sync[i]) {
        c.shard_id = backup;
        c.backup_shard_id =
            rep1 ? TakeSlot(c, bpe, job.chunk_overhead_bytes, backup, candidates) : 0;
        plan.after.backup_in_sync[i] = false;
        ++plan.promoted;
        if (c.backup_shard_id != 0) ++plan.new_backups;
      }
      // Otherwise wait for the backup to report in sync.
    } else if (rep1 && backup == 0) {
      const uint64_t b = TakeSlot(c, bpe, job.chunk_overhead_bytes, primary, candidates);
      if (b == 0) continue;
      c.backup_shard_id = b;
      plan.after.backup_in_sync[i] = false;
      ++plan.new_backups;
    }
  }
  return plan;
}

absl::Status CheckDrainFits(uint64_t shard_id, uint32_t chunks_held,
                            absl::Span<const DrainJob> jobs, const ShardHealthMap& health,
                            std::vector<ShardInfo> candidates) {
  const std::vector<ShardInfo> others = candidates;  // Before this check's picks.
  uint64_t bytes_to_move = 0;
  for (const DrainJob& job : jobs) {
    const JobLayout& layout = *job.layout;
    for (const ChunkSpec& c : layout.chunks) {
      uint64_t other;
      if (c.shard_id == shard_id) {
        other = c.backup_shard_id;
        if (other != 0 && IsUp(health, other) && layout.replication == 0) continue;
      } else if (c.backup_shard_id == shard_id) {
        other = c.shard_id;
      } else {
        continue;
      }
      const uint64_t bytes = c.num_elems * layout.bytes_per_elem + layout.chunk_overhead_bytes;
      bytes_to_move += bytes;
      if (TakeSlot(c, layout.bytes_per_elem, layout.chunk_overhead_bytes, other, candidates) != 0) {
        continue;
      }
      uint64_t free_total = 0, free_largest = 0;
      for (const ShardInfo& s : others) {
        const uint64_t f = s.memory_planned_bytes >= s.memory_limit_bytes
                               ? 0
                               : s.memory_limit_bytes - s.memory_planned_bytes;
        free_total += f;
        free_largest = std::max(free_largest, f);
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot drain shard ", shard_id, ": its ", chunks_held,
          " chunks need room on other live shards, and chunk (tensor ", c.tensor, ", chunk ",
          c.chunk, ") of job \"", job.name, "\" (", bytes,
          " bytes) fits on no live shard that is not draining",
          other != 0 ? absl::StrCat(" other than shard ", other, ", which holds its other copy")
                     : "",
          ", after ", bytes_to_move - bytes, " bytes of its other chunks; ", free_total,
          " bytes free over ", candidates.size(),
          " live shards that are not draining, largest free ", free_largest,
          " bytes; add a shard or free memory first"));
    }
  }
  return absl::OkStatus();
}

}  // namespace optimus
