// CUDA kernels behind cuda_kernels.h, exported as plain-C functions (see
// cuda_kernels_abi.h). Built by nvcc with -fmad=false: no multiply-add is
// fused, so the AdamW kernel rounds exactly like the CPU scalar kernel
// (IEEE division and square root are nvcc's defaults).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/cuda/cuda_kernels_abi.h"

namespace {

constexpr int kThreadsPerBlock = 256;
// Enough blocks to fill an H100 (132 SMs x 8 resident blocks of 256 threads
// at most) several times over; the grid-stride loops cover the rest. Fixed,
// so that the per-block partial sums, and thus sum_squares, are
// deterministic for a given num_elems.
constexpr size_t kMaxBlocks = 4096;

int NumBlocks(size_t num_elems) {
  size_t blocks = (num_elems + kThreadsPerBlock - 1) / kThreadsPerBlock;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  if (blocks == 0) blocks = 1;
  return static_cast<int>(blocks);
}

// Frees a device allocation on every return path.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  cudaError_t Allocate(size_t size_bytes) { return cudaMalloc(&ptr_, size_bytes); }
  template <typename T>
  T* get() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

__device__ float LoadAsFloat(const void* data, int dtype, size_t i) {
  if (dtype == kOptimusCudaFp32) return static_cast<const float*>(data)[i];
  const uint16_t h = static_cast<const uint16_t*>(data)[i];
  if (dtype == kOptimusCudaBf16) return __uint_as_float(static_cast<uint32_t>(h) << 16);
  return __half2float(__ushort_as_half(h));
}

// Same rounding and NaN handling as optimus::FloatToBf16 / FloatToFp16.
__device__ uint16_t FloatToBf16Bits(float f) {
  const uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

__device__ uint16_t FloatToFp16Bits(float f) {
  const uint32_t bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>(((bits >> 16) & 0x8000u) | 0x7e00u | ((bits >> 13) & 0x03ffu));
  }
  return __half_as_ushort(__float2half_rn(f));
}

// Stores f as `dtype` and returns the value actually stored, as float.
__device__ float StoreFromFloat(float f, void* data, int dtype, size_t i) {
  if (dtype == kOptimusCudaFp32) {
    static_cast<float*>(data)[i] = f;
    return f;
  }
  uint16_t h;
  float stored;
  if (dtype == kOptimusCudaBf16) {
    h = FloatToBf16Bits(f);
    stored = __uint_as_float(static_cast<uint32_t>(h) << 16);
  } else {
    h = FloatToFp16Bits(f);
    stored = __half2float(__ushort_as_half(h));
  }
  static_cast<uint16_t*>(data)[i] = h;
  return stored;
}

__global__ void UnscaleKernel(void* data, int dtype, size_t num_elems, float inv_scale,
                              int* found_nonfinite, double* block_sums) {
  __shared__ double partial[kThreadsPerBlock];
  double local = 0.0;
  bool bad = false;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_elems;
       i += stride) {
    const float x = LoadAsFloat(data, dtype, i);
    const float y = x * inv_scale;
    const float stored = StoreFromFloat(y, data, dtype, i);
    if (!isfinite(x) || !isfinite(stored)) bad = true;
    local += static_cast<double>(stored) * static_cast<double>(stored);
  }
  if (bad) atomicExch(found_nonfinite, 1);
  partial[threadIdx.x] = local;
  __syncthreads();
  for (int half = kThreadsPerBlock / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) block_sums[blockIdx.x] = partial[0];
}

// Same operations, in the same order, as StepRangeScalar's AdamW branch.
__global__ void AdamWKernel(OptimusCudaAdamWConstants k, float* master, float* m, float* v,
                            const float* grad, size_t num_elems) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_elems;
       i += stride) {
    const float g = grad[i];
    float p = master[i];
    if (k.apply_weight_decay) p = p * k.decay_factor;
    const float mi = m[i] * k.beta1 + k.one_minus_beta1 * g;
    const float vi = v[i] * k.beta2 + (k.one_minus_beta2 * g) * g;
    const float denom = sqrtf(vi) * k.inv_sqrt_bias_correction2 + k.eps;
    p = p - (k.step_size * mi) / denom;
    m[i] = mi;
    v[i] = vi;
    master[i] = p;
  }
}

#define OPTIMUS_CUDA_RETURN_IF_ERROR(expr) \
  do {                                     \
    const cudaError_t err_ = (expr);       \
    if (err_ != cudaSuccess) return static_cast<int>(err_); \
  } while (0)

}  // namespace

