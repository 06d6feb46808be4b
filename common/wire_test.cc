#include "common/wire.h"

#include <cstring>
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
