#include "coordinator/shard_map.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace optimus {
namespace {

constexpr uint64_t kMaxU64 = std::numeric_limits<uint64_t>::max();

// Saturating arithmetic: a job whose byte count does not fit in 64 bits
// simply does not fit anywhere, rather than wrapping around and "fitting".
uint64_t SatMul(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_mul_overflow(a, b, &r) ? kMaxU64 : r;
}
uint64_t SatAdd(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_add_overflow(a, b, &r) ? kMaxU64 : r;
}

uint64_t FreeBytes(const ShardInfo& s, uint64_t planned_bytes) {
  return planned_bytes >= s.memory_limit_bytes ? 0 : s.memory_limit_bytes - planned_bytes;
}

}  // namespace

uint64_t StateBytesPerElem(int world_size, size_t grad_dtype_bytes,
                           size_t param_dtype_bytes, bool has_second_moment) {
  const uint64_t workers = world_size > 0 ? static_cast<uint64_t>(world_size) : 0;
  return 4 /* fp32 master */ + 4 /* m */ + (has_second_moment ? 4 : 0) /* v */ +
         workers * grad_dtype_bytes /* aggregation slots */ +
         2 * param_dtype_bytes /* published versions */;
}

std::vector<ChunkSpec> SplitTensors(absl::Span<const uint64_t> tensor_num_elems,
                                    uint64_t max_chunk_elems) {
  if (max_chunk_elems == 0) max_chunk_elems = 1;
  std::vector<ChunkSpec> chunks;
  for (size_t t = 0; t < tensor_num_elems.size(); ++t) {
    const uint64_t n = tensor_num_elems[t];
    uint32_t index = 0;
    for (uint64_t offset = 0; offset < n; offset += max_chunk_elems) {
      ChunkSpec c;
      c.tensor = static_cast<uint32_t>(t);
      c.chunk = index++;
      c.offset_elems = offset;
      c.num_elems = std::min(max_chunk_elems, n - offset);
      chunks.push_back(c);
    }
  }
  return chunks;
}

absl::StatusOr<std::vector<ChunkSpec>> PlaceChunks(
    std::vector<ChunkSpec> chunks, absl::Span<const ShardInfo> live_shards,
    uint64_t bytes_per_elem) {
  if (live_shards.empty()) {
    return absl::FailedPreconditionError(
        "no live shards: register optimizer shard servers before creating a job");
  }
  // Shards in id order so that "first minimum" is "lowest id among ties".
  std::vector<ShardInfo> shards(live_shards.begin(), live_shards.end());
  std::sort(shards.begin(), shards.end(),
            [](const ShardInfo& a, const ShardInfo& b) { return a.id < b.id; });
  std::vector<uint64_t> planned_bytes(shards.size());
  for (size_t i = 0; i < shards.size(); ++i) planned_bytes[i] = shards[i].memory_planned_bytes;

  // Largest first; equal sizes in (tensor, chunk) order for determinism.
  std::vector<size_t> order(chunks.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (chunks[a].num_elems != chunks[b].num_elems) {
      return chunks[a].num_elems > chunks[b].num_elems;
    }
    if (chunks[a].tensor != chunks[b].tensor) return chunks[a].tensor < chunks[b].tensor;
    return chunks[a].chunk < chunks[b].chunk;
  });

  for (size_t idx : order) {
    ChunkSpec& c = chunks[idx];
    const uint64_t need_bytes = SatMul(c.num_elems, bytes_per_elem);
    int best = -1;
    for (bool want_dpu : {true, false}) {
      for (size_t i = 0; i < shards.size(); ++i) {
        if (shards[i].is_dpu != want_dpu) continue;
        if (need_bytes > FreeBytes(shards[i], planned_bytes[i])) continue;
        if (best < 0 || planned_bytes[i] < planned_bytes[best]) best = static_cast<int>(i);
      }
      if (best >= 0) break;
    }
    if (best < 0) {
      uint64_t job_bytes = 0;
      for (const ChunkSpec& x : chunks) job_bytes = SatAdd(job_bytes, SatMul(x.num_elems, bytes_per_elem));
      uint64_t free_total = 0, free_largest = 0;
      for (size_t i = 0; i < shards.size(); ++i) {
        // Free space before this job, as the operator would see it.
        const uint64_t f = FreeBytes(shards[i], shards[i].memory_planned_bytes);
        free_total = SatAdd(free_total, f);
        free_largest = std::max(free_largest, f);
      }
      return absl::ResourceExhaustedError(absl::StrFormat(
          "job state does not fit: needs %d bytes (%d bytes per element); "
          "%d bytes free over %d live shards, largest free %d bytes; "
          "chunk (tensor %d, chunk %d) of %d bytes fits on no shard",
          job_bytes, bytes_per_elem, free_total, shards.size(), free_largest, c.tensor,
          c.chunk, need_bytes));
    }
    c.shard_id = shards[best].id;
    planned_bytes[best] += need_bytes;
  }
  return chunks;
}

}  // namespace optimus
