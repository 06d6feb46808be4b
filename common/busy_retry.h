// Retrying a control-plane call the coordinator refused as busy
// (RESOURCE_EXHAUSTED: past --max_concurrent_map_reads, or every server
// thread taken). Thousands of shards handed one new job fetch their parts
// at once; if each retried at once, or after the same fixed pause, the
// refused ones would come back together and be refused together. Each
// waits instead a random time in [0, min(cap, initial x 2^attempt)] ("full
// jitter"), so that the retries spread over the window and the window
// grows while the coordinator stays busy. Never call it from a heartbeat
// thread: it sleeps.
#ifndef OPTIMUS_COMMON_BUSY_RETRY_H_
#define OPTIMUS_COMMON_BUSY_RETRY_H_

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>

#include "absl/status/status.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace optimus {

struct BusyBackoff {
  // The first wait is at most `initial`; each next one at most twice the
  // last bound, never more than `cap`.
  absl::Duration initial = absl::Milliseconds(100);
  absl::Duration cap = absl::Seconds(2);
};

// The coordinator said it is busy: the call did nothing, and may be sent
// again later.
inline bool IsBusy(const absl::Status& s) {
  return s.code() == absl::StatusCode::kResourceExhausted;
}

// The bound on the wait before retry number `attempt` (0: the first retry).
inline absl::Duration BusyBackoffBound(const BusyBackoff& b, int attempt) {
  absl::Duration bound = b.initial;
  for (int i = 0; i < attempt && bound < b.cap; ++i) bound *= 2;
  return std::min(bound, b.cap);
}

// A random wait in [0, BusyBackoffBound(b, attempt)].
inline absl::Duration JitteredBusyBackoff(const BusyBackoff& b, int attempt) {
  thread_local std::mt19937_64 gen{std::random_device{}()};
  const int64_t bound_us = absl::ToInt64Microseconds(BusyBackoffBound(b, attempt));
  std::uniform_int_distribution<int64_t> pick(0, std::max<int64_t>(bound_us, 0));
  return absl::Microseconds(pick(gen));
}

// Runs `call` until it returns anything but a busy refusal, waiting
// JitteredBusyBackoff between tries, and returns its last status. Gives up,
// returning the busy refusal, when the next wait would end after
// `give_up`. `sleep` (absl::SleepFor when empty) returns false to stop at
// once (the caller is shutting down); the busy refusal is returned then.
inline absl::Status RetryWhileBusy(const std::function<absl::Status()>& call,
                                   absl::Time give_up, const BusyBackoff& b = BusyBackoff(),
                                   const std::function<bool(absl::Duration)>& sleep = nullptr) {
  for (int attempt = 0;; ++attempt) {
    absl::Status s = call();
    if (!IsBusy(s)) return s;
    const absl::Duration wait = JitteredBusyBackoff(b, attempt);
    if (absl::Now() + wait > give_up) return s;
    if (sleep == nullptr) {
      absl::SleepFor(wait);
    } else if (!sleep(wait)) {
      return s;
    }
  }
}

}  // namespace optimus

#endif  // OPTIMUS_COMMON_BUSY_RETRY_H_
