// What only the UCX implementation has: its configuration (UCX_TLS and
// devices), and shared memory's blindness to dead peers in UCX 1.13. The
// transport contract itself is checked over UCX and loopback in
// transport_test.cc.
#include "transport/ucx.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "transport/test_util.h"

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
  o.detect_peer_failure = false;  // Shared memory cannot (see transport.h).
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
  // Without peer-failure detection UCX never learns that the peer is gone:
  // the rendezvous send waits for an answer that never comes ...
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

}  // namespace
}  // namespace transport
}  // namespace optimus
