// Runs //bench:ucx_pair briefly over tcp on loopback and checks what its
// lines say: one line per way of connecting, both moved every message, and
// the lanes UCX gave the sender: an endpoint opened to a worker address has
// no zero-copy rendezvous lane (rma_bw) over tcp under peer-failure
// detection, one made through UCX's client-server flow has it
// (docs/benchmarks.md, "A bare UCX pair"). No figure is compared with a
// speed: the machine may be busy.
#include <sys/wait.h>

#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "bench/smoke_test_util.h"
#include "common/json.h"

namespace optimus {
namespace {

TEST(UcxPairSmokeTest, TcpAddressEndpointsLackTheRendezvousLaneClientServerOnesHaveIt) {
  const std::string out = bench::RunBenchCommand(
      bench::RunfilesRoot() +
      "/bench/ucx_pair --tls=tcp --size=1048576 --count=50 --burst=4 --buffers=4 --rounds=1");
  const std::vector<nlohmann::json> lines = bench::JsonLines(out);
  ASSERT_EQ(lines.size(), 2u) << out;
  const nlohmann::json& addr = lines[0];
  const nlohmann::json& cm = lines[1];
  EXPECT_EQ(addr.value("connect", ""), "addr");
  EXPECT_EQ(cm.value("connect", ""), "cm");
  for (const nlohmann::json* l : {&addr, &cm}) {
    EXPECT_FALSE(l->contains("error")) << l->dump();
    EXPECT_EQ(l->value("bench", ""), "ucx_pair");
    EXPECT_EQ(l->value("msg_bytes", 0), 1048576);
    EXPECT_GT(l->value("gbps", 0.0), 0.0) << l->dump();
    EXPECT_NE(l->value("lanes", "").find("tcp/lo"), std::string::npos) << l->dump();
  }
  EXPECT_EQ(addr.value("lanes", "").find("rma_bw"), std::string::npos) << addr.dump();
  EXPECT_NE(cm.value("lanes", "").find("rma_bw"), std::string::npos) << cm.dump();
  EXPECT_GT(cm.value("ratio_to_addr", 0.0), 0.0) << cm.dump();
}

// --evict_mb: either process streams other memory between bursts, and every
// message still arrives; each line says where the pass ran.
TEST(UcxPairSmokeTest, EvictionBetweenBurstsStillMovesEveryMessage) {
  for (const std::string side : {"receiver", "sender"}) {
    const std::string out = bench::RunBenchCommand(
        bench::RunfilesRoot() +
        "/bench/ucx_pair --tls=tcp --size=262144 --count=20 --burst=4 --buffers=4 --rounds=1 "
        "--evict_mb=8 --gap_ms=5 --evict_on=" + side);
    const std::vector<nlohmann::json> lines = bench::JsonLines(out);
    ASSERT_EQ(lines.size(), 2u) << out;
    for (const nlohmann::json& l : lines) {
      EXPECT_FALSE(l.contains("error")) << l.dump();
      EXPECT_EQ(l.value("evict_mb", 0), 8) << l.dump();
      EXPECT_EQ(l.value("evict_on", ""), side) << l.dump();
      EXPECT_GT(l.value("gbps", 0.0), 0.0) << l.dump();
    }
  }
}

// Bad eviction flags are refused with a clear message before anything runs.
TEST(UcxPairSmokeTest, BadEvictionFlagsAreRefused) {
  for (const auto& [flags, message] :
       std::vector<std::pair<std::string, std::string>>{{"--evict_mb=-1", "--evict_mb must be"},
                                                        {"--evict_on=both", "--evict_on must be"},
                                                        {"--evict_mb=8 --evict_on=sender",
                                                         "--evict_on=sender needs --gap_ms"}}) {
    int status = 0;
    const std::string out = bench::CommandOutput(
        bench::RunfilesRoot() + "/bench/ucx_pair --rounds=1 " + flags + " 2>&1", &status);
    ASSERT_TRUE(WIFEXITED(status)) << out;
    EXPECT_EQ(WEXITSTATUS(status), 2) << flags << ": " << out;
    EXPECT_NE(out.find(message), std::string::npos) << out;
    EXPECT_EQ(out.find("\"bench\""), std::string::npos) << out;  // Nothing measured.
  }
}

}  // namespace
}  // namespace optimus
