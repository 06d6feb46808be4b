// Data-plane requests from workers (push, pull, init), on the transport's
// progress thread: parse and validate the header, find the job and chunk
// under the request's map epoch, hand the request to the chunk's state
// machine, and reply. Replication requests go to replication.cc.
#include <chrono>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "kernels/cpu/optimizer.h"
#include "server/shard.h"

namespace optimus {
namespace server {
namespace {

uint32_t WireFlags(const ReplyHint& hint) {
  uint32_t f = 0;
  if (hint.duplicate) f |= wire::kReplyDuplicate;
  if (hint.refresh_map) f |= wire::kReplyRefreshMap;
  if (hint.fenced) f |= wire::kReplyFenced;
  if (hint.retry) f |= wire::kReplyRetry;
  if (hint.need_seed) f |= wire::kReplyNeedSeed;
  return f;
}

uintptr_t PeerOf(transport::EndpointRef ep) { return reinterpret_cast<uintptr_t>(ep.ep); }

// The replies without payload that this thread holds back for one peer while
// it handles that peer's batch (when the batch's sender takes reply batches,
// wire::kRequestBatchReplies); they leave together when the batch's requests
// are handled (Shard::OnBatch).
struct ReplyCork {
  uintptr_t peer = 0;
  uint32_t count = 0;
  std::string bytes;  // The replies back to back (wire::kAmReplyBatch's payload).
};
thread_local ReplyCork* tls_reply_cork = nullptr;

// Adds `reply` for `peer` to this thread's cork; false when it holds none
// for that peer (the reply is sent on its own).
bool Corked(uintptr_t peer, absl::Span<const uint8_t> reply) {
  ReplyCork* c = tls_reply_cork;
  if (c == nullptr || c->peer != peer) return false;
  c->bytes.append(reinterpret_cast<const char*>(reply.data()), reply.size());
  ++c->count;
  return true;
}

// The answers without payload a step thread holds back (Shard::StepHooks):
// acks of pushes whose senders take reply batches, per peer, until the
// thread's queue runs dry or the oldest has waited step_reply_hold. A commit
// round's acks come from the reduce, one chunk at a time; with many small
// chunks the thread runs through several reduces in a row.
struct StepHold {
  struct ForPeer {
    uintptr_t peer = 0;
    uint32_t count = 0;
    std::string bytes;  // wire::kAmReplyBatch's payload.
  };
  std::vector<ForPeer> peers;  // Few: the workers of the jobs it steps.
  uint32_t held = 0;
  std::chrono::steady_clock::time_point since;  // When the oldest held one came.
};
thread_local StepHold* tls_step_hold = nullptr;
// Most replies held for one peer (well below wire::kMaxBatch).
constexpr uint32_t kStepHoldMaxReplies = 1024;

transport::EndpointRef EndpointOf(uintptr_t peer) {
  return transport::EndpointRef{reinterpret_cast<void*>(peer)};
}

absl::Status CheckPayload(const transport::IncomingMessage& msg, const wire::RequestHeader& h,
                          uint64_t num_elems, DType want, absl::string_view what) {
  if (h.dtype != static_cast<uint8_t>(want)) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " for tensor ", h.tensor, " chunk ", h.chunk, " has dtype ",
        DTypeName(static_cast<DType>(h.dtype)), ", the job expects ", DTypeName(want)));
  }
  const uint64_t want_bytes = num_elems * DTypeSize(want);
  if (h.num_bytes != want_bytes || msg.payload_size() != want_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " for tensor ", h.tensor, " chunk ", h.chunk, " carries ", msg.payload_size(),
        " bytes (header says ", h.num_bytes, "), expected ", want_bytes, " (", num_elems, " x ",
        DTypeName(want), ")"));
  }
  return absl::OkStatus();
}

}  // namespace

