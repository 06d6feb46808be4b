#ifndef OPTIMUS_COMMON_CPU_COUNT_H_
#define OPTIMUS_COMMON_CPU_COUNT_H_

// How many cores this process may use: what sizes a shard's step and
// kernel thread pools and what it registers as its cores. The machine's
// core count (std::thread::hardware_concurrency) is wrong in the two places
// a shard runs in production: a Kubernetes pod with a CPU limit (a cgroup
// quota: 16 CPUs of a 64-core host) and a process pinned to some CPUs
// (taskset, a cpuset). There, one thread per machine core time-slices the
// allowed cores and a chunk split across them waits for its slowest part,
// or for the quota's next period.

#include <optional>
#include <string>

namespace optimus {

// The cores this process may use: the CPUs in the calling thread's affinity
// mask, capped by the CPU quota of its cgroup (v2 cpu.max or v1
// cpu.cfs_quota_us, over the cgroup and its parents), rounded up. At least 1.
int UsableCores();

// The CPUs in the calling thread's affinity mask (threads inherit it from
// their creator); hardware_concurrency where the mask cannot be read.
int AffinityCores();

// A CPU quota in cores (quota / period, rounded up, at least 1) as cgroup
// files spell it, or nullopt for no limit or unreadable text:
//   v2 cpu.max:  "max 100000" or "400000 100000"
//   v1:          cpu.cfs_quota_us "-1" or "400000", cpu.cfs_period_us "100000"
std::optional<int> QuotaCoresV2(const std::string& cpu_max);
std::optional<int> QuotaCoresV1(const std::string& quota_us, const std::string& period_us);

// The tightest quota over the cgroup this process is in and its parents,
// read below `cgroup_root` (normally /sys/fs/cgroup) for the membership in
// `proc_self_cgroup` (the text of /proc/self/cgroup); nullopt for none.
std::optional<int> CgroupQuotaCores(const std::string& cgroup_root,
                                    const std::string& proc_self_cgroup);

}  // namespace optimus

#endif  // OPTIMUS_COMMON_CPU_COUNT_H_
