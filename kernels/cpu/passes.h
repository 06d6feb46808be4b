// The separate memory passes that benchmarks compare the fused step with: the
// unfused pipeline's gradient sum and cast, and no-arithmetic passes with the
// exact memory traffic of the fused step and of GradSumOfSquares (bandwidth
// ceilings). Stateless; the
// pool is borrowed; safe from any thread on disjoint buffers.
#ifndef OPTIMUS_KERNELS_CPU_PASSES_H_
#define OPTIMUS_KERNELS_CPU_PASSES_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/thread_pool.h"

namespace optimus {
namespace kernels {

// dst[i] = (sum over in.grads in rank order of grad[i]) * in.grad_scale, in
// fp32, exactly as FusedStep sums (so sum, fp32 step, cast reproduces
// FusedStep bit for bit). InvalidArgument for empty/null slots or a bad dtype.
absl::Status SumGradsToFp32(const StepInputs& in, size_t num_elems, float* dst,
                            ThreadPool* pool);

// Folds gradient slots into an fp32 running sum, in rank order, exactly as
// FusedStep sums them: with `start` true, acc = s0 + s1 + ... (acc's old
// contents ignored); else acc = acc + s0 + s1 + ..., each add one fp32
// rounding, left to right. So folding ranks 0..k-1 and then k..W-1 (in as
// many calls as wanted) and stepping from acc (one fp32 slot, same
// grad_scale) reproduces FusedStep over the W slots bit for bit. No scale is
// applied. `slots` may be empty (acc unchanged, or zeroed when `start`).
// InvalidArgument for a null acc or slot or a bad dtype.
absl::Status AccumulateGrads(float* acc, bool start, absl::Span<const void* const> slots,
                             DType dtype, size_t num_elems, ThreadPool* pool);

// CastFromFp32 split over `pool` (null: the calling thread).
void CastFromFp32(const float* src, size_t num_elems, void* dst,
                  DType dst_dtype, ThreadPool* pool);

// Reads every grad slot and state.master/m/v (those non-null) and writes
// state.master/m/v and `out` (if non-null) with the store kinds FusedStep
// uses, doing no arithmetic: values are kept (each written value is the
// loaded one OR-ed with the grad bits AND grad_mask; pass 0). The split over
// the pool is FusedStep's. Same validation of `in` as SumGradsToFp32.
absl::Status BandwidthCeilingPass(const StepInputs& in, size_t num_elems,
                                  ChunkState state, void* out, DType out_dtype,
                                  uint32_t grad_mask, ThreadPool* pool);

// Reads elements [0, num_elems) of every grad slot, in GradSumOfSquares'
// order and split over the pool as it is, doing no arithmetic, and returns
// the OR of all their bits (so that no read can be dropped). Same
// validation of `in` as SumGradsToFp32.
absl::StatusOr<uint32_t> ReadGradsPass(const StepInputs& in, size_t num_elems,
                                       ThreadPool* pool);

}  // namespace kernels
}  // namespace optimus

#endif  // OPTIMUS_KERNELS_CPU_PASSES_H_
