#include "common/metrics.h"

#include <cmath>

#include "absl/strings/str_cat.h"

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

std::string Number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return absl::StrCat(static_cast<int64_t>(v));
  return absl::StrCat(v);
}

}  // namespace

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
                         double value, const MetricLabels& labels) {
  Declare(name, help, type);
  absl::StrAppend(&out_, name, Labels(labels), " ", Number(value), "\n");
}

void MetricsText::Gauge(absl::string_view name, absl::string_view help, double value,
                        const MetricLabels& labels) {
  Sample(name, help, "gauge", value, labels);
}

void MetricsText::Counter(absl::string_view name, absl::string_view help, double value,
                          const MetricLabels& labels) {
  Sample(name, help, "counter", value, labels);
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
    absl::StrAppend(&text, name, "_bucket{le=\"", kBoundsSeconds[i], "\"} ", cumulative, "\n");
  }
  cumulative += buckets_[kBoundsSeconds.size()].load(std::memory_order_relaxed);
  absl::StrAppend(&text, name, "_bucket{le=\"+Inf\"} ", cumulative, "\n");
  absl::StrAppend(&text, name, "_sum ",
                  static_cast<double>(sum_nanos_.load(std::memory_order_relaxed)) * 1e-9, "\n");
  absl::StrAppend(&text, name, "_count ", cumulative, "\n");
  out->Append(text);
}

}  // namespace optimus
