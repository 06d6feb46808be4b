// optimus-coord's service: shard membership with leases, jobs and their
// shard maps, and cluster status. `Coordinator` is the core (plain methods,
// absl::Status errors, one absl::Mutex, safe from any thread);
// `CoordinatorServer` is a handle that owns a core, a gRPC server and the
// lease sweeper, and stops them all in Shutdown() or its destructor.
#ifndef OPTIMUS_COORDINATOR_COORDINATOR_H_
#define OPTIMUS_COORDINATOR_COORDINATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "common/http_server.h"
#include "coordinator/checkpoints.h"
#include "coordinator/shard_map.h"
#include "proto/optimus.pb.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace optimus {

struct CoordinatorOptions {
  // gRPC listen address, "HOST:PORT". Port 0 picks a free port (read it back
  // with CoordinatorServer::port()). Default: loopback only.
  std::string listen_address = "127.0.0.1:0";
  // A shard with no heartbeat for this long is marked DOWN; the jobs that
  // hold chunks on it fail over to their backups (replication 1) or fail.
  // Shorter detects failures sooner but costs more
  // heartbeats (shards are told to beat every lease/3). Default 2 s.
  absl::Duration lease = absl::Seconds(2);
  // How often the sweeper checks leases; a dead shard is noticed within
  // lease + sweep_interval. Default 200 ms.
  absl::Duration sweep_interval = absl::Milliseconds(200);
  // "HOST:PORT" for the HTTP /metrics (Prometheus) and /healthz endpoints;
  // port 0 picks one; empty turns them off. Default off.
  std::string metrics_address;
  // Folder for checkpoints (dir/<job name>/ckpt-<id>/), on a filesystem the
  // shards share (their --checkpoint_dir). The coordinator writes each
  // manifest there, prunes old checkpoints and verifies one before a
  // restore. Empty: checkpoints are off. Default empty.
  std::string checkpoint_dir;
  // When a shard holding chunks of a job is lost (no replica), restore the
  // job from its newest complete checkpoint onto the live shards, under the
  // same name: its workers re-join and resume at the checkpoint's step (the
  // steps since are redone). Needs checkpoint_dir. Default on.
  bool rollback_on_shard_loss = true;
  // Folder for the durable state (shards, jobs, maps), rewritten with fsync
  // and an atomic rename on every membership or job change (not on
  // heartbeats), and loaded at start, so a restarted coordinator loses
  // nothing. Empty: state lives in memory only. Default empty.
  std::string state_dir;
  // The clock for leases and lease ages; empty means absl::Now. Tests set a
  // fake one to expire one shard's lease and not another's.
  std::function<absl::Time()> clock;
};

// Most chunks one job may have: its whole map travels in one gRPC message
// (~25 bytes per chunk), which must stay well under the 64 MiB the server
// allows. A larger model needs a larger max_chunk_bytes.
inline constexpr uint64_t kMaxChunksPerJob = uint64_t{1} << 20;

// The coordinator's state machine. Request and response types are the
// control-plane contract of proto/optimus.proto: this class *is* the RPC
// layer's logic, so proto types stop here; the placement math below it
// (shard_map.h) takes plain structs. Every method is thread-safe.
class Coordinator {
 public:
  explicit Coordinator(const CoordinatorOptions& options);
  Coordinator(const Coordinator&) = delete;

  // Loads options.state_dir's state, if the folder holds one (a missing file
  // is a fresh start). Shards that were UP get a fresh lease from now: they
  // keep running while the coordinator is away and heartbeat again when it
  // is back. DATA_LOSS naming the file when it is corrupted; nothing is
  // loaded then. Call once, before serving.
  absl::Status Recover();
  Coordinator& operator=(const Coordinator&) = delete;

  // Assigns a new shard id (1, 2, ...; never reused), state UP.
  // INVALID_ARGUMENT unless memory_limit_bytes > 0, kind is DPU or HOST and
  // data_address is non-empty.
  absl::StatusOr<v1::RegisterShardResponse> RegisterShard(const v1::RegisterShardRequest& req);

  // Renews the lease and records the shard's reported usage and per-job
  // progress; a PENDING job turns READY once every shard holding its chunks
  // (as primary or backup) reports the current epoch with all its chunks
  // loaded. A shard that reports, at the current epoch, every one of its
  // backup chunks of a job seeded (backups_seeded == backup_chunks, both
  // equal to its backup count in the map) has those chunks' backups marked
  // in sync: they may be promoted. A shard whose chunks of a job all moved
  // away is assigned the job again once every remaining holder has loaded
  // the new map, until it reports that map too (so it retires what moved
  // away); until then they count in its chunks_owned. UP and DRAINING
  // shards are served; an
  // unknown or DOWN shard gets known=false and must register again (under a
  // new id).
  v1::HeartbeatResponse Heartbeat(const v1::HeartbeatRequest& req);

