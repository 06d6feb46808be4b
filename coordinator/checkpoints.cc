#include "coordinator/checkpoints.h"
#include "coordinator/checkpoint_folders.h"

#include <cmath>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_files.h"
#include "common/logging.h"
#include "kernels/optimizer_spec.h"

namespace optimus {
namespace {

constexpr char kLog[] = "coord";

}  // namespace

using checkpoint_internal::AddArrayNames;
using checkpoint_internal::InfoFromFolder;
using checkpoint_internal::kDefaultKeepLast;
using checkpoint_internal::kMaxAttempts;
using checkpoint_internal::kMaxFailedRemembered;
using checkpoint_internal::kOrderLead;
using checkpoint_internal::PolicyBoundary;
using checkpoint_internal::UnixMs;
using checkpoint_internal::UsableAsFolder;

CheckpointManager::CheckpointManager(std::string dir) : dir_(std::move(dir)) {}

std::string CheckpointManager::JobDir(const std::string& job_name) const {
  return absl::StrCat(dir_, "/", job_name);
}

CheckpointManager::InProgress* CheckpointManager::FindLocked(uint64_t job_id, uint64_t ticket) {
  auto it = in_progress_.find(job_id);
  return it != in_progress_.end() && it->second.ticket == ticket ? &it->second : nullptr;
}

void CheckpointManager::ResolveLocked(uint64_t ticket,
                                      absl::StatusOr<v1::CheckpointInfo> result) {
  auto it = awaited_.find(ticket);
  if (it != awaited_.end() && !it->second.has_value()) it->second = std::move(result);
}

void CheckpointManager::RemoveLater(std::string path) {
  files_.Queue([path = std::move(path)] {
    if (absl::Status s = ckpt::RemoveTree(path); !s.ok()) {
      OPTIMUS_LOG(Warning, kLog, "removing checkpoint folder: ", s.ToString());
    }
  });
}

absl::StatusOr<uint64_t> CheckpointManager::Start(const CheckpointJobView& job) {
  if (!enabled()) {
    return absl::FailedPreconditionError(
        "checkpoints are off: start optimus-coord with --checkpoint_dir");
  }
  if (!UsableAsFolder(job.spec.name())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job name \"", job.spec.name(), "\" cannot name a checkpoint folder (no '/', '.', '..')"));
  }
  if (job.state != v1::JOB_STATE_READY) {
    return absl::FailedPreconditionError(
        absl::StrCat("job \"", job.spec.name(), "\" is not READY"));
  }
  if (!job.owners_without_checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("shard ", *job.owners_without_checkpoint_dir.begin(), " of job \"",
                     job.spec.name(), "\" was started without --checkpoint_dir"));
  }
  absl::MutexLock lock(&mu_);
  if (auto it = in_progress_.find(job.job_id); it != in_progress_.end()) {
    const uint64_t id = it->second.info.checkpoint_id();
    return absl::FailedPreconditionError(
        absl::StrCat(id != 0 ? absl::StrCat("checkpoint ", id) : std::string("a checkpoint"),
                     " of job \"", job.spec.name(), "\" is still in progress"));
  }
  StartLocked(job, job.max_applied_step + 1, /*attempt=*/0, /*old_path=*/"");
  const uint64_t ticket = in_progress_.at(job.job_id).ticket;
  awaited_[ticket] = std::nullopt;
  return ticket;
}

absl::StatusOr<v1::CheckpointInfo> CheckpointManager::AwaitStart(uint64_t ticket) {
  absl::MutexLock lock(&mu_);
  auto it = awaited_.find(ticket);
  if (it == awaited_.end()) {
    return absl::InternalError(absl::StrCat("no checkpoint start with ticket ", ticket));
  }
  auto resolved = [&it]() { return it->second.has_value(); };
  mu_.Await(absl::Condition(&resolved));
  absl::StatusOr<v1::CheckpointInfo> out = *std::move(it->second);
  awaited_.erase(it);
  return out;
}