void Shard::SendAck(const Ack& ack) {
  if (closing_.load()) return;
  uint32_t flags = 0;
  if (ack.duplicate) flags |= wire::kReplyDuplicate;
  if (ack.has_partial) flags |= wire::kReplyPartial;
  const wire::ReplyHeader header = wire::OkReplyHeader(ack.to.request_id, 0, flags, ack.partial);
  if (Corked(ack.to.peer, wire::AsBytes(header))) return;
  if (ack.to.batch_replies && HoldOnStepThread(ack.to.peer, wire::AsBytes(header))) return;
  worker_->Send(EndpointOf(ack.to.peer), wire::kAmReply, wire::AsBytes(header), nullptr, 0,
                [](absl::Status) {});
}

void Shard::Reply(uintptr_t peer, uint64_t request_id, const absl::Status& status,
                  const ReplyHint& hint) {
  if (closing_.load()) return;  // Completions cancelled by the worker's teardown.
  metrics_.CountError(status);
  std::string header = wire::EncodeReply(request_id, status, 0, WireFlags(hint));
  const absl::Span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(header.data()),
                                        header.size());
  if (Corked(peer, bytes)) return;
  worker_->Send(EndpointOf(peer), wire::kAmReply, bytes, nullptr, 0, [](absl::Status) {});
}

void Shard::SendCorked(uintptr_t peer, uint32_t count, std::string replies) {
  if (count == 0 || closing_.load()) return;
  if (count == 1) {  // As it would have gone alone.
    worker_->Send(EndpointOf(peer), wire::kAmReply,
                  absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(replies.data()),
                                            replies.size()),
                  nullptr, 0, [](absl::Status) {});
    return;
  }
  wire::ReplyBatchHeader h;
  h.count = count;
  h.num_bytes = replies.size();
  auto payload = std::make_shared<std::string>(std::move(replies));
  metrics_.reply_batches.fetch_add(1);
  metrics_.replies_batched.fetch_add(count);
  worker_->Send(EndpointOf(peer), wire::kAmReplyBatch,
                absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(&h), sizeof(h)),
                payload->data(), payload->size(), [payload](absl::Status) {});
}

void Shard::InstallStepHold() {
  static thread_local StepHold hold;
  tls_step_hold = &hold;
}

bool Shard::HoldOnStepThread(uintptr_t peer, absl::Span<const uint8_t> reply) {
  StepHold* h = tls_step_hold;
  if (h == nullptr) return false;
  StepHold::ForPeer* p = nullptr;
  for (StepHold::ForPeer& q : h->peers) {
    if (q.peer == peer) p = &q;
  }
  if (p == nullptr) {
    h->peers.emplace_back();
    p = &h->peers.back();
    p->peer = peer;
  }
  if (p->count >= kStepHoldMaxReplies) {
    h->held -= p->count;
    SendCorked(p->peer, p->count, std::move(p->bytes));
    p->bytes.clear();
    p->count = 0;
  }
  if (h->held == 0) h->since = std::chrono::steady_clock::now();
  p->bytes.append(reinterpret_cast<const char*>(reply.data()), reply.size());
  ++p->count;
  ++h->held;
  return true;
}

void Shard::FlushStepReplies(bool only_if_old) {
  StepHold* h = tls_step_hold;
  if (h == nullptr || h->held == 0) return;
  if (only_if_old && std::chrono::steady_clock::now() - h->since < step_hold_age_) return;
  for (StepHold::ForPeer& p : h->peers) SendCorked(p.peer, p.count, std::move(p.bytes));
  h->peers.clear();  // Peers come and go; the thread keeps none.
  h->held = 0;
}

