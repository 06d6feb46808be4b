// An in-process optimus cluster for integration tests, fault tests and
// benchmarks: a real coordinator (gRPC on 127.0.0.1), S real shard servers
// and W worker clients in this process, with the data plane over the
// in-process loopback transport or over UCX on `lo` (a parameter), and the
// one synthetic training loop (pull, gradient, push) everything runs, with
// its single-process reference to compare results bit for bit.
//
// Ownership: a Cluster owns its coordinator, shards, workers and (for
// loopback) the transport fabric; pointers it hands out are borrowed and
// valid until it is destroyed (a worker's, until the next ConnectWorkers /
// CreateJob / JoinJob replaces the workers). Failures come back as
// absl::Status; nothing here asserts, so benchmarks use it as tests do.
// Thread-safety: not thread-safe, except Train (which runs W threads inside)
// and RunWorker for different ranks at once; one test or benchmark owns it.
#ifndef OPTIMUS_TESTS_HARNESS_CLUSTER_H_
#define OPTIMUS_TESTS_HARNESS_CLUSTER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "common/security.h"
#include "coordinator/coordinator.h"
#include "proto/optimus.grpc.pb.h"
#include "server/shard_server.h"
#include "transport/loopback.h"
#include "transport/transport.h"

namespace optimus {
namespace harness {

// Which data plane the cluster's shards and workers use.
enum class TransportKind {
  kLoopback,  // transport/loopback.h: one fabric per Cluster.
  kUcx,       // UCX on the loopback device "lo", default transports.
};
// "loopback" or "ucx" (for test names and logs).
std::string TransportName(TransportKind kind);

// ---- The synthetic training every harness user runs ----------------------
// Element i of tensor t starts at InitialValue(t, i); worker `rank` at `step`
// computes the gradient Gradient(p, step, rank, t, i) from the parameter p it
// pulled. Deterministic, so every run of the same job gives the same bits.
float InitialValue(uint32_t tensor, size_t i);
float Gradient(float param, uint64_t step, uint32_t rank, uint32_t tensor, size_t i);

// The same training in one process with the scalar reference kernel
// (kernels::FusedStepScalar) over whole tensors: tensor `tensor`'s published
// parameters, as fp32, after steps 1..steps (version steps+1). The cluster's
// result must equal it bit for bit whatever the chunking, placement and
// thread counts (summation order is fixed, kernels are elementwise).
// Optimizer fields left 0 take the kind's defaults (kernels/optimizer_spec.h)
// as the coordinator fills them. INVALID_ARGUMENT for a bad job definition.
absl::StatusOr<std::vector<float>> ReferenceParams(const client::JobDef& def, uint32_t tensor,
                                                   uint64_t steps);

// Elements of `got` that differ from `want` in any bit (so NaNs, and -0
// against +0, count too), or SIZE_MAX when the sizes differ: how a test
// says a cluster's parameters are ReferenceParams' bit for bit.
size_t BitMismatches(const std::vector<float>& got, const std::vector<float>& want);

// A small AdamW job (tensors "weight" 200x257 and "bias" 37, bf16 gradients
// and parameters, lr 1e-2, weight decay 0.1) cut into max_chunk_bytes
// chunks (64 KiB: 16384 elements, so both tensors spread over the shards).
client::JobDef SmallJob(const std::string& name, uint32_t world_size,
                        uint64_t max_chunk_bytes = 64 * 1024);

// A fresh folder under $TEST_TMPDIR (or /tmp). INTERNAL if mkdtemp fails.
absl::StatusOr<std::string> NewTempDir(absl::string_view prefix = "cluster");

// A CA and certificates for `shards` shards under a fresh temporary folder
// (scripts/make_local_ca.sh, found through the test's runfiles); returns
// the folder, for ClusterOptions.tls_root.
absl::StatusOr<std::string> MakeTestCa(int shards);

// A port on 127.0.0.1 below the ephemeral range that nothing is bound to
// now (for an address a process will listen on later). INTERNAL if none.
absl::StatusOr<int> FreePortBelowEphemeral();

// This process's resident memory in bytes (/proc/self/statm; 0 if unreadable).
uint64_t ResidentBytes();

struct ClusterOptions {
  TransportKind transport = TransportKind::kLoopback;
  // Shard servers started with the cluster (more with AddShard). Default 2.
  int num_shards = 2;
  // Worker clients, ranks 0..W-1; jobs are created with world size W.
  // Default 2.
  uint32_t num_workers = 2;
  // Each shard's state budget. Default 256 MiB.
  uint64_t shard_memory_limit_bytes = uint64_t{256} << 20;
  // Threads each shard splits one chunk's step over. Default 1.
  int kernel_threads = 1;
  // Each shard's step threads (0: one per core) and staging pool for
  // gradients in flight (0: an eighth of its budget). Default 0 and 0.
  int step_threads = 0;
  uint64_t staging_bytes = 0;
  // Shards' heartbeat period and the coordinator's lease and sweep period:
  // short, so that jobs get READY and dead shards are noticed quickly
  // (a dead shard is DOWN after lease + sweep_interval).
  absl::Duration heartbeat_interval = absl::Milliseconds(50);
  absl::Duration lease = absl::Seconds(2);
  absl::Duration sweep_interval = absl::Milliseconds(50);
  // The coordinator's and every shard's checkpoint folder (a shared
  // filesystem in production). Empty: checkpoints off. Default empty.
  std::string checkpoint_dir;
  // Shards' checkpoint writer limit, bytes/s; 0 for none. Default 0.
  uint64_t checkpoint_max_bytes_per_second = 0;
  // Coordinator and shards serve /metrics and /healthz on 127.0.0.1:0.
  // Default off.
  bool serve_metrics = false;
  // The coordinator's durable state folder (StopCoordinator /
  // RestartCoordinator need one to come back knowing the jobs). Empty: none.
  std::string state_dir;
  // A standby's address besides the coordinator's: a port on 127.0.0.1
  // where nothing listens at first, dialled as "localhost:PORT" (a DNS
  // name, which TLS then checks against the certificate's DNS:localhost).
  // Shards and workers are given both, the standby first
  // ("localhost:B,127.0.0.1:A": coordinator_address()), so that their
  // first calls find nobody there. MoveCoordinator then stops the
  // coordinator and starts one at the other address over the same
  // state_dir: what a standby's takeover (state in etcd) looks like to
  // shards and workers. Default off.
  bool standby_address = false;
  // TLS: a folder made by scripts/make_local_ca.sh (MakeTestCa): the
  // coordinator serves with coordinator/, shard i presents shard-<i>/,
  // workers trainer/ with job_token, and stub() admin/. Empty: plain text
  // (no authentication), asked for explicitly. Default empty.
  std::string tls_root;
  // The token workers create and join jobs with (TLS); empty: a fresh one.
  std::string job_token;
  // The coordinator's job quotas (chunks, tensors, bytes per job).
  JobLimits job_limits;
  // The coordinator's bound on map reads served at once (0: its default),
  // and its test hook run by each map read that holds a slot
  // (CoordinatorOptions::while_reading_map).
  int max_concurrent_map_reads = 0;
  // Map reads that may wait for one of those (-1: the coordinator's default).
  int max_queued_map_reads = -1;
  std::function<void()> while_reading_map;
  // Each shard's bounds on pulls waiting or being sent (per peer, in all;
  // 0: the shard's default).
  uint64_t max_parked_pulls_per_peer = 0;
  uint64_t max_parked_pulls = 0;
  // Each shard's data-plane peer limit (transport::WorkerOptions::max_peers;
  // 0: its default).
  size_t max_peers = 0;
  // The loopback fabric's settings (loopback only).
  transport::LoopbackOptions loopback;
  // How long one harness call waits for something (a pull, a push, a state
  // the coordinator should reach) before failing with DEADLINE_EXCEEDED.
  // Default 30 s: generous, so a loaded machine never fails a test.
  absl::Duration wait = absl::Seconds(30);
  // Makes worker r's data-plane worker (ClientOptions::make_worker), e.g.
  // to wrap the real one; unset: the transport's own.
  std::function<absl::StatusOr<std::unique_ptr<transport::Worker>>(
      uint32_t rank, const transport::WorkerOptions&)>
      make_worker;
};

class Cluster {
 public:
  // Starts the coordinator and options.num_shards shards (no workers yet:
  // ConnectWorkers, CreateJob or JoinJob make them). Fails with the first
  // component's error.
  static absl::StatusOr<std::unique_ptr<Cluster>> Start(const ClusterOptions& options);
  // Stops workers, then shards, then the coordinator.
  ~Cluster();
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;

