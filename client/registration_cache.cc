#include "client/registration_cache.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace optimus {
namespace client {

RegistrationCache::RegistrationCache(RegisterFn register_fn, const Options& options)
    : register_fn_(std::move(register_fn)), options_(options) {}

RegistrationCache::Index::iterator RegistrationCache::FindCoveringLocked(uintptr_t begin,
                                                                         uintptr_t end) {
  auto it = entries_.upper_bound(begin);
  if (it == entries_.begin()) return entries_.end();
  --it;
  return it->second.end >= end ? it : entries_.end();
}

bool RegistrationCache::OverlapsPinnedLocked(uintptr_t begin, uintptr_t end) {
  auto it = entries_.upper_bound(begin);
  if (it != entries_.begin() && std::prev(it)->second.end > begin) --it;
  for (; it != entries_.end() && it->first < end; ++it) {
    if (it->second.pinned) return true;
  }
  return false;
}

void RegistrationCache::DropCachedOverlappingLocked(uintptr_t begin, uintptr_t end) {
  auto it = entries_.upper_bound(begin);
  if (it != entries_.begin() && std::prev(it)->second.end > begin) --it;
  while (it != entries_.end() && it->first < end) {
    if (it->second.pinned) {
      ++it;
      continue;
    }
    ++stats_.evictions;
    auto next = std::next(it);
    EraseLocked(it);
    it = next;
  }
}

void RegistrationCache::EraseLocked(Index::iterator it) {
  const uint64_t bytes = it->second.end - it->first;
  if (it->second.pinned) {
    stats_.pinned_bytes -= bytes;
  } else {
    stats_.cached_bytes -= bytes;
    lru_.erase(it->second.lru);
  }
  // The registration itself goes with its last lease.
  entries_.erase(it);
}

absl::StatusOr<std::shared_ptr<const transport::MemoryRegion>> RegistrationCache::RegisterLocked(
    uintptr_t begin, uintptr_t end) {
  auto region = register_fn_(reinterpret_cast<void*>(begin), end - begin);
  if (!region.ok()) {
    ++stats_.registration_failures;
    return absl::Status(region.status().code(),
                        absl::StrCat("registering ", end - begin,
                                     " bytes for the data plane: ", region.status().message()));
  }
  if (*region == nullptr) {
    ++stats_.registration_failures;
    return absl::InternalError("the transport returned no memory region");
  }
  ++stats_.registrations;
  return std::shared_ptr<const transport::MemoryRegion>(std::move(*region));
}

absl::Status RegistrationCache::Pin(const void* data, size_t size_bytes) {
  if (data == nullptr || size_bytes == 0) {
    return absl::InvalidArgumentError("registering an empty buffer");
  }
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t end = begin + size_bytes;
  absl::MutexLock lock(&mu_);
  auto it = FindCoveringLocked(begin, end);
  if (it != entries_.end()) {
    if (!it->second.pinned) {
      const uint64_t bytes = it->second.end - it->first;
      lru_.erase(it->second.lru);
      it->second.pinned = true;
      stats_.cached_bytes -= bytes;
      stats_.pinned_bytes += bytes;
    }
    return absl::OkStatus();
  }
  if (OverlapsPinnedLocked(begin, end)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "buffer [", absl::Hex(begin), ", +", size_bytes,
        ") partly overlaps a registered buffer: forget that one first (ForgetBuffer)"));
  }
  DropCachedOverlappingLocked(begin, end);
  auto region = RegisterLocked(begin, end);
  if (!region.ok()) return region.status();
  Entry& e = entries_[begin];
  e.end = end;
  e.pinned = true;
  e.region = *std::move(region);
  stats_.pinned_bytes += size_bytes;
  return absl::OkStatus();
}

absl::StatusOr<RegistrationCache::Lease> RegistrationCache::Acquire(const void* data,
                                                                   size_t size_bytes) {
  if (data == nullptr || size_bytes == 0) return Lease();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t end = begin + size_bytes;
  absl::MutexLock lock(&mu_);
  auto it = FindCoveringLocked(begin, end);
  if (it != entries_.end()) {
    ++stats_.hits;
    if (!it->second.pinned) lru_.splice(lru_.begin(), lru_, it->second.lru);
    return Lease(it->second.region);
  }
  if (size_bytes < options_.min_bytes || size_bytes > options_.capacity_bytes ||
      OverlapsPinnedLocked(begin, end)) {
    ++stats_.unregistered;
    return Lease();
  }
  DropCachedOverlappingLocked(begin, end);
  auto region = RegisterLocked(begin, end);
  if (!region.ok()) {
    ++stats_.unregistered;
    return region.status();
  }
  ++stats_.misses;
  lru_.push_front(begin);
  Entry& e = entries_[begin];
  e.end = end;
  e.pinned = false;
  e.region = *std::move(region);
  e.lru = lru_.begin();
  stats_.cached_bytes += size_bytes;
  Lease lease(e.region);
  while (stats_.cached_bytes > options_.capacity_bytes && lru_.size() > 1) {
    ++stats_.evictions;
    EraseLocked(entries_.find(lru_.back()));
  }
  return lease;
}

RegistrationCache::Lease RegistrationCache::Lookup(const void* data, size_t size_bytes) {
  if (data == nullptr || size_bytes == 0) return Lease();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  absl::MutexLock lock(&mu_);
  auto it = FindCoveringLocked(begin, begin + size_bytes);
  if (it == entries_.end()) {
    ++stats_.unregistered;
    return Lease();
  }
  ++stats_.hits;
  if (!it->second.pinned) lru_.splice(lru_.begin(), lru_, it->second.lru);
  return Lease(it->second.region);
}

size_t RegistrationCache::Forget(const void* data, size_t size_bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t end = begin + (size_bytes == 0 ? 1 : size_bytes);
  absl::MutexLock lock(&mu_);
  auto it = entries_.upper_bound(begin);
  if (it != entries_.begin() && std::prev(it)->second.end > begin) --it;
  size_t dropped = 0;
  while (it != entries_.end() && it->first < end) {
    auto next = std::next(it);
    EraseLocked(it);
    ++dropped;
    it = next;
  }
  stats_.forgotten += dropped;
  return dropped;
}

void RegistrationCache::Clear() {
  absl::MutexLock lock(&mu_);
  while (!entries_.empty()) EraseLocked(entries_.begin());
}

RegistrationStats RegistrationCache::stats() const {
  absl::MutexLock lock(&mu_);
  RegistrationStats s = stats_;
  s.entries = entries_.size();
  return s;
}

}  // namespace client
}  // namespace optimus
