// The coordinator's jobs: one record per job (spec, state, current shard
// map, what each shard reported, joined worker ranks) by id, and the index
// of job names. A name belongs to one job at a time.
//
// Not thread-safe on its own: the Coordinator owns one as a member guarded
// by its lock and calls it only under that lock. It does no I/O.
#ifndef OPTIMUS_COORDINATOR_JOB_TABLE_H_
#define OPTIMUS_COORDINATOR_JOB_TABLE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/map_planner.h"
#include "proto/optimus.pb.h"

namespace optimus {

// What one map epoch changed (JobRecord::chunk_changes).
struct MapChange {
  // Indices into map.chunks of the chunks whose primary or backup changed.
  std::vector<int> chunks;
  // Shards that hold chunks at this epoch and held none at the one before.
  std::vector<uint64_t> new_holders;
};

// One (job, epoch) as fetches read it, built once per map epoch from the
// job's record and never changed after: a fetch takes the pointer under
// the coordinator's lock and copies or cuts the map with no lock held.
struct MapSnapshot {
  v1::JobSpec spec;
  v1::ShardMap map;  // The whole map: every chunk, each holder's endpoint once.
  std::optional<v1::RestoreSource> restore;
  uint64_t resume_step = 1;
  // By shard id: indices into map.chunks of the chunks it holds as primary
  // or backup, in map order.
  std::map<uint64_t, std::vector<int>> chunks_of;
  // By shard id: index into map.shards of its endpoint.
  std::map<uint64_t, int> endpoint_of;
  // The job's chunk_changes and changes_since when this epoch was current
  // (see JobRecord): what a delta from an older epoch is made of.
  std::map<uint64_t, MapChange> chunk_changes;
  uint64_t changes_since = 0;

  // What fetches of this epoch send, serialized once by the first fetch
  // that needs it (with no coordinator lock held) and shared by the next
  // ones: a retried or repeated fetch of the epoch costs a lookup and a
  // copy of bytes, not a cut and a serialization. The spec (the same for
  // every shard, tens of KB for a big model), and each shard's part of the
  // map (ShardViewOf; key 0: the whole map). They go with the snapshot:
  // once a newer epoch's snapshot replaced it in the job's record, the
  // last fetch still holding it frees them.
  mutable absl::Mutex bytes_mu;
  mutable std::shared_ptr<const std::string> spec_bytes ABSL_GUARDED_BY(bytes_mu);
  // The spec as a shard's part carries it (ShardSpecOf).
  mutable std::shared_ptr<const std::string> shard_spec_bytes ABSL_GUARDED_BY(bytes_mu);
  mutable std::map<uint64_t, std::shared_ptr<const std::string>> part_bytes
      ABSL_GUARDED_BY(bytes_mu);
  // Deltas to this epoch (DeltaOf), by the epoch they start from.
  mutable std::map<uint64_t, std::shared_ptr<const std::string>> delta_bytes
      ABSL_GUARDED_BY(bytes_mu);
};

struct JobRecord {
  uint64_t id = 0;
  v1::JobSpec spec;  // Defaults filled.
  v1::JobState state = v1::JOB_STATE_PENDING;
  uint64_t num_params = 0;
  uint64_t bytes_per_elem = 0;  // Shard bytes per element (kernels::ShardBytesPerElem).
  v1::ShardMap map;             // Current map, map.epoch() is the epoch.
  // Planned, by shard id, over primaries and backups (from map).
  std::map<uint64_t, ShardLoad> load;
  // By index into map.chunks: the chunk's backup is known to be in sync
  // (its shard reported all its backups of the job seeded at the current
  // epoch). Volatile: a restarted coordinator learns it from the next
  // heartbeats. Cleared when a chunk's backup changes.
  std::vector<bool> backup_seeded;
  // Live shards that held chunks under an older map and hold none now
  // (drained, or their backups moved), with how many they held. Once
  // every holder has loaded the current map (so that no primary still
  // forwards to a departed backup under the old one), they are assigned
  // the job again until they report its current epoch: they apply the map
  // that took their chunks away (retire them, send requests for them back
  // to the clients). Their chunks count in their chunks_owned until then:
  // a drained shard is safe to stop only once it has let go. Volatile.
  std::map<uint64_t, uint32_t> departed;
  std::map<uint64_t, v1::ShardJobProgress> progress;  // Reported, by shard id.
  std::set<uint32_t> joined_ranks;
  uint64_t resume_step = 1;  // Step workers start at (restored jobs: S).
  std::optional<v1::RestoreSource> restore;
  bool rollback_tried = false;   // Durable (PersistedJob.rollback_tried).
  std::string rollback_error;    // Why the roll-back failed; durable.
  // Being deleted: left out of saved snapshots while its deletion is made
  // durable; still served (and not released to shards) until it is gone.
  bool deleting = false;
  // What its workers prove (CreateJobResponse.job_token); durable.
  std::string token;
  // The epoch at which each shard's part of the map (ShardViewOf) last
  // changed, for the shards whose part changed after parts_since; every
  // other holder's part is unchanged since parts_since. Heartbeats hand it
  // out (Assignment.part_epoch, PartEpochOf) so that a shard whose part a
  // new epoch left as it was takes the epoch without fetching it.
  // parts_since is the job's first epoch for a job this coordinator made,
  // and the epoch it was loaded at for one loaded from the durable state
  // (a shard that has an older one fetches). Volatile.
  uint64_t parts_since = 0;
  std::map<uint64_t, uint64_t> part_epochs;
  // By epoch: what it changed (the chunks whose primary or backup changed,
  // the shards new among the holders), for the newest kKeptChunkChanges epochs. A
  // whole-map read from a worker that holds an epoch >= changes_since gets
  // a delta (GetJobRequest.known_epoch); changes_since is the job's first
  // epoch (or the epoch it was loaded at), and moves up as old epochs are
  // dropped. Volatile.
  static constexpr size_t kKeptChunkChanges = 16;
  std::map<uint64_t, MapChange> chunk_changes;
  uint64_t changes_since = 0;
  // Shards that a heartbeat reply sent to fetch their part at the current
  // epoch, with the time of their slot (options.map_fetches_per_s): a
  // later reply tells the same slot again. Cleared at each new epoch.
  // Volatile.
  std::map<uint64_t, absl::Time> fetch_slots;
  // The current map as fetches read it; null or of an older epoch until
  // the first fetch after a map change builds it (SnapshotOf). Volatile.
  std::shared_ptr<const MapSnapshot> snapshot;

