#include "server/job_table.h"

#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/huge_pages.h"
#include "server/staging.h"

namespace optimus {
namespace server {
namespace {

// Cache-line alignment so the SIMD kernels load whole lines.
constexpr size_t kAlignBytes = 64;
// Buffers at least this large are mapped from the kernel directly (page
// aligned, zeroed by it) and unmapped when freed: a deleted job's memory goes
// back to the system at once instead of staying in the allocator's arenas,
// where it would be reusable only by this process and fragmented across
// threads. A chunk's buffers are this size or larger unless the job is tiny.
constexpr size_t kMapThresholdBytes = 64 * 1024;

}  // namespace

absl::Status MemoryAccount::Reserve(uint64_t bytes, absl::string_view what) {
  uint64_t used = used_.load();
  for (;;) {
    if (bytes > limit_ || used > limit_ - bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, " needs ", bytes, " bytes on this shard; ", used >= limit_ ? 0 : limit_ - used,
          " of ", limit_, " free"));
    }
    if (used_.compare_exchange_weak(used, used + bytes)) return absl::OkStatus();
  }
}

void MemoryAccount::Release(uint64_t bytes) { used_.fetch_sub(bytes); }

absl::StatusOr<std::unique_ptr<Buffer>> Buffer::Allocate(size_t size_bytes,
                                                         std::shared_ptr<MemoryAccount> account,
                                                         const Registrar& registrar,
                                                         absl::string_view what) {
  size_t rounded = (size_bytes + kAlignBytes - 1) / kAlignBytes * kAlignBytes;
  if (rounded == 0) rounded = kAlignBytes;
  // The bytes the coordinator plans with (kernels::ShardBytesPerElem), not
  // the rounding: a shard must take every map its coordinator computed.
  if (absl::Status s = account->Reserve(size_bytes, what); !s.ok()) return s;
  std::unique_ptr<Buffer> b(new Buffer());
  b->account_ = std::move(account);
  b->reserved_bytes_ = size_bytes;
  b->size_bytes_ = size_bytes;
  if (rounded >= kMapThresholdBytes) {
    b->data_ = static_cast<uint8_t*>(MapAligned(rounded, b->account_->huge_pages()));
    b->mapped_bytes_ = b->data_ != nullptr ? rounded : 0;
  } else {
    b->data_ = static_cast<uint8_t*>(std::aligned_alloc(kAlignBytes, rounded));
    if (b->data_ != nullptr) std::memset(b->data_, 0, rounded);
  }
  if (b->data_ == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of memory allocating ", rounded, " bytes for ", what));
  }
  if (registrar) {
    auto region = registrar(b->data_, size_bytes);
    if (!region.ok()) return region.status();
    b->region_ = std::move(*region);
  }
  return b;
}

Buffer::~Buffer() {
  region_.reset();  // Deregistered before the memory goes.
  if (mapped_bytes_ != 0) {
    UnmapAligned(data_, mapped_bytes_);
  } else {
    std::free(data_);
  }
  if (account_ != nullptr) account_->Release(reserved_bytes_);
}

Chunk::Chunk(ChunkName n, uint64_t offset, uint64_t elems, uint32_t world_size, Role role)
    : name(n), offset_elems(offset), num_elems(elems), machine(n, world_size, role) {}

Chunk::~Chunk() {
  if (overhead_account_ != nullptr) overhead_account_->Release(overhead_bytes_);
}

absl::StatusOr<std::shared_ptr<Chunk>> Chunk::Create(const JobConfig& c,
                                                     const ChunkPlacement& p, Role role,
                                                     bool with_sum,
                                                     std::shared_ptr<MemoryAccount> account,
                                                     const Registrar& registrar,
                                                     std::shared_ptr<StagingPool> pool) {
  const ChunkName name{c.job_id, p.tensor, p.chunk};
  const std::string what = absl::StrCat("tensor ", p.tensor, " chunk ", p.chunk, " of job ",
                                        c.job_id, " (", p.num_elems, " elements)");
  // The chunk's bookkeeping, per chunk and per worker, as the coordinator
  // planned it: reserved before anything of the chunk is allocated (its
  // machine and staging hold world_size entries).
  const uint64_t overhead = kernels::ChunkOverheadBytes(c.world_size);
  if (absl::Status s = account->Reserve(overhead, what); !s.ok()) return s;
  std::shared_ptr<Chunk> ch(new Chunk(name, p.offset_elems, p.num_elems, c.world_size, role));
  ch->overhead_account_ = account;
  ch->overhead_bytes_ = overhead;
  {
    absl::MutexLock lock(&ch->mu);
    ch->machine.SetStepRules(c.commit_round,
                             p.tensor < c.tensors.size() && c.tensors[p.tensor].frozen);
  }
  const uint64_t n = p.num_elems;
  const kernels::StateLayout& layout = kernels::LayoutOf(c.hyper.kind);
  // Only the buffers a transfer lands in or is read from are registered.
  const Registrar none;
  auto alloc = [&](size_t bytes, bool registered) {
    return Buffer::Allocate(bytes, account, registered ? registrar : none, what);
  };
  auto master = alloc(n * 4, /*registered=*/true);  // Seeds and restores read it.
  if (!master.ok()) return master.status();
  ch->master_ = *std::move(master);
  auto m = alloc(n * 4, false);
  if (!m.ok()) return m.status();
  ch->m_ = *std::move(m);
  if (layout.has_v()) {
    auto v = alloc(n * 4, false);
    if (!v.ok()) return v.status();
    ch->v_ = *std::move(v);
  }
  ch->grad_bytes_ = n * DTypeSize(c.grad_dtype);
  if (pool == nullptr) {
    // Tests of one chunk: a pool that holds this chunk's step.
    pool = StagingPool::Create(
        n * (kernels::GradHoldBytesPerElem(c.world_size, c.grad_dtype) + DTypeSize(c.grad_dtype)),
        account, registrar, [](std::function<void()> fn) { std::thread(std::move(fn)).detach(); });
  }
  auto staging = ChunkStaging::Create(c.world_size, c.grad_dtype, n, c.commit_round,
                                      std::move(pool), account, registrar, what);
  if (!staging.ok()) return staging.status();
  ch->staging_ = *std::move(staging);
  for (int i = 0; i < 2; ++i) {
    auto pub = alloc(n * DTypeSize(c.param_dtype), true);
    if (!pub.ok()) return pub.status();
    ch->published_[i] = *std::move(pub);
  }
  if (with_sum) {
    if (absl::Status s = ch->AddSumBuffer(account, registrar); !s.ok()) return s;
  }
  return ch;
}

