// bench/transport: what one small message costs the transport (issue 12
// item 6). A client worker sends --messages active messages (a 32-byte
// header and a --payload_bytes payload, eager) to a server worker in this
// process, at most --window at a time, and the server's handler takes the
// payload. Prints one JSON line: messages per second, process CPU per
// message, and C++ heap allocations (operator new) per message, counted over
// the whole process (UCX's own buffers come from its pools and malloc, not
// operator new).
//
// Usage: bazel run -c opt //bench:transport -- [--transports=sm,self]
//        [--messages=200000] [--payload_bytes=256] [--window=64]
//        [--transport=ucx|loopback] [--detect_peer_failure=true]
#include <sys/resource.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/json.h"
#include "transport/loopback.h"
#include "transport/transport.h"

ABSL_FLAG(std::string, transport, "ucx", "ucx or loopback");
ABSL_FLAG(std::string, transports, "sm,self", "UCX transports (UCX_TLS syntax; empty: UCX's)");
ABSL_FLAG(std::string, net_devices, "lo", "UCX devices");
ABSL_FLAG(int64_t, messages, 200000, "messages timed");
ABSL_FLAG(int64_t, payload_bytes, 256, "payload of each message");
ABSL_FLAG(int, window, 64, "most sends in flight");
ABSL_FLAG(bool, detect_peer_failure, true, "WorkerOptions::detect_peer_failure");

namespace {
std::atomic<int64_t> heap_allocations{0};
}  // namespace

void* operator new(size_t n) {
  heap_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }

namespace optimus {
namespace bench {
namespace {

constexpr uint16_t kData = 1;

double CpuSeconds() {
  rusage r;
  getrusage(RUSAGE_SELF, &r);
  return r.ru_utime.tv_sec + r.ru_stime.tv_sec + 1e-6 * (r.ru_utime.tv_usec + r.ru_stime.tv_usec);
}

void Check(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "bench/transport: %s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}

int Main() {
  const int64_t messages = absl::GetFlag(FLAGS_messages);
  const int64_t payload_bytes = absl::GetFlag(FLAGS_payload_bytes);
  const int window = absl::GetFlag(FLAGS_window);
  const bool loopback = absl::GetFlag(FLAGS_transport) == "loopback";
  transport::WorkerOptions o;
  if (loopback) o.loopback = transport::LoopbackFabric::Create();
  o.transports = absl::GetFlag(FLAGS_transports);
  o.net_devices = absl::GetFlag(FLAGS_net_devices);
  o.detect_peer_failure = absl::GetFlag(FLAGS_detect_peer_failure);

  std::atomic<int64_t> received{0};
  std::vector<uint8_t> sink(payload_bytes);
  o.name = "server";
  auto server = transport::Worker::Create(o);
  Check(server.status(), "server");
  (*server)->SetHandler(kData, [&](transport::IncomingMessage& m) {
    m.ReceiveInto(sink.data(), [&](absl::Status) {
      received.fetch_add(1, std::memory_order_relaxed);
    });
  });
  Check((*server)->Start(), "server start");
  o.name = "client";
  auto client = transport::Worker::Create(o);
  Check(client.status(), "client");
  Check((*client)->Start(), "client start");
  auto ep = (*client)->Connect((*server)->address());
  Check(ep.status(), "connect");

  std::vector<uint8_t> payload(payload_bytes, 7);
  const std::string header(32, 'h');
  const auto hdr = absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(header.data()),
                                             header.size());
  // Sends wait (not spin) while the window is full, so the CPU measured is
  // the transport's.
  struct Window {
    absl::Mutex mu;
    int64_t inflight ABSL_GUARDED_BY(mu) = 0;
    int64_t failed ABSL_GUARDED_BY(mu) = 0;
  } win;
  auto run = [&](int64_t n) {
    const int64_t target = received.load() + n;
    for (int64_t i = 0; i < n; ++i) {
      {
        absl::MutexLock lock(&win.mu);
        auto open = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(win.mu) { return win.inflight < window; };
        win.mu.Await(absl::Condition(&open));
        ++win.inflight;
      }
      Window* w = &win;  // Keeps the callback within std::function's inline buffer.
      (*client)->Send(*ep, kData, hdr, payload.data(), payload.size(), [w](absl::Status s) {
        absl::MutexLock lock(&w->mu);
        if (!s.ok()) ++w->failed;
        --w->inflight;
      });
    }
    absl::MutexLock lock(&win.mu);
    auto drained = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(win.mu) {
      return win.inflight == 0 && received.load() >= target;
    };
    while (!win.mu.AwaitWithTimeout(absl::Condition(&drained), absl::Milliseconds(1))) {
    }
  };
  auto FailedOf = [](Window* w) {
    absl::MutexLock lock(&w->mu);
    return w->failed;
  };
  run(std::min<int64_t>(messages, 10000));  // Warm-up: wire-up, pools.
  const int64_t allocs0 = heap_allocations.load();
  const double cpu0 = CpuSeconds();
  const absl::Time t0 = absl::Now();
  run(messages);
  const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
  const double cpu = CpuSeconds() - cpu0;
  const int64_t allocs = heap_allocations.load() - allocs0;
  Json line;
  line["bench"] = "transport";
  line["transport"] = loopback ? "loopback" : "ucx";
  line["transports_in_use"] = (*client)->transports_in_use();
  line["messages"] = static_cast<int64_t>(messages);
  line["payload_bytes"] = static_cast<int64_t>(payload_bytes);
  line["window"] = window;
  line["msgs_per_s"] = static_cast<int64_t>(std::llround(messages / secs));
  line["cpu_us_per_msg"] = JsonRound(1e6 * cpu / messages, 3);
  line["heap_allocs_per_msg"] = JsonRound(static_cast<double>(allocs) / messages, 3);
  line["failed"] = static_cast<int64_t>(FailedOf(&win));
  std::printf("%s\n", JsonDump(line).c_str());
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace optimus

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return optimus::bench::Main();
}