void Shard::OnRequest(transport::IncomingMessage& msg) {
  const uintptr_t from = PeerOf(msg.reply_endpoint());
  auto parsed = wire::ParseRequestHeader(msg.header());
  if (!parsed.ok()) {
    metrics_.requests_rejected.fetch_add(1);
    // Without a valid header there is no request id to answer; the reply
    // carries id 0 so the sender still sees why.
    return Reply(from, 0, parsed.status());
  }
  const wire::RequestHeader& h = *parsed;
  if (static_cast<wire::Op>(h.op) == wire::Op::kReplicate) {
    // Only the shard it names (its primary, checked next) may forward.
    if (ChecksIdentities() && msg.peer_identity() != security::ShardIdentity(h.rank)) {
      metrics_.requests_refused_identity.fetch_add(1);
      metrics_.requests_rejected.fetch_add(1);
      return Reply(from, h.request_id,
                   absl::PermissionDeniedError(absl::StrCat(
                       "replication from shard ", h.rank, " sent by a peer that proved \"",
                       msg.peer_identity(), "\"")));
    }
    return OnReplicate(msg, h);
  }
  if (static_cast<wire::Op>(h.op) == wire::Op::kBatch) return OnBatch(msg, h);
  Dispatch(msg, h);
}

namespace {

// A payload inside a batch, kept for later: the batch's buffer stays alive
// with it (no copy).
class BatchPayload : public transport::PendingPayload {
 public:
  BatchPayload(std::shared_ptr<ReceiveBufferPool::Buffer> batch, const uint8_t* data, size_t size)
      : batch_(std::move(batch)), data_(data), size_(size) {}
  size_t size() const override { return size_; }
  void ReceiveInto(void* dst, const transport::MemoryRegion*, transport::DoneCallback done) override {
    if (received_) return done(absl::FailedPreconditionError("payload already received"));
    received_ = true;
    if (size_ > 0) std::memcpy(dst, data_, size_);
    done(absl::OkStatus());
  }

 private:
  std::shared_ptr<ReceiveBufferPool::Buffer> batch_;
  const uint8_t* data_;
  size_t size_;
  bool received_ = false;
};

// One request of a batch, handled as if it had come alone.
class BatchItem : public transport::IncomingMessage {
 public:
  BatchItem(std::shared_ptr<ReceiveBufferPool::Buffer> batch, const uint8_t* header,
            const uint8_t* payload, size_t payload_size, transport::EndpointRef from,
            const std::string& identity)
      : batch_(std::move(batch)),
        header_(header),
        payload_(payload),
        size_(payload_size),
        from_(from),
        identity_(identity) {}
  const std::string& peer_identity() const override { return identity_; }
  uint16_t am_id() const override { return wire::kAmRequest; }
  absl::Span<const uint8_t> header() const override {
    return absl::Span<const uint8_t>(header_, sizeof(wire::RequestHeader));
  }
  size_t payload_size() const override { return size_; }
  bool is_rendezvous() const override { return false; }
  transport::EndpointRef reply_endpoint() const override { return from_; }
  void ReceiveInto(void* dst, transport::DoneCallback done) override {
    if (taken_) return done(absl::FailedPreconditionError("payload already received"));
    taken_ = true;
    if (size_ > 0) std::memcpy(dst, payload_, size_);
    done(absl::OkStatus());
  }
  std::unique_ptr<transport::PendingPayload> Keep() override {
    if (taken_ || size_ == 0) return nullptr;
    taken_ = true;
    return std::make_unique<BatchPayload>(batch_, payload_, size_);
  }

 private:
  std::shared_ptr<ReceiveBufferPool::Buffer> batch_;
  const uint8_t* header_;
  const uint8_t* payload_;
  size_t size_;
  transport::EndpointRef from_;
  const std::string& identity_;  // The batch's sender's, alive while items are handled.
  bool taken_ = false;
};

}  // namespace

