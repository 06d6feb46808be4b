#include "coordinator/shard_map.h"

#include <algorithm>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/optimizer_spec.h"

namespace optimus {
namespace {

using ::testing::HasSubstr;

std::map<uint64_t, uint64_t> PlannedBytes(const std::vector<ChunkSpec>& chunks,
                                          absl::Span<const ShardInfo> shards,
                                          uint64_t bytes_per_elem) {
  std::map<uint64_t, uint64_t> planned;
  for (const ShardInfo& s : shards) planned[s.id] = s.memory_planned_bytes;
  for (const ChunkSpec& c : chunks) planned[c.shard_id] += c.num_elems * bytes_per_elem;
  return planned;
}

TEST(SplitTensorsTest, ChunksAreContiguousBoundedAndOrdered) {
  const std::vector<uint64_t> sizes = {10, 3, 0, 7};
  const std::vector<ChunkSpec> chunks = SplitTensors(sizes, 4);
  // 10 -> 4,4,2; 3 -> 3; 0 -> none; 7 -> 4,3.
  ASSERT_EQ(chunks.size(), 6u);
  EXPECT_EQ(chunks[0].tensor, 0u);
  EXPECT_EQ(chunks[2].num_elems, 2u);
  EXPECT_EQ(chunks[2].offset_elems, 8u);
  EXPECT_EQ(chunks[2].chunk, 2u);
  EXPECT_EQ(chunks[3].tensor, 1u);
  EXPECT_EQ(chunks[3].chunk, 0u);
  EXPECT_EQ(chunks[4].tensor, 3u);  // The empty tensor 2 has no chunk.
  EXPECT_EQ(chunks[5].offset_elems, 4u);
  EXPECT_EQ(chunks[5].num_elems, 3u);
}

TEST(SplitTensorsTest, ZeroMaxChunkIsTreatedAsOne) {
  EXPECT_EQ(SplitTensors({3}, 0).size(), 3u);
}

TEST(PlaceChunksTest, RandomShapesCoverEveryElementOnceWithinLimits) {
  std::mt19937_64 rng(12345);
  int num_placed = 0, num_refused = 0;
  for (int trial = 0; trial < 50; ++trial) {
    const int num_tensors = 1 + static_cast<int>(rng() % 20);
    std::vector<uint64_t> sizes;
    for (int t = 0; t < num_tensors; ++t) sizes.push_back(rng() % 5000);  // Some zero.
    const uint64_t max_chunk = 1 + rng() % 700;
    std::vector<ShardInfo> shards;
    const int num_shards = 1 + static_cast<int>(rng() % 6);
    for (int i = 0; i < num_shards; ++i) {
      shards.push_back({static_cast<uint64_t>(10 + i), (rng() % 2) == 0,
                        /*memory_limit_bytes=*/5000 + rng() % 40000,
                        /*memory_planned_bytes=*/rng() % 1000});
    }
    const uint64_t bpe = 1 + rng() % 4;
    std::vector<ChunkSpec> split = SplitTensors(sizes, max_chunk);
    absl::StatusOr<std::vector<ChunkSpec>> placed = PlaceChunks(split, shards, bpe, 0);
    uint64_t total = 0;
    for (uint64_t n : sizes) total += n;
    uint64_t capacity = 0;
    for (const ShardInfo& s : shards) capacity += s.memory_limit_bytes - s.memory_planned_bytes;
    if (!placed.ok()) {
      // Refusal is only allowed when the job is at least close to full.
      EXPECT_EQ(placed.status().code(), absl::StatusCode::kResourceExhausted);
      EXPECT_GT(total * bpe + max_chunk * bpe * num_shards, capacity);
      ++num_refused;
      continue;
    }
    ++num_placed;
    ASSERT_EQ(placed->size(), split.size());
    // Every element of every tensor exactly once, in order, bounded chunks.
    std::vector<uint64_t> next_offset(sizes.size(), 0);
    for (size_t i = 0; i < placed->size(); ++i) {
      const ChunkSpec& c = (*placed)[i];
      EXPECT_EQ(c.tensor, split[i].tensor);  // Input order kept.
      EXPECT_EQ(c.chunk, split[i].chunk);
      ASSERT_LT(c.tensor, sizes.size());
      EXPECT_EQ(c.offset_elems, next_offset[c.tensor]);
      EXPECT_GT(c.num_elems, 0u);
      EXPECT_LE(c.num_elems, max_chunk);
      next_offset[c.tensor] += c.num_elems;
      EXPECT_TRUE(std::any_of(shards.begin(), shards.end(),
                              [&](const ShardInfo& s) { return s.id == c.shard_id; }));
    }
    EXPECT_EQ(next_offset, sizes);
    // Memory limits never exceeded.
    const auto planned = PlannedBytes(*placed, shards, bpe);
    for (const ShardInfo& s : shards) EXPECT_LE(planned.at(s.id), s.memory_limit_bytes);
  }
  // The shapes are drawn so that both outcomes are exercised.
  EXPECT_GT(num_placed, 10);
  EXPECT_GT(num_refused, 0);
}

TEST(PlaceChunksTest, BalancedWithinOneChunkWhenAllShardsAreAlike) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<uint64_t> sizes;
    for (int t = 0; t < 30; ++t) sizes.push_back(1 + rng() % 10000);
    const uint64_t max_chunk = 1000, bpe = 16;
    std::vector<ShardInfo> shards;
    for (uint64_t id = 1; id <= 5; ++id) shards.push_back({id, true, uint64_t{1} << 40, 0});
    auto placed = PlaceChunks(SplitTensors(sizes, max_chunk), shards, bpe, 0);
    ASSERT_TRUE(placed.ok()) << placed.status();
    const auto planned = PlannedBytes(*placed, shards, bpe);
    uint64_t lo = UINT64_MAX, hi = 0;
    for (const auto& [id, bytes] : planned) {
      lo = std::min(lo, bytes);
      hi = std::max(hi, bytes);
    }
    EXPECT_LE(hi - lo, max_chunk * bpe);
  }
}

