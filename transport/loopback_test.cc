// What only the loopback implementation has, and where its behaviour is the
// point of using it: the rendezvous threshold and its "later" completion,
// dead peers as destroyed workers (the in-process fault tests rely on it),
// and its addresses. The shared transport contract is in transport_test.cc.
#include "transport/loopback.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "transport/test_util.h"

namespace optimus {
namespace transport {
namespace {

using test_util::kWait;
using test_util::Pattern;
using test_util::SendAndWait;
using test_util::Sink;

constexpr uint16_t kData = 1;

WorkerOptions On(const std::shared_ptr<LoopbackFabric>& fabric, const std::string& name) {
  WorkerOptions o;
  o.loopback = fabric;
  o.name = name;
  return o;
}

std::unique_ptr<Worker> Started(const std::shared_ptr<LoopbackFabric>& fabric,
                                const std::string& name, Sink* sink = nullptr,
                                PeerFailureCallback on_failure = nullptr) {
  WorkerOptions o = On(fabric, name);
  o.on_peer_failure = std::move(on_failure);
  auto w = Worker::Create(o);
  EXPECT_TRUE(w.ok()) << w.status();
  if (sink != nullptr) (*w)->SetHandler(kData, [sink](IncomingMessage& m) { sink->Handle(m); });
  EXPECT_TRUE((*w)->Start().ok());
  return std::move(*w);
}

// What one handler call saw, for the threshold tests.
struct Observed {
  bool rendezvous = false;
  bool done_before_return = false;
  bool done_on_handler_thread = false;
  std::vector<uint8_t> data;
  absl::Status status;
};

// A receiver that records, per message, whether `done` ran inside
// ReceiveInto and on which thread.
class Recorder {
 public:
  void Handle(IncomingMessage& m) {
    auto o = std::make_shared<Observed>();
    o->rendezvous = m.is_rendezvous();
    o->data.resize(m.payload_size());
    const std::thread::id handler_thread = std::this_thread::get_id();
    auto returned = std::make_shared<std::atomic<bool>>(false);
    m.ReceiveInto(o->data.data(), [this, o, returned, handler_thread](absl::Status s) {
      o->done_before_return = !returned->load();
      o->done_on_handler_thread = std::this_thread::get_id() == handler_thread;
      o->status = s;
      absl::MutexLock lock(&mu_);
      seen_.push_back(o);
    });
    returned->store(true);
  }

  bool WaitFor(size_t n) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return seen_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), kWait);
  }

