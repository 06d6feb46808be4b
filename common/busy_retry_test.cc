#include "common/busy_retry.h"

#include <algorithm>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace optimus {
namespace {

TEST(BusyRetryTest, BoundsDoubleUpToTheCapAndWaitsStayWithinThem) {
  BusyBackoff b;
  b.initial = absl::Milliseconds(100);
  b.cap = absl::Seconds(2);
  EXPECT_EQ(BusyBackoffBound(b, 0), absl::Milliseconds(100));
  EXPECT_EQ(BusyBackoffBound(b, 1), absl::Milliseconds(200));
  EXPECT_EQ(BusyBackoffBound(b, 4), absl::Milliseconds(1600));
  EXPECT_EQ(BusyBackoffBound(b, 5), absl::Seconds(2));
  EXPECT_EQ(BusyBackoffBound(b, 1000), absl::Seconds(2));
  // Full jitter: spread over [0, bound], not all the same.
  std::vector<absl::Duration> seen;
  for (int i = 0; i < 200; ++i) {
    const absl::Duration w = JitteredBusyBackoff(b, 3);
    EXPECT_GE(w, absl::ZeroDuration());
    EXPECT_LE(w, absl::Milliseconds(800));
    seen.push_back(w);
  }
  EXPECT_NE(*std::min_element(seen.begin(), seen.end()),
            *std::max_element(seen.begin(), seen.end()));
}

TEST(BusyRetryTest, RetriesOnlyBusyRefusalsUntilAnswered) {
  std::vector<absl::Duration> waits;
  auto sleep = [&](absl::Duration d) {
    waits.push_back(d);
    return true;
  };
  int calls = 0;
  absl::Status s = RetryWhileBusy(
      [&] {
        return ++calls < 4 ? absl::ResourceExhaustedError("busy") : absl::OkStatus();
      },
      absl::InfiniteFuture(), BusyBackoff(), sleep);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(calls, 4);
  ASSERT_EQ(waits.size(), 3u);
  for (size_t i = 0; i < waits.size(); ++i) {
    EXPECT_LE(waits[i], BusyBackoffBound(BusyBackoff(), static_cast<int>(i)));
  }

  // Any other error is the caller's at once.
  calls = 0;
  s = RetryWhileBusy([&] { return ++calls, absl::NotFoundError("no job"); },
                     absl::InfiniteFuture(), BusyBackoff(), sleep);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(calls, 1);
}

TEST(BusyRetryTest, GivesUpAtTheCallersDeadlineOrStop) {
  int calls = 0;
  BusyBackoff b;
  b.initial = absl::Seconds(10);  // Any wait but 0 ends past the deadline.
  absl::Status s = RetryWhileBusy(
      [&] { return ++calls, absl::ResourceExhaustedError("busy"); },
      absl::Now() + absl::Microseconds(1), b, [](absl::Duration d) { return d == d; });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_LE(calls, 2);

  calls = 0;
  s = RetryWhileBusy([&] { return ++calls, absl::ResourceExhaustedError("busy"); },
                     absl::InfiniteFuture(), BusyBackoff(), [](absl::Duration) { return false; });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(calls, 1);
}

}  // namespace
}  // namespace optimus
