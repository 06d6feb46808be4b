#include "server/staging.h"

#include <algorithm>
#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "kernels/cpu/passes.h"
#include "kernels/optimizer_spec.h"

namespace optimus {
namespace server {

// ---- StagingPool ---------------------------------------------------------------

std::shared_ptr<StagingPool> StagingPool::Create(uint64_t limit_bytes,
                                                 std::shared_ptr<MemoryAccount> account,
                                                 Registrar registrar, RunLater run_later) {
  return std::shared_ptr<StagingPool>(
      new StagingPool(limit_bytes, std::move(account), std::move(registrar), std::move(run_later)));
}

StagingPool::Lease::~Lease() {
  if (buffer_ != nullptr) pool_->Release(std::move(buffer_));
}

std::unique_ptr<StagingPool::Lease> StagingPool::TryAcquire(size_t bytes, uint64_t keep_free) {
  std::unique_ptr<Buffer> buffer;
  {
    absl::MutexLock lock(&mu_);
    if (bytes > limit_ || in_use_ + bytes > limit_ || limit_ - in_use_ - bytes < keep_free) {
      ++waits_;
      return nullptr;
    }
    auto it = kept_.find(bytes);
    if (it != kept_.end()) {
      buffer = std::move(it->second);
      kept_.erase(it);
      kept_bytes_ -= bytes;
    } else {
      // Make room among the kept buffers of other sizes (largest first).
      while (in_use_ + kept_bytes_ + bytes > limit_ && !kept_.empty()) {
        auto last = std::prev(kept_.end());
        kept_bytes_ -= last->first;
        kept_.erase(last);  // Freed (and deregistered) here: rare, small.
      }
    }
    in_use_ += bytes;
  }
  if (buffer == nullptr) {
    auto made = Buffer::Allocate(bytes, account_, registrar_, "gradient staging");
    if (!made.ok()) {
      // The shard's budget is shared with the jobs' state; say why once in
      // a while and let the caller wait like for a full pool.
      OPTIMUS_LOG(Warning, "shard", "staging buffer of ", bytes, " bytes: ",
                  made.status().message());
      absl::MutexLock lock(&mu_);
      in_use_ -= bytes;
      ++waits_;
      return nullptr;
    }
    buffer = *std::move(made);
  }
  return std::unique_ptr<Lease>(new Lease(shared_from_this(), std::move(buffer)));
}

void StagingPool::Release(std::unique_ptr<Buffer> buffer) {
  for (auto& fn : Return(std::move(buffer))) run_later_(std::move(fn));
}

void StagingPool::GiveBack(std::unique_ptr<Lease> lease) {
  if (lease == nullptr) return;
  std::unique_ptr<Buffer> buffer = std::move(lease->buffer_);
  lease.reset();
  for (auto& fn : Return(std::move(buffer))) fn();
}

std::vector<std::function<void()>> StagingPool::Return(std::unique_ptr<Buffer> buffer) {
  std::vector<std::function<void()>> wake;
  {
    absl::MutexLock lock(&mu_);
    const size_t bytes = buffer->size_bytes();
    in_use_ -= bytes;
    kept_bytes_ += bytes;
    // Most recently released first (find() returns the first of equal
    // sizes): the buffer reused next is the one most likely still in cache.
    kept_.emplace_hint(kept_.lower_bound(bytes), bytes, std::move(buffer));
    ++releases_;
    wake.swap(waiters_);
  }
  return wake;
}

bool StagingPool::has_waiters() const {
  absl::MutexLock lock(&mu_);
  return !waiters_.empty();
}

uint64_t StagingPool::releases() const {
  absl::MutexLock lock(&mu_);
  return releases_;
}

void StagingPool::WhenReleased(uint64_t seen, std::function<void()> fn) {
  {
    absl::MutexLock lock(&mu_);
    if (releases_ == seen) {
      waiters_.push_back(std::move(fn));
      return;
    }
  }
  run_later_(std::move(fn));  // Room may have come back since the caller looked.
}

absl::Status StagingPool::Admit(uint64_t hold_bytes, uint64_t landing_bytes,
                                absl::string_view what) {
  absl::MutexLock lock(&mu_);
  const uint64_t reserve = std::max(reserve_, landing_bytes);
  if (hold_bytes + reserve > limit_ || landing_bytes > limit_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " needs ", hold_bytes + reserve, " bytes of gradient staging in flight (",
        hold_bytes, " for its gradients, ", reserve,
        " kept for landing pushes in rank order); this shard's staging pool has ", limit_,
        ": raise the shard's --staging_mb or lower the job's chunk size"));
  }
  reserve_ = reserve;
  return absl::OkStatus();
}

