#include "common/metrics.h"

#include <charconv>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/version.h"

namespace optimus {
namespace {

std::string Escape(absl::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out.push_back('\\');
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

}  // namespace

std::string MetricsText::Number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  // Integral values that a double holds exactly print as integers ("1000000",
  // not "1e+06"); others in the shortest form that reads back to the same
  // double (C++17 <charconv>).
  if (v == std::trunc(v) && std::fabs(v) < 9007199254740992.0) {  // 2^53
    return absl::StrCat(static_cast<int64_t>(v));
  }
  char buf[64];
  const std::to_chars_result r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

std::string MetricsText::SignedText(int64_t v) { return absl::StrCat(v); }
std::string MetricsText::UnsignedText(uint64_t v) { return absl::StrCat(v); }

std::string MetricsText::Labels(const MetricLabels& labels) {
  if (labels.empty()) return "";
  std::string s = "{";
  for (size_t i = 0; i < labels.size(); ++i) {
    if (i > 0) s += ",";
    absl::StrAppend(&s, labels[i].first, "=\"", Escape(labels[i].second), "\"");
  }
  return s + "}";
}

void MetricsText::Declare(absl::string_view name, absl::string_view help,
                          absl::string_view type) {
  if (!declared_.insert(std::string(name)).second) return;
  absl::StrAppend(&out_, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

void MetricsText::Sample(absl::string_view name, absl::string_view help, absl::string_view type,
                         absl::string_view value_text, const MetricLabels& labels) {
  Declare(name, help, type);
  absl::StrAppend(&out_, name, Labels(labels), " ", value_text, "\n");
}

void MetricsText::Gauge(absl::string_view name, absl::string_view help, double value,
                        const MetricLabels& labels) {
  Sample(name, help, "gauge", Number(value), labels);
}

void MetricsText::Counter(absl::string_view name, absl::string_view help, double value,
                          const MetricLabels& labels) {
  Sample(name, help, "counter", Number(value), labels);
}

void MetricsText::BuildInfo(absl::string_view binary) {
#if defined(__x86_64__)
  const char* arch = "x86_64";
#elif defined(__aarch64__)
  const char* arch = "aarch64";
#else
  const char* arch = "other";
#endif
  Gauge("optimus_build_info",
        "Always 1; the labels say which optimus release and binary is running.", 1,
        {{"version", kOptimusVersion}, {"binary", std::string(binary)}, {"arch", arch}});
}

void Histogram::Observe(double seconds) {
  size_t i = 0;
  while (i < kBoundsSeconds.size() && seconds > kBoundsSeconds[i]) ++i;
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  sum_nanos_.fetch_add(static_cast<uint64_t>(std::max(0.0, seconds) * 1e9),
                       std::memory_order_relaxed);
}

void Histogram::Render(MetricsText* out, absl::string_view name, absl::string_view help) const {
  out->Declare(name, help, "histogram");
  uint64_t cumulative = 0;
  std::string text;
  for (size_t i = 0; i < kBoundsSeconds.size(); ++i) {
    cumulative += buckets_[i].load(std::memory_order_relaxed);
    absl::StrAppend(&text, name, "_bucket{le=\"", MetricsText::Number(kBoundsSeconds[i]), "\"} ",
                    cumulative, "\n");
  }
  cumulative += buckets_[kBoundsSeconds.size()].load(std::memory_order_relaxed);
  absl::StrAppend(&text, name, "_bucket{le=\"+Inf\"} ", cumulative, "\n");
  absl::StrAppend(
      &text, name, "_sum ",
      MetricsText::Number(static_cast<double>(sum_nanos_.load(std::memory_order_relaxed)) / 1e9),
      "\n");
  absl::StrAppend(&text, name, "_count ", cumulative, "\n");
  out->Append(text);
}

}  // namespace optimus
