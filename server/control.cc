// The shard's side of the control plane, on the heartbeat thread: register,
// heartbeat every third of the lease (or at once when a request shows our
// map is behind), load the jobs assigned to us and apply their newer maps,
// free the jobs the coordinator released, pass checkpoint orders on.
#include <unistd.h>

#include <algorithm>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/busy_retry.h"
#include "common/cpu_count.h"
#include "common/security.h"
#include "common/logging.h"
#include "kernels/cpu/optimizer.h"
#include "server/shard.h"

namespace optimus {
namespace server {
namespace {
constexpr char kLog[] = "shard";

ReplyHint RefreshHint() {
  ReplyHint h;
  h.refresh_map = true;
  return h;
}
}  // namespace

absl::Status Shard::Register() {
  ShardRegistration r;
  r.is_dpu = options_.is_dpu;
#if defined(__aarch64__)
  r.arch = "aarch64";
#elif defined(__x86_64__)
  r.arch = "x86_64";
#else
  r.arch = "unknown";
#endif
  r.cores = static_cast<uint32_t>(UsableCores());
  // What the coordinator may plan jobs' state into: the budget less the
  // staging pool (gradients in flight).
  r.memory_limit_bytes = options_.memory_limit_bytes - options_.staging_bytes;
  r.staging_bytes = options_.staging_bytes;
  r.data_address = worker_->address();
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  r.hostname = host;
  r.failure_domain = options_.failure_domain;
  r.checkpoints = !options_.checkpoint_dir.empty();
  absl::StatusOr<Registered> reg = link_->Register(r);
  if (!reg.ok()) return reg.status();
  {
    absl::MutexLock lock(&identity_mu_);
    data_plane_key_ = reg->data_plane_key;
    checks_identities_.store(!reg->data_plane_key.empty(), std::memory_order_release);
  }
  shard_id_.store(reg->shard_id);
  lease_ms_.store(reg->lease_ms);
  last_beat_unix_ns_.store(absl::ToUnixNanos(absl::Now()));
  OPTIMUS_LOG(Info, kLog, "registered shard_id=", reg->shard_id,
              " kind=", options_.is_dpu ? "dpu" : "host", " lease_ms=", reg->lease_ms,
              " isa=", kernels::ActiveIsa());
  return absl::OkStatus();
}

void Shard::HeartbeatLoop() {
  // Beats are due every interval from the previous one's *sending*, not its
  // return: the coordinator renews the lease when a beat arrives, so waiting
  // a full interval after a slow reply (a busy coordinator answers in up to
  // a second) would space two renewals by interval + round trip, and three
  // such in a row exceed the lease of a shard that never stopped beating.
  absl::Time last_sent = absl::Now();
  for (;;) {
    {
      absl::MutexLock lock(&stop_mu_);
      absl::Duration interval = options_.heartbeat_interval;
      if (interval <= absl::ZeroDuration()) {
        interval = std::max(absl::Milliseconds(lease_ms_.load()) / 3, absl::Milliseconds(50));
      }
      stop_mu_.AwaitWithDeadline(absl::Condition(this, &Shard::StopOrBeat), last_sent + interval);
      if (stopped_) return;
      beat_now_ = false;
    }
    last_sent = absl::Now();
    beat_loop_unix_ns_.store(absl::ToUnixNanos(last_sent));
    if (absl::Status s = HeartbeatOnce(); !s.ok()) {
      OPTIMUS_LOG(Warning, kLog, "heartbeat failed: ", s.ToString());
    }
  }
}

void Shard::BeatNow() {
  absl::MutexLock lock(&stop_mu_);
  beat_now_ = true;
}

HeartbeatReport Shard::BuildReport() const {
  HeartbeatReport r;
  r.shard_id = shard_id_.load();
  r.memory_used_bytes = table_.memory()->used();
  r.transports = worker_->transports_in_use();
  for (const JobRef& job : table_.All()) {
    JobReport j;
    j.job_id = job->config.job_id;
    j.map_epoch = job->epoch();
    uint64_t min_applied = UINT64_MAX;
    for (const ChunkRef& chunk : job->Chunks()) {
      absl::MutexLock lock(&chunk->mu);
      if (chunk->machine.retired()) continue;
      if (chunk->machine.role() == Role::kBackup) {
        ++j.backup_chunks;
        if (chunk->machine.seeded()) ++j.backups_seeded;
        continue;
      }
      ++j.primary_chunks;
      if (chunk->machine.backup_shard() != 0 && chunk->machine.backup_seeded()) {
        ++j.primaries_replicated;
      }
      const uint64_t version = chunk->machine.version();
      const uint64_t applied = version > 0 ? version - 1 : 0;
      min_applied = std::min(min_applied, applied);
      j.max_applied_step = std::max(j.max_applied_step, applied);
    }
    j.applied_step = min_applied == UINT64_MAX ? 0 : min_applied;
    r.chunks_owned += j.primary_chunks + j.backup_chunks;
    r.jobs.push_back(j);
  }
  if (ckpt_writer_ != nullptr) r.checkpoints = ckpt_writer_->Reports();
  return r;
}

absl::Status Shard::HeartbeatOnce() {
  absl::StatusOr<HeartbeatReply> reply = link_->Heartbeat(BuildReport());
  if (!reply.ok()) return reply.status();
  last_beat_unix_ns_.store(absl::ToUnixNanos(absl::Now()));
  if (!reply->known) {
    // Declared dead (the lease expired, e.g. a partition) or forgotten: the
    // jobs moved on without this shard, so its state is stale. Drop every
    // chunk so no worker or former primary keeps using it, then join afresh.
    OPTIMUS_LOG(Warning, kLog, "coordinator no longer knows shard_id=", shard_id_.load(),
                "; releasing its chunks and registering again");
    {
      absl::MutexLock lock(&dropped_mu_);
      for (const JobRef& job : table_.All()) dropped_when_down_.insert(job->config.job_id);
    }
    ReleaseAll(absl::FailedPreconditionError(absl::StrCat(
                   "stale shard map: shard ", shard_id_.load(), " was declared down")),
               RefreshHint());
    return Register();
  }
  for (uint64_t job_id : reply->released_jobs) {
    if (table_.Find(job_id) == nullptr) continue;
    OPTIMUS_LOG(Info, kLog, "job ", job_id, " was deleted; freeing its chunks");
    ReleaseJob(job_id, absl::NotFoundError(absl::StrCat("job ", job_id, " was deleted")), {});
  }
  bool took_unchanged = false;
  for (const HeartbeatReply::Assignment& a : reply->assignments) {
    JobRef job = table_.Find(a.job_id);
    if (job != nullptr) {
      const uint64_t had = job->epoch();
      if (had >= a.map_epoch) continue;
      // A new epoch that left our part as it was (it moved other shards'
      // chunks): nothing to fetch.
      if (job->TakeEpochUnchanged(a.map_epoch, a.part_epoch)) {
        OPTIMUS_LOG(Info, kLog, "job ", a.job_id, ": map epoch ", had, " -> ", a.map_epoch,
                    " (this shard's part unchanged since epoch ", a.part_epoch, ")");
        metrics_.map_epochs_unchanged.fetch_add(1, std::memory_order_relaxed);
        took_unchanged = true;
        continue;
      }
    }
    RequestLoad(a.job_id, a.map_epoch, absl::Now() + a.fetch_after);
  }
  // Tell the coordinator now rather than at the next beat.
  if (took_unchanged) BeatNow();
  std::set<std::pair<uint64_t, uint64_t>> ordered;
  for (const CheckpointOrder& o : reply->checkpoints) {
    ordered.insert({o.job_id, o.checkpoint_id});
    StartCheckpoint(o);
  }
  if (ckpt_writer_ != nullptr) ckpt_writer_->Retain(ordered);
  return absl::OkStatus();
}

absl::StatusOr<ChunkRef> Shard::PlaceChunk(const Job& job, const ChunkPlacement& p,
                                           const RestoreSource* restore) {
  const uint64_t me = shard_id_.load();
  const Role role = p.primary == me ? Role::kPrimary : Role::kBackup;
  // The forwarded gradient sum: every chunk of a replicated job, and a
  // chunk that a map gives a backup (a drain of an unreplicated job).
  const bool with_sum = job.config.replication > 0 || p.backup != 0;
  absl::StatusOr<ChunkRef> chunk =
      Chunk::Create(job.config, p, role, with_sum, table_.memory(), MakeRegistrar(),
                    staging_pool_);
  if (!chunk.ok()) return chunk.status();
  if (restore != nullptr) {
    if (absl::Status s = RestoreChunk(job, chunk->get(), *restore); !s.ok()) return s;
  }
  absl::MutexLock lock(&(*chunk)->mu);
  (*chunk)->machine.ApplyPlacement(me, p.primary, p.backup, with_sum);
  // Without a checkpoint folder the shard takes no checkpoint (the
  // coordinator refuses them for its jobs).
  if (ckpt_writer_ != nullptr) {
    (*chunk)->machine.SetCheckpointEvery(job.config.checkpoint_every_steps);
  }
  if (restore != nullptr) {
    float last_lr = 0.0f;
    for (const v1::CheckpointFile& f : restore->manifest.files()) {
      if (f.tensor() == p.tensor) last_lr = f.last_lr();
    }
    const uint64_t steps = restore->optimizer_steps.size() > p.tensor
                               ? restore->optimizer_steps[p.tensor]
                               : 0;
    (*chunk)->machine.Restored(restore->step, steps, last_lr);
  }
  return chunk;
}

absl::Status Shard::LoadJob(uint64_t job_id, bool* coordinator_busy) {
  // Only our part of the map: our chunks and the shards we exchange with.
  // primary_of below then knows the primaries of our chunks only; a
  // forward for a chunk we no longer hold is answered "retry" rather than
  // "fenced", and its sender learns from its own map that it moved.
  absl::StatusOr<JobDescription> desc = link_->GetJob(job_id, shard_id_.load());
  if (!desc.ok()) {
    if (coordinator_busy != nullptr) *coordinator_busy = IsBusy(desc.status());
    return desc.status();
  }
  metrics_.map_fetches.fetch_add(1, std::memory_order_relaxed);
  if (JobRef existing = table_.Find(job_id); existing != nullptr) {
    if (absl::Status s = ApplyMap(existing, *desc); !s.ok()) return s;
    BeatNow();
    return absl::OkStatus();
  }
  auto job = std::make_shared<Job>(desc->config);
  const uint64_t me = shard_id_.load();
  ConnectPeers(desc->map);
  const RestoreSource* restore = desc->restore.has_value() ? &*desc->restore : nullptr;
  // Allocated (and restored) before the job is visible; on an error they
  // are freed with `job`.
  absl::flat_hash_map<uint64_t, ChunkRef> chunks;
  absl::flat_hash_map<uint64_t, uint64_t> primary_of;
  for (const ChunkPlacement& p : desc->map.chunks) {
    primary_of[ChunkKey(p.tensor, p.chunk)] = p.primary;
    if (p.primary != me && p.backup != me) continue;
    absl::StatusOr<ChunkRef> chunk = PlaceChunk(*job, p, restore);
    if (!chunk.ok()) return chunk.status();
    chunks[ChunkKey(p.tensor, p.chunk)] = *std::move(chunk);
  }
  const size_t num_chunks = chunks.size();
  {
    absl::MutexLock lock(&job->mu);
    job->map_epoch = desc->map.epoch;
    job->chunks = std::move(chunks);
    job->primary_of = std::move(primary_of);
  }
  if (!table_.Insert(job)) return absl::OkStatus();  // Loaded meanwhile.
  {
    absl::MutexLock lock(&dropped_mu_);
    dropped_when_down_.erase(job_id);
  }
  OPTIMUS_LOG(Info, kLog, "loaded job ", job_id, " (", job->config.name, ") epoch ",
              desc->map.epoch, ": ", num_chunks, " chunks, replication ",
              job->config.replication, ", shard memory used ", table_.memory()->used(), " of ",
              table_.memory()->limit(), " bytes");
  // Tell the coordinator now rather than at the next beat.
  BeatNow();
  return absl::OkStatus();
}

void Shard::RequestLoad(uint64_t job_id, uint64_t epoch, absl::Time not_before) {
  absl::MutexLock lock(&load_mu_);
  const bool fresh = loads_wanted_.count(job_id) == 0;
  uint64_t& wanted = loads_wanted_[job_id];
  wanted = std::max(wanted, epoch);
  // The slot of the first request stands (later replies repeat it).
  if (fresh && not_before > absl::Now()) loads_not_before_[job_id] = not_before;
}

void Shard::LoaderLoop() {
  // Busy refusals in a row: the next wait's bound doubles with each.
  int busy_in_a_row = 0;
  for (;;) {
    uint64_t job_id, epoch;
    {
      absl::MutexLock lock(&load_mu_);
      load_mu_.Await(absl::Condition(this, &Shard::LoadWantedOrStopping));
      if (load_stop_) return;
      // The load whose slot comes first; wait for it (the coordinator
      // spreads a new job's fetches over its shards).
      auto next = loads_wanted_.begin();
      absl::Time at = absl::InfinitePast();
      for (auto it = loads_wanted_.begin(); it != loads_wanted_.end(); ++it) {
        auto nb = loads_not_before_.find(it->first);
        const absl::Time t = nb == loads_not_before_.end() ? absl::InfinitePast() : nb->second;
        if (it == loads_wanted_.begin() || t < at) {
          next = it;
          at = t;
        }
      }
      const absl::Duration wait = at - absl::Now();
      if (wait > absl::ZeroDuration()) {
        if (load_mu_.AwaitWithTimeout(absl::Condition(&load_stop_), wait)) return;
        continue;  // Look again: another load may have come first meanwhile.
      }
      job_id = next->first;
      epoch = next->second;
      loads_wanted_.erase(next);
      loads_not_before_.erase(job_id);
    }
    // A request for an epoch loaded meanwhile costs one GetJob and no more
    // (LoadJob and ApplyMap skip what they have).
    bool busy = false;
    absl::Status s = LoadJob(job_id, &busy);
    if (!busy) {
      busy_in_a_row = 0;
      if (!s.ok()) OPTIMUS_LOG(Error, kLog, "loading job ", job_id, ": ", s.ToString());
      continue;
    }
    // Every shard handed the job fetches its part now: the coordinator
    // serves a few at a time and refused this one. Ask again after a
    // random wait (so that the refused shards do not come back together),
    // growing while it stays busy; a stop ends the wait.
    const absl::Duration wait = JitteredBusyBackoff(BusyBackoff(), busy_in_a_row++);
    OPTIMUS_LOG(Info, kLog, "loading job ", job_id, ": the coordinator is busy (",
                s.message(), "); trying again in ", absl::FormatDuration(wait));
    absl::MutexLock lock(&load_mu_);
    uint64_t& wanted = loads_wanted_[job_id];
    wanted = std::max(wanted, epoch);
    if (load_mu_.AwaitWithTimeout(absl::Condition(&load_stop_), wait)) return;
  }
}

absl::Status Shard::ApplyMap(const JobRef& job, const JobDescription& desc) {
  const uint64_t epoch = desc.map.epoch;
  if (epoch <= job->epoch()) return absl::OkStatus();
  const uint64_t me = shard_id_.load();
  ConnectPeers(desc.map);
  std::map<uint64_t, const ChunkPlacement*> mine;
  absl::flat_hash_map<uint64_t, uint64_t> primary_of;
  for (const ChunkPlacement& p : desc.map.chunks) {
    primary_of[ChunkKey(p.tensor, p.chunk)] = p.primary;
    if (p.primary == me || p.backup == me) mine[ChunkKey(p.tensor, p.chunk)] = &p;
  }
  // Allocate first, outside the job's lock (registration waits for the
  // progress thread, which takes that lock): chunks new here, and sum
  // buffers for chunks that get their first backup. On an error nothing
  // changes.
  std::map<uint64_t, ChunkRef> fresh;
  for (const auto& [key, p] : mine) {
    ChunkRef have = job->Find(p->tensor, p->chunk);
    if (have == nullptr) {
      absl::StatusOr<ChunkRef> chunk = PlaceChunk(*job, *p, nullptr);
      if (!chunk.ok()) return chunk.status();
      fresh[key] = *std::move(chunk);
    } else if (p->backup != 0) {
      if (absl::Status s = have->AddSumBuffer(table_.memory(), MakeRegistrar()); !s.ok()) {
        return s;
      }
    }
  }
  std::vector<std::pair<ChunkRef, Actions>> carry;
  std::vector<const ChunkPlacement*> demoted;
  size_t sent_back = 0;
  {
    // One critical section: a request under the new epoch sees the new roles.
    absl::MutexLock lock(&job->mu);
    if (job->map_epoch >= epoch) return absl::OkStatus();
    const absl::Status moved = absl::FailedPreconditionError(absl::StrCat(
        "stale shard map: job ", job->config.job_id, " moved the chunk at map epoch ", epoch));
    for (auto it = job->chunks.begin(); it != job->chunks.end();) {
      const ChunkRef chunk = it->second;  // A copy: the entry may be erased below.
      auto placed = mine.find(it->first);
      absl::MutexLock clock(&chunk->mu);
      if (placed == mine.end()) {
        Actions a = chunk->machine.Retire(moved, RefreshHint());
        sent_back += a.refusals.size();
        carry.emplace_back(chunk, std::move(a));
        job->chunks.erase(it++);
        continue;
      }
      const ChunkPlacement& p = *placed->second;
      Actions a = chunk->machine.ApplyPlacement(me, p.primary, p.backup, chunk->has_sum());
      if (a.retired) demoted.push_back(&p);
      sent_back += a.refusals.size();
      carry.emplace_back(chunk, std::move(a));
      ++it;
    }
    for (auto& [key, chunk] : fresh) job->chunks[key] = chunk;
    job->primary_of = std::move(primary_of);
    OPTIMUS_LOG(Info, kLog, "job ", job->config.job_id, ": map epoch ", job->map_epoch, " -> ",
                epoch, " (", fresh.size(), " new chunks, ", sent_back, " pulls sent back)");
    job->map_epoch = epoch;
  }
  for (auto& [chunk, a] : carry) Carry(job, chunk, std::move(a));
  // A primary the map makes a backup starts over as a fresh backup (the
  // machine retired the old one); its primary seeds it.
  for (const ChunkPlacement* p : demoted) {
    absl::StatusOr<ChunkRef> chunk = PlaceChunk(*job, *p, nullptr);
    if (!chunk.ok()) return chunk.status();
    absl::MutexLock lock(&job->mu);
    job->chunks[ChunkKey(p->tensor, p->chunk)] = *std::move(chunk);
  }
  return absl::OkStatus();
}

void Shard::RetireChunk(const JobRef& job, const ChunkRef& chunk, const absl::Status& why,
                        ReplyHint hint) {
  Actions a;
  {
    absl::MutexLock lock(&chunk->mu);
    a = chunk->machine.Retire(why, hint);
  }
  Carry(job, chunk, std::move(a));  // Drops it from the job's table too.
}

void Shard::ReleaseJob(uint64_t job_id, const absl::Status& why, ReplyHint hint) {
  JobRef job = table_.Remove(job_id);
  if (job == nullptr) return;
  for (const ChunkRef& chunk : job->Chunks()) RetireChunk(job, chunk, why, hint);
  if (ckpt_writer_ != nullptr) ckpt_writer_->FailJob(job_id, std::string(why.message()));
}

bool Shard::DroppedWhenDown(uint64_t job_id) {
  absl::MutexLock lock(&dropped_mu_);
  return dropped_when_down_.count(job_id) != 0;
}

void Shard::ReleaseAll(const absl::Status& why, ReplyHint hint) {
  for (const JobRef& job : table_.All()) ReleaseJob(job->config.job_id, why, hint);
}

absl::Status Shard::VerifyPeer(absl::string_view identity, absl::string_view challenge,
                              absl::string_view proof) {
  std::optional<std::string> key;
  {
    absl::MutexLock lock(&identity_mu_);
    key = data_plane_key_;
  }
  if (!key.has_value()) return absl::UnavailableError("shard not registered yet");
  if (key->empty()) return absl::OkStatus();  // Plain text: no identities.
  uint64_t job_id = 0, shard = 0;
  uint32_t rank = 0;
  std::vector<absl::string_view> parts = absl::StrSplit(identity, ':');
  if (parts.size() == 3 && parts[0] == "worker" && absl::SimpleAtoi(parts[1], &job_id) &&
      absl::SimpleAtoi(parts[2], &rank) && security::WorkerIdentity(job_id, rank) == identity) {
    return security::CheckDataPlaneProof(security::JobDataPlaneKey(*key, job_id), challenge,
                                         identity, proof);
  }
  if (parts.size() == 2 && parts[0] == "shard" && absl::SimpleAtoi(parts[1], &shard) &&
      security::ShardIdentity(shard) == identity) {
    return security::CheckDataPlaneProof(*key, challenge, identity, proof);
  }
  return absl::UnauthenticatedError(
      absl::StrCat("\"", absl::CHexEscape(identity.substr(0, 64)),
                   "\" is no identity this shard knows (worker:<job>:<rank> or shard:<id>)"));
}

std::pair<std::string, std::string> Shard::ProveSelf(absl::string_view challenge) {
  std::optional<std::string> key;
  {
    absl::MutexLock lock(&identity_mu_);
    key = data_plane_key_;
  }
  const std::string identity = security::ShardIdentity(shard_id_.load());
  if (!key.has_value() || key->empty()) return {identity, std::string()};
  return {identity, security::DataPlaneProof(*key, challenge, identity)};
}

bool Shard::ChecksIdentities() const {
  return checks_identities_.load(std::memory_order_acquire);
}

}  // namespace server
}  // namespace optimus
