#include "client/registration_cache.h"

#include <cstdint>
#include <memory>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace optimus {
namespace client {
namespace {

constexpr size_t kMiB = 1 << 20;

// Counts registrations and which regions are alive.
struct FakeTransport {
  int registered = 0;
  int fail_next = 0;
  std::shared_ptr<std::set<uintptr_t>> alive = std::make_shared<std::set<uintptr_t>>();

  class Region : public transport::MemoryRegion {
   public:
    Region(std::shared_ptr<std::set<uintptr_t>> alive, uintptr_t at)
        : alive_(std::move(alive)), at_(at) {
      alive_->insert(at_);
    }
    ~Region() override { alive_->erase(at_); }

   private:
    std::shared_ptr<std::set<uintptr_t>> alive_;
    uintptr_t at_;
  };

  RegistrationCache::RegisterFn Fn() {
    return [this](void* data, size_t) -> absl::StatusOr<std::unique_ptr<transport::MemoryRegion>> {
      if (fail_next > 0) {
        --fail_next;
        return absl::ResourceExhaustedError("cannot pin more");
      }
      ++registered;
      return std::make_unique<Region>(alive, reinterpret_cast<uintptr_t>(data));
    };
  }
  bool Alive(const void* p) const { return alive->count(reinterpret_cast<uintptr_t>(p)) != 0; }
};

RegistrationCache::Options Opts(uint64_t capacity, uint64_t min_bytes = 64 * 1024) {
  RegistrationCache::Options o;
  o.capacity_bytes = capacity;
  o.min_bytes = min_bytes;
  return o;
}

TEST(RegistrationCacheTest, RegistersABufferOnceForEveryTransfer) {
  FakeTransport t;
  RegistrationCache cache(t.Fn(), Opts(64 * kMiB));
  std::vector<uint8_t> buf(4 * kMiB);
  const transport::MemoryRegion* first = nullptr;
  for (int step = 0; step < 100; ++step) {
    auto whole = cache.Acquire(buf.data(), buf.size());
    ASSERT_TRUE(whole.ok());
    ASSERT_TRUE(*whole);
    if (first == nullptr) first = whole->region();
    EXPECT_EQ(whole->region(), first);
    // Any chunk of it is covered by the same registration.
    auto chunk = cache.Acquire(buf.data() + kMiB, kMiB);
    ASSERT_TRUE(chunk.ok());
    EXPECT_EQ(chunk->region(), first);
  }
  EXPECT_EQ(t.registered, 1);
  const RegistrationStats s = cache.stats();
  EXPECT_EQ(s.registrations, 1u);
  EXPECT_EQ(s.misses, 1u);
  EXPECT_EQ(s.hits, 199u);
  EXPECT_EQ(s.cached_bytes, 4 * kMiB);
}

TEST(RegistrationCacheTest, SmallBuffersAreNotRegistered) {
  FakeTransport t;
  RegistrationCache cache(t.Fn(), Opts(64 * kMiB, /*min_bytes=*/64 * 1024));
  std::vector<uint8_t> small(8 * 1024);
  auto lease = cache.Acquire(small.data(), small.size());
  ASSERT_TRUE(lease.ok());
  EXPECT_FALSE(*lease);
  EXPECT_EQ(t.registered, 0);
  EXPECT_EQ(cache.stats().unregistered, 1u);
}

TEST(RegistrationCacheTest, EvictsTheLeastRecentlyUsedBeyondCapacity) {
  FakeTransport t;
  RegistrationCache cache(t.Fn(), Opts(2 * kMiB));
  std::vector<uint8_t> a(kMiB), b(kMiB), c(kMiB);
  ASSERT_TRUE(cache.Acquire(a.data(), a.size()).ok());
  ASSERT_TRUE(cache.Acquire(b.data(), b.size()).ok());
  ASSERT_TRUE(cache.Acquire(a.data(), a.size()).ok());  // a is now the most recent.
  ASSERT_TRUE(cache.Acquire(c.data(), c.size()).ok());  // Evicts b.
  EXPECT_EQ(t.registered, 3);
  EXPECT_TRUE(t.Alive(a.data()));
  EXPECT_FALSE(t.Alive(b.data()));
  EXPECT_TRUE(t.Alive(c.data()));
  ASSERT_TRUE(cache.Acquire(a.data(), a.size()).ok());  // Still there.
  EXPECT_EQ(t.registered, 3);
  ASSERT_TRUE(cache.Acquire(b.data(), b.size()).ok());  // Back, evicting c.
  EXPECT_EQ(t.registered, 4);
  EXPECT_FALSE(t.Alive(c.data()));
  const RegistrationStats s = cache.stats();
  EXPECT_EQ(s.evictions, 2u);
  EXPECT_EQ(s.cached_bytes, 2 * kMiB);
  EXPECT_EQ(s.entries, 2u);
}

TEST(RegistrationCacheTest, ALeaseOutlivesEvictionAndForget) {
  FakeTransport t;
  RegistrationCache cache(t.Fn(), Opts(kMiB));
  std::vector<uint8_t> a(kMiB), b(kMiB);
  auto held = cache.Acquire(a.data(), a.size());
  ASSERT_TRUE(held.ok() && *held);
  ASSERT_TRUE(cache.Acquire(b.data(), b.size()).ok());  // Evicts a from the cache...
  EXPECT_TRUE(t.Alive(a.data()));                       // ...not from the transfer.
  auto held_b = cache.Acquire(b.data(), b.size());
  EXPECT_EQ(cache.Forget(b.data(), b.size()), 1u);
  EXPECT_TRUE(t.Alive(b.data()));
  held->reset();
  held_b->reset();
  EXPECT_FALSE(t.Alive(a.data()));
  EXPECT_FALSE(t.Alive(b.data()));
}

TEST(RegistrationCacheTest, PinnedBuffersStayWhateverTheCapacity) {
  FakeTransport t;
  RegistrationCache cache(t.Fn(), Opts(kMiB));
  std::vector<uint8_t> arena(8 * kMiB);
  ASSERT_TRUE(cache.Pin(arena.data(), arena.size()).ok());
  ASSERT_TRUE(cache.Pin(arena.data(), arena.size()).ok());  // Idempotent.
  std::vector<std::vector<uint8_t>> others(4, std::vector<uint8_t>(kMiB));
  for (auto& o : others) ASSERT_TRUE(cache.Acquire(o.data(), o.size()).ok());
  // Small pieces of the arena are found too (below min_bytes).
  auto piece = cache.Acquire(arena.data() + 100, 8192);
  ASSERT_TRUE(piece.ok());
  EXPECT_TRUE(*piece);
  EXPECT_TRUE(cache.Lookup(arena.data() + 4 * kMiB, kMiB));
  EXPECT_TRUE(t.Alive(arena.data()));
  EXPECT_EQ(t.registered, 5);
  EXPECT_EQ(cache.stats().pinned_bytes, 8 * kMiB);
  // A buffer straddling the arena's end cannot be registered beside it.
  std::vector<uint8_t> big(16 * kMiB);
  ASSERT_TRUE(cache.Pin(big.data(), big.size()).ok());
  EXPECT_EQ(cache.Pin(big.data() + 15 * kMiB, 2 * kMiB).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RegistrationCacheTest, PinningACachedBufferKeepsItsRegistration) {
  FakeTransport t;
  RegistrationCache cache(t.Fn(), Opts(4 * kMiB));
  std::vector<uint8_t> a(kMiB);
  ASSERT_TRUE(cache.Acquire(a.data(), a.size()).ok());
  ASSERT_TRUE(cache.Pin(a.data(), a.size()).ok());
  EXPECT_EQ(t.registered, 1);
  const RegistrationStats s = cache.stats();
  EXPECT_EQ(s.pinned_bytes, kMiB);
  EXPECT_EQ(s.cached_bytes, 0u);
}

TEST(RegistrationCacheTest, ForgetDropsEveryOverlappingEntryAndTheNextUseRegistersAgain) {
  FakeTransport t;
  RegistrationCache cache(t.Fn(), Opts(64 * kMiB));
  std::vector<uint8_t> mem(4 * kMiB);
  ASSERT_TRUE(cache.Pin(mem.data(), kMiB).ok());
  ASSERT_TRUE(cache.Acquire(mem.data() + 2 * kMiB, kMiB).ok());
  EXPECT_EQ(cache.Forget(mem.data(), mem.size()), 2u);
  EXPECT_EQ(cache.stats().entries, 0u);
  EXPECT_FALSE(t.Alive(mem.data()));
  // The memory came back as another buffer: registered afresh.
  ASSERT_TRUE(cache.Acquire(mem.data(), mem.size()).ok());
  EXPECT_EQ(t.registered, 3);
  EXPECT_EQ(cache.stats().forgotten, 2u);
  EXPECT_EQ(cache.Forget(mem.data() + 5, 0), 1u);  // The entry containing an address.
}

TEST(RegistrationCacheTest, ALargerBufferAtACachedAddressReplacesTheEntry) {
  FakeTransport t;
  RegistrationCache cache(t.Fn(), Opts(64 * kMiB));
  std::vector<uint8_t> mem(4 * kMiB);
  ASSERT_TRUE(cache.Acquire(mem.data(), kMiB).ok());
  auto bigger = cache.Acquire(mem.data(), 4 * kMiB);
  ASSERT_TRUE(bigger.ok() && *bigger);
  EXPECT_EQ(t.registered, 2);
  const RegistrationStats s = cache.stats();
  EXPECT_EQ(s.entries, 1u);
  EXPECT_EQ(s.cached_bytes, 4 * kMiB);
}

TEST(RegistrationCacheTest, AFailedRegistrationIsReportedAndTriedAgainLater) {
  FakeTransport t;
  RegistrationCache cache(t.Fn(), Opts(64 * kMiB));
  std::vector<uint8_t> a(kMiB);
  t.fail_next = 1;
  auto failed = cache.Acquire(a.data(), a.size());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted);
  auto again = cache.Acquire(a.data(), a.size());
  ASSERT_TRUE(again.ok());
  EXPECT_TRUE(*again);
  EXPECT_EQ(cache.stats().registration_failures, 1u);
  std::vector<uint8_t> b(kMiB);
  t.fail_next = 1;
  EXPECT_EQ(cache.Pin(b.data(), b.size()).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(cache.stats().entries, 1u);
}

TEST(RegistrationCacheTest, ClearDropsEverythingButHeldLeases) {
  FakeTransport t;
  RegistrationCache cache(t.Fn(), Opts(64 * kMiB));
  std::vector<uint8_t> a(kMiB), b(kMiB);
  ASSERT_TRUE(cache.Pin(a.data(), a.size()).ok());
  auto held = cache.Acquire(b.data(), b.size());
  cache.Clear();
  EXPECT_FALSE(t.Alive(a.data()));
  EXPECT_TRUE(t.Alive(b.data()));
  EXPECT_EQ(cache.stats().entries, 0u);
}

}  // namespace
}  // namespace client
}  // namespace optimus
