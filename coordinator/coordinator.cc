// Coordinator: construction, recovery from the durable state, snapshots and
// waiting for them, shutdown. See coordinator_core.h.
#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/security.h"
#include "coordinator/coordinator_core.h"

namespace optimus {
namespace {
constexpr char kLog[] = "coord";

std::shared_ptr<StateStore> MakeStore(const CoordinatorOptions& options) {
  if (options.state_store != nullptr) return options.state_store;
  if (!options.state_dir.empty()) return std::make_shared<FileStateStore>(options.state_dir);
  return nullptr;
}
}  // namespace

Coordinator::Coordinator(const CoordinatorOptions& options)
    : options_(options),
      store_(MakeStore(options)),
      writer_(store_ != nullptr
                  ? std::make_unique<StateWriter>(store_.get(), [this] { return PullState(); })
                  : nullptr),
      checkpoints_(options.checkpoint_dir),
      leases_(options.lease) {
  absl::MutexLock lock(&mu_);
  shards_.AddShardDownListener([this](const std::vector<uint64_t>& shard_ids) {
    // The registry calls its listeners from MarkDown, under mu_.
    mu_.AssertHeld();
    OnShardsDownLocked(shard_ids);
  });
}

Coordinator::~Coordinator() {
  // The writer pulls the last state from the tables (and itself): before
  // they go.
  if (writer_ != nullptr) writer_->Close();
}

absl::Time Coordinator::Now() const { return options_.clock ? options_.clock() : absl::Now(); }

absl::StatusOr<uint64_t> Coordinator::SnapshotLocked() {
  if (writer_ == nullptr) return 0;
  return writer_->MarkChanged();
}

absl::StatusOr<StateWriter::Pulled> Coordinator::PullState() {
  absl::MutexLock lock(&mu_);
  Planning planning(&planning_);  // As long: the whole state, maps included.
  v1::CoordinatorState state;
  state.set_next_shard_id(shards_.next_id());
  state.set_next_job_id(jobs_.next_id());
  state.set_data_plane_key(data_plane_key_);
  for (const auto& [id, shard] : shards_.all()) {
    v1::PersistedShard* s = state.add_shards();
    s->set_shard_id(id);
    *s->mutable_capabilities() = shard.capabilities;
    s->set_state(shard.state);
    s->set_identity(shard.identity);
  }
  for (const auto& [id, job] : jobs_.all()) {
    if (job.deleting) continue;
    v1::PersistedJob* j = state.add_jobs();
    j->set_job_id(id);
    *j->mutable_spec() = job.spec;
    j->set_state(job.state);
    *j->mutable_map() = job.map;
    j->set_num_params(job.num_params);
    j->set_bytes_per_elem(job.bytes_per_elem);
    for (uint32_t r : job.joined_ranks) j->add_joined_ranks(r);
    j->set_resume_step(job.resume_step);
    if (job.restore.has_value()) *j->mutable_restore() = *job.restore;
    j->set_rollback_tried(job.rollback_tried);
    j->set_token(job.token);
    j->set_rollback_error(job.rollback_error);
  }
  StateWriter::Pulled out;
  if (!state.SerializeToString(&out.bytes)) {
    return absl::InternalError("serializing coordinator state");
  }
  // Under mu_, where every change is marked: all of them are in the bytes.
  out.seq = writer_->submitted_seq();
  return out;
}

absl::Status Coordinator::WaitDurable(const absl::StatusOr<uint64_t>& seq) {
  absl::Status s = seq.ok() ? (*seq == 0 ? absl::OkStatus() : writer_->WaitDurable(*seq))
                            : seq.status();
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("saving coordinator state: ", s.message()));
}

void Coordinator::SaveLaterLocked() {
  absl::StatusOr<uint64_t> seq = SnapshotLocked();
  if (!seq.ok()) OPTIMUS_LOG(Error, kLog, "state not saved: ", seq.status().ToString());
}

