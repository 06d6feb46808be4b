#include "coordinator/job_table.h"

#include <utility>

namespace optimus {

JobRecord& JobTable::Add(JobRecord job) {
  const uint64_t id = job.id;
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