absl::StatusOr<v1::CheckpointInfo> CheckpointManager::Create(const CheckpointJobView& job) {
  absl::StatusOr<uint64_t> ticket = Start(job);
  if (!ticket.ok()) return ticket.status();
  return AwaitStart(*ticket);
}

void CheckpointManager::StartLocked(const CheckpointJobView& job, uint64_t step, int attempt,
                                    std::string old_path) {
  InProgress ip;
  ip.ticket = next_ticket_++;
  ip.phase = Phase::kStarting;
  ip.job_id = job.job_id;
  ip.spec = job.spec;
  ip.owners = job.owners;
  ip.attempt = attempt;
  ip.old_path = std::move(old_path);
  ip.info.set_job_name(job.spec.name());
  ip.info.set_step(std::max<uint64_t>(step, 1));
  ip.info.set_state(v1::CHECKPOINT_STATE_IN_PROGRESS);
  ip.info.set_created_unix_ms(UnixMs(absl::Now()));
  PolicyState& ps = policy_[job.job_id];
  ps.last_step = job.min_applied_step;
  ps.last_time = absl::Now();
  const uint64_t job_id = job.job_id, ticket = ip.ticket;
  in_progress_[job_id] = std::move(ip);
  files_.Queue([this, job_id, ticket] { MakeFolder(job_id, ticket); });
}

void CheckpointManager::MakeFolder(uint64_t job_id, uint64_t ticket) {
  const absl::Status ended = absl::AbortedError(
      "the checkpoint ended before its folder was made (its job failed or was deleted)");
  std::string name, old_path;
  {
    absl::MutexLock lock(&mu_);
    InProgress* ip = FindLocked(job_id, ticket);
    if (ip == nullptr) return ResolveLocked(ticket, ended);
    name = ip->info.job_name();
    old_path = ip->old_path;
  }
  if (!old_path.empty()) (void)ckpt::RemoveTree(old_path);  // A retry's earlier attempt.
  // A checkpoint's id is its step.
  std::string path;
  uint64_t step;
  {
    absl::MutexLock lock(&mu_);
    InProgress* ip = FindLocked(job_id, ticket);
    if (ip == nullptr) return ResolveLocked(ticket, ended);
    step = ip->info.step();
    path = absl::StrCat(JobDir(name), "/", ckpt::FolderName(step));
    ip->info.set_checkpoint_id(step);
    ip->info.set_path(path);
    ip->old_path.clear();
  }
  if (std::optional<v1::CheckpointInfo> done = InfoFromFolder(name, step, path);
      done.has_value() && done->state() == v1::CHECKPOINT_STATE_COMPLETE) {
    // The state of this step is on disk already (a job restored from it
    // and not stepped since): that checkpoint is the answer.
    absl::MutexLock lock(&mu_);
    if (FindLocked(job_id, ticket) != nullptr) in_progress_.erase(job_id);
    return ResolveLocked(ticket, *done);
  }
  const absl::Status made = ckpt::MakeDirs(path);
  absl::MutexLock lock(&mu_);
  InProgress* ip = FindLocked(job_id, ticket);
  // Ended meanwhile: the removal of `path` is queued behind this task.
  if (ip == nullptr) return ResolveLocked(ticket, ended);
  if (!made.ok()) {
    v1::CheckpointInfo info = ip->info;
    in_progress_.erase(job_id);
    info.set_state(v1::CHECKPOINT_STATE_FAILED);
    info.set_error(std::string(made.message()));
    auto& failed = failed_[name];
    failed.push_back(info);
    if (failed.size() > kMaxFailedRemembered) failed.erase(failed.begin());
    OPTIMUS_LOG(Error, kLog, "checkpoint failed job=", name, ": ", made.ToString());
    return ResolveLocked(ticket, absl::Status(made.code(), absl::StrCat("checkpoint of job \"",
                                                                        name, "\": ",
                                                                        made.message())));
  }
  ip->phase = Phase::kOrdered;
  OPTIMUS_LOG(Info, kLog, "checkpoint ordered job=", name, " id=", ip->info.checkpoint_id(),
              " step=", ip->info.step(), " shards=", ip->owners.size());
  ResolveLocked(ticket, ip->info);
}

