// A thread that runs file work (closures) one after another, in the order
// it was queued, so that code holding a lock that heartbeats need can hand
// its disk I/O over instead of doing it. Queue never waits for I/O; Flush
// waits until everything queued before it has run.
//
// Owns its thread; the destructor runs what is still queued, then joins.
// Thread-safe. A task must not call Flush (it would wait for itself).
#ifndef OPTIMUS_COORDINATOR_FILE_WORKER_H_
#define OPTIMUS_COORDINATOR_FILE_WORKER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace optimus {

class FileWorker {
 public:
  FileWorker();
  ~FileWorker();
  FileWorker(const FileWorker&) = delete;
  FileWorker& operator=(const FileWorker&) = delete;

  void Queue(std::function<void()> task);
  // Waits until every task queued before this call has run.
  void Flush();

 private:
  void Run();

  absl::Mutex mu_;
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  uint64_t queued_ ABSL_GUARDED_BY(mu_) = 0;  // Tasks queued so far.
  uint64_t done_ ABSL_GUARDED_BY(mu_) = 0;    // Tasks run so far.
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_FILE_WORKER_H_
