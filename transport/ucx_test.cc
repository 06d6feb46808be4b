// What only the UCX implementation has: its configuration (UCX_TLS and
// devices from the options or the environment), what happens without
// peer-failure detection, regions of another worker, and sends that
// allocate nothing. The transport contract itself is checked over UCX and
// loopback in transport_test.cc.
#include "transport/ucx.h"

#include <sys/syscall.h>
#include <ucs/debug/log_def.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "transport/test_util.h"

// Counts C++ heap allocations in this test binary (UCX's own come from its
// pools and malloc, not operator new).
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
namespace transport {
namespace {

using test_util::Pattern;
using test_util::SendAndWait;
using test_util::Sink;

constexpr uint16_t kData = 1;

WorkerOptions SharedMemory(const std::string& name) {
  WorkerOptions o;
  o.transports = "sm,self";
  o.net_devices = "lo";
  o.detect_peer_failure = false;
  o.name = name;
  return o;
}

TEST(UcxWorkerTest, BadTransportIsAClearError) {
  WorkerOptions o;
  o.transports = "no-such-transport";
  o.net_devices = "lo";
  auto w = Worker::Create(o);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find("no-such-transport"), absl::string_view::npos)
      << w.status();
}

TEST(UcxWorkerTest, CreateWithoutLoopbackFabricMakesAUcxWorker) {
  WorkerOptions o;
  o.transports = "tcp";
  o.net_devices = "lo";
  auto w = Worker::Create(o);
  ASSERT_TRUE(w.ok()) << w.status();
  // A UCX worker address is UCX's packed binary, not a loopback name.
  EXPECT_NE((*w)->address().rfind("loopback:", 0), 0u) << (*w)->address();
  auto direct = NewUcxWorker(o);
  ASSERT_TRUE(direct.ok()) << direct.status();
}

// on_progress_start runs once, first, on the thread that then delivers
// messages (the shard lowers that thread's priority with it).
TEST(UcxWorkerTest, OnProgressStartRunsOnTheProgressThread) {
  std::atomic<long> hook_tid{0}, handler_tid{0};
  std::atomic<int> hook_runs{0};
  WorkerOptions so = SharedMemory("server");
  so.on_progress_start = [&] {
    hook_tid = syscall(SYS_gettid);
    ++hook_runs;
  };
  auto server = Worker::Create(so);
  ASSERT_TRUE(server.ok()) << server.status();
  absl::Notification got;
  (*server)->SetHandler(kData, [&](IncomingMessage& m) {
    handler_tid = syscall(SYS_gettid);
    got.Notify();
  });
  ASSERT_TRUE((*server)->Start().ok());
  auto client = Worker::Create(SharedMemory("client"));
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->Start().ok());
  auto ep = (*client)->Connect((*server)->address());
  ASSERT_TRUE(ep.ok()) << ep.status();
  ASSERT_TRUE(SendAndWait(client->get(), *ep, kData, "hi", nullptr, 0).ok());
  ASSERT_TRUE(got.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(hook_runs.load(), 1);
  EXPECT_NE(hook_tid.load(), 0);
  EXPECT_EQ(hook_tid.load(), handler_tid.load());
  EXPECT_NE(hook_tid.load(), syscall(SYS_gettid));
}

// Without peer-failure detection a dead peer is never reported.
TEST(UcxWorkerTest, RendezvousToDeadSharedMemoryPeerCompletesOnlyAtTeardown) {
  Sink sink;
  auto server = Worker::Create(SharedMemory("server"));
  ASSERT_TRUE(server.ok()) << server.status();
  (*server)->SetHandler(kData, [&sink](IncomingMessage& m) { sink.Handle(m); });
  ASSERT_TRUE((*server)->Start().ok());
  auto client = Worker::Create(SharedMemory("client"));
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->Start().ok());
  auto ep = (*client)->Connect((*server)->address());
  ASSERT_TRUE(ep.ok());
  const std::vector<uint8_t> payload = Pattern(1 << 20, 4);
  ASSERT_TRUE(
      SendAndWait(client->get(), *ep, kData, "first", payload.data(), payload.size()).ok());
  server->reset();
  // Without peer-failure detection UCX never learns that the peer is gone
  // (and its goodbye is ignored): the rendezvous send waits for an answer
  // that never comes ...
  auto done = std::make_shared<absl::Notification>();
  auto status = std::make_shared<absl::Status>();
  (*client)->Send(*ep, kData, {}, payload.data(), payload.size(), [done, status](absl::Status s) {
    *status = s;
    done->Notify();
  });
  EXPECT_FALSE(done->WaitForNotificationWithTimeout(absl::Milliseconds(500)));
  // ... until the worker is destroyed, which completes it with Cancelled.
  const absl::Time start = absl::Now();
  client->reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  ASSERT_TRUE(done->HasBeenNotified());
  EXPECT_EQ(status->code(), absl::StatusCode::kCancelled) << *status;
}


