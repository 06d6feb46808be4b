#include "transport/ucx.h"

#include <poll.h>
#include <ucp/api/ucp.h>

#include <cstring>
#include <deque>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "transport/ucx_status.h"

namespace optimus {
namespace transport {
namespace {

constexpr char kLog[] = "ucx";

// Safety net for the progress thread's sleep: a missed wake-up costs at most
// this much latency, and an idle worker wakes this often (negligible CPU).
// Wake-up through the efd was checked to work with tcp, sysv, posix, cma and
// self, so in practice the sleep ends on events, not on this timeout.
constexpr int kIdlePollTimeoutMs = 100;
// Used only when UCX offers no wake-up fd (a transport without event
// support): then the loop naps this long between polls. Costs latency, but
// keeps an idle worker far from a busy loop.
constexpr absl::Duration kNoWakeupNap = absl::Milliseconds(1);
// How long teardown waits for endpoint closes and cancelled requests.
constexpr absl::Duration kTeardownBudget = absl::Seconds(2);
// How long Connect waits for the peer's answer to the hello. A live peer
// answers within a round trip; an unreachable one fails sooner on tcp.
constexpr absl::Duration kConnectTimeout = absl::Seconds(10);

// UCX active-message ids: two internal ones, then the users' ids shifted up.
constexpr uint32_t kHelloAmId = 0;
constexpr uint32_t kHelloAckAmId = 1;
constexpr uint32_t kFirstUserAmId = 2;
constexpr uint32_t kMaxUserAmId = 0xffff - kFirstUserAmId;  // UCX carries 16 bits.
static_assert(kMaxUserAmId == kMaxAmId, "transport.h promises callers ids up to kMaxAmId");

// Every message's UCX header starts with the sender's instance id (8 bytes,
// host byte order; all our machines are little-endian). The receiver uses it
// to find its own endpoint back to the sender. Hello and hello-ack add a
// 64-bit connect token after it.
constexpr size_t kPrefixBytes = sizeof(uint64_t);

uint64_t LoadU64(const void* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

void AppendU64(std::string* s, uint64_t v) {
  s->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

uint64_t RandomInstanceId() {
  std::random_device rd;
  uint64_t v = (uint64_t{rd()} << 32) ^ rd();
  v ^= static_cast<uint64_t>(absl::GetCurrentTimeNanos());
  return v == 0 ? 1 : v;
}

class UcxWorker;

// A peer as seen by one worker: either opened by Connect (outgoing) or
// learned from a peer's hello (incoming; its endpoint is opened on the first
// reply). Owned by the worker until it is destroyed, so EndpointRefs (which
// point here) stay valid even after UCX has dropped the connection. We do not
// hand out UCX's param->reply_ep: UCX 1.13 destroys such endpoints by itself
// when the peer fails, so a reply sent later would use freed memory.
// Progress thread only.
struct Peer {
  UcxWorker* owner = nullptr;
  std::string address;  // Incoming peers: where to open the endpoint.
  ucp_ep_h ep = nullptr;
  absl::Status failure;  // Not OK once the endpoint has failed or closed.
};

// One operation in flight (send or rendezvous receive).
struct Op {
  UcxWorker* worker = nullptr;
  std::string header;  // Sends: prefix + user header, kept until completion.
  DoneCallback done;
  const char* what = "send";
  void* request = nullptr;
};

struct HandlerEntry {
  UcxWorker* worker = nullptr;
  uint32_t ucx_id = 0;
  uint16_t user_id = 0;
  Handler handler;
};

// Lets MemoryRegions find their worker, or learn that it is gone.
struct Core {
  absl::Mutex mu;
  UcxWorker* worker ABSL_GUARDED_BY(mu) = nullptr;
};

class UcxMemoryRegion : public MemoryRegion {
 public:
  UcxMemoryRegion(std::shared_ptr<Core> core, ucp_mem_h memh)
      : core_(std::move(core)), memh_(memh) {}
  ~UcxMemoryRegion() override;

 private:
  std::shared_ptr<Core> core_;
  ucp_mem_h memh_;
};

class UcxMessage : public IncomingMessage {
 public:
  UcxMessage(UcxWorker* worker, uint16_t am_id, absl::Span<const uint8_t> header, void* data,
             size_t length, const ucp_am_recv_param_t* param, Peer* sender)
      : worker_(worker),
        am_id_(am_id),
        header_(header),
        data_(data),
        length_(length),
        param_(param),
        sender_(sender) {}

  uint16_t am_id() const override { return am_id_; }
  absl::Span<const uint8_t> header() const override { return header_; }
  size_t payload_size() const override { return length_; }
  bool is_rendezvous() const override {
    return (param_->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  }
  EndpointRef reply_endpoint() const override { return EndpointRef{sender_}; }
  void ReceiveInto(void* dst, DoneCallback done) override;

 private:
  UcxWorker* worker_;
  uint16_t am_id_;
  absl::Span<const uint8_t> header_;
  void* data_;
  size_t length_;
  const ucp_am_recv_param_t* param_;
  Peer* sender_;
  bool received_ = false;
};

class UcxWorker : public Worker {
 public:
  explicit UcxWorker(const WorkerOptions& options)
      : options_(options), instance_(RandomInstanceId()), core_(std::make_shared<Core>()) {}

  ~UcxWorker() override {
    {
      // Waits for a MemoryRegion being destroyed on another thread; later
      // ones find no worker (their memory is unmapped below).
      absl::MutexLock lock(&core_->mu);
      core_->worker = nullptr;
    }
    if (progress_.joinable()) {
      {
        absl::MutexLock lock(&mu_);
        stop_ = true;
      }
      ucp_worker_signal(worker_);
      progress_.join();
    } else if (worker_ != nullptr) {
      Teardown();
    }
    if (context_ != nullptr) ucp_cleanup(context_);
  }

  absl::Status Init() {
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return FromUcs(st, "reading UCX configuration");
    st = ucp_config_modify(config, "TLS", options_.transports.c_str());
    if (st == UCS_OK) st = ucp_config_modify(config, "NET_DEVICES", options_.net_devices.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return FromUcs(st, absl::StrCat("setting UCX transports '", options_.transports,
                                      "' devices '", options_.net_devices, "'"));
    }
    ucp_params_t params;
    std::memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;  // One worker, one thread: no locks in UCX.
    st = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    if (st != UCS_OK) {
      context_ = nullptr;
      return FromUcs(st, absl::StrCat("initializing UCX with transports '", options_.transports,
                                      "' devices '", options_.net_devices, "'"));
    }
    ucp_worker_params_t wp;
    std::memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // Only the progress thread uses it.
    st = ucp_worker_create(context_, &wp, &worker_);
    if (st != UCS_OK) {
      worker_ = nullptr;
      return FromUcs(st, "creating UCX worker");
    }
    ucp_address_t* addr = nullptr;
    size_t addr_len = 0;
    st = ucp_worker_get_address(worker_, &addr, &addr_len);
    if (st != UCS_OK) return FromUcs(st, "getting UCX worker address");
    address_.assign(reinterpret_cast<const char*>(addr), addr_len);
    ucp_worker_release_address(worker_, addr);
    st = ucp_worker_get_efd(worker_, &efd_);
    if (st != UCS_OK) {
      efd_ = -1;
      OPTIMUS_LOG(Warning, kLog, options_.name, ": no UCX wake-up fd (", ucs_status_string(st),
                  "); the progress thread will poll every ",
                  absl::FormatDuration(kNoWakeupNap));
    }
    for (uint32_t id : {kHelloAmId, kHelloAckAmId}) {
      auto entry = std::make_unique<HandlerEntry>();
      entry->worker = this;
      entry->ucx_id = id;
      if (auto s = SetUcxHandler(entry.get()); !s.ok()) return s;
      internal_handlers_.push_back(std::move(entry));
    }
    {
      absl::MutexLock lock(&core_->mu);
      core_->worker = this;
    }
    return absl::OkStatus();
  }

  const std::string& address() const override { return address_; }

  void SetHandler(uint16_t am_id, Handler handler) override {
    if (am_id > kMaxUserAmId) {
      OPTIMUS_LOG(Error, kLog, options_.name, ": active message id ", am_id,
                  " is reserved (ids above ", kMaxUserAmId, " are not available); ignored");
      return;
    }
    auto entry = std::make_unique<HandlerEntry>();
    entry->worker = this;
    entry->ucx_id = am_id + kFirstUserAmId;
    entry->user_id = am_id;
    entry->handler = std::move(handler);
    handlers_[am_id] = std::move(entry);
  }

  absl::Status Start() override {
    if (progress_.joinable()) return absl::FailedPreconditionError("worker already started");
    for (auto& [id, entry] : handlers_) {
      if (auto s = SetUcxHandler(entry.get()); !s.ok()) return s;
    }
    started_ = true;
    progress_ = std::thread([this] { ProgressLoop(); });
    return absl::OkStatus();
  }

  absl::StatusOr<EndpointRef> Connect(const std::string& peer_address) override {
    if (peer_address.empty()) return absl::InvalidArgumentError("empty peer address");
    if (!started_) return absl::FailedPreconditionError("Connect before Start");
    auto pending = std::make_shared<PendingConnect>();
    Peer* peer = nullptr;
    RunOnProgress([&] { peer = StartConnect(peer_address, pending); });
    if (OnProgressThread()) {
      // Cannot wait for the hello's answer here. The hello is the first
      // message on the endpoint, so the peer learns who we are before any
      // later message from us; failures surface on later Sends.
      absl::MutexLock lock(&pending->mu);
      if (pending->done && !pending->status.ok()) return pending->status;
      return EndpointRef{peer};
    }
    absl::Status result;
    {
      absl::MutexLock lock(&pending->mu);
      pending->mu.AwaitWithTimeout(absl::Condition(&pending->done), kConnectTimeout);
      result = pending->done ? pending->status
                             : absl::DeadlineExceededError(absl::StrCat(
                                   "connecting to peer: no answer within ",
                                   absl::FormatDuration(kConnectTimeout)));
    }
    if (!result.ok()) {
      RunOnProgress([&] {
        FinishConnect(pending, result);
        FailPeer(peer, result);
      });
      return result;
    }
    return EndpointRef{peer};
  }

  void Send(EndpointRef ep, uint16_t am_id, absl::Span<const uint8_t> header,
            const void* payload, size_t payload_size, DoneCallback done) override {
    auto* op = new Op;
    op->worker = this;
    op->header.reserve(kPrefixBytes + header.size());
    AppendU64(&op->header, instance_);
    op->header.append(reinterpret_cast<const char*>(header.data()), header.size());
    op->done = std::move(done);
    auto* peer = static_cast<Peer*>(ep.ep);
    Post([this, peer, am_id, payload, payload_size, op] {
      DoSend(peer, am_id, payload, payload_size, op);
    });
  }

  absl::StatusOr<std::unique_ptr<MemoryRegion>> RegisterMemory(void* data,
                                                                size_t size_bytes) override {
    ucp_mem_map_params_t p;
    std::memset(&p, 0, sizeof(p));
    p.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    p.address = data;
    p.length = size_bytes;
    ucp_mem_h memh = nullptr;
    ucs_status_t st = UCS_OK;
    RunOnProgress([&] {
      st = ucp_mem_map(context_, &p, &memh);
      if (st == UCS_OK) regions_.insert(memh);
    });
    if (st != UCS_OK) return FromUcs(st, absl::StrCat("registering ", size_bytes, " bytes"));
    return std::unique_ptr<MemoryRegion>(new UcxMemoryRegion(core_, memh));
  }

  // Called by a MemoryRegion whose worker is still alive (its destructor
  // holds core_->mu). Off the progress thread the unmap is posted, not
  // waited for: a region may be destroyed on a thread that the progress
  // thread is waiting on, or while the progress thread itself destroys
  // another region (waiting here, holding core_->mu, deadlocked them).
  // Every posted task runs (by the loop, or in Teardown, which also unmaps
  // whatever is left), so none is lost.
  void Unmap(ucp_mem_h memh) {
    auto unmap = [this, memh] {
      if (regions_.erase(memh) > 0) ucp_mem_unmap(context_, memh);
    };
    if (!progress_.joinable() || OnProgressThread()) {
      unmap();
    } else {
      Post(unmap);
    }
  }

  // Starts a rendezvous receive for UcxMessage (progress thread).
  void ReceiveRendezvous(void* data_desc, void* dst, size_t length, DoneCallback done) {
    auto* op = new Op;
    op->worker = this;
    op->done = std::move(done);
    op->what = "rendezvous receive";
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = &UcxWorker::OnRecvDone;
    p.user_data = op;
    Track(op, ucp_am_recv_data_nbx(worker_, data_desc, dst, length, &p));
  }

 private:
  // State of one Connect: done once the peer answered the hello or failed.
  struct PendingConnect {
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;
    absl::Status status ABSL_GUARDED_BY(mu);
    Peer* peer = nullptr;  // Progress thread only.
  };

  bool OnProgressThread() const { return std::this_thread::get_id() == progress_id_; }

  absl::Status SetUcxHandler(HandlerEntry* entry) {
    ucp_am_handler_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                   UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
    p.id = entry->ucx_id;
    p.flags = UCP_AM_FLAG_WHOLE_MSG;
    p.cb = &UcxWorker::OnAm;
    p.arg = entry;
    ucs_status_t st = ucp_worker_set_am_recv_handler(worker_, &p);
    return FromUcs(st, absl::StrCat("registering active message handler ", entry->ucx_id));
  }

  Peer* NewPeer() {
    peers_.push_back(std::make_unique<Peer>());
    Peer* peer = peers_.back().get();
    peer->owner = this;
    return peer;
  }

  // Opens peer->ep to peer->address (progress thread).
  absl::Status OpenEndpoint(Peer* peer) {
    ucp_ep_params_t p;
    std::memset(&p, 0, sizeof(p));
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = reinterpret_cast<const ucp_address_t*>(peer->address.data());
    p.err_mode =
        options_.detect_peer_failure ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    p.err_handler.cb = &UcxWorker::OnEpError;
    p.err_handler.arg = peer;
    ucs_status_t st = ucp_ep_create(worker_, &p, &peer->ep);
    if (st != UCS_OK) {
      peer->ep = nullptr;
      peer->failure = FromUcs(st, "connecting to peer");
    }
    return peer->failure;
  }

  // Progress thread: opens an endpoint and sends the hello.
  Peer* StartConnect(const std::string& peer_address, std::shared_ptr<PendingConnect> pending) {
    Peer* peer = NewPeer();
    peer->address = peer_address;
    pending->peer = peer;
    if (absl::Status s = OpenEndpoint(peer); !s.ok()) {
      FinishConnect(pending, s);
      return peer;
    }
    const uint64_t token = next_token_++;
    pending_connects_[token] = pending;
    auto* op = new Op;
    op->worker = this;
    op->what = "hello";
    AppendU64(&op->header, instance_);
    AppendU64(&op->header, token);
    op->done = [this, pending](absl::Status s) {
      if (!s.ok()) FinishConnect(pending, s);
    };
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    // REPLY: the peer answers on UCX's reply endpoint, inside its handler
    // (the only time that endpoint is safe to use). EAGER: the handler needs
    // the address at once.
    p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    p.cb.send = &UcxWorker::OnSendDone;
    p.user_data = op;
    Track(op, ucp_am_send_nbx(peer->ep, kHelloAmId, op->header.data(), op->header.size(),
                              address_.data(), address_.size(), &p));
    return peer;
  }

  void FinishConnect(const std::shared_ptr<PendingConnect>& pending, const absl::Status& s) {
    for (auto it = pending_connects_.begin(); it != pending_connects_.end(); ++it) {
      if (it->second == pending) {
        pending_connects_.erase(it);
        break;
      }
    }
    absl::MutexLock lock(&pending->mu);
    if (pending->done) return;
    pending->done = true;
    pending->status = s;
  }

  void DoSend(Peer* peer, uint16_t am_id, const void* payload, size_t payload_size, Op* op) {
    if (closed_) return Complete(op, absl::CancelledError("send: the UCX worker is shutting down"));
    if (peer == nullptr) return Complete(op, absl::InvalidArgumentError("send on a null endpoint"));
    if (peer->owner != this) {
      return Complete(op, absl::InvalidArgumentError("send on another worker's endpoint"));
    }
    if (am_id > kMaxUserAmId) {
      return Complete(op, absl::InvalidArgumentError(
                              absl::StrCat("send: active message id ", am_id, " is reserved")));
    }
    if (payload == nullptr && payload_size > 0) {
      return Complete(op, absl::InvalidArgumentError(
                              absl::StrCat("send: null payload of ", payload_size, " bytes")));
    }
    if (peer->ep == nullptr && peer->failure.ok()) (void)OpenEndpoint(peer);
    if (!peer->failure.ok()) {
      return Complete(op, absl::Status(peer->failure.code(),
                                       absl::StrCat("send: ", peer->failure.message())));
    }
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    // Eager or rendezvous is UCX's choice by size; no REPLY flag: the
    // receiver finds its way back through our instance id (see Peer).
    p.cb.send = &UcxWorker::OnSendDone;
    p.user_data = op;
    Track(op, ucp_am_send_nbx(peer->ep, am_id + kFirstUserAmId, op->header.data(),
                              op->header.size(), payload, payload_size, &p));
  }

  // Takes over a request returned by a ucp_*_nbx call for op.
  void Track(Op* op, ucs_status_ptr_t st) {
    if (st == nullptr) {
      Complete(op, absl::OkStatus());
    } else if (UCS_PTR_IS_ERR(st)) {
      Complete(op, FromUcs(UCS_PTR_STATUS(st), op->what));
    } else {
      op->request = st;
      inflight_.insert(op);
    }
  }

  static void Complete(Op* op, absl::Status s) {
    if (op->done) op->done(std::move(s));
    delete op;
  }

  static void OnSendDone(void* request, ucs_status_t status, void* user) {
    auto* op = static_cast<Op*>(user);
    op->worker->inflight_.erase(op);
    ucp_request_free(request);
    Complete(op, FromUcs(status, op->what));
  }

  static void OnRecvDone(void* request, ucs_status_t status, size_t /*length*/, void* user) {
    auto* op = static_cast<Op*>(user);
    op->worker->inflight_.erase(op);
    ucp_request_free(request);
    Complete(op, FromUcs(status, op->what));
  }

  static void OnCloseDone(void* request, ucs_status_t /*status*/, void* user) {
    auto* self = static_cast<UcxWorker*>(user);
    --self->closing_;
    ucp_request_free(request);
  }

  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param) {
    auto* entry = static_cast<HandlerEntry*>(arg);
    UcxWorker* self = entry->worker;
    if (header_length < kPrefixBytes) {
      OPTIMUS_LOG(Warning, kLog, self->options_.name, ": dropped active message ", entry->ucx_id,
                  " without a sender id");
      return UCS_OK;
    }
    const uint64_t sender = LoadU64(header);
    const auto* rest = static_cast<const uint8_t*>(header) + kPrefixBytes;
    const size_t rest_length = header_length - kPrefixBytes;
    if (entry->ucx_id == kHelloAmId) {
      self->OnHello(sender, rest, rest_length, data, length, param);
      return UCS_OK;
    }
    if (entry->ucx_id == kHelloAckAmId) {
      self->OnHelloAck(sender, rest, rest_length);
      return UCS_OK;
    }
    auto it = self->by_instance_.find(sender);
    UcxMessage msg(self, entry->user_id, absl::Span<const uint8_t>(rest, rest_length), data,
                   length, param, it == self->by_instance_.end() ? nullptr : it->second);
    entry->handler(msg);
    // A rendezvous payload the handler did not receive is dropped here:
    // returning UCS_OK (we never keep data) lets UCX acknowledge the sender,
    // whose request then completes successfully.
    return UCS_OK;
  }

  // A peer connected to us: remember where it lives, answer on UCX's reply
  // endpoint while it is still guaranteed to exist.
  void OnHello(uint64_t sender, const uint8_t* rest, size_t rest_length, const void* data,
               size_t length, const ucp_am_recv_param_t* param) {
    if (rest_length < sizeof(uint64_t) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
        !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) || length == 0) {
      OPTIMUS_LOG(Warning, kLog, options_.name, ": dropped a malformed hello");
      return;
    }
    const uint64_t token = LoadU64(rest);
    if (by_instance_.find(sender) == by_instance_.end()) {
      Peer* peer = NewPeer();
      peer->address.assign(static_cast<const char*>(data), length);
      by_instance_[sender] = peer;
    }
    auto* op = new Op;
    op->worker = this;
    op->what = "hello answer";
    AppendU64(&op->header, instance_);
    AppendU64(&op->header, token);
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &UcxWorker::OnSendDone;
    p.user_data = op;
    Track(op, ucp_am_send_nbx(param->reply_ep, kHelloAckAmId, op->header.data(),
                              op->header.size(), nullptr, 0, &p));
  }

  void OnHelloAck(uint64_t sender, const uint8_t* rest, size_t rest_length) {
    if (rest_length < sizeof(uint64_t)) return;
    auto it = pending_connects_.find(LoadU64(rest));
    if (it == pending_connects_.end()) return;  // Timed out meanwhile.
    std::shared_ptr<PendingConnect> pending = it->second;
    // Messages from this peer are answered on the endpoint we opened.
    by_instance_.emplace(sender, pending->peer);
    FinishConnect(pending, absl::OkStatus());
  }

  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* peer = static_cast<Peer*>(arg);
    UcxWorker* self = peer->owner;
    OPTIMUS_LOG(Warning, kLog, self->options_.name, ": peer endpoint failed: ",
                ucs_status_string(status));
    if (peer->ep != ep) return;
    const absl::Status s = FromUcs(status, "peer endpoint failed");
    for (const auto& entry : self->pending_connects_) {
      if (entry.second->peer == peer) {
        std::shared_ptr<PendingConnect> pending = entry.second;  // Outlives the erase.
        self->FinishConnect(pending, s);
        break;
      }
    }
    // Closing from inside UCX's callback is not allowed; do it right after.
    self->Post([self, peer, s] { self->FailPeer(peer, s); });
  }

  // Marks the peer failed and closes its endpoint; later Sends fail at once.
  void FailPeer(Peer* peer, const absl::Status& s) {
    const bool first = peer->failure.ok();
    if (first) peer->failure = s;
    CloseEndpoint(peer);
    if (first && options_.on_peer_failure) options_.on_peer_failure(EndpointRef{peer}, s);
  }

  void CloseEndpoint(Peer* peer) {
    if (peer->ep == nullptr) return;
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    // FORCE: do not wait for a peer that may be dead; its pending requests
    // complete with an error.
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    p.cb.send = &UcxWorker::OnCloseDone;
    p.user_data = this;
    ucs_status_ptr_t st = ucp_ep_close_nbx(peer->ep, &p);
    if (st != nullptr && !UCS_PTR_IS_ERR(st)) ++closing_;
    peer->ep = nullptr;
    if (peer->failure.ok()) peer->failure = absl::UnavailableError("endpoint closed");
  }

  void Post(std::function<void()> fn) {
    {
      absl::MutexLock lock(&mu_);
      if (!worker_gone_) {
        posted_.push_back(std::move(fn));
        ucp_worker_signal(worker_);
        return;
      }
    }
    // After teardown (e.g. a done callback that retries a Send): the closure
    // finds the worker closed and fails without touching UCX.
    fn();
  }

  // Runs fn on the progress thread and waits for it (inline when already
  // there, or before Start when no progress thread exists).
  void RunOnProgress(const std::function<void()>& fn) {
    if (!progress_.joinable() || OnProgressThread()) {
      fn();
      return;
    }
    absl::Notification done;
    Post([&] {
      fn();
      done.Notify();
    });
    done.WaitForNotification();
  }

  bool RunPosted() {
    std::deque<std::function<void()>> batch;
    bool stop;
    {
      absl::MutexLock lock(&mu_);
      batch.swap(posted_);
      stop = stop_;
    }
    for (auto& fn : batch) fn();
    return stop;
  }

  void ProgressLoop() {
    progress_id_ = std::this_thread::get_id();
    for (;;) {
      while (ucp_worker_progress(worker_) != 0) {
      }
      if (RunPosted()) break;
      if (efd_ < 0) {
        absl::SleepFor(kNoWakeupNap);
        continue;
      }
      const ucs_status_t st = ucp_worker_arm(worker_);
      if (st == UCS_ERR_BUSY) continue;  // Events arrived meanwhile.
      {
        absl::MutexLock lock(&mu_);
        if (!posted_.empty() || stop_) continue;
      }
      struct pollfd pfd = {efd_, POLLIN, 0};
      poll(&pfd, 1, kIdlePollTimeoutMs);
    }
    Teardown();
  }

  // On the progress thread (or in the destructor when it never started):
  // fail what is posted, close endpoints (which completes what is in flight
  // with an error), destroy the worker.
  void Teardown() {
    closed_ = true;
    RunPosted();  // Sends posted before the stop fail with Cancelled.
    for (const auto& [token, pending] : pending_connects_) {
      absl::MutexLock lock(&pending->mu);
      pending->done = true;
      pending->status = absl::CancelledError("connect: the UCX worker is shutting down");
    }
    pending_connects_.clear();
    for (Op* op : std::set<Op*>(inflight_)) ucp_request_cancel(worker_, op->request);
    for (auto& peer : peers_) CloseEndpoint(peer.get());
    const absl::Time give_up = absl::Now() + kTeardownBudget;
    while ((!inflight_.empty() || closing_ > 0) && absl::Now() < give_up) {
      ucp_worker_progress(worker_);
      RunPosted();
    }
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    RunPosted();  // Anything posted during teardown fails now.
    {
      absl::MutexLock lock(&mu_);
      worker_gone_ = true;
    }
    RunPosted();  // Posted between the two locks.
    for (ucp_mem_h m : regions_) ucp_mem_unmap(context_, m);
    regions_.clear();
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
    // Requests UCX never completed (it gave up within the budget): their
    // memory went with the worker; tell their owners.
    std::set<Op*> left;
    left.swap(inflight_);
    for (Op* op : left) {
      Complete(op, absl::CancelledError(
                       absl::StrCat(op->what, ": the UCX worker was destroyed first")));
    }
    if (!left.empty() || closing_ > 0) {
      OPTIMUS_LOG(Warning, kLog, options_.name, ": teardown gave up on ", left.size(),
                  " requests and ", closing_, " endpoint closes after ",
                  absl::FormatDuration(kTeardownBudget));
    }
  }

  const WorkerOptions options_;
  const uint64_t instance_;  // Identifies this worker in our message headers.
  std::shared_ptr<Core> core_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::string address_;
  std::vector<std::unique_ptr<HandlerEntry>> internal_handlers_;
  std::map<uint16_t, std::unique_ptr<HandlerEntry>> handlers_;  // Fixed after Start.
  bool started_ = false;                                        // Set by Start.
  std::thread progress_;
  std::thread::id progress_id_;

  absl::Mutex mu_;
  std::deque<std::function<void()>> posted_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool worker_gone_ ABSL_GUARDED_BY(mu_) = false;  // Set just before ucp_worker_destroy.

  // Progress thread only (or the destructor's thread once it has joined).
  std::vector<std::unique_ptr<Peer>> peers_;
  std::map<uint64_t, Peer*> by_instance_;  // Sender instance id -> way back.
  std::map<uint64_t, std::shared_ptr<PendingConnect>> pending_connects_;  // By token.
  uint64_t next_token_ = 1;
  std::set<Op*> inflight_;
  std::set<ucp_mem_h> regions_;
  int closing_ = 0;  // Endpoint closes not yet completed.
  bool closed_ = false;
};

UcxMemoryRegion::~UcxMemoryRegion() {
  absl::MutexLock lock(&core_->mu);
  // A destroyed worker has unmapped everything already.
  if (core_->worker != nullptr) core_->worker->Unmap(memh_);
}

void UcxMessage::ReceiveInto(void* dst, DoneCallback done) {
  if (received_) {
    done(absl::FailedPreconditionError("payload already received"));
    return;
  }
  received_ = true;
  if (!is_rendezvous()) {
    if (length_ > 0) std::memcpy(dst, data_, length_);
    done(absl::OkStatus());
    return;
  }
  worker_->ReceiveRendezvous(data_, dst, length_, std::move(done));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Worker>> NewUcxWorker(const WorkerOptions& options) {
  auto w = std::make_unique<UcxWorker>(options);
  if (auto s = w->Init(); !s.ok()) return s;
  return std::unique_ptr<Worker>(std::move(w));
}

}  // namespace transport
}  // namespace optimus