  // Kept so that a heartbeat costs the same whatever the size of the job:
  // counts over the current map's holders instead of scans of its holders
  // or chunks. Rebuilt (one pass over holders and chunks) the first time
  // they are used at a new epoch (CountsAtEpoch); kept up to date by
  // RecordProgress and DropProgress. Volatile.
  struct HolderCounts {
    uint64_t epoch = 0;     // The map epoch they count (0: not built).
    uint32_t at_epoch = 0;  // Holders whose report is at this epoch or newer.
    uint32_t loaded = 0;    // Holders reporting this epoch with all their chunks loaded.
    // Indices into map.chunks, by backup shard.
    std::map<uint64_t, std::vector<int>> backups_of;
    // Backup shards whose chunks were marked in sync at this epoch (so
    // once per shard and epoch, not on every heartbeat).
    std::set<uint64_t> seeded;
  };
  HolderCounts counts;
};

// The job's counts at its current epoch, rebuilt first when the epoch
// changed since they were built.
JobRecord::HolderCounts& CountsAtEpoch(JobRecord& job);
// Records shard `shard_id`'s report, keeping the counts; the shard must
// hold chunks of the job (job.load has it).
void RecordProgress(JobRecord& job, uint64_t shard_id, const v1::ShardJobProgress& p);
// Drops what the shard reported, keeping the counts.
void DropProgress(JobRecord& job, uint64_t shard_id);
// Every holder reports the current epoch (or newer).
bool AllHoldersAtEpoch(JobRecord& job);
// Every holder reports the current epoch with all its chunks loaded.
bool AllHoldersLoaded(JobRecord& job);

class JobTable {
 public:
  // Adds `job` (its id must be new), gives it its name and indexes its
  // holders (JobsOf).
  JobRecord& Add(JobRecord job);
  // Removes the job and, when the name is its own, the name. Returns it.
  std::optional<JobRecord> Remove(uint64_t id);

