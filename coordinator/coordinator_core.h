// The coordinator's core: the control plane's logic behind the gRPC service,
// wiring the shard registry (leases), the job table, the map planners, the
// checkpoint manager and the durable state writer. Request and response
// types are the contract of proto/optimus.proto, so proto types stop here;
// the planning below it (map_planner.h, shard_map.h) takes plain structs.
//
// One internal class declared once, implemented by concern:
// coordinator.cc (construction, recovery, persistence), coordinator_shards.cc
// (registration, heartbeats, leases, drain, forget), coordinator_jobs.cc
// (create, join, leave, delete, maps), coordinator_maps.cc (failover and
// replication moves), coordinator_checkpoints.cc, coordinator_status.cc.
//
// Thread-safety: every method is safe from any thread. Locks, in the order
// they are taken: commit_mu_ (serializes changes to the durable state and
// is held while one waits to be durable), then mu_ (the tables; never held
// while touching the disk, but held by planning: placement, failover),
// then the checkpoint manager's, the state writer's and the lease table's
// own locks. Heartbeats and reads take only mu_, so they never wait for an
// fsync; a change that must be durable before it is answered applies
// itself under mu_, snapshots the state, releases mu_ and waits for the
// writer, and undoes itself if the save fails.
//
// Leases live in the lease table (lease_table.h), under its own small
// lock, so that failure detection never waits behind planning: a heartbeat
// renews its lease there first, then takes mu_ unless planning holds it
// (or it stays taken for more than a moment): then it is answered with its
// last reply (its report waits for the next heartbeat). The lease sweep
// (SweepLeases, a thread of its own in the server) marks a silent shard
// DOWN there, which its heartbeats see at once; the tables take the DOWN
// shards and fail their chunks over, in one step, as soon as they are free
// (SweepExpiredLeases, and the changes that place chunks: CreateJob,
// DrainShard, ForgetShard).
#ifndef OPTIMUS_COORDINATOR_COORDINATOR_CORE_H_
#define OPTIMUS_COORDINATOR_COORDINATOR_CORE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/checkpoints.h"
#include "coordinator/coordinator_options.h"
#include "coordinator/job_spec.h"
#include "coordinator/job_table.h"
#include "coordinator/lease_table.h"
#include "coordinator/shard_map.h"
#include "coordinator/shard_registry.h"
#include "coordinator/state_store.h"
#include "coordinator/state_writer.h"
#include "proto/optimus.pb.h"

namespace optimus {

class Coordinator {
 public:
  // Whether the caller of a call in progress gave up (cancelled, or its
  // deadline passed): a call that may wait for the tables checks it once
  // it has them, and if so changes nothing and returns CANCELLED, so that
  // calls whose clients are gone are not executed late. Empty: never.
  using Abandoned = std::function<bool()>;

  explicit Coordinator(const CoordinatorOptions& options);
  // Writes the state if it changed since the last write and finishes
  // queued checkpoint file work.
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  // Loads the durable state (options.state_store, or state_dir's file), if
  // there is one (none is a fresh start). Shards that were UP get a fresh
  // lease from now: they keep running while the coordinator is away and
  // heartbeat again when it is back; DOWN shards start their grace period
  // again. DATA_LOSS naming the file when it is corrupted; nothing is
  // loaded then. Call once, before serving.
  absl::Status Recover();
  // TLS mode: makes the cluster's data-plane secret if the state has none
  // (durable before it returns); shards get it at registration, workers a
  // key derived from it at join.
  absl::Status EnsureDataPlaneKey() ABSL_LOCKS_EXCLUDED(mu_, commit_mu_);
  std::string data_plane_key() ABSL_LOCKS_EXCLUDED(mu_);

  // ---- Shards (coordinator_shards.cc) ----

