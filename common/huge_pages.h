#ifndef OPTIMUS_COMMON_HUGE_PAGES_H_
#define OPTIMUS_COMMON_HUGE_PAGES_H_

// Anonymous memory for the large buffers transfers read and write: the
// shard's state, published copies and gradient staging, the client's
// staging arenas. Such a buffer is mapped on a 2 MiB boundary and, when
// asked, advised for transparent huge pages (MADV_HUGEPAGE): a 4 KiB-page
// buffer of tens of MiB costs a page-table walk and a pin per 4 KiB on every
// shared-memory transfer (process_vm_readv) and misses the TLB on every
// kernel pass; docs/benchmarks.md has the figures. Where the kernel gives
// no huge pages (transparent_hugepage "never"), the advice is a no-op and
// the memory is ordinary.

#include <cstddef>
#include <string>

namespace optimus {

inline constexpr size_t kHugePageBytes = size_t{2} << 20;

// Maps `bytes` (> 0) of zero-filled anonymous memory starting on a
// kHugePageBytes boundary, advised for huge pages when `huge_pages` and
// `bytes` is at least one huge page.
// Only whole 2 MiB pieces inside the mapping become huge pages, so a size
// that is not a multiple of 2 MiB does not grow the resident set. Returns
// nullptr when the kernel refuses the mapping. Free with UnmapAligned.
void* MapAligned(size_t bytes, bool huge_pages);
void UnmapAligned(void* data, size_t bytes);

// What /sys/kernel/mm/transparent_hugepage/enabled selects: "always",
// "madvise" or "never" ("" when the file is absent).
std::string TransparentHugePageMode();

// Whether the mapping holding `address` may be backed by transparent huge
// pages ("THPeligible: 1" in /proc/self/smaps); false if not found.
bool HugePageEligible(const void* address);

}  // namespace optimus

#endif  // OPTIMUS_COMMON_HUGE_PAGES_H_
