// Coordinator: the status of every shard and job, as `optimusctl status`
// and /metrics show it. See coordinator_core.h.
#include <algorithm>
#include <optional>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "coordinator/coordinator_core.h"
#include "coordinator/job_spec.h"

namespace optimus {
namespace {

// The job's optimizer, groups (with the tensors and elements each holds),
// frozen tensors, clipping and non-finite handling, from its spec.
void FillOptimizerStatus(const v1::JobSpec& spec, v1::JobStatus* j) {
  *j->mutable_optimizer() = spec.optimizer();
  j->set_max_grad_norm(spec.max_grad_norm());
  j->set_keep_nonfinite(spec.keep_nonfinite());
  // The implicit group of a job without any: every field unset.
  const int num_groups = std::max(1, spec.param_groups_size());
  for (int g = 0; g < num_groups; ++g) {
    v1::ParamGroupStatus* group = j->add_param_groups();
    if (g < spec.param_groups_size()) *group->mutable_group() = spec.param_groups(g);
  }
  uint32_t frozen = 0;
  for (const v1::TensorSpec& t : spec.tensors()) {
    if (t.frozen()) ++frozen;
    // The spec was checked at creation: the group exists.
    if (t.group() >= static_cast<uint32_t>(num_groups)) continue;
    uint64_t n = 1;
    for (int64_t d : t.shape()) n *= static_cast<uint64_t>(d);
    v1::ParamGroupStatus* group = j->mutable_param_groups(static_cast<int>(t.group()));
    group->set_num_tensors(group->num_tensors() + 1);
    group->set_num_elems(group->num_elems() + n);
  }
  j->set_frozen_tensors(frozen);
}

}  // namespace

v1::ShardStatus Coordinator::ShardStatusLocked(const ShardRecord& shard,
                                               const std::map<uint64_t, ShardLoad>& planned,
                                               absl::Time now) const {
  v1::ShardStatus s;
  s.set_shard_id(shard.id);
  *s.mutable_capabilities() = shard.capabilities;
  s.set_state(shard.state);
  s.set_memory_used_bytes(shard.memory_used_bytes);
  auto p = planned.find(shard.id);
  if (p != planned.end()) {
    s.set_memory_planned_bytes(p->second.size_bytes);
    // Chunks moved away still count until the shard has applied the map
    // that moved them: a drained shard (0 here) is safe to stop.
    s.set_chunks_owned(p->second.num_chunks + p->second.unreleased_chunks);
    s.set_backup_chunks(p->second.backup_chunks);
  }
  s.set_transports(shard.transports);
  const std::optional<absl::Time> renewed = leases_.LastRenewal(shard.id);
  s.set_lease_age_ms(static_cast<uint64_t>(std::max<int64_t>(
      0, renewed.has_value() ? absl::ToInt64Milliseconds(now - *renewed) : 0)));
  return s;
}

v1::StatusResponse Coordinator::Status() {
  // An empty request has no token to refuse.
  return *StatusPage(v1::StatusRequest());
}

absl::StatusOr<v1::StatusResponse> Coordinator::StatusPage(const v1::StatusRequest& req) {
  uint64_t after = 0;
  if (!req.page_token().empty() && !absl::SimpleAtoi(req.page_token(), &after)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "status page_token \"", req.page_token(),
        "\" is not one this coordinator gave (a shard id); leave it empty for the first page"));
  }
  std::set<int> states(req.shard_states().begin(), req.shard_states().end());
  const auto wanted = [&states](const ShardRecord& s) {
    return states.empty() || states.count(s.state) != 0;
  };
  v1::StatusResponse resp;
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  const std::map<uint64_t, ShardLoad> planned = PlannedLoadLocked();
  const std::map<uint64_t, ShardRecord>& shards = shards_.all();
  uint32_t matching = 0;
  for (const auto& [id, shard] : shards) matching += wanted(shard);
  resp.set_matching_shards(matching);
  for (auto it = shards.upper_bound(after); it != shards.end(); ++it) {
    if (!wanted(it->second)) continue;
    if (req.page_size() > 0 && static_cast<uint32_t>(resp.shards_size()) == req.page_size()) {
      // More match: the next page starts after the last one here.
      resp.set_next_page_token(absl::StrCat(resp.shards(resp.shards_size() - 1).shard_id()));
      break;
    }
    *resp.add_shards() = ShardStatusLocked(it->second, planned, now);
  }
  if (!req.page_token().empty()) return resp;
  for (const auto& [id, job] : jobs_.all()) {
    v1::JobStatus* j = resp.add_jobs();
    j->set_job_id(id);
    j->set_name(job.spec.name());
    j->set_state(job.state);
    j->set_world_size(job.spec.world_size());
    j->set_workers_joined(static_cast<uint32_t>(job.joined_ranks.size()));
    // Lowest step over the primaries; one that has not reported counts as 0.
    j->set_current_step(ViewLocked(job).min_applied_step);
    j->set_num_tensors(static_cast<uint32_t>(job.spec.tensors_size()));
    j->set_num_params(job.num_params);
    j->set_state_bytes(job.num_params * StateBytesPerElemOf(job.spec.optimizer().kind()));
    j->set_map_epoch(job.map.epoch());
    j->set_replication(job.spec.replication());
    j->set_num_chunks(static_cast<uint32_t>(job.map.chunks_size()));
    uint32_t with_backup = 0, in_sync = 0;
    for (int i = 0; i < job.map.chunks_size(); ++i) {
      if (job.map.chunks(i).backup_shard_id() == 0) continue;
      ++with_backup;
      if (job.backup_seeded[i]) ++in_sync;
    }
    j->set_chunks_with_backup(with_backup);
    j->set_backups_in_sync(in_sync);
    FillOptimizerStatus(job.spec, j);
    j->set_rollback_error(job.rollback_error);
  }
  return resp;
}

}  // namespace optimus
