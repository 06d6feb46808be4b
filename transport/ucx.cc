#include "transport/ucx.h"

#include <poll.h>
#include <ucp/api/ucp.h>

#include <cstring>
#include <deque>
#include <map>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/logging.h"
#include "transport/ucx_status.h"

namespace optimus {
namespace transport {
namespace {

constexpr char kLog[] = "ucx";
// Safety net for the progress thread's sleep: a missed wake-up costs at most
// this much latency, and an idle worker wakes this often (negligible CPU).
constexpr int kIdlePollTimeoutMs = 100;
// How long teardown waits for endpoint closes and cancelled requests.
constexpr absl::Duration kTeardownBudget = absl::Seconds(2);

class UcxWorker;

// State shared with MemoryRegions, which may be destroyed after the worker.
struct Core {
  absl::Mutex mu;
  ucp_context_h context ABSL_GUARDED_BY(mu) = nullptr;
  std::set<ucp_mem_h> regions ABSL_GUARDED_BY(mu);
};

class UcxMemoryRegion : public MemoryRegion {
 public:
  UcxMemoryRegion(std::shared_ptr<Core> core, ucp_mem_h memh)
      : core_(std::move(core)), memh_(memh) {}
  ~UcxMemoryRegion() override {
    absl::MutexLock lock(&core_->mu);
    if (core_->context != nullptr && core_->regions.erase(memh_) > 0) {
      ucp_mem_unmap(core_->context, memh_);
    }
  }

 private:
  std::shared_ptr<Core> core_;
  ucp_mem_h memh_;
};

struct HandlerEntry {
  UcxWorker* worker = nullptr;
  uint16_t am_id = 0;
  Handler handler;
};

struct SendCtx {
  std::string header;
  DoneCallback done;
  UcxWorker* worker = nullptr;
};

struct RecvCtx {
  DoneCallback done;
};

class UcxMessage : public IncomingMessage {
 public:
  UcxMessage(ucp_worker_h worker, uint16_t am_id, const void* header, size_t header_length,
             void* data, size_t length, const ucp_am_recv_param_t* param)
      : worker_(worker),
        am_id_(am_id),
        header_(static_cast<const uint8_t*>(header), header_length),
        data_(data),
        length_(length),
        param_(param) {}