WorkerOptions Tcp(const std::string& name) {
  WorkerOptions o;
  o.transports = "tcp";
  o.net_devices = "lo";
  o.name = name;
  return o;
}

// Polls `done` every 10 ms for up to a minute (generous, not a timing assert).
bool Eventually(const std::function<bool()>& done) {
  const absl::Time give_up = absl::Now() + absl::Minutes(1);
  while (!done()) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// Peers that are gone are forgotten: the server's table empties, and a
// reply to an endpoint kept from before fails cleanly (UNAVAILABLE).
TEST(UcxWorkerTest, PeersThatLeaveAreForgotten) {
  Sink sink;
  absl::Mutex mu;
  std::vector<EndpointRef> senders;
  auto server = Worker::Create(Tcp("server"));
  ASSERT_TRUE(server.ok()) << server.status();
  (*server)->SetHandler(kData, [&](IncomingMessage& m) {
    {
      absl::MutexLock lock(&mu);
      senders.push_back(m.reply_endpoint());
    }
    sink.Handle(m);
  });
  ASSERT_TRUE((*server)->Start().ok());
  {
    std::vector<std::unique_ptr<Worker>> clients;
    for (int i = 0; i < 10; ++i) {
      auto c = Worker::Create(Tcp(absl::StrCat("client", i)));
      ASSERT_TRUE(c.ok()) << c.status();
      ASSERT_TRUE((*c)->Start().ok());
      auto ep = (*c)->Connect((*server)->address());
      ASSERT_TRUE(ep.ok()) << ep.status();
      ASSERT_TRUE(SendAndWait(c->get(), *ep, kData, "hi", nullptr, 0).ok());
      clients.push_back(std::move(*c));
    }
    ASSERT_TRUE(sink.WaitFor(10));
    EXPECT_EQ((*server)->peer_count(), 10u);
    // A reply opens the endpoint back to the first client.
    EndpointRef first;
    {
      absl::MutexLock lock(&mu);
      first = senders[0];
    }
    EXPECT_TRUE(SendAndWait(server->get(), first, kData, "back", nullptr, 0).ok());
  }  // The clients are destroyed and say goodbye.
  EXPECT_TRUE(Eventually([&] { return (*server)->peer_count() == 0; }))
      << (*server)->peer_count() << " peers left";
  absl::MutexLock lock(&mu);
  for (EndpointRef ep : senders) {
    EXPECT_EQ(SendAndWait(server->get(), ep, kData, "gone", nullptr, 0).code(),
              absl::StatusCode::kUnavailable);
  }
}

// At max_peers, the peer silent longest since its hello makes room for a
// new one; when every peer has spoken, the hello is dropped.
TEST(UcxWorkerTest, PeersBeyondMaxPeersEvictTheSilentOrAreDropped) {
  Sink sink;
  WorkerOptions so = Tcp("server");
  so.max_peers = 2;
  auto server = Worker::Create(so);
  ASSERT_TRUE(server.ok()) << server.status();
  (*server)->SetHandler(kData, [&sink](IncomingMessage& m) { sink.Handle(m); });
  ASSERT_TRUE((*server)->Start().ok());
  std::vector<std::unique_ptr<Worker>> clients;
  auto connect = [&](const std::string& name, bool speak) -> absl::Status {
    auto c = Worker::Create(Tcp(name));
    if (!c.ok()) return c.status();
    if (absl::Status s = (*c)->Start(); !s.ok()) return s;
    auto ep = (*c)->Connect((*server)->address());
    if (!ep.ok()) return ep.status();
    if (speak) {
      if (absl::Status s = SendAndWait(c->get(), *ep, kData, name, nullptr, 0); !s.ok()) return s;
    }
    clients.push_back(std::move(*c));
    return absl::OkStatus();
  };
  ASSERT_TRUE(connect("a", true).ok());
  ASSERT_TRUE(connect("b", false).ok());   // Silent.
  ASSERT_TRUE(connect("c", true).ok());    // b makes room.
  ASSERT_TRUE(sink.WaitFor(2));
  EXPECT_EQ((*server)->peer_count(), 2u);
  EXPECT_EQ((*server)->hellos_refused(), 0u);
  // a and c have spoken: d's hello is dropped and its Connect times out.
  const absl::Status d = connect("d", false);
  EXPECT_EQ(d.code(), absl::StatusCode::kDeadlineExceeded) << d;
  EXPECT_EQ((*server)->hellos_refused(), 1u);
  EXPECT_EQ((*server)->peer_count(), 2u);
}

// Sets an environment variable for one test (the UCX workers read it when
// created), and restores it.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    had_ = std::getenv(name) != nullptr;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

// Two workers in this process exchange a message; returns the client's
// transports_in_use().
std::string TransportsBetweenTwo(const WorkerOptions& options) {
  Sink sink;
  WorkerOptions o = options;
  o.name = "server";
  auto server = Worker::Create(o);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return "";
  (*server)->SetHandler(kData, [&sink](IncomingMessage& m) { sink.Handle(m); });
  EXPECT_TRUE((*server)->Start().ok());
  o.name = "client";
  auto client = Worker::Create(o);
  EXPECT_TRUE(client.ok()) << client.status();
  if (!client.ok()) return "";
  EXPECT_TRUE((*client)->Start().ok());
  auto ep = (*client)->Connect((*server)->address());
  EXPECT_TRUE(ep.ok()) << ep.status();
  if (!ep.ok()) return "";
  EXPECT_TRUE(SendAndWait(client->get(), *ep, kData, "x", nullptr, 0).ok());
  return (*client)->transports_in_use();
}

TEST(UcxWorkerTest, TransportsComeFromTheEnvironmentUnlessSet) {
  ScopedEnv tls("UCX_TLS", "tcp");
  ScopedEnv devices("UCX_NET_DEVICES", "lo");
  WorkerOptions o;  // transports and net_devices empty: the environment's.
  EXPECT_EQ(TransportsBetweenTwo(o), "tcp");
  o.transports = "sm,self";  // Set: wins over UCX_TLS.
  const std::string used = TransportsBetweenTwo(o);
  EXPECT_TRUE(used.find("sysv") != std::string::npos || used.find("posix") != std::string::npos)
      << used;
}

// detect_peer_failure turns on shared memory's error handling unless the
// environment says otherwise: with UCX_MM_ERROR_HANDLING=n UCX has no
// shared-memory transport that reports dead peers, so a worker limited to
// shared memory cannot connect.
TEST(UcxWorkerTest, EnvironmentWinsOverDetectionSettings) {
  ScopedEnv mm("UCX_MM_ERROR_HANDLING", "n");
  WorkerOptions o;
  o.transports = "sm,self";
  o.net_devices = "lo";
  auto server = Worker::Create(o);
  ASSERT_TRUE(server.ok()) << server.status();
  ASSERT_TRUE((*server)->Start().ok());
  auto client = Worker::Create(o);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->Start().ok());
  EXPECT_FALSE((*client)->Connect((*server)->address()).ok());
  // Without detection it can.
  o.detect_peer_failure = false;
  EXPECT_NE(TransportsBetweenTwo(o), "");
}

