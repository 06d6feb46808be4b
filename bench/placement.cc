// bench/placement: what placing a job costs the coordinator (issue 16
// item 3), without gRPC: LLaMA-70B (69e9 parameters in chunks of 2 Mi
// elements, the default 4 MiB bf16 push) placed with its backups
// (PlaceChunks + PlaceBackups, coordinator/shard_map.h) over N equal DPU
// shards, through the PlacementIndex the coordinator uses now, and through
// the scan of every shard per chunk it used before (PickShard's loop, kept
// here as it was). Both must give the same placement: the line says whether
// they did.
//
// One JSON line per N: chunks, the indexed placement's time (best of
// --repeat), the scan's (once; --scan=false skips it), and "same".
//
// Usage: bazel run -c opt //bench:placement -- [--shards=1000,4000,16384]
//        [--repeat=3] [--scan=true]
#include <algorithm>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/json.h"
#include "common/model_presets.h"
#include "coordinator/shard_map.h"

ABSL_FLAG(std::string, shards, "1000,4000,16384", "numbers of shards N, one line each");
ABSL_FLAG(int, repeat, 3, "runs of the indexed placement per N (the best is reported)");
ABSL_FLAG(bool, scan, true, "also time the scan of every shard per chunk (slow at large N)");

namespace optimus {
namespace {

constexpr uint64_t kChunkElems = uint64_t{2} << 20;
constexpr uint64_t kBytesPerElem = 24;  // AdamW, bf16, with the forwarded sum.

std::vector<ChunkSpec> ScanPlace(std::vector<ChunkSpec> chunks, std::vector<ShardInfo> shards,
                                 uint64_t overhead) {
  std::vector<size_t> order(chunks.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (chunks[a].num_elems != chunks[b].num_elems) return chunks[a].num_elems > chunks[b].num_elems;
    if (chunks[a].tensor != chunks[b].tensor) return chunks[a].tensor < chunks[b].tensor;
    return chunks[a].chunk < chunks[b].chunk;
  });
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t idx : order) {
      ChunkSpec& c = chunks[idx];
      const uint64_t need = c.num_elems * kBytesPerElem + overhead;
      const int best = PickShard(shards, need, pass == 0 ? 0 : c.shard_id);
      if (best < 0) return {};
      (pass == 0 ? c.shard_id : c.backup_shard_id) = shards[best].id;
      shards[best].memory_planned_bytes += need;
    }
  }
  return chunks;
}

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  absl::StatusOr<ModelPreset> model = FindModelPreset("llama-70b");
  if (!model.ok()) {
    std::fprintf(stderr, "placement: %s\n", std::string(model.status().message()).c_str());
    return 1;
  }
  std::vector<uint64_t> sizes;
  for (const PresetTensor& t : model->tensors) sizes.push_back(t.num_elems());
  const std::vector<ChunkSpec> chunks = SplitTensors(sizes, kChunkElems);
  const uint64_t overhead = kernels::ChunkOverheadBytes(1);
  for (absl::string_view field :
       absl::StrSplit(absl::GetFlag(FLAGS_shards), ',', absl::SkipEmpty())) {
    int n = 0;
    if (!absl::SimpleAtoi(field, &n) || n < 2) {
      std::fprintf(stderr, "placement: --shards: \"%s\" is not a number >= 2\n",
                   std::string(field).c_str());
      return 1;
    }
    // Room for the job with its backups twice over.
    const uint64_t limit =
        std::max<uint64_t>(uint64_t{64} << 30, model->num_params() * kBytesPerElem * 4 / n);
    std::vector<ShardInfo> shards;
    for (int i = 0; i < n; ++i) shards.push_back({static_cast<uint64_t>(i + 1), true, limit, 0});
    double best_s = 1e30;
    std::vector<ChunkSpec> indexed;
    for (int r = 0; r < std::max(1, absl::GetFlag(FLAGS_repeat)); ++r) {
      const absl::Time start = absl::Now();
      absl::StatusOr<std::vector<ChunkSpec>> placed =
          PlaceChunks(chunks, shards, kBytesPerElem, overhead);
      if (placed.ok()) placed = PlaceBackups(*std::move(placed), shards, kBytesPerElem, overhead);
      best_s = std::min(best_s, absl::ToDoubleSeconds(absl::Now() - start));
      if (!placed.ok()) {
        std::fprintf(stderr, "placement: %s\n", std::string(placed.status().message()).c_str());
        return 1;
      }
      indexed = *std::move(placed);
    }
    Json line{{"bench", "placement"},
              {"shards", n},
              {"chunks", chunks.size()},
              {"params", model->num_params()},
              {"replication", 1},
              {"indexed_s", JsonRound(best_s, 4)}};
    if (absl::GetFlag(FLAGS_scan)) {
      const absl::Time start = absl::Now();
      const std::vector<ChunkSpec> scanned = ScanPlace(chunks, shards, overhead);
      line["scan_s"] = JsonRound(absl::ToDoubleSeconds(absl::Now() - start), 3);
      bool same = scanned.size() == indexed.size();
      for (size_t i = 0; same && i < scanned.size(); ++i) {
        same = scanned[i].shard_id == indexed[i].shard_id &&
               scanned[i].backup_shard_id == indexed[i].backup_shard_id;
      }
      line["same"] = same;
    }
    std::printf("%s\n", JsonDump(line).c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace
}  // namespace optimus

int main(int argc, char** argv) { return optimus::Main(argc, argv); }
