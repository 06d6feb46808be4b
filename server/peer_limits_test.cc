#include "server/peer_limits.h"

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

}  // namespace
}  // namespace server
}  // namespace optimus
