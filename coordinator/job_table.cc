#include "coordinator/job_table.h"

#include <iterator>
#include <set>
#include <utility>

namespace optimus {

JobRecord& JobTable::Add(JobRecord job) {
  const uint64_t id = job.id;
  ++generation_;
  ids_by_name_[job.spec.name()] = id;
  JobRecord& added = jobs_[id] = std::move(job);
  IndexHolders(added);
  return added;
}

std::optional<JobRecord> JobTable::Remove(uint64_t id) {
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return std::nullopt;
  auto name = ids_by_name_.find(it->second.spec.name());
  if (name != ids_by_name_.end() && name->second == id) ids_by_name_.erase(name);
  JobRecord out = std::move(it->second);
  jobs_.erase(it);
  ++generation_;
  for (const auto& [shard_id, load] : out.load) Unindex(shard_id, id);
  for (const auto& [shard_id, chunks] : out.departed) Unindex(shard_id, id);
  return out;
}

void JobTable::IndexHolders(const JobRecord& job) {
  for (const auto& [shard_id, load] : job.load) jobs_of_shard_[shard_id].insert(job.id);
  for (const auto& [shard_id, chunks] : job.departed) jobs_of_shard_[shard_id].insert(job.id);
}

const std::set<uint64_t>* JobTable::JobsOf(uint64_t shard_id) const {
  auto it = jobs_of_shard_.find(shard_id);
  return it == jobs_of_shard_.end() ? nullptr : &it->second;
}

void JobTable::Unindex(uint64_t shard_id, uint64_t job_id) {
  auto it = jobs_of_shard_.find(shard_id);
  if (it == jobs_of_shard_.end()) return;
  it->second.erase(job_id);
  if (it->second.empty()) jobs_of_shard_.erase(it);
}

namespace {

bool AtEpoch(const v1::ShardJobProgress& p, uint64_t epoch) { return p.map_epoch() >= epoch; }

bool Loaded(const v1::ShardJobProgress& p, uint64_t epoch, const ShardLoad& load) {
  return p.map_epoch() == epoch && p.chunks_loaded() == load.num_chunks;
}

}  // namespace

JobRecord::HolderCounts& CountsAtEpoch(JobRecord& job) {
  JobRecord::HolderCounts& c = job.counts;
  const uint64_t epoch = job.map.epoch();
  if (c.epoch == epoch && epoch != 0) return c;
  c = JobRecord::HolderCounts();
  c.epoch = epoch;
  for (const auto& [shard_id, load] : job.load) {
    auto p = job.progress.find(shard_id);
    if (p == job.progress.end()) continue;
    c.at_epoch += AtEpoch(p->second, epoch);
    c.loaded += Loaded(p->second, epoch, load);
  }
  for (int i = 0; i < job.map.chunks_size(); ++i) {
    const uint64_t backup = job.map.chunks(i).backup_shard_id();
    if (backup != 0) c.backups_of[backup].push_back(i);
  }
  return c;
}

void RecordProgress(JobRecord& job, uint64_t shard_id, const v1::ShardJobProgress& p) {
  JobRecord::HolderCounts& c = CountsAtEpoch(job);
  auto load = job.load.find(shard_id);
  if (load == job.load.end()) return;
  auto old = job.progress.find(shard_id);
  if (old != job.progress.end()) {
    c.at_epoch -= AtEpoch(old->second, c.epoch);
    c.loaded -= Loaded(old->second, c.epoch, load->second);
    old->second = p;
  } else {
    job.progress.emplace(shard_id, p);
  }
  c.at_epoch += AtEpoch(p, c.epoch);
  c.loaded += Loaded(p, c.epoch, load->second);
}

void DropProgress(JobRecord& job, uint64_t shard_id) {
  auto old = job.progress.find(shard_id);
  if (old == job.progress.end()) return;
  JobRecord::HolderCounts& c = CountsAtEpoch(job);
  if (auto load = job.load.find(shard_id); load != job.load.end()) {
    c.at_epoch -= AtEpoch(old->second, c.epoch);
    c.loaded -= Loaded(old->second, c.epoch, load->second);
  }
  job.progress.erase(old);
}

bool AllHoldersAtEpoch(JobRecord& job) {
  return CountsAtEpoch(job).at_epoch == job.load.size();
}

bool AllHoldersLoaded(JobRecord& job) { return CountsAtEpoch(job).loaded == job.load.size(); }

JobRecord* JobTable::Find(uint64_t id) {
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : &it->second;
}

const JobRecord* JobTable::Find(uint64_t id) const {
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : &it->second;
}

JobRecord* JobTable::FindByName(const std::string& name) {
  auto it = ids_by_name_.find(name);
  return it == ids_by_name_.end() ? nullptr : Find(it->second);
}

std::shared_ptr<const MapSnapshot> SnapshotOf(JobRecord& job) {
  if (job.snapshot != nullptr && job.snapshot->map.epoch() == job.map.epoch()) {
    return job.snapshot;
  }
  auto snap = std::make_shared<MapSnapshot>();
  snap->spec = job.spec;
  snap->map = job.map;
  snap->restore = job.restore;
  snap->resume_step = job.resume_step;
  snap->chunk_changes = job.chunk_changes;
  snap->changes_since = job.changes_since;
  for (int i = 0; i < snap->map.chunks_size(); ++i) {
    const v1::ChunkPlacement& p = snap->map.chunks(i);
    snap->chunks_of[p.shard_id()].push_back(i);
    if (p.backup_shard_id() != 0) snap->chunks_of[p.backup_shard_id()].push_back(i);
  }
  for (int i = 0; i < snap->map.shards_size(); ++i) {
    snap->endpoint_of[snap->map.shards(i).shard_id()] = i;
  }
  job.snapshot = std::move(snap);
  return job.snapshot;
}

v1::JobSpec ShardSpecOf(const v1::JobSpec& spec) {
  v1::JobSpec out = spec;
  for (v1::TensorSpec& t : *out.mutable_tensors()) {
    t.clear_name();
    t.clear_shape();
  }
  return out;
}

v1::ShardMap ShardViewOf(const MapSnapshot& snap, uint64_t shard_id) {
  v1::ShardMap view;
  view.set_job_id(snap.map.job_id());
  view.set_epoch(snap.map.epoch());
  std::set<int> endpoints;  // Indices into snap.map.shards: map order.
  auto add_endpoint = [&](uint64_t id) {
    auto e = snap.endpoint_of.find(id);
    if (e != snap.endpoint_of.end()) endpoints.insert(e->second);
  };
  add_endpoint(shard_id);
  auto mine = snap.chunks_of.find(shard_id);
  if (mine != snap.chunks_of.end()) {
    view.mutable_chunks()->Reserve(static_cast<int>(mine->second.size()));
    for (int i : mine->second) {
      const v1::ChunkPlacement& p = snap.map.chunks(i);
      *view.add_chunks() = p;
      // Its other holder: a primary forwards to its backup, a backup is
      // seeded by its primary.
      add_endpoint(p.shard_id() == shard_id ? p.backup_shard_id() : p.shard_id());
    }
  }
  for (int i : endpoints) *view.add_shards() = snap.map.shards(i);
  return view;
}

uint64_t PartEpochOf(const JobRecord& job, uint64_t shard_id) {
  auto it = job.part_epochs.find(shard_id);
  return it != job.part_epochs.end() ? it->second : job.parts_since;
}

void RecordPartChanges(const JobLayout& before, JobRecord& job) {
  const uint64_t epoch = job.map.epoch();
  auto touch = [&](uint64_t shard_id) {
    if (shard_id != 0) job.part_epochs[shard_id] = epoch;
  };
  const int n = job.map.chunks_size();
  MapChange& change = job.chunk_changes[epoch];
  std::set<uint64_t> held_before;
  for (const ChunkSpec& c : before.chunks) {
    held_before.insert(c.shard_id);
    if (c.backup_shard_id != 0) held_before.insert(c.backup_shard_id);
  }
  for (const auto& [shard_id, load] : job.load) {
    if (held_before.count(shard_id) == 0) change.new_holders.push_back(shard_id);
  }
  for (int i = 0; i < n; ++i) {
    const v1::ChunkPlacement& now = job.map.chunks(i);
    const ChunkSpec* was = static_cast<size_t>(i) < before.chunks.size() ? &before.chunks[i] : nullptr;
    if (was != nullptr && was->shard_id == now.shard_id() &&
        was->backup_shard_id == now.backup_shard_id()) {
      continue;
    }
    change.chunks.push_back(i);
    // Both ends, before and after: a shard's part lists the chunk's
    // holders (and their endpoints) for every chunk it holds.
    touch(now.shard_id());
    touch(now.backup_shard_id());
    if (was != nullptr) {
      touch(was->shard_id);
      touch(was->backup_shard_id);
    }
  }
  while (job.chunk_changes.size() > JobRecord::kKeptChunkChanges) {
    // Deltas from before the oldest kept epoch can no longer be made.
    job.changes_since = job.chunk_changes.begin()->first;
    job.chunk_changes.erase(job.chunk_changes.begin());
  }
  for (auto it = job.part_epochs.begin(); it != job.part_epochs.end();) {
    const bool owes = job.load.count(it->first) != 0 || job.departed.count(it->first) != 0;
    it = owes ? std::next(it) : job.part_epochs.erase(it);
  }
}

std::optional<v1::ShardMap> DeltaOf(const MapSnapshot& snap, uint64_t from) {
  const uint64_t epoch = snap.map.epoch();
  if (from == 0 || from < snap.changes_since || from > epoch) return std::nullopt;
  std::set<int> chunks;
  std::set<int> endpoints;  // Indices into snap.map.shards: map order.
  for (auto it = snap.chunk_changes.upper_bound(from); it != snap.chunk_changes.end(); ++it) {
    if (it->first > epoch) break;
    chunks.insert(it->second.chunks.begin(), it->second.chunks.end());
    for (uint64_t id : it->second.new_holders) {
      // Holders now only: one that left again is named by no chunk.
      auto e = snap.endpoint_of.find(id);
      if (e != snap.endpoint_of.end()) endpoints.insert(e->second);
    }
  }
  v1::ShardMap delta;
  delta.set_job_id(snap.map.job_id());
  delta.set_epoch(epoch);
  delta.set_delta_from(from);
  for (int i : chunks) *delta.add_chunks() = snap.map.chunks(i);
  for (int i : endpoints) *delta.add_shards() = snap.map.shards(i);
  return delta;
}

JobLayout LayoutOfJob(const JobRecord& job) {
  JobLayout layout;
  layout.bytes_per_elem = job.bytes_per_elem;
  layout.replication = job.spec.replication();
  layout.chunk_overhead_bytes = kernels::ChunkOverheadBytes(job.spec.world_size());
  layout.backup_in_sync = job.backup_seeded;
  layout.chunks.reserve(job.map.chunks_size());
  for (const v1::ChunkPlacement& p : job.map.chunks()) {
    ChunkSpec c;
    c.tensor = p.tensor();
    c.chunk = p.chunk();
    c.offset_elems = p.offset_elems();
    c.num_elems = p.num_elems();
    c.shard_id = p.shard_id();
    c.backup_shard_id = p.backup_shard_id();
    layout.chunks.push_back(c);
  }
  layout.backup_in_sync.resize(layout.chunks.size(), false);
  return layout;
}

void ApplyLayout(const JobLayout& layout, JobRecord& job) {
  for (int i = 0; i < job.map.chunks_size(); ++i) {
    v1::ChunkPlacement* p = job.map.mutable_chunks(i);
    p->set_shard_id(layout.chunks[i].shard_id);
    p->set_backup_shard_id(layout.chunks[i].backup_shard_id);
  }
  job.backup_seeded = layout.backup_in_sync;
}

}  // namespace optimus
