// AVX2 + FMA + F16C versions of the fused step, casts, gradient sum,
// gradient sum of squares and bandwidth-ceiling loops, 8 floats at a time. Same operation order as
// optimizer_scalar.cc and no fused multiply-add, so results are bit-identical
// to it; heads and tails (< 8 elements) run the scalar code. Compiled with
// -mavx2 -mfma -mf16c: only reached after run-time dispatch has checked the
// CPU, and it calls no inline header functions (see optimizer_internal.h).
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
// Out "dtype" of a step without a published copy.
constexpr DType kNoOut = static_cast<DType>(0);

constexpr size_t OutBytes(DType d) { return d == DType::kFp32 ? 4 : 2; }

// Slot pointers copied to the stack for the step loop (more workers than
// this read them through StepArgs).
constexpr size_t kLocalSlots = 64;

// Elements from `begin` until dst + i * elem_bytes is a multiple of
// vector_bytes (what a streaming store needs); `end - begin` if never.
size_t AlignHead(const void* dst, size_t elem_bytes, size_t vector_bytes,
                 size_t begin, size_t end) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(dst) + begin * elem_bytes;
  if (addr % elem_bytes != 0) return end - begin;
  const size_t head = ((vector_bytes - addr % vector_bytes) % vector_bytes) / elem_bytes;
  return head < end - begin ? head : end - begin;
}

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

// Low 16 bits of each 32-bit lane (which must hold a value < 2^16).
__m128i Narrow(__m256i x) {
  // packus works within 128-bit lanes; gather the two useful quarters.
  const __m256i packed = _mm256_packus_epi32(x, x);
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0xD8));
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
  return Narrow(_mm256_blendv_epi8(rounded, quiet_nan, is_nan));
}

void StoreF32(float* dst, __m256 x, bool stream) {
  if (stream) {
    _mm256_stream_ps(dst, x);
  } else {
    _mm256_storeu_ps(dst, x);
  }
}

void StoreHalf(void* dst, __m128i h, bool stream) {
  if (stream) {
    _mm_stream_si128(static_cast<__m128i*>(dst), h);
  } else {
    _mm_storeu_si128(static_cast<__m128i*>(dst), h);
  }
}

template <DType D, bool kStream>
void Store(__m256 x, void* dst, size_t i) {
  if constexpr (D == kNoOut) {
    return;
  } else if constexpr (D == DType::kFp32) {
    StoreF32(static_cast<float*>(dst) + i, x, kStream);
  } else {
    __m128i h;
    if constexpr (D == DType::kBf16) {
      h = ToBf16(x);
    } else {
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);  // RNE, as FloatToFp16
    }
    StoreHalf(static_cast<uint16_t*>(dst) + i, h, kStream);
  }
}

