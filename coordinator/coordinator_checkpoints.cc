// Coordinator: checkpoints. What the checkpoint manager sees of a job, the
// checkpoint RPCs, restore and rollback. Bookkeeping happens under mu_;
// file work (folders, manifests, listings) never does. See
// coordinator_core.h and checkpoints.h.
#include <algorithm>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "coordinator/coordinator_core.h"

namespace optimus {
namespace {
constexpr char kLog[] = "coord";
}  // namespace

CheckpointJobView Coordinator::ViewLocked(const JobRecord& job) const {
  CheckpointJobView v;
  v.job_id = job.id;
  v.spec = job.spec;
  v.state = job.state;
  v.resume_step = job.resume_step;
  uint64_t min_applied = std::numeric_limits<uint64_t>::max();
  for (const auto& [shard_id, load] : job.load) {
    // Checkpoint parts and the job's step come from the primaries: a
    // backup writes no part, and a new one reports no step until seeded.
    if (load.num_chunks == load.backup_chunks) continue;
    v.owners.insert(shard_id);
    const ShardRecord* shard = shards_.Find(shard_id);
    if (shard == nullptr || !shard->capabilities.checkpoints()) {
      v.owners_without_checkpoint_dir.insert(shard_id);
    }
    auto p = job.progress.find(shard_id);
    const uint64_t applied = p == job.progress.end() ? 0 : p->second.applied_step();
    min_applied = std::min(min_applied, applied);
    if (p != job.progress.end()) {
      v.max_applied_step = std::max(v.max_applied_step, p->second.max_applied_step());
    }
  }
  v.min_applied_step = v.owners.empty() ? 0 : min_applied;
  return v;
}

absl::StatusOr<v1::CreateCheckpointResponse> Coordinator::CreateCheckpoint(
    const v1::CreateCheckpointRequest& req) {
  absl::StatusOr<uint64_t> ticket;
  {
    // The order is booked under mu_, so that a job deleted meanwhile cannot
    // get one; its folder is made with no lock held.
    absl::MutexLock lock(&mu_);
    const JobRecord* job = jobs_.FindByName(req.job_name());
    if (job == nullptr) {
      return absl::NotFoundError(absl::StrCat("no job named \"", req.job_name(), "\""));
    }
    ticket = checkpoints_.Start(ViewLocked(*job));
  }
  if (!ticket.ok()) return ticket.status();
  absl::StatusOr<v1::CheckpointInfo> info = checkpoints_.AwaitStart(*ticket);
  if (!info.ok()) return info.status();
  v1::CreateCheckpointResponse resp;
  *resp.mutable_checkpoint() = *std::move(info);
  return resp;
}

v1::ListCheckpointsResponse Coordinator::ListCheckpoints(const v1::ListCheckpointsRequest& req) {
  v1::ListCheckpointsResponse resp;
  if (req.job_name().find('/') != std::string::npos) return resp;
  for (v1::CheckpointInfo& c : checkpoints_.List(req.job_name())) {
    *resp.add_checkpoints() = std::move(c);
  }
  return resp;
}

absl::StatusOr<v1::RestoreCheckpointResponse> Coordinator::RestoreCheckpoint(
    const v1::RestoreCheckpointRequest& req) {
  // Reading and checking every file takes a while: no lock is held for it.
  v1::CheckpointInfo info;
  absl::StatusOr<v1::RestoreSource> src =
      checkpoints_.PrepareRestore(req.job_name(), req.checkpoint_id(), &info);
  if (!src.ok()) return src.status();
  v1::CreateJobRequest create;
  *create.mutable_spec() = src->manifest().spec();
  create.mutable_spec()->set_name(req.new_job_name().empty() ? req.job_name()
                                                             : req.new_job_name());
  if (req.max_chunk_bytes() != 0) create.mutable_spec()->set_max_chunk_bytes(req.max_chunk_bytes());
  absl::StatusOr<v1::CreateJobResponse> job = CreateJobInternal(create, &*src);
  if (!job.ok()) return job.status();
  OPTIMUS_LOG(Info, kLog, "job ", job->job_id(), " (", create.spec().name(),
              ") restored from ", info.path(), " at step ", src->manifest().step());
  v1::RestoreCheckpointResponse resp;
  resp.set_job_id(job->job_id());
  resp.set_resume_step(src->manifest().step());
  resp.set_job_token(job->job_token());
  *resp.mutable_checkpoint() = info;
  return resp;
}

int Coordinator::RollbackFailedJobs() {
  if (!options_.rollback_on_shard_loss || !checkpoints_.enabled()) return 0;
  std::vector<std::pair<uint64_t, std::string>> tries;
  absl::StatusOr<uint64_t> saved = uint64_t{0};
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, job] : jobs_.all()) {
      if (job.state != v1::JOB_STATE_FAILED || job.rollback_tried || job.deleting) continue;
      job.rollback_tried = true;
      const JobRecord* holder = jobs_.FindByName(job.spec.name());
      if (holder != nullptr && holder->id == id) tries.emplace_back(id, job.spec.name());
    }
    if (!tries.empty()) saved = SnapshotLocked();
  }
  if (tries.empty()) return 0;
  // Durable before the attempt: if restoring brings this process down, the
  // coordinator that comes back does not try again (and again).
  if (absl::Status s = WaitDurable(saved); !s.ok()) {
    OPTIMUS_LOG(Warning, kLog, "roll-back attempts not recorded (", s.ToString(),
                "); trying anyway");
  }
  int restored = 0;
  for (const auto& [failed_id, name] : tries) {
    v1::RestoreCheckpointRequest req;
    req.set_job_name(name);
    absl::StatusOr<v1::RestoreCheckpointResponse> r = RestoreCheckpoint(req);
    if (!r.ok()) {
      OPTIMUS_LOG(Error, kLog, "job ", name, " failed and cannot roll back: ",
                  r.status().ToString());
      absl::StatusOr<uint64_t> seq = uint64_t{0};
      {
        absl::MutexLock lock(&mu_);
        JobRecord* job = jobs_.Find(failed_id);
        if (job != nullptr) {
          job->rollback_error = r.status().ToString();
          seq = SnapshotLocked();
        }
      }
      (void)WaitDurable(seq);
      continue;
    }
    ++restored;
    OPTIMUS_LOG(Warning, kLog, "job ", name, " rolled back to checkpoint ",
                r->checkpoint().checkpoint_id(), ": new job id ", r->job_id(),
                "; workers re-join and resume at step ", r->resume_step());
  }
  return restored;
}

void Coordinator::FillLastCheckpoints(v1::StatusResponse* status) {
  if (!checkpoints_.enabled()) return;
  for (v1::JobStatus& j : *status->mutable_jobs()) {
    std::optional<v1::CheckpointInfo> last = checkpoints_.Last(j.name());
    if (last.has_value()) *j.mutable_last_checkpoint() = *std::move(last);
  }
}

void Coordinator::TickCheckpoints(absl::Time now) {
  if (!checkpoints_.enabled()) return;
  absl::MutexLock lock(&mu_);
  std::vector<CheckpointJobView> views;
  for (const auto& [id, job] : jobs_.all()) {
    if (job.state == v1::JOB_STATE_FAILED || job.deleting) continue;
    views.push_back(ViewLocked(job));
  }
  checkpoints_.Tick(views, now);  // Bookkeeping only: its file work is queued.
}

}  // namespace optimus