  std::vector<std::shared_ptr<Observed>> seen() {
    absl::MutexLock lock(&mu_);
    return seen_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::shared_ptr<Observed>> seen_ ABSL_GUARDED_BY(mu_);
};

TEST(LoopbackTest, ThresholdSplitsEagerFromRendezvous) {
  LoopbackOptions lo;
  lo.rendezvous_threshold_bytes = 1000;
  auto fabric = LoopbackFabric::Create(lo);
  Recorder rec;
  auto server = Worker::Create(On(fabric, "server"));
  ASSERT_TRUE(server.ok());
  (*server)->SetHandler(kData, [&rec](IncomingMessage& m) { rec.Handle(m); });
  ASSERT_TRUE((*server)->Start().ok());
  auto client = Started(fabric, "client");
  auto ep = client->Connect((*server)->address());
  ASSERT_TRUE(ep.ok()) << ep.status();
  const std::vector<uint8_t> at = Pattern(1000, 1), above = Pattern(1001, 2);
  ASSERT_TRUE(SendAndWait(client.get(), *ep, kData, "", at.data(), at.size()).ok());
  ASSERT_TRUE(SendAndWait(client.get(), *ep, kData, "", above.data(), above.size()).ok());
  ASSERT_TRUE(rec.WaitFor(2));
  auto seen = rec.seen();
  // At the threshold: eager, copied before ReceiveInto returns.
  EXPECT_FALSE(seen[0]->rendezvous);
  EXPECT_TRUE(seen[0]->done_before_return);
  EXPECT_EQ(seen[0]->data, at);
  // Above it: rendezvous, completed later on the same progress thread.
  EXPECT_TRUE(seen[1]->rendezvous);
  EXPECT_FALSE(seen[1]->done_before_return);
  EXPECT_TRUE(seen[1]->done_on_handler_thread);
  EXPECT_TRUE(seen[1]->status.ok()) << seen[1]->status;
  EXPECT_EQ(seen[1]->data, above);
}

TEST(LoopbackTest, RendezvousSenderMayReuseItsBufferOnceDone) {
  // The payload is read from the sender's buffer when the receiver takes it,
  // and never after the sender's `done`: a sender that refills its buffer
  // in `done` (as a training loop does) must not corrupt what was sent.
  auto fabric = LoopbackFabric::Create();
  Sink sink;
  auto server = Started(fabric, "server", &sink);
  auto client = Started(fabric, "client");
  auto ep = client->Connect(server->address());
  ASSERT_TRUE(ep.ok());
  auto buf = std::make_shared<std::vector<uint8_t>>(Pattern(1 << 20, 5));
  const std::vector<uint8_t> sent = *buf;
  absl::Notification sender_done;
  client->Send(*ep, kData, {}, buf->data(), buf->size(), [buf, &sender_done](absl::Status s) {
    EXPECT_TRUE(s.ok()) << s;
    std::fill(buf->begin(), buf->end(), 0xee);
    sender_done.Notify();
  });
  ASSERT_TRUE(sink.WaitFor(1));
  ASSERT_TRUE(sender_done.WaitForNotificationWithTimeout(kWait));
  auto got = sink.got()[0];
  EXPECT_TRUE(got->rendezvous);
  EXPECT_TRUE(got->status.ok()) << got->status;
  EXPECT_TRUE(got->payload == sent);
}

TEST(LoopbackTest, DestroyedWorkerFailsPeersSendsAndReportsToBothSides) {
  auto fabric = LoopbackFabric::Create();
  Sink sink;
  absl::Mutex mu;
  std::vector<EndpointRef> server_saw, client_saw;
  auto record = [&mu](std::vector<EndpointRef>* into) {
    return [&mu, into](EndpointRef ep, const absl::Status& why) {
      EXPECT_EQ(why.code(), absl::StatusCode::kUnavailable) << why;
      absl::MutexLock lock(&mu);
      into->push_back(ep);
    };
  };
  auto server = Started(fabric, "server", &sink, record(&server_saw));
  auto client_a = Started(fabric, "client-a", nullptr, record(&client_saw));
  auto client_b = Started(fabric, "client-b");
  auto ep_a = client_a->Connect(server->address());
  auto ep_b = client_b->Connect(server->address());
  ASSERT_TRUE(ep_a.ok() && ep_b.ok());
  ASSERT_TRUE(SendAndWait(client_a.get(), *ep_a, kData, "a", nullptr, 0).ok());
  ASSERT_TRUE(SendAndWait(client_b.get(), *ep_b, kData, "b", nullptr, 0).ok());
  ASSERT_TRUE(sink.WaitFor(2));
  EXPECT_EQ(fabric->num_workers(), 3u);

  // A client dies: the server hears of it on the reply endpoint it holds.
  client_b.reset();
  EXPECT_EQ(fabric->num_workers(), 2u);
  {
    absl::MutexLock lock(&mu);
    auto one = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return server_saw.size() == 1; };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&one), kWait));
  }
  // The server dies: the first Send after it fails at once (no timeout to
  // wait out, unlike UCX), and client a hears of it once, on its endpoint.
  server.reset();
  EXPECT_EQ(SendAndWait(client_a.get(), *ep_a, kData, "late", nullptr, 0).code(),
            absl::StatusCode::kUnavailable);
  const std::vector<uint8_t> big = Pattern(1 << 20, 1);
  EXPECT_EQ(SendAndWait(client_a.get(), *ep_a, kData, "late", big.data(), big.size()).code(),
            absl::StatusCode::kUnavailable);
  {
    absl::MutexLock lock(&mu);
    auto reported = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return !client_saw.empty(); };
    ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&reported), kWait));
  }
  absl::SleepFor(absl::Milliseconds(100));  // A second report would come by now.
  absl::MutexLock lock(&mu);
  ASSERT_EQ(client_saw.size(), 1u);
  EXPECT_EQ(client_saw[0].ep, ep_a->ep);
  EXPECT_EQ(server_saw.size(), 1u);
}