void Shard::OnBatch(transport::IncomingMessage& msg, const wire::RequestHeader& h) {
  const uintptr_t from = PeerOf(msg.reply_endpoint());
  const uint64_t count = h.step;
  const size_t size = msg.payload_size();
  absl::Status s;
  // The client batches small requests up to 1 MiB; anything much larger is
  // not a batch it sent.
  constexpr size_t kMaxBatchBytes = size_t{16} << 20;
  if (count == 0 || count > wire::kMaxBatch) {
    s = absl::InvalidArgumentError(absl::StrCat("batch of ", count, " requests (1..",
                                                wire::kMaxBatch, " allowed)"));
  } else if (size > kMaxBatchBytes) {
    s = absl::ResourceExhaustedError(
        absl::StrCat("batch of ", size, " bytes; a batch carries at most ", kMaxBatchBytes));
  } else if (h.num_bytes != size || size < count * sizeof(wire::RequestHeader)) {
    s = absl::InvalidArgumentError(absl::StrCat("batch of ", count, " requests carries ", size,
                                                " bytes (header says ", h.num_bytes,
                                                "); its headers alone take ",
                                                count * sizeof(wire::RequestHeader)));
  }
  if (!s.ok()) {
    metrics_.requests_rejected.fetch_add(1);
    return Reply(from, h.request_id, s);
  }
  if (!limits_->TryReserveBytes(size)) {
    metrics_.requests_rejected.fetch_add(1);
    return Reply(from, h.request_id, InflightFull(size, limits_->options().max_inflight_bytes));
  }
  metrics_.batches_received.fetch_add(1);
  auto batch = batch_buffers_->Take(limits_, size);
  const transport::EndpointRef ep = msg.reply_endpoint();
  const uint64_t batch_id = h.request_id;
  const bool batch_replies = (h.flags & wire::kRequestBatchReplies) != 0;
  msg.ReceiveInto(batch->data(), [this, batch, count, ep, from, batch_id, batch_replies,
                                  identity = msg.peer_identity()](absl::Status rs) {
    if (!rs.ok()) {
      metrics_.requests_rejected.fetch_add(1);
      return Reply(from, batch_id, rs);
    }
    // Check the whole batch before handling any of it: a malformed batch
    // changes nothing. The headers are parsed again to handle them (cheap
    // copies) rather than kept in a list allocated per batch.
    const uint8_t* headers = batch->data();
    const size_t header_bytes = count * sizeof(wire::RequestHeader);
    auto header_at = [headers](uint64_t i) {
      return wire::ParseRequestHeader(absl::Span<const uint8_t>(
          headers + i * sizeof(wire::RequestHeader), sizeof(wire::RequestHeader)));
    };
    uint64_t payload_bytes = 0;
    uint64_t parsed = 0;  // Items before the first bad one.
    absl::Status bad;
    for (uint64_t i = 0; i < count; ++i) {
      auto item = header_at(i);
      if (!item.ok()) {
        bad = absl::InvalidArgumentError(
            absl::StrCat("request ", i, " of a batch: ", item.status().message()));
        break;
      }
      const auto op = static_cast<wire::Op>(item->op);
      if (op == wire::Op::kBatch || op == wire::Op::kReplicate) {
        bad = absl::InvalidArgumentError(
            absl::StrCat("request ", i, " of a batch is a ",
                         op == wire::Op::kBatch ? "batch" : "replication message",
                         "; a batch holds pushes, pulls, inits and commits"));
        break;
      }
      if (op == wire::Op::kPush || op == wire::Op::kInit) {
        // Checked one item at a time: a sum of the peer's counts could wrap
        // around and pass the total's check below, and an item would then
        // read past the end of the batch.
        const uint64_t left = batch->size() - header_bytes - payload_bytes;
        if (item->num_bytes > left) {
          bad = absl::InvalidArgumentError(
              absl::StrCat("request ", i, " of a batch claims ", item->num_bytes,
                           " payload bytes; the batch has ", left, " left"));
          break;
        }
        payload_bytes += item->num_bytes;
      }
      parsed = i + 1;
    }
    if (bad.ok() && header_bytes + payload_bytes != batch->size()) {
      bad = absl::InvalidArgumentError(absl::StrCat(
          "batch of ", count, " requests: headers and payloads take ", header_bytes + payload_bytes,
          " bytes, the batch carries ", batch->size()));
    }
    if (!bad.ok()) {
      // Every request the sender can tell apart hears why (the batch's id
      // is its first request's).
      metrics_.requests_rejected.fetch_add(1);
      Reply(from, batch_id, bad);
      for (uint64_t i = 0; i < parsed; ++i) {
        const uint64_t id = header_at(i)->request_id;
        if (id != batch_id) Reply(from, id, bad);
      }
      return;
    }
    // The acks (and refusals) the batch's requests get while they are
    // handled here leave as one message; pull replies and answers that come
    // later (from the step threads) go on their own.
    ReplyCork cork;
    ReplyCork* const outer = tls_reply_cork;
    if (batch_replies) {
      cork.peer = from;
      cork.bytes.reserve(count * sizeof(wire::ReplyHeader));
      tls_reply_cork = &cork;
    }
    const uint8_t* payload = headers + header_bytes;
    for (uint64_t i = 0; i < count; ++i) {
      const wire::RequestHeader item = *header_at(i);
      const auto op = static_cast<wire::Op>(item.op);
      const size_t n = (op == wire::Op::kPush || op == wire::Op::kInit) ? item.num_bytes : 0;
      BatchItem sub(batch, headers + i * sizeof(wire::RequestHeader), payload, n, ep, identity);
      Dispatch(sub, item);
      payload += n;
    }
    tls_reply_cork = outer;
    SendCorked(from, cork.count, std::move(cork.bytes));
  });
}

