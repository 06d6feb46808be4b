#include "common/json.h"

#include <cmath>
#include <limits>
#include <string>

#include "gtest/gtest.h"

namespace optimus {
namespace {

TEST(JsonTest, QuotesAndEscapes) {
  EXPECT_EQ(JsonQuote("plain"), "\"plain\"");
  EXPECT_EQ(JsonQuote("a\"b\\c"), "\"a\\\"b\\\\c\"");
  EXPECT_EQ(JsonQuote("l1\nl2\t\r"), "\"l1\\nl2\\t\\r\"");
  EXPECT_EQ(JsonQuote(std::string("\x01\x1f", 2)), "\"\\u0001\\u001f\"");
  EXPECT_EQ(JsonQuote("h\xc3\xa9"), "\"h\xc3\xa9\"");  // UTF-8 passes through
  EXPECT_EQ(JsonQuote(""), "\"\"");
}

// A name with bytes that are not UTF-8 (a truncated sequence, a stray
// continuation byte, 0xff) still makes valid JSON: each bad byte becomes
// U+FFFD, the rest is kept, and the text parses back.
TEST(JsonTest, InvalidUtf8BecomesReplacementCharacters) {
  const std::string name = "job-\xc3-\x80-\xff-\xe2\x82\xac";  // ends in a valid euro sign
  const std::string quoted = JsonQuote(name);
  EXPECT_EQ(quoted, "\"job-\xef\xbf\xbd-\xef\xbf\xbd-\xef\xbf\xbd-\xe2\x82\xac\"");
  Json doc;
  doc["job_name"] = name;
  doc["step"] = 7;
  const std::string line = JsonDump(doc);
  const nlohmann::json back = nlohmann::json::parse(line);  // Throws on invalid JSON.
  EXPECT_EQ(back["job_name"], "job-\xef\xbf\xbd-\xef\xbf\xbd-\xef\xbf\xbd-\xe2\x82\xac");
  EXPECT_EQ(back["step"], 7);
}

TEST(JsonTest, DumpIsOneCompactLineInInsertionOrder) {
  Json doc;
  doc["z"] = "last first";
  doc["a"] = 1.5;
  doc["n"] = uint64_t{18446744073709551615u};
  doc["list"] = Json::array({1, "two", nullptr, true});
  EXPECT_EQ(JsonDump(doc),
            "{\"z\":\"last first\",\"a\":1.5,\"n\":18446744073709551615,"
            "\"list\":[1,\"two\",null,true]}");
  // Non-finite numbers are not JSON: they print as null.
  Json bad;
  bad["x"] = std::numeric_limits<double>::quiet_NaN();
  EXPECT_EQ(JsonDump(bad), "{\"x\":null}");
}

TEST(JsonTest, RoundDropsNoiseDigits) {
  Json doc;
  doc["ms"] = JsonRound(12.3456789, 3);
  doc["frac"] = JsonRound(0.1 + 0.2, 4);
  doc["big"] = JsonRound(1e300, 3);
  EXPECT_EQ(JsonDump(doc), "{\"ms\":12.346,\"frac\":0.3,\"big\":1e+300}");
  EXPECT_TRUE(std::isnan(JsonRound(std::nan(""), 2)));
}

}  // namespace
}  // namespace optimus
