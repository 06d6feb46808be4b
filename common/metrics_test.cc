#include "common/metrics.h"

#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/http_server.h"
#include "common/version.h"
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

// Values print at full precision: every digit of an integer, and doubles
// that read back to the same double.
TEST(MetricsTextTest, FullPrecision) {
  MetricsText m;
  m.Counter("optimus_a_total", "A.", uint64_t{1000000000000001});  // 1e15 + 1
  m.Counter("optimus_b_total", "B.", uint64_t{9007199254740993});  // 2^53 + 1: no double holds it
  m.Counter("optimus_c_total", "C.", std::numeric_limits<uint64_t>::max());
  m.Gauge("optimus_d", "D.", int64_t{-5});
  m.Gauge("optimus_e", "E.", 1e6);
  m.Gauge("optimus_f", "F.", 1e20);
  m.Gauge("optimus_g", "G.", 0.1);
  m.Gauge("optimus_h", "H.", 1.0 / 3);
  m.Gauge("optimus_i", "I.", 1e-300);
  m.Gauge("optimus_j", "J.", 1000000000000000.5);
  m.Gauge("optimus_k", "K.", std::numeric_limits<double>::infinity());
  const std::string& t = m.text();
  EXPECT_NE(t.find("\noptimus_a_total 1000000000000001\n"), std::string::npos) << t;
  EXPECT_NE(t.find("\noptimus_b_total 9007199254740993\n"), std::string::npos) << t;
  EXPECT_NE(t.find("\noptimus_c_total 18446744073709551615\n"), std::string::npos) << t;
  EXPECT_NE(t.find("\noptimus_d -5\n"), std::string::npos) << t;
  EXPECT_NE(t.find("\noptimus_e 1000000\n"), std::string::npos) << t;
  EXPECT_NE(t.find("\noptimus_f 1e+20\n"), std::string::npos) << t;
  EXPECT_NE(t.find("\noptimus_g 0.1\n"), std::string::npos) << t;
  EXPECT_NE(t.find("\noptimus_k +Inf\n"), std::string::npos) << t;
  // Every double reads back exactly.
  for (double v : {0.1, 1.0 / 3, 1e-300, 1000000000000000.5, 2.5e-7, 123456789.123456789,
                   -0.0078125, 1e20}) {
    const std::string text = MetricsText::Number(v);
    EXPECT_EQ(std::strtod(text.c_str(), nullptr), v) << text;
  }
  EXPECT_EQ(MetricsText::Number(1000000000000000.5), "1000000000000000.5");
}

TEST(MetricsTextTest, BuildInfo) {
  MetricsText m;
  m.BuildInfo("optimus-shard");
  EXPECT_NE(m.text().find("# TYPE optimus_build_info gauge\n"), std::string::npos) << m.text();
  EXPECT_NE(m.text().find(absl::StrCat("optimus_build_info{version=\"", kOptimusVersion,
                                       "\",binary=\"optimus-shard\",arch=\"")),
            std::string::npos)
      << m.text();
  EXPECT_NE(m.text().find("\"} 1\n"), std::string::npos) << m.text();
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
  // The sum in seconds, from whole nanoseconds, without rounding noise.
  EXPECT_NE(t.find("optimus_step_seconds_sum 100.002005\n"), std::string::npos) << t;
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

}  // namespace
}  // namespace optimus
