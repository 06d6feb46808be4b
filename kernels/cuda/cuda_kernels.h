// GPU kernels for the optimizer path: unscaling gradients with a nonfinite
// check and sum of squares (for loss scaling and global-norm clipping), and
// an AdamW step that is bit-identical to the CPU scalar kernel. The API is
// host-facing: callers pass host buffers, which are borrowed for the call
// only; each call copies them to the device, runs, and copies results back
// (bring-up and test API: it allocates device memory per call). Calls are
// synchronous and safe from any thread on disjoint buffers.
#ifndef OPTIMUS_KERNELS_CUDA_CUDA_KERNELS_H_
#define OPTIMUS_KERNELS_CUDA_CUDA_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/dtype.h"
#include "kernels/cpu/optimizer.h"

namespace optimus {
namespace kernels {

// OK when at least one CUDA device is usable; FailedPrecondition (with the
// CUDA runtime's message) when there is no device or no usable driver.
absl::Status CudaAvailable();

struct GradStats {
  // True if any input value, or any value after scaling, is inf or NaN.
  bool found_nonfinite = false;
  // Sum over elements of the squared unscaled values (as stored back in
  // `dtype`), accumulated in fp64 in a fixed order; meaningless (inf/NaN)
  // when found_nonfinite.
  double sum_squares = 0.0;
};

// Multiplies num_elems values of `dtype` in the host buffer `grads` by
// inv_scale in fp32 and stores them back in place, rounded to nearest even.
// InvalidArgument for a bad dtype, null grads or non-finite inv_scale;
// FailedPrecondition without a device; ResourceExhausted when device memory
// runs out; Internal for other CUDA errors. `grads` is unchanged on error.
absl::StatusOr<GradStats> UnscaleGrads(void* grads, DType dtype,
                                       size_t num_elems, float inv_scale);

// One AdamW step (hyper.kind must be kAdamW) on host fp32 buffers of
// num_elems elements, with the same constants and operation order as
// FusedStepScalar with one worker and grad_scale 1: master, m and v are
// updated in place and match it bit for bit. `step` is 1-based. Errors as
// FusedStep plus those of UnscaleGrads; buffers are unchanged on error.
absl::Status AdamWStepCuda(const OptimizerHyper& hyper, int64_t step,
                           float* master, float* m, float* v,
                           const float* grad, size_t num_elems);

}  // namespace kernels
}  // namespace optimus

#endif  // OPTIMUS_KERNELS_CUDA_CUDA_KERNELS_H_
