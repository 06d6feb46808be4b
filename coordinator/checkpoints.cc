#include "coordinator/checkpoints.h"

#include <cmath>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_files.h"
#include "common/logging.h"

namespace optimus {
namespace {

constexpr char kLog[] = "coord";
// Complete checkpoints kept when a job's policy says 0.
constexpr uint32_t kDefaultKeepLast = 3;
// Failed checkpoints remembered per job for `list` (their files are gone).
constexpr size_t kMaxFailedRemembered = 16;
// Retries of a checkpoint whose step a shard had passed before its order
// arrived (heartbeats lag training); each retry aims further ahead.
constexpr int kMaxAttempts = 8;
// How far ahead, in time at the job's pace, an order aims: two heartbeat
// intervals (a third of the default 2 s lease each) plus margin.
constexpr absl::Duration kOrderLead = absl::Milliseconds(1600);

int64_t UnixMs(absl::Time t) { return absl::ToUnixMillis(t); }

// A job's checkpoints live in a folder named after it: a name that is not a
// plain folder name would write elsewhere.
bool UsableAsFolder(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

}  // namespace

CheckpointManager::CheckpointManager(std::string dir) : dir_(std::move(dir)) {}

std::string CheckpointManager::JobDir(const std::string& job_name) const {
  return absl::StrCat(dir_, "/", job_name);
}

uint64_t CheckpointManager::NextIdLocked(const std::string& job_name) {
  uint64_t last = last_id_[job_name];
  for (const std::string& name : ckpt::ListDir(JobDir(job_name))) {
    last = std::max(last, ckpt::ParseFolderName(name));
  }
  last_id_[job_name] = last + 1;
  return last + 1;
}

absl::StatusOr<v1::CheckpointInfo> CheckpointManager::Create(const CheckpointJobView& job) {
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
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint ", it->second.info.checkpoint_id(), " of job \"",
                     job.spec.name(), "\" is still in progress"));
  }
  return StartLocked(job, job.max_applied_step + 1);
}

absl::StatusOr<v1::CheckpointInfo> CheckpointManager::StartLocked(const CheckpointJobView& job,
                                                                  uint64_t step) {
  InProgress ip;
  ip.job_id = job.job_id;
  ip.spec = job.spec;
  ip.owners = job.owners;
  v1::CheckpointInfo& info = ip.info;
  info.set_job_name(job.spec.name());
  info.set_checkpoint_id(NextIdLocked(job.spec.name()));
  info.set_step(std::max<uint64_t>(step, 1));
  info.set_state(v1::CHECKPOINT_STATE_IN_PROGRESS);
  info.set_path(absl::StrCat(JobDir(job.spec.name()), "/",
                             ckpt::FolderName(info.checkpoint_id())));
  info.set_created_unix_ms(UnixMs(absl::Now()));
  if (absl::Status s = ckpt::MakeDirs(info.path()); !s.ok()) {
    info.set_state(v1::CHECKPOINT_STATE_FAILED);
    info.set_error(std::string(s.message()));
    failed_[info.job_name()].push_back(info);
    return absl::Status(s.code(), absl::StrCat("checkpoint of job \"", job.spec.name(),
                                               "\": ", s.message()));
  }
  PolicyState& ps = policy_[job.job_id];
  ps.last_step = job.min_applied_step;
  ps.last_time = absl::Now();
  OPTIMUS_LOG(Info, kLog, "checkpoint ordered job=", job.spec.name(),
              " id=", info.checkpoint_id(), " step=", info.step(), " shards=", ip.owners.size());
  v1::CheckpointInfo out = info;
  auto it = in_progress_.find(job.job_id);
  if (it != in_progress_.end()) ip.attempt = it->second.attempt;
  in_progress_[job.job_id] = std::move(ip);
  return out;
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
      if (!ip->second.retry) continue;
      // A retry aims ahead of the most advanced chunk by the steps training
      // makes while an order travels (at the job's measured pace; none when
      // it is paused), and later ones by a further gap that doubles. The
      // first order of a checkpoint aims at the next step: right when
      // training is paused, one wasted round trip when it is not.
      const int attempt = ip->second.attempt + 1;
      const std::string old_path = ip->second.info.path();
      if (attempt >= kMaxAttempts) {
        FailLocked(job.job_id, "training kept passing the chosen step; try again");
        continue;
      }
      (void)ckpt::RemoveTree(old_path);
      ip->second.attempt = attempt;
      const uint64_t step =
          StepAheadLocked(job, now) + (attempt >= 2 ? uint64_t{1} << (attempt - 1) : 0);
      if (!StartLocked(job, step).ok()) in_progress_.erase(job.job_id);
      continue;
    }
    if (job.state != v1::JOB_STATE_READY || !job.owners_without_checkpoint_dir.empty() ||
        !UsableAsFolder(job.spec.name())) {
      continue;
    }
    const v1::CheckpointPolicy& policy = job.spec.checkpoint_policy();
    if (policy.every_steps() == 0 && policy.every_seconds() == 0) continue;
    auto [ps, first] = policy_.try_emplace(job.job_id);
    if (first) {
      ps->second.last_step = job.resume_step - 1;
      ps->second.last_time = now;
    }
    const bool by_steps = policy.every_steps() > 0 &&
                          job.min_applied_step >= ps->second.last_step + policy.every_steps();
    const bool by_time = policy.every_seconds() > 0 &&
                         now - ps->second.last_time >= absl::Seconds(policy.every_seconds());
    if (by_steps || by_time) {
      absl::StatusOr<v1::CheckpointInfo> s = StartLocked(job, job.max_applied_step + 1);
      if (!s.ok()) OPTIMUS_LOG(Warning, kLog, "policy checkpoint: ", s.status().ToString());
    }
  }
}