// The environment another UCX program needs to run on the transports a
// detecting worker runs on: UCX's own variable names (a misspelt one is
// ignored by UCX and shared memory would lose its rendezvous lane), and only
// the settings of transports UCX_TLS loads.
TEST(UcxWorkerTest, DetectionEnvironmentNamesUcxVariablesForTheLoadedTransports) {
  auto has = [](const std::vector<std::string>& env, const std::string& entry) {
    for (const std::string& e : env) {
      if (e == entry) return true;
    }
    return false;
  };
  const std::vector<std::string> sm = UcxDetectionEnvironment("sm");
  EXPECT_TRUE(has(sm, "UCX_MM_ERROR_HANDLING=y"));
  EXPECT_TRUE(has(sm, "UCX_CMA_MEMORY_INVALIDATE=y"));
  EXPECT_TRUE(has(sm, "UCX_KEEPALIVE_INTERVAL=1s"));
  EXPECT_FALSE(has(sm, "UCX_TCP_RX_SEG_SIZE=512K"));
  EXPECT_EQ(UcxDetectionEnvironment(""), UcxDetectionEnvironment("all"));
  const std::vector<std::string> all = UcxDetectionEnvironment("all");
  for (const std::string& e : sm) EXPECT_TRUE(has(all, e)) << e;
  EXPECT_TRUE(has(all, "UCX_TCP_RX_SEG_SIZE=512K"));
  const std::vector<std::string> tcp = UcxDetectionEnvironment("tcp");
  EXPECT_EQ(tcp,
            (std::vector<std::string>{"UCX_KEEPALIVE_INTERVAL=1s", "UCX_TCP_RX_SEG_SIZE=512K"}));
}

