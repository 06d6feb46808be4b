// Internal to //kernels/cuda: the plain-C boundary between cuda_kernels.cu
// (built by nvcc, which never sees absl) and cuda_kernels.cc. Functions
// return a cudaError_t value as int (0 = success); cuda_kernels.cc turns it
// into an absl::Status. Thread-safety as the CUDA runtime: any thread.
#ifndef OPTIMUS_KERNELS_CUDA_CUDA_KERNELS_ABI_H_
#define OPTIMUS_KERNELS_CUDA_CUDA_KERNELS_ABI_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// How cuda_kernels.cc should classify an error code.
enum OptimusCudaErrorClass {
  kOptimusCudaOk = 0,
  kOptimusCudaNoDevice = 1,     // no device or no usable driver
  kOptimusCudaOutOfMemory = 2,
  kOptimusCudaInvalidValue = 3,
  kOptimusCudaOther = 4,
};

// dtype values as optimus::DType.
enum { kOptimusCudaFp32 = 1, kOptimusCudaBf16 = 2, kOptimusCudaFp16 = 3 };

// AdamW's per-step constants, derived on the host exactly as the CPU kernel
// derives them (kernels/cpu/optimizer_internal.h StepConstants).
struct OptimusCudaAdamWConstants {
  int apply_weight_decay;
  float decay_factor;
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float step_size;
  float inv_sqrt_bias_correction2;
};

int OptimusCudaClassifyError(int code);
// Static strings owned by the CUDA runtime.
const char* OptimusCudaErrorName(int code);
const char* OptimusCudaErrorString(int code);

int OptimusCudaDeviceCount(int* count);

int OptimusCudaUnscale(void* host_grads, int dtype, size_t num_elems,
                       float inv_scale, int* found_nonfinite,
                       double* sum_squares);

int OptimusCudaAdamWStep(const struct OptimusCudaAdamWConstants* k,
                         float* host_master, float* host_m, float* host_v,
                         const float* host_grad, size_t num_elems);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // OPTIMUS_KERNELS_CUDA_CUDA_KERNELS_ABI_H_