uint64_t CheckpointManager::StepAheadLocked(const CheckpointJobView& job, absl::Time now) const {
  auto p = pace_.find(job.job_id);
  const bool moving = p != pace_.end() && now - p->second.time <= kOrderLead;
  const double rate = moving ? p->second.steps_per_second : 0.0;
  const double lead = rate * absl::ToDoubleSeconds(kOrderLead);
  return job.max_applied_step + 1 + static_cast<uint64_t>(std::ceil(lead));
}

void CheckpointManager::Tick(const std::vector<CheckpointJobView>& jobs, absl::Time now) {
  if (!enabled()) return;
  absl::MutexLock lock(&mu_);
  for (const CheckpointJobView& job : jobs) {
    // Track the pace (steps/s) from the progress that heartbeats report.
    Pace& pace = pace_[job.job_id];
    if (job.max_applied_step > pace.step) {
      if (pace.time != absl::Time() && now > pace.time) {
        const double rate = static_cast<double>(job.max_applied_step - pace.step) /
                            absl::ToDoubleSeconds(now - pace.time);
        pace.steps_per_second =
            pace.steps_per_second == 0 ? rate : 0.5 * pace.steps_per_second + 0.5 * rate;
      }
      pace.step = job.max_applied_step;
      pace.time = now;
    } else if (job.max_applied_step < pace.step) {
      pace = Pace();  // A restored job starts over.
    }
    auto ip = in_progress_.find(job.job_id);
    if (ip != in_progress_.end()) {
      if (ip->second.phase != Phase::kRetry) continue;
      // A retry aims ahead of the most advanced chunk by the steps training
      // makes while an order travels (at the job's measured pace; none when
      // it is paused), and later ones by a further gap that doubles. The
      // first order of a checkpoint aims at the next step: right when
      // training is paused, one wasted round trip when it is not.
      const int attempt = ip->second.attempt + 1;
      if (attempt >= kMaxAttempts) {
        FailLocked(job.job_id, "training kept passing the chosen step; try again");
        continue;
      }
      const uint64_t step =
          StepAheadLocked(job, now) + (attempt >= 2 ? uint64_t{1} << (attempt - 1) : 0);
      const v1::CheckpointInfo& missed = ip->second.info;
      StartLocked(job, step, attempt,
                  PolicyBoundary(job.spec, missed.step()) ? "" : missed.path());
      continue;
    }
    if (job.state != v1::JOB_STATE_READY || !job.owners_without_checkpoint_dir.empty() ||
        !UsableAsFolder(job.spec.name())) {
      continue;
    }
    const v1::CheckpointPolicy& policy = job.spec.checkpoint_policy();
    if (policy.every_seconds() == 0) continue;
    auto [ps, first] = policy_.try_emplace(job.job_id);
    if (first) {
      ps->second.last_step = job.resume_step - 1;
      ps->second.last_time = now;
    }
    // every_steps is the shards' to apply at step boundaries (OnHeartbeat
    // takes those checkpoints up); a time policy is ordered from here.
    const bool by_time = policy.every_seconds() > 0 &&
                         now - ps->second.last_time >= absl::Seconds(policy.every_seconds());
    if (by_time) StartLocked(job, job.max_applied_step + 1, 0, "");
  }
}

void CheckpointManager::AdoptLocked(const CheckpointJobView& job, uint64_t step) {
  InProgress ip;
  ip.ticket = next_ticket_++;
  ip.phase = Phase::kOrdered;
  ip.policy = true;
  ip.job_id = job.job_id;
  ip.spec = job.spec;
  ip.owners = job.owners;
  ip.info.set_job_name(job.spec.name());
  ip.info.set_checkpoint_id(step);
  ip.info.set_step(step);
  ip.info.set_path(absl::StrCat(JobDir(job.spec.name()), "/", ckpt::FolderName(step)));
  ip.info.set_state(v1::CHECKPOINT_STATE_IN_PROGRESS);
  ip.info.set_created_unix_ms(UnixMs(absl::Now()));
  OPTIMUS_LOG(Info, kLog, "checkpoint taken by policy job=", job.spec.name(), " id=", step,
              " step=", step, " shards=", ip.owners.size());
  in_progress_[job.job_id] = std::move(ip);
}

