// The data plane's UCX layer: one Worker owns a UCX context and worker, a
// progress thread, and the endpoints it opened. Messages are UCX active
// messages: a small header (copied) and an optional payload that UCX sends
// eagerly or, above its rendezvous threshold, by rendezvous straight into the
// receiver's buffer. Knows nothing of jobs or optimizers.
//
// Thread-safety: Create/SetHandler before Start; after Start, Connect, Send
// and RegisterMemory may be called from any thread. Handlers and completion
// callbacks run on the progress thread and must not block.
#ifndef OPTIMUS_TRANSPORT_UCX_H_
#define OPTIMUS_TRANSPORT_UCX_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace optimus {
namespace transport {

// A connected peer. Copyable and cheap; valid until the Worker that made it
// (by Connect, or as a message's reply endpoint) is destroyed, even after the
// peer has failed (Sends on it then fail). Use it only with that Worker.
struct EndpointRef {
  void* ep = nullptr;
  bool valid() const { return ep != nullptr; }
};

struct WorkerOptions {
  // UCX transports, in UCX_TLS syntax. Default: TCP, shared memory and self,
  // which is what a single machine's loopback offers.
  std::string transports = "tcp,sm,self";
  // UCX_NET_DEVICES; "all" lets UCX choose. Tests and the local cluster use
  // "lo" so that nothing leaves the machine.
  std::string net_devices = "all";
  // Ask UCX to detect failed peers (UCP_ERR_HANDLING_MODE_PEER), so a dead
  // peer turns into failed sends rather than undefined behaviour. UCX 1.13's
  // shared-memory transports (posix, sysv) cannot detect peer failure, so with
  // this on, messages between processes on one machine go over tcp (cma may
  // still copy rendezvous payloads). Turn it off to carry messages over
  // shared memory when the peers' lifetimes are tied together. Default on.
  bool detect_peer_failure = true;
  // Name used in log lines.
  std::string name = "worker";
  // Called on the progress thread when UCX reports a peer failed (needs
  // detect_peer_failure), once per endpoint, after later Sends on it have
  // started to fail. Lets a caller fail requests still waiting for that
  // peer's reply instead of waiting for a timeout. Must not block or call
  // into the Worker. Default: none.
  std::function<void(EndpointRef ep, const absl::Status& why)> on_peer_failure;
};


// Called once when an operation finishes, on the progress thread.
using DoneCallback = std::function<void(absl::Status)>;

// One received active message, valid only during the handler call.
class IncomingMessage {
 public:
  virtual ~IncomingMessage() = default;
  virtual uint16_t am_id() const = 0;
  virtual absl::Span<const uint8_t> header() const = 0;
  virtual size_t payload_size() const = 0;
  // True when the payload has not arrived yet and will be pulled by
  // rendezvous when ReceiveInto is called.
  virtual bool is_rendezvous() const = 0;
  // Endpoint to answer the sender on. Every message carries its sender's
  // identity, learned when the sender Connected; the endpoint back is opened
  // on the first Send. Keep it as long as needed (see EndpointRef).
  virtual EndpointRef reply_endpoint() const = 0;
  // Receives the payload into dst (at least payload_size() bytes). Eager
  // payloads are copied and `done` runs before this returns; rendezvous
  // payloads land in dst later and `done` runs then. dst must stay valid
  // until `done` runs. Call at most once, from inside the handler; a payload
  // that is never received is dropped when the handler returns.
  virtual void ReceiveInto(void* dst, DoneCallback done) = 0;
};

using Handler = std::function<void(IncomingMessage& msg)>;

// Keeps a buffer registered with UCX (so rendezvous lands in it without a
// bounce buffer) until destroyed. Must not outlive its Worker.
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
};

class Worker {
 public:
  static absl::StatusOr<std::unique_ptr<Worker>> Create(const WorkerOptions& options);
  // Stops the progress thread and closes endpoints. Operations still in flight
  // complete with an error (Cancelled) before it returns; handlers may run
  // until then. Takes at most ~2 s even when peers are dead.
  virtual ~Worker() = default;

  // This worker's UCX address, to hand to peers (e.g. via the coordinator).
  virtual const std::string& address() const = 0;

  // Registers the handler for active message id `am_id` (0..65533; the two
  // highest ids are reserved and refused with an error log). Before Start only.
  virtual void SetHandler(uint16_t am_id, Handler handler) = 0;

  // Starts the progress thread.
  virtual absl::Status Start() = 0;

  // Opens an endpoint to the worker whose address() is peer_address and
  // introduces this worker to it (one round trip; Unavailable or
  // DeadlineExceeded after 10 s when the peer does not answer). After Start
  // only. Called from a handler or callback it cannot wait and returns at
  // once. Peer failures surface as errors on later Sends, never as a crash.
  virtual absl::StatusOr<EndpointRef> Connect(const std::string& peer_address) = 0;

  // Sends `header` (copied before return) and `payload` (payload_size bytes,
  // may be null when 0) to `ep` as active message `am_id`. The payload must
  // not change until `done` runs. Thread-safe.
  virtual void Send(EndpointRef ep, uint16_t am_id, absl::Span<const uint8_t> header,
                    const void* payload, size_t payload_size, DoneCallback done) = 0;

  // Registers [data, data + size_bytes) with UCX. Thread-safe; the
  // registration runs on the progress thread once started.
  virtual absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(
      void* data, size_t size_bytes) = 0;
};

}  // namespace transport
}  // namespace optimus

#endif  // OPTIMUS_TRANSPORT_UCX_H_