std::vector<float*> Chunk::state_arrays() const {
  std::vector<float*> out = {master(), m()};
  if (v_ != nullptr) out.push_back(v());
  return out;
}

std::vector<float> Chunk::PackState() const {
  const std::vector<float*> arrays = state_arrays();
  std::vector<float> out(arrays.size() * num_elems);
  for (size_t a = 0; a < arrays.size(); ++a) {
    std::memcpy(out.data() + a * num_elems, arrays[a], num_elems * 4);
  }
  return out;
}

void Chunk::UnpackState(const float* packed) const {
  const std::vector<float*> arrays = state_arrays();
  for (size_t a = 0; a < arrays.size(); ++a) {
    std::memcpy(arrays[a], packed + a * num_elems, num_elems * 4);
  }
}

float* Chunk::sum() const {
  absl::MutexLock lock(&mu);
  return sum_ptr_;
}

absl::Status Chunk::AddSumBuffer(std::shared_ptr<MemoryAccount> account,
                                 const Registrar& registrar) {
  {
    absl::MutexLock lock(&mu);
    if (sum_ != nullptr) return absl::OkStatus();
  }
  auto sum = Buffer::Allocate(num_elems * 4, std::move(account), registrar,
                              absl::StrCat("the gradient sum of tensor ", name.tensor, " chunk ",
                                           name.chunk, " of job ", name.job));
  if (!sum.ok()) return sum.status();
  absl::MutexLock lock(&mu);
  if (sum_ == nullptr) {
    sum_ = *std::move(sum);
    sum_ptr_ = sum_->floats();
  }
  return absl::OkStatus();
}

uint64_t Job::epoch() const {
  absl::MutexLock lock(&mu);
  return map_epoch;
}

bool Job::TakeEpochUnchanged(uint64_t epoch, uint64_t part_epoch) {
  absl::MutexLock lock(&mu);
  if (part_epoch == 0 || map_epoch < part_epoch || map_epoch >= epoch) return false;
  map_epoch = epoch;
  return true;
}

std::shared_ptr<Chunk> Job::Find(uint32_t tensor, uint32_t chunk) const {
  absl::MutexLock lock(&mu);
  auto it = chunks.find(ChunkKey(tensor, chunk));
  return it == chunks.end() ? nullptr : it->second;
}

std::vector<std::shared_ptr<Chunk>> Job::Chunks() const {
  absl::MutexLock lock(&mu);
  std::vector<std::shared_ptr<Chunk>> out;
  out.reserve(chunks.size());
  for (const auto& [key, c] : chunks) out.push_back(c);
  return out;
}

size_t Job::num_chunks() const {
  absl::MutexLock lock(&mu);
  return chunks.size();
}

uint64_t Job::PrimaryOf(uint32_t tensor, uint32_t chunk) const {
  absl::MutexLock lock(&mu);
  auto it = primary_of.find(ChunkKey(tensor, chunk));
  return it == primary_of.end() ? 0 : it->second;
}

std::shared_ptr<Job> JobTable::Find(uint64_t job_id) const {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  return it == jobs_.end() ? nullptr : it->second;
}

bool JobTable::Insert(std::shared_ptr<Job> job) {
  absl::MutexLock lock(&mu_);
  return jobs_.emplace(job->config.job_id, std::move(job)).second;
}

std::shared_ptr<Job> JobTable::Remove(uint64_t job_id) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return nullptr;
  std::shared_ptr<Job> job = std::move(it->second);
  jobs_.erase(it);
  return job;
}

std::vector<std::shared_ptr<Job>> JobTable::All() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Job>> out;
  for (const auto& [id, job] : jobs_) out.push_back(job);
  return out;
}

std::vector<std::shared_ptr<Job>> JobTable::RemoveAll() {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Job>> out;
  for (auto& [id, job] : jobs_) out.push_back(std::move(job));
  jobs_.clear();
  return out;
}

}  // namespace server
}  // namespace optimus
