// The checkpoint manager's reads: listing a job's checkpoints and preparing
// a restore (find, read the manifest, verify every file). Their disk I/O runs
// on the caller's thread with no lock held. See checkpoints.h.
#include <algorithm>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_files.h"
#include "coordinator/checkpoint_folders.h"
#include "coordinator/checkpoints.h"

namespace optimus {

using checkpoint_internal::InfoFromFolder;
using checkpoint_internal::UsableAsFolder;

std::vector<v1::CheckpointInfo> CheckpointManager::List(const std::string& job_name) {
  if (!enabled() || !UsableAsFolder(job_name)) return {};
  files_.Flush();
  std::vector<v1::CheckpointInfo> out;
  std::set<std::string> busy;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, ip] : in_progress_) {
      if (ip.info.job_name() != job_name) continue;
      if (ip.phase == Phase::kOrdered || ip.phase == Phase::kFinishing) {
        out.push_back(ip.info);
        busy.insert(ip.info.path());
      }
    }
    if (auto f = failed_.find(job_name); f != failed_.end()) {
      out.insert(out.end(), f->second.begin(), f->second.end());
    }
  }
  // The folders, read with no lock held.
  for (const std::string& name : ckpt::ListDir(JobDir(job_name))) {
    const uint64_t id = ckpt::ParseFolderName(name);
    const std::string path = absl::StrCat(JobDir(job_name), "/", name);
    if (id == 0 || busy.count(path) != 0) continue;
    std::optional<v1::CheckpointInfo> info = InfoFromFolder(job_name, id, path);
    if (info.has_value()) out.push_back(*std::move(info));  // Else partial leftovers.
  }
  std::sort(out.begin(), out.end(), [](const v1::CheckpointInfo& a, const v1::CheckpointInfo& b) {
    return a.checkpoint_id() < b.checkpoint_id();
  });
  return out;
}

std::optional<v1::CheckpointInfo> CheckpointManager::Last(const std::string& job_name) {
  // The newest checkpoint is the one with the highest id: in memory (in
  // progress, failed) or the last folder on disk.
  if (!enabled() || !UsableAsFolder(job_name)) return std::nullopt;
  std::optional<v1::CheckpointInfo> best;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, p] : in_progress_) {
      if (p.info.job_name() != job_name) continue;
      if (p.phase == Phase::kOrdered || p.phase == Phase::kFinishing) best = p.info;
    }
    if (auto f = failed_.find(job_name); f != failed_.end() && !f->second.empty()) {
      if (!best.has_value() || f->second.back().checkpoint_id() > best->checkpoint_id()) {
        best = f->second.back();
      }
    }
  }
  // The folder with the highest id that is a checkpoint (has a manifest).
  std::vector<std::string> names = ckpt::ListDir(JobDir(job_name));
  for (auto it = names.rbegin(); it != names.rend(); ++it) {
    const uint64_t id = ckpt::ParseFolderName(*it);
    if (id == 0) continue;
    if (best.has_value() && id <= best->checkpoint_id()) break;
    std::optional<v1::CheckpointInfo> info =
        InfoFromFolder(job_name, id, absl::StrCat(JobDir(job_name), "/", *it));
    if (info.has_value()) return info;
  }
  return best;
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
