#include "common/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/http_server.h"
#include "gtest/gtest.h"

namespace optimus {
namespace {

TEST(MetricsTextTest, WritesHelpTypeOnceAndLabels) {
  MetricsText m;
  m.Gauge("optimus_x_bytes", "Bytes of x.", 42, {{"shard", "1"}});
  m.Gauge("optimus_x_bytes", "Bytes of x.", 7.5, {{"shard", "2\"q"}});
  m.Counter("optimus_y_total", "Ys.", 3);
  EXPECT_EQ(m.text(),
            "# HELP optimus_x_bytes Bytes of x.\n# TYPE optimus_x_bytes gauge\n"
            "optimus_x_bytes{shard=\"1\"} 42\noptimus_x_bytes{shard=\"2\\\"q\"} 7.5\n"
            "# HELP optimus_y_total Ys.\n# TYPE optimus_y_total counter\noptimus_y_total 3\n");
}

TEST(HistogramTest, CumulativeBuckets) {
  Histogram h;
  h.Observe(5e-6);
  h.Observe(2e-3);
  h.Observe(100);
  MetricsText m;
  h.Render(&m, "optimus_step_seconds", "Step latency.");
  const std::string& t = m.text();
  EXPECT_NE(t.find("optimus_step_seconds_bucket{le=\"1e-05\"} 1\n"), std::string::npos) << t;
  EXPECT_NE(t.find("optimus_step_seconds_bucket{le=\"0.003\"} 2\n"), std::string::npos) << t;
  EXPECT_NE(t.find("optimus_step_seconds_bucket{le=\"10\"} 2\n"), std::string::npos) << t;
  EXPECT_NE(t.find("optimus_step_seconds_bucket{le=\"+Inf\"} 3\n"), std::string::npos) << t;
  EXPECT_NE(t.find("optimus_step_seconds_count 3\n"), std::string::npos) << t;
}

TEST(HttpServerTest, ServesHandlersAnd404) {
  int calls = 0;
  auto s = HttpServer::Start("127.0.0.1:0", {{"/metrics", [&calls] {
                                               ++calls;
                                               return HttpResponse{200, "text/plain", "a 1\n"};
                                             }}});
  ASSERT_TRUE(s.ok()) << s.status();
  auto body = HttpGet((*s)->port(), "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_EQ(*body, "a 1\n");
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(HttpGet((*s)->port(), "/nope").status().code(), absl::StatusCode::kInternal);
  const int port = (*s)->port();
  s->reset();
  EXPECT_EQ(HttpGet(port, "/metrics").status().code(), absl::StatusCode::kUnavailable);
}

int ConnectTo(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  return fd;
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

TEST(HttpServerTest, AClientThatNeverReadsHoldsOneThreadUntilItsDeadline) {
  HttpServerOptions o;
  o.write_timeout = absl::Milliseconds(300);
  const std::string big(64 << 20, 'x');
  auto s = HttpServer::Start(
      "127.0.0.1:0",
      {{"/big", [&big] { return HttpResponse{200, "text/plain", big}; }},
       {"/healthz", [] { return HttpResponse{200, "text/plain", "ok\n"}; }}},
      o);
  ASSERT_TRUE(s.ok()) << s.status();
  const int deaf = ConnectTo((*s)->port());
  const int small = 1;
  setsockopt(deaf, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  const std::string get = "GET /big HTTP/1.0\r\n\r\n";
  ASSERT_EQ(send(deaf, get.data(), get.size(), MSG_NOSIGNAL), static_cast<ssize_t>(get.size()));
  // Answered meanwhile by the other threads; the deaf client is dropped
  // once its answer's deadline passes, though it never reads.
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(HttpGet((*s)->port(), "/healthz").ok());
  EXPECT_TRUE(Eventually([&] { return (*s)->connections_timed_out() >= 1; }));
  close(deaf);
  EXPECT_TRUE(HttpGet((*s)->port(), "/healthz").ok());
}

TEST(HttpServerTest, ConnectionsBeyondThreadsAndQueueAreShedNotQueuedForever) {
  HttpServerOptions o;
  o.threads = 1;
  o.max_queued = 1;
  o.read_timeout = absl::Minutes(10);  // Only shedding can free room here.
  auto s = HttpServer::Start(
      "127.0.0.1:0", {{"/healthz", [] { return HttpResponse{200, "text/plain", "ok\n"}; }}}, o);
  ASSERT_TRUE(s.ok()) << s.status();
  std::vector<int> silent;
  for (int i = 0; i < 6; ++i) silent.push_back(ConnectTo((*s)->port()));
  // One is being served (waiting for its request), one waits in the
  // queue, the other four are closed at once.
  EXPECT_TRUE(Eventually([&] { return (*s)->connections_shed() >= 4; }));
  for (int fd : silent) close(fd);
  // The served one ends when its client goes; then probes are answered.
  EXPECT_TRUE(Eventually([&] { return HttpGet((*s)->port(), "/healthz").ok(); }));
}

TEST(HttpServerTest, BadOptionsAreAnError) {
  HttpServerOptions o;
  o.threads = 0;
  EXPECT_EQ(HttpServer::Start("127.0.0.1:0", {}, o).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(HttpServerTest, BadAddressIsAnError) {
  EXPECT_FALSE(HttpServer::Start("nonsense", {}).ok());
  EXPECT_FALSE(HttpServer::Start("999.1.1.1:0", {}).ok());
}

}  // namespace
}  // namespace optimus