  // Assigns a new shard id (1, 2, ...; never reused), state UP.
  // INVALID_ARGUMENT unless memory_limit_bytes > 0, kind is DPU or HOST and
  // data_address is non-empty. An error from saving the state changes
  // nothing.
  // `identity`: the caller's certificate common name (empty in plain-text
  // mode); only it may heartbeat as the new shard (ShardIdentityMatches).
  // Registrations waiting to be durable at the same time are made durable
  // by one write.
  absl::StatusOr<v1::RegisterShardResponse> RegisterShard(const v1::RegisterShardRequest& req,
                                                          const std::string& identity = "",
                                                          const Abandoned& abandoned = nullptr);
  // Whether `identity` registered shard `shard_id` (true for an unknown id:
  // Heartbeat tells it to register again).
  bool ShardIdentityMatches(uint64_t shard_id, const std::string& identity)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Whether `token` is the token of job `job_id` (of the job named `name`).
  // Never for a job without one (created before tokens existed: admins only).
  bool JobTokenMatches(uint64_t job_id, const std::string& token) ABSL_LOCKS_EXCLUDED(mu_);
  // True when job `job_id` was created once and is gone now (deleted, or
  // replaced by its own roll-back): a caller holding a token is then told
  // NOT_FOUND rather than refused, which is how a worker learns that its job
  // ended (and, after a roll-back, re-joins it by name). Ids never issued
  // are not gone: those stay refused, so a token cannot reach a job created
  // after the check.
  bool JobGone(uint64_t job_id) ABSL_LOCKS_EXCLUDED(mu_);
  // By name: nullopt when no job has that name (the call then answers
  // NOT_FOUND, so that ranks waiting for rank 0 to create it keep waiting).
  std::optional<bool> JobTokenMatchesByName(const std::string& name, const std::string& token)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Renews the lease (first, without waiting for the tables) and records
  // the shard's reported usage and per-job progress; a PENDING job turns READY once every shard holding its chunks
  // (as primary or backup) reports the current epoch with all its chunks
  // loaded. A shard that reports, at the current epoch, every one of its
  // backup chunks of a job seeded (backups_seeded == backup_chunks, both
  // equal to its backup count in the map) has those chunks' backups marked
  // in sync: they may be promoted. A shard whose chunks of a job all moved
  // away is assigned the job again once every remaining holder has loaded
  // the new map, until it reports that map too (so it retires what moved
  // away); until then they count in its chunks_owned. Every job the shard
  // reports that the coordinator does not have (deleted, replaced by a
  // restore, or unknown to a coordinator that lost its state) is listed in
  // released_jobs: the shard frees it. UP and DRAINING shards are served;
  // an unknown (forgotten) or DOWN shard gets known=false and must register
  // again (under a new id). Never waits for the disk, nor for planning:
  // when planning holds the tables (or they stay taken for more than a
  // moment), the lease is renewed all the same and the shard gets the
  // assignments and checkpoint orders of its last reply, its report being taken from its next
  // heartbeat (counted in Counters::heartbeats_deferred). The work is the
  // same whatever the size of the shard's jobs (counts, not scans).
  v1::HeartbeatResponse Heartbeat(const v1::HeartbeatRequest& req)
      ABSL_LOCKS_EXCLUDED(mu_, commit_mu_);

  // Marks the shard DRAINING (durable) so that TickReplication moves its
  // chunks away while training runs; returns it with the number of chunks
  // it held. Refuses, changing nothing: NOT_FOUND for an unknown shard,
  // FAILED_PRECONDITION for a DOWN one or when some chunk it holds fits on
  // no other UP shard (with the numbers). Idempotent for a DRAINING shard.
  absl::StatusOr<v1::DrainShardResponse> DrainShard(const v1::DrainShardRequest& req);

  // Removes a DOWN shard from the tables now (durable) and returns it as it
  // was. NOT_FOUND for an unknown id; FAILED_PRECONDITION for an UP or
  // DRAINING shard (nothing changes). A forgotten shard that heartbeats
  // again is told to register anew.
  absl::StatusOr<v1::ForgetShardResponse> ForgetShard(const v1::ForgetShardRequest& req);

  // The lease sweep alone: marks DOWN, in the lease table, every live
  // shard whose last heartbeat is older than the lease at `now`; from then
  // on its heartbeats get known=false. Takes no coordinator lock, so it
  // never waits behind planning. Returns how many it marked. Called by the
  // lease thread.
  int SweepLeases(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_, commit_mu_);
  // Whether the lease sweep marked the shard DOWN (the tables may not have
  // taken it yet). Takes no coordinator lock.
  bool LeaseExpired(uint64_t shard_id) const { return leases_.IsDown(shard_id); }

  // SweepLeases, then the tables' part: every shard the lease table marked
  // DOWN (in this call or before) is marked DOWN in the tables (the
  // registry tells the core through its shard-down listener), then, for
  // each PENDING/READY job holding chunks on a DOWN shard, fails it over or
  // fails it (see PlanFailover in map_planner.h); RollbackFailedJobs may
  // then restore a failed one. The epoch of a job that fails over goes up
  // by exactly one. Returns the number of shards the tables marked DOWN.
  // Called by the planning thread (woken by the lease thread).
  int SweepExpiredLeases(absl::Time now) ABSL_LOCKS_EXCLUDED(mu_, commit_mu_);

