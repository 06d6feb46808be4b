// A fixed set of threads that runs the ranges of a parallel loop, for the
// optimizer kernels. The owner (the shard server, a benchmark) creates it and
// passes it by pointer; it must outlive every call that uses it. ParallelFor
// is safe to call from several threads at once: their ranges share the pool.
#ifndef OPTIMUS_KERNELS_CPU_THREAD_POOL_H_
#define OPTIMUS_KERNELS_CPU_THREAD_POOL_H_

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"

namespace optimus {
namespace kernels {

// std::mutex as a capability that clang's thread-safety analysis checks
// (libstdc++'s std::mutex carries no annotations; absl::Mutex would need
// abseil's libraries in the header-only aarch64 kernel build).
class ABSL_LOCKABLE PoolMutex {
 public:
  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  // Waits on `cv`: released while waiting, held again on return.
  void Wait(std::condition_variable& cv) ABSL_EXCLUSIVE_LOCKS_REQUIRED(this) {
    std::unique_lock<std::mutex> lock(mu_, std::adopt_lock);
    cv.wait(lock);
    lock.release();  // Still held: the caller unlocks it.
  }

 private:
  std::mutex mu_;
};

class ThreadPool {
 public:
  // num_threads (>= 1; smaller values count as 1) is how many threads one
  // ParallelFor uses: num_threads - 1 background threads are started here,
  // and the calling thread of ParallelFor runs one range itself. Each
  // background thread calls on_thread_start (if set) first: the shard uses it
  // to run them at the step threads' priority.
  explicit ThreadPool(int num_threads, std::function<void()> on_thread_start = nullptr);
  // Joins the background threads. No ParallelFor may be running.
  ~ThreadPool();

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Splits [0, num_items) into at most num_threads() contiguous ranges whose
  // boundaries are multiples of grain_items (0 counts as 1), each at least
  // grain_items long except the last, and calls fn(begin, end) once per range,
  // concurrently. Returns when every range has returned. fn must not throw.
  void ParallelFor(size_t num_items, size_t grain_items,
                   absl::FunctionRef<void(size_t begin, size_t end)> fn);

 private:
  struct Batch;  // one ParallelFor call: the function and its pending count
  struct Task {
    Batch* batch;
    size_t begin;
    size_t end;
  };

  void WorkerLoop();
  // Runs `task` without the lock and counts it done.
  void RunTask(const Task& task) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int num_threads_;
  PoolMutex mu_;
  std::condition_variable work_cv_;  // tasks_ became non-empty, or stopping_
  std::condition_variable done_cv_;  // some batch's pending count hit zero
  // A stack, not a queue: order does not matter and its capacity is reused,
  // so a steady stream of calls allocates nothing.
  std::vector<Task> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace kernels
}  // namespace optimus

#endif  // OPTIMUS_KERNELS_CPU_THREAD_POOL_H_
