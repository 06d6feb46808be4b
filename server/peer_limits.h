// What remote peers may make a shard hold on their behalf, bounded: pulls
// parked until their version is published (per peer and in all; each one
// is a reply sent later) and bytes of requests being received into
// temporary buffers (batches, inits with optimizer state). A peer over a
// limit is answered RESOURCE_EXHAUSTED (counted in refusals()); nothing
// else is touched, so other peers and jobs go on.
//
// Peers are the transport's reply endpoints (opaque integers); an entry
// exists only while the peer has pulls parked, so a peer that is gone
// leaves nothing behind once its pulls are answered or refused.
//
// Thread-safety: thread-safe; mu_ is a leaf lock.
#ifndef OPTIMUS_SERVER_PEER_LIMITS_H_
#define OPTIMUS_SERVER_PEER_LIMITS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"

namespace optimus {
namespace server {

struct PeerLimitOptions {
  // Most pulls one peer may have parked at once (over all chunks and jobs).
  uint64_t max_parked_pulls_per_peer = 65536;
  // Most pulls parked on the shard in all.
  uint64_t max_parked_pulls = 262144;
  // Most bytes of temporary receive buffers at once.
  uint64_t max_inflight_bytes = uint64_t{256} << 20;
};

class PeerLimits {
 public:
  explicit PeerLimits(const PeerLimitOptions& options) : options_(options) {}

  // Takes one parked-pull place for `peer`; false (and counted as a
  // refusal) when the peer or the shard has no room left.
  bool TryPark(uintptr_t peer) ABSL_LOCKS_EXCLUDED(mu_);
  // Gives back a place TryPark took (the pull was answered, refused, or
  // not parked after all).
  void Unpark(uintptr_t peer) ABSL_LOCKS_EXCLUDED(mu_);

  // Reserves `bytes` of in-flight receive buffers; false (counted) when
  // they do not fit. A request larger than the whole limit is let through
  // when nothing else is in flight (at most one such at a time).
  bool TryReserveBytes(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  void ReleaseBytes(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  const PeerLimitOptions& options() const { return options_; }
  uint64_t parked() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t peers_with_parked() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t inflight_bytes() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t parked_refusals() const ABSL_LOCKS_EXCLUDED(mu_);
  uint64_t inflight_refusals() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const PeerLimitOptions options_;
  mutable absl::Mutex mu_;
  absl::flat_hash_map<uintptr_t, uint64_t> parked_by_peer_ ABSL_GUARDED_BY(mu_);
  uint64_t parked_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t inflight_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t parked_refusals_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t inflight_refusals_ ABSL_GUARDED_BY(mu_) = 0;
};

// A temporary receive buffer of `n` elements whose bytes were reserved in
// `limits` (TryReserveBytes); they are given back when its last holder
// lets go.
template <typename T>
std::shared_ptr<std::vector<T>> InflightBuffer(std::shared_ptr<PeerLimits> limits, size_t n) {
  return std::shared_ptr<std::vector<T>>(new std::vector<T>(n), [limits, n](std::vector<T>* v) {
    delete v;
    limits->ReleaseBytes(n * sizeof(T));
  });
}

// Buffers that batches are received into, kept for the next batch. A
// fresh buffer per batch cost the progress thread an allocation, a
// zero fill and, above glibc's mmap threshold, page faults and an munmap
// for every message (docs/benchmarks.md, "Corked pushes"); a kept one
// has its pages mapped and most likely in cache. Up to `keep` idle
// buffers of `capacity` bytes are kept (keep x capacity bytes of the
// shard's memory at most, outside its accounting); a batch larger than
// `capacity` gets a buffer of its own that is freed after it.
//
// Thread-safety: thread-safe; mu_ is a leaf lock. Buffers may outlive the
// pool's owner (they hold the pool).
class ReceiveBufferPool : public std::enable_shared_from_this<ReceiveBufferPool> {
 public:
  static std::shared_ptr<ReceiveBufferPool> Create(size_t keep, size_t capacity);

  // A buffer of `n` bytes, not zeroed. Its `n` bytes were reserved in
  // `limits` (TryReserveBytes) and are given back when its last holder
  // lets go, as the buffer goes back to the pool.
  class Buffer {
   public:
    uint8_t* data() const { return data_; }
    size_t size() const { return size_; }

   private:
    friend class ReceiveBufferPool;
    uint8_t* data_ = nullptr;
    size_t size_ = 0;
  };
  std::shared_ptr<Buffer> Take(std::shared_ptr<PeerLimits> limits, size_t n)
      ABSL_LOCKS_EXCLUDED(mu_);

  size_t idle() const ABSL_LOCKS_EXCLUDED(mu_);
  // Buffers allocated because none was idle (or the batch was larger than
  // `capacity`): how often the pool did not help.
  uint64_t allocations() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  ReceiveBufferPool(size_t keep, size_t capacity) : keep_(keep), capacity_(capacity) {}
  void Give(std::unique_ptr<uint8_t[]> bytes, size_t capacity) ABSL_LOCKS_EXCLUDED(mu_);

  const size_t keep_;
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<uint8_t[]>> idle_ ABSL_GUARDED_BY(mu_);
  uint64_t allocations_ ABSL_GUARDED_BY(mu_) = 0;
};

// The answer to a request whose buffer did not fit: RESOURCE_EXHAUSTED.
absl::Status InflightFull(uint64_t bytes, uint64_t limit);

}  // namespace server
}  // namespace optimus

#endif  // OPTIMUS_SERVER_PEER_LIMITS_H_
