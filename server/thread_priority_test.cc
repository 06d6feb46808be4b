#include "server/thread_priority.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <thread>

#include "gtest/gtest.h"

namespace optimus {
namespace server {
namespace {

int ThisThreadNice() {
  return getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
}

// Each case on a thread of its own: nice stays with the thread.
TEST(LowerThisThreadPriorityTest, AddsToTheThreadsNiceUpTo19AndLeavesOthers) {
  const int start = ThisThreadNice();
  if (start > 14) GTEST_SKIP() << "the test already runs at nice " << start;
  int after_3 = 0, after_30 = 0, after_0 = 0;
  std::thread([&] {
    ASSERT_TRUE(LowerThisThreadPriority(3).ok());
    after_3 = ThisThreadNice();
  }).join();
  std::thread([&] {
    ASSERT_TRUE(LowerThisThreadPriority(30).ok());
    after_30 = ThisThreadNice();
  }).join();
  std::thread([&] {
    ASSERT_TRUE(LowerThisThreadPriority(0).ok());
    after_0 = ThisThreadNice();
  }).join();
  EXPECT_EQ(after_3, start + 3);
  EXPECT_EQ(after_30, 19);
  EXPECT_EQ(after_0, start);
  EXPECT_EQ(ThisThreadNice(), start);  // The caller's own is untouched.
}

}  // namespace
}  // namespace server
}  // namespace optimus
