#include "common/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace optimus {
namespace {

HttpResponse Ok() { return HttpResponse{200, "text/plain", "ok\n"}; }

// A raw TCP connection to 127.0.0.1:port, for clients that misbehave.
int ConnectTo(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  EXPECT_GE(fd, 0);
  sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << strerror(errno);
  return fd;
}

void SendAll(int fd, const std::string& data) {
  ASSERT_EQ(send(fd, data.data(), data.size(), MSG_NOSIGNAL), static_cast<ssize_t>(data.size()));
}

// Reads until the peer closes (or a minute of silence); returns what came.
std::string ReadToEnd(int fd) {
  std::string out;
  std::vector<char> buf(1 << 20);
  for (;;) {
    pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, 60000) <= 0) break;
    const ssize_t n = recv(fd, buf.data(), buf.size(), 0);
    if (n <= 0) break;
    out.append(buf.data(), static_cast<size_t>(n));
  }
  return out;
}

// Polls `done` every 10 ms for up to a minute (a generous bound, not a
// timing assert).
bool Eventually(const std::function<bool()>& done) {
  const absl::Time give_up = absl::Now() + absl::Minutes(1);
  while (!done()) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return true;
}

// Whether this machine can bind IPv6's loopback (containers may have IPv6
// off).
bool HaveIpv6Loopback() {
  const int fd = socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in6 addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin6_family = AF_INET6;
  addr.sin6_addr = in6addr_loopback;
  const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

TEST(HttpServerTest, ServesExactPathsIgnoringTheQuery) {
  auto s = HttpServer::Start(
      "127.0.0.1:0", {{"/healthz", Ok},
                      {"/metrics", [] { return HttpResponse{200, "text/plain", "m 1\n"}; }},
                      {"/readyz", [] { return HttpResponse{503, "text/plain", "not yet\n"}; }}});
  ASSERT_TRUE(s.ok()) << s.status();
  const int port = (*s)->port();
  EXPECT_EQ(HttpGet(port, "/healthz").value_or("?"), "ok\n");
  EXPECT_EQ(HttpGet(port, "/metrics?x=1").value_or("?"), "m 1\n");
  EXPECT_EQ(HttpGet(port, "/readyz").status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(HttpGet(port, "/metricsX").status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(HttpGet(port, "/").status().code(), absl::StatusCode::kInternal);
  // The answer's status line and content type, as a raw client sees them.
  const int fd = ConnectTo(port);
  SendAll(fd, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  const std::string raw = ReadToEnd(fd);
  close(fd);
  EXPECT_EQ(raw.rfind("HTTP/1.1 200 OK\r\n", 0), 0u) << raw;
  EXPECT_NE(raw.find("Content-Type: text/plain"), std::string::npos) << raw;
  EXPECT_NE(raw.find("\r\n\r\nm 1\n"), std::string::npos) << raw;
}

// A scraper that asks for gzip (Prometheus does) gets the page compressed.
TEST(HttpServerTest, CompressesForClientsThatAsk) {
  std::string page;
  for (int i = 0; i < 10000; ++i) page += absl::StrCat("optimus_x_total{shard_id=\"", i, "\"} ", i, "\n");
  auto s = HttpServer::Start("127.0.0.1:0",
                             {{"/metrics", [&page] { return HttpResponse{200, "text/plain", page}; }}});
  ASSERT_TRUE(s.ok()) << s.status();
  const int fd = ConnectTo((*s)->port());
  SendAll(fd, "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n");
  const std::string raw = ReadToEnd(fd);
  close(fd);
  EXPECT_NE(raw.find("Content-Encoding: gzip\r\n"), std::string::npos) << raw.substr(0, 300);
  EXPECT_LT(raw.size(), page.size() / 4);
  // HttpGet asks for it too and gets the page back as it was.
  EXPECT_EQ(HttpGet((*s)->port(), "/metrics").value_or("?"), page);
}

// The case: a /metrics client that sends its request and never
// reads a large answer, and clients that connect and send nothing, hold
// three of the four threads; /healthz probes keep being answered on the
// fourth while they hold them.
TEST(HttpServerTest, SlowMetricsClientsDoNotDelayHealthProbes) {
  HttpServerOptions o;
  o.threads = 4;
  // Long enough that the slow clients hold their threads for the whole
  // test: nothing here waits for a timeout.
  o.read_timeout = absl::Minutes(5);
  o.write_timeout = absl::Minutes(5);
  // Far more than the socket buffers of both ends hold (Linux's defaults
  // let loopback buffers grow to 4 + 6 MiB), so that the server's write
  // blocks.
  const std::string big(64 << 20, 'x');
  std::atomic<int> metrics_calls{0};
  auto s = HttpServer::Start("127.0.0.1:0",
                             {{"/metrics",
                               [&] {
                                 metrics_calls.fetch_add(1);
                                 return HttpResponse{200, "text/plain", big};
                               }},
                              {"/healthz", Ok}},
                             o);
  ASSERT_TRUE(s.ok()) << s.status();
  const int port = (*s)->port();

  const int deaf = ConnectTo(port);
  SendAll(deaf, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  ASSERT_TRUE(Eventually([&] { return metrics_calls.load() == 1; }));
  std::vector<int> silent;
  for (int i = 0; i < 2; ++i) silent.push_back(ConnectTo(port));

  constexpr int kProbes = 50;
  std::vector<double> ms;
  for (int i = 0; i < kProbes; ++i) {
    const absl::Time t0 = absl::Now();
    absl::StatusOr<std::string> r = HttpGet(port, "/healthz");
    ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - t0));
    ASSERT_TRUE(r.ok()) << "probe " << i << ": " << r.status();
    EXPECT_EQ(*r, "ok\n");
  }
  // The slow clients held their connections all along: the deaf one still
  // gets the whole answer once it reads (the server was still writing it),
  // and the silent ones are still served when they finally ask.
  // (The count is bumped after an answer is written: the last probe's may
  // lag its client by a moment. The deaf client's never comes.)
  ASSERT_TRUE(Eventually([&] { return (*s)->requests_answered() >= kProbes; }));
  EXPECT_EQ((*s)->requests_answered(), static_cast<uint64_t>(kProbes));
  for (int fd : silent) {
    SendAll(fd, "GET /healthz HTTP/1.0\r\n\r\n");
    const std::string answer = ReadToEnd(fd);
    EXPECT_EQ(answer.rfind("HTTP/1.1 200", 0), 0u) << answer;
    close(fd);
  }
  const std::string all = ReadToEnd(deaf);
  close(deaf);
  EXPECT_EQ(all.rfind("HTTP/1.1 200", 0), 0u) << all.substr(0, 200);
  EXPECT_GT(all.size(), big.size());
  EXPECT_EQ(all.compare(all.size() - big.size(), big.size(), big), 0);

  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  std::printf("healthz probe latency with 1 deaf /metrics client and 2 silent clients "
              "holding 3 of 4 threads, %d probes: min %.2f ms, median %.2f ms, p90 %.2f ms, "
              "max %.2f ms\n",
              kProbes, ms.front(), median, ms[ms.size() * 9 / 10], ms.back());
  // The issue asks for < 100 ms: the median must be; any single probe may
  // be slowed by a loaded machine, but not held behind the slow clients
  // (they hold theirs for 5 minutes).
  EXPECT_LT(median, 100.0);
  EXPECT_LT(ms.back(), 10000.0);
}

// With the default timeouts' kind of settings, a client that never reads
// is let go once its write times out, and one that sends nothing once its
// read times out: neither holds a thread for good.
TEST(HttpServerTest, SlowClientsAreDroppedAfterTheirTimeouts) {
  HttpServerOptions o;
  o.threads = 1;
  o.read_timeout = absl::Milliseconds(300);
  o.write_timeout = absl::Milliseconds(300);
  const std::string big(64 << 20, 'x');
  auto s = HttpServer::Start(
      "127.0.0.1:0",
      {{"/big", [&big] { return HttpResponse{200, "text/plain", big}; }}, {"/healthz", Ok}}, o);
  ASSERT_TRUE(s.ok()) << s.status();
  const int port = (*s)->port();

  const int deaf = ConnectTo(port);
  SendAll(deaf, "GET /big HTTP/1.0\r\n\r\n");
  // With one thread, a probe is answered only once the server has let the
  // deaf client go, though it never read; it then gets only part of its
  // answer.
  ASSERT_TRUE(Eventually([&] { return HttpGet(port, "/healthz").ok(); }));
  const std::string part = ReadToEnd(deaf);
  close(deaf);
  EXPECT_LT(part.size(), big.size());

  // A silent client holds the only thread until its read timeout; then
  // probes are answered.
  const int silent = ConnectTo(port);
  EXPECT_TRUE(Eventually([&] { return HttpGet(port, "/healthz").ok(); }));
  // The server closed the silent connection: the client sees the end.
  EXPECT_EQ(ReadToEnd(silent), "");
  close(silent);
}

// Sockets this process has open (clients and server together).
int SocketsOpen() {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    const std::filesystem::path target = std::filesystem::read_symlink(e.path(), ec);
    if (!ec && target.string().rfind("socket:", 0) == 0) ++n;
  }
  return n;
}

// A flood of connections while every thread is busy: the server accepts
// only max_queued of them (and holds one more in its accept loop); the rest
// wait in the kernel's backlog, not in the process. Nothing is lost: once
// the thread is free, every client is answered.
TEST(HttpServerTest, ConnectionsWaitingForAThreadAreBounded) {
  HttpServerOptions o;
  o.threads = 1;
  o.max_queued = 2;
  // The silent client holds the only thread for the whole test.
  o.read_timeout = absl::Minutes(5);
  auto s = HttpServer::Start("127.0.0.1:0", {{"/healthz", Ok}}, o);
  ASSERT_TRUE(s.ok()) << s.status();
  const int port = (*s)->port();
  const int base = SocketsOpen();
  const int holder = ConnectTo(port);
  ASSERT_TRUE(Eventually([&] { return SocketsOpen() == base + 2; }));  // Its two ends.

  // Eight fit in queue + accept loop + httplib's listen backlog (5, and
  // Linux takes one more), so every connect() returns at once.
  constexpr int kClients = 8;
  std::vector<int> clients;
  for (int i = 0; i < kClients; ++i) {
    clients.push_back(ConnectTo(port));
    SendAll(clients.back(), "GET /healthz HTTP/1.0\r\n\r\n");
  }
  // The server's side: the held connection, 2 queued, 1 in the accept loop.
  const int bounded = base + 2 + kClients + o.max_queued + 1;
  ASSERT_TRUE(Eventually([&] { return SocketsOpen() >= bounded; }));
  absl::SleepFor(absl::Milliseconds(300));  // Time to accept more, if it would.
  EXPECT_EQ(SocketsOpen(), bounded) << "the server accepted connections beyond its queue";

  // The thread is let go: every waiting client is served, in turn.
  close(holder);
  for (int fd : clients) {
    const std::string answer = ReadToEnd(fd);
    EXPECT_EQ(answer.rfind("HTTP/1.1 200", 0), 0u) << answer;
    EXPECT_NE(answer.find("ok\n"), std::string::npos) << answer;
    close(fd);
  }
  EXPECT_TRUE(Eventually([&] { return (*s)->requests_answered() == kClients; }));
}

TEST(HttpServerTest, RefusesANegativeQueueBound) {
  HttpServerOptions o;
  o.max_queued = -1;
  absl::StatusOr<std::unique_ptr<HttpServer>> s =
      HttpServer::Start("127.0.0.1:0", {{"/healthz", Ok}}, o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("max_queued"), std::string::npos) << s.status();
}

TEST(HttpServerTest, ListensOnIpv6Loopback) {
  if (!HaveIpv6Loopback()) GTEST_SKIP() << "no IPv6 loopback on this machine (::1 cannot be bound)";
  auto s = HttpServer::Start("[::1]:0", {{"/healthz", Ok}});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(HttpGet("::1", (*s)->port(), "/healthz").value_or("?"), "ok\n");
  // Not on IPv4.
  EXPECT_FALSE(HttpGet("127.0.0.1", (*s)->port(), "/healthz").ok());
}

TEST(HttpServerTest, ListensOnEveryIpv6AddressAndIpv4WhereMapped) {
  if (!HaveIpv6Loopback()) GTEST_SKIP() << "no IPv6 loopback on this machine (::1 cannot be bound)";
  auto s = HttpServer::Start("[::]:0", {{"/healthz", Ok}});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(HttpGet("::1", (*s)->port(), "/healthz").value_or("?"), "ok\n");
  std::ifstream f("/proc/sys/net/ipv6/bindv6only");
  int v6only = 1;
  if (f >> v6only && v6only == 0) {
    EXPECT_EQ(HttpGet("127.0.0.1", (*s)->port(), "/healthz").value_or("?"), "ok\n");
  } else {
    std::printf("net.ipv6.bindv6only is not 0: [::] takes IPv6 connections only\n");
  }
}

TEST(HttpServerTest, ListensOnEveryIpv4Address) {
  auto s = HttpServer::Start("0.0.0.0:0", {{"/healthz", Ok}});
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(HttpGet((*s)->port(), "/healthz").value_or("?"), "ok\n");
  auto star = HttpServer::Start("*:0", {{"/healthz", Ok}});
  ASSERT_TRUE(star.ok()) << star.status();
  EXPECT_EQ(HttpGet((*star)->port(), "/healthz").value_or("?"), "ok\n");
}

TEST(HttpServerTest, AFixedPortAndAPortInUse) {
  auto first = HttpServer::Start("127.0.0.1:0", {{"/healthz", Ok}});
  ASSERT_TRUE(first.ok()) << first.status();
  const int port = (*first)->port();
  const std::string addr = absl::StrCat("127.0.0.1:", port);
  auto second = HttpServer::Start(addr, {{"/healthz", Ok}});
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_NE(second.status().message().find(addr), absl::string_view::npos) << second.status();
  first->reset();
  // The port is free again once the first server is gone.
  EXPECT_TRUE(Eventually([&] { return HttpServer::Start(addr, {{"/healthz", Ok}}).ok(); }));
}

TEST(HttpServerTest, StopsWhileAClientIsConnected) {
  HttpServerOptions o;
  o.read_timeout = absl::Milliseconds(200);
  auto s = HttpServer::Start("127.0.0.1:0", {{"/healthz", Ok}}, o);
  ASSERT_TRUE(s.ok()) << s.status();
  const int fd = ConnectTo((*s)->port());
  s->reset();  // Returns once the silent client's read times out.
  close(fd);
}

TEST(HttpServerTest, BadOptionsAreAnError) {
  HttpServerOptions o;
  o.threads = 0;
  EXPECT_EQ(HttpServer::Start("127.0.0.1:0", {}, o).status().code(),
            absl::StatusCode::kInvalidArgument);
  o = HttpServerOptions();
  o.read_timeout = absl::ZeroDuration();
  EXPECT_EQ(HttpServer::Start("127.0.0.1:0", {}, o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HttpServerTest, BadAddressesAreClearErrors) {
  for (const char* bad : {"nonsense", "999.1.1.1:0", "127.0.0.1:65536", "127.0.0.1:x",
                          "::1:0", "[::1:0", "[nope]:0", "[::1]", "localhost:0"}) {
    auto s = HttpServer::Start(bad, {});
    ASSERT_FALSE(s.ok()) << bad;
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(s.status().message().find(bad), absl::string_view::npos) << s.status();
  }
}

}  // namespace
}  // namespace optimus
