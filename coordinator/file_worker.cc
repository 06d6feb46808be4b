#include "coordinator/file_worker.h"

#include <utility>

namespace optimus {

FileWorker::FileWorker() { thread_ = std::thread([this] { Run(); }); }

FileWorker::~FileWorker() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void FileWorker::Queue(std::function<void()> task) {
  absl::MutexLock lock(&mu_);
  tasks_.push_back(std::move(task));
  ++queued_;
}

void FileWorker::Flush() {
  absl::MutexLock lock(&mu_);
  const uint64_t target = queued_;
  auto done = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return done_ >= target; };
  mu_.Await(absl::Condition(&done));
}

void FileWorker::Run() {
  while (true) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !tasks_.empty() || stop_;
      };
      mu_.Await(absl::Condition(&ready));
      if (tasks_.empty()) return;  // Stopping, nothing left.
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
    absl::MutexLock lock(&mu_);
    ++done_;
  }
}

}  // namespace optimus