TEST(PlaceChunksTest, PrefersDpusAndSpillsToHostOnlyWhenFull) {
  const uint64_t bpe = 10;
  // Two DPUs with room for 2 chunks of 100 elems each; one big host.
  std::vector<ShardInfo> shards = {{1, false, 1000000, 0},
                                   {2, true, 2000, 0},
                                   {3, true, 2000, 0}};
  auto fits = PlaceChunks(SplitTensors({400}, 100), shards, bpe, 0);
  ASSERT_TRUE(fits.ok()) << fits.status();
  for (const ChunkSpec& c : *fits) EXPECT_NE(c.shard_id, 1u) << "host used while DPUs had room";

  auto spills = PlaceChunks(SplitTensors({600}, 100), shards, bpe, 0);
  ASSERT_TRUE(spills.ok()) << spills.status();
  const auto planned = PlannedBytes(*spills, shards, bpe);
  EXPECT_EQ(planned.at(2), 2000u);
  EXPECT_EQ(planned.at(3), 2000u);
  EXPECT_EQ(planned.at(1), 2000u);
}

TEST(PlaceChunksTest, IsDeterministicAndBreaksTiesByShardId) {
  std::vector<ShardInfo> shards = {{9, true, 1000, 0}, {4, true, 1000, 0}};
  auto a = PlaceChunks(SplitTensors({1}, 10), shards, 4, 0);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*a)[0].shard_id, 4u);
  // Bytes already planned by other jobs count.
  shards[1].memory_planned_bytes = 100;
  auto b = PlaceChunks(SplitTensors({1}, 10), shards, 4, 0);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ((*b)[0].shard_id, 9u);
}

