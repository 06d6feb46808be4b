#include "server/peer_limits.h"

#include <cstring>
#include <memory>
#include <vector>

#include "gtest/gtest.h"

namespace optimus {
namespace server {
namespace {

TEST(PeerLimitsTest, ParkedPullsAreBoundedPerPeerAndInAll) {
  PeerLimits l(PeerLimitOptions{2, 3, 100});
  EXPECT_TRUE(l.TryPark(1));
  EXPECT_TRUE(l.TryPark(1));
  EXPECT_FALSE(l.TryPark(1));  // Peer 1's share.
  EXPECT_TRUE(l.TryPark(2));
  EXPECT_FALSE(l.TryPark(3));  // The shard's.
  EXPECT_EQ(l.parked(), 3u);
  EXPECT_EQ(l.parked_refusals(), 2u);
  EXPECT_EQ(l.peers_with_parked(), 2u);
  l.Unpark(1);
  EXPECT_TRUE(l.TryPark(3));
  l.Unpark(1);
  l.Unpark(2);
  l.Unpark(3);
  // Nothing is kept of peers with nothing parked; an unknown peer's
  // Unpark changes nothing.
  EXPECT_EQ(l.peers_with_parked(), 0u);
  EXPECT_EQ(l.parked(), 0u);
  l.Unpark(9);
  EXPECT_EQ(l.parked(), 0u);
}

TEST(PeerLimitsTest, InflightBytesAreBoundedAndOneLargeRequestGoesAlone) {
  PeerLimits l(PeerLimitOptions{1, 1, 100});
  EXPECT_TRUE(l.TryReserveBytes(60));
  EXPECT_FALSE(l.TryReserveBytes(50));
  EXPECT_TRUE(l.TryReserveBytes(40));
  EXPECT_EQ(l.inflight_bytes(), 100u);
  EXPECT_FALSE(l.TryReserveBytes(1000));
  l.ReleaseBytes(60);
  l.ReleaseBytes(40);
  EXPECT_TRUE(l.TryReserveBytes(1000));  // Larger than the limit, alone.
  EXPECT_FALSE(l.TryReserveBytes(1));
  l.ReleaseBytes(1000);
  EXPECT_EQ(l.inflight_bytes(), 0u);
  EXPECT_EQ(l.inflight_refusals(), 3u);
}

TEST(ReceiveBufferPoolTest, ABatchLandsInTheBufferTheLastOneUsedAndItsBytesAreGivenBack) {
  auto limits = std::make_shared<PeerLimits>(PeerLimitOptions{1, 1, 1000});
  auto pool = ReceiveBufferPool::Create(/*keep=*/2, /*capacity=*/100);
  ASSERT_TRUE(limits->TryReserveBytes(60));
  auto a = pool->Take(limits, 60);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->size(), 60u);
  std::memset(a->data(), 7, a->size());
  uint8_t* const first = a->data();
  a.reset();
  EXPECT_EQ(limits->inflight_bytes(), 0u);
  EXPECT_EQ(pool->idle(), 1u);
  // The next batch, of another size, gets the same memory; nothing new.
  ASSERT_TRUE(limits->TryReserveBytes(100));
  auto b = pool->Take(limits, 100);
  EXPECT_EQ(b->data(), first);
  EXPECT_EQ(b->size(), 100u);
  EXPECT_EQ(pool->allocations(), 1u);
  EXPECT_EQ(pool->idle(), 0u);
  b.reset();
  EXPECT_EQ(limits->inflight_bytes(), 0u);
}

TEST(ReceiveBufferPoolTest, KeepsAtMostKeepIdleAndNoBufferLargerThanItsCapacity) {
  auto limits = std::make_shared<PeerLimits>(PeerLimitOptions{1, 1, 1000});
  auto pool = ReceiveBufferPool::Create(/*keep=*/2, /*capacity=*/100);
  std::vector<std::shared_ptr<ReceiveBufferPool::Buffer>> held;
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(limits->TryReserveBytes(100));
    held.push_back(pool->Take(limits, 100));
  }
  EXPECT_EQ(pool->allocations(), 4u);
  held.clear();
  EXPECT_EQ(pool->idle(), 2u);
  EXPECT_EQ(limits->inflight_bytes(), 0u);
  // A batch over the capacity: a buffer of its own, large enough, let go
  // after it.
  ASSERT_TRUE(limits->TryReserveBytes(300));
  auto big = pool->Take(limits, 300);
  EXPECT_EQ(big->size(), 300u);
  std::memset(big->data(), 1, big->size());
  EXPECT_EQ(pool->allocations(), 5u);
  EXPECT_EQ(pool->idle(), 2u);
  big.reset();
  EXPECT_EQ(pool->idle(), 2u);
  EXPECT_EQ(limits->inflight_bytes(), 0u);
}

TEST(ReceiveBufferPoolTest, ABufferOutlivesThePoolsOwner) {
  auto limits = std::make_shared<PeerLimits>(PeerLimitOptions{1, 1, 1000});
  auto pool = ReceiveBufferPool::Create(2, 100);
  ASSERT_TRUE(limits->TryReserveBytes(10));
  auto a = pool->Take(limits, 10);
  std::weak_ptr<ReceiveBufferPool> seen = pool;
  pool.reset();
  limits.reset();
  EXPECT_FALSE(seen.expired());  // Held by the buffer.
  std::memset(a->data(), 3, a->size());
  a.reset();
  EXPECT_TRUE(seen.expired());
}

}  // namespace
}  // namespace server
}  // namespace optimus
