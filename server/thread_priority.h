#ifndef OPTIMUS_SERVER_THREAD_PRIORITY_H_
#define OPTIMUS_SERVER_THREAD_PRIORITY_H_

#include "absl/status/status.h"

namespace optimus {
namespace server {

// Makes the calling thread `by` (> 0) nicer than it is, at most nice 19.
// On Linux nice applies to one thread, and a new thread starts at its
// creator's value. An error (with the value asked for) if the kernel refuses.
absl::Status LowerThisThreadPriority(int by);

}  // namespace server
}  // namespace optimus

#endif  // OPTIMUS_SERVER_THREAD_PRIORITY_H_