TEST(PlaceChunksTest, RefusesWithTheNumbersWhenItDoesNotFit) {
  std::vector<ShardInfo> shards = {{1, true, 1000, 200}, {2, false, 300, 0}};
  // 3 chunks of 100 elems at 4 bytes: 1200 bytes; 800 + 300 bytes free.
  auto r = PlaceChunks(SplitTensors({300}, 100), shards, 4, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("needs 1200 bytes"));
  EXPECT_THAT(r.status().message(), HasSubstr("1100 bytes free over 2 live shards"));
  EXPECT_THAT(r.status().message(), HasSubstr("largest free 800 bytes"));
}

TEST(PlaceChunksTest, HugeJobsDoNotOverflowIntoFitting) {
  std::vector<ShardInfo> shards = {{1, true, 1000, 0}};
  auto r = PlaceChunks(SplitTensors({uint64_t{1} << 62}, uint64_t{1} << 62), shards, 16, 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(PlaceChunksTest, NoLiveShardsIsAnError) {
  auto r = PlaceChunks(SplitTensors({10}, 4), {}, 4, 0);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("no live shards"));
}

// What the coordinator places: each chunk also costs its bookkeeping on the
// shard (kernels::kChunkOverheadBytes), so a job cut into many tiny chunks
// is refused where its elements alone would fit.
TEST(PlaceChunksTest, EachChunkAlsoCostsItsBookkeeping) {
  const uint64_t room = 10 * (4 + kernels::kChunkOverheadBytes);
  std::vector<ShardInfo> shards = {{1, true, room, 0}};
  EXPECT_TRUE(PlaceChunks(SplitTensors({10}, 1), shards, 4).ok());  // Ten chunks fit.
  auto r = PlaceChunks(SplitTensors({11}, 1), shards, 4);  // Eleven do not.
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_TRUE(PlaceChunks(SplitTensors({11}, 11), shards, 4).ok());  // As one chunk they do.
}

}  // namespace
}  // namespace optimus

