// Runs //bench:dataplane with small cases (a 2 MiB tensor, short phases,
// one perftest run each) over shared memory and tcp, and checks that its
// lines say what the figures in docs/benchmarks.md rely on: every case ran,
// every baseline ran on the transport it names (plain ucx_perftest, perftest
// with optimus's failure detection, perftest at the tensor's size), shared
// memory was what UCX picked for sm with detection on, buffers were
// registered once rather than per transfer, and the staging pool keeps a
// shard's memory at the state's 16 B per parameter whatever W is. No figure
// is compared with a speed: the machine may be busy.
#include <sched.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "bench/smoke_test_util.h"
#include "common/json.h"

namespace optimus {
namespace {

// The bench's stdout (its JSON lines).
std::string RunBench(const std::string& args) {
  const std::string root = bench::RunfilesRoot();
  return bench::RunBenchCommand(root + "/bench/dataplane --bin_dir=" + root + " --work_dir=" +
                                std::getenv("TEST_TMPDIR") + "/dataplane " + args);
}

double Num(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : -1.0;
}

std::string Str(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : "";
}

constexpr int kSmallTensors = 50;
constexpr int kStagingWorkers = 4;

class DataplaneSmokeTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    out_ = new std::string(RunBench(
        "--cases=goodput,small_tensors,staging --tls='sm;tcp' --sizes=256K --workers=1,2 "
        "--shards=1 --seconds=0.2 --tensor_mib=2 --perftest_repeats=1 --perftest_mib=16 "
        "--small_tensors=50 --small_steps=2 --small_rounds=1 --staging_workers=4 "
        "--staging_params=4194304 --staging_steps=2 --shard_memory_mb=256"));
  }
  static void TearDownTestSuite() { delete out_; }
  static std::string* out_;
};

std::string* DataplaneSmokeTest::out_ = nullptr;

// With two or more CPUs to run on, the workers and the servers (and
// ucx_perftest's client and server) are on CPUs of their own, and the lines
// say which (--placement=split, the default).
TEST_F(DataplaneSmokeTest, WorkersAndServersRunOnCpusOfTheirOwn) {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  const bool split = CPU_COUNT(&allowed) >= 2;
  int cases = 0, clusters = 0;
  for (const nlohmann::json& l : bench::JsonLines(*out_)) {
    const std::string placement = Str(l, "placement");
    EXPECT_EQ(absl::StartsWith(placement, "split: workers on CPUs "), split) << l.dump();
    if (l.contains("case")) ++cases;
    if (Str(l, "event") == "cluster") {
      ++clusters;
      ASSERT_TRUE(l.contains("commands")) << l.dump();
      for (const auto& cmd : l["commands"]) {
        EXPECT_EQ(absl::StartsWith(cmd.get<std::string>(), "taskset -c "), split) << l.dump();
      }
    }
    if (split && l.contains("ucx_perftest_client_cmd")) {
      EXPECT_NE(Str(l, "ucx_perftest_client_cmd").find("taskset -c "), std::string::npos)
          << l.dump();
      EXPECT_NE(Str(l, "ucx_perftest_server_cmd").find("taskset -c "), std::string::npos)
          << l.dump();
    }
  }
  EXPECT_GT(cases, 0);
  EXPECT_GT(clusters, 0);
}

// Every case line names the kernel's TCP congestion control, which decides
// what loopback tcp (and so ucx_perftest's baseline) reads on a machine.
TEST_F(DataplaneSmokeTest, CaseLinesNameTheTcpCongestionControl) {
  std::ifstream in("/proc/sys/net/ipv4/tcp_congestion_control");
  std::string want;
  std::getline(in, want);
  int cases = 0;
  for (const nlohmann::json& l : bench::JsonLines(*out_)) {
    if (!l.contains("case")) continue;
    ++cases;
    EXPECT_EQ(Str(l, "tcp_congestion_control"), want) << l.dump();
  }
  EXPECT_GT(cases, 0);
}

