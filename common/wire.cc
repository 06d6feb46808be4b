#include "common/wire.h"

#include <cmath>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace optimus {
namespace wire {
namespace {
constexpr size_t kMaxMessageBytes = 1024;  // Keeps replies inside one eager AM header.
}  // namespace

absl::StatusOr<RequestHeader> ParseRequestHeader(absl::Span<const uint8_t> bytes) {
  if (bytes.size() != sizeof(RequestHeader)) {
    return absl::InvalidArgumentError(absl::StrCat("malformed request header: ", bytes.size(),
                                                   " bytes, expected ", sizeof(RequestHeader)));
  }
  RequestHeader h;
  std::memcpy(&h, bytes.data(), sizeof(h));
  if (h.magic != kMagic) {
    return absl::InvalidArgumentError(absl::StrCat("malformed request header: bad magic 0x",
                                                   absl::Hex(h.magic)));
  }
  if (h.version != kVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("unsupported wire version ", h.version, " (this shard speaks ", kVersion, ")"));
  }
  if (h.op < static_cast<uint16_t>(Op::kPush) || h.op > static_cast<uint16_t>(Op::kBatch)) {
    return absl::InvalidArgumentError(absl::StrCat("unknown request op ", h.op));
  }
  if (auto d = DTypeFromInt(h.dtype); !d.ok()) return d.status();
  for (const auto& [name, v] : {std::pair<const char*, float>{"lr", h.lr},
                                {"grad_mult", h.grad_mult},
                                {"clip_coef", h.clip_coef}}) {
    if (!std::isfinite(v) || v < 0.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat("malformed request header: ", name, " is ", v, " (must be finite, >= 0)"));
    }
  }
  return h;
}

std::string EncodeReply(uint64_t request_id, const absl::Status& status, uint64_t param_version,
                        uint32_t flags, double grad_sum_squares) {
  ReplyHeader h;
  h.grad_sum_squares = grad_sum_squares;
  h.code = static_cast<uint16_t>(status.code());
  h.request_id = request_id;
  h.param_version = param_version;
  h.flags = flags;
  const size_t len = std::min(status.message().size(), kMaxMessageBytes);
  h.message_len = static_cast<uint32_t>(len);
  std::string out(sizeof(h) + len, '\0');
  std::memcpy(&out[0], &h, sizeof(h));
  if (len > 0) std::memcpy(&out[sizeof(h)], status.message().data(), len);
  return out;
}

absl::StatusOr<Reply> ParseReply(absl::Span<const uint8_t> bytes) {
  if (bytes.size() < sizeof(ReplyHeader)) {
    return absl::InvalidArgumentError(absl::StrCat("malformed reply: ", bytes.size(), " bytes"));
  }
  Reply r;
  std::memcpy(&r.header, bytes.data(), sizeof(r.header));
  if (r.header.magic != kMagic || r.header.version != kVersion) {
    return absl::InvalidArgumentError("malformed reply: bad magic or version");
  }
  if (r.header.message_len > kMaxMessageBytes ||
      bytes.size() != sizeof(ReplyHeader) + r.header.message_len) {
    return absl::InvalidArgumentError("malformed reply: bad message length");
  }
  const auto code = static_cast<absl::StatusCode>(r.header.code);
  if (code == absl::StatusCode::kOk) {
    r.status = absl::OkStatus();
  } else {
    r.status = absl::Status(
        code, absl::string_view(reinterpret_cast<const char*>(bytes.data()) + sizeof(ReplyHeader),
                                r.header.message_len));
  }
  return r;
}

absl::StatusOr<ReplyBatchHeader> ParseReplyBatchHeader(absl::Span<const uint8_t> bytes) {
  if (bytes.size() != sizeof(ReplyBatchHeader)) {
    return absl::InvalidArgumentError(absl::StrCat("malformed reply batch header: ", bytes.size(),
                                                   " bytes, expected ", sizeof(ReplyBatchHeader)));
  }
  ReplyBatchHeader h;
  std::memcpy(&h, bytes.data(), sizeof(h));
  if (h.magic != kMagic || h.version != kVersion) {
    return absl::InvalidArgumentError("malformed reply batch header: bad magic or version");
  }
  if (h.count == 0 || h.count > kMaxBatch) {
    return absl::InvalidArgumentError(
        absl::StrCat("reply batch of ", h.count, " replies (1..", kMaxBatch, " allowed)"));
  }
  if (h.num_bytes < h.count * sizeof(ReplyHeader) ||
      h.num_bytes > h.count * (sizeof(ReplyHeader) + kMaxMessageBytes)) {
    return absl::InvalidArgumentError(absl::StrCat("reply batch of ", h.count, " replies carries ",
                                                   h.num_bytes, " bytes"));
  }
  return h;
}

absl::StatusOr<std::vector<absl::Span<const uint8_t>>> SplitReplyBatch(
    absl::Span<const uint8_t> payload, uint32_t count) {
  std::vector<absl::Span<const uint8_t>> out;
  out.reserve(count);
  size_t at = 0;
  while (at < payload.size()) {
    if (out.size() == count) {
      return absl::InvalidArgumentError(absl::StrCat("reply batch of ", count, " replies has ",
                                                     payload.size() - at, " bytes left over"));
    }
    if (payload.size() - at < sizeof(ReplyHeader)) {
      return absl::InvalidArgumentError(
          absl::StrCat("reply ", out.size(), " of a batch is cut short"));
    }
    ReplyHeader h;
    std::memcpy(&h, payload.data() + at, sizeof(h));
    const uint64_t len = sizeof(ReplyHeader) + static_cast<uint64_t>(h.message_len);
    if (h.message_len > kMaxMessageBytes || len > payload.size() - at) {
      return absl::InvalidArgumentError(
          absl::StrCat("reply ", out.size(), " of a batch claims a ", h.message_len,
                       "-byte message; ", payload.size() - at, " bytes are left"));
    }
    absl::Span<const uint8_t> one = payload.subspan(at, len);
    if (auto r = ParseReply(one); !r.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("reply ", out.size(), " of a batch: ", r.status().message()));
    }
    out.push_back(one);
    at += len;
  }
  if (out.size() != count) {
    return absl::InvalidArgumentError(
        absl::StrCat("reply batch says ", count, " replies and holds ", out.size()));
  }
  return out;
}

}  // namespace wire
}  // namespace optimus
