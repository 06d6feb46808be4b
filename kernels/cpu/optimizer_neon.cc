// AArch64 Advanced SIMD (NEON) versions of the fused step, casts, gradient
// sum and gradient sum of squares, for BlueField's Arm cores: 8 elements per iteration as two float32x4
// vectors. Same operation order as optimizer_scalar.cc and no fused
// multiply-add (-ffp-contract=off; vdivq/vsqrtq round correctly), so results
// are bit-identical to it; tails (< 8 elements) run the scalar code. Advanced
// SIMD is in every AArch64 CPU, so this needs no run-time check. Assumes the
// Linux default FPCR (round to nearest, no flush-to-zero, default-NaN off).
#if defined(__aarch64__)

#include <arm_neon.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/optimizer_internal.h"

namespace optimus {
namespace kernels {
namespace internal {
namespace {

constexpr size_t kLanes = 8;  // two float32x4_t per iteration
constexpr DType kNoOut = static_cast<DType>(0);

struct F32x8 {
  float32x4_t lo, hi;
};

F32x8 HalvesToFloat(uint16x8_t h, DType d) {
  if (d == DType::kBf16) {
    return {vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(h), 16)),
            vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(h), 16))};
  }
  return {vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(h))),
          vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(h)))};
}

template <DType D>
F32x8 Load(const void* src, size_t i) {
  if constexpr (D == DType::kFp32) {
    const float* f = static_cast<const float*>(src) + i;
    return {vld1q_f32(f), vld1q_f32(f + 4)};
  } else {
    return HalvesToFloat(vld1q_u16(static_cast<const uint16_t*>(src) + i), D);
  }
}

// Same rounding as FloatToBf16: round to nearest even, NaN -> quiet NaN.
uint16x4_t ToBf16(float32x4_t x) {
  const uint32x4_t bits = vreinterpretq_u32_f32(x);
  const uint32x4_t high = vshrq_n_u32(bits, 16);
  const uint32x4_t lsb = vandq_u32(high, vdupq_n_u32(1));
  const uint32x4_t rounded =
      vshrq_n_u32(vaddq_u32(vaddq_u32(bits, vdupq_n_u32(0x7fff)), lsb), 16);
  const uint32x4_t quiet_nan = vorrq_u32(high, vdupq_n_u32(0x40));
  const uint32x4_t is_number = vceqq_f32(x, x);
  return vmovn_u32(vbslq_u32(is_number, rounded, quiet_nan));
}

template <DType D>
void Store(const F32x8& x, void* dst, size_t i) {
  if constexpr (D == kNoOut) {
    return;
  } else if constexpr (D == DType::kFp32) {
    float* f = static_cast<float*>(dst) + i;
    vst1q_f32(f, x.lo);
    vst1q_f32(f + 4, x.hi);
  } else if constexpr (D == DType::kBf16) {
    vst1q_u16(static_cast<uint16_t*>(dst) + i,
              vcombine_u16(ToBf16(x.lo), ToBf16(x.hi)));
  } else {
    // FCVTN rounds per FPCR (nearest even) and quiets NaNs keeping the top
    // payload bits, as FloatToFp16 does.
    vst1q_u16(static_cast<uint16_t*>(dst) + i,
              vcombine_u16(vreinterpret_u16_f16(vcvt_f16_f32(x.lo)),
                           vreinterpret_u16_f16(vcvt_f16_f32(x.hi))));
  }
}

