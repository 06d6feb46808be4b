#include "transport/loopback.h"

#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "common/logging.h"

namespace optimus {
namespace transport {

namespace {

constexpr char kLog[] = "loopback";
constexpr absl::string_view kAddressPrefix = "loopback:";

// Fabric ids are unique in the process, so an address from another fabric
// (e.g. a test's leftover) is refused rather than reaching a stranger.
std::atomic<uint64_t> next_fabric_id{1};

class LoopbackWorker;

// A unit of work for a worker's progress thread. `cancelled` is true when it
// runs during the worker's destruction instead: it must then fail (or
// finish) whatever it stands for without delivering anything.
using Task = std::function<void(bool cancelled)>;

// A worker's mailbox: what peers and the fabric hold of it. Outlives the
// worker (peers keep it through their endpoints); once closed, Post fails,
// which is how a destroyed worker looks to its peers.
struct Core;

// The sender's half of one rendezvous payload, shared with the receiver.
// The receiver copies straight from the sender's buffer; whoever finishes
// it first (the receiver's copy or drop, or the sender's destruction)
// decides the status the sender's `done` gets, which runs on the sender's
// progress thread (or on its destroying thread). The sender's buffer is
// never read after that.
struct RendezvousSend {
  RendezvousSend(const void* src, size_t size, DoneCallback done, std::shared_ptr<Core> sender)
      : size(size), sender(std::move(sender)), src_(static_cast<const uint8_t*>(src)),
        done_(std::move(done)) {}

  // Copies the payload into dst (receiver's progress thread). UNAVAILABLE
  // when the sender was destroyed first.
  absl::Status CopyTo(void* dst) {
    absl::MutexLock lock(&mu_);
    if (finished_) {
      return absl::UnavailableError(
          "receive: the sending loopback worker was destroyed before the payload was received");
    }
    if (size > 0) std::memcpy(dst, src_, size);
    return absl::OkStatus();
  }

  // Runs the sender's done(s) unless already finished. On the sender's
  // progress thread, or on its destroying thread.
  void Finish(const absl::Status& s);

  const size_t size;
  const std::shared_ptr<Core> sender;

 private:
  absl::Mutex mu_;
  const uint8_t* src_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  DoneCallback done_ ABSL_GUARDED_BY(mu_);
};

struct Core {
  Core(uint64_t id, std::string address, std::string name, LoopbackWorker* worker,
       VerifyPeerCallback verify)
      : id(id),
        address(std::move(address)),
        name(std::move(name)),
        worker(worker),
        verify(std::move(verify)) {}

  // The identity this worker knows the worker `peer_id` as (proved to it,
  // or given to its own Connect); nullopt when none.
  std::optional<std::string> IdentityOf(uint64_t peer_id) {
    absl::MutexLock lock(&mu);
    auto it = identities.find(peer_id);
    if (it == identities.end()) return std::nullopt;
    return it->second;
  }
  void Trust(uint64_t peer_id, const std::string& identity) {
    absl::MutexLock lock(&mu);
    identities[peer_id] = identity;
  }

  // Queues t for the worker's progress thread. False when the worker is
  // being or has been destroyed (t is dropped, not run).
  bool Post(Task t) {
    absl::MutexLock lock(&mu);
    if (closed) return false;
    queue.push_back(std::move(t));
    return true;
  }

  bool IsClosed() {
    absl::MutexLock lock(&mu);
    return closed;
  }

  bool HasWorkOrClosed() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return closed || !queue.empty();
  }

  const uint64_t id;
  const std::string address;
  const std::string name;
  // Valid while a task can run: tasks run only on the worker's progress
  // thread or in its destructor.
  LoopbackWorker* const worker;
  // WorkerOptions::verify_peer (may be empty).
  const VerifyPeerCallback verify;
  std::atomic<uint64_t> refused{0};

