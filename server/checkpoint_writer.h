// The shard's checkpoint persister: chunk snapshots (copies of master and
// moments taken at a step boundary) go into a queue, and one background
// thread writes each as a checksummed data file (common/checkpoint_files.h),
// so workers never wait for the disk. It tracks each checkpoint's progress
// for the heartbeat's reports. Thread-safe; the destructor stops the thread
// (snapshots still queued are dropped: the checkpoint stays incomplete and
// the coordinator fails it when the shard's lease ends).
#ifndef OPTIMUS_SERVER_CHECKPOINT_WRITER_H_
#define OPTIMUS_SERVER_CHECKPOINT_WRITER_H_

#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "proto/optimus.pb.h"
#include "server/domain.h"

namespace optimus {
namespace server {

// One chunk's state at the checkpoint's step, owned by the writer once added.
struct ChunkSnapshot {
  uint64_t job_id = 0;
  uint64_t checkpoint_id = 0;
  uint32_t tensor = 0;
  uint64_t offset_elems = 0;
  uint64_t num_elems = 0;
  uint32_t num_arrays = 0;
  uint64_t optimizer_steps = 0;  // Steps the state has seen (torch's 'step').
  float last_lr = 0.0f;          // Of the last step taken.
  std::vector<float> data;  // num_arrays x num_elems, array after array.
};

class CheckpointWriter {
 public:
  // Writes at most `max_bytes_per_second` (0: no limit), so persisting does
  // not take the memory and disk bandwidth the optimizer needs.
  explicit CheckpointWriter(uint64_t max_bytes_per_second);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Whether Begin was called for this checkpoint (and not forgotten).
  bool Known(uint64_t job_id, uint64_t checkpoint_id) const;
  // Starts tracking a checkpoint whose files go into `dir`: it is done when
  // `num_chunks` snapshots are written. With make_dir the writer makes the
  // folder before the first file, and fails the checkpoint if the folder
  // holds a complete checkpoint already (one is never overwritten);
  // otherwise `dir` must exist. False, changing nothing, when the
  // checkpoint is tracked already.
  bool BeginIfNew(uint64_t job_id, uint64_t checkpoint_id, const std::string& dir,
                  uint32_t num_chunks, bool make_dir);
  void Begin(uint64_t job_id, uint64_t checkpoint_id, const std::string& dir,
             uint32_t num_chunks) {
    BeginIfNew(job_id, checkpoint_id, dir, num_chunks, /*make_dir=*/false);
  }
  // Queues a snapshot of a checkpoint that Begin started; dropped if that
  // checkpoint has failed.
  void Add(ChunkSnapshot snapshot);
  // Marks a checkpoint failed; `missed_step` says a later step may succeed.
  void Fail(uint64_t job_id, uint64_t checkpoint_id, const std::string& error,
            bool missed_step = false);
  // Marks every tracked checkpoint of the job failed (the job was deleted).
  void FailJob(uint64_t job_id, const std::string& error);
  // Progress of every tracked checkpoint, for the heartbeat; each counts as
  // reported from then on.
  std::vector<CheckpointReport> Reports();
  // Forgets the checkpoints not in `ordered` (what the coordinator still
  // wants reports of) once they are finished or failed and were reported
  // at least once: a policy checkpoint the coordinator has not heard of yet
  // stays.
  void Retain(const std::set<std::pair<uint64_t, uint64_t>>& ordered);

 private:
  struct Progress {
    std::string dir;
    uint32_t expected = 0;
    std::string error;
    bool missed_step = false;
    bool make_dir = false;  // Made (and checked) before the first file.
    bool reported = false;
    std::vector<v1::CheckpointFile> files;
  };
  using Key = std::pair<uint64_t, uint64_t>;  // (job, checkpoint).

  void Loop();

  const uint64_t max_bytes_per_second_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<ChunkSnapshot> queue_ ABSL_GUARDED_BY(mu_);
  std::map<Key, Progress> progress_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace server
}  // namespace optimus

#endif  // OPTIMUS_SERVER_CHECKPOINT_WRITER_H_
