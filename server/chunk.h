// The life of one chunk on a shard, as an explicit state machine: a phase
// enum, events in (a push landed, a pull, the kernel is done, the backup
// answered, a new map, a checkpoint order, retire), actions out (reply, send
// version v, schedule the step, forward the sum or a seed, copy a snapshot).
// No transport, proto, threads, clocks or buffers: the shard server holds
// the buffers and a mutex around each ChunkMachine, calls one event method
// under that mutex, and carries out the returned actions after releasing it.
// Not thread-safe by itself (the caller's mutex makes it so).
//
// Semantics: version v of a chunk is the result of steps 1..v-1 applied in
// order (initial values are version 1). The published copy of version v
// lives in buffer v % 2; version v-1 stays readable until the step that
// writes buffer (v+1) % 2 starts, which waits for the sends out of it.
#ifndef OPTIMUS_SERVER_CHUNK_H_
#define OPTIMUS_SERVER_CHUNK_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace optimus {
namespace server {

// What this shard is for a chunk under the map it has loaded.
enum class Role : uint8_t {
  kPrimary = 0,  // Takes pushes and pulls; forwards each step to its backup.
  kBackup = 1,   // Applies the primary's forwarded steps; promoted on failover.
};

enum class Phase : uint8_t {
  kEmpty = 0,           // No values: waits for the init (primary) or a seed (backup).
  kReceivingInit = 1,   // Primary: the initial values are landing.
  kCollecting = 2,      // Primary at version v: takes the W pushes of step v.
  kStepBlocked = 3,     // All W in; the step waits for pull replies out of the
                        // buffer it will write, or for a checkpoint copy.
  kStepScheduled = 4,   // Handed to a step thread, not started yet.
  kStepRunning = 5,     // The kernel runs (a primary may forward the sum meanwhile).
  kAwaitingBackup = 6,  // Primary: kernel done; publication waits for the backup.
  kBackupReady = 7,     // Backup holding the primary's state at version v.
  kBackupSeeding = 8,   // Backup: the primary's whole state is landing.
  kBackupStepping = 9,  // Backup: a forwarded sum is landing or being applied.
  kRetired = 10,        // Left this shard (moved, fenced, job deleted): refuses all.
  // The clipping round (jobs that clip or skip non-finite steps):
  kReducing = 11,        // All W in; a step thread sums the squares of the
                         // averaged gradient (the chunk's partial).
  kAwaitingCommit = 12,  // Partial sent back with the push replies; waits for
                         // a worker's commit (clip coefficient, skip).
};
const char* PhaseName(Phase phase);
inline constexpr int kNumPhases = 13;

// Where a primary's forward of the pending step to its backup stands.
enum class Forward : uint8_t {
  kNone = 0,        // No backup, or the backup acknowledged the step.
  kInFlight = 1,    // Sent (a sum or a seed); waiting for the answer.
  kNeedsSeed = 2,   // Send the whole state (after the kernel) instead of the sum.
  kRetryLater = 3,  // The backup has not loaded our map yet; a timer resends.
  kWaitMap = 4,     // The backup failed: wait for a map that replaces it.
};

// A backup's answer to a forward.
enum class ForwardAnswer : uint8_t {
  kAcked = 0,     // Applied (a sum) or installed (a seed).
  kFenced = 1,    // Under its map we are not the primary any more.
  kNeedSeed = 2,  // It does not hold the state the step starts from.
  kRetry = 3,     // It has not loaded our map yet, or is busy: ask again soon.
  kFailed = 4,    // Unreachable, or the send failed.
};

// Who asked: an opaque peer handle (the transport's endpoint, never
// dereferenced here) and the id to echo in the reply.
struct Requester {
  uintptr_t peer = 0;
  uint64_t request_id = 0;
  // The sender takes reply batches (wire::kRequestBatchReplies): an answer
  // without payload may reach it inside one.
  bool batch_replies = false;
};

// Reply flags the server puts on the wire (common/wire.h ReplyFlags), as
// plain values so that this file needs no wire header.
struct ReplyHint {
  bool duplicate = false;    // A push already received; dropped.
  bool refresh_map = false;  // Not here under the requester's map: refetch it.
  bool need_seed = false;    // (replication) send the state instead.
  bool retry = false;        // (replication) ask again soon.
  bool fenced = false;       // (replication) the sender is not the primary.
};

struct Refusal {
  Requester to;
  absl::Status status;
  ReplyHint hint;
  bool parked_pull = false;  // The refused request is a parked pull.
};

// What every push of one step carries; all W ranks' must be equal.
struct StepParams {
  float lr = 0.0f;         // The step's learning rate, before lr_mult (> 0).
  float grad_mult = 1.0f;  // Multiplies the averaged gradient (1 / loss scale).
  bool operator==(const StepParams& o) const {
    return lr == o.lr && grad_mult == o.grad_mult;
  }
  bool operator!=(const StepParams& o) const { return !(*this == o); }
};

// An OK answer to a push or a commit. With the clipping round a push is
// answered once the chunk's partial is known (has_partial).
struct Ack {
  Requester to;
  bool duplicate = false;
  bool has_partial = false;
  double partial = 0.0;  // Sum of squares of the chunk's averaged gradient.
};

// A backup's copy of what the primary decided for a forwarded step.
struct ForwardedStep {
  bool skip = false;     // Advance the version only.
  float lr = 0.0f;
  double partial = 0.0;  // Answered to pushes sent again after a promotion.
};

// Send version `version` out of published[version % 2] (already counted in
// the sends in flight: call SendDone(version) when the send completes).
struct PullReply {
  Requester to;
  uint64_t version = 0;
};

// What the caller must do after an event, in this order: refusals and
// replies, then sends, then the rest.
struct Actions {
  std::vector<Refusal> refusals;
  std::vector<Ack> acks;
  // The clipping round: compute the chunk's partial (ReduceInputs) on a
  // step thread, then ReduceDone.
  bool reduce = false;
  std::vector<PullReply> sends;
  // Run the step on a step thread (which calls BeginKernel).
  bool schedule_step = false;
  // Backup: the forwarded sum has landed; apply it on a step thread, then
  // ForwardedStepDone (and answer the primary).
  bool apply_forwarded = false;
  // Copy the state (master and moments, after the kernel: version
  // seed_version) and send it to the backup as a seed of generation seed_gen;
  // then ForwardDone(seed_gen, /*seed=*/true, answer).
  bool send_seed = false;
  uint64_t seed_version = 0;
  uint64_t seed_gen = 0;
  // Call RetryTimer(retry_gen) after a short delay (the backup loads our map
  // within a heartbeat).
  bool retry_later = false;
  uint64_t retry_gen = 0;
  // Ask the coordinator now (our map, or the peer's, is behind).
  bool beat_now = false;
  // Copy master and moments for checkpoint `snapshot_checkpoint` (the state
  // is exactly the published version and no kernel starts until
  // SnapshotDone), then call SnapshotDone. snapshot_by_policy: taken at a
  // policy boundary, not for an order.
  uint64_t snapshot_checkpoint = 0;
  bool snapshot_by_policy = false;
  // A step became ready but waits for a checkpoint copy (the caller may
  // measure how long), or a copy released a waiting step.
  bool step_waits_for_snapshot = false;
  bool step_released_by_snapshot = false;
  // Version `published` was just published (0: none); the primary's step
  // or a backup's forwarded step completed.
  uint64_t published = 0;
  // The chunk retired in this event: drop it from the job's table.
  bool retired = false;