  absl::Mutex mu;
  std::map<uint64_t, std::string> identities ABSL_GUARDED_BY(mu);
  std::deque<Task> queue ABSL_GUARDED_BY(mu);
  bool closed ABSL_GUARDED_BY(mu) = false;
  // This worker's rendezvous sends not finished yet (cancelled when it is
  // destroyed).
  std::map<RendezvousSend*, std::shared_ptr<RendezvousSend>> inflight ABSL_GUARDED_BY(mu);
  // Peers' rendezvous payloads this worker keeps (IncomingMessage::Keep),
  // dropped when it is destroyed.
  std::map<RendezvousSend*, std::shared_ptr<RendezvousSend>> kept ABSL_GUARDED_BY(mu);
};

void RendezvousSend::Finish(const absl::Status& s) {
  DoneCallback done;
  {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    finished_ = true;
    src_ = nullptr;
    done = std::move(done_);
  }
  {
    absl::MutexLock lock(&sender->mu);
    sender->inflight.erase(this);
  }
  if (done) done(s);
}

// Has the sender's progress thread finish `op` with `s` (any thread). When
// the sender is being destroyed the Post fails: its destruction finishes
// every op still in its inflight map, so this one too (with CANCELLED).
void FinishOnSender(const std::shared_ptr<RendezvousSend>& op, const absl::Status& s) {
  (void)op->sender->Post([op, s](bool) { op->Finish(s); });
}

// One message on its way: everything the receiver needs, owned by the task.
struct Message {
  uint16_t am_id = 0;
  std::string header;
  size_t payload_size = 0;
  std::string eager;                     // The payload, when sent eagerly.
  std::shared_ptr<RendezvousSend> rndv;  // Set when sent by rendezvous.
  std::shared_ptr<Core> sender;
};

}  // namespace

namespace loopback_internal {

// The registry of one fabric's live workers, by worker id.
struct FabricState {
  FabricState(uint64_t id, const LoopbackOptions& options) : id(id), options(options) {}

  const uint64_t id;
  const LoopbackOptions options;

  absl::Mutex mu;
  uint64_t next_worker ABSL_GUARDED_BY(mu) = 1;
  std::map<uint64_t, std::shared_ptr<Core>> live ABSL_GUARDED_BY(mu);
};

}  // namespace loopback_internal

namespace {

using loopback_internal::FabricState;

// An endpoint of one worker to one peer. Owned by the worker until it is
// destroyed, so EndpointRefs (which point here) stay valid after the peer
// died.
struct Peer {
  Peer(LoopbackWorker* owner, std::shared_ptr<Core> remote)
      : owner(owner), remote(std::move(remote)) {}
  LoopbackWorker* const owner;
  const std::shared_ptr<Core> remote;

  absl::Mutex mu;
  absl::Status failure ABSL_GUARDED_BY(mu);  // Not OK once the peer is known dead.
};

class LoopbackRegion : public MemoryRegion {};

// IncomingMessage::Keep's result: the sender's half of a rendezvous (the
// sender's Send completes when this is received or destroyed), or the bytes
// of an eager payload.
class LoopbackPendingPayload : public PendingPayload {
 public:
  LoopbackPendingPayload(std::shared_ptr<Core> receiver, std::shared_ptr<RendezvousSend> rndv,
                         std::string eager, size_t size)
      : receiver_(std::move(receiver)),
        rndv_(std::move(rndv)),
        eager_(std::move(eager)),
        size_(size) {
    if (rndv_ == nullptr) return;
    absl::MutexLock lock(&receiver_->mu);
    receiver_->kept.emplace(rndv_.get(), rndv_);
  }

  ~LoopbackPendingPayload() override {
    // Dropped: the sender completes OK, as for a payload the handler ignored.
    if (!taken_.load() && rndv_ != nullptr) {
      Forget();
      FinishOnSender(rndv_, absl::OkStatus());
    }
  }

  size_t size() const override { return size_; }

