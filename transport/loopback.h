// The in-process loopback implementation of the transport interface
// (transport/transport.h), for tests and benchmarks that run coordinator,
// shards and workers in one process without UCX. It is a real transport, not
// a mock: each worker has its own progress thread on which its handlers and
// completion callbacks run, payloads above a size threshold go "by
// rendezvous" (the receiver copies them straight from the sender's buffer,
// later, when it calls ReceiveInto), and a destroyed worker is a dead peer
// (Sends to it fail, peers' on_peer_failure runs), so fault tests work
// in-process.
//
// Ownership: workers attach to a LoopbackFabric (shared; one per test or
// cluster) through WorkerOptions::loopback; each worker keeps the fabric's
// registry alive, so the LoopbackFabric handle may go first. Workers of
// different fabrics cannot reach each other.
// Thread-safety: LoopbackFabric's methods are safe from any thread; its
// workers follow the Worker contract of transport.h.
#ifndef OPTIMUS_TRANSPORT_LOOPBACK_H_
#define OPTIMUS_TRANSPORT_LOOPBACK_H_

#include <cstddef>
#include <memory>

#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace optimus {
namespace transport {

namespace loopback_internal {
struct FabricState;
}  // namespace loopback_internal

struct LoopbackOptions {
  // Payloads of more than this many bytes travel by rendezvous:
  // is_rendezvous() is true, ReceiveInto returns at once and copies the
  // payload from the sender's buffer later on the receiver's progress thread,
  // and the sender's Send completes only then. Smaller ones are copied when
  // sent (eager) and ReceiveInto copies them before it returns. Default
  // 8 KiB, the order of UCX's shared-memory threshold, so the same code
  // paths run as over UCX. 0 sends every non-empty payload by rendezvous.
  size_t rendezvous_threshold_bytes = 8 * 1024;
};

class LoopbackFabric {
 public:
  static std::shared_ptr<LoopbackFabric> Create(const LoopbackOptions& options = {});
  explicit LoopbackFabric(const LoopbackOptions& options);
  LoopbackFabric(const LoopbackFabric&) = delete;
  LoopbackFabric& operator=(const LoopbackFabric&) = delete;

  // A new worker on this fabric (what Worker::Create does when
  // options.loopback is set; options.loopback itself is not consulted). Its
  // address() is "loopback:<fabric>:<worker>", unique in the process and
  // never reused. Does not fail today; StatusOr to match Worker::Create.
  absl::StatusOr<std::unique_ptr<Worker>> NewWorker(const WorkerOptions& options);

  // Workers created and not yet destroyed.
  size_t num_workers() const;
  const LoopbackOptions& options() const;

 private:
  std::shared_ptr<loopback_internal::FabricState> state_;
};

}  // namespace transport
}  // namespace optimus

#endif  // OPTIMUS_TRANSPORT_LOOPBACK_H_