TEST(LoopbackTest, WithoutDetectionSendsStillFailButNobodyIsCalled) {
  auto fabric = LoopbackFabric::Create();
  Sink sink;
  auto server = Started(fabric, "server", &sink);
  std::atomic<int> calls{0};
  WorkerOptions o = On(fabric, "client");
  o.detect_peer_failure = false;
  o.on_peer_failure = [&calls](EndpointRef, const absl::Status&) { calls.fetch_add(1); };
  auto client = Worker::Create(o);
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->Start().ok());
  auto ep = (*client)->Connect(server->address());
  ASSERT_TRUE(ep.ok());
  server.reset();
  EXPECT_EQ(SendAndWait(client->get(), *ep, kData, "late", nullptr, 0).code(),
            absl::StatusCode::kUnavailable);
  // The death notice has been processed by now (it was queued before the
  // failed send's completion, on the same progress thread).
  EXPECT_EQ(calls.load(), 0);
}

TEST(LoopbackTest, InFlightRendezvousFailsOnBothSidesWhenEitherIsDestroyed) {
  auto fabric = LoopbackFabric::Create();
  const std::vector<uint8_t> big = Pattern(1 << 20, 7);

  // The receiver has not started: the message waits in its queue. When the
  // receiver is destroyed, the sender's send fails (the bytes never landed).
  {
    auto receiver = Worker::Create(On(fabric, "receiver"));
    ASSERT_TRUE(receiver.ok());
    auto sender = Started(fabric, "sender");
    auto ep = sender->Connect((*receiver)->address());
    ASSERT_TRUE(ep.ok());
    auto done = std::make_shared<absl::Notification>();
    auto status = std::make_shared<absl::Status>();
    sender->Send(*ep, kData, {}, big.data(), big.size(), [done, status](absl::Status s) {
      *status = s;
      done->Notify();
    });
    EXPECT_FALSE(done->WaitForNotificationWithTimeout(absl::Milliseconds(50)))
        << "a rendezvous send completed before anyone took its payload";
    receiver->reset();
    ASSERT_TRUE(done->WaitForNotificationWithTimeout(kWait));
    EXPECT_EQ(status->code(), absl::StatusCode::kUnavailable) << *status;
  }

  // The sender is destroyed before the (not yet started) receiver takes the
  // payload: the sender's send completes with CANCELLED before its
  // destructor returns; the receiver's ReceiveInto then fails instead of
  // reading the freed buffer.
  {
    Sink sink;
    auto receiver = Worker::Create(On(fabric, "receiver"));
    ASSERT_TRUE(receiver.ok());
    (*receiver)->SetHandler(kData, [&sink](IncomingMessage& m) { sink.Handle(m); });
    auto sender = Started(fabric, "sender");
    auto ep = sender->Connect((*receiver)->address());
    ASSERT_TRUE(ep.ok());
    auto buf = std::make_unique<std::vector<uint8_t>>(big);
    absl::Status status;
    bool called = false;
    sender->Send(*ep, kData, {}, buf->data(), buf->size(), [&](absl::Status s) {
      status = s;
      called = true;
    });
    sender.reset();
    ASSERT_TRUE(called);
    EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
    buf.reset();
    ASSERT_TRUE((*receiver)->Start().ok());
    ASSERT_TRUE(sink.WaitFor(1));
    EXPECT_EQ(sink.got()[0]->status.code(), absl::StatusCode::kUnavailable)
        << sink.got()[0]->status;
  }
  EXPECT_EQ(fabric->num_workers(), 0u);
}

