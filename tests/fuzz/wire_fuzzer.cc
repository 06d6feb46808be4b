// Fuzz target: the data plane's wire header parsers (common/wire.h), which
// see every byte a peer sends before anything else does. Checks that
// ParseRequestHeader, ParseReply and SplitReplyBatch never crash or read out
// of bounds, that whatever they accept holds the invariants they promise,
// and that a reply survives EncodeReply -> ParseReply unchanged.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "common/wire.h"

namespace {

using optimus::wire::ParseReply;
using optimus::wire::ParseRequestHeader;

// A broken promise of the code under test: abort, so libFuzzer keeps the input.
void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "wire_fuzzer: invariant broken: %s\n", what);
    std::abort();
  }
}

void CheckRequest(absl::Span<const uint8_t> bytes) {
  auto h = ParseRequestHeader(bytes);
  if (!h.ok()) {
    Require(h.status().code() == absl::StatusCode::kInvalidArgument,
            "a bad request header is INVALID_ARGUMENT");
    return;
  }
  Require(bytes.size() == sizeof(optimus::wire::RequestHeader), "accepted header has 96 bytes");
  Require(h->magic == optimus::wire::kMagic && h->version == optimus::wire::kVersion,
          "accepted header has the magic and version");
  Require(h->op >= static_cast<uint16_t>(optimus::wire::Op::kPush) &&
              h->op <= static_cast<uint16_t>(optimus::wire::Op::kBatch),
          "accepted op is known");
  Require(optimus::DTypeFromInt(h->dtype).ok(), "accepted dtype is known");
  for (float v : {h->lr, h->grad_mult, h->clip_coef}) {
    Require(std::isfinite(v) && v >= 0.0f, "accepted floats are finite and >= 0");
  }
  // What the server does next with an accepted header: name its dtype.
  Require(!optimus::DTypeName(static_cast<optimus::DType>(h->dtype)).empty(), "dtype has a name");
  Require(std::memcmp(&*h, bytes.data(), bytes.size()) == 0, "parsing copies the bytes as they are");
}

void CheckReply(absl::Span<const uint8_t> bytes) {
  auto r = ParseReply(bytes);
  if (!r.ok()) {
    Require(r.status().code() == absl::StatusCode::kInvalidArgument,
            "a bad reply is INVALID_ARGUMENT");
    return;
  }
  Require(bytes.size() == sizeof(optimus::wire::ReplyHeader) + r->header.message_len,
          "accepted reply is its header and message");
  // Re-encoding what was read gives a reply that reads the same.
  const std::string again = optimus::wire::EncodeReply(
      r->header.request_id, r->status, r->header.param_version, r->header.flags,
      r->header.grad_sum_squares);
  auto r2 = ParseReply(absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(again.data()),
                                                 again.size()));
  Require(r2.ok(), "an encoded reply parses");
  Require(r2->status.code() == r->status.code(), "the code survives a round trip");
  Require(r2->status.message() == r->status.message(), "the message survives a round trip");
  Require(r2->header.request_id == r->header.request_id &&
              r2->header.param_version == r->header.param_version &&
              r2->header.flags == r->header.flags,
          "the header survives a round trip");
}

// A reply batch (the worker's side of kAmReplyBatch): the first four bytes
// as the count, the rest as the payload. What is accepted is `count`
// replies, each one ParseReply accepts, that fill the payload exactly.
void CheckReplyBatch(absl::Span<const uint8_t> bytes) {
  if (bytes.size() < 4) return;
  uint32_t count;
  std::memcpy(&count, bytes.data(), 4);
  const absl::Span<const uint8_t> payload = bytes.subspan(4);
  auto items = optimus::wire::SplitReplyBatch(payload, count % 64);
  if (!items.ok()) {
    Require(items.status().code() == absl::StatusCode::kInvalidArgument,
            "a bad reply batch is INVALID_ARGUMENT");
    return;
  }
  Require(items->size() == count % 64, "an accepted batch holds its count");
  size_t total = 0;
  for (absl::Span<const uint8_t> item : *items) {
    Require(item.data() == payload.data() + total, "the replies are back to back");
    Require(ParseReply(item).ok(), "every reply of an accepted batch parses");
    total += item.size();
  }
  Require(total == payload.size(), "the replies fill the payload");
  optimus::wire::ParseReplyBatchHeader(bytes).IgnoreError();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::Span<const uint8_t> bytes(data, size);
  CheckRequest(bytes);
  CheckReply(bytes);
  CheckReplyBatch(bytes);
  // The same bytes as a batch's headers (requests back to back): every
  // 96-byte slice goes through the parser as the shard's batch path does.
  for (size_t at = 0; at + sizeof(optimus::wire::RequestHeader) <= size;
       at += sizeof(optimus::wire::RequestHeader)) {
    CheckRequest(bytes.subspan(at, sizeof(optimus::wire::RequestHeader)));
  }
  // Any status a shard may answer with encodes to a reply the worker reads.
  if (size >= 2) {
    const auto code = static_cast<absl::StatusCode>(data[0] % 17);
    const absl::string_view msg(reinterpret_cast<const char*>(data + 1), size - 1);
    const absl::Status s = code == absl::StatusCode::kOk ? absl::OkStatus() : absl::Status(code, msg);
    const std::string enc = optimus::wire::EncodeReply(7, s, 3, 1);
    auto back = ParseReply(
        absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(enc.data()), enc.size()));
    Require(back.ok() && back->status.code() == s.code(), "EncodeReply's output parses");
    Require(back->status.message() == s.message().substr(0, 1024), "long messages are cut at 1 KiB");
  }
  return 0;
}