// UCX's warnings, caught while a test runs. UCX accepts any key in
// ucp_config_modify and only warns, when the worker opens its transports,
// about one that no transport takes: a misspelt setting would otherwise be
// dropped without a trace.
std::vector<std::string>* ucx_warnings = nullptr;
ucs_log_func_rc_t CatchUcxWarning(const char*, unsigned, const char*, ucs_log_level_t level,
                                  const ucs_log_component_config_t*, const char* format,
                                  va_list ap) {
  if (level <= UCS_LOG_LEVEL_WARN && ucx_warnings != nullptr) {
    char buf[512];
    va_list copy;
    va_copy(copy, ap);
    vsnprintf(buf, sizeof(buf), format, copy);
    va_end(copy);
    ucx_warnings->push_back(buf);
  }
  return UCS_LOG_FUNC_RC_CONTINUE;
}

// Every setting a detecting worker applies reaches its transport when UCX
// uses that transport (tcp's receive segment over tcp, shared memory's error
// handling over sysv/posix, cma's memory invalidation over cma): UCX takes
// none of them as an invalid configuration. A setting whose transport this
// machine lacks has no taker and is warned about harmlessly (cma under
// qemu-user, which does not emulate process_vm_readv); a key this test does
// not know must always be taken.
TEST(UcxWorkerTest, DetectionSettingsReachTheirTransports) {
  const std::map<std::string, std::vector<std::string>> transports_of = {
      {"RX_SEG_SIZE", {"tcp"}},
      {"MM_ERROR_HANDLING", {"sysv", "posix"}},
      {"MEMORY_INVALIDATE", {"cma"}},
  };
  for (const char* tls : {"tcp", "sm,self", "all"}) {
    std::vector<std::string> warnings;
    ucx_warnings = &warnings;
    ucs_log_push_handler(CatchUcxWarning);
    WorkerOptions o;
    o.transports = tls;
    o.net_devices = "lo";
    const std::string used = TransportsBetweenTwo(o);
    ucs_log_pop_handler();
    ucx_warnings = nullptr;
    EXPECT_NE(used, "") << tls;
    if (std::string(tls) == "tcp") {
      EXPECT_EQ(used, "tcp");
    }
    for (const std::string& w : warnings) {
      static constexpr absl::string_view kInvalid = "invalid configuration: ";
      const size_t at = absl::string_view(w).find(kInvalid);
      if (at == std::string::npos) continue;
      const size_t from = at + kInvalid.size();
      const std::string key = w.substr(from, w.find('=', from) - from);
      auto it = transports_of.find(key);
      bool in_use = it == transports_of.end();
      if (!in_use) {
        for (const std::string& t : it->second) {
          if (used.find(t) != std::string::npos) in_use = true;
        }
      }
      EXPECT_FALSE(in_use) << tls << ": " << w << " (transports in use: " << used << ")";
    }
  }
}