namespace optimus {
namespace {

TEST(PickShardTest, PrefersDpusThenFewestBytesThenLowerIdAndSkipsTheExcludedShard) {
  // Input order is not id order: ties still go to the lower id.
  std::vector<ShardInfo> shards = {{7, true, 1000, 100}, {3, true, 1000, 100},
                                   {5, false, 1000, 0}};
  EXPECT_EQ(shards[PickShard(shards, 10, 0)].id, 3u);
  EXPECT_EQ(shards[PickShard(shards, 10, 3)].id, 7u);   // The other copy's shard is skipped.
  EXPECT_EQ(shards[PickShard(shards, 950, 0)].id, 5u);  // No DPU has room: the host.
  EXPECT_EQ(PickShard(shards, 950, 5), -1);
  EXPECT_EQ(PickShard(shards, 1001, 0), -1);
  shards[0].memory_planned_bytes = 50;
  EXPECT_EQ(shards[PickShard(shards, 10, 0)].id, 7u);  // Fewer planned bytes wins.
}

TEST(PickShardTest, PrefersAShardOutsideTheOtherCopysFailureDomain) {
  // Shards 1 and 2 share a server (domain 10), 3 is in another (domain 20).
  std::vector<ShardInfo> shards = {{1, true, 1000, 0, 10}, {2, true, 1000, 0, 10},
                                   {3, true, 1000, 500, 20}};
  // The copy on shard 1: shard 2 has fewer planned bytes, but 3 is outside
  // the server that would take both copies down at once.
  EXPECT_EQ(shards[PickShard(shards, 100, 1, 10)].id, 3u);
  // Without a domain to avoid, the rule is unchanged.
  EXPECT_EQ(shards[PickShard(shards, 100, 1, 0)].id, 2u);
  // When nothing outside the domain has room, inside it rather than nowhere.
  EXPECT_EQ(shards[PickShard(shards, 600, 1, 10)].id, 2u);
  EXPECT_EQ(PickShard(shards, 1001, 1, 10), -1);
  EXPECT_EQ(FailureDomainOf("rack-7", "dpu-1"), FailureDomainOf("rack-7", "dpu-2"));
  EXPECT_NE(FailureDomainOf("", "dpu-1"), FailureDomainOf("", "dpu-2"));
  EXPECT_EQ(FailureDomainOf("", "node-3"), FailureDomainOf("node-3", "dpu-9"));
  EXPECT_EQ(FailureDomainOf("", ""), 0u);
}

TEST(PlaceBackupsTest, EachBackupLeavesItsPrimarysFailureDomainWhereOneHasRoom) {
  // 16 DPUs, four to a server: every backup on another server.
  std::vector<ShardInfo> shards;
  for (uint64_t i = 1; i <= 16; ++i) shards.push_back({i, true, 1000000, 0, 100 + (i - 1) / 4});
  std::map<uint64_t, uint64_t> domain;
  for (const ShardInfo& s : shards) domain[s.id] = s.domain;
  auto primaries = PlaceChunks(SplitTensors({50000, 7000, 333}, 1000), shards, 4, 0);
  ASSERT_TRUE(primaries.ok());
  auto placed = PlaceBackups(*primaries, shards, 4, 0);
  ASSERT_TRUE(placed.ok()) << placed.status();
  for (const ChunkSpec& c : *placed) {
    EXPECT_NE(domain[c.backup_shard_id], domain[c.shard_id])
        << "chunk (" << c.tensor << ", " << c.chunk << "): primary " << c.shard_id << " backup "
        << c.backup_shard_id << " on one server";
  }
  // Every shard on one host (a local cluster): backups are still placed,
  // each on another shard than its primary.
  for (ShardInfo& s : shards) s.domain = 7;
  placed = PlaceBackups(*primaries, shards, 4, 0);
  ASSERT_TRUE(placed.ok()) << placed.status();
  for (const ChunkSpec& c : *placed) EXPECT_NE(c.backup_shard_id, c.shard_id);
}

TEST(PlaceBackupsTest, EveryBackupIsOnAnotherShardAndLimitsHoldWithBackupsCounted) {
  std::mt19937_64 rng(99);
  int placed_jobs = 0, refused = 0;
  for (int trial = 0; trial < 60; ++trial) {
    std::vector<uint64_t> sizes;
    for (int t = 0; t < 1 + static_cast<int>(rng() % 10); ++t) sizes.push_back(1 + rng() % 3000);
    const uint64_t max_chunk = 1 + rng() % 500, bpe = 1 + rng() % 4;
    std::vector<ShardInfo> shards;
    const int num_shards = 2 + static_cast<int>(rng() % 4);
    for (int i = 0; i < num_shards; ++i) {
      shards.push_back({static_cast<uint64_t>(1 + i), (rng() % 2) == 0,
                        /*memory_limit_bytes=*/3000 + rng() % 20000, /*planned=*/rng() % 500});
    }
    auto primaries = PlaceChunks(SplitTensors(sizes, max_chunk), shards, bpe, 0);
    if (!primaries.ok()) continue;
    auto placed = PlaceBackups(*primaries, shards, bpe, 0);
    if (!placed.ok()) {
      EXPECT_EQ(placed.status().code(), absl::StatusCode::kResourceExhausted);
      ++refused;
      continue;
    }
    ++placed_jobs;
    std::map<uint64_t, uint64_t> planned;
    for (const ShardInfo& s : shards) planned[s.id] = s.memory_planned_bytes;
    ASSERT_EQ(placed->size(), primaries->size());
    for (size_t i = 0; i < placed->size(); ++i) {
      const ChunkSpec& c = (*placed)[i];
      EXPECT_EQ(c.shard_id, (*primaries)[i].shard_id);  // Primaries stay where they were.
      EXPECT_NE(c.backup_shard_id, 0u);
      EXPECT_NE(c.backup_shard_id, c.shard_id);
      planned[c.shard_id] += c.num_elems * bpe;
      planned[c.backup_shard_id] += c.num_elems * bpe;
    }
    for (const ShardInfo& s : shards) EXPECT_LE(planned.at(s.id), s.memory_limit_bytes);
  }
  EXPECT_GT(placed_jobs, 10);
  EXPECT_GT(refused, 0);
}

TEST(PlaceBackupsTest, BackupsFollowThePlacementRuleAfterThePrimaries) {
  // Two DPUs with room for the primaries only, one host: the backups spill
  // to the host; with a third DPU they go there instead.
  const uint64_t bpe = 10;
  std::vector<ShardInfo> shards = {{1, true, 2000, 0}, {2, true, 2000, 0},
                                   {3, false, 1000000, 0}};
  auto primaries = PlaceChunks(SplitTensors({400}, 100), shards, bpe, 0);
  ASSERT_TRUE(primaries.ok());
  auto placed = PlaceBackups(*primaries, shards, bpe, 0);
  ASSERT_TRUE(placed.ok()) << placed.status();
  for (const ChunkSpec& c : *placed) EXPECT_EQ(c.backup_shard_id, 3u);

  // DPUs with room: backups stay off the host, each on the other DPU.
  shards[0].memory_limit_bytes = shards[1].memory_limit_bytes = 1000000;
  primaries = PlaceChunks(SplitTensors({400}, 100), shards, bpe, 0);
  ASSERT_TRUE(primaries.ok());
  placed = PlaceBackups(*primaries, shards, bpe, 0);
  ASSERT_TRUE(placed.ok()) << placed.status();
  for (const ChunkSpec& c : *placed) {
    EXPECT_NE(c.backup_shard_id, 3u) << "host used while a DPU had room";
    EXPECT_EQ(c.backup_shard_id, c.shard_id == 1 ? 2u : 1u);
  }
}

TEST(PlaceBackupsTest, OneShardIsRefusedAndTooLittleRoomNamesTheNumbers) {
  std::vector<ShardInfo> one = {{1, true, 1 << 20, 0}};
  auto primaries = PlaceChunks(SplitTensors({300}, 100), one, 4, 0);
  ASSERT_TRUE(primaries.ok());
  auto r = PlaceBackups(*primaries, one, 4, 0);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(r.status().message(), HasSubstr("at least 2 live shards"));
  EXPECT_THAT(r.status().message(), HasSubstr("1 live"));

  // 3 chunks of 400 bytes: two primaries on shard 1, one on shard 2, which
  // leaves 700 + 100 bytes free; the backup of a chunk on shard 1 must go to
  // shard 2 and does not fit.
  std::vector<ShardInfo> two = {{1, true, 1500, 0}, {2, true, 500, 0}};
  primaries = PlaceChunks(SplitTensors({300}, 100), two, 4, 0);
  ASSERT_TRUE(primaries.ok());
  r = PlaceBackups(*primaries, two, 4, 0);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("1200 bytes for the primaries"));
  EXPECT_THAT(r.status().message(), HasSubstr("1200 bytes for their backups"));
  EXPECT_THAT(r.status().message(), HasSubstr("800 bytes are free over 2 live shards"));
  EXPECT_THAT(r.status().message(), HasSubstr("largest free 700 bytes"));
  EXPECT_THAT(r.status().message(), HasSubstr("other than its primary (shard 1)"));
}

// ---- The indexed placement against the scan it replaced ----

// PickShard's scan as placement used it before PlacementIndex (and as
// TakeSlot still does): the reference the index must agree with.
int ReferencePick(const std::vector<ShardInfo>& shards, uint64_t need, uint64_t exclude_id) {
  for (bool want_dpu : {true, false}) {
    int best = -1;
    for (size_t i = 0; i < shards.size(); ++i) {
      const ShardInfo& s = shards[i];
      if (s.is_dpu != want_dpu || (exclude_id != 0 && s.id == exclude_id)) continue;
      const uint64_t free =
          s.memory_planned_bytes >= s.memory_limit_bytes ? 0 : s.memory_limit_bytes - s.memory_planned_bytes;
      if (need > free) continue;
      if (best < 0 || s.memory_planned_bytes < shards[best].memory_planned_bytes ||
          (s.memory_planned_bytes == shards[best].memory_planned_bytes && s.id < shards[best].id)) {
        best = static_cast<int>(i);
      }
    }
    if (best >= 0) return best;
  }
  return -1;
}

// The old PlaceChunks + PlaceBackups, scan by scan: a vector of shards,
// the largest chunk first (ties in (tensor, chunk) order). The chunks'
// shard ids, or {} where some copy fits nowhere.
std::vector<std::pair<uint64_t, uint64_t>> ReferencePlace(std::vector<ChunkSpec> chunks,
                                                          std::vector<ShardInfo> shards,
                                                          uint64_t bpe, uint64_t overhead,
                                                          bool backups) {
  std::vector<size_t> order(chunks.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (chunks[a].num_elems != chunks[b].num_elems) return chunks[a].num_elems > chunks[b].num_elems;
    if (chunks[a].tensor != chunks[b].tensor) return chunks[a].tensor < chunks[b].tensor;
    return chunks[a].chunk < chunks[b].chunk;
  });
  for (int pass = 0; pass < (backups ? 2 : 1); ++pass) {
    for (size_t idx : order) {
      ChunkSpec& c = chunks[idx];
      const uint64_t need = c.num_elems * bpe + overhead;
      const int best = ReferencePick(shards, need, pass == 0 ? 0 : c.shard_id);
      if (best < 0) return {};
      (pass == 0 ? c.shard_id : c.backup_shard_id) = shards[best].id;
      shards[best].memory_planned_bytes += need;
    }
  }
  std::vector<std::pair<uint64_t, uint64_t>> out;
  for (const ChunkSpec& c : chunks) out.emplace_back(c.shard_id, c.backup_shard_id);
  return out;
}