  // Validates the spec (INVALID_ARGUMENT, or ALREADY_EXISTS for a taken name;
  // replication must be 0 or 1), fills defaults, places the chunks over UP
  // shards (not DRAINING ones) and, with replication 1, a backup of each on
  // another shard (FAILED_PRECONDITION without shards or, for replication 1,
  // with fewer than 2; RESOURCE_EXHAUSTED when it does not fit, backups
  // included) and returns the new job's id and map (epoch 1). The job starts
  // PENDING.
  absl::StatusOr<v1::CreateJobResponse> CreateJob(const v1::CreateJobRequest& req);

  // Records `rank` as joined (idempotent). NOT_FOUND for an unknown job;
  // INVALID_ARGUMENT when world_size differs from the job's or rank >= it.
  absl::StatusOr<v1::JoinJobResponse> JoinJob(const v1::JoinJobRequest& req);

  // NOT_FOUND for an unknown job.
  absl::StatusOr<v1::GetJobResponse> GetJob(uint64_t job_id);
  absl::StatusOr<v1::ShardMap> GetShardMap(uint64_t job_id);

  // Waits up to `timeout` for the job's map to have an epoch > after_epoch
  // and returns it; std::nullopt when the wait timed out. NOT_FOUND for an
  // unknown job, FAILED_PRECONDITION once the job has FAILED (after its
  // current map was delivered), UNAVAILABLE after BeginShutdown().
  absl::StatusOr<std::optional<v1::ShardMap>> WaitForShardMap(uint64_t job_id,
                                                              uint64_t after_epoch,
                                                              absl::Duration timeout);

  v1::StatusResponse Status();

  // ---- Checkpoints (see coordinator/checkpoints.h) ----
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
  // refused (ALREADY_EXISTS) unless it has FAILED, whose name it takes over.
  absl::StatusOr<v1::RestoreCheckpointResponse> RestoreCheckpoint(
      const v1::RestoreCheckpointRequest& req);
  // Sets each job's last_checkpoint (reads the checkpoint folders).
  void FillLastCheckpoints(v1::StatusResponse* status);
  // Runs checkpoint policies and retries; called by the sweeper.
  void TickCheckpoints(absl::Time now);
  // With options.rollback_on_shard_loss: restores each job that FAILED (a
  // shard holding its chunks was lost, no replica) from its newest complete
  // checkpoint, under the same name, onto the live shards. Tried once per
  // failed job; returns how many were restored. Called by the sweeper.
  int RollbackFailedJobs();

  // Marks DOWN every UP or DRAINING shard whose last heartbeat is older
  // than the lease at `now`, then, for each PENDING/READY job holding chunks
  // on a DOWN shard:
  //  - if every chunk whose primary is DOWN has a backup on an UP or
  //    DRAINING shard that is in sync (see Heartbeat), fails over: those
  //    backups become the primaries, chunks whose backup was lost drop it,
  //    and (replication 1) each chunk left without a backup gets one on a
  //    live, not DRAINING shard other than its primary where it fits (none:
  //    the chunk stays without one until TickReplication finds room). The
  //    epoch goes up by exactly one and the job keeps its state.
  //  - otherwise the job FAILS (RollbackFailedJobs may then restore it).
  // A lost backup alone never fails a job. Returns the number of shards
  // marked DOWN. Called by the sweeper thread.
  int SweepExpiredLeases(absl::Time now);

  // Moves chunks of PENDING/READY jobs, at most one epoch bump per job per
  // call (all of its changes at once):
  //  - a chunk whose primary is DRAINING: its in-sync backup is promoted
  //    (replication 1: and a new backup picked); without a backup it gets a
  //    temporary one, which the primary seeds at its next step and a later
  //    call promotes once the backup shard reports it in sync;
  //  - a chunk whose backup is on a DRAINING shard gets a new backup
  //    elsewhere (replication 0: just drops it unless its primary drains too);
  //  - replication 1: a chunk without a backup gets one where it fits (a
  //    replacement shard registered, memory freed).
  // New copies go only to UP shards with room (PickShard's rule). Logs
  // "shard N drained" once a DRAINING shard holds no chunk. Returns the
  // number of jobs whose map changed. Called by the sweeper thread.
  int TickReplication(absl::Time now);

  // Marks the shard DRAINING (durable) so that TickReplication moves its
  // chunks away while training runs; returns it with the number of chunks
  // it held. Refuses, changing nothing: NOT_FOUND for an unknown shard,
  // FAILED_PRECONDITION for a DOWN one or when some chunk it holds fits on
  // no other UP shard (with the numbers). Idempotent for a DRAINING shard.
  absl::StatusOr<v1::DrainShardResponse> DrainShard(const v1::DrainShardRequest& req);

  // The clock of options.clock (absl::Now by default).
  absl::Time Now() const;

  // Wakes every WaitForShardMap, which then returns UNAVAILABLE.
  void BeginShutdown();

