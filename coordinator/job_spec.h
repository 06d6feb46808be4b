// Checking a JobSpec that a CreateJob or a restore brings, and filling its
// defaults (optimizer defaults from kernels/optimizer_spec.h, the one place
// they live), plus what a shard holds per element of the job. Pure
// functions; safe from any thread.
#ifndef OPTIMUS_COORDINATOR_JOB_SPEC_H_
#define OPTIMUS_COORDINATOR_JOB_SPEC_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/optimus.pb.h"

namespace optimus {

// Most chunks one job may have by default: its whole map travels in one
// gRPC message (~25-30 bytes per chunk, under common/grpc_limits.h's 64 MiB),
// and every chunk costs its shard kernels::kChunkOverheadBytes of
// bookkeeping. 2^20 chunks of 4 MiB hold 2^40 fp32 elements. A larger model
// needs a larger max_chunk_bytes.
inline constexpr uint64_t kMaxChunksPerJob = uint64_t{1} << 20;
// Most tensors one job may declare by default (the largest models have a
// few thousand).
inline constexpr uint64_t kMaxTensorsPerJob = uint64_t{1} << 16;

// What one job may cost, set by an admin (optimus-coord's --max_* flags).
// A spec over one is refused with RESOURCE_EXHAUSTED ("job quota: ...").
struct JobLimits {
  uint64_t max_chunks = kMaxChunksPerJob;    // Chunks, over all tensors.
  uint64_t max_tensors = kMaxTensorsPerJob;  // Tensors in the spec.
  // Shard bytes over all copies (state, published copies, gradients held,
  // each chunk's bookkeeping; twice that with a backup). 0: no quota (the
  // shards' memory is then the only bound).
  uint64_t max_job_bytes = 0;
};

struct CheckedSpec {
  std::vector<uint64_t> tensor_num_elems;  // By tensor, in spec order.
  uint64_t num_params = 0;                 // Their sum.
  // Shard bytes per element, primary or backup alike
  // (kernels::ShardBytesPerElem; replicated when replication is 1).
  uint64_t bytes_per_elem = 0;
  // fp32 master and moment bytes per element (kernels::LayoutOf).
  uint64_t state_bytes_per_elem = 0;
  uint64_t num_chunks = 0;
  // Shard bytes each chunk costs beyond its elements
  // (kernels::ChunkOverheadBytes of the world size).
  uint64_t chunk_overhead_bytes = 0;
  // What the job costs the shards in all, backups and each chunk's
  // overhead included (the sum of the map's loads).
  uint64_t shard_bytes = 0;
};

// Validates `spec` in place and fills its defaults: INVALID_ARGUMENT
// ("invalid job spec: ...", naming the field) when the name is empty,
// world_size is 0 or too large, replication is not 0 or 1, there is no
// tensor, a tensor name is empty or repeated, a dimension is not positive,
// the job is too large, a dtype or the optimizer kind is unset, lr is not
// positive, another optimizer field is out of range, a param group's field
// is out of range (kernels::ValidateGroupOverrides) or its non-empty name is
// repeated, a tensor's group names no param group (with none, it must be
// 0), or max_grad_norm is negative or not finite; RESOURCE_EXHAUSTED
// ("job quota: ...", naming the limit and its flag) when the job would have
// more tensors or chunks, or cost the shards more bytes, than `limits`
// allow. Fills the optimizer's defaults for its kind, grad_scale
// (1/world_size) and max_chunk_bytes (4 MiB).
absl::StatusOr<CheckedSpec> CheckAndFillSpec(v1::JobSpec& spec, const JobLimits& limits = {});

// fp32 master and moment bytes per element of `kind` (12 for Adam/AdamW, 8
// for SGD and Lion); 0 for an unknown kind.
uint64_t StateBytesPerElemOf(v1::OptimizerKind kind);

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_JOB_SPEC_H_
