#include "client/map_delta.h"

#include <cstdint>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace optimus {
namespace {

uint64_t ChunkKey(uint32_t tensor, uint32_t chunk) {
  return (static_cast<uint64_t>(tensor) << 32) | chunk;
}

}  // namespace

absl::StatusOr<v1::ShardMap> ApplyMapDelta(const v1::ShardMap& base, const v1::ShardMap& delta) {
  if (delta.job_id() != base.job_id()) {
    return absl::InvalidArgumentError(absl::StrCat("map delta of job ", delta.job_id(),
                                                   " for a map of job ", base.job_id()));
  }
  if (delta.epoch() <= base.epoch()) {
    return absl::InvalidArgumentError(absl::StrCat("map delta to epoch ", delta.epoch(),
                                                   " is not newer than epoch ", base.epoch()));
  }
  if (delta.delta_from() != 0 && delta.delta_from() != base.epoch()) {
    return absl::InvalidArgumentError(absl::StrCat("map delta from epoch ", delta.delta_from(),
                                                   " for the map of epoch ", base.epoch()));
  }
  v1::ShardMap out = base;
  out.set_epoch(delta.epoch());
  out.clear_delta_from();
  absl::flat_hash_map<uint64_t, int> index;
  index.reserve(static_cast<size_t>(out.chunks_size()));
  for (int i = 0; i < out.chunks_size(); ++i) {
    index[ChunkKey(out.chunks(i).tensor(), out.chunks(i).chunk())] = i;
  }
  for (const v1::ChunkPlacement& c : delta.chunks()) {
    auto it = index.find(ChunkKey(c.tensor(), c.chunk()));
    if (it == index.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "map delta to epoch ", delta.epoch(), " names chunk ", c.chunk(), " of tensor ",
          c.tensor(), ", which the map of epoch ", base.epoch(), " does not have"));
    }
    v1::ChunkPlacement* p = out.mutable_chunks(it->second);
    if (p->offset_elems() != c.offset_elems() || p->num_elems() != c.num_elems()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "map delta to epoch ", delta.epoch(), " cuts chunk ", c.chunk(), " of tensor ",
          c.tensor(), " differently"));
    }
    *p = c;
  }
  // Endpoints: the delta's are the newest; keep those of shards still named.
  absl::flat_hash_map<uint64_t, const v1::ShardEndpoint*> endpoint;
  for (const v1::ShardEndpoint& e : base.shards()) endpoint[e.shard_id()] = &e;
  for (const v1::ShardEndpoint& e : delta.shards()) endpoint[e.shard_id()] = &e;
  absl::flat_hash_set<uint64_t> named;
  for (const v1::ChunkPlacement& c : out.chunks()) {
    named.insert(c.shard_id());
    if (c.backup_shard_id() != 0) named.insert(c.backup_shard_id());
  }
  out.clear_shards();
  // Base order first, then shards new in the delta, in its order.
  absl::flat_hash_set<uint64_t> added;
  auto add = [&](uint64_t id) {
    if (named.count(id) == 0 || !added.insert(id).second) return;
    *out.add_shards() = *endpoint[id];
  };
  for (const v1::ShardEndpoint& e : base.shards()) add(e.shard_id());
  for (const v1::ShardEndpoint& e : delta.shards()) add(e.shard_id());
  for (uint64_t id : named) {
    if (added.count(id) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("map delta to epoch ", delta.epoch(),
                                                     " places a chunk on shard ", id,
                                                     " without its endpoint"));
    }
  }
  return out;
}

}  // namespace optimus
