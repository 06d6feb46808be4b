// The plain structs the shard server works with: a job's configuration and
// map, what it tells the coordinator and what the coordinator answers. The
// gRPC edge (coordinator_link.cc) converts between them and proto messages;
// nothing else in server/ sees a control-plane message. The one proto type
// here is the checkpoint manifest and its file records: they are the
// on-disk checkpoint format that common/checkpoint_files reads and writes.
// Plain values; no thread-safety of their own.
#ifndef OPTIMUS_SERVER_DOMAIN_H_
#define OPTIMUS_SERVER_DOMAIN_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/dtype.h"
#include "kernels/optimizer_spec.h"
#include "proto/optimus.pb.h"

namespace optimus {
namespace server {

// What a shard needs of a job's spec, validated at the edge.
struct JobConfig {
  uint64_t job_id = 0;
  std::string name;
  uint32_t world_size = 0;
  uint32_t replication = 0;  // 0 or 1.
  DType grad_dtype = DType::kBf16;
  DType param_dtype = DType::kBf16;
  // Multiplies the summed gradient (1/W: the average).
  float grad_scale = 1.0f;
  // The policy's checkpoint boundary: every primary chunk snapshots version
  // S when it publishes it, for each S % every_steps == 0 (0: none).
  uint64_t checkpoint_every_steps = 0;
  // The job's optimizer settings; hyper.lr is the default learning rate of
  // a push that carries none.
  kernels::OptimizerHyper hyper;
  // Per tensor (spec order): its parameter group's settings and whether it
  // is frozen.
  struct Tensor {
    kernels::OptimizerHyper hyper;  // The job's, with the group's overrides.
    float lr_mult = 1.0f;           // The step's lr times this (fp32).
    bool frozen = false;
  };
  std::vector<Tensor> tensors;
  // The clipping round: every chunk waits for a kCommit (clip coefficient,
  // skip) before it steps. On when the job clips (max_grad_norm > 0) or
  // skips non-finite steps.
  bool commit_round = false;
};

struct ChunkPlacement {
  uint32_t tensor = 0;
  uint32_t chunk = 0;
  uint64_t offset_elems = 0;  // Of the chunk's first element in its tensor.
  uint64_t num_elems = 0;
  uint64_t primary = 0;       // Shard ids; backup 0: none.
  uint64_t backup = 0;
};

inline uint64_t ChunkKey(uint32_t tensor, uint32_t chunk) {
  return (static_cast<uint64_t>(tensor) << 32) | chunk;
}

struct ShardMapView {
  uint64_t epoch = 0;
  std::vector<ChunkPlacement> chunks;
  // Data-plane (UCX worker) address of every shard the map names.
  std::map<uint64_t, std::string> addresses;
};

// A job restored from a checkpoint: where its chunks' values come from.
struct RestoreSource {
  std::string path;  // Relative to the shard's checkpoint folder.
  v1::CheckpointManifest manifest;
  uint64_t step = 0;  // Version the restored values are.
  // Per tensor: the optimizer steps its values have seen
  // (ckpt::OptimizerStepsOf, read once at the edge).
  std::vector<uint64_t> optimizer_steps;
};

struct JobDescription {
  JobConfig config;
  ShardMapView map;
  std::optional<RestoreSource> restore;
};

struct ShardRegistration {
  bool is_dpu = false;
  std::string arch;
  uint32_t cores = 1;
  uint64_t memory_limit_bytes = 0;
  uint64_t staging_bytes = 0;
  std::string data_address;
  std::string hostname;
  std::string failure_domain;  // Empty: the hostname.
  bool checkpoints = false;  // Has a checkpoint folder.
};

struct Registered {
  uint64_t shard_id = 0;
  int64_t lease_ms = 0;
  // The cluster's data-plane secret; empty when the coordinator runs in
  // plain text (no data-plane authentication).
  std::string data_plane_key;
};

// Counts over the chunks a shard holds of one job, at its loaded epoch.
struct JobReport {
  uint64_t job_id = 0;
  uint64_t map_epoch = 0;
  uint64_t applied_step = 0;      // Lowest over its primaries.
  uint64_t max_applied_step = 0;  // Highest over its primaries.
  uint32_t primary_chunks = 0;
  uint32_t backup_chunks = 0;
  uint32_t backups_seeded = 0;        // Of backup_chunks, in sync.
  uint32_t primaries_replicated = 0;  // Of primaries with a backup, seeded.
};

// A shard's part of one checkpoint.
struct CheckpointReport {
  uint64_t job_id = 0;
  uint64_t checkpoint_id = 0;
  bool done = false;
  std::string error;
  bool missed_step = false;  // A later step may succeed.
  std::vector<v1::CheckpointFile> files;  // When done.
};

struct HeartbeatReport {
  uint64_t shard_id = 0;
  uint64_t memory_used_bytes = 0;
  uint32_t chunks_owned = 0;
  std::vector<JobReport> jobs;
  std::vector<CheckpointReport> checkpoints;
  std::string transports;  // The data plane's transports_in_use().
};

struct CheckpointOrder {
  uint64_t job_id = 0;
  uint64_t checkpoint_id = 0;
  uint64_t step = 0;  // Snapshot version `step`.
  std::string path;   // Relative to the checkpoint folder.
  // Taken by the shards at a policy boundary: the order only says "keep
  // reporting it"; nothing is started for it.
  bool policy = false;
};

struct HeartbeatReply {
  // False: the coordinator does not know this shard (declared down, or
  // forgotten): drop everything and register again.
  bool known = true;
  struct Assignment {
    uint64_t job_id = 0;
    uint64_t map_epoch = 0;
    // The newest epoch <= map_epoch that changed this shard's part of the
    // map; 0: not known (v1::Assignment.part_epoch).
    uint64_t part_epoch = 0;
    // Fetch no sooner than this after the reply (the coordinator's pacing).
    absl::Duration fetch_after = absl::ZeroDuration();
  };
  std::vector<Assignment> assignments;
  std::vector<CheckpointOrder> checkpoints;
  std::vector<uint64_t> released_jobs;  // Deleted: free everything of them.
};

}  // namespace server
}  // namespace optimus

#endif  // OPTIMUS_SERVER_DOMAIN_H_
