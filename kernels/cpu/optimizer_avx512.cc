// AVX-512 (F + BW) versions of the fused step, casts, gradient sum,
// gradient sum of squares and bandwidth-ceiling loops, 16 floats at a time. Same operation order as
// optimizer_scalar.cc and no fused multiply-add, so results are bit-identical
// to it; heads and tails (< 16 elements) run the scalar code. Compiled with
// -mavx512f -mavx512bw: only reached after run-time dispatch has checked the
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

constexpr size_t kLanes = 16;  // floats per __m512
// Out "dtype" of a step without a published copy.
constexpr DType kNoOut = static_cast<DType>(0);

constexpr size_t OutBytes(DType d) { return d == DType::kFp32 ? 4 : 2; }

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

void StoreF32(float* dst, __m512 x, bool stream) {
  if (stream) {
    _mm512_stream_ps(dst, x);
  } else {
    _mm512_storeu_ps(dst, x);
  }
}

void StoreHalf(void* dst, __m256i h, bool stream) {
  if (stream) {
    _mm256_stream_si256(static_cast<__m256i*>(dst), h);
  } else {
    _mm256_storeu_si256(static_cast<__m256i*>(dst), h);
  }
}

template <DType D, bool kStream>
void Store(__m512 x, void* dst, size_t i) {
  if constexpr (D == kNoOut) {
    return;
  } else if constexpr (D == DType::kFp32) {
    StoreF32(static_cast<float*>(dst) + i, x, kStream);
  } else {
    __m256i h;
    if constexpr (D == DType::kBf16) {
      h = ToBf16(x);
    } else {
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);  // RNE, as FloatToFp16
    }
    StoreHalf(static_cast<uint16_t*>(dst) + i, h, kStream);
  }
}

template <OptimizerKind K, DType G, DType O, bool kStream>
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
  const __m512 inv_sqrt_bc2 = _mm512_set1_ps(k.inv_sqrt_bias_correction2);
  const __m512 momentum = _mm512_set1_ps(k.momentum);
  const __m512 lr = _mm512_set1_ps(k.lr);
  const __m512 zero = _mm512_setzero_ps();
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 minus_one = _mm512_set1_ps(-1.0f);

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
    } else if constexpr (K == OptimizerKind::kLion) {
      if (k.apply_weight_decay) p = _mm512_mul_ps(p, decay_factor);
      const __m512 m_old = _mm512_loadu_ps(a.m + i);
      const __m512 c = _mm512_add_ps(_mm512_mul_ps(m_old, beta1),
                                     _mm512_mul_ps(one_minus_beta1, g));
      // sign(c): +1, -1, +0 for zeros, c itself for NaN.
      __m512 sign = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, zero, _CMP_GT_OQ), zero, one);
      sign = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, zero, _CMP_LT_OQ), sign, minus_one);
      sign = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(c, c, _CMP_UNORD_Q), sign, c);
      p = _mm512_sub_ps(p, _mm512_mul_ps(lr, sign));
      _mm512_storeu_ps(a.m + i, _mm512_add_ps(_mm512_mul_ps(m_old, beta2),
                                              _mm512_mul_ps(one_minus_beta2, g)));
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
          _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(v), inv_sqrt_bc2), eps);
      p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(step_size, m), denom));
      _mm512_storeu_ps(a.m + i, m);
      _mm512_storeu_ps(a.v + i, v);
    }
    _mm512_storeu_ps(a.master + i, p);
    Store<O, kStream>(p, a.out, i);
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
    Store<D, kStream>(_mm512_loadu_ps(src + i), dst, i);
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
  for (; i + kLanes <= end; i += kLanes) _mm512_storeu_ps(dst + i, Load<D>(src, i));
  CastToFp32Scalar(src, D, i, end, dst);
}

template <DType G, bool kStream>
void SumLoop(const StepArgs& a, size_t begin, size_t end, float* dst) {
  const __m512 grad_scale = _mm512_set1_ps(a.grad_scale);
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    __m512 g = Load<G>(a.grads[0], i);
    for (size_t w = 1; w < a.num_workers; ++w) {
      g = _mm512_add_ps(g, Load<G>(a.grads[w], i));
    }
    StoreF32(dst + i, _mm512_mul_ps(g, grad_scale), kStream);
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

// Grad bits of 16 elements, widened to 32 bits per element.
template <DType G>
__m512i LoadBits(const void* src, size_t i) {
  if constexpr (G == DType::kFp32) {
    return _mm512_loadu_si512(static_cast<const float*>(src) + i);
  } else {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
        static_cast<const uint16_t*>(src) + i)));
  }
}