TEST(UcxWorkerTest, RegionOfAnotherWorkerIsRefused) {
  WorkerOptions o;
  o.transports = "sm,self";
  o.net_devices = "lo";
  auto server = Worker::Create(o);
  ASSERT_TRUE(server.ok());
  std::vector<uint8_t> inbox(4 << 20);
  std::vector<absl::Status> receives;
  absl::Mutex mu;
  auto other = Worker::Create(o);
  ASSERT_TRUE(other.ok());
  auto foreign = (*other)->RegisterMemory(inbox.data(), inbox.size());
  ASSERT_TRUE(foreign.ok());
  const MemoryRegion* foreign_region = foreign->get();
  (*server)->SetHandler(kData, [&](IncomingMessage& m) {
    m.ReceiveInto(inbox.data(), foreign_region, [&](absl::Status st) {
      absl::MutexLock lock(&mu);
      receives.push_back(st);
    });
  });
  ASSERT_TRUE((*server)->Start().ok());
  auto client = Worker::Create(o);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->Start().ok());
  auto ep = (*client)->Connect((*server)->address());
  ASSERT_TRUE(ep.ok());
  const std::vector<uint8_t> payload = Pattern(1 << 20, 1);
  // A send with another worker's region fails; the receiver's refusal of
  // its region drops the payload (the sender completes OK).
  auto done = std::make_shared<absl::Notification>();
  auto status = std::make_shared<absl::Status>();
  (*client)->Send(*ep, kData, {}, payload.data(), payload.size(), foreign_region,
                  [done, status](absl::Status st) {
                    *status = st;
                    done->Notify();
                  });
  ASSERT_TRUE(done->WaitForNotificationWithTimeout(test_util::kWait));
  EXPECT_EQ(status->code(), absl::StatusCode::kInvalidArgument) << *status;
  EXPECT_TRUE(
      SendAndWait(client->get(), *ep, kData, "", payload.data(), payload.size()).ok());
  absl::MutexLock lock(&mu);
  ASSERT_EQ(receives.size(), 1u);
  EXPECT_EQ(receives[0].code(), absl::StatusCode::kInvalidArgument) << receives[0];
}

// Issue 12 item 6: once warm, a Send and its delivery allocate nothing from
// the C++ heap (op free list, inline headers, no closures), whichever thread.
TEST(UcxWorkerTest, SendsAllocateNothingOnceWarm) {
  WorkerOptions o;
  o.transports = "sm,self";
  o.net_devices = "lo";
  std::atomic<int> received{0};
  std::vector<uint8_t> inbox(256);
  o.name = "server";
  auto server = Worker::Create(o);
  ASSERT_TRUE(server.ok());
  std::atomic<int>* counter = &received;
  uint8_t* dst = inbox.data();
  (*server)->SetHandler(kData, [counter, dst](IncomingMessage& m) {
    m.ReceiveInto(dst, [counter](absl::Status) { counter->fetch_add(1); });
  });
  ASSERT_TRUE((*server)->Start().ok());
  o.name = "client";
  auto client = Worker::Create(o);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->Start().ok());
  auto ep = (*client)->Connect((*server)->address());
  ASSERT_TRUE(ep.ok());
  const std::vector<uint8_t> payload = Pattern(256, 3);
  const std::string header(32, 'h');
  std::atomic<int> completed{0};
  std::atomic<int>* done_counter = &completed;
  auto burst = [&](int n) {
    const int target = received.load() + n;
    const int done_target = completed.load() + n;
    for (int i = 0; i < n; ++i) {
      (*client)->Send(*ep, kData, test_util::Bytes(header), payload.data(), payload.size(),
                      [done_counter](absl::Status) { done_counter->fetch_add(1); });
      if (i % 64 == 63) {  // Keeps the number in flight (and of ops) bounded.
        while (completed.load() < done_target - n + i - 32) absl::SleepFor(absl::Microseconds(50));
      }
    }
    const absl::Time give_up = absl::Now() + test_util::kWait;
    while ((received.load() < target || completed.load() < done_target) &&
           absl::Now() < give_up) {
      absl::SleepFor(absl::Microseconds(100));
    }
    return received.load() >= target && completed.load() >= done_target;
  };
  ASSERT_TRUE(burst(2000));  // Warm-up: lanes logged, free list filled.
  constexpr int kMessages = 20000;
  const int64_t before = heap_allocations.load();
  ASSERT_TRUE(burst(kMessages));
  const int64_t allocations = heap_allocations.load() - before;
  std::cout << allocations << " heap allocations for " << kMessages << " messages\n";
  EXPECT_LT(allocations, kMessages / 100);
}

}  // namespace
}  // namespace transport
}  // namespace optimus
