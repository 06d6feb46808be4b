#include "common/metrics.h"

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

TEST(HttpServerTest, BadAddressIsAnError) {
  EXPECT_FALSE(HttpServer::Start("nonsense", {}).ok());
  EXPECT_FALSE(HttpServer::Start("999.1.1.1:0", {}).ok());
}

}  // namespace
}  // namespace optimus
