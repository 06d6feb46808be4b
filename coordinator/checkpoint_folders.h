// Internals of the checkpoint manager shared by checkpoints.cc (bookkeeping
// and file work) and checkpoint_reads.cc (listing and restore): constants
// and what a checkpoint folder on disk says of itself. Not for other users.
#ifndef OPTIMUS_COORDINATOR_CHECKPOINT_FOLDERS_H_
#define OPTIMUS_COORDINATOR_CHECKPOINT_FOLDERS_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/checkpoint_files.h"
#include "kernels/optimizer_spec.h"
#include "proto/optimus.pb.h"

namespace optimus {
namespace checkpoint_internal {

// Complete checkpoints kept when a job's policy says 0.
inline constexpr uint32_t kDefaultKeepLast = 3;
// Failed checkpoints remembered per job for `list` (their files are gone).
inline constexpr size_t kMaxFailedRemembered = 16;
// Retries of a checkpoint whose step a shard had passed before its order
// arrived (heartbeats lag training); each retry aims further ahead.
inline constexpr int kMaxAttempts = 8;
// How far ahead, in time at the job's pace, an order aims: two heartbeat
// intervals (a third of the default 2 s lease each) plus margin.
inline constexpr absl::Duration kOrderLead = absl::Milliseconds(1600);

inline int64_t UnixMs(absl::Time t) { return absl::ToUnixMillis(t); }

// A job's checkpoints live in a folder named after it: a name that is not a
// plain folder name would write elsewhere.
inline bool UsableAsFolder(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

// Whether `step` is a boundary of the spec's every_steps policy: the shards
// of any job of this name write that step's folder on their own, so the
// coordinator never removes it behind them (a failed attempt's files are
// overwritten by the next one, or pruned once a later checkpoint completes).
inline bool PolicyBoundary(const v1::JobSpec& spec, uint64_t step) {
  const uint64_t every = spec.checkpoint_policy().every_steps();
  return every > 0 && step % every == 0;
}

// The arrays each data file holds, from the optimizer's state layout.
inline void AddArrayNames(v1::OptimizerKind kind, v1::CheckpointManifest* m) {
  absl::StatusOr<kernels::OptimizerKind> k = kernels::OptimizerKindFromInt(kind);
  if (!k.ok()) {
    m->add_arrays("master");
    return;
  }
  const kernels::StateLayout& layout = kernels::LayoutOf(*k);
  for (uint32_t a = 0; a < layout.num_arrays; ++a) m->add_arrays(layout.names[a]);
}

// What a checkpoint folder on disk says of itself: COMPLETE with its step and
// size when its manifest reads, FAILED with the reason when the manifest is
// corrupted; nullopt without a manifest (an incomplete leftover).
inline std::optional<v1::CheckpointInfo> InfoFromFolder(const std::string& job_name, uint64_t id,
                                                 const std::string& path) {
  absl::StatusOr<v1::CheckpointManifest> m = ckpt::ReadManifest(path);
  if (absl::IsNotFound(m.status())) return std::nullopt;
  v1::CheckpointInfo info;
  info.set_job_name(job_name);
  info.set_checkpoint_id(id);
  info.set_path(path);
  if (!m.ok()) {
    info.set_state(v1::CHECKPOINT_STATE_FAILED);
    info.set_error(std::string(m.status().message()));
    return info;
  }
  info.set_state(v1::CHECKPOINT_STATE_COMPLETE);
  info.set_step(m->step());
  info.set_created_unix_ms(m->created_unix_ms());
  uint64_t size = 0;
  for (const auto& f : m->files()) size += f.size_bytes();
  info.set_size_bytes(size);
  return info;
}

}  // namespace checkpoint_internal
}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_CHECKPOINT_FOLDERS_H_
