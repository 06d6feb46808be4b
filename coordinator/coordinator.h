// optimus-coord's service: shard membership with leases, jobs and their
// shard maps, and cluster status. `Coordinator` is the core (plain methods,
// absl::Status errors, one absl::Mutex, safe from any thread);
// `CoordinatorServer` is a handle that owns a core, a gRPC server and the
// lease sweeper, and stops them all in Shutdown() or its destructor.
#ifndef OPTIMUS_COORDINATOR_COORDINATOR_H_
#define OPTIMUS_COORDINATOR_COORDINATOR_H_

#include <cstdint>
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
  // A shard with no heartbeat for this long is marked DOWN and the jobs that
  // hold chunks on it fail. Shorter detects failures sooner but costs more
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
  // progress; a PENDING job turns READY once every shard owning its chunks
  // reports the current epoch with all its chunks loaded. An unknown or DOWN
  // shard gets known=false and must register again (under a new id).
  v1::HeartbeatResponse Heartbeat(const v1::HeartbeatRequest& req);

  // Validates the spec (INVALID_ARGUMENT, or ALREADY_EXISTS for a taken name),
  // fills defaults, places the chunks over UP shards (FAILED_PRECONDITION
  // without shards, RESOURCE_EXHAUSTED when it does not fit) and returns the
  // new job's id and map (epoch 1). The job starts PENDING.
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

  // Marks DOWN every UP shard whose last heartbeat is older than the lease
  // at `now`, and fails the PENDING/READY jobs holding chunks on it.
  // Returns the number of shards marked DOWN. Called by the sweeper thread.
  int SweepExpiredLeases(absl::Time now);

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
  };
  struct ShardLoad {
    uint32_t num_chunks = 0;
    uint64_t size_bytes = 0;
  };
  struct JobRecord {
    uint64_t id = 0;
    v1::JobSpec spec;  // Defaults filled.
    v1::JobState state = v1::JOB_STATE_PENDING;
    uint64_t num_params = 0;
    uint64_t bytes_per_elem = 0;
    v1::ShardMap map;                     // Current map, map.epoch() is the epoch.
    std::map<uint64_t, ShardLoad> load;   // Planned, by shard id.
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

  // Planned load per shard over jobs that are not FAILED.
  std::map<uint64_t, ShardLoad> PlannedLoadLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<v1::CreateJobResponse> CreateJobInternal(const v1::CreateJobRequest& req,
                                                          const v1::RestoreSource* restore);
  CheckpointJobView ViewLocked(const JobRecord& job) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeMarkReadyLocked(JobRecord& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

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