absl::Status Coordinator::Recover() {
  if (store_ == nullptr) return absl::OkStatus();
  absl::StatusOr<std::optional<std::string>> bytes = store_->Load();
  if (!bytes.ok()) return bytes.status();
  if (!bytes->has_value()) {
    OPTIMUS_LOG(Info, kLog, "no state in ", store_->Describe(), ": starting empty");
    return absl::OkStatus();
  }
  v1::CoordinatorState state;
  if (!state.ParseFromString(**bytes)) {
    return absl::DataLossError(
        absl::StrCat(store_->Describe(), " does not parse as CoordinatorState"));
  }
  absl::MutexLock lock(&mu_);
  const absl::Time now = Now();
  shards_.Clear();
  jobs_.Clear();
  leases_.Clear();
  shards_.set_next_id(state.next_shard_id());
  jobs_.set_next_id(state.next_job_id());
  data_plane_key_ = state.data_plane_key();
  for (const v1::PersistedShard& s : state.shards()) {
    ShardRecord r;
    r.id = s.shard_id();
    r.capabilities = s.capabilities();
    r.state = s.state();
    r.identity = s.identity();
    r.down_since = now;
    if (r.state == v1::SHARD_STATE_DOWN) {
      leases_.AddDown(r.id, now, r.capabilities.hostname(), r.identity);
    } else {
      // A fresh lease, doubled: it may have kept running, and needs a
      // moment to reconnect.
      leases_.AddLive(r.id, now + options_.lease, r.capabilities.hostname(), r.identity);
    }
    shards_.Restore(std::move(r));
  }
  for (const v1::PersistedJob& j : state.jobs()) {
    JobRecord r;
    r.id = j.job_id();
    r.spec = j.spec();
    r.state = j.state();
    r.map = j.map();
    // Which epoch changed each part is not kept: a shard that loaded an
    // older epoch than this one fetches its part again.
    r.parts_since = r.map.epoch();
    r.changes_since = r.map.epoch();
    r.num_params = j.num_params();
    r.bytes_per_elem = j.bytes_per_elem();
    r.joined_ranks.insert(j.joined_ranks().begin(), j.joined_ranks().end());
    r.resume_step = std::max<uint64_t>(j.resume_step(), 1);
    if (j.has_restore()) r.restore = j.restore();
    r.rollback_tried = j.rollback_tried();
    r.rollback_error = j.rollback_error();
    r.token = j.token();
    // Backups count as much as primaries; whether they are in sync is
    // volatile and comes back with the next heartbeats.
    r.load = ComputeLoad(LayoutOfJob(r).chunks, r.bytes_per_elem,
                         kernels::ChunkOverheadBytes(r.spec.world_size()));
    r.backup_seeded.assign(r.map.chunks_size(), false);
    jobs_.Add(std::move(r));
  }
  OPTIMUS_LOG(Info, kLog, "recovered state from ", store_->Describe(), ": ", shards_.size(),
              " shards, ", jobs_.size(), " jobs");
  return absl::OkStatus();
}

void Coordinator::BeginShutdown() {
  absl::MutexLock lock(&mu_);
  shutting_down_ = true;
  map_changed_.SignalAll();
}

Coordinator::TableSizes Coordinator::table_sizes() {
  TableSizes t;
  {
    absl::MutexLock lock(&mu_);
    t.shards = shards_.size();
    t.jobs = jobs_.size();
    t.job_names = jobs_.names_size();
    for (const auto& [id, job] : jobs_.all()) {
      t.progress_reports += job.progress.size();
      t.departed += job.departed.size();
    }
  }
  t.checkpoints = checkpoints_.table_sizes();
  return t;
}

Coordinator::Counters Coordinator::counters() {
  absl::MutexLock lock(&mu_);
  Counters c = counters_;
  c.heartbeats_deferred = heartbeats_deferred_.load();
  c.map_parts_serialized = map_parts_serialized_.load();
  c.map_parts_reused = map_parts_reused_.load();
  return c;
}

void Coordinator::RunWithTablesLockedForTest(const std::function<void()>& f) {
  absl::MutexLock commit(&commit_mu_);
  absl::MutexLock lock(&mu_);
  Planning planning(&planning_);
  f();
}

absl::Status Coordinator::EnsureDataPlaneKey() {
  absl::MutexLock commit(&commit_mu_);
  absl::StatusOr<uint64_t> seq;
  {
    absl::MutexLock lock(&mu_);
    if (!data_plane_key_.empty()) return absl::OkStatus();
    absl::StatusOr<std::string> key = security::NewToken();
    if (!key.ok()) return key.status();
    data_plane_key_ = *key;
    seq = SnapshotLocked();
  }
  return WaitDurable(seq);
}

std::string Coordinator::data_plane_key() {
  absl::MutexLock lock(&mu_);
  return data_plane_key_;
}

void Coordinator::CountRefusal(JobRefusal why) {
  absl::MutexLock lock(&mu_);
  ++counters_.jobs_refused[static_cast<int>(why)];
}

}  // namespace optimus