std::vector<v1::CheckpointOrder> CheckpointManager::OnHeartbeat(
    uint64_t shard_id, const google::protobuf::RepeatedPtrField<v1::ShardCheckpointReport>& reports,
    const std::map<uint64_t, CheckpointJobView>& jobs) {
  std::vector<v1::CheckpointOrder> orders;
  if (!enabled()) return orders;
  absl::MutexLock lock(&mu_);
  for (const v1::ShardCheckpointReport& r : reports) {
    auto it = in_progress_.find(r.job_id());
    if (it == in_progress_.end()) {
      // The first report of a checkpoint the shards took at a boundary of
      // the job's policy (while none of its checkpoints is in progress).
      auto v = jobs.find(r.job_id());
      if (v == jobs.end()) continue;
      const CheckpointJobView& job = v->second;
      const uint64_t every = job.spec.checkpoint_policy().every_steps();
      const uint64_t step = r.checkpoint_id();
      if (every == 0 || step % every != 0 || step <= job.resume_step ||
          job.state != v1::JOB_STATE_READY || job.owners.count(shard_id) == 0 ||
          !job.owners_without_checkpoint_dir.empty() || !UsableAsFolder(job.spec.name())) {
        continue;
      }
      AdoptLocked(job, step);
      it = in_progress_.find(r.job_id());
    }
    if (it == in_progress_.end() || it->second.phase != Phase::kOrdered ||
        it->second.info.checkpoint_id() != r.checkpoint_id() ||
        it->second.owners.count(shard_id) == 0) {
      continue;
    }
    InProgress& ip = it->second;
    if (!r.error().empty()) {
      if (r.missed_step()) {
        ip.phase = Phase::kRetry;
        OPTIMUS_LOG(Info, kLog, "checkpoint ", ip.info.checkpoint_id(), " of job ",
                    ip.info.job_name(), ": shard ", shard_id, " passed step ", ip.info.step(),
                    " already; retrying later");
        continue;
      }
      FailLocked(r.job_id(), absl::StrCat("shard ", shard_id, ": ", r.error()));
      continue;
    }
    if (r.done()) {
      // A report's files end up in the manifest a restore reads: a name
      // leaving the folder (../../dev/zero) or a size its header cannot
      // have fails the checkpoint here, before anything opens it.
      absl::Status bad;
      for (const v1::CheckpointFile& f : r.files()) {
        bad = ckpt::CheckFileRecord(f);
        if (!bad.ok()) break;
      }
      if (!bad.ok()) {
        FailLocked(r.job_id(), absl::StrCat("shard ", shard_id, " reported an invalid file: ",
                                            bad.message()));
        continue;
      }
      ip.reports[shard_id] = r;
      if (ip.reports.size() == ip.owners.size()) {
        // Every part is on disk; the manifest is file work.
        ip.phase = Phase::kFinishing;
        const uint64_t job_id = r.job_id(), ticket = ip.ticket;
        files_.Queue([this, job_id, ticket] { WriteManifest(job_id, ticket); });
      }
    }
  }
  for (const auto& [job_id, ip] : in_progress_) {
    if (ip.phase != Phase::kOrdered || ip.owners.count(shard_id) == 0 ||
        ip.reports.count(shard_id) != 0) {
      continue;
    }
    v1::CheckpointOrder o;
    o.set_job_id(job_id);
    o.set_checkpoint_id(ip.info.checkpoint_id());
    o.set_step(ip.info.step());
    o.set_path(absl::StrCat(ip.info.job_name(), "/", ckpt::FolderName(ip.info.checkpoint_id())));
    o.set_policy(ip.policy);
    orders.push_back(std::move(o));
  }
  return orders;
}

