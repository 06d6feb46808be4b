#include "common/cpu_count.h"

#include <sched.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "gtest/gtest.h"

namespace optimus {
namespace {

namespace fs = std::filesystem;

TEST(CpuCountTest, ReadsCgroupV2Quotas) {
  EXPECT_FALSE(QuotaCoresV2("max 100000\n").has_value());
  EXPECT_EQ(QuotaCoresV2("400000 100000\n"), 4);
  EXPECT_EQ(QuotaCoresV2("150000 100000"), 2);  // 1.5 cores: two threads.
  EXPECT_EQ(QuotaCoresV2("20000 100000"), 1);
  EXPECT_EQ(QuotaCoresV2("300000"), 3);  // The period defaults to 100 ms.
  EXPECT_FALSE(QuotaCoresV2("").has_value());
  EXPECT_FALSE(QuotaCoresV2("lots 100000").has_value());
  EXPECT_FALSE(QuotaCoresV2("100000 0").has_value());
}

TEST(CpuCountTest, ReadsCgroupV1Quotas) {
  EXPECT_FALSE(QuotaCoresV1("-1\n", "100000\n").has_value());
  EXPECT_EQ(QuotaCoresV1("800000\n", "100000\n"), 8);
  EXPECT_EQ(QuotaCoresV1("50000", "100000"), 1);
  EXPECT_FALSE(QuotaCoresV1("x", "100000").has_value());
}

class CgroupTreeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::path(::testing::TempDir()) /
            ::testing::UnitTest::GetInstance()->current_test_info()->name();
    fs::remove_all(root_);
  }
  void Write(const std::string& rel, const std::string& text) {
    const fs::path p = root_ / rel;
    fs::create_directories(p.parent_path());
    std::ofstream(p) << text;
  }
  fs::path root_;
};

// A pod's container: the tightest quota on the way up wins.
TEST_F(CgroupTreeTest, TakesTheTightestQuotaOverTheCgroupAndItsParents) {
  Write("cpu.max", "max 100000\n");
  Write("kubepods/cpu.max", "6000000 100000\n");
  Write("kubepods/pod7/cpu.max", "1600000 100000\n");
  Write("kubepods/pod7/shard/cpu.max", "max 100000\n");
  EXPECT_EQ(CgroupQuotaCores(root_, "0::/kubepods/pod7/shard\n"), 16);
  Write("kubepods/cpu.max", "400000 100000\n");
  EXPECT_EQ(CgroupQuotaCores(root_, "0::/kubepods/pod7/shard\n"), 4);
  // No quota anywhere, or no such cgroup: no limit.
  EXPECT_FALSE(CgroupQuotaCores(root_, "0::/elsewhere\n").has_value());
  EXPECT_FALSE(CgroupQuotaCores(root_, "").has_value());
}

TEST_F(CgroupTreeTest, ReadsTheV1CpuController) {
  Write("cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "250000\n");
  Write("cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n");
  Write("cpu,cpuacct/cpu.cfs_quota_us", "-1\n");
  Write("cpu,cpuacct/cpu.cfs_period_us", "100000\n");
  const std::string self =
      "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n0::/\n";
  EXPECT_EQ(CgroupQuotaCores(root_, self), 3);
  // A quota set only on a controller other than cpu is not a CPU limit.
  EXPECT_FALSE(CgroupQuotaCores(root_, "5:memory:/docker/abc\n").has_value());
}

// Threads inherit their creator's CPU mask: a thread pinned to one CPU
// counts one, whatever the machine has.
TEST(CpuCountTest, CountsTheCpusThisThreadMayRunOn) {
  cpu_set_t mine;
  CPU_ZERO(&mine);
  ASSERT_EQ(sched_getaffinity(0, sizeof(mine), &mine), 0);
  EXPECT_EQ(AffinityCores(), CPU_COUNT(&mine));
  EXPECT_GE(UsableCores(), 1);
  EXPECT_LE(UsableCores(), CPU_COUNT(&mine));
  int pinned = 0, usable = 0;
  std::thread t([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &mine)) {
        CPU_SET(c, &one);
        break;
      }
    }
    if (sched_setaffinity(0, sizeof(one), &one) != 0) return;
    pinned = AffinityCores();
    usable = UsableCores();
  });
  t.join();
  EXPECT_EQ(pinned, 1);
  EXPECT_EQ(usable, 1);
}

}  // namespace
}  // namespace optimus