uint64_t StagingPool::reserve() const {
  absl::MutexLock lock(&mu_);
  return reserve_;
}

uint64_t StagingPool::in_use() const {
  absl::MutexLock lock(&mu_);
  return in_use_;
}

uint64_t StagingPool::held() const {
  absl::MutexLock lock(&mu_);
  return in_use_ + kept_bytes_;
}

uint64_t StagingPool::waits() const {
  absl::MutexLock lock(&mu_);
  return waits_;
}

// ---- ChunkStaging -------------------------------------------------------------

ChunkStaging::ChunkStaging(uint32_t world_size, DType grad_dtype, size_t num_elems,
                           bool permanent, std::shared_ptr<StagingPool> pool)
    : world_size_(world_size),
      grad_dtype_(grad_dtype),
      num_elems_(num_elems),
      permanent_(permanent),
      folds_(pool->fold() && kernels::FoldsGradients(world_size, grad_dtype)),
      landing_bytes_(num_elems * DTypeSize(grad_dtype)),
      slots_bytes_(num_elems * world_size * DTypeSize(grad_dtype)),
      hold_bytes_(folds_ ? num_elems * 4 : slots_bytes_),
      pool_(std::move(pool)),
      ranks_(world_size),
      step_slots_(!folds_) {}

absl::StatusOr<std::shared_ptr<ChunkStaging>> ChunkStaging::Create(
    uint32_t world_size, DType grad_dtype, size_t num_elems, bool permanent,
    std::shared_ptr<StagingPool> pool, std::shared_ptr<MemoryAccount> account,
    const Registrar& registrar, absl::string_view what) {
  std::shared_ptr<ChunkStaging> s(
      new ChunkStaging(world_size, grad_dtype, num_elems, permanent, std::move(pool)));
  if (absl::Status st = s->pool_->Admit(s->hold_bytes(), s->folds_ ? s->landing_bytes_ : 0, what);
      !st.ok()) {
    return st;
  }
  if (permanent) {
    auto hold = Buffer::Allocate(s->hold_bytes_, std::move(account), registrar,
                                 absl::StrCat("the gradients of ", what));
    if (!hold.ok()) return hold.status();
    absl::MutexLock lock(&s->mu_);
    s->permanent_hold_ = *std::move(hold);
  }
  return s;
}

uint8_t* ChunkStaging::HoldData() const {
  if (permanent_hold_ != nullptr) return permanent_hold_->data();
  return hold_ != nullptr ? hold_->data() : nullptr;
}

const transport::MemoryRegion* ChunkStaging::HoldRegion() const {
  if (permanent_hold_ != nullptr) return permanent_hold_->region();
  return hold_ != nullptr ? hold_->region() : nullptr;
}

void ChunkStaging::BeginStep(uint64_t step) {
  if (active_ && step_ == step) return;
  // An earlier step that never reached its kernel (a failover reset the
  // chunk's slots): drop it. Its readers are done (busy_ ends quickly).
  mu_.Await(absl::Condition(
      +[](bool* busy) { return !*busy; }, &busy_));
  if (active_) FreeStep();
  active_ = true;
  step_ = step;
}

void ChunkStaging::FreeStep() {
  hold_.reset();
  for (Rank& r : ranks_) r = Rank();
  known_ = 0;
  folded_ = 0;
  sum_started_ = false;
  used_ = false;
  fold_failed_ = false;
  step_slots_ = !folds_;
  active_ = false;
}

std::unique_ptr<StagingPool::Lease> ChunkStaging::AcquireUnlocked(size_t bytes,
                                                                  uint64_t keep_free) {
  // A new buffer is registered with the data plane, which may wait for the
  // transport's progress thread; that thread may be waiting for mu_ (a push
  // landing here). So mu_ is let go meanwhile; acquiring_ keeps others from
  // placing on this chunk until it is back.
  acquiring_ = true;
  mu_.Unlock();
  std::unique_ptr<StagingPool::Lease> lease = pool_->TryAcquire(bytes, keep_free);
  mu_.Lock();
  acquiring_ = false;
  if (missed_) {
    // Someone found this chunk busy meanwhile: try its waiters again once
    // this thread is done (a pool release may never come to wake them).
    missed_ = false;
    std::weak_ptr<ChunkStaging> weak = weak_from_this();
    pool_->Defer([weak] {
      std::shared_ptr<ChunkStaging> self = weak.lock();
      if (self == nullptr) return;
      std::vector<std::pair<std::function<void(Landing)>, Landing>> again;
      {
        absl::MutexLock lock(&self->mu_);
        again = self->Unblock();
      }
      self->RunUnblocked(std::move(again));
    });
  }
  return lease;
}

