// Where pushed gradients land on a shard, and how a chunk's W gradients are
// summed as they arrive.
//
// StagingPool: one byte budget per shard (--staging_mb) for the gradient
// buffers of the chunk-steps in flight. Buffers are registered with the
// data plane once and kept for reuse (no registration per transfer); a
// push that finds no room waits for one (its payload stays at the worker,
// as rendezvous allows) instead of failing.
//
// ChunkStaging: one chunk's gradients for the step it is collecting, held
// one of two ways, chosen when the step takes its room from the pool:
//  - slots: W slots of the grad dtype, rank r's push landing in slot r; the
//    step sums them itself (FusedStep). Always so when W slots cost at most
//    the fp32 sum (W x 2 B <= 4 B: W <= 2 for bf16); for larger W whenever
//    the pool could hold W slots with its reserve left free: a chunk-step
//    then waits for its W slots (its pushes wait at their workers) rather
//    than folding, since the folds cost more memory traffic than the wait
//    (each pass reads and writes the sum besides the slot);
//  - fold: an fp32 running sum, when W slots never fit (W x landing +
//    reserve > the pool) or the job holds its gradients until the commit
//    (then every chunk's step waits for every chunk's pushes, which the
//    pool cannot hold as slots). Rank r's push lands in a landing buffer
//    and is folded into the sum (kernels::AccumulateGrads) once ranks
//    0..r-1 are, on a step thread, and its buffer goes back to the pool.
//    Folds run early only while pushes wait for room; otherwise the step
//    folds all the landed ranks in one pass. The sum is in rank order, so
//    the step from it is bit for bit the step over the W slots: replicas,
//    checkpoints and the torch comparisons see no difference.
// The sum (or the W slots) is taken from the pool when a step's first
// gradient arrives and given back when the step's kernel is done; jobs
// whose steps wait for a worker's commit (clipping, skipping non-finite
// steps) hold every chunk's sum until the commit, so theirs is allocated
// with the chunk instead (kernels::ShardBytesPerElem counts it).
//
// No deadlock by construction: a chunk-step holding W slots waits only for
// its own pushes (workers send every push without waiting for others to
// land), so its room always comes back. A chunk-step that holds its sum can
// always finish, because the pool keeps `reserve` bytes that only the
// landing of a chunk's next rank in order (which is folded and freed at
// once) may take; a sum, W slots, and landings out of rank order are
// granted only with the reserve left free. Pushes of a chunk-step not yet
// granted its sum or slots wait.
//
// Thread-safety: both classes are thread-safe. ChunkStaging::mu_ is taken
// before StagingPool::mu_ and nothing else; it is let go while a new pool
// buffer is registered (registration may wait for the transport's progress
// thread, which may be waiting for mu_); callbacks run after it is
// released; it is never held by the caller of a ChunkMachine event.
#ifndef OPTIMUS_SERVER_STAGING_H_
#define OPTIMUS_SERVER_STAGING_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/dtype.h"
#include "kernels/cpu/thread_pool.h"
#include "server/job_table.h"
#include "transport/transport.h"

namespace optimus {
namespace server {

class StagingPool : public std::enable_shared_from_this<StagingPool> {
 public:
  // Runs a closure later on a thread that holds no lock (the shard's step
  // executor); used to wake waiting pushes after a release.
  using RunLater = std::function<void(std::function<void()>)>;

  // limit_bytes: the most bytes of buffers held, in use or kept for reuse.
  // Buffers are accounted in `account` while they exist.
  static std::shared_ptr<StagingPool> Create(uint64_t limit_bytes,
                                             std::shared_ptr<MemoryAccount> account,
                                             Registrar registrar, RunLater run_later);

  // A buffer from the pool; goes back to it when destroyed.
  class Lease {
   public:
    ~Lease();
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    uint8_t* data() const { return buffer_->data(); }
    size_t size_bytes() const { return buffer_->size_bytes(); }
    const transport::MemoryRegion* region() const { return buffer_->region(); }