template <DType G, DType O, bool kStream>
void TouchLoop(const StepArgs& a, uint32_t grad_mask, size_t begin, size_t end) {
  const __m512i mask = _mm512_set1_epi32(static_cast<int>(grad_mask));
  size_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    __m512i g = LoadBits<G>(a.grads[0], i);
    for (size_t w = 1; w < a.num_workers; ++w) g = _mm512_or_si512(g, LoadBits<G>(a.grads[w], i));
    g = _mm512_and_si512(g, mask);
    const __m512i p = _mm512_or_si512(_mm512_loadu_si512(a.master + i), g);
    _mm512_storeu_si512(a.master + i, p);
    if (a.m != nullptr) _mm512_storeu_si512(a.m + i, _mm512_or_si512(_mm512_loadu_si512(a.m + i), g));
    if (a.v != nullptr) _mm512_storeu_si512(a.v + i, _mm512_or_si512(_mm512_loadu_si512(a.v + i), g));
    if constexpr (O == DType::kFp32) {
      StoreF32(static_cast<float*>(a.out) + i, _mm512_castsi512_ps(p), kStream);
    } else if constexpr (O != kNoOut) {
      StoreHalf(static_cast<uint16_t*>(a.out) + i, _mm512_cvtepi32_epi16(p), kStream);
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

// Squares of the 16 fp32 values of g added, in double, to the lanes of
// `lo` (g's elements 0-7) and `hi` (8-15).
void AddSquares(__m512 g, __m512d* lo, __m512d* hi) {
  const __m512d g_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
  // The upper 8 floats, with AVX-512F only (extractf32x8 would need DQ).
  const __m512d g_hi = _mm512_cvtps_pd(
      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(g), 1)));
  *lo = _mm512_add_pd(*lo, _mm512_mul_pd(g_lo, g_lo));
  *hi = _mm512_add_pd(*hi, _mm512_mul_pd(g_hi, g_hi));
}

// Slot pointers copied to the stack for the loop (more workers than this
// read them through StepArgs).
constexpr size_t kLocalSlots = 64;

// GradSquaresLoop prefetches each slot this far ahead (and so does the
// ceiling's ReadLoop, which must stay the faster way to read the same
// bytes). Measured on 64 Mi parameters, W=3 bf16, one thread, Zen 5 VM
// (bench/kernels grad_norm): without it the pass read 35 GB/s with slots
// mapped as the shard server maps them and 10 GB/s with slots from
// aligned_alloc (page offset 64, 4 KiB apart); with it, 42 and 21 GB/s.
// 2-32 KiB ahead, to L1 or L2, were within noise of each other.
constexpr size_t kPrefetchBytes = 8192;

// Lanes of a group of 32 elements in 4 accumulators of 8 doubles. fp32 and
// fp16 load elements in order: accumulator k holds lanes 8k..8k+7. bf16
// loads all 32 as one vector and splits even and odd elements (a shift and
// a mask, no shuffle): accumulators 0, 1 hold lanes 0, 2, .., 14 and 16, 18,
// .., 30; 2, 3 hold lanes 1, 3, .., 15 and 17, 19, .., 31.
// (Its member functions are in an anonymous namespace, so no other file can
// link to these AVX-512 copies.)
template <DType G>
struct Group {
  __m512d acc0 = _mm512_setzero_pd(), acc1 = acc0, acc2 = acc0, acc3 = acc0;

  void Add(const void* const* slots, size_t num_workers, __m512 grad_scale, size_t i) {
    __m512 g0, g1;
    if constexpr (G == DType::kBf16) {
      const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
      __m512i x = _mm512_loadu_si512(static_cast<const uint16_t*>(slots[0]) + i);
      g0 = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      g1 = _mm512_castsi512_ps(_mm512_and_si512(x, high));
      for (size_t w = 1; w < num_workers; ++w) {
        x = _mm512_loadu_si512(static_cast<const uint16_t*>(slots[w]) + i);
        g0 = _mm512_add_ps(g0, _mm512_castsi512_ps(_mm512_slli_epi32(x, 16)));
        g1 = _mm512_add_ps(g1, _mm512_castsi512_ps(_mm512_and_si512(x, high)));
      }
    } else {
      g0 = Load<G>(slots[0], i);
      g1 = Load<G>(slots[0], i + kLanes);
      for (size_t w = 1; w < num_workers; ++w) {
        g0 = _mm512_add_ps(g0, Load<G>(slots[w], i));
        g1 = _mm512_add_ps(g1, Load<G>(slots[w], i + kLanes));
      }
    }
    AddSquares(_mm512_mul_ps(g0, grad_scale), &acc0, &acc1);
    AddSquares(_mm512_mul_ps(g1, grad_scale), &acc2, &acc3);
  }

