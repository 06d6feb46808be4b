// Worker::Create (declared in transport.h): the one place that knows every
// implementation. It lives in //transport:transport, apart from the
// interface (//transport:interface), so that the implementations depend on
// the interface and this file on them, without a cycle.
#include "transport/transport.h"

#include "transport/loopback.h"
#include "transport/ucx.h"

namespace optimus {
namespace transport {

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(const WorkerOptions& options) {
  if (options.loopback != nullptr) return options.loopback->NewWorker(options);
  return NewUcxWorker(options);
}

}  // namespace transport
}  // namespace optimus