  void ReceiveInto(void* dst, const MemoryRegion* /*region*/, DoneCallback done) override {
    if (taken_.exchange(true)) {
      done(absl::FailedPreconditionError("payload already received"));
      return;
    }
    if (rndv_ != nullptr) Forget();
    if (dst == nullptr && size_ > 0) {
      if (rndv_ != nullptr) FinishOnSender(rndv_, absl::OkStatus());  // Dropped.
      done(absl::InvalidArgumentError("receive into a null buffer"));
      return;
    }
    if (rndv_ == nullptr) std::memcpy(dst, eager_.data(), eager_.size());
    // The payload "arrives" on the receiver's progress thread.
    std::shared_ptr<RendezvousSend> rndv = rndv_;
    auto shared_done = std::make_shared<DoneCallback>(std::move(done));
    const bool posted = receiver_->Post([rndv, dst, shared_done](bool cancelled) {
      if (cancelled) {
        if (rndv != nullptr) {
          FinishOnSender(rndv, absl::UnavailableError(
              "send: the receiving loopback worker was destroyed before taking the payload"));
        }
        (*shared_done)(absl::CancelledError("receive: the loopback worker was destroyed first"));
        return;
      }
      absl::Status s;
      if (rndv != nullptr) {
        s = rndv->CopyTo(dst);
        if (s.ok()) FinishOnSender(rndv, absl::OkStatus());
      }
      (*shared_done)(s);
    });
    if (!posted) {  // The receiving worker is being or has been destroyed.
      if (rndv != nullptr) {
        FinishOnSender(rndv, absl::UnavailableError(
            "send: the receiving loopback worker was destroyed before taking the payload"));
      }
      (*shared_done)(absl::CancelledError("receive: the loopback worker was destroyed first"));
    }
  }

 private:
  void Forget() {
    absl::MutexLock lock(&receiver_->mu);
    receiver_->kept.erase(rndv_.get());
  }

  const std::shared_ptr<Core> receiver_;
  const std::shared_ptr<RendezvousSend> rndv_;  // Null for an eager payload.
  const std::string eager_;
  const size_t size_;
  std::atomic<bool> taken_{false};
};

class LoopbackMessage : public IncomingMessage {
 public:
  LoopbackMessage(std::shared_ptr<Core> receiver, const Message& m, Peer* back,
                  std::string identity)
      : receiver_(std::move(receiver)), m_(m), back_(back), identity_(std::move(identity)) {}
  const std::string& peer_identity() const override { return identity_; }

  uint16_t am_id() const override { return m_.am_id; }
  absl::Span<const uint8_t> header() const override {
    return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(m_.header.data()),
                                     m_.header.size());
  }
  size_t payload_size() const override { return m_.payload_size; }
  bool is_rendezvous() const override { return m_.rndv != nullptr; }
  EndpointRef reply_endpoint() const override { return EndpointRef{back_}; }

  void ReceiveInto(void* dst, DoneCallback done) override {
    if (received_) {
      done(absl::FailedPreconditionError("payload already received"));
      return;
    }
    received_ = true;
    if (dst == nullptr && m_.payload_size > 0) {
      if (m_.rndv != nullptr) FinishOnSender(m_.rndv, absl::OkStatus());  // Dropped.
      done(absl::InvalidArgumentError("receive into a null buffer"));
      return;
    }
    if (m_.rndv == nullptr) {
      if (!m_.eager.empty()) std::memcpy(dst, m_.eager.data(), m_.eager.size());
      done(absl::OkStatus());
      return;
    }
    // Rendezvous: the payload "arrives" later, on this progress thread.
    std::shared_ptr<RendezvousSend> rndv = m_.rndv;
    auto shared_done = std::make_shared<DoneCallback>(std::move(done));
    const bool posted = receiver_->Post([rndv, dst, shared_done](bool cancelled) {
      if (cancelled) {
        FinishOnSender(rndv, absl::UnavailableError(
            "send: the receiving loopback worker was destroyed before taking the payload"));
        (*shared_done)(
            absl::CancelledError("rendezvous receive: the loopback worker was destroyed first"));
        return;
      }
      absl::Status s = rndv->CopyTo(dst);
      if (s.ok()) FinishOnSender(rndv, absl::OkStatus());
      (*shared_done)(s);
    });
    if (!posted) {  // This worker is being destroyed.
      FinishOnSender(rndv, absl::UnavailableError(
          "send: the receiving loopback worker was destroyed before taking the payload"));
      (*shared_done)(
          absl::CancelledError("rendezvous receive: the loopback worker was destroyed first"));
    }
  }

