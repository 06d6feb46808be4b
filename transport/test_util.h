// Helpers for the transport tests (transport_test, ucx_test, loopback_test):
// a handler that collects what arrives, a byte pattern, a blocking send.
// Test-only. Sink is thread-safe; the functions are stateless.
#ifndef OPTIMUS_TRANSPORT_TEST_UTIL_H_
#define OPTIMUS_TRANSPORT_TEST_UTIL_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace optimus {
namespace transport {
namespace test_util {

inline constexpr absl::Duration kWait = absl::Seconds(10);

struct Received {
  std::string header;
  std::vector<uint8_t> payload;
  bool rendezvous = false;
  absl::Status status;
};

// Collects what arrives on a handler; receives payloads unless told to
// ignore them.
class Sink {
 public:
  void Handle(IncomingMessage& msg) {
    auto r = std::make_shared<Received>();
    r->header.assign(reinterpret_cast<const char*>(msg.header().data()), msg.header().size());
    r->rendezvous = msg.is_rendezvous();
    if (ignore_payloads.load()) {
      absl::MutexLock lock(&mu_);
      r->status = absl::CancelledError("ignored");
      got_.push_back(r);
      return;
    }
    r->payload.resize(msg.payload_size());
    msg.ReceiveInto(r->payload.data(), [this, r](absl::Status s) {
      absl::MutexLock lock(&mu_);
      r->status = s;
      got_.push_back(r);
    });
  }

  // Until n messages are complete (payload received or ignored).
  bool WaitFor(size_t n, absl::Duration timeout = kWait) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return got_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }

  std::vector<std::shared_ptr<Received>> got() {
    absl::MutexLock lock(&mu_);
    return got_;
  }

  std::atomic<bool> ignore_payloads{false};

 private:
  absl::Mutex mu_;
  std::vector<std::shared_ptr<Received>> got_ ABSL_GUARDED_BY(mu_);
};

inline std::vector<uint8_t> Pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 31 + seed + (i >> 12));
  return v;
}

inline absl::Span<const uint8_t> Bytes(const std::string& s) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// Sends and waits for the send's completion; DEADLINE_EXCEEDED when it does
// not complete within kWait (a hang).
inline absl::Status SendAndWait(Worker* w, EndpointRef ep, uint16_t id, const std::string& hdr,
                                const void* payload, size_t size) {
  // Shared with the callback, which may still run after a timeout.
  struct State {
    absl::Notification done;
    absl::Status result;
  };
  auto state = std::make_shared<State>();
  w->Send(ep, id, Bytes(hdr), payload, size, [state](absl::Status s) {
    state->result = s;
    state->done.Notify();
  });
  if (!state->done.WaitForNotificationWithTimeout(kWait)) {
    return absl::DeadlineExceededError("send did not complete");
  }
  return state->result;
}

}  // namespace test_util
}  // namespace transport
}  // namespace optimus

#endif  // OPTIMUS_TRANSPORT_TEST_UTIL_H_