uint32_t ChunkStaging::NextNeeded() const {
  for (uint32_t r = folded_; r < world_size_; ++r) {
    if (!ranks_[r].known) return r;
  }
  return world_size_;
}

bool ChunkStaging::StillWanted(uint64_t step, uint32_t rank) const {
  return !abandoned_ && active_ && step_ == step && !ranks_[rank].known &&
         ranks_[rank].landing == nullptr;
}

bool ChunkStaging::SlotsFit() const {
  return !folds_ || (!permanent_ && slots_bytes_ + pool_->reserve() <= pool_->limit());
}

bool ChunkStaging::Place(uint32_t rank, Landing* out) {
  if (acquiring_) {
    missed_ = true;  // The acquiring thread has waiters tried again after.
    return false;
  }
  const uint64_t step = step_;
  if (HoldData() == nullptr) {
    // W slots whenever the pool could ever hold them (with the reserve left
    // free): the step then reads the pushes where they landed, with no fold
    // pass, and until they fit this chunk's pushes wait for another step to
    // give its buffers back (slot holders only wait for their own pushes,
    // so room always comes back). An fp32 sum to fold into only when W
    // slots never fit.
    const bool slots = SlotsFit();
    std::unique_ptr<StagingPool::Lease> hold =
        AcquireUnlocked(slots ? slots_bytes_ : hold_bytes_, pool_->reserve());
    if (hold == nullptr || !StillWanted(step, rank) || HoldData() != nullptr) return false;
    hold_ = std::move(hold);
    step_slots_ = slots;
  }
  if (step_slots_) {
    out->dst = HoldData() + rank * landing_bytes_;
    out->region = HoldRegion();
    return true;
  }
  // In rank order, a landing may use the pool's reserve: it is folded and
  // freed without waiting for any other push.
  const bool in_order = rank == NextNeeded();
  std::unique_ptr<StagingPool::Lease> lease =
      AcquireUnlocked(landing_bytes_, in_order ? 0 : pool_->reserve());
  if (lease == nullptr || !StillWanted(step, rank) || HoldData() == nullptr) return false;
  out->dst = lease->data();
  out->region = lease->region();
  ranks_[rank].landing = std::move(lease);
  return true;
}

ChunkStaging::Landing ChunkStaging::Land(uint64_t step, uint32_t rank) {
  Landing l;
  std::vector<std::pair<std::function<void(Landing)>, Landing>> ready;
  {
    absl::MutexLock lock(&mu_);
    if (abandoned_ || rank >= world_size_) return l;
    BeginStep(step);
    // Pushes already waiting go first (rank order decides among them).
    bool others_wait = false;
    for (const Rank& r : ranks_) others_wait |= r.waiting;
    if (!others_wait && Place(rank, &l)) {
      // Waiters that found this chunk busy acquiring (mu_ was let go).
      ready = Unblock();
    }
  }
  RunUnblocked(std::move(ready));
  return l;
}

void ChunkStaging::Wait(uint64_t step, uint32_t rank, std::function<void(Landing)> go) {
  std::vector<std::pair<std::function<void(Landing)>, Landing>> ready;
  {
    absl::MutexLock lock(&mu_);
    if (abandoned_ || rank >= world_size_) return;
    BeginStep(step);
    ranks_[rank].waiting = true;
    ranks_[rank].go = std::move(go);
    ready = Unblock();  // Room may have appeared since Land.
  }
  RunUnblocked(std::move(ready));
}

