// Shard-map math of the coordinator: how tensors are cut into contiguous
// chunks, and where chunks go (what an element costs on a shard is
// kernels::ShardBytesPerElem's to say).
// Pure functions over plain structs (no proto, no clock); they own nothing
// and are safe to call from any thread.
#ifndef OPTIMUS_COORDINATOR_SHARD_MAP_H_
#define OPTIMUS_COORDINATOR_SHARD_MAP_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/optimizer_spec.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace optimus {

// A live shard as the placer sees it.
struct ShardInfo {
  uint64_t id = 0;
  bool is_dpu = false;
  uint64_t memory_limit_bytes = 0;
  // Bytes already placed on this shard by other jobs.
  uint64_t memory_planned_bytes = 0;
  // Its failure domain (FailureDomainOf); 0: unknown, shared with no shard.
  uint64_t domain = 0;
};

// A shard's failure domain as a number, from what it registered with:
// equal for shards with the same failure_domain (or, where that is empty,
// the same hostname); 0 when both are empty.
uint64_t FailureDomainOf(absl::string_view failure_domain, absl::string_view hostname);

// One contiguous slice [offset_elems, offset_elems + num_elems) of a tensor.
struct ChunkSpec {
  uint32_t tensor = 0;  // Index of the tensor in the job spec.
  uint32_t chunk = 0;   // Index of the chunk within its tensor.
  uint64_t offset_elems = 0;
  uint64_t num_elems = 0;
  uint64_t shard_id = 0;  // Primary; 0 until placed.
  // Backup (replication 1): another shard holding a full copy; 0 for none.
  uint64_t backup_shard_id = 0;
};

// A job's default chunk: 4 MiB of gradient payload per push (JobSpec
// chunk_payload_bytes; 2 Mi elements of bf16). Large enough that per-message
// overheads vanish and the transport reaches its plateau (bench/dataplane),
// small enough that a layer's push pipelines over several shards.
inline constexpr uint64_t kDefaultChunkPayloadBytes = uint64_t{4} << 20;

// Cuts each tensor into contiguous chunks of at most max_chunk_elems
// elements (all full-size except possibly the last of each tensor), in
// tensor order then offset order, with shard_id = 0. A tensor with zero
// elements gets no chunk: there is nothing to store or update for it.
// max_chunk_elems == 0 is treated as 1.
std::vector<ChunkSpec> SplitTensors(absl::Span<const uint64_t> tensor_num_elems,
                                    uint64_t max_chunk_elems);

// Assigns shard_id to every chunk, each chunk costing
// num_elems * bytes_per_elem bytes. Greedy, largest chunk first: a chunk
// goes to the DPU shard with the fewest planned bytes among those where it
// still fits under memory_limit_bytes; only if no DPU fits, to the host
// shard chosen the same way. Ties are broken by the lower shard id, so the
// result depends only on the inputs. Returns the chunks in their input order.
// Each pick goes through a PlacementIndex: O(chunks log shards) in all.
// Errors: FAILED_PRECONDITION when live_shards is empty ("no live shards");
// RESOURCE_EXHAUSTED when some chunk fits nowhere, with the bytes the job
// needs, the free bytes over the live shards and the largest free space.
// A chunk costs num_elems * bytes_per_elem + chunk_overhead_bytes (its
// bookkeeping on the shard; tests of the placement arithmetic pass 0).
absl::StatusOr<std::vector<ChunkSpec>> PlaceChunks(
    std::vector<ChunkSpec> chunks, absl::Span<const ShardInfo> live_shards,
    uint64_t bytes_per_elem, uint64_t chunk_overhead_bytes = kernels::kChunkOverheadBytes);

// The placement rule for one more copy of need_bytes: among the DPU shards
// where it still fits (memory_planned_bytes + need_bytes <= limit), the one
// with the fewest planned bytes, ties by the lower id; only if no DPU fits,
// the host shard chosen the same way. The shard with id exclude_id (the
// chunk's other copy; 0: none) is never chosen, and shards in
// exclude_domain (that copy's failure domain; 0: none) only when no shard
// outside it has room. Returns the index into `shards`, or -1 when none
// fits. PlaceChunks, PlaceBackups and the coordinator's failover and drain
// all choose with it.
int PickShard(absl::Span<const ShardInfo> shards, uint64_t need_bytes, uint64_t exclude_id,
              uint64_t exclude_domain = 0);

// PickShard's rule over shards whose planned bytes grow as copies are
// placed, in O(log n) per pick rather than PickShard's scan of every
// shard: the shards are kept in a treap ordered by (DPU before host,
// planned bytes, id), each node knowing the most free bytes in its
// subtree, so the first shard in that order where a copy fits is found in
// one descent. Same answers as PickShard over shards() (shard ids must be
// distinct, as the registry's are). Not thread-safe; owns copies.
class PlacementIndex {
 public:
  explicit PlacementIndex(absl::Span<const ShardInfo> shards);
  // PickShard(shards(), need_bytes, exclude_id, exclude_domain): an index
  // into shards(), or -1 when no shard other than exclude_id has room. The
  // search outside exclude_domain walks down, at most, to each shard of
  // that domain with room: O(domain size x log n).
  int Pick(uint64_t need_bytes, uint64_t exclude_id, uint64_t exclude_domain = 0) const;
  // Adds `bytes` to shard i's planned bytes (saturating at 2^64 - 1).
  void AddPlanned(int i, uint64_t bytes);
  const ShardInfo& shard(int i) const { return shards_[static_cast<size_t>(i)]; }
  const std::vector<ShardInfo>& shards() const { return shards_; }

 private:
  bool Before(int a, int b) const;  // In pick order.
  uint64_t Free(int i) const;
  void Pull(int t);
  // Splits tree t into the nodes before node `key` and the rest.
  void Split(int t, int key, int* before, int* rest);
  int Merge(int a, int b);
  int Insert(int t, int node);
  int Erase(int t, int node);
  int Find(int t, uint64_t need_bytes, uint64_t exclude_id, uint64_t exclude_domain) const;

  std::vector<ShardInfo> shards_;
  std::vector<int> left_, right_;
  std::vector<uint64_t> priority_, max_free_;
  int root_ = -1;
};

// Replication 1: assigns backup_shard_id to every chunk of an already
// placed job (shard_id set by PlaceChunks), on a shard other than its
// primary, outside the primary's failure domain where one has room, with
// PickShard's rule, largest chunk first; each backup costs
// num_elems * bytes_per_elem like its primary. `live_shards` carry the
// bytes planned before this job; the job's primaries count on top of them.
// Returns the chunks in their input order.
// Errors: FAILED_PRECONDITION with fewer than 2 live shards (a backup must
// live on another shard than its primary); RESOURCE_EXHAUSTED when some
// backup fits nowhere, with the bytes of the primaries and of the backups,
// the free bytes left over the live shards after the primaries and the
// largest free space.
absl::StatusOr<std::vector<ChunkSpec>> PlaceBackups(
    std::vector<ChunkSpec> chunks, absl::Span<const ShardInfo> live_shards,
    uint64_t bytes_per_elem, uint64_t chunk_overhead_bytes = kernels::kChunkOverheadBytes);

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_SHARD_MAP_H_