template <OptimizerKind K, DType G, DType O, bool kStream>
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
  const __m256 inv_sqrt_bc2 = _mm256_set1_ps(k.inv_sqrt_bias_correction2);
  const __m256 momentum = _mm256_set1_ps(k.momentum);
  const __m256 lr = _mm256_set1_ps(k.lr);
  const __m256 zero = _mm256_setzero_ps();
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 minus_one = _mm256_set1_ps(-1.0f);

  // Locals, not reads through `a`: the vector stores below may alias
  // anything, so the compiler would reload every field each iteration.
  float* const master = a.master;
  float* const mp = a.m;
  float* const vp = a.v;
  void* const out = a.out;
  const bool apply_wd = k.apply_weight_decay;
  const bool use_momentum = k.use_momentum;
  const size_t num_workers = a.num_workers;
  const void* local_slots[kLocalSlots];
  const void* const* slots = a.grads;
  if (num_workers <= kLocalSlots) {
    for (size_t w = 0; w < num_workers; ++w) local_slots[w] = a.grads[w];
    slots = local_slots;
  }

  // Everything after the sum over workers, for 8 elements at i.
  auto update = [&](__m256 g, size_t i) {
    g = _mm256_mul_ps(g, grad_scale);
    __m256 p = _mm256_loadu_ps(master + i);
    if constexpr (K == OptimizerKind::kSgd) {
      if (apply_wd) g = _mm256_add_ps(g, _mm256_mul_ps(weight_decay, p));
      if (use_momentum) {
        const __m256 m = _mm256_add_ps(
            _mm256_mul_ps(_mm256_loadu_ps(mp + i), momentum), g);
        _mm256_storeu_ps(mp + i, m);
        g = m;
      }
      p = _mm256_sub_ps(p, _mm256_mul_ps(lr, g));
    } else if constexpr (K == OptimizerKind::kLion) {
      if (apply_wd) p = _mm256_mul_ps(p, decay_factor);
      const __m256 m_old = _mm256_loadu_ps(mp + i);
      const __m256 c = _mm256_add_ps(_mm256_mul_ps(m_old, beta1),
                                     _mm256_mul_ps(one_minus_beta1, g));
      // sign(c): +1, -1, +0 for zeros, c itself for NaN.
      __m256 sign = _mm256_blendv_ps(zero, one, _mm256_cmp_ps(c, zero, _CMP_GT_OQ));
      sign = _mm256_blendv_ps(sign, minus_one, _mm256_cmp_ps(c, zero, _CMP_LT_OQ));
      sign = _mm256_blendv_ps(sign, c, _mm256_cmp_ps(c, c, _CMP_UNORD_Q));
      p = _mm256_sub_ps(p, _mm256_mul_ps(lr, sign));
      _mm256_storeu_ps(mp + i, _mm256_add_ps(_mm256_mul_ps(m_old, beta2),
                                              _mm256_mul_ps(one_minus_beta2, g)));
    } else {
      if (apply_wd) {
        if constexpr (K == OptimizerKind::kAdamW) {
          p = _mm256_mul_ps(p, decay_factor);
        } else {
          g = _mm256_add_ps(g, _mm256_mul_ps(weight_decay, p));
        }
      }
      const __m256 m = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(mp + i), beta1),
                                     _mm256_mul_ps(one_minus_beta1, g));
      const __m256 v = _mm256_add_ps(
          _mm256_mul_ps(_mm256_loadu_ps(vp + i), beta2),
          _mm256_mul_ps(_mm256_mul_ps(one_minus_beta2, g), g));
      const __m256 denom =
          _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(v), inv_sqrt_bc2), eps);
      p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(step_size, m), denom));
      _mm256_storeu_ps(mp + i, m);
      _mm256_storeu_ps(vp + i, v);
    }
    _mm256_storeu_ps(master + i, p);
    Store<O, kStream>(p, out, i);
  };

  // Two vectors per iteration share one pass over the slot pointers. Each
  // vector still sums the slots in rank order.
  size_t i = begin;
  for (; i + 2 * kLanes <= end; i += 2 * kLanes) {
    __m256 g0 = Load<G>(slots[0], i);
    __m256 g1 = Load<G>(slots[0], i + kLanes);
    for (size_t w = 1; w < num_workers; ++w) {
      g0 = _mm256_add_ps(g0, Load<G>(slots[w], i));
      g1 = _mm256_add_ps(g1, Load<G>(slots[w], i + kLanes));
    }
    update(g0, i);
    update(g1, i + kLanes);
  }
  for (; i + kLanes <= end; i += kLanes) {
    __m256 g = Load<G>(slots[0], i);
    for (size_t w = 1; w < num_workers; ++w) g = _mm256_add_ps(g, Load<G>(slots[w], i));
    update(g, i);
  }
  StepRangeScalar(a, i, end);
}

// Streams the published copy on long ranges (see kStreamMinElems): a scalar
// head aligns `out`, and the fence orders the streaming stores before
// whatever the caller does next (publishing the version).
template <OptimizerKind K, DType G, DType O>
void StepOut(const StepArgs& a, size_t begin, size_t end) {
  if (O == kNoOut || end - begin < kStreamMinElems) {
    return StepLoop<K, G, O, false>(a, begin, end);
  }
  const size_t head = AlignHead(a.out, OutBytes(O), kLanes * OutBytes(O), begin, end);
  StepRangeScalar(a, begin, begin + head);
  StepLoop<K, G, O, true>(a, begin + head, end);
  _mm_sfence();
}