void Shard::Dispatch(transport::IncomingMessage& msg, const wire::RequestHeader& h) {
  const uintptr_t from = PeerOf(msg.reply_endpoint());
  auto refuse = [&](const absl::Status& s, ReplyHint hint = {}) {
    metrics_.requests_rejected.fetch_add(1);
    Reply(from, h.request_id, s, hint);
  };
  if (ChecksIdentities() &&
      msg.peer_identity() != security::WorkerIdentity(h.job_id, h.rank)) {
    metrics_.requests_refused_identity.fetch_add(1);
    return refuse(absl::PermissionDeniedError(absl::StrCat(
        "request for job ", h.job_id, " rank ", h.rank, " from a peer that proved \"",
        msg.peer_identity(), "\"")));
  }
  JobRef job = table_.Find(h.job_id);
  ReplyHint refresh;
  refresh.refresh_map = true;
  if (job == nullptr) {
    if (DroppedWhenDown(h.job_id)) {
      // Declared down and back: the job moved on to other shards; the
      // sender's map is older than that.
      return refuse(absl::FailedPreconditionError(absl::StrCat(
                        "stale shard map: shard ", shard_id_.load(), " was declared down and "
                        "no longer holds job ", h.job_id)),
                    refresh);
    }
    return refuse(absl::NotFoundError(
        absl::StrCat("unknown job ", h.job_id, " on shard ", shard_id_.load())));
  }
  const uint64_t epoch = job->epoch();
  if (h.map_epoch < epoch) {
    return refuse(absl::FailedPreconditionError(
                      absl::StrCat("stale shard map: request has epoch ", h.map_epoch, ", job ",
                                   h.job_id, " is at epoch ", epoch)),
                  refresh);
  }
  if (h.map_epoch > epoch) {
    // The coordinator published a map this shard has not loaded yet.
    BeatNow();
    return refuse(absl::UnavailableError(absl::StrCat(
                      "shard ", shard_id_.load(), " has not loaded map epoch ", h.map_epoch,
                      " of job ", h.job_id, " yet (it has ", epoch, "); retry")),
                  refresh);
  }
  ChunkRef chunk = job->Find(h.tensor, h.chunk);
  if (chunk == nullptr) {
    if (job->PrimaryOf(h.tensor, h.chunk) == shard_id_.load()) {
      // Ours under the loaded map, but retired (fenced by a backup that
      // serves a newer map): the sender's map is as old as ours.
      return refuse(absl::FailedPreconditionError(absl::StrCat(
                        "stale shard map: shard ", shard_id_.load(), " is not the primary of tensor ",
                        h.tensor, " chunk ", h.chunk, " of job ", h.job_id, " at epoch ", epoch)),
                    refresh);
    }
    return refuse(absl::NotFoundError(absl::StrCat("unknown chunk ", h.chunk, " of tensor ",
                                                   h.tensor, " in job ", h.job_id, " on shard ",
                                                   shard_id_.load())));
  }
  switch (static_cast<wire::Op>(h.op)) {
    case wire::Op::kPush: return OnPush(msg, h, job, chunk);
    case wire::Op::kPull: return OnPull(msg, h, job, chunk);
    case wire::Op::kInit: return OnInit(msg, h, job, chunk);
    case wire::Op::kCommit:
      if (msg.payload_size() != 0 || h.num_bytes != 0) {
        return refuse(absl::InvalidArgumentError(absl::StrCat(
            "commit for tensor ", h.tensor, " chunk ", h.chunk, " carries ", msg.payload_size(),
            " bytes; a commit has no payload")));
      }
      return OnCommit(h, from, job, chunk);
    case wire::Op::kReplicate:  // Handled by OnRequest.
    case wire::Op::kBatch:
      return;
  }
}