   private:
    friend class StagingPool;
    Lease(std::shared_ptr<StagingPool> pool, std::unique_ptr<Buffer> buffer)
        : pool_(std::move(pool)), buffer_(std::move(buffer)) {}
    std::shared_ptr<StagingPool> pool_;
    std::unique_ptr<Buffer> buffer_;
  };

  // A buffer of exactly `bytes` (zeroed only when newly made) if, once
  // granted, at least `keep_free` bytes of the budget stay unused; else
  // null (the caller waits: WhenReleased). A buffer of that size kept from
  // earlier is reused, registration included.
  std::unique_ptr<Lease> TryAcquire(size_t bytes, uint64_t keep_free) ABSL_LOCKS_EXCLUDED(mu_);
  // Releases so far: read it before trying TryAcquire, pass it to
  // WhenReleased, and no release in between is missed.
  uint64_t releases() const ABSL_LOCKS_EXCLUDED(mu_);
  // Runs fn (through run_later) once after the next release, or at once if
  // there were releases since `seen` (a releases() value).
  void WhenReleased(uint64_t seen, std::function<void()> fn) ABSL_LOCKS_EXCLUDED(mu_);

  // The bytes kept for in-order landings: raised to `bytes` (a job's
  // landing buffer) if smaller. OK when the budget can hold a chunk's sum
  // and its landing with it; RESOURCE_EXHAUSTED (what to raise) otherwise.
  absl::Status Admit(uint64_t hold_bytes, uint64_t landing_bytes, absl::string_view what)
      ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t reserve() const ABSL_LOCKS_EXCLUDED(mu_);
  // Gives `lease` back now and runs what waits for room on the calling
  // thread, which must hold no lock, instead of through run_later: the
  // next chunk-step's pushes start landing before the step threads get to
  // the wake-ups queued behind other steps.
  void GiveBack(std::unique_ptr<Lease> lease) ABSL_LOCKS_EXCLUDED(mu_);
  // Runs fn through run_later (on a thread that holds no lock).
  void Defer(std::function<void()> fn) { run_later_(std::move(fn)); }
  // Someone waits for room (WhenReleased).
  bool has_waiters() const ABSL_LOCKS_EXCLUDED(mu_);
  // The kernel thread pool folds run on (the shard's; null: the caller's
  // thread). Set before any chunk is created.
  void set_kernel_pool(kernels::ThreadPool* pool) { kernel_pool_ = pool; }
  kernels::ThreadPool* kernel_pool() const { return kernel_pool_; }

  // False: chunk-steps hold W slots and never fold (the layout before the
  // pool, kept as the benchmarks' baseline: --fold_gradients=false). Set
  // before any chunk is created.
  void set_fold(bool fold) { fold_ = fold; }
  bool fold() const { return fold_; }

  uint64_t limit() const { return limit_; }
  uint64_t in_use() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t held() const ABSL_LOCKS_EXCLUDED(mu_);  // In use + kept for reuse.
  uint64_t waits() const ABSL_LOCKS_EXCLUDED(mu_);  // TryAcquire calls that found no room.

 private:
  StagingPool(uint64_t limit_bytes, std::shared_ptr<MemoryAccount> account, Registrar registrar,
              RunLater run_later)
      : limit_(limit_bytes),
        account_(std::move(account)),
        registrar_(std::move(registrar)),
        run_later_(std::move(run_later)) {}
  void Release(std::unique_ptr<Buffer> buffer) ABSL_LOCKS_EXCLUDED(mu_);
  // Takes the buffer back; returns the waiters to wake.
  std::vector<std::function<void()>> Return(std::unique_ptr<Buffer> buffer)
      ABSL_LOCKS_EXCLUDED(mu_);

