// The shard's jobs and chunks, and the memory they cost. JobTable owns Jobs,
// a Job owns its Chunks, both through shared_ptr: whatever works on a chunk
// (a request handler, a step thread, a pull reply being sent, a forward
// waiting for its answer) holds a shared_ptr for as long as it does, so a
// chunk that retires or a job that is deleted is freed the moment the last
// of them lets go, and its bytes leave MemoryAccount::used() then.
//
// Thread-safety: all classes here are thread-safe. Lock order (outer to
// inner): JobTable::mu_, Job::mu, Chunk::mu. Chunk buffers are allocated
// once and never move; what may touch them when is the ChunkMachine's rule.
#ifndef OPTIMUS_SERVER_JOB_TABLE_H_
#define OPTIMUS_SERVER_JOB_TABLE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/chunk.h"
#include "server/domain.h"
#include "transport/transport.h"

namespace optimus {
namespace server {

// The shard's memory budget. Every allocation reserves its bytes first and
// gives them back when freed.
class MemoryAccount {
 public:
  // `huge_pages`: buffers of 2 MiB or more are advised for transparent
  // huge pages (common/huge_pages.h).
  explicit MemoryAccount(uint64_t limit_bytes, bool huge_pages = true)
      : limit_(limit_bytes), huge_pages_(huge_pages) {}
  // RESOURCE_EXHAUSTED with the numbers (and `what`) when it does not fit.
  absl::Status Reserve(uint64_t bytes, absl::string_view what);
  void Release(uint64_t bytes);
  uint64_t used() const { return used_.load(); }
  uint64_t limit() const { return limit_; }
  bool huge_pages() const { return huge_pages_; }

 private:
  const uint64_t limit_;
  const bool huge_pages_;
  std::atomic<uint64_t> used_{0};
};

// Registers a buffer with the data plane (so rendezvous lands in it).
using Registrar =
    std::function<absl::StatusOr<std::unique_ptr<transport::MemoryRegion>>(void*, size_t)>;

// One zeroed, 64-byte aligned, registered, accounted allocation; large
// ones are mapped from the kernel on a 2 MiB boundary (advised for huge
// pages from 2 MiB on, as the account says) and given back to it when freed.
class Buffer {
 public:
  static absl::StatusOr<std::unique_ptr<Buffer>> Allocate(
      size_t size_bytes, std::shared_ptr<MemoryAccount> account, const Registrar& registrar,
      absl::string_view what);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size_bytes() const { return size_bytes_; }
  float* floats() const { return reinterpret_cast<float*>(data_); }
  // Its registration with the data plane (null without a registrar).
  const transport::MemoryRegion* region() const { return region_.get(); }

 private:
  Buffer() = default;
  uint8_t* data_ = nullptr;
  size_t size_bytes_ = 0;
  size_t reserved_bytes_ = 0;
  size_t mapped_bytes_ = 0;  // Non-zero: mmap'ed (unmapped when freed).
  std::shared_ptr<MemoryAccount> account_;
  std::unique_ptr<transport::MemoryRegion> region_;  // Before data_ is freed.
};

class Job;
class ChunkStaging;  // server/staging.h
class StagingPool;

// One chunk on this shard: its buffers and its state machine.
class Chunk {
 public:
  // Allocates the chunk's buffers for `job` (the gradient-sum buffer only
  // when `with_sum`; the gradients' own buffers when the job's steps wait
  // for a commit, else they come from `pool` per step): RESOURCE_EXHAUSTED
  // when they do not fit the budget, or the chunk's step would not fit the
  // staging pool.
  static absl::StatusOr<std::shared_ptr<Chunk>> Create(const JobConfig& config,
                                                       const ChunkPlacement& placement, Role role,
                                                       bool with_sum,
                                                       std::shared_ptr<MemoryAccount> account,
                                                       const Registrar& registrar,
                                                       std::shared_ptr<StagingPool> pool);
  ~Chunk();

  const ChunkName name;
  const uint64_t offset_elems;
  const uint64_t num_elems;

  // fp32 state; `v` is null for optimizers without a second moment.
  float* master() const { return master_->floats(); }
  float* m() const { return m_->floats(); }
  float* v() const { return v_ ? v_->floats() : nullptr; }
  // The state arrays in layout order (master, m[, v]).
  std::vector<float*> state_arrays() const;
  // The state arrays back to back, as seeds, inits with optimizer state
  // and checkpoint files carry them; and the way back. Only in the phases
  // the machine reserves for reading / writing the state.
  std::vector<float> PackState() const;
  void UnpackState(const float* packed) const;
  // Where the step's pushed gradients land and are summed (staging.h).
  ChunkStaging& staging() const { return *staging_; }
  // The published copy of version v (param dtype).
  uint8_t* published(uint64_t version) const { return published_[version % 2]->data(); }
  size_t published_bytes() const { return published_[0]->size_bytes(); }
  const transport::MemoryRegion* published_region(uint64_t version) const {
    return published_[version % 2]->region();
  }
  size_t grad_bytes() const { return grad_bytes_; }

