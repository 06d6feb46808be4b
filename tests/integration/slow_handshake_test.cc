// A shard reaching a coordinator whose answers are slow (a loaded machine,
// a long network path): every byte between them is held back 300 ms by a
// TCP relay, so a TLS handshake takes over a second. The shard's link must
// still connect and register. Before the fix its channel gave each
// connection attempt at most 500 ms (gRPC reads the minimum reconnect
// backoff as the connect timeout), so every attempt was cut off and the
// shard never registered: a fault drill failed that way on a loaded machine.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/security.h"
#include "gtest/gtest.h"
#include "server/coordinator_link.h"
#include "tests/harness/cluster.h"
#include "tests/harness/status_assert.h"

namespace optimus {
namespace harness {
namespace {

// Relays TCP connections from 127.0.0.1:port() to `target_port`, holding
// every piece it reads for `delay` before passing it on.
class SlowRelay {
 public:
  SlowRelay(int target_port, absl::Duration delay) : target_port_(target_port), delay_(delay) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a = Loopback(0);
    EXPECT_EQ(bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << strerror(errno);
    EXPECT_EQ(listen(listen_fd_, 16), 0);
    socklen_t len = sizeof(a);
    getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    threads_.emplace_back([this] { Accept(); });
  }
  ~SlowRelay() {
    stop_ = true;
    shutdown(listen_fd_, SHUT_RDWR);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (int fd : fds_) shutdown(fd, SHUT_RDWR);
    }
    for (std::thread& t : threads_) t.join();
    close(listen_fd_);
    for (int fd : fds_) close(fd);
  }
  int port() const { return port_; }
  int connections() const { return connections_.load(); }

 private:
  static sockaddr_in Loopback(int port) {
    sockaddr_in a;
    std::memset(&a, 0, sizeof(a));
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
  }
  void Accept() {
    for (;;) {
      const int in = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (in < 0 || stop_) {
        if (in >= 0) close(in);
        return;
      }
      const int out = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in a = Loopback(target_port_);
      if (connect(out, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
        close(in);
        close(out);
        continue;
      }
      connections_.fetch_add(1);
      std::lock_guard<std::mutex> lock(mu_);
      fds_.push_back(in);
      fds_.push_back(out);
      threads_.emplace_back([this, in, out] { Pump(in, out); });
      threads_.emplace_back([this, in, out] { Pump(out, in); });
    }
  }
  void Pump(int from, int to) {
    std::vector<char> buf(64 * 1024);
    for (;;) {
      const ssize_t n = read(from, buf.data(), buf.size());
      if (n <= 0) break;
      absl::SleepFor(delay_);
      if (send(to, buf.data(), static_cast<size_t>(n), MSG_NOSIGNAL) != n) break;
    }
    shutdown(to, SHUT_WR);
  }

  const int target_port_;
  const absl::Duration delay_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> connections_{0};
  std::mutex mu_;
  std::vector<int> fds_;
  std::vector<std::thread> threads_;
};

int PortOf(const std::string& address) {
  return std::stoi(address.substr(address.rfind(':') + 1));
}

TEST(SlowHandshakeTest, AShardRegistersThroughASlowLinkUnderTls) {
  ASSERT_OK_AND_ASSIGN(std::string ca, MakeTestCa(2));
  ClusterOptions o;
  o.num_shards = 1;
  o.num_workers = 1;
  o.tls_root = ca;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Cluster> cluster, Cluster::Start(o));
  SlowRelay relay(PortOf(cluster->coordinator_address()), absl::Milliseconds(300));

  security::TlsOptions t;
  t.dir = absl::StrCat(ca, "/shard-1");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<server::CoordinatorLink> link,
                       server::NewGrpcCoordinatorLink(absl::StrCat("127.0.0.1:", relay.port()), t));
  server::ShardRegistration r;
  r.arch = "x86_64";
  r.memory_limit_bytes = uint64_t{64} << 20;
  r.data_address = "slow-shard";
  r.hostname = "slow";
  // As the shard does: retry until registered, here for up to a minute
  // (generous: with the fix the first or second attempt succeeds).
  absl::StatusOr<server::Registered> reg = absl::UnavailableError("not tried");
  const absl::Time give_up = absl::Now() + absl::Minutes(1);
  while (!reg.ok() && absl::Now() < give_up) {
    reg = link->Register(r);
    if (!reg.ok()) absl::SleepFor(absl::Milliseconds(200));
  }
  ASSERT_OK(reg.status());
  EXPECT_GT(reg->shard_id, 0u);
  // It is the coordinator's second shard, and it heartbeats through the
  // same slow link.
  ASSERT_OK_AND_ASSIGN(v1::StatusResponse st, cluster->Status());
  EXPECT_EQ(st.shards_size(), 2);
  server::HeartbeatReport hb;
  hb.shard_id = reg->shard_id;
  absl::StatusOr<server::HeartbeatReply> beat = link->Heartbeat(hb);
  ASSERT_OK(beat.status());
  EXPECT_TRUE(beat->known);
  EXPECT_GE(relay.connections(), 1);
}

}  // namespace
}  // namespace harness
}  // namespace optimus