std::vector<v1::CheckpointOrder> CheckpointManager::OnHeartbeat(
    uint64_t shard_id, const google::protobuf::RepeatedPtrField<v1::ShardCheckpointReport>& reports) {
  std::vector<v1::CheckpointOrder> orders;
  if (!enabled()) return orders;
  absl::MutexLock lock(&mu_);
  for (const v1::ShardCheckpointReport& r : reports) {
    auto it = in_progress_.find(r.job_id());
    if (it == in_progress_.end() || it->second.info.checkpoint_id() != r.checkpoint_id() ||
        it->second.owners.count(shard_id) == 0 || it->second.retry) {
      continue;
    }
    InProgress& ip = it->second;
    if (!r.error().empty()) {
      if (r.missed_step()) {
        ip.retry = true;
        OPTIMUS_LOG(Info, kLog, "checkpoint ", ip.info.checkpoint_id(), " of job ",
                    ip.info.job_name(), ": shard ", shard_id, " passed step ", ip.info.step(),
                    " already; retrying later");
        continue;
      }
      FailLocked(r.job_id(), absl::StrCat("shard ", shard_id, ": ", r.error()));
      continue;
    }
    if (r.done()) {
      ip.reports[shard_id] = r;
      if (ip.reports.size() == ip.owners.size()) FinishLocked(r.job_id());
    }
  }
  for (const auto& [job_id, ip] : in_progress_) {
    if (ip.retry || ip.owners.count(shard_id) == 0 || ip.reports.count(shard_id) != 0) continue;
    v1::CheckpointOrder o;
    o.set_job_id(job_id);
    o.set_checkpoint_id(ip.info.checkpoint_id());
    o.set_step(ip.info.step());
    o.set_path(absl::StrCat(ip.info.job_name(), "/", ckpt::FolderName(ip.info.checkpoint_id())));
    orders.push_back(std::move(o));
  }
  return orders;
}