  // Removes the shards that have been DOWN longer than
  // options.down_shard_grace at `now`; returns how many. Called by the
  // sweeper thread.
  int ForgetLongDownShards(absl::Time now);

  // Moves chunks of PENDING/READY jobs, at most one epoch bump per job per
  // call (see PlanReplication in map_planner.h): off DRAINING shards, and
  // (replication 1) new backups where one is missing. Logs "shard N
  // drained" once a DRAINING shard holds no chunk. Returns the number of
  // jobs whose map changed. Called by the sweeper thread.
  int TickReplication(absl::Time now);

  // ---- Jobs (coordinator_jobs.cc) ----

  // Validates the spec (INVALID_ARGUMENT, or ALREADY_EXISTS for a taken name;
  // replication must be 0 or 1), fills defaults, places the chunks over UP
  // shards (not DRAINING ones) and, with replication 1, a backup of each on
  // another shard (FAILED_PRECONDITION without shards or, for replication 1,
  // with fewer than 2; RESOURCE_EXHAUSTED when it does not fit, backups
  // included) and returns the new job's id and map (epoch 1). The job starts
  // PENDING. Answers once the job is durable. Placement is planned with no
  // lock held and committed only if no shard or job changed meanwhile
  // (PlacementGenerationLocked); else planned again (kOffLockPlacements
  // times, then under the lock): the result is the same as planning at
  // commit time.
  absl::StatusOr<v1::CreateJobResponse> CreateJob(const v1::CreateJobRequest& req,
                                                  const Abandoned& abandoned = nullptr);

  // Records `rank` as joined (idempotent; a rank that left may join again).
  // NOT_FOUND for an unknown job; INVALID_ARGUMENT when world_size differs
  // from the job's or rank >= it.
  absl::StatusOr<v1::JoinJobResponse> JoinJob(const v1::JoinJobRequest& req);

  // Records `rank` as gone (idempotent). NOT_FOUND for an unknown job,
  // INVALID_ARGUMENT for a rank >= world_size. A job all of whose workers
  // left may be deleted without force.
  absl::StatusOr<v1::LeaveJobResponse> LeaveJob(const v1::LeaveJobRequest& req);

  // Ends a job: it leaves every table and the status at once (and the
  // durable state), its checkpoint in progress ends (the partial folder is
  // removed; complete checkpoints stay on disk), WaitForShardMap waiters get
  // NOT_FOUND, its planned bytes are free for placement, and every shard
  // that reports it afterwards is told to release it. FAILED_PRECONDITION,
  // changing nothing, while workers are joined unless force (a FAILED job,
  // or one whose workers all left, needs none); NOT_FOUND for an unknown
  // name; INVALID_ARGUMENT for an empty one.
  absl::StatusOr<v1::DeleteJobResponse> DeleteJob(const v1::DeleteJobRequest& req);

  // NOT_FOUND for an unknown job. for_shard_id 0: the whole map (workers);
  // otherwise only that shard's part (ShardViewOf in job_table.h: its
  // chunks and the endpoints it exchanges with) with a summary of the
  // whole, and no current_step; its spec is ShardSpecOf's (every tensor at
  // its index, without names and shapes). The map is read from the epoch's snapshot:
  // the lock is held only to take it, never to copy the map.
  absl::StatusOr<v1::GetJobResponse> GetJob(uint64_t job_id, uint64_t for_shard_id = 0);
  absl::StatusOr<v1::ShardMap> GetShardMap(uint64_t job_id);

  // GetJob's answer as the gRPC service sends it, the same on the wire:
  // `head` holds every field but spec and map (state and current_step are
  // read at each call; the rest is small), `spec` and `map` the serialized
  // JobSpec and ShardMap (the whole map, or the shard's part). Those two
  // are made once per (job, epoch, shard) and kept with the epoch's
  // snapshot (MapSnapshot::part_bytes), so that a fetch repeated or
  // retried at the same epoch costs a lookup, not a cut and a
  // serialization; counted in Counters::map_parts_serialized / _reused.
  // With known_epoch (whole-map reads only; GetJobRequest.known_epoch) the
  // spec is left out (null) and the map is the delta from known_epoch
  // (DeltaOf; head.map_delta_from set) when one can be made, else the
  // whole map; deltas are kept with the snapshot too.
  struct SerializedJob {
    v1::GetJobResponse head;
    std::shared_ptr<const std::string> spec;  // Null: none sent.
    std::shared_ptr<const std::string> map;
  };
  absl::StatusOr<SerializedJob> GetJobSerialized(uint64_t job_id, uint64_t for_shard_id = 0,
                                                 uint64_t known_epoch = 0);