// Shards as a fleet looks: mostly alike (one memory size, DPUs), some
// hosts, some other sizes, some nearly full; ids distinct, not in order.
std::vector<ShardInfo> RandomFleet(std::mt19937_64& rng, int n) {
  std::vector<ShardInfo> shards;
  const uint64_t common_limit = 20000 + rng() % 60000;
  for (int i = 0; i < n; ++i) {
    ShardInfo s;
    s.id = 1 + static_cast<uint64_t>(i) * 7 % 1009 + (rng() % 3 == 0 ? 2000 : 0);
    s.is_dpu = rng() % 4 != 0;
    s.memory_limit_bytes = rng() % 3 == 0 ? 1 + rng() % 100000 : common_limit;
    // Equal planned bytes are common (fresh shards): ties by id matter.
    s.memory_planned_bytes = rng() % 2 == 0 ? 0 : rng() % (s.memory_limit_bytes + 5000);
    shards.push_back(s);
  }
  std::shuffle(shards.begin(), shards.end(), rng);
  return shards;
}

TEST(PlacementIndexTest, PicksWhatTheScanPicksAsPlannedBytesGrow) {
  std::mt19937_64 rng(20261124);
  int picks = 0, misses = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<ShardInfo> shards = RandomFleet(rng, 1 + static_cast<int>(rng() % 40));
    PlacementIndex index(shards);
    for (int step = 0; step < 60; ++step) {
      const uint64_t need = rng() % 4 == 0 ? 0 : rng() % 30000;
      const uint64_t exclude = rng() % 2 == 0 ? 0 : shards[rng() % shards.size()].id;
      const int want = ReferencePick(shards, need, exclude);
      const int got = index.Pick(need, exclude);
      ASSERT_EQ(got, want) << "trial " << trial << " step " << step << " need " << need
                           << " exclude " << exclude;
      if (want < 0) {
        ++misses;
        continue;
      }
      ++picks;
      // Saturating, as placement adds.
      const uint64_t add = rng() % 16 == 0 ? ~uint64_t{0} : need;
      index.AddPlanned(want, add);
      ShardInfo& s = shards[static_cast<size_t>(want)];
      s.memory_planned_bytes =
          s.memory_planned_bytes > ~uint64_t{0} - add ? ~uint64_t{0} : s.memory_planned_bytes + add;
      ASSERT_EQ(index.shard(want).memory_planned_bytes, s.memory_planned_bytes);
    }
  }
  // Both outcomes were exercised.
  EXPECT_GT(picks, 1000);
  EXPECT_GT(misses, 100);
}

