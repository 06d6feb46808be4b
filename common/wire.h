// The data plane's fixed binary header, carried in the UCX active-message
// header of every push, pull and init request and every reply. Plain structs
// and pure functions; every field a peer sends is validated by Parse*()
// before use. Both ends are little-endian (x86_64 hosts, aarch64 DPUs).
#ifndef OPTIMUS_COMMON_WIRE_H_
#define OPTIMUS_COMMON_WIRE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/dtype.h"

namespace optimus {
namespace wire {

// Active-message ids.
constexpr uint16_t kAmRequest = 1;  // worker -> shard: push, pull, init.
constexpr uint16_t kAmReply = 2;    // shard -> worker: status (+ pulled bytes).

constexpr uint32_t kMagic = 0x4d54504fu;  // "OPTM" read little-endian.
constexpr uint16_t kVersion = 1;

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
};

// RequestHeader.flags bits.
enum RequestFlags : uint8_t {
  // A push the client sends again after a failover. A step that is already
  // applied is answered OK + kReplyDuplicate instead of "stale push".
  kRequestResend = 1u << 0,
  kReplicateState = 1u << 1,  // kReplicate: seeds the backup with the state.
  kReplicateSum = 1u << 2,    // kReplicate: applies one step with the sum.
};

// 64 bytes. `step` is the gradient's step for kPush and the wanted version
// for kPull (version v = the result of steps 1..v-1; initial values are v=1).
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
};
static_assert(sizeof(RequestHeader) == 64, "wire layout");

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
};
static_assert(sizeof(ReplyHeader) == 32, "wire layout");

// Checks size, magic, version, op and dtype. InvalidArgument on any mismatch.
absl::StatusOr<RequestHeader> ParseRequestHeader(absl::Span<const uint8_t> bytes);

// Serializes a reply carrying `status` (its message is truncated to 1 KiB).
std::string EncodeReply(uint64_t request_id, const absl::Status& status,
                        uint64_t param_version, uint32_t flags);

struct Reply {
  ReplyHeader header;
  absl::Status status;
};

// Checks size, magic, version and message length.
absl::StatusOr<Reply> ParseReply(absl::Span<const uint8_t> bytes);

inline absl::Span<const uint8_t> AsBytes(const RequestHeader& h) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(&h), sizeof(h));
}

}  // namespace wire
}  // namespace optimus

#endif  // OPTIMUS_COMMON_WIRE_H_