  // The fp32 summed gradient of the step being applied (replication);
  // null until AddSumBuffer. Set once, under mu, and never freed before the
  // chunk.
  float* sum() const ABSL_LOCKS_EXCLUDED(mu);
  bool has_sum() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return sum_ptr_ != nullptr; }
  absl::Status AddSumBuffer(std::shared_ptr<MemoryAccount> account, const Registrar& registrar);

  // Every access to `machine` holds mu; buffers are touched outside it only
  // in the phases the machine reserves for that.
  mutable absl::Mutex mu;
  ChunkMachine machine ABSL_GUARDED_BY(mu);
  // When the step began waiting for a checkpoint copy (for the stall metric).
  absl::Time blocked_since ABSL_GUARDED_BY(mu);
  // Backup: the forward whose sum is being applied, to answer when done.
  Requester forward_from ABSL_GUARDED_BY(mu);

 private:
  Chunk(ChunkName n, uint64_t offset, uint64_t elems, uint32_t world_size, Role role);

  std::unique_ptr<Buffer> master_, m_, v_, published_[2];
  // kernels::ChunkOverheadBytes(world size), reserved for the chunk's
  // bookkeeping.
  std::shared_ptr<MemoryAccount> overhead_account_;
  uint64_t overhead_bytes_ = 0;
  std::shared_ptr<ChunkStaging> staging_;
  std::unique_ptr<Buffer> sum_ ABSL_GUARDED_BY(mu);
  float* sum_ptr_ ABSL_GUARDED_BY(mu) = nullptr;
  size_t grad_bytes_ = 0;  // One rank's push.
};

// One job's chunks on this shard, and what it knows of the job's map.
class Job {
 public:
  explicit Job(JobConfig config) : config(std::move(config)) {}

  const JobConfig config;
  const kernels::StateLayout& layout() const { return kernels::LayoutOf(config.hyper.kind); }

  uint64_t epoch() const ABSL_LOCKS_EXCLUDED(mu);
  // Takes map epoch `epoch` without a new map when the loaded one is at
  // least `part_epoch` (the newest epoch that changed this shard's part:
  // what is loaded is then that epoch's part too). False, changing
  // nothing, when part_epoch is 0 (not known) or newer than the loaded
  // epoch, or the loaded epoch is `epoch` or newer.
  bool TakeEpochUnchanged(uint64_t epoch, uint64_t part_epoch) ABSL_LOCKS_EXCLUDED(mu);
  std::shared_ptr<Chunk> Find(uint32_t tensor, uint32_t chunk) const ABSL_LOCKS_EXCLUDED(mu);
  std::vector<std::shared_ptr<Chunk>> Chunks() const ABSL_LOCKS_EXCLUDED(mu);
  size_t num_chunks() const ABSL_LOCKS_EXCLUDED(mu);
  // The chunk's primary under the loaded map (0: not in it): a forward
  // from any other shard comes from a deposed primary.
  uint64_t PrimaryOf(uint32_t tensor, uint32_t chunk) const ABSL_LOCKS_EXCLUDED(mu);

  mutable absl::Mutex mu;
  uint64_t map_epoch ABSL_GUARDED_BY(mu) = 0;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Chunk>> chunks ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<uint64_t, uint64_t> primary_of ABSL_GUARDED_BY(mu);
};

class JobTable {
 public:
  explicit JobTable(uint64_t memory_limit_bytes, bool huge_pages = true)
      : memory_(std::make_shared<MemoryAccount>(memory_limit_bytes, huge_pages)) {}

  const std::shared_ptr<MemoryAccount>& memory() const { return memory_; }

  std::shared_ptr<Job> Find(uint64_t job_id) const ABSL_LOCKS_EXCLUDED(mu_);
  // False when a job with that id is there already (it stays).
  bool Insert(std::shared_ptr<Job> job) ABSL_LOCKS_EXCLUDED(mu_);
  // Takes the job out of the table (null if absent); the caller retires its chunks.
  std::shared_ptr<Job> Remove(uint64_t job_id) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<std::shared_ptr<Job>> All() const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<std::shared_ptr<Job>> RemoveAll() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::shared_ptr<MemoryAccount> memory_;
  mutable absl::Mutex mu_ ABSL_ACQUIRED_BEFORE(Job::mu);
  std::map<uint64_t, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace server
}  // namespace optimus

#endif  // OPTIMUS_SERVER_JOB_TABLE_H_
