#include "common/cpu_count.h"

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace optimus {
namespace {

std::optional<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

std::optional<int> Cores(int64_t quota, int64_t period) {
  if (quota <= 0 || period <= 0) return std::nullopt;
  return static_cast<int>(std::max<int64_t>(1, (quota + period - 1) / period));
}

// "/a/b/c" -> "/a/b/c", "/a/b", "/a", "" (the root): where a quota may be set.
std::vector<std::string> SelfAndParents(absl::string_view path) {
  std::vector<std::string> out;
  std::string p(absl::StripTrailingAsciiWhitespace(path));
  while (!p.empty() && p != "/") {
    out.push_back(p);
    const size_t slash = p.rfind('/');
    p = slash == std::string::npos ? "" : p.substr(0, slash);
  }
  out.push_back("");
  return out;
}

std::optional<int> Min(std::optional<int> a, std::optional<int> b) {
  if (!a) return b;
  if (!b) return a;
  return std::min(*a, *b);
}

}  // namespace

std::optional<int> QuotaCoresV2(const std::string& cpu_max) {
  std::vector<absl::string_view> f =
      absl::StrSplit(absl::StripAsciiWhitespace(cpu_max), ' ', absl::SkipEmpty());
  if (f.empty() || f[0] == "max") return std::nullopt;
  int64_t quota = 0, period = 100000;  // The period is optional; 100 ms by default.
  if (!absl::SimpleAtoi(f[0], &quota)) return std::nullopt;
  if (f.size() > 1 && !absl::SimpleAtoi(f[1], &period)) return std::nullopt;
  return Cores(quota, period);
}

std::optional<int> QuotaCoresV1(const std::string& quota_us, const std::string& period_us) {
  int64_t quota = 0, period = 0;
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(quota_us), &quota) ||
      !absl::SimpleAtoi(absl::StripAsciiWhitespace(period_us), &period)) {
    return std::nullopt;
  }
  return Cores(quota, period);
}

std::optional<int> CgroupQuotaCores(const std::string& cgroup_root,
                                    const std::string& proc_self_cgroup) {
  std::optional<int> cores;
  for (absl::string_view line : absl::StrSplit(proc_self_cgroup, '\n', absl::SkipEmpty())) {
    // hierarchy-id:controllers:path
    std::vector<absl::string_view> f = absl::StrSplit(line, absl::MaxSplits(':', 2));
    if (f.size() != 3) continue;
    if (f[0] == "0" && f[1].empty()) {  // cgroup v2 (unified).
      for (const std::string& dir : SelfAndParents(f[2])) {
        // A hybrid machine mounts the unified hierarchy at <root>/unified.
        for (const char* mount : {"", "/unified"}) {
          if (auto text = ReadFile(cgroup_root + mount + dir + "/cpu.max")) {
            cores = Min(cores, QuotaCoresV2(*text));
          }
        }
      }
      continue;
    }
    bool cpu = false;
    for (absl::string_view c : absl::StrSplit(f[1], ',')) cpu = cpu || c == "cpu";
    if (!cpu) continue;
    for (const std::string& dir : SelfAndParents(f[2])) {
      // v1 mounts the cpu controller as "cpu" or "cpu,cpuacct".
      for (const char* mount : {"/cpu", "/cpu,cpuacct"}) {
        const std::string base = cgroup_root + mount + dir;
        auto quota = ReadFile(base + "/cpu.cfs_quota_us");
        auto period = ReadFile(base + "/cpu.cfs_period_us");
        if (quota && period) cores = Min(cores, QuotaCoresV1(*quota, *period));
      }
    }
  }
  return cores;
}

int AffinityCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

int UsableCores() {
  int cores = AffinityCores();
  if (auto self = ReadFile("/proc/self/cgroup")) {
    if (auto quota = CgroupQuotaCores("/sys/fs/cgroup", *self)) cores = std::min(cores, *quota);
  }
  return std::max(1, cores);
}

}  // namespace optimus
