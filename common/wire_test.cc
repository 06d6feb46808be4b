#include "common/wire.h"

#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace optimus {
namespace wire {
namespace {

TEST(WireTest, RequestRoundTrip) {
  RequestHeader h;
  h.op = static_cast<uint16_t>(Op::kPush);
  h.job_id = 7;
  h.tensor = 3;
  h.chunk = 2;
  h.step = 11;
  h.rank = 1;
  h.dtype = static_cast<uint8_t>(DType::kBf16);
  h.num_bytes = 4096;
  h.request_id = 99;
  auto parsed = ParseRequestHeader(AsBytes(h));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->job_id, 7u);
  EXPECT_EQ(parsed->step, 11u);
  EXPECT_EQ(parsed->num_bytes, 4096u);
}

TEST(WireTest, RejectsMalformedRequests) {
  RequestHeader h;
  h.op = static_cast<uint16_t>(Op::kPull);
  h.dtype = static_cast<uint8_t>(DType::kFp32);
  // Truncated.
  auto bytes = AsBytes(h);
  EXPECT_EQ(ParseRequestHeader(bytes.subspan(0, 10)).status().code(),
            absl::StatusCode::kInvalidArgument);
  RequestHeader bad = h;
  bad.magic = 0x12345678;
  EXPECT_EQ(ParseRequestHeader(AsBytes(bad)).status().code(), absl::StatusCode::kInvalidArgument);
  bad = h;
  bad.version = 9;
  EXPECT_EQ(ParseRequestHeader(AsBytes(bad)).status().code(), absl::StatusCode::kInvalidArgument);
  bad = h;
  bad.op = 42;
  EXPECT_EQ(ParseRequestHeader(AsBytes(bad)).status().code(), absl::StatusCode::kInvalidArgument);
  bad = h;
  bad.dtype = 17;
  EXPECT_EQ(ParseRequestHeader(AsBytes(bad)).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(WireTest, ReplyCarriesStatus) {
  std::string enc = EncodeReply(5, absl::FailedPreconditionError("step 3 already applied"), 4,
                                kReplyDuplicate);
  auto r = ParseReply(absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(enc.data()),
                                                enc.size()));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->header.request_id, 5u);
  EXPECT_EQ(r->header.param_version, 4u);
  EXPECT_EQ(r->header.flags, kReplyDuplicate);
  EXPECT_EQ(r->status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(r->status.message(), "step 3 already applied");

  std::string ok = EncodeReply(6, absl::OkStatus(), 0, 0);
  auto r2 = ParseReply(absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(ok.data()),
                                                 ok.size()));
  ASSERT_TRUE(r2.ok());
  EXPECT_TRUE(r2->status.ok());

  // A reply whose message length disagrees with its size is refused.
  enc.pop_back();
  EXPECT_FALSE(ParseReply(absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(enc.data()),
                                                    enc.size()))
                   .ok());
}

}  // namespace
}  // namespace wire
}  // namespace optimus

namespace optimus {
namespace wire {
namespace {

// Version 2's step fields: carried as sent, and a value no step can use is
// refused before anything reads it; a version-1 peer is told why.
TEST(WireTest, StepFieldsRoundTripAndBadOnesAreRefused) {
  RequestHeader h;
  h.op = static_cast<uint16_t>(Op::kPush);
  h.dtype = static_cast<uint8_t>(DType::kBf16);
  h.lr = 3e-4f;
  h.grad_mult = 1.0f / 65536;
  h.step_flags = kPushNoGrad;
  h.optimizer_steps = 12;
  auto parsed = ParseRequestHeader(AsBytes(h));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->lr, 3e-4f);
  EXPECT_EQ(parsed->grad_mult, 1.0f / 65536);
  EXPECT_EQ(parsed->step_flags, static_cast<uint32_t>(kPushNoGrad));
  EXPECT_EQ(parsed->optimizer_steps, 12u);
  for (float v : {-1.0f, std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::infinity()}) {
    RequestHeader bad = h;
    bad.lr = v;
    EXPECT_EQ(ParseRequestHeader(AsBytes(bad)).status().code(),
              absl::StatusCode::kInvalidArgument);
    bad = h;
    bad.grad_mult = v;
    EXPECT_EQ(ParseRequestHeader(AsBytes(bad)).status().code(),
              absl::StatusCode::kInvalidArgument);
    bad = h;
    bad.op = static_cast<uint16_t>(Op::kCommit);
    bad.clip_coef = v;
    EXPECT_EQ(ParseRequestHeader(AsBytes(bad)).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  RequestHeader old = h;
  old.version = 1;
  absl::Status s = ParseRequestHeader(AsBytes(old)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("unsupported wire version 1"), absl::string_view::npos) << s;
}

TEST(WireTest, ReplyCarriesThePartial) {
  std::string enc = EncodeReply(9, absl::OkStatus(), 0, kReplyPartial, 2.5e-3);
  auto r = ParseReply(absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(enc.data()),
                                                enc.size()));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->header.flags, kReplyPartial);
  EXPECT_EQ(r->header.grad_sum_squares, 2.5e-3);
}

}  // namespace
}  // namespace wire
}  // namespace optimus