  std::unique_ptr<PendingPayload> Keep() override {
    if (received_ || m_.payload_size == 0) return nullptr;
    received_ = true;
    return std::make_unique<LoopbackPendingPayload>(receiver_, m_.rndv, m_.eager,
                                                    m_.payload_size);
  }

  bool received() const { return received_; }

 private:
  std::shared_ptr<Core> receiver_;
  const Message& m_;
  Peer* back_;
  const std::string identity_;
  bool received_ = false;
};

class LoopbackWorker : public Worker {
 public:
  LoopbackWorker(std::shared_ptr<FabricState> fabric, uint64_t id, const WorkerOptions& options)
      : fabric_(std::move(fabric)),
        options_(options),
        core_(std::make_shared<Core>(id, absl::StrCat(kAddressPrefix, fabric_->id, ":", id),
                                     options.name, this, options.verify_peer)) {
    options_.loopback.reset();  // Workers keep the registry, not the handle.
  }

  ~LoopbackWorker() override {
    // 1. Unreachable: Connect to this address fails from now on.
    {
      absl::MutexLock lock(&fabric_->mu);
      fabric_->live.erase(core_->id);
    }
    // 2. Closed: peers' Sends to it fail, the progress thread stops after
    // the task it is running.
    {
      absl::MutexLock lock(&core_->mu);
      core_->closed = true;
    }
    if (progress_.joinable()) progress_.join();
    // 3. What was queued is cancelled: undelivered messages fail their
    // senders, pending receives fail; finished sends report their status.
    std::deque<Task> left;
    {
      absl::MutexLock lock(&core_->mu);
      left.swap(core_->queue);
    }
    for (Task& t : left) t(/*cancelled=*/true);
    // 4. Own rendezvous sends no receiver has taken yet.
    std::map<RendezvousSend*, std::shared_ptr<RendezvousSend>> inflight;
    {
      absl::MutexLock lock(&core_->mu);
      inflight.swap(core_->inflight);
    }
    for (const auto& [raw, op] : inflight) {
      op->Finish(absl::CancelledError("send: the loopback worker was destroyed first"));
    }
    // 4b. Peers' payloads it kept are dropped (their senders complete OK,
    // as for a payload dropped on purpose; later receives fail).
    std::map<RendezvousSend*, std::shared_ptr<RendezvousSend>> kept;
    {
      absl::MutexLock lock(&core_->mu);
      kept.swap(core_->kept);
    }
    for (const auto& [raw, op] : kept) FinishOnSender(op, absl::OkStatus());
    // 5. Peers learn that this worker died, as UCX's peer-failure detection
    // would tell them.
    std::vector<std::shared_ptr<Core>> others;
    {
      absl::MutexLock lock(&fabric_->mu);
      for (const auto& [id, core] : fabric_->live) others.push_back(core);
    }
    const uint64_t dead = core_->id;
    const absl::Status why = absl::UnavailableError(
        absl::StrCat("peer loopback worker ", core_->address, " (", core_->name,
                     ") was destroyed"));
    for (const auto& other : others) {
      LoopbackWorker* w = other->worker;
      (void)other->Post([w, dead, why](bool cancelled) {
        if (!cancelled) w->OnPeerDied(dead, why);
      });
    }
  }

  const std::string& address() const override { return core_->address; }
  const std::shared_ptr<Core>& core() const { return core_; }
  std::string transports_in_use() const override {
    return used_.load() ? "loopback" : "";
  }

  void SetHandler(uint16_t am_id, Handler handler) override {
    if (am_id > kMaxAmId) {
      OPTIMUS_LOG(Error, kLog, options_.name, ": active message id ", am_id,
                  " is reserved (ids above ", kMaxAmId, " are not available); ignored");
      return;
    }
    if (started_.load()) {
      OPTIMUS_LOG(Error, kLog, options_.name, ": SetHandler(", am_id,
                  ") after Start is not allowed; ignored");
      return;
    }
    handlers_[am_id] = std::move(handler);
  }

