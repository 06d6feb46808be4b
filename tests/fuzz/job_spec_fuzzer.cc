// Fuzz target: the coordinator's validation of a JobSpec (coordinator/
// job_spec.h), on a spec as CreateJob receives it (the serialized proto)
// and then what the coordinator does with an accepted spec: cut its tensors
// into chunks and place them (coordinator/shard_map.h). Checks that a bad
// spec is answered with INVALID_ARGUMENT, never a crash, and that an
// accepted one holds what CheckAndFillSpec promises: filled defaults,
// idempotence, a chunk count within kMaxChunksPerJob and chunks that cover
// every tensor exactly.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "coordinator/job_spec.h"
#include "coordinator/shard_map.h"
#include "proto/optimus.pb.h"

namespace {

void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "job_spec_fuzzer: invariant broken: %s\n", what);
    std::abort();
  }
}

// Splitting and placing more chunks than this per input would only make the
// fuzzer slow; the chunk-count limit itself is checked for every input.
constexpr uint64_t kMaxChunksToPlace = 4096;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  optimus::v1::JobSpec spec;
  if (!spec.ParseFromArray(data, static_cast<int>(size))) return 0;
  absl::StatusOr<optimus::CheckedSpec> checked = optimus::CheckAndFillSpec(spec);
  if (!checked.ok()) {
    // A malformed spec is INVALID_ARGUMENT; a well-formed one over a job
    // quota (chunks, tensors, bytes) is RESOURCE_EXHAUSTED.
    const absl::StatusCode code = checked.status().code();
    Require(code == absl::StatusCode::kInvalidArgument ||
                (code == absl::StatusCode::kResourceExhausted &&
                 absl::StrContains(checked.status().message(), "job quota")),
            "a bad spec is INVALID_ARGUMENT, or RESOURCE_EXHAUSTED over a quota");
    return 0;
  }
  Require(!spec.name().empty() && spec.world_size() >= 1 && spec.replication() <= 1,
          "accepted spec has a name, workers, replication 0 or 1");
  Require(checked->tensor_num_elems.size() == static_cast<size_t>(spec.tensors_size()),
          "one element count per tensor");
  uint64_t sum = 0;
  for (uint64_t n : checked->tensor_num_elems) {
    Require(n >= 1, "every tensor has an element");
    sum += n;
  }
  Require(sum == checked->num_params, "num_params is the sum");
  Require(checked->bytes_per_elem > 0 && checked->state_bytes_per_elem > 0,
          "an element costs bytes");
  Require(spec.max_chunk_bytes() >= 4, "max_chunk_bytes filled");
  Require(spec.optimizer().grad_scale() > 0 && std::isfinite(spec.optimizer().grad_scale()),
          "grad_scale filled");
  Require(spec.optimizer().lr() > 0 && std::isfinite(spec.optimizer().lr()), "lr positive");

  // Checking the filled spec again (a restore does) accepts it unchanged.
  optimus::v1::JobSpec again = spec;
  absl::StatusOr<optimus::CheckedSpec> rechecked = optimus::CheckAndFillSpec(again);
  Require(rechecked.ok(), "a filled spec checks again");
  Require(again.SerializeAsString() == spec.SerializeAsString(), "filling is idempotent");
  Require(rechecked->bytes_per_elem == checked->bytes_per_elem &&
              rechecked->num_params == checked->num_params,
          "the same spec costs the same");

  // The chunks CreateJob would make, and their placement.
  const uint64_t max_chunk_elems = spec.max_chunk_bytes() / 4;
  uint64_t num_chunks = 0;
  for (uint64_t n : checked->tensor_num_elems) num_chunks += (n + max_chunk_elems - 1) / max_chunk_elems;
  Require(num_chunks <= optimus::kMaxChunksPerJob, "chunk count within the limit");
  if (num_chunks > kMaxChunksToPlace) return 0;
  std::vector<optimus::ChunkSpec> chunks =
      optimus::SplitTensors(checked->tensor_num_elems, max_chunk_elems);
  Require(chunks.size() == num_chunks, "SplitTensors makes the chunks counted");
  std::vector<uint64_t> covered(checked->tensor_num_elems.size(), 0);
  for (const optimus::ChunkSpec& c : chunks) {
    Require(c.tensor < covered.size(), "a chunk names a tensor of the spec");
    Require(c.offset_elems == covered[c.tensor], "chunks are contiguous");
    Require(c.num_elems >= 1 && c.num_elems <= max_chunk_elems, "chunk size within the limit");
    covered[c.tensor] += c.num_elems;
  }
  Require(covered == checked->tensor_num_elems, "chunks cover every tensor");
  const std::vector<optimus::ShardInfo> shards = {{1, true, uint64_t{16} << 30, 0},
                                                  {2, false, uint64_t{64} << 30, 0}};
  auto placed = optimus::PlaceChunks(chunks, shards, checked->bytes_per_elem);
  if (placed.ok()) {
    for (const optimus::ChunkSpec& c : *placed) Require(c.shard_id == 1 || c.shard_id == 2, "placed");
    if (spec.replication() == 1) {
      auto backups = optimus::PlaceBackups(*placed, shards, checked->bytes_per_elem);
      if (backups.ok()) {
        for (const optimus::ChunkSpec& c : *backups) {
          Require(c.backup_shard_id != 0 && c.backup_shard_id != c.shard_id,
                  "a backup lives on another shard");
        }
      }
    }
  } else {
    Require(placed.status().code() == absl::StatusCode::kResourceExhausted,
            "a job that does not fit is RESOURCE_EXHAUSTED");
  }
  return 0;
}
