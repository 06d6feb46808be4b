#include "coordinator/shard_map.h"

#include "kernels/optimizer_spec.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "kernels/optimizer_spec.h"

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

// PickShard's rule over the shards outside exclude_domain (0: all).
static int PickShardOutside(absl::Span<const ShardInfo> shards, uint64_t need_bytes,
                            uint64_t exclude_id, uint64_t exclude_domain);

uint64_t FailureDomainOf(absl::string_view failure_domain, absl::string_view hostname) {
  const absl::string_view name = failure_domain.empty() ? hostname : failure_domain;
  if (name.empty()) return 0;
  const uint64_t h = std::hash<std::string>()(std::string(name));
  return h == 0 ? 1 : h;
}

int PickShard(absl::Span<const ShardInfo> shards, uint64_t need_bytes, uint64_t exclude_id,
              uint64_t exclude_domain) {
  if (exclude_domain != 0) {
    // Outside the other copy's domain first; inside it only if that fails.
    if (int i = PickShardOutside(shards, need_bytes, exclude_id, exclude_domain); i >= 0) return i;
  }
  return PickShardOutside(shards, need_bytes, exclude_id, 0);
}

static int PickShardOutside(absl::Span<const ShardInfo> shards, uint64_t need_bytes,
                            uint64_t exclude_id, uint64_t exclude_domain) {
  for (bool want_dpu : {true, false}) {
    int best = -1;
    for (size_t i = 0; i < shards.size(); ++i) {
      const ShardInfo& s = shards[i];
      if (s.is_dpu != want_dpu || (exclude_id != 0 && s.id == exclude_id)) continue;
      if (exclude_domain != 0 && s.domain == exclude_domain) continue;
      if (need_bytes > FreeBytes(s, s.memory_planned_bytes)) continue;
      if (best < 0 || s.memory_planned_bytes < shards[best].memory_planned_bytes ||
          (s.memory_planned_bytes == shards[best].memory_planned_bytes &&
           s.id < shards[best].id)) {
        best = static_cast<int>(i);
      }
    }
    if (best >= 0) return best;
  }
  return -1;
}

PlacementIndex::PlacementIndex(absl::Span<const ShardInfo> shards)
    : shards_(shards.begin(), shards.end()),
      left_(shards.size(), -1),
      right_(shards.size(), -1),
      priority_(shards.size()),
      max_free_(shards.size(), 0) {
  // Fixed pseudo-random priorities (splitmix64): the tree's shape, never
  // its answers, depends on them.
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < shards_.size(); ++i) {
    x += 0x9e3779b97f4a7c15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    priority_[i] = z ^ (z >> 31);
    root_ = Insert(root_, static_cast<int>(i));
  }
}

bool PlacementIndex::Before(int a, int b) const {
  const ShardInfo& x = shards_[static_cast<size_t>(a)];
  const ShardInfo& y = shards_[static_cast<size_t>(b)];
  if (x.is_dpu != y.is_dpu) return x.is_dpu;
  if (x.memory_planned_bytes != y.memory_planned_bytes) {
    return x.memory_planned_bytes < y.memory_planned_bytes;
  }
  if (x.id != y.id) return x.id < y.id;
  return a < b;
}

uint64_t PlacementIndex::Free(int i) const {
  const ShardInfo& s = shards_[static_cast<size_t>(i)];
  return FreeBytes(s, s.memory_planned_bytes);
}

void PlacementIndex::Pull(int t) {
  uint64_t m = Free(t);
  if (left_[t] >= 0) m = std::max(m, max_free_[left_[t]]);
  if (right_[t] >= 0) m = std::max(m, max_free_[right_[t]]);
  max_free_[t] = m;
}

void PlacementIndex::Split(int t, int key, int* before, int* rest) {
  if (t < 0) {
    *before = *rest = -1;
    return;
  }
  if (Before(t, key)) {
    Split(right_[t], key, &right_[t], rest);
    *before = t;
  } else {
    Split(left_[t], key, before, &left_[t]);
    *rest = t;
  }
  Pull(t);
}

