// What each optimizer keeps per parameter on a shard, and its default
// hyper-parameters: the one place that the coordinator (validation, memory
// planning), the shard server (allocation), checkpoint files and export
// (array names) and the client (defaults) take them from.
// Plain values and pure functions; safe from any thread.
#ifndef OPTIMUS_KERNELS_OPTIMIZER_SPEC_H_
#define OPTIMUS_KERNELS_OPTIMIZER_SPEC_H_

#include <array>
#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"

namespace optimus {
namespace kernels {

// The numeric values match proto/optimus.proto's OptimizerKind.
enum class OptimizerKind : uint8_t {
  kAdamW = 1,  // Adam, decoupled weight decay (Loshchilov & Hutter), as torch.optim.AdamW.
  kAdam = 2,   // Adam, L2 weight decay added to the gradient, as torch.optim.Adam.
  kSgd = 3,    // SGD with momentum (dampening 0, no Nesterov), as torch.optim.SGD.
  // Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"),
  // as lion-pytorch: c = b1*m + (1-b1)*g; p = p*(1 - lr*wd) - lr*sign(c);
  // m = b2*m + (1-b2)*g. Uses beta1, beta2, lr, weight_decay; state m.
  kLion = 4,
};

// INVALID_ARGUMENT for a value that names no optimizer.
absl::StatusOr<OptimizerKind> OptimizerKindFromInt(int value);
absl::string_view OptimizerName(OptimizerKind kind);  // "adamw", "adam", "sgd", "lion".

struct OptimizerHyper {
  OptimizerKind kind = OptimizerKind::kAdamW;
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  float momentum = 0.0f;  // SGD only; 0 disables the momentum buffer.
};

// The defaults of `kind`, as torch.optim (and lion-pytorch for Lion) has
// them: lr 1e-3; Adam/AdamW betas (0.9, 0.999), eps 1e-8; Lion betas
// (0.9, 0.99); weight decay and momentum 0.
OptimizerHyper DefaultHyper(OptimizerKind kind);

// Fills the fields of `hyper` that are 0 and have a non-zero default for
// its kind (betas, eps; lr when 0), then checks every field: INVALID_ARGUMENT
// naming the field when one is out of range (lr > 0 and finite, betas and
// momentum in [0, 1), eps and weight decay >= 0 and finite).
absl::Status FillDefaultsAndValidate(OptimizerHyper* hyper);

// A parameter group's overrides of its job's settings, as torch.optim's
// param_groups carry them; an unset field takes the job's value.
struct GroupOverrides {
  std::optional<float> weight_decay;
  std::optional<float> lr_mult;  // The group's lr is the step's lr times this; unset: 1.
  std::optional<float> beta1;
  std::optional<float> beta2;
  std::optional<float> momentum;
};

// Checks the set fields of `group` with FillDefaultsAndValidate's ranges
// (weight decay >= 0 and finite, betas and momentum in [0, 1)) and lr_mult
// > 0 and finite: INVALID_ARGUMENT naming the field as `where` + "." + its
// name (e.g. "param_groups[1].beta2") and the bad value.
absl::Status ValidateGroupOverrides(const GroupOverrides& group, absl::string_view where);

// `base` (a job's validated settings) with the set fields of `group`.
// The group's lr_mult is not part of it (it scales each step's lr).
OptimizerHyper WithGroupOverrides(OptimizerHyper base, const GroupOverrides& group);

// The fp32 arrays a shard keeps per element of a chunk for one optimizer:
// the master weights first, then the moments, in this order in memory,
// in checkpoint files and in the export.
struct StateLayout {
  uint32_t num_arrays = 1;                  // 2 or 3.
  std::array<const char*, 3> names = {};    // torch.optim's state names.
  bool has_v() const { return num_arrays > 2; }
  uint64_t bytes_per_elem() const { return uint64_t{4} * num_arrays; }
};
const StateLayout& LayoutOf(OptimizerKind kind);

// A chunk's W gradients on a shard, once all have landed: the W slots as
// pushed, or (when W slots cost more than 4 B per element) one fp32 running
// sum that the slots are folded into as they land (server/staging.h).
bool FoldsGradients(uint32_t world_size, DType grad_dtype);
uint64_t GradHoldBytesPerElem(uint32_t world_size, DType grad_dtype);

// Bytes a shard holds per element of a chunk of a job, for as long as the
// job lives: the optimizer state, two published versions, for a chunk with
// a backup (replicated on both copies) the fp32 gradient sum the primary
// forwards, and, for a job whose steps wait for a worker's commit (clipping
// or skipping non-finite steps: every chunk holds its gradients until the
// whole job's norm is known), GradHoldBytesPerElem. Gradients of other jobs
// land in the shard's staging pool, sized for the chunks in flight, not per
// element. The coordinator plans with it, the shard allocates it.
uint64_t ShardBytesPerElem(OptimizerKind kind, uint32_t world_size, DType grad_dtype,
                           DType param_dtype, bool replicated, bool holds_grads);

// What a chunk costs a shard beyond its elements: its bookkeeping (state
// machine, staging, buffer headers and their alignment, registrations; about
// 5 KB measured with one-element chunks, //tests/integration:
// chunk_overhead_test), rounded up. Negligible for chunks of megabytes; it
// keeps a job cut into tiny chunks from costing many times what it was
// planned with. The coordinator plans with ShardChunkBytes, the shard
// reserves it per chunk.
inline constexpr uint64_t kChunkOverheadBytes = 8192;
// What a chunk costs a shard per worker of its job, beyond the above: the
// rank's entries in the chunk's state machine (slot state, the push to
// answer) and staging (landing state, a waiting push); about 70 bytes,
// rounded up. A job of a million workers costs 128 MiB per chunk: it is
// planned (and refused) as such, not discovered when the shard allocates.
inline constexpr uint64_t kChunkRankOverheadBytes = 128;
// A chunk's bookkeeping for a job of `world_size` workers: what the
// coordinator plans per chunk and the shard reserves before allocating it.
inline uint64_t ChunkOverheadBytes(uint32_t world_size) {
  return kChunkOverheadBytes + uint64_t{world_size} * kChunkRankOverheadBytes;
}
// All a chunk of `num_elems` costs its shard.
inline uint64_t ShardChunkBytes(uint64_t num_elems, uint64_t bytes_per_elem, uint32_t world_size) {
  return num_elems * bytes_per_elem + ChunkOverheadBytes(world_size);
}

}  // namespace kernels
}  // namespace optimus

#endif  // OPTIMUS_KERNELS_OPTIMIZER_SPEC_H_
