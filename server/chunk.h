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
};
const char* PhaseName(Phase phase);
inline constexpr int kNumPhases = 11;

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
  // Not run because a checkpoint copy began meanwhile; SnapshotDone
  // schedules it again.
  bool blocked_by_snapshot = false;
  uint64_t step = 0;    // The step applied: version step -> step + 1.
  // Sum the W slots into the fp32 sum buffer, send it to the backup
  // (generation gen), and step from the sum; else the fused step over the slots.
  bool forward_sum = false;
  uint64_t gen = 0;
};

enum class PushVerdict : uint8_t {
  kAccept = 0,     // Receive the payload into the rank's slot, then PushLanded.
  kDuplicate = 1,  // Acknowledge with the duplicate hint; nothing changes.
  kRefuse = 2,     // Answer with `error`; nothing changes.
};
struct PushDecision {
  PushVerdict verdict = PushVerdict::kRefuse;
  absl::Status error;
  ReplyHint hint;
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
  void Restored(uint64_t version);
  // Leaves this shard: every parked pull is refused with `why` and `hint`;
  // later events do nothing (a step already running completes unseen).
  Actions Retire(const absl::Status& why, ReplyHint hint);

  // ---- Worker requests (primary) ----
  // Accept: receive the values, then InitLanded.
  PushDecision InitRequested();
  Actions InitLanded(bool ok);
  PushDecision PushRequested(uint64_t step, uint32_t rank, bool resend);
  Actions PushLanded(uint32_t rank, bool ok);
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
  Actions SeedLanded(bool ok, uint64_t version);
  PushDecision SumOffered(uint64_t step, bool has_sum_buffer);
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
  uint32_t full_slots_ = 0;
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
