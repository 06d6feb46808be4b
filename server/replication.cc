// Replication (jobs with a backup per chunk). Primary side: send the step's
// summed gradient, or the whole state as a seed, to the chunk's backup and
// hand its answer to the chunk. Backup side: take sums and seeds from the
// chunk's primary, and fence a sender that is no longer the primary. The
// protocol's decisions are the chunk's (chunk.h); this file moves bytes.
#include <cstring>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/security.h"
#include "common/logging.h"
#include "kernels/cpu/optimizer.h"
#include "server/shard.h"

namespace optimus {
namespace server {
namespace {
constexpr char kLog[] = "shard";

uintptr_t PeerOf(transport::EndpointRef ep) { return reinterpret_cast<uintptr_t>(ep.ep); }
}  // namespace

// ---- Primary side -------------------------------------------------------------

void Shard::ConnectPeers(const ShardMapView& map) {
  const uint64_t me = shard_id_.load();
  std::set<uint64_t> wanted;
  for (const ChunkPlacement& p : map.chunks) {
    if (p.primary == me && p.backup != 0) wanted.insert(p.backup);
  }
  for (uint64_t id : wanted) {
    {
      absl::MutexLock lock(&peers_mu_);
      if (peers_.count(id) != 0) continue;
    }
    auto addr = map.addresses.find(id);
    if (addr == map.addresses.end()) continue;
    auto ep = worker_->Connect(addr->second, security::ShardIdentity(id));
    if (!ep.ok()) {
      // Forwards to it fail and wait for a map that replaces it.
      OPTIMUS_LOG(Warning, kLog, "cannot reach backup shard ", id, ": ", ep.status().ToString());
      continue;
    }
    absl::MutexLock lock(&peers_mu_);
    peers_[id] = *ep;
  }
}

transport::EndpointRef Shard::PeerEndpoint(uint64_t shard_id) {
  absl::MutexLock lock(&peers_mu_);
  auto it = peers_.find(shard_id);
  return it == peers_.end() ? transport::EndpointRef{} : it->second;
}

void Shard::SendForward(const JobRef& job, const ChunkRef& chunk, uint64_t gen, uint64_t version,
                        bool seed, const ForwardedStep& step) {
  if (closing_.load()) return;
  uint64_t backup;
  uint64_t optimizer_steps;
  float last_lr;
  {
    absl::MutexLock lock(&chunk->mu);
    if (chunk->machine.backup_gen() != gen) return;  // A newer map replaced the backup.
    backup = chunk->machine.backup_shard();
    optimizer_steps = chunk->machine.optimizer_steps();
    last_lr = chunk->machine.last_lr();
  }
  const transport::EndpointRef ep = PeerEndpoint(backup);
  if (!ep.valid()) {
    Actions a;
    {
      absl::MutexLock lock(&chunk->mu);
      a = chunk->machine.ForwardDone(gen, seed, ForwardAnswer::kFailed);
    }
    OPTIMUS_LOG(Warning, kLog, "no endpoint to backup shard ", backup, " of tensor ",
                chunk->name.tensor, " chunk ", chunk->name.chunk, "; the step waits for a new map");
    return Carry(job, chunk, std::move(a));
  }
  const size_t n = chunk->num_elems;
  std::shared_ptr<std::vector<float>> staging;
  const void* payload;
  size_t bytes;
  if (seed) {
    // The state after the kernel: the machine holds the chunk unpublished
    // (and so unchanged) until the backup answers.
    staging = std::make_shared<std::vector<float>>(chunk->PackState());
    payload = staging->data();
    bytes = staging->size() * 4;
  } else if (step.skip) {
    payload = nullptr;
    bytes = 0;
  } else {
    payload = chunk->sum();
    bytes = n * 4;
  }
  wire::RequestHeader h;
  h.op = static_cast<uint16_t>(wire::Op::kReplicate);
  h.map_epoch = job->epoch();
  h.job_id = job->config.job_id;
  h.tensor = chunk->name.tensor;
  h.chunk = chunk->name.chunk;
  h.step = version;
  h.rank = static_cast<uint32_t>(shard_id_.load());
  h.dtype = static_cast<uint8_t>(DType::kFp32);
  h.flags = seed ? wire::kReplicateState : wire::kReplicateSum;
  h.num_bytes = bytes;
  if (seed) {
    h.optimizer_steps = optimizer_steps;
    h.lr = last_lr;
  } else {
    h.lr = step.lr;
    h.grad_sum_squares = step.partial;
    if (step.skip) h.step_flags |= wire::kStepSkip;
  }
  const uint64_t id = next_forward_id_.fetch_add(1);
  h.request_id = id;
  {
    absl::MutexLock lock(&fwd_mu_);
    forwards_[id] = PendingForward{job, chunk, gen, seed, ep, staging};
  }
  metrics_.forwards_sent.fetch_add(1);
  worker_->Send(ep, wire::kAmRequest, wire::AsBytes(h), payload, bytes,
                [this, id](absl::Status st) {
                  if (!st.ok()) ForwardDone(id, st, 0);
                });
}

void Shard::OnForwardReply(transport::IncomingMessage& msg) {
  auto reply = wire::ParseReply(msg.header());
  if (!reply.ok()) {
    OPTIMUS_LOG(Warning, kLog, "dropping malformed reply: ", reply.status().ToString());
    return;
  }
  ForwardDone(reply->header.request_id, reply->status, reply->header.flags);
}

void Shard::FailForwardsTo(transport::EndpointRef ep, const absl::Status& why) {
  std::vector<uint64_t> ids;
  {
    absl::MutexLock lock(&fwd_mu_);
    for (const auto& [id, f] : forwards_) {
      if (f.ep.ep == ep.ep) ids.push_back(id);
    }
  }
  {
    absl::MutexLock lock(&peers_mu_);
    for (auto it = peers_.begin(); it != peers_.end();) {
      it = it->second.ep == ep.ep ? peers_.erase(it) : std::next(it);
    }
  }
  for (uint64_t id : ids) ForwardDone(id, absl::UnavailableError(why.message()), 0);
}

void Shard::ForwardDone(uint64_t forward_id, const absl::Status& st, uint32_t flags) {
  PendingForward f;
  {
    absl::MutexLock lock(&fwd_mu_);
    auto it = forwards_.find(forward_id);
    if (it == forwards_.end()) return;  // Already answered (send error + reply).
    f = std::move(it->second);
    forwards_.erase(it);
  }
  ForwardAnswer answer = ForwardAnswer::kFailed;
  if (st.ok()) {
    answer = ForwardAnswer::kAcked;
  } else if ((flags & wire::kReplyFenced) != 0) {
    answer = ForwardAnswer::kFenced;
  } else if ((flags & wire::kReplyNeedSeed) != 0) {
    answer = ForwardAnswer::kNeedSeed;
  } else if ((flags & wire::kReplyRetry) != 0) {
    answer = ForwardAnswer::kRetry;
  }
  Actions a;
  uint64_t backup;
  bool waits_for_map;
  {
    absl::MutexLock lock(&f.chunk->mu);
    backup = f.chunk->machine.backup_shard();
    a = f.chunk->machine.ForwardDone(f.gen, f.seed, answer);
    waits_for_map = answer == ForwardAnswer::kFailed &&
                    f.chunk->machine.forward() == Forward::kWaitMap;
  }
  if (waits_for_map) {
    OPTIMUS_LOG(Warning, kLog, "forward of tensor ", f.chunk->name.tensor, " chunk ",
                f.chunk->name.chunk, " to backup shard ", backup, " failed (", st.ToString(),
                "); the step waits for a new map");
  }
  if (answer == ForwardAnswer::kFenced) {
    OPTIMUS_LOG(Info, kLog, "tensor ", f.chunk->name.tensor, " chunk ", f.chunk->name.chunk,
                " retired: fenced by shard ", backup, ": ", st.message());
  }
  Carry(f.job, f.chunk, std::move(a));
}

// ---- Backup side ----------------------------------------------------------------

void Shard::OnReplicate(transport::IncomingMessage& msg, const wire::RequestHeader& h) {
  const uintptr_t from = PeerOf(msg.reply_endpoint());
  auto refuse = [&](const absl::Status& s, ReplyHint hint) {
    metrics_.requests_rejected.fetch_add(1);
    Reply(from, h.request_id, s, hint);
  };
  const std::string what = absl::StrCat("forward of tensor ", h.tensor, " chunk ", h.chunk,
                                        " of job ", h.job_id, " from shard ", h.rank);
  JobRef job = table_.Find(h.job_id);
  ChunkRef chunk = job != nullptr ? job->Find(h.tensor, h.chunk) : nullptr;
  const uint64_t epoch = job != nullptr ? job->epoch() : 0;
  bool is_backup = false;
  if (chunk != nullptr) {
    absl::MutexLock lock(&chunk->mu);
    is_backup = chunk->machine.role() == Role::kBackup && chunk->machine.primary_shard() == h.rank;
  }
  if (!is_backup) {
    // Under our map the chunk has another primary (us, promoted, or a shard
    // it moved to): the sender must stop. If only the backup moved (the
    // sender is still the primary and learns its new backup from its next
    // map), or we lag behind the sender's map, it asks again.
    const uint64_t primary = job != nullptr ? job->PrimaryOf(h.tensor, h.chunk) : 0;
    const bool sender_deposed = primary != 0 && primary != h.rank;
    if (job == nullptr || h.map_epoch > epoch || !sender_deposed) {
      BeatNow();
      ReplyHint retry;
      retry.retry = true;
      return refuse(absl::UnavailableError(
                        absl::StrCat(what, ": map epoch ", h.map_epoch, " not loaded here yet")),
                    retry);
    }
    const absl::Status fenced = absl::FailedPreconditionError(
        absl::StrCat(what, ": shard ", shard_id_.load(), " is not its backup under map epoch ",
                     epoch, " (the sender's is ", h.map_epoch, ")"));
    OPTIMUS_LOG(Info, kLog, "fencing: ", fenced.message());
    ReplyHint hint;
    hint.fenced = true;
    return refuse(fenced, hint);
  }
  const bool state = (h.flags & wire::kReplicateState) != 0;
  const size_t n = chunk->num_elems;
  const bool skip = !state && (h.step_flags & wire::kStepSkip) != 0;
  const uint64_t want = state ? job->layout().num_arrays * n * 4 : skip ? 0 : n * 4;
  if (h.dtype != static_cast<uint8_t>(DType::kFp32) || h.num_bytes != want ||
      msg.payload_size() != want || state == ((h.flags & wire::kReplicateSum) != 0)) {
    return refuse(absl::InvalidArgumentError(absl::StrCat(what, ": carries ", msg.payload_size(),
                                                          " bytes (flags ",
                                                          static_cast<int>(h.flags),
                                                          "), expected ", want)),
                  {});
  }
  const uint64_t request_id = h.request_id;
  const uint64_t step = h.step;
  const uint64_t optimizer_steps = h.optimizer_steps;
  const float lr = h.lr;
  if (state) {
    // Room for the seed's landing buffer first (bounded with the other
    // requests being received); the primary sends it again later.
    const size_t elems = job->layout().num_arrays * n;
    if (!limits_->TryReserveBytes(elems * sizeof(float))) {
      ReplyHint retry;
      retry.retry = true;
      return refuse(InflightFull(elems * sizeof(float), limits_->options().max_inflight_bytes),
                    retry);
    }
    auto staging = InflightBuffer<float>(limits_, elems);
    PushDecision d;
    {
      absl::MutexLock lock(&chunk->mu);
      d = chunk->machine.SeedOffered(step);
    }
    if (d.verdict != PushVerdict::kAccept) return refuse(d.error, d.hint);
    msg.ReceiveInto(staging->data(), [this, from, request_id, step, job, chunk, staging,
                                      optimizer_steps, lr](absl::Status rs) {
      if (rs.ok()) {
        // The chunk is being seeded: nothing else touches its buffers.
        chunk->UnpackState(staging->data());
        kernels::CastFromFp32(chunk->master(), chunk->num_elems, chunk->published(step),
                              job->config.param_dtype);
      }
      Actions a;
      {
        absl::MutexLock lock(&chunk->mu);
        a = chunk->machine.SeedLanded(rs.ok(), step, optimizer_steps, lr);
      }
      if (rs.ok()) metrics_.seeds_received.fetch_add(1);
      Reply(from, request_id, rs);
      Carry(job, chunk, std::move(a));
    });
    return;
  }
  float* sum = chunk->sum();
  PushDecision d;
  {
    absl::MutexLock lock(&chunk->mu);
    ForwardedStep f;
    f.skip = skip;
    f.lr = lr;
    f.partial = h.grad_sum_squares;
    d = chunk->machine.SumOffered(step, sum != nullptr, f);
    if (d.verdict == PushVerdict::kAccept) chunk->forward_from = Requester{from, request_id};
  }
  if (d.verdict != PushVerdict::kAccept) return refuse(d.error, d.hint);
  if (skip) {
    Actions a;
    {
      absl::MutexLock lock(&chunk->mu);
      a = chunk->machine.SumLanded(true);
    }
    return Carry(job, chunk, std::move(a));
  }
  msg.ReceiveInto(sum, [this, from, request_id, job, chunk](absl::Status rs) {
    Actions a;
    {
      absl::MutexLock lock(&chunk->mu);
      a = chunk->machine.SumLanded(rs.ok());
    }
    if (!rs.ok()) Reply(from, request_id, rs);
    Carry(job, chunk, std::move(a));
  });
}

}  // namespace server
}  // namespace optimus