TEST_F(DataplaneSmokeTest, EveryLineIsJsonAndNoCaseFailed) {
  const std::vector<nlohmann::json> lines = bench::JsonLines(*out_);
  ASSERT_FALSE(lines.empty()) << *out_;
  for (const nlohmann::json& l : lines) {
    EXPECT_EQ(Str(l, "bench"), "dataplane") << l.dump();
    EXPECT_FALSE(l.contains("error")) << l.dump();
    EXPECT_FALSE(l.contains("ucx_perftest_detect_error")) << l.dump();
    EXPECT_FALSE(l.contains("ucx_perftest_ws_error")) << l.dump();
  }
}

TEST_F(DataplaneSmokeTest, GoodputLinesCarryEveryBaselineOnTheirTransport) {
  // (case, transport, W) -> line.
  std::map<std::tuple<std::string, std::string, int>, nlohmann::json> cases;
  for (const nlohmann::json& l : bench::JsonLines(*out_)) {
    const std::string kase = Str(l, "case");
    if (kase != "push" && kase != "pull") continue;
    const auto key = std::make_tuple(kase, Str(l, "transport"), static_cast<int>(Num(l, "workers")));
    EXPECT_EQ(cases.count(key), 0u) << "twice: " << l.dump();
    cases[key] = l;
  }
  for (const char* tls : {"sm", "tcp"}) {
    for (const char* kase : {"push", "pull"}) {
      for (int w : {1, 2}) {
        SCOPED_TRACE(std::string(kase) + " over " + tls + ", W=" + std::to_string(w));
        auto it = cases.find(std::make_tuple(kase, tls, w));
        ASSERT_NE(it, cases.end()) << *out_;
        const nlohmann::json& l = it->second;
        EXPECT_EQ(Num(l, "msg_bytes"), 262144.0);
        EXPECT_EQ(Num(l, "shards"), 1.0);
        // A 2 MiB tensor in 256 KiB chunks.
        EXPECT_EQ(Num(l, "tensor_bytes"), 2097152.0) << l.dump();
        EXPECT_EQ(Num(l, "chunks"), 8.0) << l.dump();
        EXPECT_GE(Num(l, "iterations"), 3.0) << l.dump();
        const double gbps = Num(l, "optimus_gbps");
        EXPECT_GT(gbps, 0.0) << l.dump();
        // What UCX picked for the workers' endpoints, with failure detection
        // on: shared memory for sm (not a fallback to tcp), tcp for tcp.
        const std::string in_use = Str(l, "transports_in_use");
        if (std::string(tls) == "sm") {
          EXPECT_TRUE(absl::StrContains(in_use, "cma") || absl::StrContains(in_use, "sysv") ||
                      absl::StrContains(in_use, "posix"))
              << in_use;
          EXPECT_FALSE(absl::StrContains(in_use, "tcp")) << in_use;
        } else {
          EXPECT_EQ(in_use, "tcp");
        }
        // Baseline 1: plain perftest, same transport and message size.
        const double perftest = Num(l, "ucx_perftest_gbps");
        EXPECT_GT(perftest, 0.0) << l.dump();
        ASSERT_TRUE(l.contains("ucx_perftest_runs_gbps")) << l.dump();
        EXPECT_EQ(l["ucx_perftest_runs_gbps"].size(), 1u);
        if (perftest > 0) {
          EXPECT_NEAR(Num(l, "ratio"), gbps / perftest, 0.01 * gbps / perftest + 0.002);
        }
        const std::string client = Str(l, "ucx_perftest_client_cmd");
        EXPECT_TRUE(absl::StrContains(client, std::string("UCX_TLS=") + tls + " ")) << client;
        EXPECT_TRUE(absl::StrContains(client, "-s 262144")) << client;
        EXPECT_FALSE(absl::StrContains(client, " -e")) << client;
        // Baseline 2: perftest with the UCX settings of optimus's failure
        // detection and error-handling endpoints.
        const double detect = Num(l, "ucx_perftest_detect_gbps");
        EXPECT_GT(detect, 0.0) << l.dump();
        if (detect > 0) {
          EXPECT_NEAR(Num(l, "ratio_detect"), gbps / detect, 0.01 * gbps / detect + 0.002);
        }
        const std::string detect_client = Str(l, "ucx_perftest_detect_client_cmd");
        EXPECT_TRUE(absl::StrContains(detect_client, std::string("UCX_TLS=") + tls + " "))
            << detect_client;
        EXPECT_TRUE(absl::StrContains(detect_client, "UCX_KEEPALIVE_INTERVAL=")) << detect_client;
        EXPECT_TRUE(absl::StrContains(detect_client, " -e")) << detect_client;
        // Baseline 3: perftest with one message of the tensor's size.
        EXPECT_GT(Num(l, "ucx_perftest_ws_gbps"), 0.0) << l.dump();
        EXPECT_EQ(Num(l, "ucx_perftest_ws_msg_bytes"), 2097152.0) << l.dump();
        EXPECT_TRUE(absl::StrContains(Str(l, "ucx_perftest_ws_client_cmd"), "-s 2097152"))
            << l.dump();
        // Buffers registered once and reused: a few per worker for the
        // whole case, against (iterations x 8 chunks) transfers per worker.
        EXPECT_GT(Num(l, "registrations"), 0.0) << l.dump();
        EXPECT_LE(Num(l, "registrations"), 4.0 * w) << l.dump();
        // No heap allocation per message on the send and receive paths.
        EXPECT_GE(Num(l, "allocs_per_msg"), 0.0) << l.dump();
        EXPECT_LT(Num(l, "allocs_per_msg"), 1.0) << l.dump();
        ASSERT_TRUE(l.contains("shard_memory_used_bytes")) << l.dump();
        ASSERT_EQ(l["shard_memory_used_bytes"].size(), 1u) << l.dump();
        EXPECT_GT(l["shard_memory_used_bytes"][0].get<double>(), 0.0) << l.dump();
      }
    }
  }
}