  // Waits up to `timeout` for the job's map to have an epoch > after_epoch
  // and returns it; std::nullopt when the wait timed out. With `delta`
  // (and after_epoch > 0), the delta from after_epoch (DeltaOf) when one
  // can be made. NOT_FOUND for an unknown (or deleted) job,
  // FAILED_PRECONDITION once the job has FAILED (after its current map
  // was delivered), UNAVAILABLE after BeginShutdown().
  absl::StatusOr<std::optional<v1::ShardMap>> WaitForShardMap(uint64_t job_id,
                                                              uint64_t after_epoch,
                                                              absl::Duration timeout,
                                                              bool delta = false);

  // ---- Status (coordinator_status.cc) ----
  // Every shard and job (StatusPage of an empty request).
  v1::StatusResponse Status();
  // The shards in req.shard_states (all when empty), from the one after
  // req.page_token, at most req.page_size of them (0: all), in id order;
  // the jobs with the first page. INVALID_ARGUMENT for a page_token that is
  // not a shard id.
  absl::StatusOr<v1::StatusResponse> StatusPage(const v1::StatusRequest& req);

  // ---- Checkpoints (coordinator_checkpoints.cc; see checkpoints.h) ----
  // Orders a checkpoint of a READY job now; returns it IN_PROGRESS.
  // NOT_FOUND for an unknown job, FAILED_PRECONDITION when checkpoints are
  // off, one is in progress, or a shard of the job has no checkpoint dir.
  absl::StatusOr<v1::CreateCheckpointResponse> CreateCheckpoint(
      const v1::CreateCheckpointRequest& req);
  v1::ListCheckpointsResponse ListCheckpoints(const v1::ListCheckpointsRequest& req);
  // Verifies the checkpoint's files (DATA_LOSS naming the corrupted file;
  // nothing changes) and creates a job from it, placed over the live shards
  // with the current placement rules (any number of shards, any chunk
  // size): the shards load their element ranges from the files and the
  // job's workers resume at the checkpoint's step. The new job takes the
  // name new_job_name (default: job_name); an existing job of that name is
  // refused (ALREADY_EXISTS) unless it has FAILED: then it takes over the
  // name and the FAILED job is deleted (its shards release it).
  absl::StatusOr<v1::RestoreCheckpointResponse> RestoreCheckpoint(
      const v1::RestoreCheckpointRequest& req);
  // Sets each job's last_checkpoint (reads the checkpoint folders, with no
  // lock held).
  void FillLastCheckpoints(v1::StatusResponse* status);
  // Runs checkpoint policies and retries; called by the sweeper.
  void TickCheckpoints(absl::Time now);
  // With options.rollback_on_shard_loss: restores each job that FAILED (a
  // shard holding its chunks was lost, no replica) from its newest complete
  // checkpoint, under the same name, onto the live shards. Tried once per
  // failed job; returns how many were restored. Called by the sweeper.
  int RollbackFailedJobs();
  // Waits until the checkpoint file work queued so far (folders, manifests,
  // pruning) has run. For tests.
  void WaitForCheckpointFileWork() { checkpoints_.WaitForFileWork(); }

  // The clock of options.clock (absl::Now by default).
  absl::Time Now() const;

  // Wakes every WaitForShardMap, which then returns UNAVAILABLE.
  void BeginShutdown();

  // Runs `f` holding the tables' locks as planning does (commit_mu_, then
  // mu_), for tests that show what does not wait for planning.
  void RunWithTablesLockedForTest(const std::function<void()>& f)
      ABSL_LOCKS_EXCLUDED(mu_, commit_mu_);

  // How big the tables are, for tests that check they do not grow.
  struct TableSizes {
    size_t shards = 0;
    size_t jobs = 0;
    size_t job_names = 0;
    size_t progress_reports = 0;  // Per (job, shard) progress kept.
    size_t departed = 0;          // Per (job, shard) departed entries.
    CheckpointManager::TableSizes checkpoints;
  };
  TableSizes table_sizes();