  // The index a heartbeat reads instead of walking every job: per shard,
  // the jobs it holds chunks of or departed from, and maybe a few it no
  // longer has to do with (the reader drops those with Unindex). Call
  // IndexHolders after a job's load or departed shards changed.
  void IndexHolders(const JobRecord& job);
  // The jobs indexed for `shard_id` (nullptr: none).
  const std::set<uint64_t>* JobsOf(uint64_t shard_id) const;
  void Unindex(uint64_t shard_id, uint64_t job_id);
  // The shard left the tables.
  void UnindexShard(uint64_t shard_id) { jobs_of_shard_.erase(shard_id); }
  // Gives `name` to job `id` (undoing a restore that took it over).
  void ClaimName(const std::string& name, uint64_t id) { ids_by_name_[name] = id; }

  // Drops every job and name (keeps the next id).
  void Clear() {
    jobs_.clear();
    ids_by_name_.clear();
    ++generation_;
    jobs_of_shard_.clear();
  }

  // Changes whenever a job is added or removed, or Touch() is called (a
  // job's map or state changed): with the registry's, what placement
  // planned off the lock compares before it commits.
  uint64_t generation() const { return generation_; }
  void Touch() { ++generation_; }

  JobRecord* Find(uint64_t id);
  const JobRecord* Find(uint64_t id) const;
  // The job that holds `name`, or nullptr.
  JobRecord* FindByName(const std::string& name);

  std::map<uint64_t, JobRecord>& all() { return jobs_; }
  const std::map<uint64_t, JobRecord>& all() const { return jobs_; }
  size_t size() const { return jobs_.size(); }
  size_t names_size() const { return ids_by_name_.size(); }

  // Ids are never handed out twice, not even for a job whose creation was
  // undone: a shard that saw it must not mistake a later job for it.
  uint64_t TakeNextId() { return next_id_++; }
  uint64_t next_id() const { return next_id_; }
  void set_next_id(uint64_t id) { next_id_ = id; }

 private:
  uint64_t next_id_ = 1;
  uint64_t generation_ = 0;
  std::map<uint64_t, JobRecord> jobs_;
  std::map<std::string, uint64_t> ids_by_name_;
  std::map<uint64_t, std::set<uint64_t>> jobs_of_shard_;
};

// The job's current map as fetches read it: job.snapshot, built anew when
// it is missing or of an older epoch than job.map (an epoch never changes
// without a new epoch number, so one snapshot per epoch is enough).
std::shared_ptr<const MapSnapshot> SnapshotOf(JobRecord& job);

// The part of `snap`'s map that shard `shard_id` needs: the chunks it holds
// as primary or backup (in map order), and the endpoints of itself and of
// those chunks' other holders (each once, in the whole map's order). A
// shard holding nothing (its chunks all moved away) gets an empty map at
// the epoch, which tells it to let go of them.
v1::ShardMap ShardViewOf(const MapSnapshot& snap, uint64_t shard_id);
// The spec as one shard's part carries it: every field, but each tensor
// only with what a shard reads (its group and whether it is frozen), at
// its index, without its name and shape. A shard steps chunks, which carry
// their own offsets and lengths; the names and shapes (most of a big
// model's spec: ~22 KB of LLaMA-70B's 723 tensors) were sent to each of
// thousands of shards at every new job for nothing.
v1::JobSpec ShardSpecOf(const v1::JobSpec& spec);

// Assignment.part_epoch for `shard_id` (see JobRecord::part_epochs).
uint64_t PartEpochOf(const JobRecord& job, uint64_t shard_id);
// Records, at the map's new epoch, which shards' parts the change from
// `before` to the job's current map touched: the holders (primary or
// backup, before or after) of every chunk whose holders changed. Called
// after the chunks moved and the epoch advanced; entries of shards that
// no longer hold or owe anything of the job are dropped.
void RecordPartChanges(const JobLayout& before, JobRecord& job);

// The delta from epoch `from` to the snapshot's (GetJobResponse.map_delta_from):
// the chunks changed at any epoch in (from, snapshot epoch], as they are
// now, and the endpoints of the shards that became holders in that time
// and still are (a worker at `from` has every other holder's); empty when
// `from` is the snapshot's epoch. std::nullopt when the snapshot does not know every change since
// `from` (from < changes_since), or `from` is 0 or newer than the snapshot.
std::optional<v1::ShardMap> DeltaOf(const MapSnapshot& snap, uint64_t from);

// The job's chunks as the map planners take them.
JobLayout LayoutOfJob(const JobRecord& job);
// Writes the planners' copies back into job.map and job.backup_seeded (the
// chunks' ranges do not change).
void ApplyLayout(const JobLayout& layout, JobRecord& job);

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_JOB_TABLE_H_
