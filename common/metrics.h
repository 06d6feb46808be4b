// Prometheus text exposition (format 0.0.4) for optimus's /metrics pages:
// a builder that components fill at scrape time from their own counters, and
// a fixed-bucket latency histogram. The builder is not thread-safe (one per
// scrape); Histogram::Observe is safe from any thread.
#ifndef OPTIMUS_COMMON_METRICS_H_
#define OPTIMUS_COMMON_METRICS_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace optimus {

using MetricLabels = std::vector<std::pair<std::string, std::string>>;

class MetricsText {
 public:
  // The HELP/TYPE lines are written once per metric name.
  void Gauge(absl::string_view name, absl::string_view help, double value,
             const MetricLabels& labels = {});
  void Counter(absl::string_view name, absl::string_view help, double value,
               const MetricLabels& labels = {});
  // Raw histogram lines; see Histogram::Render.
  void Append(absl::string_view text) { out_.append(text.data(), text.size()); }
  void Declare(absl::string_view name, absl::string_view help, absl::string_view type);
  const std::string& text() const { return out_; }

  static std::string Labels(const MetricLabels& labels);

 private:
  void Sample(absl::string_view name, absl::string_view help, absl::string_view type,
              double value, const MetricLabels& labels);

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
