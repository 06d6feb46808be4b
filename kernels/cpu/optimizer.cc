// Validation, per-step constants and run-time ISA dispatch for the fused
// optimizer step and the gradient-norm pass, and the split of a chunk over a
// thread pool. The math itself lives in optimizer_{scalar,avx2,avx512,neon}.cc.
#include "kernels/cpu/optimizer.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include <cmath>
#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cpu/optimizer_internal.h"
#include "kernels/cpu/thread_pool.h"

namespace optimus {
namespace kernels {
namespace internal {
namespace {

bool ValidDType(DType d) {
  return d == DType::kFp32 || d == DType::kBf16 || d == DType::kFp16;
}

absl::Status Invalid(absl::string_view what,
                     absl::string_view caller = "FusedStep") {
  return absl::InvalidArgumentError(absl::StrCat(caller, ": ", what));
}

absl::Status CheckNonNegativeFinite(const char* name, float value) {
  if (!std::isfinite(value) || value < 0.0f) {
    return Invalid(absl::StrCat(name, " must be finite and >= 0, got ", value));
  }
  return absl::OkStatus();
}

absl::Status CheckBeta(const char* name, float value) {
  if (!(value >= 0.0f && value < 1.0f)) {
    return Invalid(absl::StrCat(name, " must be in [0, 1), got ", value));
  }
  return absl::OkStatus();
}

// A thread's share of a chunk is a multiple of this many elements: 64 KiB of
// fp32 master, a whole number of cache lines of every array (so no two
// threads write one line) and enough work to amortize the hand-off to a
// pool thread (a few microseconds).
constexpr size_t kSplitGrainElems = 16384;
// So that every thread's range starts at a GradSumOfSquares block.
static_assert(kSplitGrainElems % kNormBlockElems == 0,
              "thread ranges must be made of whole norm blocks");

const IsaKernels kScalarKernels = {
    "scalar",           &StepRangeScalar, &CastFromFp32Scalar,
    &CastToFp32Scalar,  &SumGradsScalar,  &TouchScalar,
    &GradSquaresScalar, &ReadGradsScalar};

#if defined(__x86_64__)
const IsaKernels kAvx2Kernels = {
    "avx2",          &StepRangeAvx2,   &CastFromFp32Avx2, &CastToFp32Avx2,
    &SumGradsAvx2,   &TouchAvx2,       &GradSquaresAvx2,  &ReadGradsAvx2};
const IsaKernels kAvx512Kernels = {
    "avx512",          &StepRangeAvx512, &CastFromFp32Avx512,
    &CastToFp32Avx512, &SumGradsAvx512,  &TouchAvx512,
    &GradSquaresAvx512, &ReadGradsAvx512};

// F16C from CPUID leaf 1 (ECX bit 29): clang 14's __builtin_cpu_supports
// does not know "f16c" (the fuzz and sanitizer build uses clang).
bool CpuHasF16c() {
  unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
}

// __builtin_cpu_supports also checks that the OS saves the wider registers.
bool CpuRunsAvx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && CpuHasF16c();
}

bool CpuRunsAvx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") &&
         __builtin_cpu_supports("avx512bw");
}
#endif

#if defined(__aarch64__)
// Advanced SIMD is part of the AArch64 base architecture: no run-time check.
// The bandwidth-ceiling loops are the scalar ones (benchmarks run on x86).
const IsaKernels kNeonKernels = {
    "neon",         &StepRangeNeon, &CastFromFp32Neon, &CastToFp32Neon,
    &SumGradsNeon,  &TouchScalar,   &GradSquaresNeon,  &ReadGradsScalar};
#endif

const IsaKernels* ChooseKernels() {
#if defined(__x86_64__)
  if (CpuRunsAvx512()) return &kAvx512Kernels;
  if (CpuRunsAvx2()) return &kAvx2Kernels;
#endif
#if defined(__aarch64__)
  return &kNeonKernels;
#endif
  return &kScalarKernels;
}

absl::Status RunStep(const IsaKernels& kernels, const OptimizerHyper& hyper,
                     const StepInputs& in, size_t num_elems, ChunkState state,
                     void* out, DType out_dtype, ThreadPool* pool) {
  StepArgs args;
  absl::Status status = PrepareStep(hyper, in, state, out, out_dtype, &args);
  if (!status.ok()) return status;
  if (pool == nullptr || pool->num_threads() == 1) {
    kernels.step(args, 0, num_elems);
  } else {
    pool->ParallelFor(num_elems, kSplitGrainElems, [&](size_t begin, size_t end) {
      kernels.step(args, begin, end);
    });
  }
  return absl::OkStatus();
}

absl::StatusOr<double> RunGradSumOfSquares(const IsaKernels& kernels,
                                           const StepInputs& in,
                                           size_t num_elems, ThreadPool* pool) {
  StepArgs args;
  absl::Status status = PrepareGrads("GradSumOfSquares", in, &args);
  if (!status.ok()) return status;
  // One slot per block, so that the ranges of a split write disjoint sums
  // and the sums are added in one fixed order below whatever the split.
  std::vector<double> block_sums((num_elems + kNormBlockElems - 1) / kNormBlockElems);
  if (pool == nullptr || pool->num_threads() == 1) {
    kernels.grad_squares(args, 0, num_elems, block_sums.data());
  } else {
    pool->ParallelFor(num_elems, kSplitGrainElems, [&](size_t begin, size_t end) {
      kernels.grad_squares(args, begin, end, block_sums.data());
    });
  }
  double total = 0.0;
  for (const double block_sum : block_sums) total = total + block_sum;
  return total;
}

}  // namespace

const IsaKernels& ActiveKernels() {
  static const IsaKernels* const kernels = ChooseKernels();
  return *kernels;
}

absl::Status PrepareGrads(absl::string_view caller, const StepInputs& in,
                          StepArgs* args) {
  if (in.grads.empty()) return Invalid("no gradient slots (grads is empty)", caller);
  for (size_t w = 0; w < in.grads.size(); ++w) {
    if (in.grads[w] == nullptr) {
      return Invalid(absl::StrCat("gradient slot of worker rank ", w, " is null"),
                     caller);
    }
  }
  if (!ValidDType(in.grad_dtype)) {
    return Invalid(
        absl::StrCat("invalid grad_dtype ", static_cast<int>(in.grad_dtype)),
        caller);
  }
  if (!std::isfinite(in.grad_scale)) {
    return Invalid(absl::StrCat("grad_scale must be finite, got ", in.grad_scale),
                   caller);
  }
  args->grads = in.grads.data();
  args->num_workers = in.grads.size();
  args->grad_dtype = in.grad_dtype;
  args->grad_scale = in.grad_scale;
  return absl::OkStatus();
}

absl::Status PrepareStep(const OptimizerHyper& hyper, const StepInputs& in,
                         ChunkState state, void* out, DType out_dtype,
                         StepArgs* args) {
  const OptimizerKind kind = hyper.kind;
  if (kind != OptimizerKind::kAdamW && kind != OptimizerKind::kAdam &&
      kind != OptimizerKind::kSgd && kind != OptimizerKind::kLion) {
    return Invalid(absl::StrCat("unknown optimizer kind ",
                                static_cast<int>(kind)));
  }
  absl::Status status = PrepareGrads("FusedStep", in, args);
  if (!status.ok()) return status;
  if (!ValidDType(out_dtype)) {
    return Invalid(absl::StrCat("invalid out_dtype ", static_cast<int>(out_dtype)));
  }
  if (in.step < 1) {
    return Invalid(absl::StrCat("step must be >= 1 (1-based), got ", in.step));
  }
  if (state.master == nullptr) return Invalid("state.master is null");
  status = CheckNonNegativeFinite("lr", hyper.lr);
  if (!status.ok()) return status;
  status = CheckNonNegativeFinite("weight_decay", hyper.weight_decay);
  if (!status.ok()) return status;

  StepConstants& k = args->k;
  k = StepConstants();
  k.kind = kind;
  k.apply_weight_decay = hyper.weight_decay != 0.0f;
  k.lr = hyper.lr;
  k.weight_decay = hyper.weight_decay;
  const double lr = hyper.lr;
  if (kind == OptimizerKind::kSgd) {
    status = CheckNonNegativeFinite("momentum", hyper.momentum);
    if (!status.ok()) return status;
    k.use_momentum = hyper.momentum != 0.0f;
    k.momentum = hyper.momentum;
    if (k.use_momentum && state.m == nullptr) {
      return Invalid("state.m (momentum buffer) is null but momentum != 0");
    }
  } else if (kind == OptimizerKind::kLion) {
    status = CheckBeta("beta1", hyper.beta1);
    if (!status.ok()) return status;
    status = CheckBeta("beta2", hyper.beta2);
    if (!status.ok()) return status;
    if (state.m == nullptr) return Invalid("state.m (Lion moment) is null");
    k.decay_factor = static_cast<float>(1.0 - lr * static_cast<double>(hyper.weight_decay));
    k.beta1 = hyper.beta1;
    k.one_minus_beta1 = static_cast<float>(1.0 - static_cast<double>(hyper.beta1));
    k.beta2 = hyper.beta2;
    k.one_minus_beta2 = static_cast<float>(1.0 - static_cast<double>(hyper.beta2));
  } else {
    status = CheckBeta("beta1", hyper.beta1);
    if (!status.ok()) return status;
    status = CheckBeta("beta2", hyper.beta2);
    if (!status.ok()) return status;
    status = CheckNonNegativeFinite("eps", hyper.eps);
    if (!status.ok()) return status;
    if (state.m == nullptr) return Invalid("state.m (first moment) is null");
    if (state.v == nullptr) return Invalid("state.v (second moment) is null");
    const double beta1 = hyper.beta1;
    const double beta2 = hyper.beta2;
    const double t = static_cast<double>(in.step);
    const double bias_correction1 = 1.0 - std::pow(beta1, t);
    const double bias_correction2 = 1.0 - std::pow(beta2, t);
    k.decay_factor = static_cast<float>(1.0 - lr * static_cast<double>(hyper.weight_decay));
    k.beta1 = hyper.beta1;
    k.one_minus_beta1 = static_cast<float>(1.0 - beta1);
    k.beta2 = hyper.beta2;
    k.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    k.eps = hyper.eps;
    k.step_size = static_cast<float>(lr / bias_correction1);
    k.inv_sqrt_bias_correction2 = static_cast<float>(1.0 / std::sqrt(bias_correction2));
    if (!std::isfinite(k.step_size) || !std::isfinite(k.inv_sqrt_bias_correction2)) {
      return Invalid(absl::StrCat("bias correction underflows at step ", in.step,
                                  " (beta1 ", hyper.beta1, ", beta2 ",
                                  hyper.beta2, ")"));
    }
  }

  args->master = state.master;
  args->m = state.m;
  args->v = state.v;
  args->out = out;
  args->out_dtype = out_dtype;
  return absl::OkStatus();
}

absl::StatusOr<const IsaKernels*> KernelsForIsa(absl::string_view isa) {
  if (isa == "scalar") return &kScalarKernels;
#if defined(__aarch64__)
  if (isa == "neon") return &kNeonKernels;
#endif
#if defined(__x86_64__)
  if (isa == "avx2") {
    if (!CpuRunsAvx2()) return absl::UnavailableError("CPU lacks AVX2/FMA/F16C");
    return &kAvx2Kernels;
  }
  if (isa == "avx512") {
    if (!CpuRunsAvx512()) return absl::UnavailableError("CPU lacks AVX-512 F/BW");
    return &kAvx512Kernels;
  }
#endif
  return absl::NotFoundError(
      absl::StrCat("ISA \"", isa, "\" is not built into this binary"));
}

absl::Status FusedStepWithIsa(absl::string_view isa,
                              const OptimizerHyper& hyper,
                              const StepInputs& in, size_t num_elems,
                              ChunkState state, void* out, DType out_dtype) {
  absl::StatusOr<const IsaKernels*> kernels = KernelsForIsa(isa);
  if (!kernels.ok()) return kernels.status();
  return RunStep(**kernels, hyper, in, num_elems, state, out, out_dtype,
                 /*pool=*/nullptr);
}

absl::StatusOr<double> GradSumOfSquaresWithIsa(absl::string_view isa,
                                               const StepInputs& in,
                                               size_t num_elems,
                                               ThreadPool* pool) {
  absl::StatusOr<const IsaKernels*> kernels = KernelsForIsa(isa);
  if (!kernels.ok()) return kernels.status();
  return RunGradSumOfSquares(**kernels, in, num_elems, pool);
}

}  // namespace internal