  bool empty() const;
};

// What a step thread does when BeginKernel lets it run.
struct StepPlan {
  bool run = false;     // False: nothing to run (retired, or blocked).
  // Leave master and moments alone (a non-finite step, or no rank had a
  // gradient): copy the published version forward (and tell the backup).
  bool skip = false;
  // Not run because a checkpoint copy began meanwhile; SnapshotDone
  // schedules it again.
  bool blocked_by_snapshot = false;
  uint64_t step = 0;    // The step applied: version step -> step + 1.
  // Sum the W slots into the fp32 sum buffer, send it to the backup
  // (generation gen), and step from the sum; else the fused step over the slots.
  bool forward_sum = false;
  uint64_t gen = 0;
  StepParams params;
  float clip_coef = 1.0f;          // Multiplies the averaged gradient.
  uint64_t optimizer_step = 0;     // t of the optimizer's bias corrections.
  double partial = 0.0;            // The round's partial (forwarded to the backup).
  std::vector<uint32_t> ranks;     // The ranks whose slots hold a gradient.
};

// What the reduce pass of the clipping round reads.
struct ReduceInputs {
  bool run = false;
  uint64_t step = 0;  // The step whose gradients are reduced.
  StepParams params;
  std::vector<uint32_t> ranks;
};

enum class CommitVerdict : uint8_t {
  kOk = 0,
  kRefuse = 1,
};

enum class PushVerdict : uint8_t {
  kAccept = 0,     // Receive the payload into the rank's slot (none for a
                   // push without gradient), then PushLanded.
  kDuplicate = 1,  // Acknowledge (`ack`); nothing changes.
  kRefuse = 2,     // Answer with `error`; nothing changes.
  kHeld = 3,       // A duplicate answered with the partial once it is known.
};
struct PushDecision {
  PushVerdict verdict = PushVerdict::kRefuse;
  absl::Status error;
  ReplyHint hint;
  Ack ack;  // kDuplicate.
};

enum class PullVerdict : uint8_t {
  kServe = 0,   // Send the version now (counted); SendDone when it completes.
  kParked = 1,  // Answered when the version is published.
  kRefuse = 2,
};
struct PullDecision {
  PullVerdict verdict = PullVerdict::kRefuse;
  absl::Status error;
  ReplyHint hint;
};

// A checkpoint order's outcome on one primary chunk.
enum class CaptureVerdict : uint8_t {
  kCopyNow = 0,    // At the step and idle: copy now (SnapshotDone after).
  kLater = 1,      // Copied when the step is published (Actions.snapshot_checkpoint).
  kMissed = 2,     // Already past the step (or mid-step at it): retry later.
  kRefuse = 3,     // No values yet, or not a primary.
};
struct CaptureDecision {
  CaptureVerdict verdict = CaptureVerdict::kRefuse;
  std::string error;
};

// Identifies the chunk in messages.
struct ChunkName {
  uint64_t job = 0;
  uint32_t tensor = 0;
  uint32_t chunk = 0;
};

class ChunkMachine {
 public:
  // A chunk just placed on this shard: no values, `role` under the map.
  ChunkMachine(ChunkName name, uint32_t world_size, Role role);

