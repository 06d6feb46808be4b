// AVX-512 (F + BW) versions of the fused step and casts, 16 floats at a time.
// Same operation order as optimizer_scalar.cc and no fused multiply-add, so
// results are bit-identical to it; the tail (< 16 elements) runs the scalar
// code. Compiled with -mavx512f -mavx512bw: only reached after run-time
// dispatch has checked the CPU, and it calls no inline header functions (see
// optimizer_internal.h).
#if defined(__x86_64__)

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/optimizer_internal.h"

namespace optimus {
namespace kernels {
namespace internal {
namespace {

constexpr size_t kLanes = 16;  // floats per __m512

template <DType D>
__m512 Load(const void* src, size_t i) {
  if constexpr (D == DType::kFp32) {
    return _mm512_loadu_ps(static_cast<const float*>(src) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        static_cast<const uint16_t*>(src) + i));
    if constexpr (D == DType::kBf16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// Same rounding as FloatToBf16: round to nearest even, NaN -> quiet NaN.
__m256i ToBf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i high = _mm512_srli_epi32(bits, 16);
  const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __m512i quiet_nan = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
  const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  const __m512i result = _mm512_mask_blend_epi32(is_nan, rounded, quiet_nan);
  return _mm512_cvtepi32_epi16(result);  // values fit: plain truncation
}

template <DType D>
void Store(__m512 x, void* dst, size_t i) {
  if constexpr (D == DType::kFp32) {
    _mm512_storeu_ps(static_cast<float*>(dst) + i, x);
  } else {
    __m256i h;
    if constexpr (D == DType::kBf16) {
      h = ToBf16(x);
    } else {
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);  // RNE, as FloatToFp16
    }
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(static_cast<uint16_t*>(dst) + i), h);
  }
}

template <OptimizerKind K, DType G, DType O>
void StepLoop(const StepArgs& a, size_t begin, size_t end) {
  const StepConstants& k = a.k;
  const __m512 grad_scale = _mm512_set1_ps(a.grad_scale);
  const __m512 weight_decay = _mm512_set1_ps(k.weight_decay);
  const __m512 decay_factor = _mm512_set1_ps(k.decay_factor);
  const __m512 beta1 = _mm512_set1_ps(k.beta1);
  const __m512 one_minus_beta1 = _mm512_set1_ps(k.one_minus_beta1);
  const __m512 beta2 = _mm512_set1_ps(k.beta2);
  const __m512 one_minus_beta2 = _mm512_set1_ps(k.one_minus_beta2);
  const __m512 eps = _mm512_set1_ps(k.eps);
  const __m512 step_size = _mm512_set1_ps(k.step_size);
  const __m512 sqrt_bc2 = _mm512_set1_ps(k.sqrt_bias_correction2);
  const __m512 momentum = _mm512_set1_ps(k.momentum);
  const __m512 lr = _mm512_set1_ps(k.lr);

  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    __m512 g = Load<G>(a.grads[0], i);
    for (size_t w = 1; w < a.num_workers; ++w) {
      g = _mm512_add_ps(g, Load<G>(a.grads[w], i));
    }
    g = _mm512_mul_ps(g, grad_scale);
    __m512 p = _mm512_loadu_ps(a.master + i);
    if constexpr (K == OptimizerKind::kSgd) {
      if (k.apply_weight_decay) g = _mm512_add_ps(g, _mm512_mul_ps(weight_decay, p));
      if (k.use_momentum) {
        const __m512 m = _mm512_add_ps(
            _mm512_mul_ps(_mm512_loadu_ps(a.m + i), momentum), g);
        _mm512_storeu_ps(a.m + i, m);
        g = m;
      }
      p = _mm512_sub_ps(p, _mm512_mul_ps(lr, g));
    } else {
      if (k.apply_weight_decay) {
        if constexpr (K == OptimizerKind::kAdamW) {
          p = _mm512_mul_ps(p, decay_factor);
        } else {
          g = _mm512_add_ps(g, _mm512_mul_ps(weight_decay, p));
        }
      }
      const __m512 m = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(a.m + i), beta1),
                                     _mm512_mul_ps(one_minus_beta1, g));
      const __m512 v = _mm512_add_ps(
          _mm512_mul_ps(_mm512_loadu_ps(a.v + i), beta2),
          _mm512_mul_ps(_mm512_mul_ps(one_minus_beta2, g), g));
      const __m512 denom =
          _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), sqrt_bc2), eps);
      p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(step_size, m), denom));
      _mm512_storeu_ps(a.m + i, m);
      _mm512_storeu_ps(a.v + i, v);
    }
    _mm512_storeu_ps(a.master + i, p);
    Store<O>(p, a.out, i);
  }
  StepRangeScalar(a, i, end);
}

template <OptimizerKind K, DType G>
void DispatchOut(const StepArgs& a, size_t begin, size_t end) {
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
  for (; i + kLanes <= end; i += kLanes) Store<D>(_mm512_loadu_ps(src + i), dst, i);
  CastFromFp32Scalar(src, i, end, dst, D);
}

template <DType D>
void CastToLoop(const void* src, size_t begin, size_t end, float* dst) {
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) _mm512_storeu_ps(dst + i, Load<D>(src, i));
  CastToFp32Scalar(src, D, i, end, dst);
}

}  // namespace

void StepRangeAvx512(const StepArgs& a, size_t begin, size_t end) {
  switch (a.k.kind) {
    case OptimizerKind::kAdamW:
      return DispatchGrad<OptimizerKind::kAdamW>(a, begin, end);
    case OptimizerKind::kAdam:
      return DispatchGrad<OptimizerKind::kAdam>(a, begin, end);
    case OptimizerKind::kSgd:
      return DispatchGrad<OptimizerKind::kSgd>(a, begin, end);
  }
}

void CastFromFp32Avx512(const float* src, size_t begin, size_t end, void* dst,
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

void CastToFp32Avx512(const void* src, DType src_dtype, size_t begin, size_t end,
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

}  // namespace internal
}  // namespace kernels
}  // namespace optimus

#endif  // defined(__x86_64__)
