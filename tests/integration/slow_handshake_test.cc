// A shard reaching a coordinator whose answers are slow (a loaded machine,
// a long network path): every byte between them is held back 300 ms by a
// TCP relay, so a TLS handshake takes over a second. The shard's link must
// still connect and register. Before the fix its channel gave each
// connection attempt at most 500 ms (gRPC reads the minimum reconnect
// backoff as the connect timeout), so every attempt was cut off and the
// shard never registered: a fault drill failed that way on a loaded machine.
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/security.h"
#include "gtest/gtest.h"
#include "server/coordinator_link.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"
#include "tests/harness/tcp_relay.h"

namespace optimus {
namespace harness {
namespace {

int PortOf(const std::string& address) {
  return std::stoi(address.substr(address.rfind(':') + 1));
}

TEST(SlowHandshakeTest, AShardRegistersThroughASlowLinkUnderTls) {
  ASSERT_OK_AND_ASSIGN(std::string ca, MakeTestCa(2));
  ClusterOptions o;
  o.num_shards = 1;
  o.num_workers = 1;
  o.tls_root = ca;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Cluster> cluster, Cluster::Start(o));
  TcpRelayOptions ro;
  ro.target_port = PortOf(cluster->coordinator_address());
  ro.piece_delay = absl::Milliseconds(300);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<TcpRelay> relay, TcpRelay::Start(ro));

  security::TlsOptions t;
  t.dir = absl::StrCat(ca, "/shard-1");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<server::CoordinatorLink> link,
                       server::NewGrpcCoordinatorLink(relay->address(), t));
  server::ShardRegistration r;
  r.arch = "x86_64";
  r.memory_limit_bytes = uint64_t{64} << 20;
  r.data_address = "slow-shard";
  r.hostname = "slow";
  // As the shard does: retry until registered, here for up to a minute
  // (generous: with the fix the first or second attempt succeeds).
  absl::StatusOr<server::Registered> reg = absl::UnavailableError("not tried");
  const absl::Time give_up = absl::Now() + absl::Minutes(1);
  while (!reg.ok() && absl::Now() < give_up) {
    reg = link->Register(r);
    if (!reg.ok()) absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_OK(reg.status());
  EXPECT_GT(reg->shard_id, 0u);
  // It is the coordinator's second shard, and it heartbeats through the
  // same slow link.
  ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, cluster->Status());
  EXPECT_EQ(st.shards_size(), 2);
  server::HeartbeatReport hb;
  hb.shard_id = reg->shard_id;
  absl::StatusOr<server::HeartbeatReply> beat = link->Heartbeat(hb);
  ASSERT_OK(beat.status());
  EXPECT_TRUE(beat->known);
  EXPECT_GE(relay->connections(), 1);
}

}  // namespace
}  // namespace harness
}  // namespace optimus