TEST(LoopbackTest, AddressesAreUniqueAndBadOnesAreRefusedClearly) {
  auto fabric = LoopbackFabric::Create();
  auto other_fabric = LoopbackFabric::Create();
  auto a = Started(fabric, "a");
  auto b = Started(fabric, "b");
  auto stranger = Started(other_fabric, "stranger");
  EXPECT_NE(a->address(), b->address());
  EXPECT_NE(a->address(), stranger->address());
  EXPECT_EQ(a->address().rfind("loopback:", 0), 0u) << a->address();

  auto code = [&](const std::string& addr) { return a->Connect(addr).status(); };
  EXPECT_EQ(code("").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(std::string("\x01\x02ucx-binary\0", 14)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("loopback:1").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code("loopback:x:y").code(), absl::StatusCode::kInvalidArgument);
  const absl::Status foreign = code(stranger->address());
  EXPECT_EQ(foreign.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(foreign.message().find("another loopback fabric"), absl::string_view::npos)
      << foreign;
  // Well formed, on this fabric, but no such worker (never created).
  const std::string prefix = a->address().substr(0, a->address().rfind(':') + 1);
  const absl::Status unknown = code(prefix + "999999");
  EXPECT_EQ(unknown.code(), absl::StatusCode::kUnavailable) << unknown;
  EXPECT_NE(unknown.message().find("no live loopback worker"), absl::string_view::npos)
      << unknown;
  // A destroyed worker's address is never reused, and refused.
  const std::string b_address = b->address();
  b.reset();
  EXPECT_EQ(code(b_address).code(), absl::StatusCode::kUnavailable);
  auto c = Started(fabric, "c");
  EXPECT_NE(c->address(), b_address);
  EXPECT_TRUE(a->Connect(c->address()).ok());
}

TEST(LoopbackTest, WorkersOutliveTheFabricHandleAndIgnoreUcxSettings) {
  auto fabric = LoopbackFabric::Create();
  WorkerOptions o = On(fabric, "server");
  o.transports = "no-such-transport";  // UCX only: ignored.
  Sink sink;
  auto server = Worker::Create(o);
  ASSERT_TRUE(server.ok()) << server.status();
  (*server)->SetHandler(kData, [&sink](IncomingMessage& m) { sink.Handle(m); });
  ASSERT_TRUE((*server)->Start().ok());
  auto client = Started(fabric, "client");
  fabric.reset();  // The tests' handle goes; the workers keep the registry.
  auto ep = client->Connect((*server)->address());
  ASSERT_TRUE(ep.ok()) << ep.status();
  ASSERT_TRUE(SendAndWait(client.get(), *ep, kData, "still here", nullptr, 0).ok());
  ASSERT_TRUE(sink.WaitFor(1));
  EXPECT_EQ(sink.got()[0]->header, "still here");
}

TEST(LoopbackTest, MessagesFromOneThreadArriveInOrder) {
  // Requests and replies of one endpoint keep their order, as over UCX; the
  // shard relies on an init arriving before the pulls that follow it.
  auto fabric = LoopbackFabric::Create();
  std::vector<std::string> order;
  absl::Mutex mu;
  auto server = Worker::Create(On(fabric, "server"));
  ASSERT_TRUE(server.ok());
  (*server)->SetHandler(kData, [&](IncomingMessage& m) {
    absl::MutexLock lock(&mu);
    order.emplace_back(reinterpret_cast<const char*>(m.header().data()), m.header().size());
  });
  ASSERT_TRUE((*server)->Start().ok());
  auto client = Started(fabric, "client");
  auto ep = client->Connect((*server)->address());
  ASSERT_TRUE(ep.ok());
  const std::vector<uint8_t> big = Pattern(64 << 10, 3);
  std::vector<std::string> sent;
  for (int i = 0; i < 200; ++i) {
    sent.push_back(std::to_string(i));
    // Eager and rendezvous mixed.
    client->Send(*ep, kData, test_util::Bytes(sent.back()), big.data(), (i % 3) ? 16 : big.size(),
                 [](absl::Status) {});
  }
  absl::MutexLock lock(&mu);
  auto all = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return order.size() == sent.size(); };
  ASSERT_TRUE(mu.AwaitWithTimeout(absl::Condition(&all), kWait));
  EXPECT_EQ(order, sent);
}

}  // namespace
}  // namespace transport
}  // namespace optimus
