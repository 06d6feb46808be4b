// The coordinator's checkpoint bookkeeping: orders checkpoints on request
// (or every T seconds by a job's policy), takes up the ones the shards take
// on their own at the policy's step boundaries (every N steps: no order
// races the training), collects the shards' reports, writes the manifest
// once every shard's files are on disk, keeps the last K complete
// checkpoints, lists them, and verifies one before a restore. A checkpoint's
// id is its step; its files live under dir/<job name>/ckpt-<step>/ (see
// common/checkpoint_files.h).
//
// Disk I/O never happens under a lock: bookkeeping (orders, reports, states)
// is done under the manager's own lock, which is always taken after the
// Coordinator's and never held while touching the disk; file work that
// follows from it (a checkpoint's folder, its manifest, pruning, removing
// what a failed one left) runs in order on the manager's file thread, so a
// heartbeat that completes a checkpoint never waits for its manifest.
// Reads (List, PrepareRestore) do their I/O on the caller's thread without
// any lock held.
//
// Owned by the Coordinator. Thread-safe; never calls back into the
// Coordinator. The destructor finishes the queued file work.
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
#include "coordinator/file_worker.h"
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
  // one is in progress, or a shard has no checkpoint dir; INVALID_ARGUMENT
  // for a job name that cannot name a folder. Bookkeeping only (callable
  // under the Coordinator's lock): its folder is made on the file thread,
  // and shards are sent the order once it exists. Returns a ticket for
  // AwaitStart.
  absl::StatusOr<uint64_t> Start(const CheckpointJobView& job);
  // Waits for Start's folder (call it with no lock held): the checkpoint,
  // IN_PROGRESS; or the error that failed it (the folder cannot be made),
  // or ABORTED when its job was deleted first.
  absl::StatusOr<v1::CheckpointInfo> AwaitStart(uint64_t ticket);
  // Start, then AwaitStart.
  absl::StatusOr<v1::CheckpointInfo> Create(const CheckpointJobView& job);

  // Runs the policies (every N steps / T seconds) and retries checkpoints
  // whose step a shard had already passed. Bookkeeping; the file work is
  // queued. Called by the sweeper.
  void Tick(const std::vector<CheckpointJobView>& jobs, absl::Time now);

  // Takes a shard's reports and returns the orders it must carry out (or,
  // for policy checkpoints, keep reporting). The first report of a policy
  // checkpoint (a step boundary of its job's every_steps, after its resume
  // step) puts it in progress over the job's owners, unless another of the
  // job's checkpoints is in progress (then that boundary is skipped). `jobs`
  // holds the views of the jobs the reports name. Once every owner reported
  // its part, the manifest is written on the file thread (the checkpoint
  // stays IN_PROGRESS until it is).
  std::vector<v1::CheckpointOrder> OnHeartbeat(
      uint64_t shard_id,
      const google::protobuf::RepeatedPtrField<v1::ShardCheckpointReport>& reports,
      const std::map<uint64_t, CheckpointJobView>& jobs);

  // Fails the job's checkpoint in progress (a shard went down).
  void OnJobFailed(uint64_t job_id, const std::string& why);

  // The job's primaries changed (a failover or a drain moved chunks): a
  // checkpoint in progress ordered from other owners is retried at a later
  // step over the job's new owners by the next Tick (a lost owner never
  // reports, and a chunk's new primary was never ordered).
  void OnOwnersChanged(uint64_t job_id, const std::set<uint64_t>& owners);

  // The job was deleted: its checkpoint in progress ends (its partial folder
  // is removed; complete checkpoints stay on disk) and what was kept for it
  // by id (policy, pace) goes.
  void OnJobDeleted(uint64_t job_id);
  // No job has `job_name` any more: forgets what was kept by name (failed
  // checkpoints). Its folders stay.
  void ForgetJobName(const std::string& job_name);

  // Checkpoints of job `job_name`, oldest first: complete ones found on disk
  // plus those in progress or failed since this coordinator started. Waits
  // for the file work queued before it (a manifest being written) so that it
  // shows the outcome of every report already taken.
  std::vector<v1::CheckpointInfo> List(const std::string& job_name);
  // The newest checkpoint, without waiting for queued file work (for
  // status: a manifest being written shows as IN_PROGRESS).
  std::optional<v1::CheckpointInfo> Last(const std::string& job_name);

  // Finds checkpoint `checkpoint_id` (0: the newest complete one) of
  // `job_name`, reads its manifest and verifies every file's checksum.
  // NOT_FOUND without one; DATA_LOSS naming the corrupted file.
  absl::StatusOr<v1::RestoreSource> PrepareRestore(const std::string& job_name,
                                                   uint64_t checkpoint_id,
                                                   v1::CheckpointInfo* info);

  // Waits until the file work queued so far has run (tests; List).
  void WaitForFileWork() { files_.Flush(); }

  // Sizes of the tables kept, for tests that check nothing grows.
  struct TableSizes {
    size_t in_progress = 0;
    size_t policies = 0;
    size_t paces = 0;
    size_t names = 0;  // Job names with failed checkpoints kept.
  };
  TableSizes table_sizes() const;

 private:
  enum class Phase {
    kStarting,   // Waiting for the file thread to make its folder; no orders yet.
    kOrdered,    // Orders out; collecting reports.
    kRetry,      // A shard had passed the step: the next Tick orders a later one.
    kFinishing,  // Every report in; the manifest is being written.
  };
  struct InProgress {
    uint64_t ticket = 0;  // Unique per start (a retry gets a new one).
    Phase phase = Phase::kStarting;
    uint64_t job_id = 0;
    v1::JobSpec spec;
    v1::CheckpointInfo info;  // checkpoint_id and path set once the folder is made.
    std::set<uint64_t> owners;
    std::map<uint64_t, v1::ShardCheckpointReport> reports;  // By shard.
    int attempt = 0;
    std::string old_path;  // kStarting after a retry: the folder to remove first.
    bool policy = false;   // Taken by the shards at a policy boundary, not ordered.
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
  // Takes up a policy checkpoint the shards began at `step` (kOrdered: the
  // shards made its folder).
  void AdoptLocked(const CheckpointJobView& job, uint64_t step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Puts the job's entry in kStarting at `step` and queues its folder.
  void StartLocked(const CheckpointJobView& job, uint64_t step, int attempt,
                   std::string old_path) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The entry of `job_id` when it is still the one started with `ticket`.
  InProgress* FindLocked(uint64_t job_id, uint64_t ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FailLocked(uint64_t job_id, const std::string& error) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Queues the removal of a checkpoint folder.
  void RemoveLater(std::string path);

  // File thread: makes a checkpoint's folder and sends it out.
  void MakeFolder(uint64_t job_id, uint64_t ticket);
  // File thread: writes the manifest, then prunes.
  void WriteManifest(uint64_t job_id, uint64_t ticket);
  // File thread: keeps the newest `keep_last` complete checkpoints, and
  // removes incomplete leftovers older than checkpoint `completed` (newer
  // ones may be policy checkpoints the shards are still writing).
  void Prune(const std::string& job_name, uint32_t keep_last, uint64_t completed);
  // Records what AwaitStart(ticket) returns, when someone waits for it.
  void ResolveLocked(uint64_t ticket, absl::StatusOr<v1::CheckpointInfo> result)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string dir_;
  mutable absl::Mutex mu_;
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<uint64_t, InProgress> in_progress_ ABSL_GUARDED_BY(mu_);  // By job id.
  // Starts that Start's caller waits for, by ticket: empty until resolved.
  std::map<uint64_t, std::optional<absl::StatusOr<v1::CheckpointInfo>>> awaited_
      ABSL_GUARDED_BY(mu_);
  // Failed checkpoints by job name (their files are removed), newest last.
  std::map<std::string, std::vector<v1::CheckpointInfo>> failed_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, PolicyState> policy_ ABSL_GUARDED_BY(mu_);  // By job id.
  std::map<uint64_t, Pace> pace_ ABSL_GUARDED_BY(mu_);            // By job id.
  // Last member: destroyed first, so that queued work runs while the rest
  // of the manager is still there.
  FileWorker files_;
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_CHECKPOINTS_H_