void Shard::OnPush(transport::IncomingMessage& msg, const wire::RequestHeader& h,
                   const JobRef& job, const ChunkRef& chunk) {
  const uintptr_t from = PeerOf(msg.reply_endpoint());
  const JobConfig& c = job->config;
  const bool has_grad = (h.step_flags & wire::kPushNoGrad) == 0;
  absl::Status s;
  if (has_grad) {
    s = CheckPayload(msg, h, chunk->num_elems, c.grad_dtype, "push");
  } else if (h.num_bytes != 0 || msg.payload_size() != 0) {
    s = absl::InvalidArgumentError(absl::StrCat(
        "push without gradient for tensor ", h.tensor, " chunk ", h.chunk, " carries ",
        msg.payload_size(), " bytes; it must carry none"));
  }
  StepParams params;
  params.lr = h.lr;
  params.grad_mult = h.grad_mult > 0.0f ? h.grad_mult : 1.0f;
  PushDecision d;
  if (s.ok()) {
    absl::MutexLock lock(&chunk->mu);
    d = chunk->machine.PushRequested(h.step, h.rank, (h.flags & wire::kRequestResend) != 0,
                                     params, has_grad,
                                     Requester{from, h.request_id,
                                               (h.flags & wire::kRequestBatchReplies) != 0});
  } else {
    d.error = s;
  }
  if (d.verdict == PushVerdict::kRefuse) {
    metrics_.requests_rejected.fetch_add(1);
    return Reply(from, h.request_id, d.error, d.hint);
  }
  if (d.verdict == PushVerdict::kDuplicate || d.verdict == PushVerdict::kHeld) {
    metrics_.pushes_duplicate.fetch_add(1);
    if (d.verdict == PushVerdict::kDuplicate) SendAck(d.ack);
    return;
  }
  const uint64_t request_id = h.request_id;
  const uint32_t rank = h.rank;
  const uint64_t step = h.step;
  ChunkStaging& staging = chunk->staging();
  if (!has_grad) {
    staging.NoGrad(step, rank);
    Actions a;
    {
      absl::MutexLock lock(&chunk->mu);
      a = chunk->machine.PushLanded(rank, true);
    }
    metrics_.pushes_received.fetch_add(1);
    return Carry(job, chunk, std::move(a));
  }
  auto landed = [this, from, request_id, rank, step, job, chunk](absl::Status rs) {
    const bool fold = chunk->staging().Landed(step, rank, rs.ok());
    Actions a;
    {
      absl::MutexLock lock(&chunk->mu);
      a = chunk->machine.PushLanded(rank, rs.ok());
    }
    if (!rs.ok()) {
      metrics_.requests_rejected.fetch_add(1);
      return Reply(from, request_id, rs);
    }
    metrics_.pushes_received.fetch_add(1);
    metrics_.pushed_bytes.fetch_add(chunk->grad_bytes());
    if (fold) ScheduleFold(chunk);
    Carry(job, chunk, std::move(a));  // Answers the push (now, or with the partial).
  };
  const ChunkStaging::Landing place = staging.Land(step, rank);
  if (place.dst != nullptr) return msg.ReceiveInto(place.dst, place.region, std::move(landed));
  // No room in the staging pool yet: the payload stays at the worker (a
  // rendezvous) until a buffer frees up.
  std::shared_ptr<transport::PendingPayload> kept = msg.Keep();
  if (kept == nullptr) {
    // The transport cannot hold it (an eager payload it could not copy).
    landed(absl::ResourceExhaustedError(absl::StrCat(
        "no staging buffer free for tensor ", h.tensor, " chunk ", h.chunk, " of job ", h.job_id,
        " on shard ", shard_id_.load(), "; push it again")));
    return;
  }
  staging.Wait(step, rank, [kept, landed](ChunkStaging::Landing l) {
    kept->ReceiveInto(l.dst, l.region, landed);
  });
}

