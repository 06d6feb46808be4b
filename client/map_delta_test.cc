#include "client/map_delta.h"

#include <set>

#include "gtest/gtest.h"
#include "proto/optimus.pb.h"

namespace optimus {
namespace {

v1::ChunkPlacement Chunk(uint32_t tensor, uint32_t chunk, uint64_t offset, uint64_t n,
                         uint64_t primary, uint64_t backup) {
  v1::ChunkPlacement c;
  c.set_tensor(tensor);
  c.set_chunk(chunk);
  c.set_offset_elems(offset);
  c.set_num_elems(n);
  c.set_shard_id(primary);
  c.set_backup_shard_id(backup);
  return c;
}

v1::ShardEndpoint Endpoint(uint64_t id) {
  v1::ShardEndpoint e;
  e.set_shard_id(id);
  e.set_data_address("addr-" + std::to_string(id));
  return e;
}

// Shards 1, 2, 3 hold two tensors of two chunks each, with backups.
v1::ShardMap Base() {
  v1::ShardMap m;
  m.set_job_id(7);
  m.set_epoch(3);
  *m.add_chunks() = Chunk(0, 0, 0, 100, 1, 2);
  *m.add_chunks() = Chunk(0, 1, 100, 50, 2, 3);
  *m.add_chunks() = Chunk(1, 0, 0, 80, 3, 1);
  *m.add_chunks() = Chunk(1, 1, 80, 80, 2, 1);
  for (uint64_t id : {1, 2, 3}) *m.add_shards() = Endpoint(id);
  return m;
}

std::set<uint64_t> Endpoints(const v1::ShardMap& m) {
  std::set<uint64_t> out;
  for (const auto& e : m.shards()) out.insert(e.shard_id());
  return out;
}

// Shard 1 was lost at epoch 4: its primary (tensor 0 chunk 0) went to its
// backup 2 with a new backup on shard 4, and its backups moved to 4 too.
v1::ShardMap FailoverOfShard1() {
  v1::ShardMap d;
  d.set_job_id(7);
  d.set_epoch(4);
  *d.add_chunks() = Chunk(0, 0, 0, 100, 2, 4);
  *d.add_chunks() = Chunk(1, 0, 0, 80, 3, 4);
  *d.add_chunks() = Chunk(1, 1, 80, 80, 2, 4);
  for (uint64_t id : {2, 3, 4}) *d.add_shards() = Endpoint(id);
  return d;
}

TEST(MapDeltaTest, MovedChunksTakeTheirNewHoldersAndTheRestStay) {
  const v1::ShardMap base = Base();
  absl::StatusOr<v1::ShardMap> got = ApplyMapDelta(base, FailoverOfShard1());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->epoch(), 4u);
  EXPECT_EQ(got->job_id(), 7u);
  ASSERT_EQ(got->chunks_size(), 4);
  // The map a coordinator would have sent whole.
  v1::ShardMap want = base;
  want.set_epoch(4);
  *want.mutable_chunks(0) = Chunk(0, 0, 0, 100, 2, 4);
  *want.mutable_chunks(2) = Chunk(1, 0, 0, 80, 3, 4);
  *want.mutable_chunks(3) = Chunk(1, 1, 80, 80, 2, 4);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(got->chunks(i).SerializeAsString(), want.chunks(i).SerializeAsString()) << i;
  }
  // Shard 1 holds nothing now; shard 4 is new, with the delta's address.
  EXPECT_EQ(Endpoints(*got), (std::set<uint64_t>{2, 3, 4}));
  for (const auto& e : got->shards()) EXPECT_EQ(e.data_address(), "addr-" + std::to_string(e.shard_id()));
}

TEST(MapDeltaTest, AnEmptyDeltaOnlyMovesTheEpoch) {
  v1::ShardMap d;
  d.set_job_id(7);
  d.set_epoch(5);
  absl::StatusOr<v1::ShardMap> got = ApplyMapDelta(Base(), d);
  ASSERT_TRUE(got.ok()) << got.status();
  v1::ShardMap want = Base();
  want.set_epoch(5);
  EXPECT_EQ(got->SerializeAsString(), want.SerializeAsString());
}

TEST(MapDeltaTest, ADeltaThatDoesNotFitTheMapIsRefused) {
  const v1::ShardMap base = Base();
  v1::ShardMap other_job = FailoverOfShard1();
  other_job.set_job_id(8);
  v1::ShardMap not_newer = FailoverOfShard1();
  not_newer.set_epoch(3);
  v1::ShardMap unknown_chunk = FailoverOfShard1();
  *unknown_chunk.add_chunks() = Chunk(2, 0, 0, 10, 2, 3);
  v1::ShardMap recut = FailoverOfShard1();
  recut.mutable_chunks(0)->set_num_elems(99);
  v1::ShardMap no_endpoint = FailoverOfShard1();
  no_endpoint.mutable_shards()->RemoveLast();  // Shard 4's.
  for (const v1::ShardMap* d : {&other_job, &not_newer, &unknown_chunk, &recut, &no_endpoint}) {
    absl::StatusOr<v1::ShardMap> got = ApplyMapDelta(base, *d);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << d->DebugString();
  }
}

}  // namespace
}  // namespace optimus
