// The client's memory registrations: the buffers it sends from and receives
// into are registered with the transport once (Worker::RegisterMemory) and
// every later transfer from or into any part of them reuses that
// registration, so a rendezvous does not pin pages per transfer.
//
// Entries are keyed by address range and never overlap. Two kinds:
//  - pinned (Pin): registered on request, for buffers that live long (a
//    trainer's staging buffers); never evicted, dropped by Forget;
//  - cached (Acquire): registered on first use (the user tensors given to
//    Push and Pull), the least recently used dropped beyond capacity_bytes.
// A Lease keeps a registration alive while a transfer uses it, so dropping
// an entry (eviction, Forget, Clear) never pulls a registration from under a
// transfer: it goes when its last lease does.
//
// Thread-safety: every method is safe from any thread. The register function
// runs under the cache's mutex (so a buffer is registered once even when two
// threads ask at once) and must not call back into the cache; callers must
// not hold a lock that the transport's progress thread may need. Since a
// registration waits for the progress thread while it holds the mutex, no
// method may be called on that thread (a transfer's done callback): it
// would wait for the mutex while the mutex waits for it.
#ifndef OPTIMUS_CLIENT_REGISTRATION_CACHE_H_
#define OPTIMUS_CLIENT_REGISTRATION_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "transport/transport.h"

namespace optimus {
namespace client {

// Counters of a RegistrationCache (or of a Client, which has one).
struct RegistrationStats {
  uint64_t registrations = 0;          // Successful calls of the register function.
  uint64_t registration_failures = 0;  // Failed ones (the transfer went without).
  uint64_t hits = 0;                   // Acquire/Lookup found a covering entry.
  uint64_t misses = 0;                 // Acquire registered a new entry.
  uint64_t unregistered = 0;           // Acquire/Lookup returned no registration.
  uint64_t evictions = 0;              // Cached entries dropped for capacity or overlap.
  uint64_t forgotten = 0;              // Entries dropped by Forget.
  uint64_t entries = 0;                // Entries now.
  uint64_t pinned_bytes = 0;           // Bytes of pinned entries now.
  uint64_t cached_bytes = 0;           // Bytes of cached entries now.
};

class RegistrationCache {
 public:
  using RegisterFn = std::function<absl::StatusOr<std::unique_ptr<transport::MemoryRegion>>(
      void* data, size_t size_bytes)>;

  struct Options {
    // Bytes of cached (not pinned) registrations kept; the least recently
    // used go first beyond it. 0: Acquire registers nothing (pinned entries
    // are still found). Costs pinned memory on transports that pin pages
    // (RDMA). Default 4 GiB.
    uint64_t capacity_bytes = uint64_t{4} << 30;
    // Acquire does not register buffers smaller than this: they travel
    // eagerly (copied), where a registration buys nothing. Pinned entries
    // are found whatever their size. Default 64 KiB.
    uint64_t min_bytes = 64 * 1024;
  };

  // A registration held for one transfer, or none (the transport then
  // registers for that transfer itself). Cheap to copy.
  class Lease {
   public:
    Lease() = default;
    const transport::MemoryRegion* region() const { return region_.get(); }
    explicit operator bool() const { return region_ != nullptr; }
    void reset() { region_.reset(); }

   private:
    friend class RegistrationCache;
    explicit Lease(std::shared_ptr<const transport::MemoryRegion> r) : region_(std::move(r)) {}
    std::shared_ptr<const transport::MemoryRegion> region_;
  };

  RegistrationCache(RegisterFn register_fn, const Options& options);
  RegistrationCache(const RegistrationCache&) = delete;
  RegistrationCache& operator=(const RegistrationCache&) = delete;

  // Registers [data, data + size_bytes) as a pinned entry. OK at once when a
  // pinned entry covers it already; a cached entry that covers it becomes
  // pinned. Cached entries it overlaps are dropped. INVALID_ARGUMENT for an
  // empty range or one that partly overlaps a pinned entry; the register
  // function's error when it fails.
  absl::Status Pin(const void* data, size_t size_bytes);

  // The registration covering [data, data + size_bytes) for a transfer:
  // an entry's that covers it (a hit), else a new cached entry (cached
  // entries it overlaps are dropped first), else none: the range is below
  // min_bytes or above capacity_bytes, partly overlaps a pinned entry, or
  // registering failed (the error is returned; the caller may go on
  // without a registration).
  absl::StatusOr<Lease> Acquire(const void* data, size_t size_bytes);

  // An existing entry's registration covering the range, or none; never
  // registers (for one-off transfers).
  Lease Lookup(const void* data, size_t size_bytes);

  // The memory [data, data + size_bytes) is going away: drops every entry
  // overlapping it (size_bytes 0: the entry containing data). Transfers
  // holding a lease keep theirs until they finish. Returns the number of
  // entries dropped.
  size_t Forget(const void* data, size_t size_bytes);

  // Drops every entry (leases held keep theirs).
  void Clear();

  RegistrationStats stats() const;

 private:
  struct Entry {
    uintptr_t end = 0;  // One past the last byte.
    bool pinned = false;
    std::shared_ptr<const transport::MemoryRegion> region;
    std::list<uintptr_t>::iterator lru;  // Cached entries only.
  };
  using Index = std::map<uintptr_t, Entry>;  // By first byte.

  // The entry containing [begin, end), or entries_.end().
  Index::iterator FindCoveringLocked(uintptr_t begin, uintptr_t end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Entries overlapping [begin, end): whether any is pinned, and drops the
  // cached ones (unless only checking).
  bool OverlapsPinnedLocked(uintptr_t begin, uintptr_t end) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void DropCachedOverlappingLocked(uintptr_t begin, uintptr_t end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseLocked(Index::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Registers [begin, end) under the mutex.
  absl::StatusOr<std::shared_ptr<const transport::MemoryRegion>> RegisterLocked(uintptr_t begin,
                                                                              uintptr_t end)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const RegisterFn register_fn_;
  const Options options_;
  mutable absl::Mutex mu_;
  Index entries_ ABSL_GUARDED_BY(mu_);
  std::list<uintptr_t> lru_ ABSL_GUARDED_BY(mu_);  // Cached entries, most recent first.
  RegistrationStats stats_ ABSL_GUARDED_BY(mu_);
};

}  // namespace client
}  // namespace optimus

#endif  // OPTIMUS_CLIENT_REGISTRATION_CACHE_H_
