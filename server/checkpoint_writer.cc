#include "server/checkpoint_writer.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/checkpoint_files.h"
#include "common/logging.h"
#include "server/thread_priority.h"

namespace optimus {
namespace server {

CheckpointWriter::CheckpointWriter(uint64_t max_bytes_per_second)
    : max_bytes_per_second_(max_bytes_per_second), thread_([this] { Loop(); }) {}

CheckpointWriter::~CheckpointWriter() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

bool CheckpointWriter::Known(uint64_t job_id, uint64_t checkpoint_id) const {
  absl::MutexLock lock(&mu_);
  return progress_.count({job_id, checkpoint_id}) != 0;
}

bool CheckpointWriter::BeginIfNew(uint64_t job_id, uint64_t checkpoint_id,
                                  const std::string& dir, uint32_t num_chunks, bool make_dir) {
  absl::MutexLock lock(&mu_);
  auto [it, fresh] = progress_.try_emplace({job_id, checkpoint_id});
  if (!fresh) return false;
  it->second.dir = dir;
  it->second.expected = num_chunks;
  it->second.make_dir = make_dir;
  return true;
}

void CheckpointWriter::Add(ChunkSnapshot snapshot) {
  absl::MutexLock lock(&mu_);
  auto it = progress_.find({snapshot.job_id, snapshot.checkpoint_id});
  if (it == progress_.end() || !it->second.error.empty()) return;
  queue_.push_back(std::move(snapshot));
}

void CheckpointWriter::Fail(uint64_t job_id, uint64_t checkpoint_id, const std::string& error,
                            bool missed_step) {
  absl::MutexLock lock(&mu_);
  Progress& p = progress_[{job_id, checkpoint_id}];
  if (!p.error.empty()) return;  // The first reason stands.
  p.error = error;
  p.missed_step = missed_step;
}

void CheckpointWriter::FailJob(uint64_t job_id, const std::string& error) {
  absl::MutexLock lock(&mu_);
  for (auto& [key, p] : progress_) {
    if (key.first == job_id && p.error.empty()) p.error = error;
  }
}

std::vector<CheckpointReport> CheckpointWriter::Reports() {
  std::vector<CheckpointReport> out;
  absl::MutexLock lock(&mu_);
  for (auto& [key, p] : progress_) {
    p.reported = true;
    CheckpointReport r;
    r.job_id = key.first;
    r.checkpoint_id = key.second;
    r.error = p.error;
    r.missed_step = p.missed_step;
    r.done = p.error.empty() && p.files.size() == p.expected;
    if (r.done) r.files = p.files;
    out.push_back(std::move(r));
  }
  return out;
}

void CheckpointWriter::Retain(const std::set<std::pair<uint64_t, uint64_t>>& ordered) {
  absl::MutexLock lock(&mu_);
  for (auto it = progress_.begin(); it != progress_.end();) {
    const Progress& p = it->second;
    const bool finished = !p.error.empty() || p.files.size() == p.expected;
    if (ordered.count(it->first) == 0 && finished && p.reported) {
      it = progress_.erase(it);
    } else {
      ++it;
    }
  }
}

void CheckpointWriter::Loop() {
  // Persisting is background work: at the lowest CPU priority it takes the
  // cores only when the optimizer steps leave them idle, so workers do not
  // wait for it (on Linux, nice applies to one thread).
  if (absl::Status s = LowerThisThreadPriority(19); !s.ok()) {
    OPTIMUS_LOG(Warning, "ckpt", "checkpoint writer: ", s.message());
  }
  for (;;) {
    ChunkSnapshot snap;
    std::string dir;
    bool make_dir = false;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](CheckpointWriter* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) {
            return w->stopping_ || !w->queue_.empty();
          },
          this));
      if (stopping_) return;
      snap = std::move(queue_.front());
      queue_.pop_front();
      auto it = progress_.find({snap.job_id, snap.checkpoint_id});
      if (it == progress_.end() || !it->second.error.empty()) continue;
      dir = it->second.dir;
      make_dir = it->second.make_dir;
      it->second.make_dir = false;
    }
    if (make_dir) {
      // A policy checkpoint: this shard makes its folder, and never writes
      // into one that holds a complete checkpoint (e.g. of the same step,
      // from before a restore).
      absl::Status made = ckpt::ReadManifest(dir).ok()
                              ? absl::AlreadyExistsError(absl::StrCat(
                                    "a complete checkpoint exists in ", dir))
                              : ckpt::MakeDirs(dir);
      if (!made.ok()) {
        absl::MutexLock lock(&mu_);
        auto it = progress_.find({snap.job_id, snap.checkpoint_id});
        if (it != progress_.end() && it->second.error.empty()) {
          it->second.error = std::string(made.message());
        }
        continue;
      }
    }
    std::vector<const float*> arrays;
    for (uint32_t a = 0; a < snap.num_arrays; ++a) {
      arrays.push_back(snap.data.data() + a * snap.num_elems);
    }
    // Named by element range, not chunk index: a restore may chunk differently.
    const std::string name = absl::StrFormat("t%05d-o%012d.bin", snap.tensor, snap.offset_elems);
    absl::StatusOr<v1::CheckpointFile> file =
        ckpt::WriteDataFile(dir, name, snap.tensor, snap.offset_elems, snap.num_elems, arrays,
                            max_bytes_per_second_);
    absl::MutexLock lock(&mu_);
    auto it = progress_.find({snap.job_id, snap.checkpoint_id});
    if (it == progress_.end()) continue;
    if (!file.ok()) {
      OPTIMUS_LOG(Error, "shard", "checkpoint ", snap.checkpoint_id, " of job ", snap.job_id,
                  " failed: ", file.status().ToString());
      if (it->second.error.empty()) it->second.error = std::string(file.status().message());
      continue;
    }
    file->set_optimizer_steps(snap.optimizer_steps);
    file->set_last_lr(snap.last_lr);
    it->second.files.push_back(*file);
  }
}

}  // namespace server
}  // namespace optimus