  uint16_t am_id() const override { return am_id_; }
  absl::Span<const uint8_t> header() const override { return header_; }
  size_t payload_size() const override { return length_; }
  bool is_rendezvous() const override {
    return (param_->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  }
  EndpointRef reply_endpoint() const override {
    EndpointRef ref;
    if (param_->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ref.ep = param_->reply_ep;
    return ref;
  }

  void ReceiveInto(void* dst, DoneCallback done) override {
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
    auto* ctx = new RecvCtx{std::move(done)};
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = &UcxMessage::OnRecvDone;
    p.user_data = ctx;
    ucs_status_ptr_t st = ucp_am_recv_data_nbx(worker_, data_, dst, length_, &p);
    if (st == nullptr) {
      ctx->done(absl::OkStatus());
      delete ctx;
    } else if (UCS_PTR_IS_ERR(st)) {
      ctx->done(FromUcs(UCS_PTR_STATUS(st), "rendezvous receive"));
      delete ctx;
    }
  }

 private:
  static void OnRecvDone(void* request, ucs_status_t status, size_t /*length*/, void* user) {
    auto* ctx = static_cast<RecvCtx*>(user);
    ctx->done(FromUcs(status, "rendezvous receive"));
    delete ctx;
    ucp_request_free(request);
  }

  ucp_worker_h worker_;
  uint16_t am_id_;
  absl::Span<const uint8_t> header_;
  void* data_;
  size_t length_;
  const ucp_am_recv_param_t* param_;
  bool received_ = false;
};

class UcxWorker : public Worker {
 public:
  explicit UcxWorker(const WorkerOptions& options)
      : options_(options), core_(std::make_shared<Core>()) {}

  ~UcxWorker() override {
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
    absl::MutexLock lock(&core_->mu);
    if (core_->context != nullptr) {
      for (ucp_mem_h m : core_->regions) ucp_mem_unmap(core_->context, m);
      core_->regions.clear();
      ucp_cleanup(core_->context);
      core_->context = nullptr;
    }
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
    // Memory registration happens from other threads than the progress thread.
    params.mt_workers_shared = 1;
    ucp_context_h context = nullptr;
    st = ucp_init(&params, config, &context);
    ucp_config_release(config);
    if (st != UCS_OK) return FromUcs(st, "initializing UCX");
    {
      absl::MutexLock lock(&core_->mu);
      core_->context = context;
    }
    ucp_worker_params_t wp;
    std::memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;  // Only the progress thread uses it.
    st = ucp_worker_create(context, &wp, &worker_);
    if (st != UCS_OK) return FromUcs(st, "creating UCX worker");
    ucp_address_t* addr = nullptr;
    size_t addr_len = 0;
    st = ucp_worker_get_address(worker_, &addr, &addr_len);
    if (st != UCS_OK) return FromUcs(st, "getting UCX worker address");
    address_.assign(reinterpret_cast<const char*>(addr), addr_len);
    ucp_worker_release_address(worker_, addr);
    st = ucp_worker_get_efd(worker_, &efd_);
    if (st != UCS_OK) {
      efd_ = -1;
      OPTIMUS_LOG(Warning, kLog, options_.name, ": no UCX wake-up fd (",
                  ucs_status_string(st), "); polling every millisecond");
    }
    return absl::OkStatus();
  }

  const std::string& address() const override { return address_; }

  void SetHandler(uint16_t am_id, Handler handler) override {
    auto entry = std::make_unique<HandlerEntry>();
    entry->worker = this;
    entry->am_id = am_id;
    entry->handler = std::move(handler);
    handlers_[am_id] = std::move(entry);
  }

  absl::Status Start() override {
    for (auto& [id, entry] : handlers_) {
      ucp_am_handler_param_t p;
      std::memset(&p, 0, sizeof(p));
      p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                     UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
      p.id = id;
      p.flags = UCP_AM_FLAG_WHOLE_MSG;
      p.cb = &UcxWorker::OnAm;
      p.arg = entry.get();
      ucs_status_t st = ucp_worker_set_am_recv_handler(worker_, &p);
      if (st != UCS_OK) return FromUcs(st, absl::StrCat("registering handler ", id));
    }
    progress_ = std::thread([this] { ProgressLoop(); });
    return absl::OkStatus();
  }

  absl::StatusOr<EndpointRef> Connect(const std::string& peer_address) override {
    if (peer_address.empty()) return absl::InvalidArgumentError("empty peer address");
    absl::StatusOr<EndpointRef> result = absl::InternalError("not run");
    RunOnProgress([&] {
      ucp_ep_params_t p;
      std::memset(&p, 0, sizeof(p));
      p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                     UCP_EP_PARAM_FIELD_ERR_HANDLER;
      p.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
      p.err_mode = options_.detect_peer_failure ? UCP_ERR_HANDLING_MODE_PEER
                                                : UCP_ERR_HANDLING_MODE_NONE;
      p.err_handler.cb = &UcxWorker::OnEpError;
      p.err_handler.arg = this;
      ucp_ep_h ep = nullptr;
      ucs_status_t st = ucp_ep_create(worker_, &p, &ep);
      if (st != UCS_OK) {
        result = FromUcs(st, "connecting to peer");
        return;
      }
      eps_.push_back(ep);
      result = EndpointRef{ep};
    });
    return result;
  }

  void Send(EndpointRef ep, uint16_t am_id, absl::Span<const uint8_t> header,
            const void* payload, size_t payload_size, DoneCallback done) override {
    auto* ctx = new SendCtx;
    ctx->header.assign(reinterpret_cast<const char*>(header.data()), header.size());
    ctx->done = std::move(done);
    ctx->worker = this;
    Post([this, ep, am_id, payload, payload_size, ctx] {
      DoSend(ep, am_id, payload, payload_size, ctx);
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
    absl::MutexLock lock(&core_->mu);
    if (core_->context == nullptr) return absl::FailedPreconditionError("UCX context is gone");
    ucs_status_t st = ucp_mem_map(core_->context, &p, &memh);
    if (st != UCS_OK) return FromUcs(st, absl::StrCat("registering ", size_bytes, " bytes"));
    core_->regions.insert(memh);
    return std::unique_ptr<MemoryRegion>(new UcxMemoryRegion(core_, memh));
  }

 private:
  static ucs_status_t OnAm(void* arg, const void* header, size_t header_length, void* data,
                           size_t length, const ucp_am_recv_param_t* param) {
    auto* entry = static_cast<HandlerEntry*>(arg);
    UcxMessage msg(entry->worker->worker_, entry->am_id, header, header_length, data, length,
                   param);
    entry->handler(msg);
    // An unreceived rendezvous payload is dropped; the sender completes OK.
    return UCS_OK;
  }

  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* self = static_cast<UcxWorker*>(arg);
    self->failed_eps_.insert(ep);
    OPTIMUS_LOG(Warning, kLog, self->options_.name, ": peer endpoint failed: ",
                ucs_status_string(status));
  }

  static void OnSendDone(void* request, ucs_status_t status, void* user) {
    auto* ctx = static_cast<SendCtx*>(user);
    ctx->worker->inflight_.erase(request);
    ctx->done(FromUcs(status, "send"));
    delete ctx;
    ucp_request_free(request);
  }

  void DoSend(EndpointRef ep, uint16_t am_id, const void* payload, size_t payload_size,
              SendCtx* ctx) {
    auto* uep = static_cast<ucp_ep_h>(ep.ep);
    if (closed_) {
      ctx->done(absl::CancelledError("send: the UCX worker is shutting down"));
      delete ctx;
      return;
    }
    if (uep == nullptr || failed_eps_.count(uep) != 0) {
      ctx->done(absl::UnavailableError(uep == nullptr ? "send on a null endpoint"
                                                      : "send: peer endpoint has failed"));
      delete ctx;
      return;
    }
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    p.cb.send = &UcxWorker::OnSendDone;
    p.user_data = ctx;
    ucs_status_ptr_t st = ucp_am_send_nbx(uep, am_id, ctx->header.data(), ctx->header.size(),
                                          payload, payload_size, &p);
    if (st == nullptr) {
      ctx->done(absl::OkStatus());
      delete ctx;
    } else if (UCS_PTR_IS_ERR(st)) {
      ctx->done(FromUcs(UCS_PTR_STATUS(st), "send"));
      delete ctx;
    } else {
      inflight_.insert(st);
    }
  }

  void Post(std::function<void()> fn) {
    {
      absl::MutexLock lock(&mu_);
      posted_.push_back(std::move(fn));
    }
    ucp_worker_signal(worker_);
  }

  // Runs fn on the progress thread and waits for it (inline when already there).
  void RunOnProgress(const std::function<void()>& fn) {
    if (!progress_.joinable() || std::this_thread::get_id() == progress_id_) {
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
        absl::SleepFor(absl::Milliseconds(1));
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

  // On the progress thread (or after it ended): cancel what is in flight,
  // close endpoints, destroy the worker.
  void Teardown() {
    RunPosted();  // Sends posted before the stop fail fast below.
    closed_ = true;
    for (void* req : std::set<void*>(inflight_)) ucp_request_cancel(worker_, req);
    std::vector<void*> closing;
    for (ucp_ep_h ep : eps_) {
      ucp_request_param_t p;
      std::memset(&p, 0, sizeof(p));
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t st = ucp_ep_close_nbx(ep, &p);
      if (st != nullptr && !UCS_PTR_IS_ERR(st)) closing.push_back(st);
    }
    eps_.clear();
    const absl::Time give_up = absl::Now() + kTeardownBudget;
    for (;;) {
      ucp_worker_progress(worker_);
      bool pending = !inflight_.empty();
      for (void* req : closing) {
        if (req != nullptr && ucp_request_check_status(req) == UCS_INPROGRESS) pending = true;
      }
      if (!pending || absl::Now() > give_up) break;
    }
    for (void* req : closing) ucp_request_free(req);
    // Whatever is still posted (sends after the stop) fails now.
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    RunPosted();
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
  }

  const WorkerOptions options_;
  std::shared_ptr<Core> core_;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::string address_;
  std::map<uint16_t, std::unique_ptr<HandlerEntry>> handlers_;  // Fixed after Start.
  std::thread progress_;
  std::thread::id progress_id_;

  absl::Mutex mu_;
  std::deque<std::function<void()>> posted_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;

  // Progress thread only.
  std::vector<ucp_ep_h> eps_;
  std::set<ucp_ep_h> failed_eps_;
  std::set<void*> inflight_;
  bool closed_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Worker>> Worker::Create(const WorkerOptions& options) {
  auto w = std::make_unique<UcxWorker>(options);
  if (auto s = w->Init(); !s.ok()) return s;
  return std::unique_ptr<Worker>(std::move(w));
}

}  // namespace transport
}  // namespace optimus
