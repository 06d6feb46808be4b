// The shard server's internal class, declared once and implemented one
// concern per file:
//   shard_server.cc   wiring: what it owns, the start and stop order
//   requests.cc       data-plane requests from workers: parse, validate,
//                     dispatch to the chunk, reply, send pulled versions
//   steps.cc          carrying out a chunk's actions; step threads running
//                     the kernels (primary steps, backups' forwarded steps)
//   replication.cc    primary side (forward sums and seeds, their answers)
//                     and backup side (take sums and seeds, fencing)
//   control.cc        the coordinator link's heartbeat loop: assignments,
//                     loading jobs and applying maps, released jobs
//   checkpointing.cc  checkpoint orders, snapshot copies, restores
// The chunk's protocol itself is server/chunk.h (no I/O); the tables and
// buffers are server/job_table.h; counters are server/shard_metrics.h.
//
// Threads: the transport's progress thread (requests, replies, send
// completions), step threads (StepExecutor), the kernel pool, the
// heartbeat thread, the checkpoint writer, the metrics HTTP thread.
// Locks: JobTable, Job and Chunk mutexes (job_table.h's order); peers_mu_,
// fwd_mu_, exec_mu_ and stop_mu_ are leaves (nothing else is taken while
// one is held).
#ifndef OPTIMUS_SERVER_SHARD_H_
#define OPTIMUS_SERVER_SHARD_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "common/http_server.h"
#include "common/wire.h"
#include "kernels/cpu/thread_pool.h"
#include "server/checkpoint_writer.h"
#include "server/chunk.h"
#include "server/coordinator_link.h"
#include "server/domain.h"
#include "server/job_table.h"
#include "server/peer_limits.h"
#include "server/shard_metrics.h"
#include "server/shard_server.h"
#include "server/staging.h"
#include "server/step_executor.h"
#include "transport/transport.h"

namespace optimus {
namespace server {

using JobRef = std::shared_ptr<Job>;
using ChunkRef = std::shared_ptr<Chunk>;

class Shard : public ShardServer {
 public:
  Shard(const ShardServerOptions& options, std::unique_ptr<CoordinatorLink> link);
  ~Shard() override;

  // ---- shard_server.cc: wiring, start and stop ----
  absl::Status Start();
  void Shutdown() override;
  uint64_t shard_id() const override { return shard_id_.load(); }
  std::string data_address() const override { return worker_ != nullptr ? worker_->address() : ""; }
  ShardServerStats stats() const override;
  int metrics_port() const override;
  std::function<void()> HoldStepThreadsForTest() override;

 private:
  // ---- requests.cc ----
  void OnRequest(transport::IncomingMessage& msg);
  // A push, pull, init or commit (alone, or one of a batch).
  void Dispatch(transport::IncomingMessage& msg, const wire::RequestHeader& h);
  // Several requests in one message (wire::Op::kBatch).
  void OnBatch(transport::IncomingMessage& msg, const wire::RequestHeader& h);
  void OnPush(transport::IncomingMessage& msg, const wire::RequestHeader& h, const JobRef& job,
              const ChunkRef& chunk);
  void OnPull(transport::IncomingMessage& msg, const wire::RequestHeader& h, const JobRef& job,
              const ChunkRef& chunk);
  void OnInit(transport::IncomingMessage& msg, const wire::RequestHeader& h, const JobRef& job,
              const ChunkRef& chunk);
  void OnCommit(const wire::RequestHeader& h, uintptr_t from, const JobRef& job,
                const ChunkRef& chunk);
  // Answers a push or commit OK (with the partial of the clipping round).
  void SendAck(const Ack& ack);
  // Answers a request (no payload), counting refusals by code.
  void Reply(uintptr_t peer, uint64_t request_id, const absl::Status& status,
             const ReplyHint& hint = {});
  // Sends `count` replies held back for a batch (back to back in
  // `replies`): one as a kAmReply, several as one kAmReplyBatch.
  void SendCorked(uintptr_t peer, uint32_t count, std::string replies);
  // A step thread's held answers (StepExecutorHooks, made by StepHooks):
  // acks of pushes whose senders take reply batches wait on the thread that
  // made them until its queue runs dry or the oldest has waited
  // options_.step_reply_hold, then leave as one kAmReplyBatch per peer.
  StepExecutorHooks StepHooks();
  // Makes this thread one that holds answers (on a step thread's start).
  void InstallStepHold();
  // Holds `reply` for `peer` when called on a step thread; false elsewhere.
  bool HoldOnStepThread(uintptr_t peer, absl::Span<const uint8_t> reply);
  // Sends what this step thread holds (only if the oldest is
  // step_hold_age_ old, with only_if_old).
  void FlushStepReplies(bool only_if_old);
  // Sends version `p.version` (already counted by the machine) to a worker.
  void SendVersion(const JobRef& job, const ChunkRef& chunk, const PullReply& p);

