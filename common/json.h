// JSON output for what optimus prints (logs, benchmark lines, optimusctl's
// -o json): documents are nlohmann-json values (Debian's nlohmann-json3-dev,
// header-only), dumped on one line and always valid UTF-8: bytes that are
// not UTF-8 (a name from a peer, a path) become U+FFFD instead of making the
// whole document unreadable. Stateless; safe from any thread.
#ifndef OPTIMUS_COMMON_JSON_H_
#define OPTIMUS_COMMON_JSON_H_

#include <string>

#include <nlohmann/json.hpp>

#include "absl/strings/string_view.h"

namespace optimus {

// Objects keep their keys in insertion order, so lines read as written.
using Json = nlohmann::ordered_json;

// `doc` on one line, no trailing newline, compact (no spaces), invalid UTF-8
// replaced by U+FFFD.
std::string JsonDump(const Json& doc);
std::string JsonDump(const nlohmann::json& doc);

// `s` as a JSON string literal, quotes included: '"' and '\' escaped,
// control characters as \n, \t, ... or \u00XX; valid UTF-8 passes through,
// invalid bytes become U+FFFD.
std::string JsonQuote(absl::string_view s);

// `v` rounded to `decimals` places: a measured figure printed as a JSON
// number without its noise digits (JsonDump prints the shortest form that
// reads back, so 12.3456789 rounded to 3 prints 12.346). Non-finite values
// pass through (JsonDump prints them as null).
double JsonRound(double v, int decimals);

}  // namespace optimus

#endif  // OPTIMUS_COMMON_JSON_H_