extern "C" {

int OptimusCudaClassifyError(int code) {
  switch (static_cast<cudaError_t>(code)) {
    case cudaSuccess:
      return kOptimusCudaOk;
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInitializationError:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return kOptimusCudaNoDevice;
    case cudaErrorMemoryAllocation:
      return kOptimusCudaOutOfMemory;
    case cudaErrorInvalidValue:
      return kOptimusCudaInvalidValue;
    default:
      return kOptimusCudaOther;
  }
}

const char* OptimusCudaErrorName(int code) {
  return cudaGetErrorName(static_cast<cudaError_t>(code));
}

const char* OptimusCudaErrorString(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

int OptimusCudaDeviceCount(int* count) {
  *count = 0;
  return static_cast<int>(cudaGetDeviceCount(count));
}

int OptimusCudaUnscale(void* host_grads, int dtype, size_t num_elems, float inv_scale,
                       int* found_nonfinite, double* sum_squares) {
  *found_nonfinite = 0;
  *sum_squares = 0.0;
  if (num_elems == 0) return 0;
  const size_t elem_bytes = dtype == kOptimusCudaFp32 ? 4 : 2;
  const size_t size_bytes = num_elems * elem_bytes;
  const int blocks = NumBlocks(num_elems);
  DeviceBuffer data, flag, sums;
  OPTIMUS_CUDA_RETURN_IF_ERROR(data.Allocate(size_bytes));
  OPTIMUS_CUDA_RETURN_IF_ERROR(flag.Allocate(sizeof(int)));
  OPTIMUS_CUDA_RETURN_IF_ERROR(sums.Allocate(blocks * sizeof(double)));
  OPTIMUS_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(data.get<void>(), host_grads, size_bytes, cudaMemcpyHostToDevice));
  OPTIMUS_CUDA_RETURN_IF_ERROR(cudaMemset(flag.get<int>(), 0, sizeof(int)));
  UnscaleKernel<<<blocks, kThreadsPerBlock>>>(data.get<void>(), dtype, num_elems, inv_scale,
                                              flag.get<int>(), sums.get<double>());
  OPTIMUS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  std::vector<double> block_sums(blocks);
  int flag_host = 0;
  OPTIMUS_CUDA_RETURN_IF_ERROR(cudaMemcpy(block_sums.data(), sums.get<double>(),
                                          blocks * sizeof(double), cudaMemcpyDeviceToHost));
  OPTIMUS_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(&flag_host, flag.get<int>(), sizeof(int), cudaMemcpyDeviceToHost));
  OPTIMUS_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(host_grads, data.get<void>(), size_bytes, cudaMemcpyDeviceToHost));
  double total = 0.0;
  for (double s : block_sums) total += s;  // block order: deterministic
  *found_nonfinite = flag_host;
  *sum_squares = total;
  return 0;
}

int OptimusCudaAdamWStep(const OptimusCudaAdamWConstants* k, float* host_master, float* host_m,
                         float* host_v, const float* host_grad, size_t num_elems) {
  if (num_elems == 0) return 0;
  const size_t size_bytes = num_elems * sizeof(float);
  DeviceBuffer master, m, v, grad;
  OPTIMUS_CUDA_RETURN_IF_ERROR(master.Allocate(size_bytes));
  OPTIMUS_CUDA_RETURN_IF_ERROR(m.Allocate(size_bytes));
  OPTIMUS_CUDA_RETURN_IF_ERROR(v.Allocate(size_bytes));
  OPTIMUS_CUDA_RETURN_IF_ERROR(grad.Allocate(size_bytes));
  OPTIMUS_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(master.get<float>(), host_master, size_bytes, cudaMemcpyHostToDevice));
  OPTIMUS_CUDA_RETURN_IF_ERROR(cudaMemcpy(m.get<float>(), host_m, size_bytes, cudaMemcpyHostToDevice));
  OPTIMUS_CUDA_RETURN_IF_ERROR(cudaMemcpy(v.get<float>(), host_v, size_bytes, cudaMemcpyHostToDevice));
  OPTIMUS_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(grad.get<float>(), host_grad, size_bytes, cudaMemcpyHostToDevice));
  AdamWKernel<<<NumBlocks(num_elems), kThreadsPerBlock>>>(*k, master.get<float>(), m.get<float>(),
                                                          v.get<float>(), grad.get<float>(),
                                                          num_elems);
  OPTIMUS_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  OPTIMUS_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  OPTIMUS_CUDA_RETURN_IF_ERROR(
      cudaMemcpy(host_master, master.get<float>(), size_bytes, cudaMemcpyDeviceToHost));
  OPTIMUS_CUDA_RETURN_IF_ERROR(cudaMemcpy(host_m, m.get<float>(), size_bytes, cudaMemcpyDeviceToHost));
  OPTIMUS_CUDA_RETURN_IF_ERROR(cudaMemcpy(host_v, v.get<float>(), size_bytes, cudaMemcpyDeviceToHost));
  return 0;
}

}  // extern "C"