// The per-vector update; m_ptr/v_ptr point at this vector's 4 elements.
template <OptimizerKind K>
float32x4_t Update(const StepConstants& k, float32x4_t g, float32x4_t p,
                   float* m_ptr, float* v_ptr) {
  if constexpr (K == OptimizerKind::kSgd) {
    if (k.apply_weight_decay) g = vaddq_f32(g, vmulq_f32(vdupq_n_f32(k.weight_decay), p));
    if (k.use_momentum) {
      const float32x4_t m = vaddq_f32(vmulq_f32(vld1q_f32(m_ptr), vdupq_n_f32(k.momentum)), g);
      vst1q_f32(m_ptr, m);
      g = m;
    }
    return vsubq_f32(p, vmulq_f32(vdupq_n_f32(k.lr), g));
  } else if constexpr (K == OptimizerKind::kLion) {
    if (k.apply_weight_decay) p = vmulq_f32(p, vdupq_n_f32(k.decay_factor));
    const float32x4_t m_old = vld1q_f32(m_ptr);
    const float32x4_t c = vaddq_f32(vmulq_f32(m_old, vdupq_n_f32(k.beta1)),
                                    vmulq_f32(vdupq_n_f32(k.one_minus_beta1), g));
    // sign(c): +1, -1, +0 for zeros, c itself for NaN.
    const float32x4_t zero = vdupq_n_f32(0.0f);
    float32x4_t sign = vbslq_f32(vcgtq_f32(c, zero), vdupq_n_f32(1.0f), zero);
    sign = vbslq_f32(vcltq_f32(c, zero), vdupq_n_f32(-1.0f), sign);
    sign = vbslq_f32(vceqq_f32(c, c), sign, c);
    p = vsubq_f32(p, vmulq_f32(vdupq_n_f32(k.lr), sign));
    vst1q_f32(m_ptr, vaddq_f32(vmulq_f32(m_old, vdupq_n_f32(k.beta2)),
                               vmulq_f32(vdupq_n_f32(k.one_minus_beta2), g)));
    return p;
  } else {
    if (k.apply_weight_decay) {
      if constexpr (K == OptimizerKind::kAdamW) {
        p = vmulq_f32(p, vdupq_n_f32(k.decay_factor));
      } else {
        g = vaddq_f32(g, vmulq_f32(vdupq_n_f32(k.weight_decay), p));
      }
    }
    const float32x4_t m = vaddq_f32(vmulq_f32(vld1q_f32(m_ptr), vdupq_n_f32(k.beta1)),
                                    vmulq_f32(vdupq_n_f32(k.one_minus_beta1), g));
    const float32x4_t v =
        vaddq_f32(vmulq_f32(vld1q_f32(v_ptr), vdupq_n_f32(k.beta2)),
                  vmulq_f32(vmulq_f32(vdupq_n_f32(k.one_minus_beta2), g), g));
    const float32x4_t denom =
        vaddq_f32(vmulq_f32(vsqrtq_f32(v), vdupq_n_f32(k.inv_sqrt_bias_correction2)),
                  vdupq_n_f32(k.eps));
    p = vsubq_f32(p, vdivq_f32(vmulq_f32(vdupq_n_f32(k.step_size), m), denom));
    vst1q_f32(m_ptr, m);
    vst1q_f32(v_ptr, v);
    return p;
  }
}

template <OptimizerKind K, DType G, DType O>
void StepLoop(const StepArgs& a, size_t begin, size_t end) {
  const float32x4_t grad_scale = vdupq_n_f32(a.grad_scale);
  const bool has_v = a.v != nullptr;
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    F32x8 g = Load<G>(a.grads[0], i);
    for (size_t w = 1; w < a.num_workers; ++w) {
      const F32x8 gw = Load<G>(a.grads[w], i);
      g.lo = vaddq_f32(g.lo, gw.lo);
      g.hi = vaddq_f32(g.hi, gw.hi);
    }
    g.lo = vmulq_f32(g.lo, grad_scale);
    g.hi = vmulq_f32(g.hi, grad_scale);
    float* m = a.m == nullptr ? nullptr : a.m + i;
    float* v = has_v ? a.v + i : nullptr;
    F32x8 p = {vld1q_f32(a.master + i), vld1q_f32(a.master + i + 4)};
    p.lo = Update<K>(a.k, g.lo, p.lo, m, v);
    p.hi = Update<K>(a.k, g.hi, p.hi, m == nullptr ? nullptr : m + 4,
                     v == nullptr ? nullptr : v + 4);
    vst1q_f32(a.master + i, p.lo);
    vst1q_f32(a.master + i + 4, p.hi);
    Store<O>(p, a.out, i);
  }
  StepRangeScalar(a, i, end);
}