  // Why a CreateJob or restore was refused with RESOURCE_EXHAUSTED.
  enum class JobRefusal {
    kQuota = 0,     // Over options.job_limits (chunks, tensors, bytes).
    kMapSize = 1,   // Its map would not fit a gRPC message.
    kCapacity = 2,  // The live shards' memory cannot hold it.
  };
  static constexpr int kNumJobRefusals = 3;
  // Counts since start, for metrics.
  struct Counters {
    uint64_t jobs_deleted = 0;      // By DeleteJob or replaced by a restore.
    uint64_t shards_forgotten = 0;  // By ForgetShard or the grace period.
    // Heartbeats answered from the lease table while planning held the
    // tables (lease renewed, report left for the next heartbeat).
    uint64_t heartbeats_deferred = 0;
    std::array<uint64_t, kNumJobRefusals> jobs_refused{};  // By JobRefusal.
    // CreateJob/restore placements planned off the lock and found stale
    // (shards or jobs changed meanwhile), and jobs then placed under it.
    uint64_t placement_retries = 0;
    uint64_t placements_under_lock = 0;
    // GetJobSerialized: maps (a shard's part, or the whole) cut and
    // serialized, and answers sent from bytes made by an earlier fetch of
    // the same (job, epoch, shard).
    uint64_t map_parts_serialized = 0;
    uint64_t map_parts_reused = 0;
    // Shards sent to fetch a part after a wait (Assignment.fetch_after_ms):
    // past options.map_fetches_per_s, their slot was later.
    uint64_t map_fetches_delayed = 0;
  };
  // How many times CreateJob plans a placement off the lock before it
  // plans one under it.
  static constexpr int kOffLockPlacements = 3;
  Counters counters();
  void CountRefusal(JobRefusal why) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // ---- Durable state (coordinator.cc) ----
  // Marks the durable state changed for the writer, which serializes it
  // (PullState) when it next writes: one write covers every change marked
  // before it (group commit). Returns the change's sequence number, 0 when
  // the state is not kept. O(1): never serializes, never waits for I/O.
  absl::StatusOr<uint64_t> SnapshotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The durable state (every shard, every job not being deleted),
  // serialized under mu_, with the newest change sequence number it holds.
  // Called by the writer's thread.
  absl::StatusOr<StateWriter::Pulled> PullState() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until snapshot `seq` is durable. Call with no lock but
  // commit_mu_ held; "saving coordinator state: ..." on failure.
  absl::Status WaitDurable(const absl::StatusOr<uint64_t>& seq) ABSL_LOCKS_EXCLUDED(mu_);
  // Queues a snapshot nobody waits for (the writer logs a failure).
  void SaveLaterLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- Shards (coordinator_shards.cc) ----
  // The shard-down listener: shards just marked DOWN are no longer waited
  // for as departed holders.
  void OnShardsDownLocked(const std::vector<uint64_t>& shard_ids)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops what jobs keep per shard for a shard that left the tables.
  void DropShardFromJobsLocked(uint64_t shard_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The time from which one more shard may fetch a map part:
  // options.map_fetches_per_s of them a second, and half a second's worth
  // at once after a quiet spell (a token bucket, kept as the time the next
  // slot frees up).
  absl::Time NextMapFetchSlotLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The serialized delta from epoch `from` to the snapshot's (DeltaOf),
  // made once and kept with the snapshot; null when none can be made.
  std::shared_ptr<const std::string> DeltaBytes(const MapSnapshot& snap, uint64_t from);
  absl::Time next_map_fetch_slot_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  // Heartbeat's work on the tables, after its lease was renewed.
  void HeartbeatLocked(const v1::HeartbeatRequest& req, v1::HeartbeatResponse* resp)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Returns true when the job turned READY.
  bool MaybeMarkReadyLocked(JobRecord& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records a shard's backups of `job` as in sync when its report says so
  // (once per shard and epoch).
  static void MarkSeeded(JobRecord& job, uint64_t shard_id, const v1::ShardJobProgress& p);
  // The tables' part of a sweep: marks DOWN in the registry the shards the
  // lease table marked DOWN since the last call, then (when it marked one,
  // or `check_jobs` says so) fails over or fails every live job holding
  // chunks on a DOWN shard, in the same step, so that the tables never
  // show a shard DOWN whose chunks still count. Returns how many it marked.
  // Needs commit_mu_: its save must not carry a change that is still
  // waiting to be durable and may be undone.
  int TakeDownShardsLocked(absl::Time now, bool check_jobs = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(commit_mu_, mu_);
  // Takes mu_ for a heartbeat (true), or gives up (false, not held) when
  // planning holds it or it stays taken for more than a moment. Never
  // sleeps: heartbeats run on gRPC's few callback threads.
  bool LockTablesForHeartbeat() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true, mu_)
      ABSL_NO_THREAD_SAFETY_ANALYSIS;  // Its body: a TryLock loop.
  // Marks mu_ as held by planning (which may take long) for its scope;
  // take it right after mu_.
  class Planning {
   public:
    explicit Planning(std::atomic<int>* n) : n_(n) { n_->fetch_add(1); }
    ~Planning() { n_->fetch_sub(1); }
    Planning(const Planning&) = delete;
    Planning& operator=(const Planning&) = delete;

   private:
    std::atomic<int>* const n_;
  };

  // ---- Jobs (coordinator_jobs.cc) ----
  absl::StatusOr<v1::CreateJobResponse> CreateJobInternal(const v1::CreateJobRequest& req,
                                                          const v1::RestoreSource* restore,
                                                          const Abandoned& abandoned = nullptr);
  // Removes a job whose deletion is durable, and everything kept for it.
  void FinishDeleteLocked(uint64_t job_id, const char* why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- Maps (coordinator_maps.cc) ----
  // Changes whenever something placement depends on changes (a shard comes,
  // goes or changes state; a job comes, goes, fails or changes its map):
  // a placement planned off the lock commits only if it did not change.
  uint64_t PlacementGenerationLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return shards_.generation() + jobs_.generation();
  }
  // Planned load per shard over jobs that are not FAILED (and their
  // unreleased chunks).
  std::map<uint64_t, ShardLoad> PlannedLoadLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // UP shards (not DRAINING or DOWN) as the placer sees them, with the
  // bytes planned on them by every job that has not failed.
  std::vector<ShardInfo> PlacementCandidatesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails over or fails every live job holding chunks on DOWN shards;
  // returns true when one changed.
  bool FailoverJobsLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The (shard registry, job table) generations at which FailoverJobsLocked
  // last found no job holding chunks on a DOWN shard: until either moves,
  // it has nothing to do.
  std::pair<uint64_t, uint64_t> failover_idle_at_ ABSL_GUARDED_BY(mu_){~uint64_t{0}, ~uint64_t{0}};
  // After job.map.chunks changed from `before`: epoch + 1, load, endpoints,
  // seeded flags' size, stale progress dropped, the shards whose parts
  // changed (RecordPartChanges); tells the checkpoint manager about the
  // new primaries. The caller saves and signals map_changed_.
  void CommitMapChangeLocked(JobRecord& job, const JobLayout& before)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // map.shards from job.load (every shard holding a primary or a backup).
  void SetEndpointsLocked(JobRecord& job) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  // ---- Checkpoints, status ----
  CheckpointJobView ViewLocked(const JobRecord& job) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::ShardStatus ShardStatusLocked(const ShardRecord& shard,
                                    const std::map<uint64_t, ShardLoad>& planned,
                                    absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const CoordinatorOptions options_;
  // Where the durable state goes (null: memory only), and its writer.
  // Declared before the writer, which borrows it.
  std::shared_ptr<StateStore> store_;
  std::unique_ptr<StateWriter> writer_;

  absl::Mutex commit_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::Mutex mu_ ABSL_ACQUIRED_AFTER(commit_mu_);
  // Its lock is taken after mu_ (it never calls back).
  CheckpointManager checkpoints_;
  // Signalled when a map epoch changes, a job fails or is deleted, or on
  // shutdown.
  absl::CondVar map_changed_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  std::string data_plane_key_ ABSL_GUARDED_BY(mu_);  // Empty: plain text.
  ShardRegistry shards_ ABSL_GUARDED_BY(mu_);
  JobTable jobs_ ABSL_GUARDED_BY(mu_);
  Counters counters_ ABSL_GUARDED_BY(mu_);
  // Thread-safe on its own, with a lock taken after mu_.
  LeaseTable leases_;
  std::atomic<uint64_t> heartbeats_deferred_{0};
  // Counters::map_parts_serialized / _reused; counted with no lock held.
  std::atomic<uint64_t> map_parts_serialized_{0};
  std::atomic<uint64_t> map_parts_reused_{0};
  // Holders of mu_ that are planning (Planning scopes): a heartbeat that
  // finds mu_ taken by one does not wait for it.
  std::atomic<int> planning_{0};
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_COORDINATOR_CORE_H_
