// JSON string quoting for the one-line JSON that optimus prints (logs,
// optimusctl --json, benchmark lines). Stateless; safe from any thread.
#ifndef OPTIMUS_COMMON_JSON_H_
#define OPTIMUS_COMMON_JSON_H_

#include <string>

#include "absl/strings/string_view.h"

namespace optimus {

// `s` as a JSON string literal, quotes included: '"' and '\' escaped,
// \n \r \t as such, other control characters as \u00XX; other bytes (UTF-8)
// pass through.
std::string JsonQuote(absl::string_view s);

}  // namespace optimus

#endif  // OPTIMUS_COMMON_JSON_H_