 private:
  struct ShardRecord {
    uint64_t id = 0;
    v1::ShardCapabilities capabilities;
    v1::ShardState state = v1::SHARD_STATE_UP;
    absl::Time last_heartbeat;
    uint64_t memory_used_bytes = 0;  // As reported.
    uint32_t chunks_reported = 0;    // As reported.
    // DRAINING: chunks it held when the drain began (volatile), and whether
    // "drained" was logged.
    uint32_t drain_chunks_at_start = 0;
    bool drained_logged = false;
  };
  struct ShardLoad {
    uint32_t num_chunks = 0;     // As primary or backup.
    uint32_t backup_chunks = 0;  // Of num_chunks, as backup.
    uint64_t size_bytes = 0;     // A backup costs as much as a primary.
    // PlannedLoadLocked only: chunks that a map moved away, which the shard
    // has not released yet (JobRecord::departed); not in num_chunks.
    uint32_t unreleased_chunks = 0;
  };
  struct JobRecord {
    uint64_t id = 0;
    v1::JobSpec spec;  // Defaults filled.
    v1::JobState state = v1::JOB_STATE_PENDING;
    uint64_t num_params = 0;
    uint64_t bytes_per_elem = 0;
    v1::ShardMap map;                     // Current map, map.epoch() is the epoch.
    // Planned, by shard id, over primaries and backups (from map; see
    // ComputeLoad).
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
    uint64_t resume_step = 1;             // Step workers start at (restored jobs: S).
    std::optional<v1::RestoreSource> restore;
    bool rollback_tried = false;
  };

  // Writes the durable state when options_.state_dir is set. On failure (a
  // full disk, say) the file on disk keeps the previous state.
  absl::Status PersistLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string StatePath() const;

  // Planned load per shard over jobs that are not FAILED (and their
  // unreleased chunks).
  std::map<uint64_t, ShardLoad> PlannedLoadLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<v1::CreateJobResponse> CreateJobInternal(const v1::CreateJobRequest& req,
                                                          const v1::RestoreSource* restore);
  CheckpointJobView ViewLocked(const JobRecord& job) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeMarkReadyLocked(JobRecord& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every shard holding chunks of `job` reported its current epoch loaded.
  static bool AllHoldersAtCurrentEpoch(const JobRecord& job);
  // Records a shard's backups of `job` as in sync when its report says so.
  void MarkSeededLocked(JobRecord& job, uint64_t shard_id, const v1::ShardJobProgress& p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // UP shards (not DRAINING or DOWN) as the placer sees them, with the
  // bytes planned on them by every job that has not failed.
  std::vector<ShardInfo> PlacementCandidatesLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Picks a shard for one more copy of chunk `index` of `job` (other than
  // exclude_id) among `candidates` and counts its bytes there; 0 if none fits.
  static uint64_t TakeSlot(const JobRecord& job, int index, uint64_t exclude_id,
                           std::vector<ShardInfo>& candidates);
  // After job.map.chunks changed: epoch + 1, load, endpoints, seeded flags'
  // size, stale progress dropped; tells the checkpoint manager about the
  // new primaries. The caller persists and signals map_changed_.
  void CommitMapChangeLocked(JobRecord& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Fails over or fails `job` when it holds chunks on DOWN shards; returns
  // true when it changed.
  bool FailoverLocked(JobRecord& job, std::vector<ShardInfo>& candidates)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // map.shards from job.load (every shard holding a primary or a backup).
  void SetEndpointsLocked(JobRecord& job) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::ShardStatus ShardStatusLocked(const ShardRecord& shard,
                                    const std::map<uint64_t, ShardLoad>& planned,
                                    absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Load by shard over a map's primaries and backups.
  static std::map<uint64_t, ShardLoad> ComputeLoad(const v1::ShardMap& map,
                                                   uint64_t bytes_per_elem);

  const CoordinatorOptions options_;
  absl::Mutex mu_;
  // Locked after mu_ when both are needed.
  CheckpointManager checkpoints_;
  // Signalled when a map epoch changes, a job fails, or on shutdown.
  absl::CondVar map_changed_;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t next_shard_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_job_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, ShardRecord> shards_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, JobRecord> jobs_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> job_ids_by_name_ ABSL_GUARDED_BY(mu_);
};

// A running coordinator: the core, its gRPC server and the lease sweeper.
// Start() either returns a serving handle or an error; Shutdown() (or the
// destructor) ends open WatchShardMap streams, stops the server and the
// sweeper, and may be called from any thread, more than once.
class CoordinatorServer {
 public:
  // UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(const CoordinatorOptions& options);
  ~CoordinatorServer();
  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;

  // The bound port (never 0).
  int port() const { return port_; }
  // "HOST:PORT" to dial: the listen host with the bound port; a wildcard
  // host (0.0.0.0, [::], *) becomes 127.0.0.1.
  std::string address() const;
  // Borrowed; valid until this handle is destroyed.
  Coordinator* core() { return core_.get(); }
  // The /metrics and /healthz port, or 0 when they are off.
  int metrics_port() const;
  // The Prometheus text that /metrics serves.
  std::string RenderMetrics() const;

  void Shutdown();

 private:
  class Service;
  CoordinatorServer() = default;

  std::unique_ptr<Coordinator> core_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<HttpServer> http_;
  std::string host_;
  int port_ = 0;
  absl::Notification stop_sweeper_;
  std::thread sweeper_;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_COORDINATOR_H_
