#include "common/logging.h"

#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"

namespace optimus {
namespace {

// Runs `fn` with log lines captured; returns what was written.
template <typename Fn>
std::string Capture(Fn fn) {
  std::FILE* f = std::tmpfile();
  SetLogOutput(f);
  fn();
  SetLogOutput(nullptr);
  std::string out;
  std::rewind(f);
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  std::fclose(f);
  return out;
}

TEST(LoggingTest, JsonLinesEscapeQuotesAndNewlines) {
  LogFormat format;
  ASSERT_TRUE(ParseLogFormat("json", &format));
  SetLogFormat(format);
  const std::string out = Capture([] {
    OPTIMUS_LOG(Warning, "shard", "job \"a\" failed:\nline2\\", 7);
  });
  SetLogFormat(LogFormat::kText);
  // One line, ending in a newline, with every field, in this order.
  ASSERT_EQ(out.find('\n'), out.size() - 1) << out;
  EXPECT_EQ(out.rfind("{\"ts\":\"", 0), 0u) << out;
  EXPECT_NE(out.find("\"level\":\"WARN\",\"pid\":"), std::string::npos) << out;
  EXPECT_NE(out.find("\"component\":\"shard\""), std::string::npos) << out;
  EXPECT_NE(out.find("\"msg\":\"job \\\"a\\\" failed:\\nline2\\\\7\"}"), std::string::npos)
      << out;
  const nlohmann::json doc = nlohmann::json::parse(out);
  EXPECT_EQ(doc["msg"], "job \"a\" failed:\nline2\\7");
  EXPECT_EQ(doc["level"], "WARN");
  EXPECT_EQ(doc["ts"].get<std::string>().back(), 'Z');
}

// A message with bytes that are not UTF-8 (a name sent by a peer) still
// makes a valid JSON line: the bad bytes become U+FFFD.
TEST(LoggingTest, JsonLinesStayValidWithInvalidUtf8) {
  SetLogFormat(LogFormat::kJson);
  const std::string out = Capture([] {
    OPTIMUS_LOG(Info, "coord", "job \xff\xfe created");
  });
  SetLogFormat(LogFormat::kText);
  nlohmann::json doc;
  ASSERT_NO_THROW(doc = nlohmann::json::parse(out)) << out;
  EXPECT_EQ(doc["msg"], "job \xef\xbf\xbd\xef\xbf\xbd created");
}

TEST(LoggingTest, TextLinesAndLevelFilter) {
  SetLogFormat(LogFormat::kText);
  const std::string out = Capture([] {
    OPTIMUS_LOG(Debug, "coord", "hidden");
    OPTIMUS_LOG(Error, "coord", "shown ", 42);
  });
  EXPECT_EQ(out.find("hidden"), std::string::npos) << out;
  EXPECT_NE(out.find(" ERROR pid="), std::string::npos) << out;
  EXPECT_NE(out.find(" coord: shown 42\n"), std::string::npos) << out;
}

TEST(LoggingTest, UnknownFormatNameIsRefused) {
  LogFormat format = LogFormat::kText;
  EXPECT_FALSE(ParseLogFormat("xml", &format));
  EXPECT_EQ(format, LogFormat::kText);
}

}  // namespace
}  // namespace optimus