  // The 32 lanes in documented order.
  void Store(double* lanes) const {
    if constexpr (G == DType::kBf16) {
      const __m512i first = _mm512_set_epi64(11, 3, 10, 2, 9, 1, 8, 0);
      const __m512i second = _mm512_set_epi64(15, 7, 14, 6, 13, 5, 12, 4);
      _mm512_storeu_pd(lanes, _mm512_permutex2var_pd(acc0, first, acc2));
      _mm512_storeu_pd(lanes + 8, _mm512_permutex2var_pd(acc0, second, acc2));
      _mm512_storeu_pd(lanes + 16, _mm512_permutex2var_pd(acc1, first, acc3));
      _mm512_storeu_pd(lanes + 24, _mm512_permutex2var_pd(acc1, second, acc3));
    } else {
      _mm512_storeu_pd(lanes, acc0);
      _mm512_storeu_pd(lanes + 8, acc1);
      _mm512_storeu_pd(lanes + 16, acc2);
      _mm512_storeu_pd(lanes + 24, acc3);
    }
  }
};

// The reduction of kNormBlockElems/kNormLanes (optimizer_internal.h): whole
// groups of 32 elements in vectors (Group), then FinishNormBlock with the
// block's tail.
template <DType G>
void GradSquaresLoop(const StepArgs& a, size_t begin, size_t end, double* block_sums) {
  static_assert(kNormLanes == 2 * kLanes, "one group is 2 vectors");
  const __m512 grad_scale = _mm512_set1_ps(a.grad_scale);
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
  constexpr size_t kVectorsPerGroup = G == DType::kFp32 ? 2 : 1;  // 32 elements
  constexpr size_t kElemBytes = G == DType::kFp32 ? 4 : 2;
  __m512i bits = _mm512_setzero_si512();
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
      const uint8_t* p = static_cast<const uint8_t*>(a.grads[w]) + i * kElemBytes;
      for (size_t v = 0; v < kVectorsPerGroup; ++v) {
        bits = _mm512_or_si512(bits, _mm512_loadu_si512(p + 64 * v));
      }
    }
  }
  const __m256i half = _mm256_or_si256(_mm512_castsi512_si256(bits),
                                       _mm512_extracti64x4_epi64(bits, 1));
  const __m128i quarter = _mm_or_si128(_mm256_castsi256_si128(half),
                                       _mm256_extracti128_si256(half, 1));
  const __m128i eighth = _mm_or_si128(quarter, _mm_srli_si128(quarter, 8));
  const __m128i sixteenth = _mm_or_si128(eighth, _mm_srli_si128(eighth, 4));
  uint32_t result = static_cast<uint32_t>(_mm_cvtsi128_si32(sixteenth));
  if (G != DType::kFp32) result = (result | (result >> 16)) & 0xffff;
  return result | ReadGradsScalar(a, i, end);
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
    case OptimizerKind::kLion:
      return DispatchGrad<OptimizerKind::kLion>(a, begin, end);
  }
}

void CastFromFp32Avx512(const float* src, size_t begin, size_t end, void* dst,
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

void SumGradsAvx512(const StepArgs& a, size_t begin, size_t end, float* dst) {
  switch (a.grad_dtype) {
    case DType::kFp32:
      return SumOut<DType::kFp32>(a, begin, end, dst);
    case DType::kBf16:
      return SumOut<DType::kBf16>(a, begin, end, dst);
    case DType::kFp16:
      return SumOut<DType::kFp16>(a, begin, end, dst);
  }
}

void GradSquaresAvx512(const StepArgs& a, size_t begin, size_t end,
                       double* block_sums) {
  switch (a.grad_dtype) {
    case DType::kFp32:
      return GradSquaresLoop<DType::kFp32>(a, begin, end, block_sums);
    case DType::kBf16:
      return GradSquaresLoop<DType::kBf16>(a, begin, end, block_sums);
    case DType::kFp16:
      return GradSquaresLoop<DType::kFp16>(a, begin, end, block_sums);
  }
}

uint32_t ReadGradsAvx512(const StepArgs& a, size_t begin, size_t end) {
  if (a.grad_dtype == DType::kFp32) return ReadLoop<DType::kFp32>(a, begin, end);
  return ReadLoop<DType::kBf16>(a, begin, end);
}

void TouchAvx512(const StepArgs& a, uint32_t grad_mask, size_t begin, size_t end) {
  if (a.grad_dtype == DType::kFp32) {
    return TouchDispatchOut<DType::kFp32>(a, grad_mask, begin, end);
  }
  return TouchDispatchOut<DType::kBf16>(a, grad_mask, begin, end);
}

}  // namespace internal
}  // namespace kernels
}  // namespace optimus

#endif  // defined(__x86_64__)