  const uint64_t limit_;
  const std::shared_ptr<MemoryAccount> account_;
  const Registrar registrar_;
  const RunLater run_later_;
  bool fold_ = true;
  kernels::ThreadPool* kernel_pool_ = nullptr;
  mutable absl::Mutex mu_;
  uint64_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t kept_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reserve_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t waits_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t releases_ ABSL_GUARDED_BY(mu_) = 0;
  std::multimap<size_t, std::unique_ptr<Buffer>> kept_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> waiters_ ABSL_GUARDED_BY(mu_);
};

class ChunkStaging : public std::enable_shared_from_this<ChunkStaging> {
 public:
  // `permanent`: the gradients are held for the chunk's life (jobs with the
  // commit round), allocated now in `account`.
  static absl::StatusOr<std::shared_ptr<ChunkStaging>> Create(
      uint32_t world_size, DType grad_dtype, size_t num_elems, bool permanent,
      std::shared_ptr<StagingPool> pool, std::shared_ptr<MemoryAccount> account,
      const Registrar& registrar, absl::string_view what);

  // The job's steps may fold (W x the grad dtype > 4 B, the pool folds);
  // each step still takes W slots instead when the pool can hold them.
  bool folds() const { return folds_; }
  size_t landing_bytes() const { return landing_bytes_; }
  // The least a step takes from the pool while in flight: the fp32 sum
  // (folds()) or the W slots; 0 when permanent.
  size_t hold_bytes() const { return permanent_ ? 0 : hold_bytes_; }

  // Where rank `rank`'s gradient for `step` lands.
  struct Landing {
    uint8_t* dst = nullptr;
    const transport::MemoryRegion* region = nullptr;
  };
  // A landing place now, or none: then the caller keeps the payload and
  // calls Wait. The machine accepted the push (one landing per rank and
  // step).
  Landing Land(uint64_t step, uint32_t rank) ABSL_LOCKS_EXCLUDED(mu_);
  // `go` runs once, with no lock held, when the rank has a landing place
  // (from a step thread or the thread that freed it), or never if the chunk
  // is abandoned first.
  void Wait(uint64_t step, uint32_t rank, std::function<void(Landing)> go)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Rank pushed no gradient for `step`.
  void NoGrad(uint64_t step, uint32_t rank) ABSL_LOCKS_EXCLUDED(mu_);
  // The payload landed (ok) or did not (its landing buffer is freed; a
  // push sent again lands anew). True: call Fold on a step thread.
  bool Landed(uint64_t step, uint32_t rank, bool ok) ABSL_LOCKS_EXCLUDED(mu_);
  // Folds the ranks that can be folded (in rank order), on a step thread.
  void Fold(kernels::ThreadPool* pool) ABSL_LOCKS_EXCLUDED(mu_);

  // What a step reads: called once every rank of `step` has landed (the
  // machine said so). Waits for a fold in progress, folds the rest, and
  // keeps the gradients until StepDone (a reduce pass and the step after it
  // read the same). `ranks`: the ranks with a gradient, in order.
  struct Inputs {
    std::vector<const void*> grads;  // Empty when no rank had a gradient.
    DType dtype = DType::kFp32;
    absl::Status status;             // Not OK: the fold failed (say so, skip).
    absl::Time all_landed;           // When the last push of the step landed.
  };
  Inputs Use(uint64_t step, const std::vector<uint32_t>& ranks, kernels::ThreadPool* pool)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The reader of Use is done (the reduce pass), the gradients stay.
  void Unuse() ABSL_LOCKS_EXCLUDED(mu_);
  // The step's kernel is done: everything of `step` goes back to the pool.
  void StepDone(uint64_t step) ABSL_LOCKS_EXCLUDED(mu_);
  // The chunk left the shard: waiting pushes are dropped and buffers go
  // back once no reader uses them.
  void Abandon() ABSL_LOCKS_EXCLUDED(mu_);
  // One line for logs: the step, and each rank's landing state.
  std::string DebugString() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  ChunkStaging(uint32_t world_size, DType grad_dtype, size_t num_elems, bool permanent,
               std::shared_ptr<StagingPool> pool);

