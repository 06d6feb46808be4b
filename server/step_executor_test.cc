#include "server/step_executor.h"

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace optimus {
namespace server {
namespace {

// after_task runs after every task; before_wait once per run of tasks,
// when the thread finds the queue empty, and not between queued tasks
// (the shard sends a step thread's held acks from it).
TEST(StepExecutorTest, BeforeWaitRunsOnceWhenARunOfTasksDrainsTheQueue) {
  absl::Mutex mu;
  int after = 0, waits = 0, done = 0;
  StepExecutorHooks hooks;
  hooks.after_task = [&] {
    absl::MutexLock lock(&mu);
    ++after;
  };
  hooks.before_wait = [&] {
    absl::MutexLock lock(&mu);
    ++waits;
  };
  auto exec = std::make_unique<StepExecutor>(1, hooks);
  absl::Notification go;
  exec->Schedule([&] { go.WaitForNotification(); });
  for (int i = 0; i < 3; ++i) {
    exec->Schedule([&] {
      absl::MutexLock lock(&mu);
      ++done;
    });
  }
  go.Notify();
  {
    absl::MutexLock lock(&mu);
    auto drained = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return waits == 1; };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&drained), absl::Seconds(30)));
    EXPECT_EQ(done, 3);
    EXPECT_EQ(after, 4);
  }
  exec->Schedule([] {});
  {
    absl::MutexLock lock(&mu);
    auto again = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return waits == 2; };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&again), absl::Seconds(30)));
    EXPECT_EQ(after, 5);
  }
  exec.reset();  // Nothing ran since: no further call.
  EXPECT_EQ(waits, 2);
}

}  // namespace
}  // namespace server
}  // namespace optimus
