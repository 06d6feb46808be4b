// Plain C++ reference for the fused step and the casts, one element at a time.
// Built with -ffp-contract=off: every multiply and add rounds separately, in
// the order the vector files use, so they can match it bit for bit.
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "common/dtype.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/optimizer_internal.h"

namespace optimus {
namespace kernels {
namespace internal {
namespace {

float LoadAsFloat(const void* src, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kFp32:
      return static_cast<const float*>(src)[i];
    case DType::kBf16:
      return Bf16ToFloat(static_cast<const uint16_t*>(src)[i]);
    case DType::kFp16:
      return Fp16ToFloat(static_cast<const uint16_t*>(src)[i]);
  }
  return 0.0f;  // unreachable: dtypes are validated by PrepareStep
}

void StoreFromFloat(float value, void* dst, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kFp32:
      static_cast<float*>(dst)[i] = value;
      return;
    case DType::kBf16:
      static_cast<uint16_t*>(dst)[i] = FloatToBf16(value);
      return;
    case DType::kFp16:
      static_cast<uint16_t*>(dst)[i] = FloatToFp16(value);
      return;
  }
}

}  // namespace

void StepRangeScalar(const StepArgs& a, size_t begin, size_t end) {
  const StepConstants& k = a.k;
  for (size_t i = begin; i < end; ++i) {
    // Sum over workers in rank order, then scale.
    float g = LoadAsFloat(a.grads[0], a.grad_dtype, i);
    for (size_t w = 1; w < a.num_workers; ++w) {
      g = g + LoadAsFloat(a.grads[w], a.grad_dtype, i);
    }
    g = g * a.grad_scale;
    float p = a.master[i];

    switch (k.kind) {
      case OptimizerKind::kAdamW:
      case OptimizerKind::kAdam: {
        if (k.apply_weight_decay) {
          if (k.kind == OptimizerKind::kAdamW) {
            p = p * k.decay_factor;  // param.mul_(1 - lr * wd)
          } else {
            g = g + k.weight_decay * p;  // grad.add(param, wd)
          }
        }
        // exp_avg.mul_(b1).add_(g, 1 - b1)
        const float m = a.m[i] * k.beta1 + k.one_minus_beta1 * g;
        // exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2)
        const float v = a.v[i] * k.beta2 + (k.one_minus_beta2 * g) * g;
        // denom = exp_avg_sq.sqrt() / sqrt(bc2) + eps
        const float denom = std::sqrt(v) / k.sqrt_bias_correction2 + k.eps;
        // param.addcdiv_(exp_avg, denom, -step_size)
        p = p - (k.step_size * m) / denom;
        a.m[i] = m;
        a.v[i] = v;
        break;
      }
      case OptimizerKind::kSgd: {
        if (k.apply_weight_decay) g = g + k.weight_decay * p;
        if (k.use_momentum) {
          const float m = a.m[i] * k.momentum + g;
          a.m[i] = m;
          g = m;
        }
        p = p - k.lr * g;
        break;
      }
    }
    a.master[i] = p;
    StoreFromFloat(p, a.out, a.out_dtype, i);
  }
}

void CastFromFp32Scalar(const float* src, size_t begin, size_t end, void* dst,
                        DType dst_dtype) {
  for (size_t i = begin; i < end; ++i) StoreFromFloat(src[i], dst, dst_dtype, i);
}

void CastToFp32Scalar(const void* src, DType src_dtype, size_t begin,
                      size_t end, float* dst) {
  for (size_t i = begin; i < end; ++i) dst[i] = LoadAsFloat(src, src_dtype, i);
}

}  // namespace internal
}  // namespace kernels
}  // namespace optimus