absl::Status FusedStep(const OptimizerHyper& hyper, const StepInputs& in,
                       size_t num_elems, ChunkState state, void* out,
                       DType out_dtype) {
  return internal::RunStep(internal::ActiveKernels(), hyper, in, num_elems,
                           state, out, out_dtype, /*pool=*/nullptr);
}

absl::Status FusedStep(const OptimizerHyper& hyper, const StepInputs& in,
                       size_t num_elems, ChunkState state, void* out,
                       DType out_dtype, ThreadPool* pool) {
  return internal::RunStep(internal::ActiveKernels(), hyper, in, num_elems,
                           state, out, out_dtype, pool);
}

absl::Status FusedStepScalar(const OptimizerHyper& hyper, const StepInputs& in,
                             size_t num_elems, ChunkState state, void* out,
                             DType out_dtype) {
  return internal::RunStep(internal::kScalarKernels, hyper, in, num_elems,
                           state, out, out_dtype, /*pool=*/nullptr);
}

absl::StatusOr<double> GradSumOfSquares(const StepInputs& in, size_t num_elems,
                                        ThreadPool* pool) {
  return internal::RunGradSumOfSquares(internal::ActiveKernels(), in, num_elems,
                                       pool);
}

void CastFromFp32(const float* src, size_t num_elems, void* dst,
                  DType dst_dtype) {
  internal::ActiveKernels().cast_from_fp32(src, 0, num_elems, dst, dst_dtype);
}

void CastToFp32(const void* src, DType src_dtype, size_t num_elems,
                float* dst) {
  internal::ActiveKernels().cast_to_fp32(src, src_dtype, 0, num_elems, dst);
}

absl::string_view ActiveIsa() { return internal::ActiveKernels().name; }

}  // namespace kernels
}  // namespace optimus