  absl::Status Start() override {
    if (started_.exchange(true)) return absl::FailedPreconditionError("worker already started");
    progress_ = std::thread([this] {
      if (options_.on_progress_start) options_.on_progress_start();
      ProgressLoop();
    });
    return absl::OkStatus();
  }

  uint64_t refused_messages() const override { return core_->refused.load(); }

  using Worker::Connect;
  absl::StatusOr<EndpointRef> Connect(const std::string& peer_address,
                                      const std::string& identity) override {
    if (!started_.load()) return absl::FailedPreconditionError("Connect before Start");
    if (peer_address.empty()) return absl::InvalidArgumentError("empty peer address");
    uint64_t fabric_id = 0, worker_id = 0;
    if (!ParseAddress(peer_address, &fabric_id, &worker_id)) {
      return absl::InvalidArgumentError(
          absl::StrCat("not a loopback address: '", absl::CHexEscape(peer_address.substr(0, 64)),
                       "' (a loopback worker reaches only loopback:<fabric>:<worker>)"));
    }
    if (fabric_id != fabric_->id) {
      return absl::InvalidArgumentError(absl::StrCat(
          "address ", peer_address, " belongs to another loopback fabric (this one is ",
          fabric_->id, ")"));
    }
    if (core_->IsClosed()) {
      return absl::CancelledError("connect: the loopback worker is shutting down");
    }
    std::shared_ptr<Core> remote;
    {
      absl::MutexLock lock(&fabric_->mu);
      auto it = fabric_->live.find(worker_id);
      if (it != fabric_->live.end()) remote = it->second;
    }
    if (remote == nullptr || remote->IsClosed()) {
      return absl::UnavailableError(absl::StrCat("connecting to peer: no live loopback worker at ",
                                                 peer_address, " (destroyed, or never created)"));
    }
    core_->Trust(remote->id, identity);
    if (remote->verify) {
      // The handshake, done here at once: the peer's challenge, our proof,
      // its verdict.
      const std::string challenge = RandomChallenge(32);
      std::pair<std::string, std::string> claim;
      if (options_.prove) claim = options_.prove(challenge);
      absl::Status verdict = challenge.empty()
                                 ? absl::UnavailableError("no randomness for a challenge")
                                 : remote->verify(claim.first, challenge, claim.second);
      if (!verdict.ok()) {
        remote->refused.fetch_add(1);
        return absl::Status(verdict.code(),
                            absl::StrCat("the peer refused this worker: ", verdict.message()));
      }
      remote->Trust(core_->id, claim.first);
    }
    return EndpointRef{AddPeer(std::move(remote))};
  }

