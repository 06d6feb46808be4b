#include "coordinator/job_table.h"

#include <utility>

namespace optimus {

JobRecord& JobTable::Add(JobRecord job) {
  const uint64_t id = job.id;
  ids_by_name_[job.spec.name()] = id;
  return jobs_[id] = std::move(job);
}

std::optional<JobRecord> JobTable::Remove(uint64_t id) {
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return std::nullopt;
  auto name = ids_by_name_.find(it->second.spec.name());
  if (name != ids_by_name_.end() && name->second == id) ids_by_name_.erase(name);
  JobRecord out = std::move(it->second);
  jobs_.erase(it);
  return out;
}

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