void CheckpointManager::FinishLocked(uint64_t job_id) {
  InProgress& ip = in_progress_.at(job_id);
  v1::CheckpointManifest m;
  m.set_format_version(ckpt::kFormatVersion);
  m.set_job_name(ip.info.job_name());
  m.set_checkpoint_id(ip.info.checkpoint_id());
  m.set_step(ip.info.step());
  *m.mutable_spec() = ip.spec;
  m.set_dtype("fp32");
  for (const std::string& a : ckpt::ArrayNames(ip.spec.optimizer().kind())) m.add_arrays(a);
  uint64_t size_bytes = 0;
  for (const auto& [shard, r] : ip.reports) {
    for (const v1::CheckpointFile& f : r.files()) {
      *m.add_files() = f;
      size_bytes += f.size_bytes();
    }
  }
  std::sort(m.mutable_files()->begin(), m.mutable_files()->end(),
            [](const v1::CheckpointFile& a, const v1::CheckpointFile& b) {
              return std::make_pair(a.tensor(), a.offset_elems()) <
                     std::make_pair(b.tensor(), b.offset_elems());
            });
  m.set_created_unix_ms(ip.info.created_unix_ms());
  // The manifest goes last: a folder without one is not a checkpoint.
  if (absl::Status s = ckpt::WriteManifest(ip.info.path(), m); !s.ok()) {
    return FailLocked(job_id, std::string(s.message()));
  }
  const std::string name = ip.info.job_name();
  OPTIMUS_LOG(Info, kLog, "checkpoint complete job=", name, " id=", ip.info.checkpoint_id(),
              " step=", ip.info.step(), " files=", m.files_size(), " bytes=", size_bytes,
              " path=", ip.info.path());
  const uint32_t keep = ip.spec.checkpoint_policy().keep_last() > 0
                            ? ip.spec.checkpoint_policy().keep_last()
                            : kDefaultKeepLast;
  in_progress_.erase(job_id);
  PruneLocked(name, keep);
}

void CheckpointManager::FailLocked(uint64_t job_id, const std::string& error) {
  auto it = in_progress_.find(job_id);
  if (it == in_progress_.end()) return;
  v1::CheckpointInfo info = it->second.info;
  in_progress_.erase(it);
  info.set_state(v1::CHECKPOINT_STATE_FAILED);
  info.set_error(error);
  OPTIMUS_LOG(Error, kLog, "checkpoint failed job=", info.job_name(),
              " id=", info.checkpoint_id(), ": ", error);
  // Free the space its partial files hold; the previous checkpoints are
  // other folders and stay as they are.
  if (absl::Status s = ckpt::RemoveTree(info.path()); !s.ok()) {
    OPTIMUS_LOG(Warning, kLog, "removing failed checkpoint: ", s.ToString());
  }
  auto& failed = failed_[info.job_name()];
  failed.push_back(std::move(info));
  if (failed.size() > kMaxFailedRemembered) failed.erase(failed.begin());
}

void CheckpointManager::OnJobFailed(uint64_t job_id, const std::string& why) {
  absl::MutexLock lock(&mu_);
  FailLocked(job_id, why);
}

void CheckpointManager::OnOwnersChanged(uint64_t job_id, const std::set<uint64_t>& owners) {
  absl::MutexLock lock(&mu_);
  auto it = in_progress_.find(job_id);
  if (it == in_progress_.end() || it->second.retry || it->second.owners == owners) return;
  it->second.retry = true;
  OPTIMUS_LOG(Info, kLog, "checkpoint ", it->second.info.checkpoint_id(), " of job ",
              it->second.info.job_name(), ": the job's chunks moved to other shards; retrying "
              "later over the new ones");
}