  const ClusterOptions& options() const { return options_; }

  // Data-plane options for one more participant of this cluster's transport
  // (e.g. a test's raw peer that sends hand-made requests to a shard).
  transport::WorkerOptions TransportOptions(const std::string& name) const;
  // The loopback fabric; null over UCX.
  const std::shared_ptr<transport::LoopbackFabric>& fabric() const { return fabric_; }

  // ---- Coordinator ----
  CoordinatorServer* coordinator() { return coord_.get(); }
  // What shards and workers are given: the coordinator's address, or with
  // standby_address both addresses (see there).
  std::string coordinator_address() const { return coord_targets_; }
  // The address the coordinator listens on now ("127.0.0.1:PORT").
  std::string listening_address() const { return coord_address_; }
  // A gRPC stub to the coordinator that listens now (it moves with
  // MoveCoordinator), for RPCs without a helper below.
  v1::Coordinator::Stub* stub() { return stub_.get(); }
  absl::StatusOr<v1::StatusResponse> Status();

  // A coordinator outage: StopCoordinator shuts the coordinator down (the
  // shards and workers keep running and keep their state);
  // RestartCoordinator starts a new one on the same address over the same
  // state_dir. FAILED_PRECONDITION without a state_dir, or when not stopped.
  absl::Status StopCoordinator();
  absl::Status RestartCoordinator();
  // With standby_address: stops the coordinator (if it runs) and starts a
  // new one at the other address over the same state_dir.
  // FAILED_PRECONDITION without standby_address or state_dir.
  absl::Status MoveCoordinator();

