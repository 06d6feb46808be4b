// A minimal JSON reader for tests that check machine-readable output: parses
// one document into a tree of values, failing on anything that is not strict
// JSON. Values are plain data (copyable, no sharing); safe from any thread.
#ifndef OPTIMUS_CLI_TEST_JSON_H_
#define OPTIMUS_CLI_TEST_JSON_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace optimus {

struct JsonValue {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  std::string number_text;  // Exactly as written, e.g. "123" or "1.5e3".
  std::string string;
  std::vector<JsonValue> array;
  std::map<std::string, JsonValue> object;

  bool IsInteger() const;
  // The number as an unsigned integer; 0 unless IsInteger().
  uint64_t AsUint() const;
  // Member `key` of an object; a null value when absent.
  const JsonValue& operator[](const std::string& key) const;
};

// INVALID_ARGUMENT with the byte offset when `text` is not one JSON value
// (surrounding whitespace allowed).
absl::StatusOr<JsonValue> ParseJson(absl::string_view text);

}  // namespace optimus

#endif  // OPTIMUS_CLI_TEST_JSON_H_