void CheckpointManager::WriteManifest(uint64_t job_id, uint64_t ticket) {
  v1::CheckpointManifest m;
  std::string path, name;
  uint32_t keep = kDefaultKeepLast;
  uint64_t size_bytes = 0;
  {
    absl::MutexLock lock(&mu_);
    InProgress* ip = FindLocked(job_id, ticket);
    if (ip == nullptr || ip->phase != Phase::kFinishing) return;
    m.set_format_version(ckpt::kFormatVersion);
    m.set_job_name(ip->info.job_name());
    m.set_checkpoint_id(ip->info.checkpoint_id());
    m.set_step(ip->info.step());
    *m.mutable_spec() = ip->spec;
    m.set_dtype("fp32");
    AddArrayNames(ip->spec.optimizer().kind(), &m);
    for (const auto& [shard, r] : ip->reports) {
      for (const v1::CheckpointFile& f : r.files()) {
        *m.add_files() = f;
        size_bytes += f.size_bytes();
        // The checkpoint's last step is the newest any range took: ranges
        // that skipped it (frozen, no gradient) report an older lr or 0.
        m.set_last_lr(std::max(m.last_lr(), f.last_lr()));
      }
    }
    m.set_created_unix_ms(ip->info.created_unix_ms());
    path = ip->info.path();
    name = ip->info.job_name();
    if (ip->spec.checkpoint_policy().keep_last() > 0) keep = ip->spec.checkpoint_policy().keep_last();
  }
  std::sort(m.mutable_files()->begin(), m.mutable_files()->end(),
            [](const v1::CheckpointFile& a, const v1::CheckpointFile& b) {
              return std::make_pair(a.tensor(), a.offset_elems()) <
                     std::make_pair(b.tensor(), b.offset_elems());
            });
  // The manifest goes last: a folder without one is not a checkpoint.
  const absl::Status written = ckpt::WriteManifest(path, m);
  {
    absl::MutexLock lock(&mu_);
    // Ended meanwhile (its job was deleted): its folder's removal is queued.
    if (FindLocked(job_id, ticket) == nullptr) return;
    if (!written.ok()) return FailLocked(job_id, std::string(written.message()));
    in_progress_.erase(job_id);
  }
  OPTIMUS_LOG(Info, kLog, "checkpoint complete job=", name, " id=", m.checkpoint_id(),
              " step=", m.step(), " files=", m.files_size(), " bytes=", size_bytes,
              " path=", path);
  Prune(name, keep, m.checkpoint_id());
}

void CheckpointManager::FailLocked(uint64_t job_id, const std::string& error) {
  auto it = in_progress_.find(job_id);
  if (it == in_progress_.end()) return;
  InProgress ip = std::move(it->second);
  in_progress_.erase(it);
  // Free the space its partial files hold; the previous checkpoints are
  // other folders and stay as they are.
  if (!ip.info.path().empty() && !PolicyBoundary(ip.spec, ip.info.step())) {
    RemoveLater(ip.info.path());
  }
  if (!ip.old_path.empty()) RemoveLater(ip.old_path);
  OPTIMUS_LOG(Error, kLog, "checkpoint failed job=", ip.info.job_name(),
              " id=", ip.info.checkpoint_id(), ": ", error);
  if (ip.info.checkpoint_id() == 0) return;  // Never ordered: nothing to list.
  ip.info.set_state(v1::CHECKPOINT_STATE_FAILED);
  ip.info.set_error(error);
  auto& failed = failed_[ip.info.job_name()];
  failed.push_back(std::move(ip.info));
  if (failed.size() > kMaxFailedRemembered) failed.erase(failed.begin());
}