  struct Rank {
    bool known = false;    // Landed, or pushed without a gradient.
    bool has_grad = false;
    bool waiting = false;  // Accepted, waiting for a landing place.
    std::unique_ptr<StagingPool::Lease> landing;  // Fold: where it landed.
    std::function<void(Landing)> go;              // While waiting.
  };

  // Starts tracking `step` (dropping what an abandoned earlier step left).
  void BeginStep(uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // pool_->TryAcquire with mu_ let go meanwhile (see staging.cc).
  std::unique_ptr<StagingPool::Lease> AcquireUnlocked(size_t bytes, uint64_t keep_free)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint8_t* HoldData() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const transport::MemoryRegion* HoldRegion() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The lowest rank not folded and not known yet (world_size_: none).
  uint32_t NextNeeded() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Rank `rank` of `step` still needs a landing place (after mu_ was let go).
  bool StillWanted(uint64_t step, uint32_t rank) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A landing place for `rank` if the rules allow one now.
  bool Place(uint32_t rank, Landing* out) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waiting ranks that can land now, with their places (run after unlock);
  // asks the pool to call back when none can and some wait.
  std::vector<std::pair<std::function<void(Landing)>, Landing>> Unblock()
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunUnblocked(std::vector<std::pair<std::function<void(Landing)>, Landing>> ready);
  // A step takes W slots, not a sum: the pool could hold them.
  bool SlotsFit() const;
  bool Foldable() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Folds ranks [folded_, end) that are known, outside the lock (busy).
  void FoldRun(kernels::ThreadPool* pool) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeStep() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const uint32_t world_size_;
  const DType grad_dtype_;
  const size_t num_elems_;
  const bool permanent_;
  const bool folds_;
  const size_t landing_bytes_;  // One rank's gradient.
  const size_t slots_bytes_;    // W slots.
  const size_t hold_bytes_;     // The fp32 sum (folds_), or the W slots.
  const std::shared_ptr<StagingPool> pool_;

  mutable absl::Mutex mu_;
  std::unique_ptr<Buffer> permanent_hold_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<StagingPool::Lease> hold_ ABSL_GUARDED_BY(mu_);
  uint64_t step_ ABSL_GUARDED_BY(mu_) = 0;
  bool active_ ABSL_GUARDED_BY(mu_) = false;  // Tracking step_.
  std::vector<Rank> ranks_ ABSL_GUARDED_BY(mu_);
  // This step's gradients are W slots (no fold), not a sum.
  bool step_slots_ ABSL_GUARDED_BY(mu_);
  uint32_t known_ ABSL_GUARDED_BY(mu_) = 0;
  uint32_t folded_ ABSL_GUARDED_BY(mu_) = 0;   // Ranks [0, folded_) are in the sum.
  bool sum_started_ ABSL_GUARDED_BY(mu_) = false;  // Some rank's gradient is in it.
  bool busy_ ABSL_GUARDED_BY(mu_) = false;     // A fold or a reader uses the buffers.
  bool used_ ABSL_GUARDED_BY(mu_) = false;     // Use() called: no more folds.
  bool fold_failed_ ABSL_GUARDED_BY(mu_) = false;
  bool abandoned_ ABSL_GUARDED_BY(mu_) = false;
  bool pool_callback_ ABSL_GUARDED_BY(mu_) = false;  // WhenReleased pending.
  bool acquiring_ ABSL_GUARDED_BY(mu_) = false;  // A thread is in AcquireUnlocked.
  bool missed_ ABSL_GUARDED_BY(mu_) = false;     // Place refused meanwhile.
  bool fold_pending_ ABSL_GUARDED_BY(mu_) = false;  // A fold for room is scheduled.
  absl::Time all_landed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace server
}  // namespace optimus

#endif  // OPTIMUS_SERVER_STAGING_H_