  // ---- Shards ----
  // Starts one more shard; returns its index.
  absl::StatusOr<size_t> AddShard();
  size_t num_shards() const { return shards_.size(); }
  // Borrowed; stays valid (and its stats() readable) after KillShard. Null
  // for an index >= num_shards().
  server::ShardServer* shard(size_t i) {
    return i < shards_.size() ? shards_[i].get() : nullptr;
  }
  // Stops shard i as if its machine died: no more heartbeats or replies,
  // its data-plane worker is destroyed (peers see it fail); the coordinator
  // marks it DOWN after the lease. Idempotent. OUT_OF_RANGE for a bad index.
  absl::Status KillShard(size_t i);
  // Every shard's stats(), by index (killed ones included).
  std::vector<server::ShardServerStats> ShardStats() const;
  // memory_used_bytes of every shard, by index.
  std::vector<uint64_t> ShardMemoryUsed() const;
  // Marks shard i DRAINING: the coordinator moves its chunks elsewhere
  // while training runs.
  absl::StatusOr<v1::DrainShardResponse> DrainShard(size_t i);
  // The index (for shard(i)) of the shard holding chunk `chunk` (its index
  // in the map) of the joined job as primary, by the coordinator's map now.
  absl::StatusOr<size_t> PrimaryOf(int chunk);

  // ---- Workers and jobs ----
  // Replaces the workers with W new clients (not joined to any job).
  absl::Status ConnectWorkers();
  uint32_t num_workers() const { return options_.num_workers; }
  // Borrowed until the workers are replaced. Null for a rank without a
  // worker (none connected yet, or rank >= num_workers()).
  client::Client* worker(uint32_t rank) {
    return rank < workers_.size() ? workers_[rank].get() : nullptr;
  }
  // New workers; rank 0 creates the job (world size W), every rank joins
  // (waiting until the shards are READY), and rank 0 sends the initial
  // values (InitialValue) of every tensor: version 1.
  absl::Status CreateJob(const client::JobDef& def);
  // New workers join an existing job (one restored from a checkpoint, or
  // rolled back after a shard was lost): no initial values; resume at
  // worker(r)->resume_step().
  absl::Status JoinJob(const std::string& name);
  // The job the workers joined last (CreateJob / JoinJob); empty if none.
  const std::string& joined_job() const { return joined_job_; }
  // Every rank leaves the joined job (LeaveJob RPC), so that it can be
  // deleted without force.
  absl::Status LeaveJob();
  // Ends a job (DeleteJob RPC): the shards free its memory at their next
  // heartbeat. The workers stay connected but must not use the job again.
  absl::StatusOr<v1::DeleteJobResponse> DeleteJob(const std::string& name, bool force = false);

