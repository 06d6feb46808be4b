// Plain C++ reference for the fused step and the casts, one element at a time.
// Built with -ffp-contract=off: every multiply and add rounds separately, in
// the order the vector files use, so they can match it bit for bit.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

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

// The gradient FusedStep applies to element i: the slots summed in rank
// order in fp32, then scaled (as in StepRangeScalar).
float GradAt(const StepArgs& a, size_t i) {
  float g = LoadAsFloat(a.grads[0], a.grad_dtype, i);
  for (size_t w = 1; w < a.num_workers; ++w) {
    g = g + LoadAsFloat(a.grads[w], a.grad_dtype, i);
  }
  return g * a.grad_scale;
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

// torch.sign: +1, -1, 0 for either zero (as +0), NaN stays NaN.
float Sign(float c) {
  if (c > 0.0f) return 1.0f;
  if (c < 0.0f) return -1.0f;
  return c == c ? 0.0f : c;
}

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
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
        // denom = exp_avg_sq.sqrt() / sqrt(bc2) + eps (times the reciprocal:
        // see StepConstants)
        const float denom = std::sqrt(v) * k.inv_sqrt_bias_correction2 + k.eps;
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
      case OptimizerKind::kLion: {
        if (k.apply_weight_decay) p = p * k.decay_factor;
        const float m_old = a.m[i];
        // c = exp_avg * b1 + (1 - b1) * g; p -= lr * sign(c)
        const float c = m_old * k.beta1 + k.one_minus_beta1 * g;
        p = p - k.lr * Sign(c);
        // exp_avg.mul_(b2).add_(g, 1 - b2)
        a.m[i] = m_old * k.beta2 + k.one_minus_beta2 * g;
        break;
      }
    }
    a.master[i] = p;
    if (a.out != nullptr) StoreFromFloat(p, a.out, a.out_dtype, i);
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

void SumGradsScalar(const StepArgs& a, size_t begin, size_t end, float* dst) {
  for (size_t i = begin; i < end; ++i) {
    float g = LoadAsFloat(a.grads[0], a.grad_dtype, i);
    for (size_t w = 1; w < a.num_workers; ++w) {
      g = g + LoadAsFloat(a.grads[w], a.grad_dtype, i);
    }
    dst[i] = g * a.grad_scale;
  }
}

void TouchScalar(const StepArgs& a, uint32_t grad_mask, size_t begin,
                 size_t end) {
  const bool half = a.grad_dtype != DType::kFp32;
  for (size_t i = begin; i < end; ++i) {
    uint32_t g = 0;
    for (size_t w = 0; w < a.num_workers; ++w) {
      g |= half ? static_cast<const uint16_t*>(a.grads[w])[i]
                : static_cast<const uint32_t*>(a.grads[w])[i];
    }
    g &= grad_mask;
    const float p = FromBits(Bits(a.master[i]) | g);
    a.master[i] = p;
    if (a.m != nullptr) a.m[i] = FromBits(Bits(a.m[i]) | g);
    if (a.v != nullptr) a.v[i] = FromBits(Bits(a.v[i]) | g);
    if (a.out == nullptr) continue;
    if (a.out_dtype == DType::kFp32) {
      static_cast<float*>(a.out)[i] = p;
    } else {
      static_cast<uint16_t*>(a.out)[i] = static_cast<uint16_t>(Bits(p));
    }
  }
}

double FinishNormBlock(const StepArgs& a, size_t block_begin, size_t i,
                       size_t block_end, double* lanes) {
  for (; i < block_end; ++i) {
    const double g = GradAt(a, i);
    double& lane = lanes[(i - block_begin) % kNormLanes];
    lane = lane + g * g;
  }
  for (size_t half = kNormLanes / 2; half > 0; half /= 2) {
    for (size_t j = 0; j < half; ++j) lanes[j] = lanes[j] + lanes[j + half];
  }
  return lanes[0];
}

void GradSquaresScalar(const StepArgs& a, size_t begin, size_t end,
                       double* block_sums) {
  for (size_t block = begin; block < end; block += kNormBlockElems) {
    const size_t block_end = end - block < kNormBlockElems ? end : block + kNormBlockElems;
    double lanes[kNormLanes] = {};
    block_sums[block / kNormBlockElems] = FinishNormBlock(a, block, block, block_end, lanes);
  }
}

uint32_t ReadGradsScalar(const StepArgs& a, size_t begin, size_t end) {
  const bool half = a.grad_dtype != DType::kFp32;
  uint32_t bits = 0;
  for (size_t i = begin; i < end; ++i) {
    for (size_t w = 0; w < a.num_workers; ++w) {
      bits |= half ? static_cast<const uint16_t*>(a.grads[w])[i]
                   : static_cast<const uint32_t*>(a.grads[w])[i];
    }
  }
  return bits;
}

}  // namespace internal
}  // namespace kernels
}  // namespace optimus
