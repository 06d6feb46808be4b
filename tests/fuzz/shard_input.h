// The input format of shard_requests_fuzzer, shared with make_seeds (which
// writes its seed corpus from real requests):
//   byte 0      the job the shard holds for this input (JobVariant)
//   then records, each:
//     u8   ctl      RecordFlags
//     u8   hlen     header bytes that follow
//     hlen bytes    the active message's header
//     u16  plen     payload bytes that follow (little-endian)
//     plen bytes    the payload
// A record cut short by the end of the input takes what is left. The fix-up
// flags let the fuzzer spend its time past the checks a peer that knows the
// protocol passes anyway (magic, version, the job's id and map epoch, a
// byte count matching the payload); without them the bytes go as they are.
#ifndef OPTIMUS_TESTS_FUZZ_SHARD_INPUT_H_
#define OPTIMUS_TESTS_FUZZ_SHARD_INPUT_H_

#include <cstdint>
#include <string>

#include "common/wire.h"

namespace optimus {
namespace fuzz {

enum JobVariant : uint8_t {
  // fp32 gradients and parameters, AdamW, 2 workers, replication 1: tensor
  // 0 one chunk of 64 elements (primary here, no backup), tensor 1 two
  // chunks of 32 (chunk 0 primary here with its backup on the peer, chunk 1
  // primary on the peer with its backup here).
  kFp32AdamWReplicated = 0,
  // bf16 gradients and parameters, SGD with momentum, 3 workers, clipping
  // (the commit round): tensor 0 one chunk of 64, tensor 1 (frozen) one of 16.
  kBf16SgdClipped = 1,
  // fp16 gradients and parameters, Lion, 1 worker, a checkpoint every 2
  // steps: tensor 0 two chunks of 48 and 16.
  kFp16LionCheckpointed = 2,
  kNumVariants = 3,
};

// The peer's shard id in the maps (the other shard of replicated chunks).
inline constexpr uint64_t kPeerShardId = 99;
inline constexpr int kMaxRecords = 64;

enum RecordFlags : uint8_t {
  kToReplyHandler = 1u << 0,  // Sent as wire::kAmReply instead of kAmRequest.
  kFixHeader = 1u << 1,       // Magic, version, job id, map epoch (requests); magic, version (replies).
  kFixBytes = 1u << 2,        // num_bytes = plen (requests); message_len = hlen - 48 (replies).
  kFixBatch = 1u << 3,        // kFixHeader on each request inside a kBatch payload.
  // Let this request settle before sending the next, as a client that
  // waits for its init before pushing does: wait until it is answered or
  // the shard has handled it and what it queued (its answer may never come:
  // a pull may be parked).
  kAwaitReply = 1u << 4,
};

inline void AppendRecord(std::string* out, uint8_t ctl, const std::string& header,
                         const std::string& payload) {
  out->push_back(static_cast<char>(ctl));
  out->push_back(static_cast<char>(header.size()));
  out->append(header);
  const uint16_t plen = static_cast<uint16_t>(payload.size());
  out->push_back(static_cast<char>(plen & 0xff));
  out->push_back(static_cast<char>(plen >> 8));
  out->append(payload);
}

inline std::string HeaderBytes(const wire::RequestHeader& h) {
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

}  // namespace fuzz
}  // namespace optimus

#endif  // OPTIMUS_TESTS_FUZZ_SHARD_INPUT_H_