int PlacementIndex::Merge(int a, int b) {
  if (a < 0) return b;
  if (b < 0) return a;
  if (priority_[a] > priority_[b]) {
    right_[a] = Merge(right_[a], b);
    Pull(a);
    return a;
  }
  left_[b] = Merge(a, left_[b]);
  Pull(b);
  return b;
}

int PlacementIndex::Insert(int t, int node) {
  if (t < 0 || priority_[node] > priority_[t]) {
    Split(t, node, &left_[node], &right_[node]);
    Pull(node);
    return node;
  }
  if (Before(node, t)) {
    left_[t] = Insert(left_[t], node);
  } else {
    right_[t] = Insert(right_[t], node);
  }
  Pull(t);
  return t;
}

int PlacementIndex::Erase(int t, int node) {
  if (t == node) {
    const int merged = Merge(left_[t], right_[t]);
    left_[t] = right_[t] = -1;
    return merged;
  }
  if (Before(node, t)) {
    left_[t] = Erase(left_[t], node);
  } else {
    right_[t] = Erase(right_[t], node);
  }
  Pull(t);
  return t;
}

// The first node of tree t in pick order with room for need_bytes that is
// not exclude_id. A subtree whose most free bytes are too few is skipped
// whole; one that has room but only on exclude_id is walked down to it and
// back: at most one such path per search.
int PlacementIndex::Find(int t, uint64_t need_bytes, uint64_t exclude_id,
                         uint64_t exclude_domain) const {
  if (t < 0 || max_free_[t] < need_bytes) return -1;
  if (int found = Find(left_[t], need_bytes, exclude_id, exclude_domain); found >= 0) return found;
  const ShardInfo& s = shards_[static_cast<size_t>(t)];
  if (Free(t) >= need_bytes && !(exclude_id != 0 && s.id == exclude_id) &&
      !(exclude_domain != 0 && s.domain == exclude_domain)) {
    return t;
  }
  return Find(right_[t], need_bytes, exclude_id, exclude_domain);
}

int PlacementIndex::Pick(uint64_t need_bytes, uint64_t exclude_id, uint64_t exclude_domain) const {
  if (exclude_domain != 0) {
    if (int i = Find(root_, need_bytes, exclude_id, exclude_domain); i >= 0) return i;
  }
  return Find(root_, need_bytes, exclude_id, 0);
}

void PlacementIndex::AddPlanned(int i, uint64_t bytes) {
  root_ = Erase(root_, i);
  ShardInfo& s = shards_[static_cast<size_t>(i)];
  s.memory_planned_bytes = SatAdd(s.memory_planned_bytes, bytes);
  root_ = Insert(root_, i);
}

namespace {

// Chunk indices, largest first; equal sizes in (tensor, chunk) order for
// determinism.
std::vector<size_t> LargestFirst(const std::vector<ChunkSpec>& chunks) {
  std::vector<size_t> order(chunks.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (chunks[a].num_elems != chunks[b].num_elems) {
      return chunks[a].num_elems > chunks[b].num_elems;
    }
    if (chunks[a].tensor != chunks[b].tensor) return chunks[a].tensor < chunks[b].tensor;
    return chunks[a].chunk < chunks[b].chunk;
  });
  return order;
}

struct FreeSpace {
  uint64_t total = 0;
  uint64_t largest = 0;
};

FreeSpace FreeOver(absl::Span<const ShardInfo> shards) {
  FreeSpace f;
  for (const ShardInfo& s : shards) {
    const uint64_t b = FreeBytes(s, s.memory_planned_bytes);
    f.total = SatAdd(f.total, b);
    f.largest = std::max(f.largest, b);
  }
  return f;
}

// A chunk's bytes on its shard: its elements and its bookkeeping.
uint64_t ChunkNeed(uint64_t num_elems, uint64_t bytes_per_elem, uint64_t overhead) {
  return SatAdd(SatMul(num_elems, bytes_per_elem), overhead);
}

}  // namespace