template <OptimizerKind K, DType G>
void DispatchOut(const StepArgs& a, size_t begin, size_t end) {
  if (a.out == nullptr) return StepOut<K, G, kNoOut>(a, begin, end);
  switch (a.out_dtype) {
    case DType::kFp32:
      return StepOut<K, G, DType::kFp32>(a, begin, end);
    case DType::kBf16:
      return StepOut<K, G, DType::kBf16>(a, begin, end);
    case DType::kFp16:
      return StepOut<K, G, DType::kFp16>(a, begin, end);
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

template <DType D, bool kStream>
void CastFromLoop(const float* src, size_t begin, size_t end, void* dst) {
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    Store<D, kStream>(_mm256_loadu_ps(src + i), dst, i);
  }
  CastFromFp32Scalar(src, i, end, dst, D);
}

template <DType D>
void CastFromOut(const float* src, size_t begin, size_t end, void* dst) {
  if (end - begin < kStreamMinElems) return CastFromLoop<D, false>(src, begin, end, dst);
  const size_t head = AlignHead(dst, OutBytes(D), kLanes * OutBytes(D), begin, end);
  CastFromFp32Scalar(src, begin, begin + head, dst, D);
  CastFromLoop<D, true>(src, begin + head, end, dst);
  _mm_sfence();
}

template <DType D>
void CastToLoop(const void* src, size_t begin, size_t end, float* dst) {
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) _mm256_storeu_ps(dst + i, Load<D>(src, i));
  CastToFp32Scalar(src, D, i, end, dst);
}

template <DType G, bool kStream>
void SumLoop(const StepArgs& a, size_t begin, size_t end, float* dst) {
  const __m256 grad_scale = _mm256_set1_ps(a.grad_scale);
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    __m256 g = Load<G>(a.grads[0], i);
    for (size_t w = 1; w < a.num_workers; ++w) {
      g = _mm256_add_ps(g, Load<G>(a.grads[w], i));
    }
    StoreF32(dst + i, _mm256_mul_ps(g, grad_scale), kStream);
  }
  SumGradsScalar(a, i, end, dst);
}

template <DType G>
void SumOut(const StepArgs& a, size_t begin, size_t end, float* dst) {
  if (end - begin < kStreamMinElems) return SumLoop<G, false>(a, begin, end, dst);
  const size_t head = AlignHead(dst, 4, kLanes * 4, begin, end);
  SumGradsScalar(a, begin, begin + head, dst);
  SumLoop<G, true>(a, begin + head, end, dst);
  _mm_sfence();
}

// Grad bits of 8 elements, widened to 32 bits per element.
template <DType G>
__m256i LoadBits(const void* src, size_t i) {
  if constexpr (G == DType::kFp32) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        static_cast<const float*>(src) + i));
  } else {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
        static_cast<const uint16_t*>(src) + i)));
  }
}

__m256i LoadU(const float* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
void StoreU(float* p, __m256i x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }

template <DType G, DType O, bool kStream>
void TouchLoop(const StepArgs& a, uint32_t grad_mask, size_t begin, size_t end) {
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(grad_mask));
  const __m256i low16 = _mm256_set1_epi32(0xffff);
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    __m256i g = LoadBits<G>(a.grads[0], i);
    for (size_t w = 1; w < a.num_workers; ++w) g = _mm256_or_si256(g, LoadBits<G>(a.grads[w], i));
    g = _mm256_and_si256(g, mask);
    const __m256i p = _mm256_or_si256(LoadU(a.master + i), g);
    StoreU(a.master + i, p);
    if (a.m != nullptr) StoreU(a.m + i, _mm256_or_si256(LoadU(a.m + i), g));
    if (a.v != nullptr) StoreU(a.v + i, _mm256_or_si256(LoadU(a.v + i), g));
    if constexpr (O == DType::kFp32) {
      StoreF32(static_cast<float*>(a.out) + i, _mm256_castsi256_ps(p), kStream);
    } else if constexpr (O != kNoOut) {
      StoreHalf(static_cast<uint16_t*>(a.out) + i, Narrow(_mm256_and_si256(p, low16)), kStream);
    }
  }
  TouchScalar(a, grad_mask, i, end);
}

