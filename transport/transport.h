// The data plane's transport interface: a Worker sends active messages (a
// small header, copied, plus an optional payload) to peers' Workers, and
// hands messages it receives to per-id handlers. Two implementations:
// transport/ucx.h (UCX, between processes and machines) and
// transport/loopback.h (in one process, for tests and benchmarks).
// Worker::Create picks one from WorkerOptions, so callers never name one.
// Knows nothing of jobs or optimizers.
//
// Ownership: the caller owns a Worker; EndpointRefs, MemoryRegions and
// IncomingMessages belong to the Worker that made them and must not outlive it.
// Thread-safety (every implementation): Create/SetHandler before Start; after
// Start, Connect, Send and RegisterMemory may be called from any thread.
// Handlers and completion callbacks run on the Worker's progress thread and
// must not block.
#ifndef OPTIMUS_TRANSPORT_TRANSPORT_H_
#define OPTIMUS_TRANSPORT_TRANSPORT_H_

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace optimus {
namespace transport {

class LoopbackFabric;  // transport/loopback.h
class MemoryRegion;
class PendingPayload;

// A connected peer. Copyable and cheap; valid until the Worker that made it
// (by Connect, or as a message's reply endpoint) is destroyed, even after the
// peer has failed (Sends on it then fail). Use it only with that Worker.
struct EndpointRef {
  void* ep = nullptr;
  bool valid() const { return ep != nullptr; }
};

// Called on the progress thread when a peer is found dead (see
// WorkerOptions::on_peer_failure).
using PeerFailureCallback = std::function<void(EndpointRef ep, const absl::Status& why)>;

// Highest active-message id a caller may use. UCX carries 16 bits and the
// UCX implementation keeps two ids for its own handshake; every
// implementation refuses ids above this one so that code that runs on one
// runs on all.
inline constexpr uint16_t kMaxAmId = 0xffff - 4;

// `n` unpredictable bytes (the kernel's random source) for a handshake's
// challenge; empty if that source cannot be read (the handshake then
// refuses the peer).
inline std::string RandomChallenge(size_t n) {
  std::string out(n, '\0');
  FILE* f = std::fopen("/dev/urandom", "rb");
  const bool ok = f != nullptr && std::fread(out.data(), 1, n, f) == n;
  if (f != nullptr) std::fclose(f);
  return ok ? out : std::string();
}

// Acceptor side of the handshake: checks a connecting peer's claim (the
// identity it says it is, and its proof over `challenge`, fresh random bytes
// of this worker). OK binds the peer to `identity`; an error is answered to
// the peer (its Connect fails with it). Runs on the progress thread: must
// not block or call into the Worker.
using VerifyPeerCallback = std::function<absl::Status(
    absl::string_view identity, absl::string_view challenge, absl::string_view proof)>;
// Connector side: the identity this worker claims and its proof over a
// peer's challenge. Same thread rules.
using ProveCallback =
    std::function<std::pair<std::string, std::string>(absl::string_view challenge)>;

struct WorkerOptions {
  // ---- Every implementation ----
  // Name used in log lines. Default "worker".
  std::string name = "worker";
  // Report dead peers: a dead peer (a destroyed worker, a killed process, a
  // lost machine) turns into failed Sends, failed receives of its payloads
  // and a call of on_peer_failure, within a few seconds. On UCX this asks
  // for UCP_ERR_HANDLING_MODE_PEER and, unless the environment sets them,
  // turns on UCX's peer-failure support of its shared-memory transports
  // (UCX_MM_ERROR_HANDLING, UCX_CMA_MEMORY_INVALIDATE: the peer's process is
  // checked by pid) and a keepalive round every second
  // (UCX_KEEPALIVE_INTERVAL), so peers on one machine still talk over
  // shared memory (sysv/posix and cma), as fast as without detection; over
  // tcp, where detection leaves UCX only its fragment path, it raises the
  // receive segment (and so the fragment) to 512 KiB (UCX_TCP_RX_SEG_SIZE;
  // UCX's 64 KiB ran pushes 1.3x and pulls 1.5x slower on loopback). A
  // destroyed worker says goodbye to its peers, so one in a process that
  // lives on is reported at once. Limits: a killed peer that stays a zombie
  // (its parent does not reap it) looks alive to the pid check; and UCX
  // 1.13's shared memory does not work between processes that share an IPC
  // namespace but not a pid namespace with its own /proc (containers of one
  // pod without shareProcessNamespace; checked: connecting times out, with
  // or without detection), which UCX then considers on one machine: set
  // UCX_MM_ERROR_HANDLING=n there (UCX then uses tcp between them, as before
  // this was turned on) or leave sm out of UCX_TLS. Off: UCX never reports a
  // dead peer (eager sends to it "succeed", rendezvous ones wait until
  // teardown). Default on.
  bool detect_peer_failure = true;
  // Called on the progress thread when a peer failed (needs
  // detect_peer_failure), once per endpoint, after later Sends on it have
  // started to fail. Lets a caller fail requests still waiting for that
  // peer's reply instead of waiting for a timeout. Must not block or call
  // into the Worker. Default: none.
  PeerFailureCallback on_peer_failure;
  // Runs first on the worker's progress thread, before it handles anything
  // (the shard lowers that thread's priority with it, --step_nice below 0).
  // Default: none.
  std::function<void()> on_progress_start;
  // Peer identity. Set: a peer that connects to this worker must prove who
  // it is before anything it sends is delivered: its hello is answered with
  // a fresh 32-byte challenge, it answers with an identity and a proof, and
  // verify_peer decides. Until then (and for good once refused) its
  // messages are dropped and counted (refused_messages()) and the address
  // it gave is never handed to UCX. Peers this worker connected to itself
  // are trusted, as the identity given to Connect. Delivered messages carry
  // the sender's identity (IncomingMessage::peer_identity()). Unset: every
  // peer is delivered, with an empty identity. Default unset.
  VerifyPeerCallback verify_peer;
  // How this worker answers a peer's challenge when it connects. Unset:
  // it claims the empty identity with no proof. Default unset.
  ProveCallback prove;
  // Most peers learned from hellos (peers that connected to this worker)
  // kept at once. Beyond it the peer silent longest since its hello (it
  // sent nothing else, so no EndpointRef to it exists) is dropped to make
  // room, or, when every one has spoken, the hello is dropped (counted in
  // hellos_refused; that Connect times out). Peers that failed are
  // forgotten whatever the limit. UCX only. Default 65536.
  size_t max_peers = 65536;

  // ---- Which implementation ----
  // Set: Worker::Create makes an in-process loopback worker attached to this
  // fabric (transport/loopback.h); the UCX fields below are ignored. Unset:
  // a UCX worker. Default unset.
  std::shared_ptr<LoopbackFabric> loopback;

  // ---- UCX only (ignored by loopback) ----
  // UCX transports, in UCX_TLS syntax (e.g. "rc,sm,self"). Empty: UCX_TLS
  // from the environment, or UCX's own default ("all": UCX ranks what the
  // machine offers, e.g. shared memory between processes on one machine,
  // RDMA or TCP across machines). Default empty.
  std::string transports;
  // UCX_NET_DEVICES (e.g. "mlx5_0:1", "lo"). Empty: UCX_NET_DEVICES from the
  // environment, or UCX's default ("all"). Tests and the local cluster use
  // "lo" so that nothing leaves the machine. Default empty.
  std::string net_devices;
  // After the last event, the progress thread keeps polling this long
  // before it arms the wake-up fd and sleeps: a message that arrives
  // meanwhile is seen without a wake-up through the kernel (measured in
  // bench/dataplane: tcp push and pull goodput up 5-15% at 4 MiB; a busy
  // worker spins, an idle one sleeps as before). Zero: sleep at once.
  // Default 50 us.
  absl::Duration progress_spin = absl::Microseconds(50);
};

// Called once when an operation finishes, on the progress thread (or, for an
// operation the Worker's destruction cancels, on the destroying thread).
using DoneCallback = std::function<void(absl::Status)>;

class MemoryRegion;    // Below.
class PendingPayload;  // Below.

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
  // identity; the endpoint back is opened on the first Send. Keep it as long
  // as needed (see EndpointRef).
  virtual EndpointRef reply_endpoint() const = 0;
  // Receives the payload into dst (at least payload_size() bytes). Eager
  // payloads are copied and `done` runs before this returns; rendezvous
  // payloads land in dst later, on the progress thread, and `done` runs
  // then (with an error if the sender went away first). dst must stay valid
  // until `done` runs. Call at most once (a second call fails with
  // FAILED_PRECONDITION), from inside the handler; a payload that is never
  // received is dropped when the handler returns and its sender's Send
  // still completes OK.
  virtual void ReceiveInto(void* dst, DoneCallback done) = 0;
  // Same, with `region` (nullable) a registration of this worker
  // (RegisterMemory) covering dst, which saves the transport registering dst
  // for this transfer; it must stay registered until `done` runs. The
  // default ignores it (loopback has nothing to register).
  virtual void ReceiveInto(void* dst, const MemoryRegion* region, DoneCallback done) {
    (void)region;
    ReceiveInto(dst, std::move(done));
  }
  // Instead of ReceiveInto, from inside the handler: keeps the payload to be
  // received later (see PendingPayload), or null when there is none to keep
  // (payload_size() is 0, or ReceiveInto or Keep was called already). A
  // rendezvous payload stays at its sender, whose Send completes only when
  // the PendingPayload is received or destroyed; an eager one is copied
  // aside. Afterwards ReceiveInto on this message fails with
  // FAILED_PRECONDITION.
  virtual std::unique_ptr<PendingPayload> Keep() = 0;
  // Who sent it: the identity it proved at its handshake (see
  // WorkerOptions::verify_peer), or the one given to Connect for a peer this
  // worker connected to; empty when none.
  virtual const std::string& peer_identity() const = 0;
};

using Handler = std::function<void(IncomingMessage& msg)>;

// A payload kept at its sender (or, when it came eagerly, copied aside) by
// IncomingMessage::Keep, to be received later: lets a receiver that has no
// buffer free yet make the sender wait (as rendezvous allows) instead of
// refusing the message. May be handed to and used from any thread.
// Normally received or destroyed before its Worker is destroyed; if the
// Worker goes first, the payload is dropped with it (a later ReceiveInto
// fails with CANCELLED at once, destruction does nothing).
class PendingPayload {
 public:
  // Drops the payload if it was never received (the sender's Send then
  // completes OK, as for a payload the handler did not take).
  virtual ~PendingPayload() = default;
  virtual size_t size() const = 0;
  // Receives the payload into dst (at least size() bytes), from any thread,
  // at most once (a second call fails with FAILED_PRECONDITION, `done` run
  // before it returns). `done` runs on the progress thread when the payload
  // has landed, or with an error: UNAVAILABLE when the sender failed first,
  // CANCELLED when the worker is shutting down. `region`, when not null, is
  // a registration of this worker covering dst (saves the transport
  // registering dst for this transfer; keep it until `done` runs). dst must
  // stay valid until `done` runs.
  virtual void ReceiveInto(void* dst, const MemoryRegion* region, DoneCallback done) = 0;
};

// Keeps a buffer registered (so rendezvous lands in it without a bounce
// buffer) until destroyed. May be destroyed on any thread, the progress
// thread included, and never waits for the progress thread (UCX's
// deregistration may complete just after). Must not outlive its Worker.
class MemoryRegion {
 public:
  virtual ~MemoryRegion() = default;
};

class Worker {
 public:
  // A loopback worker when options.loopback is set, a UCX worker otherwise.
  // Errors: INVALID_ARGUMENT and others for a bad configuration (e.g. an
  // unknown UCX transport), with the implementation's reason.
  static absl::StatusOr<std::unique_ptr<Worker>> Create(const WorkerOptions& options);
  // Stops the progress thread and closes endpoints. Operations still in
  // flight complete with an error (CANCELLED) before it returns; handlers may
  // run until then. Peers see this worker as failed. Takes at most ~2 s even
  // when peers are dead.
  virtual ~Worker() = default;

  // This worker's address, an opaque string to hand to peers (e.g. via the
  // coordinator). Valid from Create on.
  virtual const std::string& address() const = 0;

  // Registers the handler for active message id `am_id` (0..kMaxAmId; higher
  // ids are refused with an error log). Before Start only. A message for an
  // id without a handler is dropped (its sender's Send still completes).
  virtual void SetHandler(uint16_t am_id, Handler handler) = 0;

  // Starts the progress thread. FAILED_PRECONDITION when already started.
  virtual absl::Status Start() = 0;

  // Opens an endpoint to the worker whose address() is peer_address and
  // introduces this worker to it. After Start only (FAILED_PRECONDITION
  // before). INVALID_ARGUMENT for an empty address (and on loopback for one
  // that is malformed or of another fabric; UCX cannot tell a malformed
  // binary address, so pass only addresses a worker reported); UNAVAILABLE
  // (or DEADLINE_EXCEEDED after 10 s on UCX) when the peer is dead or does
  // not answer. Callable from a handler or callback (it does not wait there).
  // Peer failures after this surface as errors on later Sends, never as a
  // crash.
  virtual absl::StatusOr<EndpointRef> Connect(const std::string& peer_address) {
    return Connect(peer_address, std::string());
  }
  // Same, naming who the peer is (e.g. "shard:3", from the coordinator's
  // map): its messages to this worker carry that identity. UNAUTHENTICATED
  // (or the peer's error) when the peer refuses this worker's proof.
  virtual absl::StatusOr<EndpointRef> Connect(const std::string& peer_address,
                                              const std::string& identity) = 0;

  // Messages dropped because their sender had not proved who it is (see
  // WorkerOptions::verify_peer), and handshakes refused. Thread-safe.
  virtual uint64_t refused_messages() const { return 0; }

  // Sends `header` (copied before return) and `payload` (payload_size bytes,
  // may be null when 0) to `ep` as active message `am_id`. The payload must
  // not change until `done` runs. `done` gets OK once the payload is handed
  // over (an eager copy made, or the receiver took it or dropped it); an
  // error when the peer failed (UNAVAILABLE on loopback and for UCX's
  // peer-failure codes, see ucx_status.h); INVALID_ARGUMENT for a null
  // endpoint or another worker's; CANCELLED when this worker is being
  // destroyed.
  virtual void Send(EndpointRef ep, uint16_t am_id, absl::Span<const uint8_t> header,
                    const void* payload, size_t payload_size, DoneCallback done) = 0;
  // Same, with `region` (nullable) a registration of this worker
  // (RegisterMemory) covering the payload: the transport uses it instead of
  // registering the payload for this transfer. It must stay registered
  // until `done` runs. INVALID_ARGUMENT for another worker's region. The
  // default ignores it (loopback has nothing to register).
  virtual void Send(EndpointRef ep, uint16_t am_id, absl::Span<const uint8_t> header,
                    const void* payload, size_t payload_size, const MemoryRegion* region,
                    DoneCallback done) {
    (void)region;
    Send(ep, am_id, header, payload, payload_size, std::move(done));
  }

  // The transports this worker's endpoints use so far, in the order first
  // seen, e.g. "sysv,cma" or "tcp" ("loopback" for the in-process fabric;
  // empty before any endpoint has carried a message). Thread-safe. For logs
  // and status.
  virtual std::string transports_in_use() const { return ""; }

  // Peers this worker knows now (connected to or from, not yet forgotten),
  // and hellos it dropped at max_peers. Thread-safe. For metrics and tests;
  // 0 on loopback.
  virtual size_t peer_count() const { return 0; }
  virtual uint64_t hellos_refused() const { return 0; }

  // Registers [data, data + size_bytes) for rendezvous. Thread-safe. A no-op
  // region on loopback.
  virtual absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(
      void* data, size_t size_bytes) = 0;
};

}  // namespace transport
}  // namespace optimus

#endif  // OPTIMUS_TRANSPORT_TRANSPORT_H_