void CheckpointManager::PruneLocked(const std::string& job_name, uint32_t keep_last) {
  std::set<std::string> busy;
  for (const auto& [id, ip] : in_progress_) busy.insert(ip.info.path());
  std::vector<std::string> complete;
  for (const std::string& name : ckpt::ListDir(JobDir(job_name))) {
    if (ckpt::ParseFolderName(name) == 0) continue;
    const std::string path = absl::StrCat(JobDir(job_name), "/", name);
    if (busy.count(path) != 0) continue;
    if (ckpt::ReadManifest(path).ok()) {
      complete.push_back(path);  // Sorted by id: ListDir sorts, names are zero-padded.
    } else {
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

std::vector<v1::CheckpointInfo> CheckpointManager::List(const std::string& job_name) {
  std::vector<v1::CheckpointInfo> out;
  if (!enabled() || !UsableAsFolder(job_name)) return out;
  absl::MutexLock lock(&mu_);
  std::set<std::string> busy;
  for (const auto& [id, ip] : in_progress_) {
    if (ip.info.job_name() == job_name && !ip.retry) {
      out.push_back(ip.info);
      busy.insert(ip.info.path());
    }
  }
  for (const std::string& name : ckpt::ListDir(JobDir(job_name))) {
    const uint64_t id = ckpt::ParseFolderName(name);
    const std::string path = absl::StrCat(JobDir(job_name), "/", name);
    if (id == 0 || busy.count(path) != 0) continue;
    v1::CheckpointInfo info;
    info.set_job_name(job_name);
    info.set_checkpoint_id(id);
    info.set_path(path);
    absl::StatusOr<v1::CheckpointManifest> m = ckpt::ReadManifest(path);
    if (absl::IsNotFound(m.status())) continue;  // Partial leftovers.
    if (!m.ok()) {
      info.set_state(v1::CHECKPOINT_STATE_FAILED);
      info.set_error(std::string(m.status().message()));
    } else {
      info.set_state(v1::CHECKPOINT_STATE_COMPLETE);
      info.set_step(m->step());
      info.set_created_unix_ms(m->created_unix_ms());
      uint64_t size = 0;
      for (const auto& f : m->files()) size += f.size_bytes();
      info.set_size_bytes(size);
    }
    out.push_back(std::move(info));
  }
  for (const v1::CheckpointInfo& f : failed_[job_name]) out.push_back(f);
  std::sort(out.begin(), out.end(), [](const v1::CheckpointInfo& a, const v1::CheckpointInfo& b) {
    return a.checkpoint_id() < b.checkpoint_id();
  });
  return out;
}

std::optional<v1::CheckpointInfo> CheckpointManager::Last(const std::string& job_name) {
  std::vector<v1::CheckpointInfo> all = List(job_name);
  if (all.empty()) return std::nullopt;
  return all.back();
}

absl::StatusOr<v1::RestoreSource> CheckpointManager::PrepareRestore(const std::string& job_name,
                                                                    uint64_t checkpoint_id,
                                                                    v1::CheckpointInfo* info) {
  if (!enabled()) {
    return absl::FailedPreconditionError(
        "checkpoints are off: start optimus-coord with --checkpoint_dir");
  }
  if (!UsableAsFolder(job_name)) {
    return absl::InvalidArgumentError(absl::StrCat("bad job name \"", job_name, "\""));
  }
  const std::vector<v1::CheckpointInfo> all = List(job_name);
  const v1::CheckpointInfo* pick = nullptr;
  for (const v1::CheckpointInfo& c : all) {
    if (checkpoint_id == 0 ? c.state() == v1::CHECKPOINT_STATE_COMPLETE
                           : c.checkpoint_id() == checkpoint_id) {
      pick = &c;
    }
  }
  if (pick == nullptr) {
    return absl::NotFoundError(
        checkpoint_id == 0
            ? absl::StrCat("job \"", job_name, "\" has no complete checkpoint in ", JobDir(job_name))
            : absl::StrCat("job \"", job_name, "\" has no checkpoint ", checkpoint_id));
  }
  if (pick->state() != v1::CHECKPOINT_STATE_COMPLETE) {
    if (!pick->error().empty() && pick->state() == v1::CHECKPOINT_STATE_FAILED &&
        pick->error().find("corrupt") != std::string::npos) {
      return absl::DataLossError(pick->error());
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", pick->checkpoint_id(), " of job \"", job_name, "\" is not complete"));
  }
  absl::StatusOr<v1::CheckpointManifest> m = ckpt::ReadManifest(pick->path());
  if (!m.ok()) return m.status();
  if (absl::Status s = ckpt::VerifyCheckpoint(pick->path(), *m); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("refusing to restore checkpoint ",
                                               pick->checkpoint_id(), " of job \"", job_name,
                                               "\": ", s.message()));
  }
  *info = *pick;
  v1::RestoreSource src;
  src.set_path(absl::StrCat(job_name, "/", ckpt::FolderName(pick->checkpoint_id())));
  *src.mutable_manifest() = *std::move(m);
  return src;
}

}  // namespace optimus