template <DType G, DType O>
void TouchOut(const StepArgs& a, uint32_t grad_mask, size_t begin, size_t end) {
  if (O == kNoOut || end - begin < kStreamMinElems) {
    return TouchLoop<G, O, false>(a, grad_mask, begin, end);
  }
  const size_t head = AlignHead(a.out, OutBytes(O), kLanes * OutBytes(O), begin, end);
  TouchScalar(a, grad_mask, begin, begin + head);
  TouchLoop<G, O, true>(a, grad_mask, begin + head, end);
  _mm_sfence();
}

template <DType G>
void TouchDispatchOut(const StepArgs& a, uint32_t grad_mask, size_t begin, size_t end) {
  if (a.out == nullptr) return TouchOut<G, kNoOut>(a, grad_mask, begin, end);
  switch (a.out_dtype) {
    case DType::kFp32:
      return TouchOut<G, DType::kFp32>(a, grad_mask, begin, end);
    case DType::kBf16:
    case DType::kFp16:
      return TouchOut<G, DType::kBf16>(a, grad_mask, begin, end);
  }
}

// Squares of the 8 fp32 values of g added, in double, to the lanes of
// `lo` (g's elements 0-3) and `hi` (4-7).
void AddSquares(__m256 g, __m256d* lo, __m256d* hi) {
  const __m256d g_lo = _mm256_cvtps_pd(_mm256_castps256_ps128(g));
  const __m256d g_hi = _mm256_cvtps_pd(_mm256_extractf128_ps(g, 1));
  *lo = _mm256_add_pd(*lo, _mm256_mul_pd(g_lo, g_lo));
  *hi = _mm256_add_pd(*hi, _mm256_mul_pd(g_hi, g_hi));
}

// GradSquaresLoop and ReadLoop prefetch each slot this far ahead: see the
// AVX-512 file, where it was measured (this file's loops do the same work
// per cache line, with half-width vectors).
constexpr size_t kPrefetchBytes = 8192;

// Lanes of a group of 32 elements in 8 accumulators of 4 doubles. fp32 and
// fp16 load elements in order: accumulator k holds lanes 4k..4k+3. bf16
// loads 16 elements per vector and splits even and odd elements (a shift
// and a mask, no shuffle): accumulators 0-3 hold lanes 0, 2, 4, 6 / 8, 10,
// 12, 14 / 16, .. / 24, .., 30, and 4-7 the odd lanes 1, 3, 5, 7 / ... / 25,
// .., 31. (Its member functions are in an anonymous namespace, so no other
// file can link to these AVX2 copies.)
template <DType G>
struct Group {
  __m256d acc[8] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                    _mm256_setzero_pd(), _mm256_setzero_pd()};

  void Add(const void* const* slots, size_t num_workers, __m256 grad_scale, size_t i) {
    __m256 g0, g1, g2, g3;
    if constexpr (G == DType::kBf16) {
      // g0, g1: even and odd of elements 0-15; g2, g3: of 16-31.
      const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
      const uint16_t* s = static_cast<const uint16_t*>(slots[0]) + i;
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
      __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16));
      g0 = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
      g1 = _mm256_castsi256_ps(_mm256_and_si256(x, high));
      g2 = _mm256_castsi256_ps(_mm256_slli_epi32(y, 16));
      g3 = _mm256_castsi256_ps(_mm256_and_si256(y, high));
      for (size_t w = 1; w < num_workers; ++w) {
        s = static_cast<const uint16_t*>(slots[w]) + i;
        x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
        y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + 16));
        g0 = _mm256_add_ps(g0, _mm256_castsi256_ps(_mm256_slli_epi32(x, 16)));
        g1 = _mm256_add_ps(g1, _mm256_castsi256_ps(_mm256_and_si256(x, high)));
        g2 = _mm256_add_ps(g2, _mm256_castsi256_ps(_mm256_slli_epi32(y, 16)));
        g3 = _mm256_add_ps(g3, _mm256_castsi256_ps(_mm256_and_si256(y, high)));
      }
      AddSquares(_mm256_mul_ps(g0, grad_scale), &acc[0], &acc[1]);
      AddSquares(_mm256_mul_ps(g1, grad_scale), &acc[4], &acc[5]);
      AddSquares(_mm256_mul_ps(g2, grad_scale), &acc[2], &acc[3]);
      AddSquares(_mm256_mul_ps(g3, grad_scale), &acc[6], &acc[7]);
    } else {
      g0 = Load<G>(slots[0], i);
      g1 = Load<G>(slots[0], i + kLanes);
      g2 = Load<G>(slots[0], i + 2 * kLanes);
      g3 = Load<G>(slots[0], i + 3 * kLanes);
      for (size_t w = 1; w < num_workers; ++w) {
        const void* slot = slots[w];
        g0 = _mm256_add_ps(g0, Load<G>(slot, i));
        g1 = _mm256_add_ps(g1, Load<G>(slot, i + kLanes));
        g2 = _mm256_add_ps(g2, Load<G>(slot, i + 2 * kLanes));
        g3 = _mm256_add_ps(g3, Load<G>(slot, i + 3 * kLanes));
      }
      AddSquares(_mm256_mul_ps(g0, grad_scale), &acc[0], &acc[1]);
      AddSquares(_mm256_mul_ps(g1, grad_scale), &acc[2], &acc[3]);
      AddSquares(_mm256_mul_ps(g2, grad_scale), &acc[4], &acc[5]);
      AddSquares(_mm256_mul_ps(g3, grad_scale), &acc[6], &acc[7]);
    }
  }

  // The 32 lanes in documented order.
  void Store(double* lanes) const {
    if constexpr (G == DType::kBf16) {
      for (size_t k = 0; k < 4; ++k) {
        // Even lanes e0 e1 e2 e3 and odd lanes o0 o1 o2 o3 of 8 elements.
        const __m256d lo = _mm256_unpacklo_pd(acc[k], acc[k + 4]);  // e0 o0 e2 o2
        const __m256d hi = _mm256_unpackhi_pd(acc[k], acc[k + 4]);  // e1 o1 e3 o3
        _mm256_storeu_pd(lanes + 8 * k, _mm256_permute2f128_pd(lo, hi, 0x20));
        _mm256_storeu_pd(lanes + 8 * k + 4, _mm256_permute2f128_pd(lo, hi, 0x31));
      }
    } else {
      for (size_t k = 0; k < 8; ++k) _mm256_storeu_pd(lanes + 4 * k, acc[k]);
    }
  }
};