  // The job's step rules: commit_round, every step waits for a worker's
  // commit (the clipping round) after its partial is computed; frozen, the
  // tensor takes no gradient (pushes carry none) and is never stepped.
  void SetStepRules(bool commit_round, bool frozen) {
    commit_round_ = commit_round;
    frozen_ = frozen;
  }
  // ---- Placement (maps) ----
  // The shard's shard id, the chunk's primary and backup (0: none) under a
  // newly applied map. A backup change starts a new backup generation: the
  // new backup is seeded before the next publication (a pending one seeds
  // it now); a backup promoted to primary takes pushes from its version on.
  // has_sum_buffer: the fp32 sum buffer exists (the step can forward sums).
  Actions ApplyPlacement(uint64_t self, uint64_t primary, uint64_t backup, bool has_sum_buffer);
  // Snapshot every version S with S % every_steps == 0 when it is published
  // as a primary (the job's checkpoint policy; 0: none). Versions up to the
  // first one held (a restored checkpoint's) are not taken again. The
  // snapshot's checkpoint id is S: a checkpoint's id is its step.
  void SetCheckpointEvery(uint64_t every_steps) { checkpoint_every_ = every_steps; }
  // Values loaded from a checkpoint at `version`: both copies of a chunk
  // load the same files, so a backup is seeded and a primary's backup holds
  // its state.
  void Restored(uint64_t version, uint64_t optimizer_steps, float last_lr);
  // Leaves this shard: every parked pull is refused with `why` and `hint`;
  // later events do nothing (a step already running completes unseen).
  Actions Retire(const absl::Status& why, ReplyHint hint);

  // ---- Worker requests (primary) ----
  // Accept: receive the values, then InitLanded.
  PushDecision InitRequested();
  // optimizer_steps and last_lr: of an imported optimizer state (0 for
  // plain initial values).
  Actions InitLanded(bool ok, uint64_t optimizer_steps = 0, float last_lr = 0.0f);
  // `params` resolved (lr > 0); has_grad false: this rank has no gradient
  // (no payload: call PushLanded at once). `from` is answered through
  // Actions.acks when the push is taken.
  PushDecision PushRequested(uint64_t step, uint32_t rank, bool resend, const StepParams& params,
                             bool has_grad, Requester from);
  Actions PushLanded(uint32_t rank, bool ok);
  // ---- The clipping round (primary) ----
  ReduceInputs GetReduceInputs() const;
  Actions ReduceDone(double sum_squares);
  // A worker's commit for `step`: answered in Actions (acks or refusals).
  Actions CommitRequested(uint64_t step, float clip_coef, bool skip, Requester from);
  PullDecision PullRequested(uint64_t version, Requester from);
  Actions SendDone(uint64_t version);

  // ---- The step (primary) ----
  StepPlan BeginKernel();
  // The sum could not be computed or sent: seed the backup after the kernel.
  void SumNotForwarded();
  Actions KernelDone();
  Actions ForwardDone(uint64_t gen, bool seed, ForwardAnswer answer);
  Actions RetryTimer(uint64_t gen);

  // ---- Checkpoints (primary) ----
  CaptureDecision CaptureOrdered(uint64_t step, uint64_t checkpoint_id);
  // The order failed elsewhere: forget a capture it set here.
  void CaptureCancelled(uint64_t checkpoint_id);
  Actions SnapshotDone();