void Shard::OnCommit(const wire::RequestHeader& h, uintptr_t from, const JobRef& job,
                     const ChunkRef& chunk) {
  Actions a;
  {
    absl::MutexLock lock(&chunk->mu);
    a = chunk->machine.CommitRequested(h.step, h.clip_coef, (h.step_flags & wire::kStepSkip) != 0,
                                       Requester{from, h.request_id});
  }
  Carry(job, chunk, std::move(a));
}

void Shard::OnPull(transport::IncomingMessage& msg, const wire::RequestHeader& h,
                   const JobRef& job, const ChunkRef& chunk) {
  const uintptr_t from = PeerOf(msg.reply_endpoint());
  const DType want = job->config.param_dtype;
  PullDecision d;
  if (h.dtype != static_cast<uint8_t>(want)) {
    d.error = absl::InvalidArgumentError(absl::StrCat(
        "pull for tensor ", h.tensor, " chunk ", h.chunk, " asks for ",
        DTypeName(static_cast<DType>(h.dtype)), ", the job publishes ", DTypeName(want)));
  } else if (h.num_bytes != chunk->published_bytes() || msg.payload_size() != 0) {
    d.error = absl::InvalidArgumentError(absl::StrCat(
        "pull for tensor ", h.tensor, " chunk ", h.chunk, " expects ", h.num_bytes,
        " bytes; the chunk has ", chunk->published_bytes()));
  } else if (!limits_->TryPark(from)) {
    // Every pull holds a place from here until its version is sent (or it
    // is refused): a peer cannot make the shard hold, and later send at
    // once, more than its share.
    const PeerLimitOptions& lim = limits_->options();
    const bool shard_full = limits_->parked() >= lim.max_parked_pulls;
    d.error = absl::ResourceExhaustedError(absl::StrCat(
        "pull for tensor ", h.tensor, " chunk ", h.chunk, " of job ", h.job_id, " refused: ",
        shard_full ? absl::StrCat("shard ", shard_id_.load(), " has ", lim.max_parked_pulls,
                                  " pulls waiting or being sent (--max_parked_pulls)")
                   : absl::StrCat("this peer has ", lim.max_parked_pulls_per_peer,
                                  " pulls waiting or being sent on shard ", shard_id_.load(),
                                  " (--max_parked_pulls_per_peer)"),
        "; pull again once earlier ones are answered"));
  } else {
    {
      absl::MutexLock lock(&chunk->mu);
      d = chunk->machine.PullRequested(h.step, Requester{from, h.request_id});
    }
    if (d.verdict == PullVerdict::kRefuse) limits_->Unpark(from);
  }
  switch (d.verdict) {
    case PullVerdict::kServe:
      return SendVersion(job, chunk, PullReply{Requester{from, h.request_id}, h.step});
    case PullVerdict::kParked:
      return;  // Its place is given back when it is sent or refused.
    case PullVerdict::kRefuse:
      metrics_.requests_rejected.fetch_add(1);
      return Reply(from, h.request_id, d.error, d.hint);
  }
}

