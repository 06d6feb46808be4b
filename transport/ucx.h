// The UCX implementation of the transport interface (transport/transport.h):
// one Worker owns a UCX context and worker, a progress thread, and the
// endpoints it opened. Messages are UCX active messages: a small header
// (copied) and an optional payload that UCX sends eagerly or, above its
// rendezvous threshold (~20 KB on tcp, ~8 KB on sysv/posix), by rendezvous
// straight into the receiver's buffer. Every message's UCX header carries the
// sender's instance id, so a receiver answers on an endpoint it owns (UCX
// 1.13 frees its own reply endpoints when a peer fails). Dead peers are
// found by UCX (keepalive, with shared memory's peer-failure support turned
// on; see WorkerOptions::detect_peer_failure) and by goodbyes: a worker
// being destroyed tells its peers. Each endpoint's transports are logged
// once it has carried a message (transports_in_use()). Sends take their op
// from a free list and copy small headers inline: no allocation per Send.
//
// Ownership and thread-safety: as for every transport::Worker (see
// transport.h). Worker::Create(options) builds one when options.loopback is
// unset; callers normally go through it rather than NewUcxWorker.
#ifndef OPTIMUS_TRANSPORT_UCX_H_
#define OPTIMUS_TRANSPORT_UCX_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "transport/transport.h"

namespace optimus {
namespace transport {

// Creates a UCX worker with options.transports / net_devices, or, where
// empty, UCX_TLS / UCX_NET_DEVICES from the environment or UCX's defaults
// (the loopback field is ignored); logs which, and where it came from.
// Errors from UCX's configuration and initialization, converted by FromUcs
// (ucx_status.h) and naming the transports and devices.
absl::StatusOr<std::unique_ptr<Worker>> NewUcxWorker(const WorkerOptions& options);

// The UCX settings a worker with detect_peer_failure applies for a UCX_TLS
// value `tls` ("all" when empty), as environment assignments
// ("UCX_KEEPALIVE_INTERVAL=1s", ...), whether or not the environment
// already sets them. With these and UCP_ERR_HANDLING_MODE_PEER another UCX
// program runs on the transports an optimus worker runs on (bench/dataplane
// gives them to ucx_perftest -e).
std::vector<std::string> UcxDetectionEnvironment(absl::string_view tls);

}  // namespace transport
}  // namespace optimus

#endif  // OPTIMUS_TRANSPORT_UCX_H_
