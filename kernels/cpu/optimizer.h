// Fused optimizer step for one chunk on the shard server: sum the W workers'
// gradient slots in rank order in fp32, scale, apply the optimizer to the fp32
// master weights and moments, and write the published low-precision copy, all
// in one pass over memory. Elementwise and summation-order fixed, so results
// do not depend on how a chunk is split or on the number of threads. Also the
// gradient-norm pass that global gradient clipping runs before the step
// (GradSumOfSquares). Stateless; safe from any thread as long as different
// calls touch disjoint state. The ThreadPool overloads borrow the caller's
// pool.
#ifndef OPTIMUS_KERNELS_CPU_OPTIMIZER_H_
#define OPTIMUS_KERNELS_CPU_OPTIMIZER_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "kernels/optimizer_spec.h"

namespace optimus {
namespace kernels {

// OptimizerKind and OptimizerHyper (with their defaults) are in
// kernels/optimizer_spec.h.

// One step's inputs for one chunk.
struct StepInputs {
  // W gradient slots in worker-rank order; each holds num_elems of grad_dtype.
  absl::Span<const void* const> grads;
  DType grad_dtype = DType::kFp32;
  // Multiplies the fp32 sum over workers (1/W gives the average).
  float grad_scale = 1.0f;
  // 1-based step number t; Adam's bias corrections use beta^t.
  int64_t step = 1;
};

// The chunk's fp32 state. `m` is Adam's first moment, SGD's momentum buffer
// or Lion's moment; `v` is Adam's second moment (unused, may be null, for SGD
// and Lion).
struct ChunkState {
  float* master = nullptr;
  float* m = nullptr;
  float* v = nullptr;
};

class ThreadPool;  // kernels/cpu/thread_pool.h

// Runs one fused step over num_elems elements and writes the updated master
// weights, cast to out_dtype, into `out` (num_elems elements). A null `out`
// skips the published copy (a plain fp32 optimizer step).
// InvalidArgument for an empty grads span, null pointers or bad hyper values;
// nothing is written then.
absl::Status FusedStep(const OptimizerHyper& hyper, const StepInputs& in,
                       size_t num_elems, ChunkState state, void* out,
                       DType out_dtype);

// Same, with the chunk split into contiguous cache-line-aligned ranges run on
// `pool` (borrowed; null or a 1-thread pool runs on the calling thread).
// Results are bitwise identical to the overload above for any thread count.
// Blocks until the whole chunk is done.
absl::Status FusedStep(const OptimizerHyper& hyper, const StepInputs& in,
                       size_t num_elems, ChunkState state, void* out,
                       DType out_dtype, ThreadPool* pool);

// Same math, one element at a time in plain C++: the reference that the
// vectorized paths are tested against. Same error behaviour.
absl::Status FusedStepScalar(const OptimizerHyper& hyper, const StepInputs& in,
                             size_t num_elems, ChunkState state, void* out,
                             DType out_dtype);

// The clipping round's pass over one chunk: the gradient FusedStep would
// apply (the fp32 sum of the W slots in rank order, times in.grad_scale,
// bit for bit as FusedStep computes it), squared and summed in double.
// Non-finite gradient values (an inf or NaN in a slot, or an fp32 sum over
// the slots that overflows) make the result inf or NaN (a caller tests
// std::isfinite); finite values cannot overflow the double sum.
// Deterministic: the same bits for any thread count and any pool (fixed
// blocks of 1024 elements, each summed in a fixed order, blocks added in
// order), and for every ISA (avx512, avx2, neon and scalar compute the same
// double; only the payload of a NaN result may differ between them).
// in.step is ignored. `pool` is borrowed; null or a 1-thread pool runs on
// the calling thread. Returns +0 for num_elems == 0. InvalidArgument for an
// empty grads span, null pointers, a bad grad_dtype or a non-finite
// grad_scale (FusedStep rejects those too).
absl::StatusOr<double> GradSumOfSquares(const StepInputs& in, size_t num_elems,
                                        ThreadPool* pool);

// Converts num_elems fp32 values to dst_dtype (a vectorized cast).
void CastFromFp32(const float* src, size_t num_elems, void* dst, DType dst_dtype);
// Converts num_elems src_dtype values to fp32.
void CastToFp32(const void* src, DType src_dtype, size_t num_elems, float* dst);

// The instruction set FusedStep runs on this CPU ("avx512", "avx2", "neon",
// "scalar"), chosen once at run time from the CPU's features.
absl::string_view ActiveIsa();

}  // namespace kernels
}  // namespace optimus

#endif  // OPTIMUS_KERNELS_CPU_OPTIMIZER_H_