// The reduction of kNormBlockElems/kNormLanes (optimizer_internal.h): whole
// groups of 32 elements in vectors (Group), then FinishNormBlock with the
// block's tail.
template <DType G>
void GradSquaresLoop(const StepArgs& a, size_t begin, size_t end, double* block_sums) {
  static_assert(kNormLanes == 4 * kLanes, "one group is 4 vectors");
  const __m256 grad_scale = _mm256_set1_ps(a.grad_scale);
  const size_t num_workers = a.num_workers;
  const void* local_slots[kLocalSlots];
  const void* const* slots = a.grads;
  if (num_workers <= kLocalSlots) {
    for (size_t w = 0; w < num_workers; ++w) local_slots[w] = a.grads[w];
    slots = local_slots;
  }
  constexpr size_t kElemBytes = G == DType::kFp32 ? 4 : 2;
  constexpr size_t kPrefetchElems = kPrefetchBytes / kElemBytes;
  for (size_t block = begin; block < end; block += kNormBlockElems) {
    const size_t block_end = end - block < kNormBlockElems ? end : block + kNormBlockElems;
    Group<G> group;
    size_t i = block;
    for (; i + kNormLanes <= block_end; i += kNormLanes) {
      if (i + kPrefetchElems + kNormLanes <= end) {  // never past the range
        for (size_t w = 0; w < num_workers; ++w) {
          // One group is 32 elements: one cache line of bf16/fp16, two of fp32.
          const char* p = static_cast<const char*>(slots[w]) + (i + kPrefetchElems) * kElemBytes;
          _mm_prefetch(p, _MM_HINT_T0);
          if (kElemBytes == 4) _mm_prefetch(p + 64, _MM_HINT_T0);
        }
      }
      group.Add(slots, num_workers, grad_scale, i);
    }
    double lanes[kNormLanes];
    group.Store(lanes);
    block_sums[block / kNormBlockElems] = FinishNormBlock(a, block, i, block_end, lanes);
  }
}