namespace optimus {
namespace wire {
namespace {

std::vector<uint8_t> Bytes(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

TEST(WireTest, AReplyBatchSplitsIntoTheRepliesItCarries) {
  std::vector<uint8_t> payload;
  const ReplyHeader ack = OkReplyHeader(7, 0, kReplyPartial, 2.5);
  const auto ack_bytes = AsBytes(ack);
  payload.insert(payload.end(), ack_bytes.begin(), ack_bytes.end());
  const std::vector<uint8_t> refusal =
      Bytes(EncodeReply(8, absl::NotFoundError("no tensor 99 here"), 0, 0));
  payload.insert(payload.end(), refusal.begin(), refusal.end());
  const std::vector<uint8_t> dup = Bytes(EncodeReply(9, absl::OkStatus(), 0, kReplyDuplicate));
  payload.insert(payload.end(), dup.begin(), dup.end());

  ReplyBatchHeader h;
  h.count = 3;
  h.num_bytes = payload.size();
  auto parsed = ParseReplyBatchHeader(
      absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(&h), sizeof(h)));
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  auto items = SplitReplyBatch(payload, parsed->count);
  ASSERT_TRUE(items.ok()) << items.status();
  ASSERT_EQ(items->size(), 3u);
  auto r0 = ParseReply((*items)[0]);
  ASSERT_TRUE(r0.ok());
  EXPECT_EQ(r0->header.request_id, 7u);
  EXPECT_EQ(r0->header.grad_sum_squares, 2.5);
  auto r1 = ParseReply((*items)[1]);
  ASSERT_TRUE(r1.ok());
  EXPECT_EQ(r1->header.request_id, 8u);
  EXPECT_EQ(r1->status, absl::NotFoundError("no tensor 99 here"));
  auto r2 = ParseReply((*items)[2]);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->header.flags, kReplyDuplicate);
}

TEST(WireTest, AMalformedReplyBatchIsRefusedWhole) {
  const std::vector<uint8_t> one = Bytes(EncodeReply(1, absl::OkStatus(), 0, 0));
  std::vector<uint8_t> two = one;
  two.insert(two.end(), one.begin(), one.end());
  // Counts that do not match what the payload holds.
  EXPECT_FALSE(SplitReplyBatch(two, 1).ok());
  EXPECT_FALSE(SplitReplyBatch(two, 3).ok());
  // Cut short, inside the second reply.
  EXPECT_FALSE(SplitReplyBatch(absl::Span<const uint8_t>(two).first(two.size() - 1), 2).ok());
  // A message longer than what is left.
  std::vector<uint8_t> bad = two;
  ReplyHeader h;
  std::memcpy(&h, bad.data(), sizeof(h));
  h.message_len = 4000;
  std::memcpy(bad.data(), &h, sizeof(h));
  EXPECT_FALSE(SplitReplyBatch(bad, 2).ok());
  // A reply with a bad magic.
  bad = two;
  bad[sizeof(ReplyHeader)] ^= 0xff;
  auto split = SplitReplyBatch(bad, 2);
  ASSERT_FALSE(split.ok());
  EXPECT_EQ(split.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(split.status().message().find("reply 1 of a batch"), std::string::npos)
      << split.status();

  auto header = [](uint32_t count, uint64_t bytes) {
    ReplyBatchHeader h;
    h.count = count;
    h.num_bytes = bytes;
    return ParseReplyBatchHeader(
        absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(&h), sizeof(h)));
  };
  EXPECT_TRUE(header(2, 2 * sizeof(ReplyHeader)).ok());
  EXPECT_FALSE(header(0, 0).ok());
  EXPECT_FALSE(header(kMaxBatch + 1, (kMaxBatch + 1) * sizeof(ReplyHeader)).ok());
  EXPECT_FALSE(header(2, sizeof(ReplyHeader)).ok());      // Too few bytes for two.
  EXPECT_FALSE(header(1, 10 * sizeof(ReplyHeader) + 4096).ok());  // Too many for one.
  std::vector<uint8_t> short_header(sizeof(ReplyBatchHeader) - 1);
  EXPECT_FALSE(ParseReplyBatchHeader(short_header).ok());
}

}  // namespace
}  // namespace wire
}  // namespace optimus