void Shard::OnInit(transport::IncomingMessage& msg, const wire::RequestHeader& h,
                   const JobRef& job, const ChunkRef& chunk) {
  const uintptr_t from = PeerOf(msg.reply_endpoint());
  const bool with_state = (h.step_flags & wire::kInitState) != 0;
  const uint32_t arrays = with_state ? job->layout().num_arrays : 1;
  absl::Status s = CheckPayload(msg, h, chunk->num_elems * arrays, DType::kFp32,
                                with_state ? "init with optimizer state" : "init");
  if (s.ok() && job->config.tensors.size() > h.tensor && job->config.tensors[h.tensor].frozen && with_state && h.optimizer_steps != 0) {
    s = absl::InvalidArgumentError(absl::StrCat("init of tensor ", h.tensor,
                                                " (frozen) says it took ", h.optimizer_steps,
                                                " optimizer steps; a frozen tensor takes none"));
  }
  PushDecision d;
  if (s.ok()) {
    absl::MutexLock lock(&chunk->mu);
    d = chunk->machine.InitRequested();
  } else {
    d.error = s;
  }
  if (d.verdict != PushVerdict::kAccept) {
    metrics_.requests_rejected.fetch_add(1);
    return Reply(from, h.request_id, d.error, d.hint);
  }
  const uint64_t request_id = h.request_id;
  const uint64_t optimizer_steps = with_state ? h.optimizer_steps : 0;
  const float last_lr = with_state ? h.lr : 0.0f;
  auto landed = [this, from, request_id, job, chunk, optimizer_steps, last_lr](absl::Status rs) {
    // The chunk is receiving its initial values: nothing else touches its
    // buffers until InitLanded.
    if (rs.ok()) {
      kernels::CastFromFp32(chunk->master(), chunk->num_elems, chunk->published(1),
                            job->config.param_dtype);
    }
    Actions a;
    {
      absl::MutexLock lock(&chunk->mu);
      a = chunk->machine.InitLanded(rs.ok(), optimizer_steps, last_lr);
    }
    Reply(from, request_id, rs);
    Carry(job, chunk, std::move(a));
  };
  if (!with_state) return msg.ReceiveInto(chunk->master(), std::move(landed));
  // The arrays arrive back to back: land them in a staging buffer, then
  // copy each into its own.
  const uint64_t staging_bytes = chunk->num_elems * arrays * sizeof(float);
  if (!limits_->TryReserveBytes(staging_bytes)) {
    metrics_.requests_rejected.fetch_add(1);
    // The machine took the init: tell it the values did not land.
    return landed(InflightFull(staging_bytes, limits_->options().max_inflight_bytes));
  }
  auto staging = InflightBuffer<float>(limits_, chunk->num_elems * arrays);
  msg.ReceiveInto(staging->data(), [staging, chunk, landed](absl::Status rs) mutable {
    if (rs.ok()) chunk->UnpackState(staging->data());
    landed(rs);
  });
}

void Shard::SendVersion(const JobRef& job, const ChunkRef& chunk, const PullReply& p) {
  const uintptr_t peer = p.to.peer;
  if (closing_.load()) return limits_->Unpark(peer);
  const wire::ReplyHeader header = wire::OkReplyHeader(p.to.request_id, p.version, 0);
  const size_t bytes = chunk->published_bytes();
  const uint64_t version = p.version;
  worker_->Send(EndpointOf(p.to.peer), wire::kAmReply, wire::AsBytes(header),
                chunk->published(version), bytes, chunk->published_region(version),
                [this, job, chunk, version, bytes, peer](absl::Status s) {
                  limits_->Unpark(peer);
                  if (!s.ok()) {
                    OPTIMUS_LOG(Warning, "shard", "pull reply failed: ", s.ToString());
                  } else {
                    metrics_.pulls_served.fetch_add(1);
                    metrics_.pulled_bytes.fetch_add(bytes);
                  }
                  Actions a;
                  {
                    absl::MutexLock lock(&chunk->mu);
                    a = chunk->machine.SendDone(version);
                  }
                  Carry(job, chunk, std::move(a));
                });
}

}  // namespace server
}  // namespace optimus