template <OptimizerKind K, DType G>
void DispatchOut(const StepArgs& a, size_t begin, size_t end) {
  if (a.out == nullptr) return StepLoop<K, G, kNoOut>(a, begin, end);
  switch (a.out_dtype) {
    case DType::kFp32:
      return StepLoop<K, G, DType::kFp32>(a, begin, end);
    case DType::kBf16:
      return StepLoop<K, G, DType::kBf16>(a, begin, end);
    case DType::kFp16:
      return StepLoop<K, G, DType::kFp16>(a, begin, end);
  }
}

template <OptimizerKind K>
void DispatchGrad(const StepArgs& a, size_t begin, size_t end) {
  switch (a.grad_dtype) {
    case DType::kFp32:
      return DispatchOut<K, DType::kFp32>(a, begin, end);
    case DType::kBf16:
      return DispatchOut<K, DType::kBf16>(a, begin, end);
    case DType::kFp16:
      return DispatchOut<K, DType::kFp16>(a, begin, end);
  }
}

template <DType D>
void CastFromLoop(const float* src, size_t begin, size_t end, void* dst) {
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    Store<D>(F32x8{vld1q_f32(src + i), vld1q_f32(src + i + 4)}, dst, i);
  }
  CastFromFp32Scalar(src, i, end, dst, D);
}

template <DType D>
void CastToLoop(const void* src, size_t begin, size_t end, float* dst) {
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    const F32x8 x = Load<D>(src, i);
    vst1q_f32(dst + i, x.lo);
    vst1q_f32(dst + i + 4, x.hi);
  }
  CastToFp32Scalar(src, D, i, end, dst);
}

template <DType G>
void SumLoop(const StepArgs& a, size_t begin, size_t end, float* dst) {
  const float32x4_t grad_scale = vdupq_n_f32(a.grad_scale);
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    F32x8 g = Load<G>(a.grads[0], i);
    for (size_t w = 1; w < a.num_workers; ++w) {
      const F32x8 gw = Load<G>(a.grads[w], i);
      g.lo = vaddq_f32(g.lo, gw.lo);
      g.hi = vaddq_f32(g.hi, gw.hi);
    }
    vst1q_f32(dst + i, vmulq_f32(g.lo, grad_scale));
    vst1q_f32(dst + i + 4, vmulq_f32(g.hi, grad_scale));
  }
  SumGradsScalar(a, i, end, dst);
}

// Squares of the 8 fp32 values of g added, in double, to acc[0..3] (lanes
// 0-1, 2-3, 4-5, 6-7 of g).
void AddSquares(const F32x8& g, float64x2_t* acc) {
  const float64x2_t d0 = vcvt_f64_f32(vget_low_f32(g.lo));
  const float64x2_t d1 = vcvt_high_f64_f32(g.lo);
  const float64x2_t d2 = vcvt_f64_f32(vget_low_f32(g.hi));
  const float64x2_t d3 = vcvt_high_f64_f32(g.hi);
  acc[0] = vaddq_f64(acc[0], vmulq_f64(d0, d0));
  acc[1] = vaddq_f64(acc[1], vmulq_f64(d1, d1));
  acc[2] = vaddq_f64(acc[2], vmulq_f64(d2, d2));
  acc[3] = vaddq_f64(acc[3], vmulq_f64(d3, d3));
}

