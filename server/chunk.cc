#include "server/chunk.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace optimus {
namespace server {

const char* PhaseName(Phase phase) {
  switch (phase) {
    case Phase::kEmpty: return "empty";
    case Phase::kReceivingInit: return "receiving_init";
    case Phase::kCollecting: return "collecting";
    case Phase::kStepBlocked: return "step_blocked";
    case Phase::kStepScheduled: return "step_scheduled";
    case Phase::kStepRunning: return "step_running";
    case Phase::kAwaitingBackup: return "awaiting_backup";
    case Phase::kBackupReady: return "backup_ready";
    case Phase::kBackupSeeding: return "backup_seeding";
    case Phase::kBackupStepping: return "backup_stepping";
    case Phase::kRetired: return "retired";
  }
  return "unknown";
}

bool Actions::empty() const {
  return refusals.empty() && sends.empty() && !schedule_step && !apply_forwarded &&
         !send_seed && !retry_later && !beat_now && snapshot_checkpoint == 0 &&
         !step_waits_for_snapshot && !step_released_by_snapshot && published == 0 && !retired &&
         !snapshot_by_policy;
}

namespace {

ReplyHint RefreshMap() {
  ReplyHint h;
  h.refresh_map = true;
  return h;
}

PushDecision Refuse(absl::Status error, ReplyHint hint = {}) {
  PushDecision d;
  d.verdict = PushVerdict::kRefuse;
  d.error = std::move(error);
  d.hint = hint;
  return d;
}

PushDecision Accept() {
  PushDecision d;
  d.verdict = PushVerdict::kAccept;
  return d;
}

PushDecision Duplicate() {
  PushDecision d;
  d.verdict = PushVerdict::kDuplicate;
  d.hint.duplicate = true;
  return d;
}

}  // namespace

ChunkMachine::ChunkMachine(ChunkName name, uint32_t world_size, Role role)
    : name_(name), world_size_(world_size), role_(role), slots_(world_size, Slot::kEmpty) {}

std::string ChunkMachine::What() const {
  return absl::StrCat("tensor ", name_.tensor, " chunk ", name_.chunk, " of job ", name_.job);
}

Phase ChunkMachine::IdlePhase() const {
  if (version_ == 0) return Phase::kEmpty;
  if (role_ == Role::kPrimary) return Phase::kCollecting;
  return seeded_ ? Phase::kBackupReady : Phase::kEmpty;
}

void ChunkMachine::ResetSlots() {
  std::fill(slots_.begin(), slots_.end(), Slot::kEmpty);
  full_slots_ = 0;
}

// ---- Placement ----------------------------------------------------------------

Actions ChunkMachine::ApplyPlacement(uint64_t self, uint64_t primary, uint64_t backup,
                                     bool has_sum_buffer) {
  Actions out;
  if (retired()) return out;
  self_ = self;
  has_sum_buffer_ = has_sum_buffer;
  const Role role = primary == self ? Role::kPrimary : Role::kBackup;
  if (role_ == Role::kPrimary && role == Role::kBackup) {
    // A primary is never demoted in place: its state may be ahead of or
    // behind the new primary's. The caller places a fresh backup chunk.
    return Retire(absl::FailedPreconditionError(absl::StrCat(
                      "stale shard map: ", What(), " moved its primary to shard ", primary)),
                  RefreshMap());
  }
  if (role_ == Role::kBackup && role == Role::kPrimary) {
    role_ = Role::kPrimary;
    // Seeding and stepping finish first and then land in the primary's
    // idle phase.
    if (phase_ == Phase::kBackupReady) {
      phase_ = Phase::kCollecting;
      ResetSlots();
    }
  }
  primary_ = primary;
  const uint64_t new_backup = role_ == Role::kPrimary ? backup : 0;
  if (new_backup != backup_) {
    backup_ = new_backup;
    ++gen_;  // Answers from the old backup are ignored from now on.
    backup_seeded_ = false;
    const bool pending = phase_ == Phase::kStepRunning || phase_ == Phase::kAwaitingBackup;
    if (pending && forward_ != Forward::kNone) {
      // The publication held up by the old backup now seeds the new one, or
      // goes ahead without one.
      forward_ = backup_ != 0 ? Forward::kNeedsSeed : Forward::kNone;
      if (phase_ == Phase::kAwaitingBackup) TryPublish(&out);
    }
  }
  return out;
}

void ChunkMachine::Restored(uint64_t version) {
  if (retired()) return;
  version_ = version;
  first_version_ = version;
  seeded_ = role_ == Role::kBackup;
  backup_seeded_ = role_ == Role::kPrimary && backup_ != 0;
  ResetSlots();
  phase_ = IdlePhase();
}

Actions ChunkMachine::Retire(const absl::Status& why, ReplyHint hint) {
  Actions out;
  if (retired()) return out;
  phase_ = Phase::kRetired;
  forward_ = Forward::kNone;
  ++gen_;
  capture_step_ = 0;
  for (const PullReply& p : parked_) out.refusals.push_back(Refusal{p.to, why, hint});
  parked_.clear();
  out.retired = true;
  return out;
}

// ---- Worker requests ---------------------------------------------------------

namespace {
absl::Status NotPrimary(uint64_t self, const std::string& what) {
  return absl::FailedPreconditionError(
      absl::StrCat("stale shard map: shard ", self, " is not the primary of ", what));
}
}  // namespace

PushDecision ChunkMachine::InitRequested() {
  if (retired() || role_ != Role::kPrimary) return Refuse(NotPrimary(self_, What()), RefreshMap());
  if (phase_ != Phase::kEmpty || version_ != 0) {
    return Refuse(absl::AlreadyExistsError(absl::StrCat(What(), " already has initial values")));
  }
  phase_ = Phase::kReceivingInit;
  return Accept();
}

Actions ChunkMachine::InitLanded(bool ok) {
  Actions out;
  if (phase_ != Phase::kReceivingInit) return out;
  if (!ok) {
    phase_ = Phase::kEmpty;
    return out;
  }
  version_ = 1;
  first_version_ = 1;
  phase_ = Phase::kCollecting;
  TakeParked(1, &out);
  return out;
}

PushDecision ChunkMachine::PushRequested(uint64_t step, uint32_t rank, bool resend) {
  if (retired() || role_ != Role::kPrimary) return Refuse(NotPrimary(self_, What()), RefreshMap());
  if (rank >= world_size_) {
    return Refuse(absl::InvalidArgumentError(
        absl::StrCat("push from rank ", rank, " but the job has world size ", world_size_)));
  }
  if (version_ == 0) {
    return Refuse(absl::FailedPreconditionError(absl::StrCat(What(), " has no initial values yet")));
  }
  // A push sent again after a failover whose step is already applied.
  if (step < version_ && resend) return Duplicate();
  if (step < version_) {
    return Refuse(absl::FailedPreconditionError(
        absl::StrCat("stale push: step ", step, " of ", What(),
                     " is already applied (next step is ", version_, ")")));
  }
  if (step > version_) {
    return Refuse(absl::OutOfRangeError(absl::StrCat("push for step ", step, " of ", What(),
                                                     " is ahead: the chunk is waiting for step ",
                                                     version_)));
  }
  // The same (job, epoch, step, rank, chunk) again, or the step is already
  // being applied (e.g. a promoted backup applying the forwarded sum):
  // pushes are idempotent.
  if (phase_ != Phase::kCollecting || slots_[rank] != Slot::kEmpty) return Duplicate();
  slots_[rank] = Slot::kReceiving;
  return Accept();
}

Actions ChunkMachine::PushLanded(uint32_t rank, bool ok) {
  Actions out;
  if (phase_ != Phase::kCollecting || rank >= world_size_ || slots_[rank] != Slot::kReceiving) {
    return out;  // Retired or moved on meanwhile: the payload is not used.
  }
  if (!ok) {
    slots_[rank] = Slot::kEmpty;
    return out;
  }
  slots_[rank] = Slot::kFull;
  if (++full_slots_ == world_size_) TryStartStep(&out);
  return out;
}

PullDecision ChunkMachine::PullRequested(uint64_t version, Requester from) {
  PullDecision d;
  if (retired() || role_ != Role::kPrimary) {
    d.error = NotPrimary(self_, What());
    d.hint = RefreshMap();
    return d;
  }
  if (version == 0) {
    d.error = absl::InvalidArgumentError("version 0 does not exist; initial values are version 1");
    return d;
  }
  const uint64_t pv = version_;
  // Buffer pv % 2 is never written while pv is the latest; pv - 1 lives in
  // the buffer the next step writes, which waits for sends out of it, so it
  // is served only before that step is under way.
  const bool previous_readable = version + 1 == pv && version >= first_version_ &&
                                 phase_ == Phase::kCollecting;
  if (phase_ == Phase::kBackupSeeding) {
    // Promoted while the seed lands: its buffers are about to be rewritten.
    if (version > pv) {
      parked_.push_back(PullReply{from, version});
      d.verdict = PullVerdict::kParked;
      return d;
    }
    d.error = absl::UnavailableError(absl::StrCat(What(), " is being seeded; retry"));
    d.hint = RefreshMap();
    return d;
  }
  if (pv > 0 && (version == pv || previous_readable)) {
    ++sends_[version % 2];
    d.verdict = PullVerdict::kServe;
    return d;
  }
  if (version == pv + 1) {
    parked_.push_back(PullReply{from, version});
    d.verdict = PullVerdict::kParked;
    return d;
  }
  if (version > pv + 1) {
    d.error = absl::OutOfRangeError(absl::StrCat("pull of version ", version, " of ", What(),
                                                 " is more than one step ahead (latest published is ",
                                                 pv, ")"));
    return d;
  }
  d.error = absl::FailedPreconditionError(absl::StrCat(
      "version ", version, " of ", What(), " is no longer held (latest published is ", pv, ")"));
  return d;
}

Actions ChunkMachine::SendDone(uint64_t version) {
  Actions out;
  const int idx = static_cast<int>(version % 2);
  if (sends_[idx] > 0) --sends_[idx];
  const int next_out = static_cast<int>((version_ + 1) % 2);
  if (phase_ == Phase::kStepBlocked && idx == next_out && sends_[idx] == 0 && !snapshot_copying_) {
    phase_ = Phase::kStepScheduled;
    out.schedule_step = true;
  }
  return out;
}

// ---- The step -----------------------------------------------------------------

void ChunkMachine::TryStartStep(Actions* out) {
  const int next_out = static_cast<int>((version_ + 1) % 2);
  if (snapshot_copying_) {
    phase_ = Phase::kStepBlocked;
    out->step_waits_for_snapshot = true;
  } else if (sends_[next_out] > 0) {
    phase_ = Phase::kStepBlocked;
  } else {
    phase_ = Phase::kStepScheduled;
    out->schedule_step = true;
  }
}

StepPlan ChunkMachine::BeginKernel() {
  StepPlan plan;
  if (phase_ != Phase::kStepScheduled) return plan;
  if (snapshot_copying_) {
    // A checkpoint copy began after the step was scheduled: it finishes
    // first (SnapshotDone schedules the step again).
    phase_ = Phase::kStepBlocked;
    plan.blocked_by_snapshot = true;
    return plan;
  }
  phase_ = Phase::kStepRunning;
  forward_ = Forward::kNone;
  plan.run = true;
  plan.step = version_;
  if (backup_ != 0) {
    if (backup_seeded_ && has_sum_buffer_) {
      plan.forward_sum = true;
      plan.gen = gen_;
      forward_ = Forward::kInFlight;
    } else {
      // A new backup: once the kernel is done, send it the whole state.
      forward_ = Forward::kNeedsSeed;
    }
  }
  return plan;
}

void ChunkMachine::SumNotForwarded() {
  if (phase_ == Phase::kStepRunning && forward_ == Forward::kInFlight) {
    forward_ = Forward::kNeedsSeed;
  }
}

Actions ChunkMachine::KernelDone() {
  Actions out;
  if (phase_ != Phase::kStepRunning) return out;
  phase_ = Phase::kAwaitingBackup;
  TryPublish(&out);
  return out;
}

void ChunkMachine::TryPublish(Actions* out) {
  if (phase_ != Phase::kAwaitingBackup) return;
  switch (forward_) {
    case Forward::kInFlight:
    case Forward::kRetryLater:
    case Forward::kWaitMap:
      return;
    case Forward::kNeedsSeed:
      if (backup_ == 0) break;
      // The state after the kernel is version + 1: the backup takes it
      // whole, whatever it held.
      forward_ = Forward::kInFlight;
      out->send_seed = true;
      out->seed_version = version_ + 1;
      out->seed_gen = gen_;
      return;
    case Forward::kNone:
      break;
  }
  forward_ = Forward::kNone;
  Publish(out);
}

void ChunkMachine::Publish(Actions* out) {
  ++version_;
  phase_ = Phase::kCollecting;
  ResetSlots();
  out->published = version_;
  // The state is exactly this version until the next step, which needs
  // every worker's next push: copy it after the pulls are answered.
  if (capture_step_ != 0 && capture_step_ == version_) {
    snapshot_copying_ = true;
    out->snapshot_checkpoint = capture_checkpoint_;
    capture_step_ = 0;
  } else if (checkpoint_every_ > 0 && version_ % checkpoint_every_ == 0 &&
             version_ > first_version_) {
    snapshot_copying_ = true;
    out->snapshot_checkpoint = version_;
    out->snapshot_by_policy = true;
  }
  TakeParked(version_, out);
}

void ChunkMachine::TakeParked(uint64_t version, Actions* out) {
  auto keep = std::stable_partition(parked_.begin(), parked_.end(),
                                    [version](const PullReply& p) { return p.version != version; });
  for (auto it = keep; it != parked_.end(); ++it) {
    out->sends.push_back(*it);
    ++sends_[version % 2];  // Counted now, so no step overwrites the buffer first.
  }
  parked_.erase(keep, parked_.end());
}

Actions ChunkMachine::ForwardDone(uint64_t gen, bool seed, ForwardAnswer answer) {
  Actions out;
  if (retired() || gen != gen_ || forward_ != Forward::kInFlight) return out;  // Stale.
  switch (answer) {
    case ForwardAnswer::kAcked:
      forward_ = Forward::kNone;
      if (seed) backup_seeded_ = true;
      TryPublish(&out);
      break;
    case ForwardAnswer::kFenced:
      // Our backup serves a newer map in which we are not the primary: stop
      // at once so no worker builds on a step it will never see.
      return Retire(absl::FailedPreconditionError(absl::StrCat(
                        "stale shard map: shard ", self_, " was fenced by shard ", backup_,
                        " for ", What())),
                    RefreshMap());
    case ForwardAnswer::kNeedSeed:
      backup_seeded_ = false;
      forward_ = Forward::kNeedsSeed;
      TryPublish(&out);
      break;
    case ForwardAnswer::kRetry:
      forward_ = Forward::kRetryLater;
      out.retry_later = true;
      out.retry_gen = gen_;
      out.beat_now = true;  // Our map may be the one behind.
      break;
    case ForwardAnswer::kFailed:
      // Publishing without the backup would let workers run ahead of the
      // only other copy: hold the step until a map replaces it.
      forward_ = Forward::kWaitMap;
      break;
  }
  return out;
}

Actions ChunkMachine::RetryTimer(uint64_t gen) {
  Actions out;
  if (retired() || gen != gen_ || forward_ != Forward::kRetryLater) return out;
  // As a seed: the kernel may be done, so the sum alone may be too late.
  forward_ = Forward::kNeedsSeed;
  TryPublish(&out);
  return out;
}

// ---- Checkpoints ----------------------------------------------------------------

CaptureDecision ChunkMachine::CaptureOrdered(uint64_t step, uint64_t checkpoint_id) {
  CaptureDecision d;
  if (retired() || role_ != Role::kPrimary) {
    d.error = absl::StrCat(What(), " is not a primary here");
    return d;
  }
  if (version_ == 0) {
    d.error = absl::StrCat(What(), " has no initial values yet");
    return d;
  }
  const bool idle = phase_ == Phase::kCollecting || phase_ == Phase::kStepBlocked ||
                    phase_ == Phase::kStepScheduled;
  if (version_ > step || (version_ == step && (!idle || snapshot_copying_))) {
    d.verdict = CaptureVerdict::kMissed;
    d.error = absl::StrCat(What(), " already applied step ", step);
    return d;
  }
  if (version_ == step) {
    // At the step and no kernel under way: copy now; the step waits.
    snapshot_copying_ = true;
    d.verdict = CaptureVerdict::kCopyNow;
    return d;
  }
  capture_step_ = step;
  capture_checkpoint_ = checkpoint_id;
  d.verdict = CaptureVerdict::kLater;
  return d;
}

void ChunkMachine::CaptureCancelled(uint64_t checkpoint_id) {
  if (capture_step_ != 0 && capture_checkpoint_ == checkpoint_id) capture_step_ = 0;
}

Actions ChunkMachine::SnapshotDone() {
  Actions out;
  snapshot_copying_ = false;
  const int next_out = static_cast<int>((version_ + 1) % 2);
  if (phase_ == Phase::kStepBlocked && sends_[next_out] == 0) {
    phase_ = Phase::kStepScheduled;
    out.schedule_step = true;
    out.step_released_by_snapshot = true;
  }
  return out;
}

// ---- Backup side -----------------------------------------------------------------

PushDecision ChunkMachine::SeedOffered(uint64_t version) {
  if (retired() || role_ != Role::kBackup) {
    return Refuse(absl::FailedPreconditionError(absl::StrCat(What(), " is not a backup here")));
  }
  if (phase_ == Phase::kBackupSeeding || phase_ == Phase::kBackupStepping) {
    ReplyHint h;
    h.retry = true;
    return Refuse(absl::UnavailableError(absl::StrCat(
                      "seed of version ", version, " for ", What(), ": backup is busy (",
                      PhaseName(phase_), ")")),
                  h);
  }
  phase_ = Phase::kBackupSeeding;
  return Accept();
}

Actions ChunkMachine::SeedLanded(bool ok, uint64_t version) {
  Actions out;
  if (phase_ != Phase::kBackupSeeding) return out;
  if (ok) {
    version_ = version;
    first_version_ = version;
    seeded_ = true;
  }
  ResetSlots();
  phase_ = IdlePhase();
  // Promoted meanwhile: workers may already wait for this version.
  if (ok) TakeParked(version, &out);
  return out;
}

PushDecision ChunkMachine::SumOffered(uint64_t step, bool has_sum_buffer) {
  if (retired() || role_ != Role::kBackup) {
    return Refuse(absl::FailedPreconditionError(absl::StrCat(What(), " is not a backup here")));
  }
  if (!has_sum_buffer) {
    return Refuse(absl::InternalError(absl::StrCat(What(), ": no gradient buffer")));
  }
  if (phase_ == Phase::kBackupSeeding || phase_ == Phase::kBackupStepping) {
    ReplyHint h;
    h.retry = true;
    return Refuse(absl::UnavailableError(absl::StrCat("step ", step, " of ", What(),
                                                      ": backup is busy (", PhaseName(phase_),
                                                      ")")),
                  h);
  }
  if (phase_ != Phase::kBackupReady || !seeded_ || version_ != step) {
    ReplyHint h;
    h.need_seed = true;
    return Refuse(absl::FailedPreconditionError(absl::StrCat(
                      "step ", step, " of ", What(), ": backup is at version ", version_,
                      " (seeded ", seeded_ ? 1 : 0, "), the step starts from ", step)),
                  h);
  }
  phase_ = Phase::kBackupStepping;
  return Accept();
}

Actions ChunkMachine::SumLanded(bool ok) {
  Actions out;
  if (phase_ != Phase::kBackupStepping) return out;
  if (!ok) {
    phase_ = IdlePhase();
    return out;
  }
  out.apply_forwarded = true;
  return out;
}

Actions ChunkMachine::ForwardedStepDone(bool ok) {
  Actions out;
  if (phase_ != Phase::kBackupStepping) return out;
  if (ok) {
    ++version_;
    out.published = version_;
  }
  ResetSlots();
  phase_ = IdlePhase();
  if (ok) TakeParked(version_, &out);
  return out;
}

std::string ChunkMachine::DebugString() const {
  return absl::StrCat(What(), ": role=", role_ == Role::kPrimary ? "primary" : "backup",
                      " phase=", PhaseName(phase_), " version=", version_,
                      " full_slots=", full_slots_, " forward=", static_cast<int>(forward_),
                      " backup=", backup_, " backup_seeded=", backup_seeded_ ? 1 : 0,
                      " seeded=", seeded_ ? 1 : 0, " sends=", sends_[0], "/", sends_[1],
                      " parked=", parked_.size(), " copying=", snapshot_copying_ ? 1 : 0);
}

}  // namespace server
}  // namespace optimus