// GradSquaresLoop's reads alone: 32 elements of every slot per iteration,
// OR-ed into one register, with the same prefetches.
template <DType G>
uint32_t ReadLoop(const StepArgs& a, size_t begin, size_t end) {
  constexpr size_t kVectorsPerGroup = G == DType::kFp32 ? 4 : 2;  // 32 elements
  constexpr size_t kElemBytes = G == DType::kFp32 ? 4 : 2;
  __m256i bits = _mm256_setzero_si256();
  size_t i = begin;
  for (; i + kNormLanes <= end; i += kNormLanes) {
    if (i + kPrefetchBytes / kElemBytes + kNormLanes <= end) {  // as GradSquaresLoop
      for (size_t w = 0; w < a.num_workers; ++w) {
        const char* p = static_cast<const char*>(a.grads[w]) + i * kElemBytes + kPrefetchBytes;
        _mm_prefetch(p, _MM_HINT_T0);
        if (kElemBytes == 4) _mm_prefetch(p + 64, _MM_HINT_T0);
      }
    }
    for (size_t w = 0; w < a.num_workers; ++w) {
      const __m256i* p = reinterpret_cast<const __m256i*>(
          static_cast<const uint8_t*>(a.grads[w]) + i * kElemBytes);
      for (size_t v = 0; v < kVectorsPerGroup; ++v) {
        bits = _mm256_or_si256(bits, _mm256_loadu_si256(p + v));
      }
    }
  }
  const __m128i half = _mm_or_si128(_mm256_castsi256_si128(bits),
                                    _mm256_extracti128_si256(bits, 1));
  const __m128i quarter = _mm_or_si128(half, _mm_srli_si128(half, 8));
  const __m128i eighth = _mm_or_si128(quarter, _mm_srli_si128(quarter, 4));
  uint32_t result = static_cast<uint32_t>(_mm_cvtsi128_si32(eighth));
  if (G != DType::kFp32) result = (result | (result >> 16)) & 0xffff;
  return result | ReadGradsScalar(a, i, end);
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
    case OptimizerKind::kLion:
      return DispatchGrad<OptimizerKind::kLion>(a, begin, end);
  }
}

void CastFromFp32Avx2(const float* src, size_t begin, size_t end, void* dst,
                        DType dst_dtype) {
  switch (dst_dtype) {
    case DType::kFp32:
      return CastFromOut<DType::kFp32>(src, begin, end, dst);
    case DType::kBf16:
      return CastFromOut<DType::kBf16>(src, begin, end, dst);
    case DType::kFp16:
      return CastFromOut<DType::kFp16>(src, begin, end, dst);
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

void SumGradsAvx2(const StepArgs& a, size_t begin, size_t end, float* dst) {
  switch (a.grad_dtype) {
    case DType::kFp32:
      return SumOut<DType::kFp32>(a, begin, end, dst);
    case DType::kBf16:
      return SumOut<DType::kBf16>(a, begin, end, dst);
    case DType::kFp16:
      return SumOut<DType::kFp16>(a, begin, end, dst);
  }
}

void GradSquaresAvx2(const StepArgs& a, size_t begin, size_t end, double* block_sums) {
  switch (a.grad_dtype) {
    case DType::kFp32:
      return GradSquaresLoop<DType::kFp32>(a, begin, end, block_sums);
    case DType::kBf16:
      return GradSquaresLoop<DType::kBf16>(a, begin, end, block_sums);
    case DType::kFp16:
      return GradSquaresLoop<DType::kFp16>(a, begin, end, block_sums);
  }
}

uint32_t ReadGradsAvx2(const StepArgs& a, size_t begin, size_t end) {
  if (a.grad_dtype == DType::kFp32) return ReadLoop<DType::kFp32>(a, begin, end);
  return ReadLoop<DType::kBf16>(a, begin, end);
}

void TouchAvx2(const StepArgs& a, uint32_t grad_mask, size_t begin, size_t end) {
  if (a.grad_dtype == DType::kFp32) {
    return TouchDispatchOut<DType::kFp32>(a, grad_mask, begin, end);
  }
  return TouchDispatchOut<DType::kBf16>(a, grad_mask, begin, end);
}

}  // namespace internal
}  // namespace kernels
}  // namespace optimus

#endif  // defined(__x86_64__)