  // Every worker runs steps first..last (inclusive) of the joined job, in
  // parallel: pull version `step` of each tensor, compute Gradient, push
  // step `step`. `rank0_step_done`, if set, gets the time rank 0 finished
  // each step. The first error of any rank, naming it.
  absl::Status Train(uint64_t first_step, uint64_t last_step,
                     std::vector<absl::Time>* rank0_step_done = nullptr);
  // One rank's part of Train, for tests that run ranks apart.
  absl::Status RunWorker(uint32_t rank, uint64_t first_step, uint64_t last_step,
                         std::vector<absl::Time>* step_done = nullptr);
  // Tensor t at `version`, through worker `rank`: raw param-dtype bytes, or
  // converted to fp32.
  absl::StatusOr<std::vector<uint8_t>> Pull(uint32_t tensor, uint64_t version,
                                            uint32_t rank = 0);
  absl::StatusOr<std::vector<float>> PullFp32(uint32_t tensor, uint64_t version,
                                              uint32_t rank = 0);
  // Rank `rank`'s gradient for tensor t at `step` from the fp32 parameters
  // it pulled, in the job's grad dtype (what RunWorker pushes). Empty for a
  // rank without a worker.
  std::vector<uint8_t> GradientBytes(uint32_t rank, uint32_t tensor,
                                     const std::vector<float>& params, uint64_t step);

  // ---- Checkpoints (the coordinator's RPCs) ----
  absl::StatusOr<v1::CheckpointInfo> CreateCheckpoint(const std::string& job);
  absl::StatusOr<std::vector<v1::CheckpointInfo>> ListCheckpoints(const std::string& job);
  // Waits until checkpoint `id` of `job` (or the retry that replaced it, if
  // a shard had passed its step: a larger id) is no longer IN_PROGRESS and
  // returns it (COMPLETE or FAILED). DEADLINE_EXCEEDED after `timeout`
  // (default options().wait).
  absl::StatusOr<v1::CheckpointInfo> WaitCheckpoint(const std::string& job, uint64_t id,
                                                    absl::Duration timeout = absl::ZeroDuration());
  absl::StatusOr<v1::RestoreCheckpointResponse> RestoreCheckpoint(
      const std::string& job, uint64_t id, const std::string& new_name,
      uint64_t max_chunk_bytes = 0);

  // ---- Waiting for the control plane ----
  // Until the coordinator has seen every shard of `job` at >= step applied
  // (heartbeats lag the data plane).
  absl::Status WaitApplied(const std::string& job, uint64_t step);
  // Until `done()` holds, polling every 10 ms; DEADLINE_EXCEEDED naming
  // `what` after `timeout` (default options().wait).
  absl::Status WaitUntil(absl::string_view what, const std::function<bool()>& done,
                         absl::Duration timeout = absl::ZeroDuration());
  // Until the coordinator's status satisfies `pred` (e.g. a job READY under
  // a new id, a shard DOWN).
  absl::Status WaitStatus(absl::string_view what,
                          const std::function<bool(const v1::StatusResponse&)>& pred,
                          absl::Duration timeout = absl::ZeroDuration());

 private:
  explicit Cluster(const ClusterOptions& options);
  absl::Status JoinAll(const std::string& name);
  absl::Status StartCoordinator(const std::string& address);

  const ClusterOptions options_;
  std::shared_ptr<transport::LoopbackFabric> fabric_;  // Loopback only.
  std::unique_ptr<CoordinatorServer> coord_;
  std::string coord_address_;  // Kept across StopCoordinator.
  std::string coord_targets_;  // coordinator_address().
  // With standby_address: where each of the two coordinators listens.
  std::string first_address_, standby_listen_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  // TLS options for the folder `who` of options_.tls_root (plain text
  // without one).
  security::TlsOptions TlsFor(const std::string& who) const;
  std::vector<std::unique_ptr<server::ShardServer>> shards_;
  std::vector<std::unique_ptr<client::Client>> workers_;
  std::string joined_job_;
  // Each rank's last push per tensor: a push buffer must stay unchanged
  // until the next version of its tensor is pulled (the client resends it
  // after a failover).
  std::vector<std::vector<std::vector<uint8_t>>> last_push_;
};

}  // namespace harness
}  // namespace optimus

#endif  // OPTIMUS_TESTS_HARNESS_CLUSTER_H_