  // ---- steps.cc ----
  // Carries out what an event returned (after the chunk's lock is released).
  void Carry(const JobRef& job, const ChunkRef& chunk, Actions actions);
  // ShardServerOptions::audit_versions: logs version `version` of the chunk
  // (made as its primary, or as its backup) with the CRC of its published copy.
  void AuditVersion(const Job& job, const Chunk& chunk, uint64_t version, bool primary);
  void Schedule(std::function<void()> task) ABSL_LOCKS_EXCLUDED(exec_mu_);
  void RunStep(const JobRef& job, const ChunkRef& chunk);
  // Folds a chunk's landed gradients into its running sum (staging.h).
  void ScheduleFold(const ChunkRef& chunk);
  void RunForwardedStep(const JobRef& job, const ChunkRef& chunk);
  // The clipping round's pass: the chunk's partial sum of squares.
  void RunReduce(const JobRef& job, const ChunkRef& chunk);
  // One optimizer step of the chunk (state + published copy of step + 1)
  // at the step's learning rate and optimizer step count.
  absl::Status StepKernel(const Job& job, const Chunk& chunk, uint64_t step, float lr,
                          uint64_t optimizer_step, absl::Span<const void* const> grads,
                          DType grad_dtype, float scale);
  // A skipped step: the published copy of step moves to step + 1.
  static void SkipKernel(const Chunk& chunk, uint64_t step);

  // ---- replication.cc ----
  // Primary side.
  // A seed (the whole state), or the step's sum: `step` says what the
  // backup applies with it (a skip sends no payload).
  void SendForward(const JobRef& job, const ChunkRef& chunk, uint64_t gen, uint64_t version,
                   bool seed, const ForwardedStep& step = {});
  void OnForwardReply(transport::IncomingMessage& msg);
  void FailForwardsTo(transport::EndpointRef ep, const absl::Status& why);
  void ForwardDone(uint64_t forward_id, const absl::Status& status, uint32_t flags);
  // Opens (once) endpoints to the shards a map names as our chunks' backups.
  void ConnectPeers(const ShardMapView& map) ABSL_LOCKS_EXCLUDED(peers_mu_);
  transport::EndpointRef PeerEndpoint(uint64_t shard_id) ABSL_LOCKS_EXCLUDED(peers_mu_);
  // Backup side.
  void OnReplicate(transport::IncomingMessage& msg, const wire::RequestHeader& h);

  // ---- control.cc ----
  void HeartbeatLoop();
  bool StopOrBeat() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(stop_mu_) { return stopped_ || beat_now_; }
  void BeatNow() ABSL_LOCKS_EXCLUDED(stop_mu_);
  absl::Status Register();
  absl::Status HeartbeatOnce();
  HeartbeatReport BuildReport() const;
  // `coordinator_busy` (optional) is set when the map fetch was refused
  // because the coordinator was serving its most map reads (a fetch
  // storm): nothing was loaded, and the same fetch may be tried again.
  absl::Status LoadJob(uint64_t job_id, bool* coordinator_busy = nullptr);
  // Job loading runs on its own thread (a job of many chunks, or one
  // restored from a checkpoint, takes long; the heartbeat must go on):
  // the heartbeat asks for a load, LoaderLoop does it and then has the
  // next heartbeat go out at once. A fetch the coordinator refused as busy
  // is tried again by the loader after a jittered, growing wait
  // (common/busy_retry.h), not at once and not only at the next heartbeat.
  // Not before `not_before` (the coordinator's slot for the fetch).
  void RequestLoad(uint64_t job_id, uint64_t epoch, absl::Time not_before = absl::InfinitePast())
      ABSL_LOCKS_EXCLUDED(load_mu_);
  void LoaderLoop() ABSL_LOCKS_EXCLUDED(load_mu_);
  bool LoadWantedOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(load_mu_) {
    return load_stop_ || !loads_wanted_.empty();
  }
  absl::Status ApplyMap(const JobRef& job, const JobDescription& desc);
  // Places a fresh chunk of `job` per `p` (restored from a checkpoint when
  // `restore` is set): allocates, restores and sets its placement.
  absl::StatusOr<ChunkRef> PlaceChunk(const Job& job, const ChunkPlacement& p,
                                      const RestoreSource* restore);
  // The job leaves this shard: its chunks retire (parked pulls answered
  // with `why`), and its memory is freed once nothing refers to it.
  void ReleaseJob(uint64_t job_id, const absl::Status& why, ReplyHint hint);
  void ReleaseAll(const absl::Status& why, ReplyHint hint);
  void RetireChunk(const JobRef& job, const ChunkRef& chunk, const absl::Status& why,
                   ReplyHint hint);
  Registrar MakeRegistrar();

  // ---- checkpointing.cc ----
  void StartCheckpoint(const CheckpointOrder& order);
  // Starts tracking the job's policy checkpoint at `step` (once per shard).
  void BeginPolicyCheckpoint(const JobRef& job, uint64_t step);
  // Copies the chunk's state for checkpoint `checkpoint_id` (0: the order
  // failed, nothing to copy) and releases the chunk's next step.
  void FinishSnapshot(const JobRef& job, const ChunkRef& chunk, uint64_t checkpoint_id);
  absl::Status RestoreChunk(const Job& job, Chunk* chunk, const RestoreSource& restore);

