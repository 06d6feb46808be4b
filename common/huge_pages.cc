#include "common/huge_pages.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace optimus {
namespace {

size_t PageBytes() {
  static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return page;
}

size_t RoundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

}  // namespace

void* MapAligned(size_t bytes, bool huge_pages) {
  if (bytes == 0) return nullptr;
  const size_t length = RoundUp(bytes, PageBytes());
  // Over-map by one huge page, then give back the unaligned head and the
  // tail beyond the length.
  const size_t span = length + kHugePageBytes;
  void* m = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return nullptr;
  const uintptr_t start = reinterpret_cast<uintptr_t>(m);
  const uintptr_t aligned = RoundUp(start, kHugePageBytes);
  if (aligned > start) munmap(m, aligned - start);
  const uintptr_t end = start + span;
  if (end > aligned + length) munmap(reinterpret_cast<void*>(aligned + length), end - aligned - length);
  void* p = reinterpret_cast<void*>(aligned);
  // EINVAL where the kernel has no transparent huge pages: ordinary pages.
  // Below one huge page there is nothing to advise.
  if (huge_pages && length >= kHugePageBytes) (void)madvise(p, length, MADV_HUGEPAGE);
  return p;
}

void UnmapAligned(void* data, size_t bytes) {
  if (data == nullptr || bytes == 0) return;
  munmap(data, RoundUp(bytes, PageBytes()));
}

std::string TransparentHugePageMode() {
  std::ifstream in("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(in, line)) return "";
  // "always [madvise] never": the bracketed word is the mode.
  const size_t open = line.find('[');
  const size_t close = line.find(']', open);
  if (open == std::string::npos || close == std::string::npos) return "";
  return line.substr(open + 1, close - open - 1);
}

bool HugePageEligible(const void* address) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(address);
  std::ifstream in("/proc/self/smaps");
  std::string line;
  bool inside = false;
  while (std::getline(in, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%" SCNxPTR "-%" SCNxPTR " ", &lo, &hi) == 2) {  // A mapping.
      inside = a >= lo && a < hi;
      continue;
    }
    if (inside && line.rfind("THPeligible:", 0) == 0) {
      std::istringstream fields(line.substr(12));
      int eligible = 0;
      fields >> eligible;
      return eligible == 1;
    }
  }
  return false;
}

}  // namespace optimus