TEST_F(DataplaneSmokeTest, SmallTensorsAgainstOneTensorOfTheSameBytes) {
  int seen = 0;
  for (const nlohmann::json& l : bench::JsonLines(*out_)) {
    if (Str(l, "case") != "small_tensors") continue;
    ++seen;
    EXPECT_EQ(Num(l, "tensors"), kSmallTensors) << l.dump();
    EXPECT_GT(Num(l, "steps_per_s"), 0.0) << l.dump();
    EXPECT_GT(Num(l, "baseline_steps_per_s"), 0.0) << l.dump();
    EXPECT_GT(Num(l, "ratio"), 0.0) << l.dump();
    EXPECT_GT(Num(l, "messages_per_step"), 0.0) << l.dump();
  }
  EXPECT_EQ(seen, 1) << *out_;
}

TEST_F(DataplaneSmokeTest, StagingPoolHoldsMemoryAtTheStateWhateverW) {
  int seen = 0;
  for (const nlohmann::json& l : bench::JsonLines(*out_)) {
    if (Str(l, "case") != "staging") continue;
    ++seen;
    EXPECT_EQ(Num(l, "workers"), kStagingWorkers) << l.dump();
    EXPECT_EQ(Str(l, "optimizer"), "adamw") << l.dump();
    EXPECT_GT(Num(l, "steps_per_s"), 0.0) << l.dump();
    EXPECT_GT(Num(l, "baseline_steps_per_s"), 0.0) << l.dump();
    // AdamW with bf16 publication: 16 B per parameter of state and
    // published copy; the gradients are in the pool, which is bounded.
    EXPECT_GE(Num(l, "memory_used_less_staging_per_param"), 0.0) << l.dump();
    EXPECT_LE(Num(l, "memory_used_less_staging_per_param"), 16.0) << l.dump();
    EXPECT_LE(Num(l, "staging_held_bytes"), Num(l, "staging_limit_bytes")) << l.dump();
    // The layout it replaced holds W bf16 gradient slots per parameter.
    EXPECT_GE(Num(l, "baseline_memory_used_per_param"), 16.0 + 2.0 * kStagingWorkers) << l.dump();
    EXPECT_GT(Num(l, "kernel_mean_s"), 0.0) << l.dump();
    EXPECT_GT(Num(l, "tail_over_kernel"), 0.0) << l.dump();
  }
  EXPECT_EQ(seen, 1) << *out_;
}

}  // namespace
}  // namespace optimus