void CheckpointManager::OnJobFailed(uint64_t job_id, const std::string& why) {
  absl::MutexLock lock(&mu_);
  auto it = in_progress_.find(job_id);
  // Every part is on disk already: the manifest completes it.
  if (it == in_progress_.end() || it->second.phase == Phase::kFinishing) return;
  FailLocked(job_id, why);
}

void CheckpointManager::OnOwnersChanged(uint64_t job_id, const std::set<uint64_t>& owners) {
  absl::MutexLock lock(&mu_);
  auto it = in_progress_.find(job_id);
  if (it == in_progress_.end()) return;
  InProgress& ip = it->second;
  if (ip.phase == Phase::kStarting) {
    ip.owners = owners;  // Not ordered yet: order the new owners.
    return;
  }
  if (ip.phase != Phase::kOrdered || ip.owners == owners) return;
  if (ip.policy) {
    // Its parts come from the chunks as they were; the next boundary is
    // taken over the new owners.
    return FailLocked(job_id, "the job's chunks moved to other shards during the checkpoint");
  }
  ip.phase = Phase::kRetry;
  OPTIMUS_LOG(Info, kLog, "checkpoint ", ip.info.checkpoint_id(), " of job ", ip.info.job_name(),
              ": the job's chunks moved to other shards; retrying later over the new ones");
}

void CheckpointManager::OnJobDeleted(uint64_t job_id) {
  absl::MutexLock lock(&mu_);
  auto it = in_progress_.find(job_id);
  if (it != in_progress_.end()) {
    const InProgress& ip = it->second;
    OPTIMUS_LOG(Info, kLog, "checkpoint ", ip.info.checkpoint_id(), " of job ",
                ip.info.job_name(), " ended: the job was deleted");
    if (!ip.info.path().empty() && !PolicyBoundary(ip.spec, ip.info.step())) {
      RemoveLater(ip.info.path());
    }
    if (!ip.old_path.empty()) RemoveLater(ip.old_path);
    in_progress_.erase(it);
  }
  policy_.erase(job_id);
  pace_.erase(job_id);
}

void CheckpointManager::ForgetJobName(const std::string& job_name) {
  absl::MutexLock lock(&mu_);
  failed_.erase(job_name);
}

void CheckpointManager::Prune(const std::string& job_name, uint32_t keep_last,
                              uint64_t completed) {
  // The coordinator makes and removes folders on this (the file) thread
  // only; shards make the folders of policy checkpoints, always of steps
  // after the one just completed.
  std::set<std::string> busy;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, ip] : in_progress_) {
      if (!ip.info.path().empty()) busy.insert(ip.info.path());
      if (!ip.old_path.empty()) busy.insert(ip.old_path);
    }
  }
  std::vector<std::string> complete;
  for (const std::string& name : ckpt::ListDir(JobDir(job_name))) {
    const uint64_t id = ckpt::ParseFolderName(name);
    if (id == 0) continue;
    const std::string path = absl::StrCat(JobDir(job_name), "/", name);
    if (busy.count(path) != 0) continue;
    if (ckpt::ReadManifest(path).ok()) {
      complete.push_back(path);  // Sorted by id: ListDir sorts, names are zero-padded.
    } else if (id < completed) {
      // Left behind by a checkpoint that never completed.
      (void)ckpt::RemoveTree(path);
    }
  }
  while (complete.size() > keep_last) {
    OPTIMUS_LOG(Info, kLog, "removing old checkpoint ", complete.front(), " (keep_last ",
                keep_last, ")");
    if (absl::Status s = ckpt::RemoveTree(complete.front()); !s.ok()) {
      OPTIMUS_LOG(Warning, kLog, s.ToString());
    }
    complete.erase(complete.begin());
  }
}

CheckpointManager::TableSizes CheckpointManager::table_sizes() const {
  absl::MutexLock lock(&mu_);
  TableSizes t;
  t.in_progress = in_progress_.size();
  t.policies = policy_.size();
  t.paces = pace_.size();
  std::set<std::string> names;
  for (const auto& [name, f] : failed_) names.insert(name);
  t.names = names.size();
  return t;
}

}  // namespace optimus
