#include "common/json.h"

#include <cmath>

namespace optimus {

std::string JsonDump(const Json& doc) {
  return doc.dump(-1, ' ', /*ensure_ascii=*/false, Json::error_handler_t::replace);
}

std::string JsonDump(const nlohmann::json& doc) {
  return doc.dump(-1, ' ', /*ensure_ascii=*/false, nlohmann::json::error_handler_t::replace);
}

std::string JsonQuote(absl::string_view s) { return JsonDump(Json(std::string(s))); }

double JsonRound(double v, int decimals) {
  if (!std::isfinite(v)) return v;
  const double scale = std::pow(10.0, decimals);
  const double r = std::round(v * scale) / scale;
  return std::isfinite(r) ? r : v;  // v * scale overflowed: v has no decimals to drop.
}

}  // namespace optimus
