#include "kernels/cpu/thread_pool.h"

#include <algorithm>
#include <cstddef>
#include <mutex>

namespace optimus {
namespace kernels {

struct ThreadPool::Batch {
  explicit Batch(absl::FunctionRef<void(size_t, size_t)> f) : fn(f) {}
  absl::FunctionRef<void(size_t, size_t)> fn;
  size_t pending = 0;  // guarded by the pool's mu_
};

ThreadPool::ThreadPool(int num_threads, std::function<void()> on_thread_start)
    : num_threads_(std::max(num_threads, 1)) {
  tasks_.reserve(static_cast<size_t>(num_threads_) * 4);
  threads_.reserve(static_cast<size_t>(num_threads_ - 1));
  for (int t = 1; t < num_threads_; ++t) {
    threads_.emplace_back([this, on_thread_start] {
      if (on_thread_start) on_thread_start();
      WorkerLoop();
    });
  }
}

ThreadPool::~ThreadPool() {
  mu_.Lock();
  stopping_ = true;
  mu_.Unlock();
  work_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void ThreadPool::RunTask(const Task& task) {
  mu_.Unlock();
  task.batch->fn(task.begin, task.end);
  mu_.Lock();
  if (--task.batch->pending == 0) done_cv_.notify_all();
}

void ThreadPool::WorkerLoop() {
  mu_.Lock();
  while (true) {
    while (!stopping_ && tasks_.empty()) mu_.Wait(work_cv_);
    if (tasks_.empty()) break;  // stopping_ and nothing left to run
    const Task task = tasks_.back();
    tasks_.pop_back();
    RunTask(task);
  }
  mu_.Unlock();
}

void ThreadPool::ParallelFor(size_t num_items, size_t grain_items,
                             absl::FunctionRef<void(size_t, size_t)> fn) {
  if (num_items == 0) return;
  const size_t grain = std::max<size_t>(grain_items, 1);
  const size_t num_grains = (num_items + grain - 1) / grain;
  const size_t num_ranges =
      std::min<size_t>(static_cast<size_t>(num_threads_), num_grains);
  if (num_ranges <= 1) {
    fn(0, num_items);
    return;
  }
  // Range r covers grains [r * num_grains / num_ranges, (r+1) * ...): sizes
  // differ by at most one grain.
  auto boundary = [&](size_t r) {
    return std::min(num_items, (r * num_grains / num_ranges) * grain);
  };
  Batch batch(fn);
  mu_.Lock();
  batch.pending = num_ranges;
  for (size_t r = 1; r < num_ranges; ++r) {
    tasks_.push_back(Task{&batch, boundary(r), boundary(r + 1)});
  }
  if (num_ranges > 2) {
    work_cv_.notify_all();
  } else {
    work_cv_.notify_one();
  }
  RunTask(Task{&batch, 0, boundary(1)});
  // Help with whatever is queued (ours or a concurrent caller's) rather than
  // sleep while work is waiting.
  while (batch.pending > 0) {
    if (!tasks_.empty()) {
      const Task task = tasks_.back();
      tasks_.pop_back();
      RunTask(task);
    } else {
      mu_.Wait(done_cv_);
    }
  }
  mu_.Unlock();
}

}  // namespace kernels
}  // namespace optimus
