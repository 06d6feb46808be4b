// The coordinator's checkpoint bookkeeping: orders checkpoints (on request or
// by a job's policy), collects the shards' reports, writes the manifest once
// every shard's files are on disk, keeps the last K complete checkpoints,
// lists them, and verifies one before a restore. Files live under
// dir/<job name>/ckpt-<id>/ (see common/checkpoint_files.h).
//
// Owned by the Coordinator. Thread-safe; its lock is always taken after the
// Coordinator's (it never calls back into the Coordinator).
#ifndef OPTIMUS_COORDINATOR_CHECKPOINTS_H_
#define OPTIMUS_COORDINATOR_CHECKPOINTS_H_

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/optimus.pb.h"

namespace optimus {

// What the manager needs to know of a job, copied under the Coordinator's lock.
struct CheckpointJobView {
  uint64_t job_id = 0;
  v1::JobSpec spec;
  v1::JobState state = v1::JOB_STATE_UNSPECIFIED;
  // Shards holding its chunks as primary (backups write no checkpoint part).
  std::set<uint64_t> owners;
  std::set<uint64_t> owners_without_checkpoint_dir;
  uint64_t min_applied_step = 0;    // As last reported.
  uint64_t max_applied_step = 0;
  uint64_t resume_step = 1;
};

class CheckpointManager {
 public:
  // `dir` empty: checkpoints are off and every call says so.
  explicit CheckpointManager(std::string dir);
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  bool enabled() const { return !dir_.empty(); }

  // Orders a checkpoint of `job` at step max_applied_step + 1 (a version no
  // chunk has passed). FAILED_PRECONDITION when off, the job is not READY,
  // one is in progress, or a shard has no checkpoint dir.
  absl::StatusOr<v1::CheckpointInfo> Create(const CheckpointJobView& job);

  // Runs the policies (every N steps / T seconds) and retries checkpoints
  // whose step a shard had already passed. Called by the sweeper.
  void Tick(const std::vector<CheckpointJobView>& jobs, absl::Time now);

  // Takes a shard's reports and returns the orders it must carry out.
  std::vector<v1::CheckpointOrder> OnHeartbeat(
      uint64_t shard_id,
      const google::protobuf::RepeatedPtrField<v1::ShardCheckpointReport>& reports);

  // Fails the job's checkpoint in progress (a shard went down).
  void OnJobFailed(uint64_t job_id, const std::string& why);

  // The job's primaries changed (a failover or a drain moved chunks): a
  // checkpoint in progress ordered from other owners is retried at a later
  // step over the job's new owners by the next Tick (a lost owner never
  // reports, and a chunk's new primary was never ordered).
  void OnOwnersChanged(uint64_t job_id, const std::set<uint64_t>& owners);

  // Checkpoints of job `job_name`, oldest first: complete ones found on disk
  // plus those in progress or failed since this coordinator started.
  std::vector<v1::CheckpointInfo> List(const std::string& job_name);
  // The newest of List, if any.
  std::optional<v1::CheckpointInfo> Last(const std::string& job_name);

  // Finds checkpoint `checkpoint_id` (0: the newest complete one) of
  // `job_name`, reads its manifest and verifies every file's checksum.
  // NOT_FOUND without one; DATA_LOSS naming the corrupted file.
  absl::StatusOr<v1::RestoreSource> PrepareRestore(const std::string& job_name,
                                                   uint64_t checkpoint_id,
                                                   v1::CheckpointInfo* info);

 private:
  struct InProgress {
    uint64_t job_id = 0;
    v1::JobSpec spec;
    v1::CheckpointInfo info;
    std::set<uint64_t> owners;
    std::map<uint64_t, v1::ShardCheckpointReport> reports;  // By shard.
    int attempt = 0;
    bool retry = false;       // A shard had passed the step: order a later one.
  };
  struct PolicyState {
    uint64_t last_step = 0;   // Steps applied when the last checkpoint was ordered.
    absl::Time last_time;
  };
  // How fast a job's steps advance, from the progress heartbeats report.
  struct Pace {
    uint64_t step = 0;
    absl::Time time;
    double steps_per_second = 0;  // Smoothed.
  };

  // The step to order so that, at the job's pace, the order reaches every
  // shard before training gets there (orders travel on heartbeat replies,
  // and progress comes back on heartbeats: up to two intervals late).
  // A job with no progress for a lead time counts as paused: the order then
  // aims at the next step.
  uint64_t StepAheadLocked(const CheckpointJobView& job, absl::Time now) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  std::string JobDir(const std::string& job_name) const;
  uint64_t NextIdLocked(const std::string& job_name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<v1::CheckpointInfo> StartLocked(const CheckpointJobView& job, uint64_t step)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FinishLocked(uint64_t job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailLocked(uint64_t job_id, const std::string& error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PruneLocked(const std::string& job_name, uint32_t keep_last)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string dir_;
  absl::Mutex mu_;
  std::map<uint64_t, InProgress> in_progress_ ABSL_GUARDED_BY(mu_);  // By job id.
  // Failed checkpoints by job name (their files are removed), newest last.
  std::map<std::string, std::vector<v1::CheckpointInfo>> failed_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, PolicyState> policy_ ABSL_GUARDED_BY(mu_);  // By job id.
  std::map<uint64_t, Pace> pace_ ABSL_GUARDED_BY(mu_);            // By job id.
  std::map<std::string, uint64_t> last_id_ ABSL_GUARDED_BY(mu_);  // By job name.
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_CHECKPOINTS_H_
