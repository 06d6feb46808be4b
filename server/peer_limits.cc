#include "server/peer_limits.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace optimus {
namespace server {

bool PeerLimits::TryPark(uintptr_t peer) {
  absl::MutexLock lock(&mu_);
  if (parked_ >= options_.max_parked_pulls) {
    ++parked_refusals_;
    return false;
  }
  uint64_t& mine = parked_by_peer_[peer];
  if (mine >= options_.max_parked_pulls_per_peer) {
    if (mine == 0) parked_by_peer_.erase(peer);  // A per-peer limit of 0.
    ++parked_refusals_;
    return false;
  }
  ++mine;
  ++parked_;
  return true;
}

void PeerLimits::Unpark(uintptr_t peer) {
  absl::MutexLock lock(&mu_);
  auto it = parked_by_peer_.find(peer);
  if (it == parked_by_peer_.end()) return;
  if (--it->second == 0) parked_by_peer_.erase(it);
  --parked_;
}

bool PeerLimits::TryReserveBytes(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  // One request larger than the whole limit (an init with optimizer state
  // of a large chunk) goes through alone rather than never.
  const bool alone = inflight_bytes_ == 0;
  if (!alone && (bytes > options_.max_inflight_bytes ||
                 inflight_bytes_ > options_.max_inflight_bytes - bytes)) {
    ++inflight_refusals_;
    return false;
  }
  inflight_bytes_ += bytes;
  return true;
}

void PeerLimits::ReleaseBytes(uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  inflight_bytes_ -= bytes < inflight_bytes_ ? bytes : inflight_bytes_;
}

uint64_t PeerLimits::parked() const {
  absl::MutexLock lock(&mu_);
  return parked_;
}

size_t PeerLimits::peers_with_parked() const {
  absl::MutexLock lock(&mu_);
  return parked_by_peer_.size();
}

uint64_t PeerLimits::inflight_bytes() const {
  absl::MutexLock lock(&mu_);
  return inflight_bytes_;
}

uint64_t PeerLimits::parked_refusals() const {
  absl::MutexLock lock(&mu_);
  return parked_refusals_;
}

uint64_t PeerLimits::inflight_refusals() const {
  absl::MutexLock lock(&mu_);
  return inflight_refusals_;
}

absl::Status InflightFull(uint64_t bytes, uint64_t limit) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "a request of ", bytes, " bytes does not fit the shard's buffers for requests being "
      "received (--max_inflight_mb, ", limit, " bytes, in use by others); send it again later"));
}

std::shared_ptr<ReceiveBufferPool> ReceiveBufferPool::Create(size_t keep, size_t capacity) {
  return std::shared_ptr<ReceiveBufferPool>(new ReceiveBufferPool(keep, capacity));
}

std::shared_ptr<ReceiveBufferPool::Buffer> ReceiveBufferPool::Take(
    std::shared_ptr<PeerLimits> limits, size_t n) {
  const bool pooled = n <= capacity_;
  const size_t capacity = pooled ? capacity_ : n;
  std::unique_ptr<uint8_t[]> bytes;
  {
    absl::MutexLock lock(&mu_);
    if (pooled && !idle_.empty()) {
      bytes = std::move(idle_.back());  // The most recently used: still in cache.
      idle_.pop_back();
    } else {
      ++allocations_;
    }
  }
  // Default-initialized: the batch overwrites what it uses.
  if (bytes == nullptr) bytes.reset(new uint8_t[std::max<size_t>(capacity, 1)]);
  auto* b = new Buffer;
  b->data_ = bytes.release();
  b->size_ = n;
  return std::shared_ptr<Buffer>(
      b, [pool = shared_from_this(), limits = std::move(limits), capacity](Buffer* b) {
        pool->Give(std::unique_ptr<uint8_t[]>(b->data_), capacity);
        limits->ReleaseBytes(b->size_);
        delete b;
      });
}

void ReceiveBufferPool::Give(std::unique_ptr<uint8_t[]> bytes, size_t capacity) {
  if (capacity != capacity_) return;  // A large batch's own buffer.
  absl::MutexLock lock(&mu_);
  if (idle_.size() < keep_) idle_.push_back(std::move(bytes));
}

size_t ReceiveBufferPool::idle() const {
  absl::MutexLock lock(&mu_);
  return idle_.size();
}

uint64_t ReceiveBufferPool::allocations() const {
  absl::MutexLock lock(&mu_);
  return allocations_;
}

}  // namespace server
}  // namespace optimus
