// AVX2 + FMA + F16C versions of the fused step and casts, 8 floats at a time.
// Same operation order as optimizer_scalar.cc and no fused multiply-add, so
// results are bit-identical to it; the tail (< 8 elements) runs the scalar
// code. Compiled with -mavx2 -mfma -mf16c: only reached after run-time
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

constexpr size_t kLanes = 8;  // floats per __m256

template <DType D>
__m256 Load(const void* src, size_t i) {
  if constexpr (D == DType::kFp32) {
    return _mm256_loadu_ps(static_cast<const float*>(src) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
        static_cast<const uint16_t*>(src) + i));
    if constexpr (D == DType::kBf16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// Same rounding as FloatToBf16: round to nearest even, NaN -> quiet NaN.
__m128i ToBf16(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i high = _mm256_srli_epi32(bits, 16);
  const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i result = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
  // packus works within 128-bit lanes; gather the two useful quarters.
  const __m256i packed = _mm256_packus_epi32(result, result);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xD8));
}

template <DType D>
void Store(__m256 x, void* dst, size_t i) {
  if constexpr (D == DType::kFp32) {
    _mm256_storeu_ps(static_cast<float*>(dst) + i, x);
  } else {
    __m128i h;
    if constexpr (D == DType::kBf16) {
      h = ToBf16(x);
    } else {
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);  // RNE, as FloatToFp16
    }
    _mm_storeu_si128(
        reinterpret_cast<__m128i*>(static_cast<uint16_t*>(dst) + i), h);
  }
}

template <OptimizerKind K, DType G, DType O>
void StepLoop(const StepArgs& a, size_t begin, size_t end) {
  const StepConstants& k = a.k;
  const __m256 grad_scale = _mm256_set1_ps(a.grad_scale);
  const __m256 weight_decay = _mm256_set1_ps(k.weight_decay);
  const __m256 decay_factor = _mm256_set1_ps(k.decay_factor);
  const __m256 beta1 = _mm256_set1_ps(k.beta1);
  const __m256 one_minus_beta1 = _mm256_set1_ps(k.one_minus_beta1);
  const __m256 beta2 = _mm256_set1_ps(k.beta2);
  const __m256 one_minus_beta2 = _mm256_set1_ps(k.one_minus_beta2);
  const __m256 eps = _mm256_set1_ps(k.eps);
  const __m256 step_size = _mm256_set1_ps(k.step_size);
  const __m256 sqrt_bc2 = _mm256_set1_ps(k.sqrt_bias_correction2);
  const __m256 momentum = _mm256_set1_ps(k.momentum);
  const __m256 lr = _mm256_set1_ps(k.lr);

  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    __m256 g = Load<G>(a.grads[0], i);
    for (size_t w = 1; w < a.num_workers; ++w) {
      g = _mm256_add_ps(g, Load<G>(a.grads[w], i));
    }
    g = _mm256_mul_ps(g, grad_scale);
    __m256 p = _mm256_loadu_ps(a.master + i);
    if constexpr (K == OptimizerKind::kSgd) {
      if (k.apply_weight_decay) g = _mm256_add_ps(g, _mm256_mul_ps(weight_decay, p));
      if (k.use_momentum) {
        const __m256 m = _mm256_add_ps(
            _mm256_mul_ps(_mm256_loadu_ps(a.m + i), momentum), g);
        _mm256_storeu_ps(a.m + i, m);
        g = m;
      }
      p = _mm256_sub_ps(p, _mm256_mul_ps(lr, g));
    } else {
      if (k.apply_weight_decay) {
        if constexpr (K == OptimizerKind::kAdamW) {
          p = _mm256_mul_ps(p, decay_factor);
        } else {
          g = _mm256_add_ps(g, _mm256_mul_ps(weight_decay, p));
        }
      }
      const __m256 m = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(a.m + i), beta1),
                                     _mm256_mul_ps(one_minus_beta1, g));
      const __m256 v = _mm256_add_ps(
          _mm256_mul_ps(_mm256_loadu_ps(a.v + i), beta2),
          _mm256_mul_ps(_mm256_mul_ps(one_minus_beta2, g), g));
      const __m256 denom =
          _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), sqrt_bc2), eps);
      p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(step_size, m), denom));
      _mm256_storeu_ps(a.m + i, m);
      _mm256_storeu_ps(a.v + i, v);
    }
    _mm256_storeu_ps(a.master + i, p);
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
  for (; i + kLanes <= end; i += kLanes) Store<D>(_mm256_loadu_ps(src + i), dst, i);
  CastFromFp32Scalar(src, i, end, dst, D);
}

template <DType D>
void CastToLoop(const void* src, size_t begin, size_t end, float* dst) {
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) _mm256_storeu_ps(dst + i, Load<D>(src, i));
  CastToFp32Scalar(src, D, i, end, dst);
}

}  // namespace

void StepRangeAvx2(const StepArgs& a, size_t begin, size_t end) {
  switch (a.k.kind) {
    case OptimizerKind::kAdamW:
      return DispatchGrad<OptimizerKind::kAdamW>(a, begin, end);
    case OptimizerKind::kAdam:
      return DispatchGrad<OptimizerKind::kAdam>(a, begin, end);
    case OptimizerKind::kSgd:
      return DispatchGrad<OptimizerKind::kSgd>(a, begin, end);
  }
}

void CastFromFp32Avx2(const float* src, size_t begin, size_t end, void* dst,
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

void CastToFp32Avx2(const void* src, DType src_dtype, size_t begin, size_t end,
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