TEST(PlacementIndexTest, PicksWhatTheScanPicksOutsideAFailureDomain) {
  std::mt19937_64 rng(20261125);
  int outside = 0, fell_back = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<ShardInfo> shards = RandomFleet(rng, 1 + static_cast<int>(rng() % 40));
    for (ShardInfo& s : shards) s.domain = rng() % 5;  // 0: unknown.
    PlacementIndex index(shards);
    for (int step = 0; step < 60; ++step) {
      const uint64_t need = rng() % 30000;
      const ShardInfo& other = shards[rng() % shards.size()];
      const uint64_t exclude = rng() % 4 == 0 ? 0 : other.id;
      const uint64_t domain = rng() % 4 == 0 ? 0 : other.domain;
      const int want = PickShard(shards, need, exclude, domain);
      ASSERT_EQ(index.Pick(need, exclude, domain), want)
          << "trial " << trial << " step " << step << " need " << need << " exclude " << exclude
          << " domain " << domain;
      if (want < 0) continue;
      if (domain == 0 || shards[static_cast<size_t>(want)].domain != domain) {
        ++outside;
      } else {
        // Inside the domain only when no shard outside it had room.
        ++fell_back;
        for (const ShardInfo& s : shards) {
          if (s.domain == domain || s.id == exclude) continue;
          EXPECT_GT(need, s.memory_planned_bytes >= s.memory_limit_bytes
                              ? 0
                              : s.memory_limit_bytes - s.memory_planned_bytes);
        }
      }
      index.AddPlanned(want, need);
      shards[static_cast<size_t>(want)].memory_planned_bytes += need;
    }
  }
  EXPECT_GT(outside, 1000);
  EXPECT_GT(fell_back, 10);
}