std::vector<std::pair<std::function<void(ChunkStaging::Landing)>, ChunkStaging::Landing>>
ChunkStaging::Unblock() {
  std::vector<std::pair<std::function<void(Landing)>, Landing>> ready;
  if (abandoned_ || !active_) return ready;
  // Before any attempt: a release after this point wakes us (see below).
  const uint64_t releases = pool_->releases();
  bool any_waiting = false;
  // Place may let mu_ go (AcquireUnlocked): waiters may come meanwhile, so
  // go round again while something was placed.
  for (bool progress = true; progress && !abandoned_ && active_;) {
    progress = false;
    any_waiting = false;
    // The next rank in order first: it may use the reserve.
    std::vector<uint32_t> order;
    const uint32_t next = NextNeeded();
    if (next < world_size_) order.push_back(next);
    for (uint32_t r = 0; r < world_size_; ++r) {
      if (r != next) order.push_back(r);
    }
    for (uint32_t r : order) {
      if (!ranks_[r].waiting) continue;
      Landing l;
      if (!Place(r, &l)) {
        any_waiting |= ranks_[r].waiting;
        // No sum or slots yet: every other rank needs the same room.
        if (any_waiting && HoldData() == nullptr) break;
        continue;
      }
      Rank& rk = ranks_[r];
      if (!rk.waiting) continue;  // Abandoned meanwhile (its go is gone).
      rk.waiting = false;
      ready.emplace_back(std::move(rk.go), l);
      rk.go = nullptr;
      progress = true;
    }
  }
  if (any_waiting && Foldable() && !fold_pending_) {
    // Landed slots of this chunk hold room its waiting pushes need.
    fold_pending_ = true;
    std::weak_ptr<ChunkStaging> weak = weak_from_this();
    pool_->Defer([weak] {
      std::shared_ptr<ChunkStaging> self = weak.lock();
      if (self != nullptr) self->Fold(self->pool_->kernel_pool());
    });
  }
  if (any_waiting && !pool_callback_) {
    pool_callback_ = true;
    std::weak_ptr<ChunkStaging> weak = weak_from_this();
    pool_->WhenReleased(releases, [weak] {
      std::shared_ptr<ChunkStaging> self = weak.lock();
      if (self == nullptr) return;
      std::vector<std::pair<std::function<void(Landing)>, Landing>> again;
      {
        absl::MutexLock lock(&self->mu_);
        self->pool_callback_ = false;
        again = self->Unblock();
      }
      self->RunUnblocked(std::move(again));
    });
  }
  return ready;
}

void ChunkStaging::RunUnblocked(
    std::vector<std::pair<std::function<void(Landing)>, Landing>> ready) {
  for (auto& [go, landing] : ready) go(landing);
}

void ChunkStaging::NoGrad(uint64_t step, uint32_t rank) {
  absl::MutexLock lock(&mu_);
  if (abandoned_ || rank >= world_size_) return;
  BeginStep(step);
  Rank& r = ranks_[rank];
  if (r.known) return;
  r.known = true;
  r.has_grad = false;
  if (++known_ == world_size_) all_landed_ = absl::Now();
}

bool ChunkStaging::Landed(uint64_t step, uint32_t rank, bool ok) {
  absl::MutexLock lock(&mu_);
  if (abandoned_ || !active_ || step_ != step || rank >= world_size_) return false;
  Rank& r = ranks_[rank];
  if (r.known) return false;
  if (!ok) {
    r.landing.reset();  // A push sent again lands anew.
    return false;
  }
  r.known = true;
  r.has_grad = true;
  if (++known_ == world_size_) {
    all_landed_ = absl::Now();
    return false;  // The step folds the rest itself.
  }
  // Folding early costs a pass over the sum each time; it is worth it only
  // to free landing buffers someone waits for. Otherwise the step folds all
  // the slots in one pass.
  bool waiting_here = false;
  for (const Rank& rk : ranks_) waiting_here |= rk.waiting;
  return Foldable() && (waiting_here || pool_->has_waiters());
}

bool ChunkStaging::Foldable() const {
  return !step_slots_ && active_ && !busy_ && !used_ && !abandoned_ && HoldData() != nullptr &&
         folded_ < world_size_ && ranks_[folded_].known;
}

void ChunkStaging::FoldRun(kernels::ThreadPool* pool) {
  uint32_t end = folded_;
  std::vector<const void*> slots;
  while (end < world_size_ && ranks_[end].known) {
    if (ranks_[end].has_grad) slots.push_back(ranks_[end].landing->data());
    ++end;
  }
  if (end == folded_) return;
  float* sum = reinterpret_cast<float*>(HoldData());
  const bool start = !sum_started_;
  absl::Status s;
  if (!slots.empty()) {
    busy_ = true;
    mu_.Unlock();
    s = kernels::AccumulateGrads(sum, start, absl::MakeConstSpan(slots), grad_dtype_,
                                 num_elems_, pool);
    mu_.Lock();
    busy_ = false;
  }
  if (!s.ok()) {
    // Our own invariant: the buffers are the job's sizes. Skip the step.
    OPTIMUS_LOG(Error, "shard", "folding gradients failed: ", s.ToString());
    fold_failed_ = true;
  }
  if (!slots.empty()) sum_started_ = true;
  for (uint32_t r = folded_; r < end; ++r) ranks_[r].landing.reset();
  folded_ = end;
  if (abandoned_) FreeStep();
}

