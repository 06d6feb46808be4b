#include "kernels/cpu/passes.h"

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cpu/optimizer_internal.h"

namespace optimus {
namespace kernels {
namespace {

// Same grain as FusedStep's split (optimizer.cc), for the same reasons.
constexpr size_t kSplitGrainElems = 16384;

absl::Status FillArgs(const StepInputs& in, internal::StepArgs* args) {
  if (in.grads.empty()) return absl::InvalidArgumentError("no gradient slots");
  for (const void* slot : in.grads) {
    if (slot == nullptr) return absl::InvalidArgumentError("null gradient slot");
  }
  if (in.grad_dtype != DType::kFp32 && in.grad_dtype != DType::kBf16 &&
      in.grad_dtype != DType::kFp16) {
    return absl::InvalidArgumentError("invalid grad_dtype");
  }
  args->grads = in.grads.data();
  args->num_workers = in.grads.size();
  args->grad_dtype = in.grad_dtype;
  args->grad_scale = in.grad_scale;
  return absl::OkStatus();
}

template <typename Fn>
void Split(size_t num_elems, ThreadPool* pool, Fn fn) {
  if (pool == nullptr) {
    fn(size_t{0}, num_elems);
  } else {
    pool->ParallelFor(num_elems, kSplitGrainElems, fn);
  }
}

}  // namespace

absl::Status SumGradsToFp32(const StepInputs& in, size_t num_elems, float* dst,
                            ThreadPool* pool) {
  internal::StepArgs args;
  absl::Status status = FillArgs(in, &args);
  if (!status.ok()) return status;
  if (dst == nullptr) return absl::InvalidArgumentError("dst is null");
  const internal::IsaKernels& k = internal::ActiveKernels();
  Split(num_elems, pool, [&](size_t b, size_t e) { k.sum_grads(args, b, e, dst); });
  return absl::OkStatus();
}

absl::Status AccumulateGrads(float* acc, bool start, absl::Span<const void* const> slots,
                             DType dtype, size_t num_elems, ThreadPool* pool) {
  if (acc == nullptr) return absl::InvalidArgumentError("AccumulateGrads: acc is null");
  for (const void* slot : slots) {
    if (slot == nullptr) return absl::InvalidArgumentError("AccumulateGrads: null slot");
  }
  if (dtype != DType::kFp32 && dtype != DType::kBf16 && dtype != DType::kFp16) {
    return absl::InvalidArgumentError("AccumulateGrads: invalid dtype");
  }
  const internal::IsaKernels& k = internal::ActiveKernels();
  const size_t elem = DTypeSize(dtype);
  Split(num_elems, pool, [&](size_t b, size_t e) {
    // Block by block: the ISA cast widens a block of one slot into `wide`
    // (fp32 slots are read in place), then a plain loop adds it, which the
    // compiler vectorizes; an fp32 add is the same one rounding in any ISA.
    constexpr size_t kBlock = 1024;
    alignas(64) float wide[kBlock];
    for (size_t i = b; i < e; i += kBlock) {
      const size_t n = e - i < kBlock ? e - i : kBlock;
      float* a = acc + i;
      size_t first = 0;
      if (start) {
        if (slots.empty()) {
          for (size_t j = 0; j < n; ++j) a[j] = 0.0f;
          continue;
        }
        k.cast_to_fp32(static_cast<const uint8_t*>(slots[0]) + i * elem, dtype, 0, n, a);
        first = 1;
      }
      for (size_t w = first; w < slots.size(); ++w) {
        const float* src;
        if (dtype == DType::kFp32) {
          src = static_cast<const float*>(slots[w]) + i;
        } else {
          k.cast_to_fp32(static_cast<const uint8_t*>(slots[w]) + i * elem, dtype, 0, n, wide);
          src = wide;
        }
        for (size_t j = 0; j < n; ++j) a[j] = a[j] + src[j];
      }
    }
  });
  return absl::OkStatus();
}

void CastFromFp32(const float* src, size_t num_elems, void* dst,
                  DType dst_dtype, ThreadPool* pool) {
  const internal::IsaKernels& k = internal::ActiveKernels();
  Split(num_elems, pool,
        [&](size_t b, size_t e) { k.cast_from_fp32(src, b, e, dst, dst_dtype); });
}

absl::Status BandwidthCeilingPass(const StepInputs& in, size_t num_elems,
                                  ChunkState state, void* out, DType out_dtype,
                                  uint32_t grad_mask, ThreadPool* pool) {
  internal::StepArgs args;
  absl::Status status = FillArgs(in, &args);
  if (!status.ok()) return status;
  if (state.master == nullptr) return absl::InvalidArgumentError("state.master is null");
  args.master = state.master;
  args.m = state.m;
  args.v = state.v;
  args.out = out;
  args.out_dtype = out_dtype;
  const internal::IsaKernels& k = internal::ActiveKernels();
  Split(num_elems, pool, [&](size_t b, size_t e) { k.touch(args, grad_mask, b, e); });
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> ReadGradsPass(const StepInputs& in, size_t num_elems,
                                       ThreadPool* pool) {
  internal::StepArgs args;
  absl::Status status = FillArgs(in, &args);
  if (!status.ok()) return status;
  const internal::IsaKernels& k = internal::ActiveKernels();
  std::atomic<uint32_t> bits{0};
  Split(num_elems, pool, [&](size_t b, size_t e) {
    bits.fetch_or(k.read_grads(args, b, e), std::memory_order_relaxed);
  });
  return bits.load(std::memory_order_relaxed);
}

}  // namespace kernels
}  // namespace optimus
