#include "cli/output.h"

#include <charconv>
#include <cmath>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "yaml-cpp/yaml.h"

namespace optimus {
namespace {

// The same tree with every string (keys included) made valid UTF-8.
Json Sanitized(const Json& doc) {
  return Json::parse(doc.dump(-1, ' ', false, Json::error_handler_t::replace));
}

void Emit(YAML::Emitter* out, const Json& j) {
  switch (j.type()) {
    case Json::value_t::object:
      *out << YAML::BeginMap;
      for (auto it = j.begin(); it != j.end(); ++it) {
        *out << YAML::Key << YAML::DoubleQuoted << it.key() << YAML::Value;
        Emit(out, it.value());
      }
      *out << YAML::EndMap;
      return;
    case Json::value_t::array:
      *out << YAML::BeginSeq;
      for (const Json& v : j) Emit(out, v);
      *out << YAML::EndSeq;
      return;
    case Json::value_t::string:
      *out << YAML::DoubleQuoted << j.get<std::string>();
      return;
    case Json::value_t::boolean:
      *out << j.get<bool>();
      return;
    case Json::value_t::null:
    case Json::value_t::discarded:
      *out << YAML::Null;
      return;
    default:  // Numbers: their JSON text is a YAML number too.
      *out << j.dump();
      return;
  }
}

}  // namespace

absl::StatusOr<OutputFormat> ParseOutputFormat(absl::string_view name) {
  if (name == "table") return OutputFormat::kTable;
  if (name == "json") return OutputFormat::kJson;
  if (name == "yaml") return OutputFormat::kYaml;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown output format \"", name, "\" (table, json or yaml)"));
}

std::string ToJsonText(const Json& doc) {
  return doc.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
}

std::string ToYamlText(const Json& doc) {
  YAML::Emitter out;
  out.SetIndent(2);
  Emit(&out, Sanitized(doc));
  return std::string(out.c_str()) + "\n";
}

std::string RenderDocument(const Json& doc, OutputFormat format) {
  return format == OutputFormat::kYaml ? ToYamlText(doc) : ToJsonText(doc);
}

Json JsonFloat(float x) {
  if (!std::isfinite(x)) return nullptr;
  char buf[64];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), x);
  if (r.ec != std::errc()) return static_cast<double>(x);
  *r.ptr = '\0';
  // The double nearest the float's shortest decimal form prints as that form.
  return std::strtod(buf, nullptr);
}

}  // namespace optimus