  const ShardServerOptions options_;
  const std::chrono::nanoseconds step_hold_age_ =
      absl::ToChronoNanoseconds(options_.step_reply_hold);
  ShardMetrics metrics_;
  // Parked pulls and in-flight request bytes per peer (peer_limits.h);
  // shared with the buffers it accounts, which may outlive the shard.
  const std::shared_ptr<PeerLimits> limits_;
  // What batches are received into (peer_limits.h): a few buffers of
  // wire::kBatchBytes, kept.
  const std::shared_ptr<ReceiveBufferPool> batch_buffers_;
  JobTable table_;
  // Borrowed by every step; outlives executor_ (declared before it).
  std::unique_ptr<kernels::ThreadPool> kernel_pool_;
  absl::Mutex exec_mu_;
  std::unique_ptr<StepExecutor> executor_ ABSL_GUARDED_BY(exec_mu_);  // Null once stopping.
  std::unique_ptr<CheckpointWriter> ckpt_writer_;  // Null without a checkpoint folder.
  std::unique_ptr<CoordinatorLink> link_;
  std::unique_ptr<transport::Worker> worker_;
  // Gradients in flight (set in Start, before any job loads).
  std::shared_ptr<StagingPool> staging_pool_;
  std::atomic<bool> closing_{false};  // Set just before worker_ is destroyed.
  std::unique_ptr<HttpServer> http_;

  std::atomic<uint64_t> shard_id_{0};
  std::atomic<int64_t> lease_ms_{2000};  // Granted by the coordinator.
  std::atomic<int64_t> last_beat_unix_ns_{0};   // Last heartbeat the coordinator answered.
  std::atomic<int64_t> beat_loop_unix_ns_{0};   // Last heartbeat attempt (any outcome).

  // Replication: endpoints to other shards, and forwards awaiting answers.
  struct PendingForward {
    JobRef job;
    ChunkRef chunk;
    uint64_t gen = 0;
    bool seed = false;
    transport::EndpointRef ep;
    std::shared_ptr<std::vector<float>> staging;  // A seed's payload.
  };
  // Data-plane identity (common/security.h): nullopt until registered (no
  // peer is let in), then the cluster secret ("" in plain text: no checks).
  absl::Status VerifyPeer(absl::string_view identity, absl::string_view challenge,
                          absl::string_view proof) ABSL_LOCKS_EXCLUDED(identity_mu_);
  std::pair<std::string, std::string> ProveSelf(absl::string_view challenge)
      ABSL_LOCKS_EXCLUDED(identity_mu_);
  // Whether the data plane checks identities (registered with a secret).
  // Read on every request: an atomic copy of "the secret is not empty",
  // set with it at registration (true before: nothing is let in then).
  bool ChecksIdentities() const;
  std::atomic<bool> checks_identities_{true};
  absl::Mutex identity_mu_;
  std::optional<std::string> data_plane_key_ ABSL_GUARDED_BY(identity_mu_);

  // Jobs this shard dropped because the coordinator declared it down: a
  // request for one is sent back to the map (workers still on the map
  // that had this shard fetch the new one), not answered "unknown job",
  // which would end the worker's step. An entry goes when the job is
  // loaded here again.
  absl::Mutex dropped_mu_;
  std::set<uint64_t> dropped_when_down_ ABSL_GUARDED_BY(dropped_mu_);
  bool DroppedWhenDown(uint64_t job_id) ABSL_LOCKS_EXCLUDED(dropped_mu_);

  absl::Mutex peers_mu_;
  std::map<uint64_t, transport::EndpointRef> peers_ ABSL_GUARDED_BY(peers_mu_);
  absl::Mutex fwd_mu_;
  absl::flat_hash_map<uint64_t, PendingForward> forwards_ ABSL_GUARDED_BY(fwd_mu_);
  std::atomic<uint64_t> next_forward_id_{1};

  absl::Mutex stop_mu_;
  bool stopped_ ABSL_GUARDED_BY(stop_mu_) = false;
  bool beat_now_ ABSL_GUARDED_BY(stop_mu_) = false;
  std::thread heartbeat_thread_;

  absl::Mutex load_mu_;
  std::map<uint64_t, uint64_t> loads_wanted_ ABSL_GUARDED_BY(load_mu_);  // job id -> epoch.
  // Job id -> the earliest time its wanted load may fetch (absent: now).
  std::map<uint64_t, absl::Time> loads_not_before_ ABSL_GUARDED_BY(load_mu_);
  bool load_stop_ ABSL_GUARDED_BY(load_mu_) = false;
  std::thread loader_thread_;
};

}  // namespace server
}  // namespace optimus

#endif  // OPTIMUS_SERVER_SHARD_H_