  // ---- Backup side ----
  // A seed (the primary's whole state at `version`) or a sum (the step
  // starting from `step`) from the chunk's primary. OK: receive it, then
  // SeedLanded / SumLanded. Otherwise the answer to send (need seed, retry).
  PushDecision SeedOffered(uint64_t version);
  // ok: the caller installed the state; version `version` is now held.
  Actions SeedLanded(bool ok, uint64_t version, uint64_t optimizer_steps = 0,
                     float last_lr = 0.0f);
  PushDecision SumOffered(uint64_t step, bool has_sum_buffer, const ForwardedStep& f);
  bool forwarded_skip() const { return forwarded_.skip; }
  float forwarded_lr() const { return forwarded_.lr; }
  // ok: the caller applies the forwarded step, then ForwardedStepDone.
  Actions SumLanded(bool ok);
  Actions ForwardedStepDone(bool ok);

  // ---- Reading ----
  Role role() const { return role_; }
  Phase phase() const { return phase_; }
  bool retired() const { return phase_ == Phase::kRetired; }
  uint64_t version() const { return version_; }           // 0: no values.
  uint64_t first_version() const { return first_version_; }
  uint64_t primary_shard() const { return primary_; }
  uint64_t backup_shard() const { return backup_; }
  uint64_t backup_gen() const { return gen_; }
  bool seeded() const { return seeded_; }                 // Backup: in sync.
  bool backup_seeded() const { return backup_seeded_; }   // Primary: backup in sync.
  Forward forward() const { return forward_; }
  uint32_t full_slots() const { return full_slots_; }
  size_t parked_pulls() const { return parked_.size(); }
  int sends_in_flight(int buffer) const { return sends_[buffer]; }
  bool snapshot_copying() const { return snapshot_copying_; }
  uint64_t capture_step() const { return capture_step_; }
  // Optimizer steps applied to the state held (torch's 'step'), and the lr
  // of the last step taken (0: none).
  uint64_t optimizer_steps() const { return applied_; }
  float last_lr() const { return last_lr_; }
  bool frozen() const { return frozen_; }
  bool partial_ready() const { return partial_ready_; }
  bool has_commit() const { return commit_have_; }
  // One line for logs.
  std::string DebugString() const;

 private:
  enum class Slot : uint8_t { kEmpty = 0, kReceiving = 1, kFull = 2 };

  // Moves to kStepScheduled (schedule) or kStepBlocked.
  void TryStartStep(Actions* out);
  // Publishes version_ + 1 once the kernel is done and the backup has the
  // step, or sends the backup the seed it needs first.
  void TryPublish(Actions* out);
  void Publish(Actions* out);
  void TakeParked(uint64_t version, Actions* out);
  // All W pushes are in: reduce (the round), or step.
  void AllPushesIn(Actions* out);
  // Resets the slots and everything the step being collected carried.
  void ResetSlots();
  // The phase that holds version v with nothing in flight, for the role.
  Phase IdlePhase() const;
  std::string What() const;

  ChunkName name_;
  uint32_t world_size_;
  Role role_;
  Phase phase_ = Phase::kEmpty;
  uint64_t version_ = 0;
  uint64_t first_version_ = 1;
  std::vector<Slot> slots_;
  std::vector<bool> has_grad_;
  std::vector<Requester> waiters_;  // Per rank: the push to answer.
  std::vector<bool> waiting_;       // waiters_[r] is unanswered.
  std::vector<Requester> held_;     // Copies of pushes, answered with the partial.
  uint32_t full_slots_ = 0;
  bool commit_round_ = false;
  bool frozen_ = false;
  // The step being collected / applied.
  bool params_set_ = false;
  StepParams params_;
  bool noop_ = false;               // No rank had a gradient.
  bool partial_ready_ = false;
  double partial_ = 0.0;
  bool commit_have_ = false;
  float commit_coef_ = 1.0f;
  bool commit_skip_ = false;
  bool running_skip_ = false;       // The step under way leaves the state alone.
  // The last step published, for answers to pushes and commits sent again.
  bool last_valid_ = false;
  double last_partial_ = 0.0;
  bool last_commit_valid_ = false;
  float last_coef_ = 1.0f;
  bool last_skip_ = false;
  // Optimizer steps applied and the last step's lr.
  uint64_t applied_ = 0;
  float last_lr_ = 0.0f;
  ForwardedStep forwarded_;  // Backup: the step landing.
  int sends_[2] = {0, 0};
  std::vector<PullReply> parked_;
  bool snapshot_copying_ = false;
  uint64_t capture_step_ = 0;
  uint64_t capture_checkpoint_ = 0;
  uint64_t checkpoint_every_ = 0;
  // Replication.
  uint64_t self_ = 0;
  uint64_t primary_ = 0;
  uint64_t backup_ = 0;
  uint64_t gen_ = 0;
  bool has_sum_buffer_ = false;
  bool backup_seeded_ = false;
  bool seeded_ = false;
  Forward forward_ = Forward::kNone;
};

}  // namespace server
}  // namespace optimus

#endif  // OPTIMUS_SERVER_CHUNK_H_