// The reduction of kNormBlockElems/kNormLanes (optimizer_internal.h): each
// group of 32 elements is 4 F32x8 whose squares go to lanes 0-31 in 16
// accumulators; the lanes go through FinishNormBlock with the block's tail.
template <DType G>
void GradSquaresLoop(const StepArgs& a, size_t begin, size_t end, double* block_sums) {
  static_assert(kNormLanes == 4 * kLanes, "one group is 4 F32x8");
  const float32x4_t grad_scale = vdupq_n_f32(a.grad_scale);
  for (size_t block = begin; block < end; block += kNormBlockElems) {
    const size_t block_end = end - block < kNormBlockElems ? end : block + kNormBlockElems;
    float64x2_t acc[kNormLanes / 2];
    for (float64x2_t& x : acc) x = vdupq_n_f64(0.0);
    size_t i = block;
    for (; i + kNormLanes <= block_end; i += kNormLanes) {
      F32x8 g[4];
      for (size_t k = 0; k < 4; ++k) g[k] = Load<G>(a.grads[0], i + k * kLanes);
      for (size_t w = 1; w < a.num_workers; ++w) {
        for (size_t k = 0; k < 4; ++k) {
          const F32x8 gw = Load<G>(a.grads[w], i + k * kLanes);
          g[k].lo = vaddq_f32(g[k].lo, gw.lo);
          g[k].hi = vaddq_f32(g[k].hi, gw.hi);
        }
      }
      for (size_t k = 0; k < 4; ++k) {
        g[k].lo = vmulq_f32(g[k].lo, grad_scale);
        g[k].hi = vmulq_f32(g[k].hi, grad_scale);
        AddSquares(g[k], acc + 4 * k);
      }
    }
    double lanes[kNormLanes];
    for (size_t k = 0; k < kNormLanes / 2; ++k) vst1q_f64(lanes + 2 * k, acc[k]);
    block_sums[block / kNormBlockElems] = FinishNormBlock(a, block, i, block_end, lanes);
  }
}

}  // namespace

void StepRangeNeon(const StepArgs& a, size_t begin, size_t end) {
  switch (a.k.kind) {
    case OptimizerKind::kAdamW:
      return DispatchGrad<OptimizerKind::kAdamW>(a, begin, end);
    case OptimizerKind::kAdam:
      return DispatchGrad<OptimizerKind::kAdam>(a, begin, end);
    case OptimizerKind::kSgd:
      return DispatchGrad<OptimizerKind::kSgd>(a, begin, end);
    case OptimizerKind::kLion:
      return DispatchGrad<OptimizerKind::kLion>(a, begin, end);
  }
}

void CastFromFp32Neon(const float* src, size_t begin, size_t end, void* dst,
                      DType dst_dtype) {
  switch (dst_dtype) {
    case DType::kFp32:
      return CastFromLoop<DType::kFp32>(src, begin, end, dst);
    case DType::kBf16:
      return CastFromLoop<DType::kBf16>(src, begin, end, dst);
    case DType::kFp16:
      return CastFromLoop<DType::kFp16>(src, begin, end, dst);
  }
}

void CastToFp32Neon(const void* src, DType src_dtype, size_t begin, size_t end,
                    float* dst) {
  switch (src_dtype) {
    case DType::kFp32:
      return CastToLoop<DType::kFp32>(src, begin, end, dst);
    case DType::kBf16:
      return CastToLoop<DType::kBf16>(src, begin, end, dst);
    case DType::kFp16:
      return CastToLoop<DType::kFp16>(src, begin, end, dst);
  }
}

void SumGradsNeon(const StepArgs& a, size_t begin, size_t end, float* dst) {
  switch (a.grad_dtype) {
    case DType::kFp32:
      return SumLoop<DType::kFp32>(a, begin, end, dst);
    case DType::kBf16:
      return SumLoop<DType::kBf16>(a, begin, end, dst);
    case DType::kFp16:
      return SumLoop<DType::kFp16>(a, begin, end, dst);
  }
}

void GradSquaresNeon(const StepArgs& a, size_t begin, size_t end, double* block_sums) {
  switch (a.grad_dtype) {
    case DType::kFp32:
      return GradSquaresLoop<DType::kFp32>(a, begin, end, block_sums);
    case DType::kBf16:
      return GradSquaresLoop<DType::kBf16>(a, begin, end, block_sums);
    case DType::kFp16:
      return GradSquaresLoop<DType::kFp16>(a, begin, end, block_sums);
  }
}

}  // namespace internal
}  // namespace kernels
}  // namespace optimus

#endif  // defined(__aarch64__)
