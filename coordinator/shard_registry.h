// The coordinator's shard membership: registration (ids 1, 2, ... never
// reused), what heartbeats report, marking shards DOWN (once their lease
// expired: the leases themselves are in lease_table.h, under a lock of
// their own), and forgetting DOWN shards (at once, or once they have been
// DOWN longer than a grace period). A shard's death is reported to the
// listeners added with AddShardDownListener; the registry knows nothing of
// jobs or maps.
//
// Not thread-safe on its own: the Coordinator owns one as a member guarded
// by its lock and calls it only under that lock; listeners run under it
// too, on the thread that called MarkDown. It does no I/O.
#ifndef OPTIMUS_COORDINATOR_SHARD_REGISTRY_H_
#define OPTIMUS_COORDINATOR_SHARD_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "coordinator/map_planner.h"
#include "proto/optimus.pb.h"

namespace optimus {

struct ShardRecord {
  uint64_t id = 0;
  v1::ShardCapabilities capabilities;
  v1::ShardState state = v1::SHARD_STATE_UP;
  // When it was marked DOWN (by this process: a recovered DOWN shard counts
  // from the recovery), for the grace period.
  absl::Time down_since;
  uint64_t memory_used_bytes = 0;  // As reported.
  uint32_t chunks_reported = 0;    // As reported.
  std::string transports;          // As reported (data-plane transports in use).
  // DRAINING: chunks it held when the drain began (volatile), and whether
  // "drained" was logged.
  uint32_t drain_chunks_at_start = 0;
  bool drained_logged = false;
  // The client certificate common name it registered with (empty in
  // plain-text mode); durable. Heartbeats for its id must come from it.
  std::string identity;
};

class ShardRegistry {
 public:
  // Called with the ids of the shards one MarkDown marked DOWN, all of
  // them marked before the call (a backup lost in the same sweep as its
  // primary is already DOWN when the listener looks).
  using ShardDownListener = std::function<void(const std::vector<uint64_t>& shard_ids)>;

  ShardRegistry() = default;

  void AddShardDownListener(ShardDownListener listener);

  // A new UP shard with the next id.
  const ShardRecord& Register(const v1::ShardCapabilities& caps);
  // Undoes the Register that returned `id` (its state could not be saved):
  // the id is handed out again when it was the last one.
  void Unregister(uint64_t id);

  // Records an UP or DRAINING shard's report; nullptr for a shard that is
  // unknown or DOWN (it must register again).
  ShardRecord* Report(uint64_t id, uint64_t memory_used_bytes, uint32_t chunks_reported);

  // Marks DOWN (since `now`) each of `ids` that is UP or DRAINING (the
  // lease table found their leases expired), then tells the listeners
  // about those. Returns how many it marked.
  int MarkDown(const std::vector<uint64_t>& ids, absl::Time now);

  // Removes the DOWN shard `id` and returns it as it was. NOT_FOUND for an
  // unknown id; FAILED_PRECONDITION for an UP or DRAINING shard.
  absl::StatusOr<ShardRecord> Forget(uint64_t id);
  // Removes every shard DOWN for longer than `grace` at `now`; returns them.
  std::vector<ShardRecord> ForgetDownLongerThan(absl::Duration grace, absl::Time now);

  // Drops every shard (keeps the listeners and the next id).
  void Clear() {
    shards_.clear();
    ++generation_;
  }
  // Puts back a record (recovery, or undoing a Forget whose save failed).
  void Restore(ShardRecord record);

  ShardRecord* Find(uint64_t id);
  const ShardRecord* Find(uint64_t id) const;
  const std::map<uint64_t, ShardRecord>& all() const { return shards_; }
  std::map<uint64_t, ShardRecord>& mutable_all() { return shards_; }
  size_t size() const { return shards_.size(); }

  // The lease state of every shard, as the map planners take it.
  ShardHealthMap Health() const;

  // Changes whenever a shard comes, goes or changes state through the
  // registry (Register, Unregister, MarkDown, Forget*, Restore, Clear):
  // what placement planned off the lock compares before it commits. Who
  // changes a record's state through Find or mutable_all calls Touch().
  uint64_t generation() const { return generation_; }
  void Touch() { ++generation_; }

  uint64_t next_id() const { return next_id_; }
  void set_next_id(uint64_t id) { next_id_ = id; }

 private:
  uint64_t next_id_ = 1;
  uint64_t generation_ = 0;
  std::map<uint64_t, ShardRecord> shards_;
  std::vector<ShardDownListener> listeners_;
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_SHARD_REGISTRY_H_
