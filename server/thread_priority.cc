#include "server/thread_priority.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace optimus {
namespace server {

absl::Status LowerThisThreadPriority(int by) {
  if (by <= 0) return absl::OkStatus();
  const id_t tid = static_cast<id_t>(syscall(SYS_gettid));
  errno = 0;
  const int now = getpriority(PRIO_PROCESS, tid);
  if (errno != 0) {
    return absl::InternalError(absl::StrCat("reading this thread's nice value: ", std::strerror(errno)));
  }
  const int want = std::min(19, now + by);
  if (setpriority(PRIO_PROCESS, tid, want) != 0) {
    return absl::InternalError(
        absl::StrCat("setting this thread's nice value to ", want, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace server
}  // namespace optimus