  void Send(EndpointRef ep, uint16_t am_id, absl::Span<const uint8_t> header,
            const void* payload, size_t payload_size, DoneCallback done) override {
    if (core_->IsClosed()) {
      // The worker is being destroyed (e.g. a completion retries): no
      // progress thread is left to run `done` later.
      if (done) done(absl::CancelledError("send: the loopback worker is shutting down"));
      return;
    }
    auto* peer = static_cast<Peer*>(ep.ep);
    absl::Status bad;
    if (peer == nullptr) {
      bad = absl::InvalidArgumentError("send on a null endpoint");
    } else if (peer->owner != this) {
      bad = absl::InvalidArgumentError("send on another worker's endpoint");
    } else if (am_id > kMaxAmId) {
      bad = absl::InvalidArgumentError(absl::StrCat("send: active message id ", am_id,
                                                    " is reserved"));
    } else if (payload == nullptr && payload_size > 0) {
      bad = absl::InvalidArgumentError(
          absl::StrCat("send: null payload of ", payload_size, " bytes"));
    } else {
      absl::MutexLock lock(&peer->mu);
      if (!peer->failure.ok()) {
        bad = absl::Status(peer->failure.code(), absl::StrCat("send: ", peer->failure.message()));
      }
    }
    if (!bad.ok()) return CompleteLater(std::move(done), bad);

    auto msg = std::make_shared<Message>();
    msg->am_id = am_id;
    msg->header.assign(reinterpret_cast<const char*>(header.data()), header.size());
    msg->payload_size = payload_size;
    msg->sender = core_;
    if (payload_size > fabric_->options.rendezvous_threshold_bytes) {
      msg->rndv = std::make_shared<RendezvousSend>(payload, payload_size, std::move(done), core_);
      absl::MutexLock lock(&core_->mu);
      core_->inflight.emplace(msg->rndv.get(), msg->rndv);
    } else if (payload_size > 0) {
      msg->eager.assign(static_cast<const char*>(payload), payload_size);
    }
    used_.store(true);
    const std::shared_ptr<Core>& remote = peer->remote;
    LoopbackWorker* receiver = remote->worker;
    const bool posted = remote->Post([receiver, msg](bool cancelled) {
      receiver->Deliver(*msg, cancelled);
    });
    const absl::Status result =
        posted ? absl::OkStatus()
               : absl::UnavailableError(absl::StrCat("send: peer loopback worker ",
                                                     remote->address, " (", remote->name,
                                                     ") was destroyed"));
    if (msg->rndv != nullptr) {
      if (!posted) FinishOnSender(msg->rndv, result);
      return;  // Otherwise the receiver finishes it.
    }
    CompleteLater(std::move(done), result);
  }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(void* data,
                                                                size_t size_bytes) override {
    if (data == nullptr && size_bytes > 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("registering ", size_bytes, " bytes at a null address"));
    }
    // Nothing to pin: a loopback payload is a memcpy between buffers of one
    // process.
    return std::unique_ptr<MemoryRegion>(new LoopbackRegion());
  }

  // A message arrived (progress thread), or is dropped (destruction).
  void Deliver(const Message& m, bool cancelled) {
    if (cancelled) {
      if (m.rndv != nullptr) {
        FinishOnSender(m.rndv, absl::UnavailableError(absl::StrCat(
            "send: peer loopback worker ", core_->address, " (", core_->name,
            ") was destroyed before the message was delivered")));
      }
      return;
    }
    used_.store(true);
    std::optional<std::string> identity = core_->IdentityOf(m.sender->id);
    if (core_->verify && !identity.has_value()) {
      // The sender never proved who it is: dropped.
      core_->refused.fetch_add(1);
      if (m.rndv != nullptr) FinishOnSender(m.rndv, absl::OkStatus());
      return;
    }
    Peer* back = PeerFor(m.sender);
    LoopbackMessage msg(core_, m, back, identity.value_or(std::string()));
    auto it = handlers_.find(m.am_id);
    if (it == handlers_.end()) {
      OPTIMUS_LOG(Warning, kLog, options_.name, ": dropped active message ", m.am_id,
                  " (no handler)");
    } else {
      it->second(msg);
    }
    // A rendezvous payload the handler did not take is dropped; its sender
    // completes successfully, as over UCX.
    if (m.rndv != nullptr && !msg.received()) FinishOnSender(m.rndv, absl::OkStatus());
  }

  // Progress thread: a peer was destroyed.
  void OnPeerDied(uint64_t dead, const absl::Status& why) {
    std::vector<Peer*> hit;
    {
      absl::MutexLock lock(&mu_);
      for (const auto& p : peers_) {
        if (p->remote->id == dead) hit.push_back(p.get());
      }
    }
    for (Peer* p : hit) {
      {
        absl::MutexLock lock(&p->mu);
        if (!p->failure.ok()) continue;
        p->failure = why;
      }
      OPTIMUS_LOG(Warning, kLog, options_.name, ": peer endpoint failed: ", why.message());
      if (options_.detect_peer_failure && options_.on_peer_failure) {
        options_.on_peer_failure(EndpointRef{p}, why);
      }
    }
  }

