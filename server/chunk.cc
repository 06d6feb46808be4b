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
    case Phase::kReducing: return "reducing";
    case Phase::kAwaitingCommit: return "awaiting_commit";
  }
  return "unknown";
}

bool Actions::empty() const {
  return refusals.empty() && acks.empty() && !reduce && sends.empty() && !schedule_step && !apply_forwarded &&
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
    : name_(name),
      world_size_(world_size),
      role_(role),
      slots_(world_size, Slot::kEmpty),
      has_grad_(world_size, false),
      waiters_(world_size),
      waiting_(world_size, false) {}

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
  std::fill(has_grad_.begin(), has_grad_.end(), false);
  std::fill(waiting_.begin(), waiting_.end(), false);
  held_.clear();
  full_slots_ = 0;
  params_set_ = false;
  noop_ = false;
  partial_ready_ = false;
  partial_ = 0.0;
  commit_have_ = false;
  commit_coef_ = 1.0f;
  commit_skip_ = false;
  running_skip_ = false;
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

void ChunkMachine::Restored(uint64_t version, uint64_t optimizer_steps, float last_lr) {
  if (retired()) return;
  version_ = version;
  first_version_ = version;
  applied_ = optimizer_steps;
  last_lr_ = last_lr;
  last_valid_ = false;
  last_commit_valid_ = false;
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
  for (const PullReply& p : parked_) out.refusals.push_back(Refusal{p.to, why, hint, true});
  parked_.clear();
  for (uint32_t r = 0; r < world_size_; ++r) {
    if (waiting_[r]) out.refusals.push_back(Refusal{waiters_[r], why, hint});
    waiting_[r] = false;
  }
  for (const Requester& h : held_) out.refusals.push_back(Refusal{h, why, hint});
  held_.clear();
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

Actions ChunkMachine::InitLanded(bool ok, uint64_t optimizer_steps, float last_lr) {
  Actions out;
  if (phase_ != Phase::kReceivingInit) return out;
  if (!ok) {
    phase_ = Phase::kEmpty;
    return out;
  }
  version_ = 1;
  first_version_ = 1;
  applied_ = optimizer_steps;
  last_lr_ = last_lr;
  phase_ = Phase::kCollecting;
  TakeParked(1, &out);
  return out;
}

PushDecision ChunkMachine::PushRequested(uint64_t step, uint32_t rank, bool resend,
                                         const StepParams& params, bool has_grad,
                                         Requester from) {
  if (retired() || role_ != Role::kPrimary) return Refuse(NotPrimary(self_, What()), RefreshMap());
  if (rank >= world_size_) {
    return Refuse(absl::InvalidArgumentError(
        absl::StrCat("push from rank ", rank, " but the job has world size ", world_size_)));
  }
  if (version_ == 0) {
    return Refuse(absl::FailedPreconditionError(absl::StrCat(What(), " has no initial values yet")));
  }
  if (frozen_ && has_grad) {
    return Refuse(absl::InvalidArgumentError(absl::StrCat(
        "push with a gradient for ", What(), ", a frozen tensor: push it with no gradient")));
  }
  // A push sent again after a failover whose step is already applied.
  if (step < version_ && resend) {
    PushDecision d = Duplicate();
    d.ack.to = from;
    d.ack.duplicate = true;
    if (commit_round_ && last_valid_ && step + 1 == version_) {
      d.ack.has_partial = true;
      d.ack.partial = last_partial_;
    }
    return d;
  }
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
  // pushes are idempotent. With the round, the answer carries the partial,
  // so it waits for it.
  if (phase_ != Phase::kCollecting || slots_[rank] != Slot::kEmpty) {
    if (phase_ == Phase::kBackupSeeding || phase_ == Phase::kBackupStepping) {
      // Promoted while the primary's last step lands here: that step's
      // pushes are answered once it is applied (sent again by then).
      return Refuse(absl::UnavailableError(absl::StrCat(What(), " is being seeded; retry")),
                    RefreshMap());
    }
    PushDecision d = Duplicate();
    d.ack.to = from;
    d.ack.duplicate = true;
    if (commit_round_) {
      if (partial_ready_ || noop_) {
        d.ack.has_partial = true;
        d.ack.partial = partial_;
      } else {
        // Answered with the partial, as the first copy is.
        held_.push_back(from);
        d.verdict = PushVerdict::kHeld;
      }
    }
    return d;
  }
  if (params_set_ && params != params_) {
    return Refuse(absl::InvalidArgumentError(absl::StrCat(
        "push for step ", step, " of ", What(), " from rank ", rank, " carries lr ", params.lr,
        " and gradient multiplier ", params.grad_mult, ", but the step's other pushes carry lr ",
        params_.lr, " and multiplier ", params_.grad_mult,
        ": every rank must push the same learning rate and loss scale")));
  }
  params_set_ = true;
  params_ = params;
  slots_[rank] = Slot::kReceiving;
  has_grad_[rank] = has_grad;
  waiters_[rank] = from;
  waiting_[rank] = true;
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
  if (!commit_round_) {
    out.acks.push_back(Ack{waiters_[rank]});
    waiting_[rank] = false;
  }
  if (++full_slots_ == world_size_) AllPushesIn(&out);
  return out;
}

void ChunkMachine::AllPushesIn(Actions* out) {
  noop_ = frozen_ || std::none_of(has_grad_.begin(), has_grad_.end(), [](bool b) { return b; });
  if (!commit_round_) return TryStartStep(out);
  if (noop_) {
    // Nothing to clip or skip: the partial is 0 and the step needs no commit.
    partial_ready_ = true;
    partial_ = 0.0;
    for (uint32_t r = 0; r < world_size_; ++r) {
      if (!waiting_[r]) continue;
      out->acks.push_back(Ack{waiters_[r], false, true, 0.0});
      waiting_[r] = false;
    }
    for (const Requester& h : held_) out->acks.push_back(Ack{h, true, true, 0.0});
    held_.clear();
    return TryStartStep(out);
  }
  phase_ = Phase::kReducing;
  out->reduce = true;
}

ReduceInputs ChunkMachine::GetReduceInputs() const {
  ReduceInputs in;
  if (phase_ != Phase::kReducing) return in;
  in.run = true;
  in.step = version_;
  in.params = params_;
  for (uint32_t r = 0; r < world_size_; ++r) {
    if (has_grad_[r]) in.ranks.push_back(r);
  }
  return in;
}

Actions ChunkMachine::ReduceDone(double sum_squares) {
  Actions out;
  if (phase_ != Phase::kReducing) return out;
  partial_ready_ = true;
  partial_ = sum_squares;
  for (uint32_t r = 0; r < world_size_; ++r) {
    if (!waiting_[r]) continue;
    out.acks.push_back(Ack{waiters_[r], false, true, partial_});
    waiting_[r] = false;
  }
  for (const Requester& h : held_) out.acks.push_back(Ack{h, true, true, partial_});
  held_.clear();
  phase_ = Phase::kAwaitingCommit;
  if (commit_have_) TryStartStep(&out);
  return out;
}

Actions ChunkMachine::CommitRequested(uint64_t step, float clip_coef, bool skip, Requester from) {
  Actions out;
  auto refuse = [&](absl::Status s, ReplyHint hint = {}) {
    out.refusals.push_back(Refusal{from, std::move(s), hint});
    return out;
  };
  if (retired() || role_ != Role::kPrimary) return refuse(NotPrimary(self_, What()), RefreshMap());
  if (!commit_round_) {
    return refuse(absl::FailedPreconditionError(absl::StrCat(
        "commit for ", What(), ": the job neither clips nor skips non-finite steps")));
  }
  if (!(clip_coef > 0.0f) || clip_coef > 1.0f) {
    return refuse(absl::InvalidArgumentError(
        absl::StrCat("commit for step ", step, " of ", What(), " has clip coefficient ",
                     clip_coef, "; it must be in (0, 1]")));
  }
  if (version_ == 0) {
    return refuse(absl::FailedPreconditionError(absl::StrCat(What(), " has no initial values yet")));
  }
  auto disagree = [&](float coef, bool was_skip) {
    return refuse(absl::InvalidArgumentError(absl::StrCat(
        "commit for step ", step, " of ", What(), " says clip coefficient ", clip_coef,
        skip ? " (skip)" : "", " but the step was committed with ", coef,
        was_skip ? " (skip)" : "", ": workers disagree on the global gradient norm")));
  };
  if (step < version_) {
    if (step + 1 == version_ && last_commit_valid_ &&
        (last_coef_ != clip_coef || last_skip_ != skip)) {
      return disagree(last_coef_, last_skip_);
    }
    out.acks.push_back(Ack{from, /*duplicate=*/true});
    return out;
  }
  if (step > version_) {
    return refuse(absl::OutOfRangeError(absl::StrCat("commit for step ", step, " of ", What(),
                                                     " is ahead: the chunk is at step ",
                                                     version_)));
  }
  if (commit_have_) {
    if (commit_coef_ != clip_coef || commit_skip_ != skip) {
      return disagree(commit_coef_, commit_skip_);
    }
    out.acks.push_back(Ack{from, /*duplicate=*/true});
    return out;
  }
  const bool collecting = phase_ == Phase::kCollecting || phase_ == Phase::kReducing ||
                          phase_ == Phase::kAwaitingCommit;
  if (!collecting || noop_) {
    // Under way without one (no rank had a gradient), or a promoted backup
    // applying the primary's step: nothing to decide.
    out.acks.push_back(Ack{from, /*duplicate=*/true});
    return out;
  }
  commit_have_ = true;
  commit_coef_ = clip_coef;
  commit_skip_ = skip;
  out.acks.push_back(Ack{from});
  if (phase_ == Phase::kAwaitingCommit) TryStartStep(&out);
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
  running_skip_ = noop_ || (commit_have_ && commit_skip_);
  plan.skip = running_skip_;
  plan.params = params_;
  plan.clip_coef = commit_have_ ? commit_coef_ : 1.0f;
  plan.optimizer_step = applied_ + 1;
  plan.partial = partial_;
  for (uint32_t r = 0; r < world_size_; ++r) {
    if (has_grad_[r]) plan.ranks.push_back(r);
  }
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
  // The state arrays now hold the step (a seed sent before publication
  // carries these counts).
  if (!running_skip_) ++applied_;
  if (params_set_) last_lr_ = params_.lr;
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
  last_valid_ = partial_ready_;
  last_partial_ = partial_;
  last_commit_valid_ = commit_have_;
  last_coef_ = commit_coef_;
  last_skip_ = commit_skip_;
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
                    phase_ == Phase::kStepScheduled || phase_ == Phase::kReducing ||
                    phase_ == Phase::kAwaitingCommit;
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

Actions ChunkMachine::SeedLanded(bool ok, uint64_t version, uint64_t optimizer_steps,
                                 float last_lr) {
  Actions out;
  if (phase_ != Phase::kBackupSeeding) return out;
  if (ok) {
    version_ = version;
    first_version_ = version;
    seeded_ = true;
    applied_ = optimizer_steps;
    last_lr_ = last_lr;
    last_valid_ = false;
    last_commit_valid_ = false;
  }
  ResetSlots();
  phase_ = IdlePhase();
  // Promoted meanwhile: workers may already wait for this version.
  if (ok) TakeParked(version, &out);
  return out;
}

PushDecision ChunkMachine::SumOffered(uint64_t step, bool has_sum_buffer,
                                      const ForwardedStep& f) {
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
  forwarded_ = f;
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
    if (!forwarded_.skip) ++applied_;
    last_lr_ = forwarded_.lr;
    last_valid_ = true;
    last_partial_ = forwarded_.partial;
    last_commit_valid_ = false;
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
                      " parked=", parked_.size(), " copying=", snapshot_copying_ ? 1 : 0,
                      " applied=", applied_, " commit=", commit_have_ ? 1 : 0);
}

}  // namespace server
}  // namespace optimus
