// The data plane's fixed binary header, carried in the UCX active-message
// header of every push, pull and init request and every reply. Plain structs
// and pure functions; every field a peer sends is validated by Parse*()
// before use. Both ends are little-endian (x86_64 hosts, aarch64 DPUs).
#ifndef OPTIMUS_COMMON_WIRE_H_
#define OPTIMUS_COMMON_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/dtype.h"

namespace optimus {
namespace wire {

// Active-message ids.
constexpr uint16_t kAmRequest = 1;  // worker -> shard: push, pull, init.
constexpr uint16_t kAmReply = 2;    // shard -> worker: status (+ pulled bytes).
// shard -> worker: several replies without payload at once (ReplyBatchHeader),
// to a kBatch whose sender set kRequestBatchReplies.
constexpr uint16_t kAmReplyBatch = 3;

constexpr uint32_t kMagic = 0x4d54504fu;  // "OPTM" read little-endian.
// 2: per-step learning rate, gradient multiplier and flags in the request;
// the clipping round (kCommit, the partial sum of squares in push replies).
constexpr uint16_t kVersion = 2;

enum class Op : uint16_t {
  kPush = 1,  // Gradient for (chunk, step); payload: num_elems of dtype.
  kPull = 2,  // Parameters at version `step`; reply payload: num_elems of param dtype.
  kInit = 3,  // Initial fp32 master values (version 1); payload: num_elems fp32.
  // Primary -> backup (replication): `step` is the chunk version the message
  // starts from; payload (fp32): the chunk's state arrays at that version
  // (master, then the moments) when flags has kReplicateState, then the
  // step's summed, scaled gradient when flags has kReplicateSum. `rank`
  // carries the sender's shard id. Answered once applied.
  kReplicate = 4,
  // Worker -> shard, the second half of the clipping round (jobs with
  // max_grad_norm or skipping of non-finite steps): once a worker has every
  // chunk's partial sum of squares for `step` (from the push replies), it
  // sends each chunk the step's clip coefficient (`clip_coef`, in (0, 1])
  // and kStepSkip when the job's gradient holds an inf or NaN. No payload.
  // Every rank sends it; the chunk steps at the first and checks the rest
  // agree.
  kCommit = 5,
  // Worker -> shard: several requests in one message (many small chunks:
  // one message per shard instead of one per chunk). `step` is the number
  // of requests (1..kMaxBatch); the payload is their RequestHeaders back to
  // back, then their payloads back to back in the same order (num_bytes of
  // each push or init; none for pulls and commits); `num_bytes` is the
  // total. Each request is handled and answered (its own request_id) as if
  // it had come alone; a batch holds no batch and no kReplicate.
  kBatch = 6,
};
// Most requests in one kBatch.
constexpr uint64_t kMaxBatch = 4096;
// Most bytes the client puts in one kBatch; shards keep receive buffers of
// this size for batches (a larger batch is still accepted, up to 16 MiB).
constexpr size_t kBatchBytes = size_t{1} << 20;

// RequestHeader.step_flags bits.
enum StepFlags : uint32_t {
  // kPush: this rank has no gradient for the tensor this step (no payload);
  // a chunk none of whose ranks has one is left untouched.
  kPushNoGrad = 1u << 0,
  // kCommit / kReplicate (sum): the step is skipped: state untouched, the
  // version advances. No payload on a kReplicate.
  kStepSkip = 1u << 1,
  // kInit: the payload holds every state array of the chunk (master, then
  // the moments, kernels::LayoutOf order), and optimizer_steps says how many
  // steps they have seen (an imported optimizer state).
  kInitState = 1u << 2,
};

// RequestHeader.flags bits.
enum RequestFlags : uint8_t {
  // A push the client sends again after a failover. A step that is already
  // applied is answered OK + kReplyDuplicate instead of "stale push".
  kRequestResend = 1u << 0,
  kReplicateState = 1u << 1,  // kReplicate: seeds the backup with the state.
  kReplicateSum = 1u << 2,    // kReplicate: applies one step with the sum.
  // kBatch: the sender takes kAmReplyBatch, so the replies without payload
  // to the batch's requests (push acks, refusals) may come back in one
  // message instead of one each. kPush (alone or in a batch): its ack may
  // come inside a kAmReplyBatch with other acks (a commit round's acks,
  // which the shard's step threads hold). The client marks every push.
  kRequestBatchReplies = 1u << 3,
};

// 96 bytes. `step` is the gradient's step for kPush and kCommit and the
// wanted version for kPull (version v = the result of steps 1..v-1; initial
// values are v=1).
struct RequestHeader {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t op = 0;
  uint64_t job_id = 0;
  uint64_t map_epoch = 0;
  uint32_t tensor = 0;
  uint32_t chunk = 0;
  uint64_t step = 0;
  uint32_t rank = 0;
  uint8_t dtype = 0;
  uint8_t flags = 0;         // RequestFlags.
  uint8_t reserved[2] = {0, 0};
  uint64_t num_bytes = 0;    // Payload bytes sent (push/init) or expected (pull).
  uint64_t request_id = 0;   // Echoed in the reply.
  // kPush: the step's learning rate (before the tensor's group lr_mult), as
  // it is (0 is a step with lr 0; the client fills in the job's lr when the
  // trainer gives none). Every rank's push of a (chunk, step) must carry the
  // same.
  // kReplicate (sum): the lr of the forwarded step. kInit (state): the
  // last lr the imported state was stepped with (0: none).
  float lr = 0.0f;
  // kPush: multiplies the averaged gradient (1 / the loss scale); 0 means
  // 1. Every rank's push of a (chunk, step) must carry the same.
  float grad_mult = 0.0f;
  float clip_coef = 0.0f;    // kCommit: in (0, 1].
  uint32_t step_flags = 0;   // StepFlags.
  // kInit with kInitState, kReplicate seed: optimizer steps the values have
  // seen (torch's per-parameter 'step').
  uint64_t optimizer_steps = 0;
  // kReplicate (sum): the step's partial sum of squares, so that a promoted
  // backup answers a push sent again for it.
  double grad_sum_squares = 0.0;
};
static_assert(sizeof(RequestHeader) == 96, "wire layout");

enum ReplyFlags : uint32_t {
  kReplyDuplicate = 1u << 0,  // A push already received; this copy was dropped.
  // The request's map epoch is not the shard's, or the chunk is no longer on
  // this shard: fetch the job's current map and send it again.
  kReplyRefreshMap = 1u << 1,
  // kReplicate: the receiver is no longer this chunk's backup under a map
  // at least as new as the sender's (it was promoted, or the chunk moved):
  // the sender is not the primary any more and must stop serving the chunk.
  kReplyFenced = 1u << 2,
  // kReplicate: the receiver has not loaded the sender's map yet; retry soon.
  kReplyRetry = 1u << 3,
  // kReplicate: the backup does not hold the state this step starts from;
  // send the state (a seed) instead.
  kReplyNeedSeed = 1u << 4,
  // kPush (jobs with the clipping round): grad_sum_squares holds the sum of
  // squares of the chunk's averaged gradient for the push's step (inf or
  // NaN when it holds a non-finite value); the worker adds every chunk's and
  // sends kCommit.
  kReplyPartial = 1u << 5,
};

// Followed in the AM header by `message_len` bytes of error text.
struct ReplyHeader {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t code = 0;          // absl::StatusCode.
  uint64_t request_id = 0;
  uint64_t param_version = 0; // For pulls: the version whose bytes follow.
  uint32_t flags = 0;
  uint32_t message_len = 0;
  double grad_sum_squares = 0.0;  // With kReplyPartial.
  uint64_t reserved = 0;
};
static_assert(sizeof(ReplyHeader) == 48, "wire layout");

// Checks size, magic, version, op, dtype and that lr, grad_mult and
// clip_coef are finite and not negative. InvalidArgument on any mismatch.
absl::StatusOr<RequestHeader> ParseRequestHeader(absl::Span<const uint8_t> bytes);

// Serializes a reply carrying `status` (its message is truncated to 1 KiB).
std::string EncodeReply(uint64_t request_id, const absl::Status& status,
                        uint64_t param_version, uint32_t flags,
                        double grad_sum_squares = 0.0);

// An OK reply needs no message: its header is the whole reply, built on the
// stack (the servers' common path: no allocation per reply).
inline ReplyHeader OkReplyHeader(uint64_t request_id, uint64_t param_version, uint32_t flags,
                                 double grad_sum_squares = 0.0) {
  ReplyHeader h;
  h.grad_sum_squares = grad_sum_squares;
  h.request_id = request_id;
  h.param_version = param_version;
  h.flags = flags;
  return h;
}

struct Reply {
  ReplyHeader header;
  absl::Status status;
};

// Checks size, magic, version and message length.
absl::StatusOr<Reply> ParseReply(absl::Span<const uint8_t> bytes);

// The AM header of a kAmReplyBatch. Its payload is `count` replies back to
// back, each as a kAmReply's header would be (a ReplyHeader, then its
// message), `num_bytes` in all.
struct ReplyBatchHeader {
  uint32_t magic = kMagic;
  uint16_t version = kVersion;
  uint16_t reserved = 0;
  uint32_t count = 0;
  uint32_t reserved2 = 0;
  uint64_t num_bytes = 0;
};
static_assert(sizeof(ReplyBatchHeader) == 24, "wire layout");

// Checks size, magic, version, 1 <= count <= kMaxBatch and that num_bytes
// could hold `count` replies. INVALID_ARGUMENT on any mismatch.
absl::StatusOr<ReplyBatchHeader> ParseReplyBatchHeader(absl::Span<const uint8_t> bytes);

// A reply batch's payload cut into its replies, each one that ParseReply
// accepts; INVALID_ARGUMENT unless there are exactly `count` and they fill
// the payload.
absl::StatusOr<std::vector<absl::Span<const uint8_t>>> SplitReplyBatch(
    absl::Span<const uint8_t> payload, uint32_t count);

inline absl::Span<const uint8_t> AsBytes(const RequestHeader& h) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(&h), sizeof(h));
}
inline absl::Span<const uint8_t> AsBytes(const ReplyHeader& h) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(&h), sizeof(h));
}

}  // namespace wire
}  // namespace optimus

#endif  // OPTIMUS_COMMON_WIRE_H_
