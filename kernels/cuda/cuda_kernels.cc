// absl::Status face of cuda_kernels.cu. This file holds the one converter
// from CUDA runtime error codes to absl::Status for the kernels layer.
#include "kernels/cuda/cuda_kernels.h"

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/optimizer_internal.h"
#include "kernels/cuda/cuda_kernels_abi.h"

namespace optimus {
namespace kernels {
namespace {

// Converts a cudaError_t (as int) from `what` into a Status.
absl::Status CudaStatus(int code, absl::string_view what) {
  if (code == 0) return absl::OkStatus();
  const std::string message =
      absl::StrCat(what, ": ", OptimusCudaErrorName(code), " (", code,
                   "): ", OptimusCudaErrorString(code));
  switch (OptimusCudaClassifyError(code)) {
    case kOptimusCudaNoDevice:
      return absl::FailedPreconditionError(message);
    case kOptimusCudaOutOfMemory:
      return absl::ResourceExhaustedError(message);
    case kOptimusCudaInvalidValue:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace

absl::Status CudaAvailable() {
  int count = 0;
  const int code = OptimusCudaDeviceCount(&count);
  if (code != 0) {
    // Any failure to enumerate devices means this process cannot use CUDA.
    return absl::FailedPreconditionError(
        absl::StrCat("no usable CUDA device: cudaGetDeviceCount failed with ",
                     OptimusCudaErrorName(code), ": ",
                     OptimusCudaErrorString(code)));
  }
  if (count == 0) {
    return absl::FailedPreconditionError("no CUDA device: cudaGetDeviceCount returned 0");
  }
  return absl::OkStatus();
}

absl::StatusOr<GradStats> UnscaleGrads(void* grads, DType dtype,
                                       size_t num_elems, float inv_scale) {
  if (dtype != DType::kFp32 && dtype != DType::kBf16 && dtype != DType::kFp16) {
    return absl::InvalidArgumentError(
        absl::StrCat("UnscaleGrads: invalid dtype ", static_cast<int>(dtype)));
  }
  if (grads == nullptr) return absl::InvalidArgumentError("UnscaleGrads: grads is null");
  if (!std::isfinite(inv_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("UnscaleGrads: inv_scale must be finite, got ", inv_scale));
  }
  absl::Status status = CudaAvailable();
  if (!status.ok()) return status;
  int found_nonfinite = 0;
  GradStats stats;
  status = CudaStatus(
      OptimusCudaUnscale(grads, static_cast<int>(dtype), num_elems, inv_scale,
                         &found_nonfinite, &stats.sum_squares),
      "UnscaleGrads");
  if (!status.ok()) return status;
  stats.found_nonfinite = found_nonfinite != 0;
  return stats;
}

absl::Status AdamWStepCuda(const OptimizerHyper& hyper, int64_t step,
                           float* master, float* m, float* v,
                           const float* grad, size_t num_elems) {
  if (hyper.kind != OptimizerKind::kAdamW) {
    return absl::InvalidArgumentError("AdamWStepCuda: hyper.kind must be kAdamW");
  }
  // Validate and derive the constants exactly as the CPU kernel does.
  const void* slots[] = {grad};
  StepInputs in;
  in.grads = slots;
  in.grad_dtype = DType::kFp32;
  in.grad_scale = 1.0f;
  in.step = step;
  internal::StepArgs args;
  absl::Status status = internal::PrepareStep(
      hyper, in, ChunkState{master, m, v}, master, DType::kFp32, &args);
  if (!status.ok()) return status;
  status = CudaAvailable();
  if (!status.ok()) return status;

  OptimusCudaAdamWConstants k;
  k.apply_weight_decay = args.k.apply_weight_decay ? 1 : 0;
  k.decay_factor = args.k.decay_factor;
  k.beta1 = args.k.beta1;
  k.one_minus_beta1 = args.k.one_minus_beta1;
  k.beta2 = args.k.beta2;
  k.one_minus_beta2 = args.k.one_minus_beta2;
  k.eps = args.k.eps;
  k.step_size = args.k.step_size;
  k.inv_sqrt_bias_correction2 = args.k.inv_sqrt_bias_correction2;
  return CudaStatus(OptimusCudaAdamWStep(&k, master, m, v, grad, num_elems),
                    "AdamWStepCuda");
}

}  // namespace kernels
}  // namespace optimus