absl::StatusOr<std::vector<ChunkSpec>> PlaceChunks(
    std::vector<ChunkSpec> chunks, absl::Span<const ShardInfo> live_shards,
    uint64_t bytes_per_elem, uint64_t chunk_overhead_bytes) {
  if (live_shards.empty()) {
    return absl::FailedPreconditionError(
        "no live shards: register optimizer shard servers before creating a job");
  }
  // memory_planned_bytes grows as chunks are placed.
  PlacementIndex shards(live_shards);
  for (size_t idx : LargestFirst(chunks)) {
    ChunkSpec& c = chunks[idx];
    const uint64_t need_bytes = ChunkNeed(c.num_elems, bytes_per_elem, chunk_overhead_bytes);
    const int best = shards.Pick(need_bytes, /*exclude_id=*/0);
    if (best < 0) {
      uint64_t job_bytes = 0;
      for (const ChunkSpec& x : chunks) job_bytes = SatAdd(job_bytes, ChunkNeed(x.num_elems, bytes_per_elem, chunk_overhead_bytes));
      // Free space before this job, as the operator would see it.
      const FreeSpace free = FreeOver(live_shards);
      return absl::ResourceExhaustedError(absl::StrFormat(
          "job state does not fit: needs %d bytes (%d bytes per element and %d per chunk); "
          "%d bytes free over %d live shards, largest free %d bytes; "
          "chunk (tensor %d, chunk %d) of %d bytes fits on no shard",
          job_bytes, bytes_per_elem, chunk_overhead_bytes, free.total, live_shards.size(),
          free.largest, c.tensor, c.chunk, need_bytes));
    }
    c.shard_id = shards.shard(best).id;
    shards.AddPlanned(best, need_bytes);
  }
  return chunks;
}

absl::StatusOr<std::vector<ChunkSpec>> PlaceBackups(
    std::vector<ChunkSpec> chunks, absl::Span<const ShardInfo> live_shards,
    uint64_t bytes_per_elem, uint64_t chunk_overhead_bytes) {
  if (live_shards.size() < 2) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "replication 1 needs at least 2 live shards (a chunk's backup lives on another "
        "shard than its primary); %d live",
        live_shards.size()));
  }
  // The job's primaries count on top of what other jobs planned.
  std::vector<ShardInfo> shards(live_shards.begin(), live_shards.end());
  absl::flat_hash_map<uint64_t, size_t> index_of;
  for (size_t i = 0; i < shards.size(); ++i) index_of.emplace(shards[i].id, i);
  uint64_t job_bytes = 0;
  for (const ChunkSpec& c : chunks) {
    const uint64_t need_bytes = ChunkNeed(c.num_elems, bytes_per_elem, chunk_overhead_bytes);
    job_bytes = SatAdd(job_bytes, need_bytes);
    if (auto it = index_of.find(c.shard_id); it != index_of.end()) {
      ShardInfo& s = shards[it->second];
      s.memory_planned_bytes = SatAdd(s.memory_planned_bytes, need_bytes);
    }
  }
  const FreeSpace after_primaries = FreeOver(shards);
  const auto primary_domain = [&](uint64_t id) -> uint64_t {
    auto it = index_of.find(id);
    return it == index_of.end() ? 0 : shards[it->second].domain;
  };
  PlacementIndex index(shards);
  for (size_t idx : LargestFirst(chunks)) {
    ChunkSpec& c = chunks[idx];
    const uint64_t need_bytes = ChunkNeed(c.num_elems, bytes_per_elem, chunk_overhead_bytes);
    const int best = index.Pick(need_bytes, /*exclude_id=*/c.shard_id, primary_domain(c.shard_id));
    if (best < 0) {
      return absl::ResourceExhaustedError(absl::StrFormat(
          "job state with replication 1 does not fit: needs %d bytes for the primaries "
          "and %d bytes for their backups (%d bytes per element and %d per chunk); after the primaries "
          "%d bytes are free over %d live shards, largest free %d bytes; the backup of "
          "chunk (tensor %d, chunk %d) of %d bytes fits on no shard other than its "
          "primary (shard %d)",
          job_bytes, job_bytes, bytes_per_elem, chunk_overhead_bytes,
          after_primaries.total, shards.size(),
          after_primaries.largest, c.tensor, c.chunk, need_bytes, c.shard_id));
    }
    c.backup_shard_id = index.shard(best).id;
    index.AddPlanned(best, need_bytes);
  }
  return chunks;
}

}  // namespace optimus
