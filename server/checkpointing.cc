// Checkpoints on the shard: an order (from the heartbeat) is checked
// against every primary chunk's state machine, chunks already at the step
// are copied at once, the others when they publish it; the copies go to the
// background CheckpointWriter. Restores read a chunk's element range from
// the checkpoint's files.
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_files.h"
#include "kernels/cpu/optimizer.h"
#include "server/shard.h"

namespace optimus {
namespace server {

void Shard::StartCheckpoint(const CheckpointOrder& o) {
  // A policy checkpoint is taken by the chunks themselves at the boundary
  // (FinishSnapshot begins it); its order only keeps it reported.
  if (ckpt_writer_ == nullptr || o.policy) return;
  JobRef job = table_.Find(o.job_id);
  // Only primaries write: a backup holds the same bytes.
  std::vector<ChunkRef> primaries;
  if (job != nullptr) {
    for (const ChunkRef& chunk : job->Chunks()) {
      absl::MutexLock lock(&chunk->mu);
      if (!chunk->machine.retired() && chunk->machine.role() == Role::kPrimary) {
        primaries.push_back(chunk);
      }
    }
  }
  const std::string dir = absl::StrCat(options_.checkpoint_dir, "/", o.path);
  if (!ckpt_writer_->BeginIfNew(o.job_id, o.checkpoint_id, dir,
                                static_cast<uint32_t>(primaries.size()), /*make_dir=*/false)) {
    return;  // Ordered before (or taken by the policy at this step).
  }
  if (job == nullptr) {
    return ckpt_writer_->Fail(
        o.job_id, o.checkpoint_id,
        absl::StrCat("shard ", shard_id_.load(), " has not loaded job ", o.job_id));
  }
  if (absl::Status s = ckpt::MakeDirs(dir); !s.ok()) {
    return ckpt_writer_->Fail(o.job_id, o.checkpoint_id, std::string(s.message()));
  }
  std::vector<ChunkRef> copy_now;
  std::vector<ChunkRef> capture_later;
  std::string error;
  bool missed = false;
  for (const ChunkRef& chunk : primaries) {
    CaptureDecision d;
    {
      absl::MutexLock lock(&chunk->mu);
      d = chunk->machine.CaptureOrdered(o.step, o.checkpoint_id);
    }
    if (d.verdict == CaptureVerdict::kCopyNow) {
      copy_now.push_back(chunk);
    } else if (d.verdict == CaptureVerdict::kLater) {
      capture_later.push_back(chunk);
    } else {
      error = d.error;
      missed = d.verdict == CaptureVerdict::kMissed;
      break;
    }
  }
  if (!error.empty()) {
    // Undo this order on every chunk it touched, then report.
    for (const ChunkRef& chunk : capture_later) {
      absl::MutexLock lock(&chunk->mu);
      chunk->machine.CaptureCancelled(o.checkpoint_id);
    }
    for (const ChunkRef& chunk : copy_now) FinishSnapshot(job, chunk, /*checkpoint_id=*/0);
    return ckpt_writer_->Fail(o.job_id, o.checkpoint_id, error, missed);
  }
  // Copied without holding the chunk: pushes and pulls go on, only its
  // next step waits for the copy.
  for (const ChunkRef& chunk : copy_now) FinishSnapshot(job, chunk, o.checkpoint_id);
}

void Shard::BeginPolicyCheckpoint(const JobRef& job, uint64_t step) {
  if (ckpt_writer_ == nullptr || ckpt_writer_->Known(job->config.job_id, step)) return;
  // Every primary chunk of the job snapshots this boundary as it publishes
  // it; the writer makes the folder (refusing one that is complete already).
  uint32_t primaries = 0;
  for (const ChunkRef& chunk : job->Chunks()) {
    absl::MutexLock lock(&chunk->mu);
    if (!chunk->machine.retired() && chunk->machine.role() == Role::kPrimary) ++primaries;
  }
  const std::string dir = absl::StrCat(options_.checkpoint_dir, "/", job->config.name, "/",
                                       ckpt::FolderName(step));
  ckpt_writer_->BeginIfNew(job->config.job_id, step, dir, primaries, /*make_dir=*/true);
}

void Shard::FinishSnapshot(const JobRef& job, const ChunkRef& chunk, uint64_t checkpoint_id) {
  if (checkpoint_id != 0 && ckpt_writer_ != nullptr) {
    // The machine holds the chunk's next step until SnapshotDone, so the
    // state is exactly the published version.
    ChunkSnapshot snap;
    snap.job_id = job->config.job_id;
    snap.checkpoint_id = checkpoint_id;
    snap.tensor = chunk->name.tensor;
    snap.offset_elems = chunk->offset_elems;
    snap.num_elems = chunk->num_elems;
    {
      absl::MutexLock lock(&chunk->mu);
      snap.optimizer_steps = chunk->machine.optimizer_steps();
      snap.last_lr = chunk->machine.last_lr();
    }
    snap.num_arrays = job->layout().num_arrays;
    snap.data = chunk->PackState();
    ckpt_writer_->Add(std::move(snap));
  }
  Actions a;
  {
    absl::MutexLock lock(&chunk->mu);
    a = chunk->machine.SnapshotDone();
  }
  Carry(job, chunk, std::move(a));
}

absl::Status Shard::RestoreChunk(const Job& job, Chunk* chunk, const RestoreSource& restore) {
  if (options_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(
        "the job is restored from a checkpoint but this shard has no --checkpoint_dir");
  }
  const std::string dir = absl::StrCat(options_.checkpoint_dir, "/", restore.path);
  std::vector<float*> arrays = chunk->state_arrays();
  if (absl::Status s = ckpt::ReadTensorRange(dir, restore.manifest, chunk->name.tensor,
                                             chunk->offset_elems, chunk->num_elems,
                                             absl::MakeSpan(arrays));
      !s.ok()) {
    return s;
  }
  kernels::CastFromFp32(chunk->master(), chunk->num_elems, chunk->published(restore.step),
                        job.config.param_dtype);
  return absl::OkStatus();
}

}  // namespace server
}  // namespace optimus
