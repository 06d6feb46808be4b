// optimusctl's machine-readable output: every read command builds one JSON
// tree (nlohmann::ordered_json, fields in the order the command adds them)
// and prints it as JSON (`-o json`) or YAML (`-o yaml`, the same tree
// through yaml-cpp's emitter). Text is always valid UTF-8: bytes that are
// not (a name a client sent) become U+FFFD. Pure functions; thread-safe.
#ifndef OPTIMUS_CLI_OUTPUT_H_
#define OPTIMUS_CLI_OUTPUT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace optimus {

using Json = nlohmann::ordered_json;

enum class OutputFormat {
  kTable,  // "table": aligned columns for people (the default).
  kJson,   // "json": one JSON document on one line.
  kYaml,   // "yaml": the same document as block YAML.
};

// "table", "json" or "yaml"; INVALID_ARGUMENT naming `name` otherwise.
absl::StatusOr<OutputFormat> ParseOutputFormat(absl::string_view name);

// `doc` on one line and a newline; invalid UTF-8 replaced by U+FFFD.
std::string ToJsonText(const Json& doc);

// `doc` as a YAML document and a newline: strings double-quoted (a job
// named "true" or "007" stays a string), numbers as JSON writes them, null
// as ~. Loads back (yaml-cpp, PyYAML) to the same values.
std::string ToYamlText(const Json& doc);

// `doc` in `format` (kJson or kYaml; kTable gives JSON too).
std::string RenderDocument(const Json& doc, OutputFormat format);

// A float as a JSON number in its shortest decimal form (3e-4f -> 0.0003,
// not 0.0003000000142...); null when not finite (JSON has no inf or NaN).
Json JsonFloat(float x);

}  // namespace optimus

#endif  // OPTIMUS_CLI_OUTPUT_H_