void ChunkStaging::Fold(kernels::ThreadPool* pool) {
  std::vector<std::pair<std::function<void(Landing)>, Landing>> ready;
  {
    absl::MutexLock lock(&mu_);
    fold_pending_ = false;
    while (Foldable()) FoldRun(pool);
    ready = Unblock();  // Freed landings may let waiting pushes in.
  }
  RunUnblocked(std::move(ready));
}

ChunkStaging::Inputs ChunkStaging::Use(uint64_t step, const std::vector<uint32_t>& ranks,
                                       kernels::ThreadPool* pool) {
  absl::MutexLock lock(&mu_);
  Inputs in;
  mu_.Await(absl::Condition(
      +[](bool* busy) { return !*busy; }, &busy_));
  in.all_landed = all_landed_;
  if (ranks.empty()) return in;  // Nothing to read (a step with no gradient).
  if (abandoned_ || !active_ || step_ != step || HoldData() == nullptr) {
    in.status = absl::InternalError(absl::StrCat(
        "the gradients of step ", step, " are not staged (holding step ", step_,
        active_ ? "" : ", inactive", abandoned_ ? ", abandoned" : "", ")"));
    return in;
  }
  used_ = true;
  if (step_slots_) {
    for (uint32_t r : ranks) in.grads.push_back(HoldData() + r * landing_bytes_);
    in.dtype = grad_dtype_;
  } else {
    while (folded_ < world_size_ && ranks_[folded_].known) FoldRun(pool);
    if (folded_ < world_size_) {
      in.status = absl::InternalError(absl::StrCat("rank ", folded_, " of step ", step,
                                                   " has not landed"));
      return in;
    }
    if (fold_failed_) {
      in.status = absl::InternalError("folding the gradients failed");
      return in;
    }
    if (sum_started_) in.grads.push_back(HoldData());
    in.dtype = DType::kFp32;
  }
  busy_ = true;  // Until Unuse or StepDone.
  return in;
}

void ChunkStaging::Unuse() {
  absl::MutexLock lock(&mu_);
  busy_ = false;
  if (abandoned_) FreeStep();
}

void ChunkStaging::StepDone(uint64_t step) {
  std::unique_ptr<StagingPool::Lease> hold;
  {
    absl::MutexLock lock(&mu_);
    busy_ = false;
    if (abandoned_ || (active_ && step_ == step)) {
      hold = std::move(hold_);
      FreeStep();
    }
  }
  // Outside mu_: the pushes waiting for this room are let in from here.
  pool_->GiveBack(std::move(hold));
}

std::string ChunkStaging::DebugString() const {
  absl::MutexLock lock(&mu_);
  std::string ranks;
  for (const Rank& r : ranks_) {
    ranks += r.known ? (r.has_grad ? 'L' : 'N') : r.waiting ? 'w' : r.landing ? 'r' : '.';
  }
  return absl::StrCat("staging step=", step_, active_ ? "" : " inactive", " hold=",
                      HoldData() != nullptr, step_slots_ ? " slots" : " sum",
                      " folded=", folded_, " known=", known_, " ranks=", ranks,
                      busy_ ? " busy" : "", used_ ? " used" : "",
                      acquiring_ ? " acquiring" : "", pool_callback_ ? " callback" : "",
                      abandoned_ ? " abandoned" : "", " pool_in_use=", pool_->in_use(),
                      " reserve=", pool_->reserve());
}

void ChunkStaging::Abandon() {
  std::vector<std::function<void(Landing)>> dropped;
  {
    absl::MutexLock lock(&mu_);
    abandoned_ = true;
    for (Rank& r : ranks_) {
      if (r.go) dropped.push_back(std::move(r.go));
      r.go = nullptr;
      r.waiting = false;
    }
    if (!busy_) FreeStep();
  }
  // Destroyed outside the lock: they may hold kept payloads.
  dropped.clear();
}

}  // namespace server
}  // namespace optimus
