#include "server/step_executor.h"

#include <utility>

namespace optimus {
namespace server {

StepExecutor::StepExecutor(int num_threads, std::function<void()> on_thread_start)
    : StepExecutor(num_threads, StepExecutorHooks{std::move(on_thread_start), nullptr, nullptr}) {}

StepExecutor::StepExecutor(int num_threads, StepExecutorHooks hooks) : hooks_(std::move(hooks)) {
  if (num_threads < 1) num_threads = 1;
  for (int i = 0; i < num_threads; ++i) {
    threads_.emplace_back([this] {
      if (hooks_.on_thread_start) hooks_.on_thread_start();
      Loop();
    });
  }
}

StepExecutor::~StepExecutor() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  for (auto& t : threads_) t.join();
}

void StepExecutor::Schedule(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(std::move(task));
}

void StepExecutor::Loop() {
  bool ran = false;  // Tasks since before_wait last ran.
  for (;;) {
    std::function<void()> task;
    mu_.Lock();
    if (ran && queue_.empty() && hooks_.before_wait) {
      mu_.Unlock();
      hooks_.before_wait();
      ran = false;
      mu_.Lock();
    }
    mu_.Await(absl::Condition(this, &StepExecutor::HasWorkOrStopping));
    if (queue_.empty()) {  // stopping_ and drained.
      mu_.Unlock();
      if (ran && hooks_.before_wait) hooks_.before_wait();
      return;
    }
    task = std::move(queue_.front());
    queue_.pop_front();
    mu_.Unlock();
    task();
    ran = true;
    if (hooks_.after_task) hooks_.after_task();
  }
}

}  // namespace server
}  // namespace optimus
