#include "cli/output.h"

#include <cstdint>
#include <limits>
#include <string>

#include "gtest/gtest.h"
#include "yaml-cpp/yaml.h"

namespace optimus {
namespace {

// Whether the YAML node holds what the JSON value does: the same keys in
// the same order, strings as strings (quoted, so "true" and "007" stay
// strings), numbers equal, null as null.
void ExpectSame(const Json& j, const YAML::Node& y, const std::string& where) {
  switch (j.type()) {
    case Json::value_t::object: {
      ASSERT_TRUE(y.IsMap()) << where;
      ASSERT_EQ(y.size(), j.size()) << where;
      auto yit = y.begin();
      for (auto it = j.begin(); it != j.end(); ++it, ++yit) {
        EXPECT_EQ(yit->first.as<std::string>(), it.key()) << where;
        ExpectSame(it.value(), yit->second, where + "." + it.key());
      }
      return;
    }
    case Json::value_t::array:
      ASSERT_TRUE(y.IsSequence()) << where;
      ASSERT_EQ(y.size(), j.size()) << where;
      for (size_t i = 0; i < j.size(); ++i) {
        ExpectSame(j[i], y[i], where + "[" + std::to_string(i) + "]");
      }
      return;
    case Json::value_t::string:
      ASSERT_TRUE(y.IsScalar()) << where;
      EXPECT_EQ(y.Tag(), "!") << where << ": a string must be quoted";
      EXPECT_EQ(y.as<std::string>(), j.get<std::string>()) << where;
      return;
    case Json::value_t::boolean:
      EXPECT_EQ(y.as<bool>(), j.get<bool>()) << where;
      return;
    case Json::value_t::null:
      EXPECT_TRUE(y.IsNull()) << where;
      return;
    case Json::value_t::number_unsigned:
      EXPECT_EQ(y.as<uint64_t>(), j.get<uint64_t>()) << where;
      return;
    case Json::value_t::number_integer:
      EXPECT_EQ(y.as<int64_t>(), j.get<int64_t>()) << where;
      return;
    default:
      EXPECT_EQ(y.as<double>(), j.get<double>()) << where;
      return;
  }
}

Json Sample() {
  return Json{{"name", "llama-70b"},
              {"tricky", {"true", "007", "null", "~", "a: b", "- x", "#c", "", "line\nbreak"}},
              {"count", 3},
              {"negative", -2},
              {"big", (uint64_t{1} << 60) + 1},
              {"lr", JsonFloat(3e-4f)},
              {"eps", JsonFloat(1e-8f)},
              {"inf", JsonFloat(std::numeric_limits<float>::infinity())},
              {"on", true},
              {"none", nullptr},
              {"empty_list", Json::array()},
              {"empty_map", Json::object()},
              {"nested", {{{"a", 1}}, {{"b", Json::array({1, 2})}}}}};
}

TEST(OutputTest, JsonIsOneLineAndParsesBack) {
  const std::string text = ToJsonText(Sample());
  ASSERT_EQ(text.find('\n'), text.size() - 1);
  EXPECT_EQ(Json::parse(text), Sample());
  // Fields keep the order they were added in.
  EXPECT_EQ(text.rfind("{\"name\":\"llama-70b\",\"tricky\":", 0), 0u) << text;
}

TEST(OutputTest, YamlLoadsToTheSameTree) {
  const std::string text = ToYamlText(Sample());
  const YAML::Node y = YAML::Load(text);
  ExpectSame(Sample(), y, "$");
}

TEST(OutputTest, FloatsPrintInTheirShortestForm) {
  EXPECT_EQ(JsonFloat(3e-4f).dump(), "0.0003");
  EXPECT_EQ(JsonFloat(0.95f).dump(), "0.95");
  EXPECT_EQ(JsonFloat(1e-8f).dump(), "1e-08");
  EXPECT_TRUE(JsonFloat(std::numeric_limits<float>::quiet_NaN()).is_null());
  EXPECT_EQ(static_cast<float>(JsonFloat(0.1f).get<double>()), 0.1f);  // Round-trips.
}

TEST(OutputTest, InvalidUtf8BecomesReplacementCharacters) {
  const Json doc = {{"name", std::string("a\xff" "b\xc3")}, {std::string("k\xfe"), 1}};
  const std::string json = ToJsonText(doc);
  const Json back = Json::parse(json);  // Throws on invalid UTF-8.
  EXPECT_EQ(back["name"].get<std::string>(), "a\xef\xbf\xbd" "b\xef\xbf\xbd");
  const YAML::Node y = YAML::Load(ToYamlText(doc));
  EXPECT_EQ(y["name"].as<std::string>(), "a\xef\xbf\xbd" "b\xef\xbf\xbd");
  EXPECT_EQ(y["k\xef\xbf\xbd"].as<int>(), 1);
}

TEST(OutputTest, ParsesFormatNames) {
  EXPECT_EQ(*ParseOutputFormat("table"), OutputFormat::kTable);
  EXPECT_EQ(*ParseOutputFormat("json"), OutputFormat::kJson);
  EXPECT_EQ(*ParseOutputFormat("yaml"), OutputFormat::kYaml);
  const absl::StatusOr<OutputFormat> bad = ParseOutputFormat("xml");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "unknown output format \"xml\" (table, json or yaml)");
}

}  // namespace
}  // namespace optimus
