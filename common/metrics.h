// Prometheus text exposition (format 0.0.4) for optimus's /metrics pages:
// a builder that components fill at scrape time from their own counters, and
// a fixed-bucket latency histogram. Values print at full precision: integers
// with every digit (a uint64_t counter past 2^53 too), doubles in the
// shortest form that reads back to the same double. The builder is not
// thread-safe (one per scrape); Histogram::Observe is safe from any thread.
#ifndef OPTIMUS_COMMON_METRICS_H_
#define OPTIMUS_COMMON_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace optimus {

using MetricLabels = std::vector<std::pair<std::string, std::string>>;

class MetricsText {
 public:
  // The HELP/TYPE lines are written once per metric name. An integer value
  // (any integral type) prints exactly; a double as Number() does.
  void Gauge(absl::string_view name, absl::string_view help, double value,
             const MetricLabels& labels = {});
  void Counter(absl::string_view name, absl::string_view help, double value,
               const MetricLabels& labels = {});
  template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
  void Gauge(absl::string_view name, absl::string_view help, T value,
             const MetricLabels& labels = {}) {
    Sample(name, help, "gauge", Integer(value), labels);
  }
  template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
  void Counter(absl::string_view name, absl::string_view help, T value,
               const MetricLabels& labels = {}) {
    Sample(name, help, "counter", Integer(value), labels);
  }
  // optimus_build_info{version="<kOptimusVersion>",binary="<binary>",
  // arch="x86_64|aarch64"} 1: what is running, for dashboards and alerts.
  void BuildInfo(absl::string_view binary);
  // Raw histogram lines; see Histogram::Render.
  void Append(absl::string_view text) { out_.append(text.data(), text.size()); }
  void Declare(absl::string_view name, absl::string_view help, absl::string_view type);
  const std::string& text() const { return out_; }

  static std::string Labels(const MetricLabels& labels);
  // A double in the shortest text that parses back to the same value
  // ("42", "7.5", "1e-05", "1.0000000000000002"); NaN, +Inf, -Inf.
  static std::string Number(double v);

 private:
  template <typename T>
  static std::string Integer(T v) {
    if constexpr (std::is_signed_v<T>) {
      return SignedText(static_cast<int64_t>(v));
    } else {
      return UnsignedText(static_cast<uint64_t>(v));
    }
  }
  static std::string SignedText(int64_t v);
  static std::string UnsignedText(uint64_t v);
  void Sample(absl::string_view name, absl::string_view help, absl::string_view type,
              absl::string_view value_text, const MetricLabels& labels);

  std::string out_;
  std::set<std::string> declared_;
};

// Latency histogram with fixed buckets from 10 us to 10 s (x ~3 per bucket).
class Histogram {
 public:
  static constexpr std::array<double, 13> kBoundsSeconds = {
      1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0};

  void Observe(double seconds);
  void Render(MetricsText* out, absl::string_view name, absl::string_view help) const;
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }

 private:
  std::array<std::atomic<uint64_t>, kBoundsSeconds.size() + 1> buckets_{};
  std::atomic<uint64_t> count_{0};
  std::atomic<uint64_t> sum_nanos_{0};
};

}  // namespace optimus

#endif  // OPTIMUS_COMMON_METRICS_H_
