// A fixed pool of threads owned by a shard server that runs optimizer steps
// (and other short CPU tasks) off the transport's progress thread.
// Thread-safe; the destructor finishes queued tasks and joins the threads.
#ifndef OPTIMUS_SERVER_STEP_EXECUTOR_H_
#define OPTIMUS_SERVER_STEP_EXECUTOR_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace optimus {
namespace server {

struct StepExecutorHooks {
  // Each thread calls it before it takes tasks.
  std::function<void()> on_thread_start;
  // A thread calls it after each task (without the executor's lock).
  std::function<void()> after_task;
  // A thread calls it when it finds the queue empty after running tasks,
  // before it sleeps (and once more before it exits, if it ran any since).
  std::function<void()> before_wait;
};

class StepExecutor {
 public:
  // Each thread calls on_thread_start (if set) before it takes tasks.
  explicit StepExecutor(int num_threads, std::function<void()> on_thread_start = nullptr);
  StepExecutor(int num_threads, StepExecutorHooks hooks);
  ~StepExecutor();
  StepExecutor(const StepExecutor&) = delete;
  StepExecutor& operator=(const StepExecutor&) = delete;

  void Schedule(std::function<void()> task);

 private:
  void Loop();
  bool HasWorkOrStopping() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stopping_ || !queue_.empty();
  }

  const StepExecutorHooks hooks_;
  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace server
}  // namespace optimus

#endif  // OPTIMUS_SERVER_STEP_EXECUTOR_H_
