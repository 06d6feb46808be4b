// Internal to //kernels/cpu: the per-ISA entry points behind FusedStep and
// the casts, and the per-step constants they share. Not for use outside
// kernels/ (tests included here may pick an ISA explicitly). Functions are
// stateless; callers own all buffers. Safe from any thread on disjoint state.
//
// The files built with -mavx2/-mavx512f must not call any inline function
// from a header (this one declares none): such a function would be emitted
// with AVX instructions, and the linker may pick that copy for every caller,
// including those on CPUs without AVX.
#ifndef OPTIMUS_KERNELS_CPU_OPTIMIZER_INTERNAL_H_
#define OPTIMUS_KERNELS_CPU_OPTIMIZER_INTERNAL_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "kernels/cpu/optimizer.h"

namespace optimus {
namespace kernels {
namespace internal {

// Everything an element update needs, computed once per call in
// PrepareStep. fp32 values that torch derives from Python/C++ doubles are
// derived here the same way: in double, then rounded to float once.
struct StepConstants {
  OptimizerKind kind = OptimizerKind::kAdamW;
  bool apply_weight_decay = false;  // weight_decay != 0 (torch skips it at 0)
  bool use_momentum = false;        // SGD: momentum != 0
  float lr = 0;
  float weight_decay = 0;
  float decay_factor = 1;   // AdamW, Lion: float(1 - lr * weight_decay)
  float beta1 = 0;
  float one_minus_beta1 = 0;  // float(1 - beta1)
  float beta2 = 0;
  float one_minus_beta2 = 0;  // float(1 - beta2)
  float eps = 0;
  float step_size = 0;      // float(lr / (1 - beta1^t))
  // float(1 / sqrt(1 - beta2^t)). torch divides by sqrt(1 - beta2^t); we
  // multiply by its reciprocal (one IEEE rounding either way, results within
  // an ulp of torch's) because the divider is the bottleneck of the fused
  // step on x86 and Arm cores, and a second division per element would make
  // the pass compute-bound instead of memory-bound.
  float inv_sqrt_bias_correction2 = 1;
  float momentum = 0;
};

// Validated arguments of one FusedStep call.
struct StepArgs {
  StepConstants k;
  const void* const* grads = nullptr;  // num_workers slots
  size_t num_workers = 0;
  DType grad_dtype = DType::kFp32;
  float grad_scale = 1;
  float* master = nullptr;
  float* m = nullptr;  // null for SGD without momentum
  float* v = nullptr;  // null for SGD and Lion
  void* out = nullptr;  // null: no published copy
  DType out_dtype = DType::kFp32;
};

// Ranges at least this long write the published copy with non-temporal
// (streaming) stores: it is write-only here, and streaming skips the read
// for ownership that an ordinary store pays, 2 of ~34 bytes per element for
// bf16. Shorter ranges use ordinary stores (the copy is likely still cached
// when a worker pulls it, and the fence would cost more than it saves).
constexpr size_t kStreamMinElems = 4096;

// GradSumOfSquares' reduction, fixed so that every ISA, split and thread
// count computes the same double: the chunk is cut into blocks of
// kNormBlockElems elements from its start; within a block, element i adds
// g_i * g_i to lane (i - block start) % kNormLanes in index order (each lane
// starts at +0); the lanes are then folded in halves (lane j += lane j + 16
// for j < 16, then j += j + 8, j + 4, j + 2, j + 1) to the block's sum, and
// the caller adds the block sums in block order. g_i * g_i is exact in
// double (a float has 24 significant bits, its square at most 48), so an FMA
// or a separate multiply give the same sum.
//
// 32 lanes: 4 AVX-512, 8 AVX2 or 16 NEON accumulators, enough independent
// adds to hide the latency of a double add (3-4 cycles) at memory speed; a
// vector path may hold the lanes in another order as long as it hands them
// to the fold in this one. 1024-element blocks: a block's fixed costs (the
// lanes stored, 31 adds, one block sum) are small next to its 32 groups of
// 32 elements, and the caller's serial sum has one term per 1024 elements.
constexpr size_t kNormLanes = 32;
constexpr size_t kNormBlockElems = 1024;

// Validates the gradient inputs (slots, dtype, grad_scale) and fills the
// gradient fields of `args`; InvalidArgument, with `caller` in the message,
// on bad input.
absl::Status PrepareGrads(absl::string_view caller, const StepInputs& in,
                          StepArgs* args);

// Validates the inputs and fills `args`; InvalidArgument on bad input.
absl::Status PrepareStep(const OptimizerHyper& hyper, const StepInputs& in,
                         ChunkState state, void* out, DType out_dtype,
                         StepArgs* args);

// Updates elements [begin, end) of the chunk described by args. Each ISA
// version must produce bit-identical results to the scalar one.
using StepRangeFn = void (*)(const StepArgs& args, size_t begin, size_t end);
using CastFromFp32Fn = void (*)(const float* src, size_t begin, size_t end,
                                void* dst, DType dst_dtype);
using CastToFp32Fn = void (*)(const void* src, DType src_dtype, size_t begin,
                              size_t end, float* dst);
// Elements [begin, end) of dst = (sum of args.grads in rank order) *
// args.grad_scale: the first pass of the unfused pipeline (benchmarks).
using SumGradsFn = void (*)(const StepArgs& args, size_t begin, size_t end,
                            float* dst);
// The fused step's memory traffic with no arithmetic, for the benchmarks'
// bandwidth ceiling: reads every grad slot, master, m and v (those non-null),
// writes master, m, v and out with the same store kinds as `step`. Values
// are kept: each store writes (loaded bits | (grad bits & grad_mask)), so a
// grad_mask of 0 (opaque to the compiler) leaves the state unchanged.
using TouchFn = void (*)(const StepArgs& args, uint32_t grad_mask,
                         size_t begin, size_t end);
// GradSumOfSquares' kernel over elements [begin, end) of the chunk of
// args.grads (only the gradient fields of args are read): writes
// block_sums[b] for every block b of kNormBlockElems that [begin, end)
// covers. begin must be a multiple of kNormBlockElems, and end one too or
// the chunk's end.
using GradSquaresFn = void (*)(const StepArgs& args, size_t begin, size_t end,
                               double* block_sums);
// GradSumOfSquares' memory traffic with no arithmetic, for the benchmarks'
// bandwidth ceiling: reads elements [begin, end) of every grad slot in the
// same order and returns the OR of their bits (so no read can be dropped).
using ReadGradsFn = uint32_t (*)(const StepArgs& args, size_t begin,
                                 size_t end);

void StepRangeScalar(const StepArgs& args, size_t begin, size_t end);
void CastFromFp32Scalar(const float* src, size_t begin, size_t end, void* dst,
                        DType dst_dtype);
void CastToFp32Scalar(const void* src, DType src_dtype, size_t begin,
                      size_t end, float* dst);
void SumGradsScalar(const StepArgs& args, size_t begin, size_t end, float* dst);
void TouchScalar(const StepArgs& args, uint32_t grad_mask, size_t begin,
                 size_t end);
void GradSquaresScalar(const StepArgs& args, size_t begin, size_t end,
                       double* block_sums);
uint32_t ReadGradsScalar(const StepArgs& args, size_t begin, size_t end);
// The end of one block of GradSquares for the vector paths: adds the squares
// of elements [i, block_end) (the tail after the last whole vector group) to
// lanes[(i - block_begin) % kNormLanes], folds the kNormLanes lanes (they
// are overwritten) and returns the block's sum.
double FinishNormBlock(const StepArgs& args, size_t block_begin, size_t i,
                       size_t block_end, double* lanes);

#if defined(__x86_64__)
void StepRangeAvx2(const StepArgs& args, size_t begin, size_t end);
void CastFromFp32Avx2(const float* src, size_t begin, size_t end, void* dst,
                      DType dst_dtype);
void CastToFp32Avx2(const void* src, DType src_dtype, size_t begin, size_t end,
                    float* dst);
void StepRangeAvx512(const StepArgs& args, size_t begin, size_t end);
void CastFromFp32Avx512(const float* src, size_t begin, size_t end, void* dst,
                        DType dst_dtype);
void CastToFp32Avx512(const void* src, DType src_dtype, size_t begin,
                      size_t end, float* dst);
void SumGradsAvx2(const StepArgs& args, size_t begin, size_t end, float* dst);
void TouchAvx2(const StepArgs& args, uint32_t grad_mask, size_t begin,
               size_t end);
void SumGradsAvx512(const StepArgs& args, size_t begin, size_t end, float* dst);
void TouchAvx512(const StepArgs& args, uint32_t grad_mask, size_t begin,
                 size_t end);
void GradSquaresAvx2(const StepArgs& args, size_t begin, size_t end,
                     double* block_sums);
uint32_t ReadGradsAvx2(const StepArgs& args, size_t begin, size_t end);
void GradSquaresAvx512(const StepArgs& args, size_t begin, size_t end,
                       double* block_sums);
uint32_t ReadGradsAvx512(const StepArgs& args, size_t begin, size_t end);
#endif

#if defined(__aarch64__)
void StepRangeNeon(const StepArgs& args, size_t begin, size_t end);
void CastFromFp32Neon(const float* src, size_t begin, size_t end, void* dst,
                      DType dst_dtype);
void CastToFp32Neon(const void* src, DType src_dtype, size_t begin, size_t end,
                    float* dst);
void SumGradsNeon(const StepArgs& args, size_t begin, size_t end, float* dst);
void GradSquaresNeon(const StepArgs& args, size_t begin, size_t end,
                     double* block_sums);
#endif

struct IsaKernels {
  const char* name;  // "avx512", "avx2", "neon", "scalar"
  StepRangeFn step;
  CastFromFp32Fn cast_from_fp32;
  CastToFp32Fn cast_to_fp32;
  SumGradsFn sum_grads;
  TouchFn touch;
  GradSquaresFn grad_squares;
  ReadGradsFn read_grads;
};

// The ISA kernels FusedStep uses on this CPU.
const IsaKernels& ActiveKernels();

// The kernels for `isa` if this binary has them and this CPU runs them;
// NotFound for an ISA not built in, Unavailable for one the CPU lacks.
absl::StatusOr<const IsaKernels*> KernelsForIsa(absl::string_view isa);

// FusedStep on an explicitly chosen ISA (for tests and benchmarks).
absl::Status FusedStepWithIsa(absl::string_view isa,
                              const OptimizerHyper& hyper,
                              const StepInputs& in, size_t num_elems,
                              ChunkState state, void* out, DType out_dtype);

// GradSumOfSquares on an explicitly chosen ISA (for tests and benchmarks).
absl::StatusOr<double> GradSumOfSquaresWithIsa(absl::string_view isa,
                                               const StepInputs& in,
                                               size_t num_elems,
                                               ThreadPool* pool);

}  // namespace internal
}  // namespace kernels
}  // namespace optimus

#endif  // OPTIMUS_KERNELS_CPU_OPTIMIZER_INTERNAL_H_