TEST(PlacementIndexTest, PlacesJobsExactlyAsTheScanDid) {
  std::mt19937_64 rng(777);
  int placed = 0, refused = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const std::vector<ShardInfo> shards = RandomFleet(rng, 1 + static_cast<int>(rng() % 30));
    std::vector<uint64_t> sizes;
    const int num_tensors = 1 + static_cast<int>(rng() % 8);
    for (int t = 0; t < num_tensors; ++t) sizes.push_back(rng() % 3000);
    const std::vector<ChunkSpec> chunks = SplitTensors(sizes, 1 + rng() % 500);
    const uint64_t bpe = 1 + rng() % 16;
    const uint64_t overhead = rng() % 2 == 0 ? 0 : rng() % 2000;
    const bool backups = rng() % 2 == 0 && shards.size() >= 2;
    const auto want = ReferencePlace(chunks, shards, bpe, overhead, backups);
    absl::StatusOr<std::vector<ChunkSpec>> got = PlaceChunks(chunks, shards, bpe, overhead);
    if (got.ok() && backups) got = PlaceBackups(*std::move(got), shards, bpe, overhead);
    if (want.empty() && !chunks.empty()) {
      EXPECT_EQ(got.status().code(), absl::StatusCode::kResourceExhausted)
          << "trial " << trial << ": " << got.status();
      ++refused;
      continue;
    }
    ASSERT_TRUE(got.ok()) << "trial " << trial << ": " << got.status();
    std::vector<std::pair<uint64_t, uint64_t>> ids;
    for (const ChunkSpec& c : *got) ids.emplace_back(c.shard_id, c.backup_shard_id);
    EXPECT_EQ(ids, want) << "trial " << trial;
    ++placed;
  }
  EXPECT_GT(placed, 50);
  EXPECT_GT(refused, 20);
}

}  // namespace
}  // namespace optimus