 private:
  static bool ParseAddress(absl::string_view address, uint64_t* fabric_id, uint64_t* worker_id) {
    if (!absl::ConsumePrefix(&address, kAddressPrefix)) return false;
    std::vector<absl::string_view> parts = absl::StrSplit(address, ':');
    return parts.size() == 2 && absl::SimpleAtoi(parts[0], fabric_id) &&
           absl::SimpleAtoi(parts[1], worker_id);
  }

  Peer* AddPeer(std::shared_ptr<Core> remote) {
    absl::MutexLock lock(&mu_);
    peers_.push_back(std::make_unique<Peer>(this, remote));
    Peer* p = peers_.back().get();
    by_core_.emplace(remote->id, p);  // Replies use the first endpoint.
    return p;
  }

  // The endpoint back to a message's sender (progress thread).
  Peer* PeerFor(const std::shared_ptr<Core>& sender) {
    {
      absl::MutexLock lock(&mu_);
      auto it = by_core_.find(sender->id);
      if (it != by_core_.end()) return it->second;
    }
    Peer* p = AddPeer(sender);
    if (sender->IsClosed()) {
      // Died before its message was handled: replies fail (no callback,
      // the death was announced before this endpoint existed).
      absl::MutexLock lock(&p->mu);
      p->failure = absl::UnavailableError(absl::StrCat(
          "peer loopback worker ", sender->address, " (", sender->name, ") was destroyed"));
    }
    return p;
  }

  // Runs done(s) on the progress thread.
  void CompleteLater(DoneCallback done, const absl::Status& s) {
    if (!done) return;
    auto shared_done = std::make_shared<DoneCallback>(std::move(done));
    if (!core_->Post([shared_done, s](bool) { (*shared_done)(s); })) {
      (*shared_done)(absl::CancelledError("send: the loopback worker is shutting down"));
    }
  }

  void ProgressLoop() {
    for (;;) {
      Task t;
      {
        absl::MutexLock lock(&core_->mu);
        core_->mu.Await(absl::Condition(core_.get(), &Core::HasWorkOrClosed));
        if (core_->closed) return;  // The destructor cancels what is left.
        t = std::move(core_->queue.front());
        core_->queue.pop_front();
      }
      t(/*cancelled=*/false);
    }
  }

  const std::shared_ptr<FabricState> fabric_;
  WorkerOptions options_;
  const std::shared_ptr<Core> core_;
  std::map<uint16_t, Handler> handlers_;  // Fixed once started_.
  std::atomic<bool> started_{false};
  std::atomic<bool> used_{false};  // Some message was sent (transports_in_use).
  std::thread progress_;

  absl::Mutex mu_;
  std::vector<std::unique_ptr<Peer>> peers_ ABSL_GUARDED_BY(mu_);
  std::map<uint64_t, Peer*> by_core_ ABSL_GUARDED_BY(mu_);  // Way back to a sender, by its id.
};

}  // namespace

std::shared_ptr<LoopbackFabric> LoopbackFabric::Create(const LoopbackOptions& options) {
  return std::make_shared<LoopbackFabric>(options);
}

LoopbackFabric::LoopbackFabric(const LoopbackOptions& options)
    : state_(std::make_shared<FabricState>(next_fabric_id.fetch_add(1), options)) {}

absl::StatusOr<std::unique_ptr<Worker>> LoopbackFabric::NewWorker(const WorkerOptions& options) {
  uint64_t id;
  {
    absl::MutexLock lock(&state_->mu);
    id = state_->next_worker++;
  }
  auto w = std::make_unique<LoopbackWorker>(state_, id, options);
  // Reachable from now on, like a UCX worker's address; messages wait in
  // its queue until Start.
  absl::MutexLock lock(&state_->mu);
  state_->live.emplace(id, w->core());
  return std::unique_ptr<Worker>(std::move(w));
}

size_t LoopbackFabric::num_workers() const {
  absl::MutexLock lock(&state_->mu);
  return state_->live.size();
}

const LoopbackOptions& LoopbackFabric::options() const { return state_->options; }

}  // namespace transport
}  // namespace optimus
