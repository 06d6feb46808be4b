#include "transport/ucx.h"

#include <poll.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
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
#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
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
// How long teardown waits for endpoint closes and cancelled requests, and,
// within that, for its goodbyes to go out.
constexpr absl::Duration kTeardownBudget = absl::Seconds(2);
constexpr absl::Duration kGoodbyeBudget = absl::Milliseconds(500);
// How long Connect waits for the peer's answer to the hello. A live peer
// answers within a round trip; an unreachable one fails sooner on tcp.
constexpr absl::Duration kConnectTimeout = absl::Seconds(10);
// Ops kept for reuse (beyond this many idle ones, finished ops are freed).
constexpr size_t kMaxFreeOps = 4096;

// UCX active-message ids: two internal ones, then the users' ids shifted up.
constexpr uint32_t kHelloAmId = 0;
constexpr uint32_t kHelloAckAmId = 1;
// The proof a connecting peer sends when the acceptor verifies peers
// (WorkerOptions::verify_peer), and the acceptor's verdict.
constexpr uint32_t kAuthAmId = 2;
constexpr uint32_t kAuthAckAmId = 3;
constexpr uint32_t kFirstUserAmId = 4;
// Bytes of the challenge a verifying worker sends in its hello answer.
constexpr size_t kChallengeBytes = 32;
// A UCX worker address is tens to a few hundred bytes; a hello whose
// address is outside these bounds is dropped before UCX sees it.
constexpr size_t kMinAddressBytes = 8;
constexpr size_t kMaxAddressBytes = 8192;
constexpr uint32_t kMaxUserAmId = 0xffff - kFirstUserAmId;  // UCX carries 16 bits.
static_assert(kMaxUserAmId == kMaxAmId, "transport.h promises callers ids up to kMaxAmId");

// Every message's UCX header starts with the sender's instance id (8 bytes,
// host byte order; all our machines are little-endian). The receiver uses it
// to find its own endpoint back to the sender. Hello and hello-ack add a
// 64-bit connect token after it, then the sender's name (for logs; older
// peers ignore it). A hello-ack with token kByeToken is a goodbye: the
// sender's worker is being destroyed (older peers ignore it as the answer
// to no connect).
constexpr size_t kPrefixBytes = sizeof(uint64_t);
constexpr uint64_t kByeToken = 0;  // Connect tokens start at 1.
// User headers up to this size travel in the op itself; larger ones are
// copied to the heap. The shard's and client's headers are well below it.
constexpr size_t kInlineHeaderBytes = 128;

// Settings for peer-failure detection (WorkerOptions::detect_peer_failure),
// each applied unless one of its environment variables is set. UCX 1.13's
// shared-memory transports can report a dead peer (they check its pid) but
// do not advertise it by default, so with UCP_ERR_HANDLING_MODE_PEER UCX
// would fall back to tcp between processes on one machine; cma's rendezvous
// lane additionally needs "memory invalidation", which cma only claims
// (harmless here: a peer is declared dead when its process is gone). The
// keys are the ones ucp_config_modify applies to the transports (checked:
// "MM_ERROR_HANDLING" reaches sysv and posix, "MEMORY_INVALIDATE" cma).
// Keepalive: UCX's default round is 20 s; one second finds a dead
// shared-memory peer in about a second (checked with SIGKILL), at the cost
// of a pid check per endpoint per second. tcp's receive segment: with error
// handling UCX 1.13 moves a tcp payload as active-message fragments of one
// receive segment each (no zero-copy rendezvous lane), every one read into a
// segment and copied into place; UCX's 64 KiB segment makes that a recv, a
// wakeup and a handler per 64 KiB. 512 KiB moved a 4 MiB push 1.3x and a
// pull 1.5x faster on loopback (docs/benchmarks.md, "tcp's receive
// segment"); it is memory per tcp endpoint that is receiving.
struct DetectionSetting {
  const char* key;
  const char* value;
  std::vector<const char*> env;  // Any of these set: the environment wins.
  // UCX_TLS names that load the transport this is for (empty: any). UCX
  // warns about a setting no loaded transport takes.
  std::vector<const char*> for_tls;
};
const std::vector<DetectionSetting>& DetectionSettings() {
  static const auto* settings = new std::vector<DetectionSetting>{
      {"MM_ERROR_HANDLING", "y",
       {"UCX_MM_ERROR_HANDLING", "UCX_SYSV_ERROR_HANDLING", "UCX_POSIX_ERROR_HANDLING"},
       {"sm", "shm", "mm", "sysv", "posix"}},
      {"MEMORY_INVALIDATE", "y", {"UCX_CMA_MEMORY_INVALIDATE"}, {"sm", "shm", "cma"}},
      {"KEEPALIVE_INTERVAL", "1s", {"UCX_KEEPALIVE_INTERVAL"}, {}},
      {"RX_SEG_SIZE", "512K", {"UCX_TCP_RX_SEG_SIZE"}, {"tcp"}},
  };
  return *settings;
}

// Whether a UCX_TLS value loads one of `names` ("all" and exclusion lists,
// "^...", load everything).
bool TlsLoadsAny(absl::string_view tls, const std::vector<const char*>& names) {
  if (names.empty() || absl::StartsWith(tls, "^")) return true;
  for (absl::string_view t : absl::StrSplit(tls, ',')) {
    if (t == "all") return true;
    for (const char* n : names) {
      if (t == n) return true;
    }
  }
  return false;
}

uint64_t LoadU64(const void* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

void AppendU64(std::string* s, uint64_t v) {
  s->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// Serials of this process's UCX workers (tags of their peer ids).
uint64_t NextWorkerSerial() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1) & 0xffffffffu;
}

uint64_t RandomInstanceId() {
  std::random_device rd;
  uint64_t v = (uint64_t{rd()} << 32) ^ rd();
  v ^= static_cast<uint64_t>(absl::GetCurrentTimeNanos());
  return v == 0 ? 1 : v;
}

// One lane of a UCX endpoint, from ucp_ep_print_info.
struct Lane {
  std::string transport;  // "sysv", "cma", "tcp", "rc_mlx5", ...
  std::string device;     // "memory", "lo", "mlx5_0:1", ...
  std::string roles;      // "am keepalive", "rma_bw", ...
};

// Parses the lane lines of ucp_ep_print_info (UCX 1.13), e.g.
//   #  lane[0]:  2:sysv/memory.0 md[2]  -> md[2]/sysv/sysdev[255] am am_bw#0 keepalive
// into {sysv, memory, "am am_bw keepalive"}. Lines it does not understand
// are skipped.
std::vector<Lane> ParseLanes(absl::string_view info) {
  std::vector<Lane> lanes;
  for (absl::string_view line : absl::StrSplit(info, '\n')) {
    const size_t at = line.find("lane[");
    if (at == absl::string_view::npos) continue;
    const size_t colon = line.find("]:", at);
    if (colon == absl::string_view::npos) continue;
    std::vector<absl::string_view> words =
        absl::StrSplit(line.substr(colon + 2), ' ', absl::SkipWhitespace());
    if (words.empty()) continue;
    absl::string_view rsc = words[0];  // "2:sysv/memory.0"
    if (size_t c = rsc.find(':'); c != absl::string_view::npos && c < rsc.find('/')) {
      rsc.remove_prefix(c + 1);
    }
    const size_t slash = rsc.find('/');
    if (slash == absl::string_view::npos) continue;
    Lane lane;
    lane.transport = std::string(rsc.substr(0, slash));
    absl::string_view device = rsc.substr(slash + 1);
    if (size_t dot = device.rfind('.'); dot != absl::string_view::npos &&
        dot + 1 < device.size() &&
        device.find_first_not_of("0123456789", dot + 1) == absl::string_view::npos) {
      device = device.substr(0, dot);  // The path index.
    }
    lane.device = std::string(device);
    // Roles follow the remote's "md[..]/tl/sysdev[..]" word after "->".
    bool after_arrow = false, skipped_remote = false;
    std::vector<std::string> roles;
    for (size_t i = 1; i < words.size(); ++i) {
      if (words[i] == "->") {
        after_arrow = true;
        continue;
      }
      if (!after_arrow) continue;
      if (!skipped_remote) {
        skipped_remote = true;
        continue;
      }
      absl::string_view role = words[i];
      if (size_t hash = role.find('#'); hash != absl::string_view::npos) role = role.substr(0, hash);
      roles.emplace_back(role);
    }
    lane.roles = absl::StrJoin(roles, " ");
    lanes.push_back(std::move(lane));
  }
  return lanes;
}

std::vector<Lane> DescribeLanes(ucp_ep_h ep) {
  char* text = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  if (f == nullptr) return {};
  ucp_ep_print_info(ep, f);
  std::fclose(f);
  std::vector<Lane> lanes = ParseLanes(absl::string_view(text, size));
  std::free(text);
  return lanes;
}

class UcxWorker;

// A peer as seen by one worker: either opened by Connect (outgoing) or
// learned from a peer's hello (incoming; its endpoint is opened on the first
// reply). Owned by the worker; EndpointRefs carry its id, not its address,
// so a peer that failed can be forgotten (freed once UCX is done with it)
// and a Send on an EndpointRef kept from before fails cleanly. We do not
// hand out UCX's param->reply_ep: UCX 1.13 destroys such endpoints by itself
// when the peer fails, so a reply sent later would use freed memory.
// Progress thread only.
struct Peer {
  UcxWorker* owner = nullptr;
  uint64_t id = 0;        // What EndpointRefs to it carry: the worker's serial, then a count.
  bool incoming = false;  // Learned from a hello (counted against max_peers).
  bool heard = false;     // Incoming: sent something after its hello.
  int ops = 0;            // Ops in UCX that point here (op->peer).
  bool closing = false;   // Its endpoint's close has not completed.
  std::string address;  // Incoming peers: where to open the endpoint.
  std::string name;     // The peer worker's name, from the hello ("" if unknown).
  uint64_t instance = 0;  // The peer worker's instance id (0 until known).
  ucp_ep_h ep = nullptr;
  absl::Status failure;  // Not OK once the endpoint has failed or closed.
  bool lanes_logged = false;
  // Identity (WorkerOptions::verify_peer): trusted once this worker
  // connected to it (`identity` given to Connect) or it proved `identity`.
  bool trusted = false;
  std::string identity;
  std::string challenge;  // Sent in the hello answer; single use.
};

// One unit of work: a Send (posted to the progress thread, then in flight in
// UCX), a rendezvous receive, an internal message, or a task posted to the
// progress thread. Ops are recycled through the worker's free lists and
// carry small headers inline, so a Send allocates nothing once the worker
// is warm.
struct Op {
  enum class Kind { kSend, kTask, kOther };

  char* header() { return heap_header != nullptr ? heap_header.get() : inline_header; }
  // The UCX header: the sender's instance id, then rest.
  void SetHeader(uint64_t instance, const void* rest, size_t rest_size) {
    header_size = kPrefixBytes + rest_size;
    if (header_size > sizeof(inline_header)) heap_header.reset(new char[header_size]);
    std::memcpy(header(), &instance, kPrefixBytes);
    if (rest_size > 0) std::memcpy(header() + kPrefixBytes, rest, rest_size);
  }

  UcxWorker* worker = nullptr;
  Kind kind = Kind::kOther;
  Op* next = nullptr;  // In the posted queue, the in-flight list or a free list.
  Op* prev = nullptr;  // In the in-flight list.
  bool in_flight = false;
  uint64_t generation = 0;  // Bumped on each reuse.
  DoneCallback done;
  const char* what = "send";
  void* request = nullptr;
  Peer* peer = nullptr;  // Sends in UCX: the endpoint's peer (counted in peer->ops).
  uint64_t peer_id = 0;  // Sends until DoSend: the EndpointRef's peer id.
  // Send arguments.
  uint16_t am_id = 0;
  const void* payload = nullptr;
  size_t payload_size = 0;
  ucp_mem_h memh = nullptr;
  bool foreign_region = false;
  // UCX header: our prefix, then the caller's header.
  size_t header_size = 0;
  std::unique_ptr<char[]> heap_header;  // Headers too large for inline_header.
  char inline_header[kPrefixBytes + kInlineHeaderBytes];
  // Tasks.
  std::function<void()> task;
};

struct HandlerEntry {
  UcxWorker* worker = nullptr;
  uint32_t ucx_id = 0;
  uint16_t user_id = 0;
  Handler handler;
};

// Lets MemoryRegions and PendingPayloads find their worker, or learn that it
// is gone.
struct Core {
  absl::Mutex mu;
  UcxWorker* worker ABSL_GUARDED_BY(mu) = nullptr;
};

class UcxMemoryRegion : public MemoryRegion {
 public:
  UcxMemoryRegion(std::shared_ptr<Core> core, ucp_mem_h memh)
      : core_(std::move(core)), memh_(memh) {}
  ~UcxMemoryRegion() override;

  const Core* core() const { return core_.get(); }
  ucp_mem_h memh() const { return memh_; }

 private:
  std::shared_ptr<Core> core_;
  ucp_mem_h memh_;
};

// A rendezvous payload kept by IncomingMessage::Keep: UCX's descriptor,
// valid until ucp_am_recv_data_nbx or ucp_am_data_release. Owned by the
// worker (progress thread).
struct Kept {
  void* desc = nullptr;
  size_t length = 0;
  uint64_t sender = 0;  // Peer id; 0 when the sender is unknown.
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
  EndpointRef reply_endpoint() const override;
  const std::string& peer_identity() const override {
    static const std::string kNone;
    return sender_ != nullptr ? sender_->identity : kNone;
  }
  void ReceiveInto(void* dst, DoneCallback done) override {
    ReceiveInto(dst, nullptr, std::move(done));
  }
  void ReceiveInto(void* dst, const MemoryRegion* region, DoneCallback done) override;
  std::unique_ptr<PendingPayload> Keep() override;

  // The handler kept the rendezvous descriptor: the AM callback must return
  // UCS_INPROGRESS.
  bool kept_rendezvous() const { return kept_rendezvous_; }

 private:
  UcxWorker* worker_;
  uint16_t am_id_;
  absl::Span<const uint8_t> header_;
  void* data_;
  size_t length_;
  const ucp_am_recv_param_t* param_;
  Peer* sender_;
  bool taken_ = false;  // Received or kept.
  bool kept_rendezvous_ = false;
};

// IncomingMessage::Keep's result: a rendezvous descriptor held by the worker
// (kept_), or the bytes of an eager payload (bytes_).
class UcxPendingPayload : public PendingPayload {
 public:
  UcxPendingPayload(std::shared_ptr<Core> core, Kept* kept, size_t size)
      : core_(std::move(core)), kept_(kept), size_(size) {}
  UcxPendingPayload(std::shared_ptr<Core> core, std::unique_ptr<uint8_t[]> bytes, size_t size)
      : core_(std::move(core)), bytes_(std::move(bytes)), size_(size) {}
  ~UcxPendingPayload() override;

  size_t size() const override { return size_; }
  void ReceiveInto(void* dst, const MemoryRegion* region, DoneCallback done) override;

 private:
  const std::shared_ptr<Core> core_;
  Kept* const kept_ = nullptr;  // Rendezvous: the worker's, touched on its progress thread only.
  const std::unique_ptr<uint8_t[]> bytes_;  // Eager.
  const size_t size_;
  std::atomic<bool> taken_{false};
};

class UcxWorker : public Worker {
 public:
  explicit UcxWorker(const WorkerOptions& options)
      : options_(options), instance_(RandomInstanceId()), core_(std::make_shared<Core>()) {}

  ~UcxWorker() override {
    {
      // Waits for a MemoryRegion or PendingPayload being used on another
      // thread; later ones find no worker (memory is unmapped and kept
      // payloads dropped below).
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
    absl::MutexLock lock(&mu_);
    FreeOps(free_ops_);
    FreeOps(local_free_);
  }

  absl::Status Init() {
    ucp_config_t* config = nullptr;
    ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
    if (st != UCS_OK) return FromUcs(st, "reading UCX configuration");
    // Where each setting comes from, for the log line and errors.
    const std::string tls = Describe(options_.transports, "UCX_TLS", "all");
    const std::string devices = Describe(options_.net_devices, "UCX_NET_DEVICES", "all");
    const std::string what = absl::StrCat("transports ", tls, ", devices ", devices);
    if (!options_.transports.empty()) st = ucp_config_modify(config, "TLS", options_.transports.c_str());
    if (st == UCS_OK && !options_.net_devices.empty()) {
      st = ucp_config_modify(config, "NET_DEVICES", options_.net_devices.c_str());
    }
    if (st != UCS_OK) {
      ucp_config_release(config);
      return FromUcs(st, absl::StrCat("setting UCX ", what));
    }
    std::vector<std::string> detection;
    if (options_.detect_peer_failure) {
      const char* env_tls = std::getenv("UCX_TLS");
      const std::string tls_value =
          !options_.transports.empty() ? options_.transports : (env_tls ? env_tls : "all");
      for (const DetectionSetting& s : DetectionSettings()) {
        if (!TlsLoadsAny(tls_value, s.for_tls)) continue;
        const char* env_name = nullptr;
        for (const char* e : s.env) {
          if (std::getenv(e) != nullptr) env_name = e;
        }
        if (env_name != nullptr) {
          detection.push_back(absl::StrCat(env_name, "=", std::getenv(env_name), " (environment)"));
          continue;
        }
        const ucs_status_t mst = ucp_config_modify(config, s.key, s.value);
        if (mst == UCS_OK) {
          detection.push_back(absl::StrCat(s.env.front(), "=", s.value));
        } else {
          OPTIMUS_LOG(Warning, kLog, options_.name, ": could not set ", s.env.front(), "=",
                      s.value, " (", ucs_status_string(mst), "); UCX's default stays");
        }
      }
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
      return FromUcs(st, absl::StrCat("initializing UCX with ", what));
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
    for (uint32_t id : {kHelloAmId, kHelloAckAmId, kAuthAmId, kAuthAckAmId}) {
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
    OPTIMUS_LOG(Info, kLog, options_.name, ": UCX ", ucp_get_version_string(), ", ", what,
                options_.detect_peer_failure
                    ? absl::StrCat("; dead peers detected (", absl::StrJoin(detection, ", "), ")")
                    : std::string("; dead peers not detected"));
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
    progress_ = std::thread([this] {
      if (options_.on_progress_start) options_.on_progress_start();
      ProgressLoop();
    });
    return absl::OkStatus();
  }

  using Worker::Connect;
  absl::StatusOr<EndpointRef> Connect(const std::string& peer_address,
                                      const std::string& identity) override {
    if (peer_address.empty()) return absl::InvalidArgumentError("empty peer address");
    if (!started_) return absl::FailedPreconditionError("Connect before Start");
    auto pending = std::make_shared<PendingConnect>();
    uint64_t id = 0;
    RunOnProgress([&] { id = StartConnect(peer_address, identity, pending)->id; });
    if (OnProgressThread()) {
      // Cannot wait for the hello's answer here. The hello is the first
      // message on the endpoint, so the peer learns who we are before any
      // later message from us; failures surface on later Sends.
      absl::MutexLock lock(&pending->mu);
      if (pending->done && !pending->status.ok()) return pending->status;
      return RefOf(id);
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
        FailPeerById(id, result);
      });
      return result;
    }
    return RefOf(id);
  }

  void Send(EndpointRef ep, uint16_t am_id, absl::Span<const uint8_t> header,
            const void* payload, size_t payload_size, DoneCallback done) override {
    Send(ep, am_id, header, payload, payload_size, nullptr, std::move(done));
  }

  // The common path takes one lock and, once warm, allocates nothing: the
  // op comes from the free list and the header is copied into it.
  void Send(EndpointRef ep, uint16_t am_id, absl::Span<const uint8_t> header,
            const void* payload, size_t payload_size, const MemoryRegion* region,
            DoneCallback done) override {
    ucp_mem_h memh = nullptr;
    bool foreign = false;
    if (region != nullptr) {
      const auto* r = dynamic_cast<const UcxMemoryRegion*>(region);
      foreign = r == nullptr || r->core() != core_.get();
      if (!foreign) memh = r->memh();
    }
    bool gone;
    Op* op;
    {
      absl::MutexLock lock(&mu_);
      op = TakeOpLocked();
      op->kind = Op::Kind::kSend;
      op->peer_id = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(ep.ep));
      op->am_id = am_id;
      op->payload = payload;
      op->payload_size = payload_size;
      op->memh = memh;
      op->foreign_region = foreign;
      op->SetHeader(instance_, header.data(), header.size());
      op->done = std::move(done);
      gone = !EnqueueLocked(op);
    }
    if (gone) RunOp(op);
  }

  uint64_t refused_messages() const override { return refused_.load(); }

  std::string transports_in_use() const override {
    absl::MutexLock lock(&tls_mu_);
    return absl::StrJoin(tls_in_use_, ",");
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

  // The region's memory handle for an operation of this worker: null for
  // no region, INVALID_ARGUMENT for another worker's. Any thread.
  absl::StatusOr<ucp_mem_h> MemhOf(const MemoryRegion* region) const {
    if (region == nullptr) return nullptr;
    const auto* r = dynamic_cast<const UcxMemoryRegion*>(region);
    if (r == nullptr || r->core() != core_.get()) {
      return absl::InvalidArgumentError("receive: the memory region belongs to another worker");
    }
    return r->memh();
  }

  // Starts a rendezvous receive (progress thread). UCX owns data_desc from
  // here on, whatever happens.
  void ReceiveRendezvous(void* data_desc, void* dst, size_t length, ucp_mem_h memh,
                         DoneCallback done) {
    Op* op = TakeOp();
    op->done = std::move(done);
    op->what = "rendezvous receive";
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    if (memh != nullptr) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = memh;
    }
    p.cb.recv_am = &UcxWorker::OnRecvDone;
    p.user_data = op;
    const uint64_t generation = op->generation;
    Track(op, generation, ucp_am_recv_data_nbx(worker_, data_desc, dst, length, &p));
  }

  // IncomingMessage::Keep of a rendezvous payload (progress thread).
  Kept* AddKept(void* desc, size_t length, const Peer* sender) {
    auto* k = new Kept{desc, length, sender != nullptr ? sender->id : 0};
    kept_.insert(k);
    return k;
  }

  // PendingPayload::ReceiveInto of a kept rendezvous payload (progress
  // thread). While the worker is closing, Teardown drops what is kept.
  void ReceiveKept(Kept* k, void* dst, ucp_mem_h memh, DoneCallback done) {
    if (closed_ || kept_.erase(k) == 0) {
      done(absl::CancelledError("receive: the UCX worker is shutting down"));
      return;
    }
    std::unique_ptr<Kept> owned(k);
    const Peer* sender = k->sender != 0 ? FindPeer(k->sender) : nullptr;
    if (k->sender != 0 && (sender == nullptr || !sender->failure.ok())) {
      // The sender is known dead (or failed and forgotten): nothing will come.
      ucp_am_data_release(worker_, k->desc);
      done(sender != nullptr
               ? absl::Status(sender->failure.code(),
                              absl::StrCat("receive: ", sender->failure.message()))
               : absl::UnavailableError("receive: the sender failed"));
      return;
    }
    ReceiveRendezvous(k->desc, dst, k->length, memh, std::move(done));
  }

  // A kept rendezvous payload nobody will receive (progress thread): UCX
  // then tells its sender, whose Send completes OK.
  void DropKept(Kept* k) {
    if (closed_ || kept_.erase(k) == 0) return;
    ucp_am_data_release(worker_, k->desc);
    delete k;
  }

  // Runs fn on the progress thread (inline once the worker is gone).
  void Post(std::function<void()> fn) {
    bool gone;
    Op* op;
    {
      absl::MutexLock lock(&mu_);
      op = TakeOpLocked();
      op->kind = Op::Kind::kTask;
      op->task = std::move(fn);
      gone = !EnqueueLocked(op);
    }
    if (gone) RunOp(op);
  }

  const std::shared_ptr<Core>& core() const { return core_; }

  size_t peer_count() const override { return peer_count_.load(); }
  uint64_t hellos_refused() const override { return hellos_refused_.load(); }

  // What EndpointRefs carry: a peer's id (0: none).
  static EndpointRef RefOf(uint64_t id) {
    return EndpointRef{reinterpret_cast<void*>(static_cast<uintptr_t>(id))};
  }

 private:
  // State of one Connect: done once the peer answered the hello or failed.
  struct PendingConnect {
    absl::Mutex mu;
    bool done ABSL_GUARDED_BY(mu) = false;
    absl::Status status ABSL_GUARDED_BY(mu);
    Peer* peer = nullptr;  // Progress thread only.
  };

  // "'tcp' (set by the caller)", "'sm' (from UCX_TLS)", "UCX's default (all)".
  static std::string Describe(const std::string& value, const char* env, const char* ucx_default) {
    if (!value.empty()) return absl::StrCat("'", value, "' (set by the caller)");
    if (const char* v = std::getenv(env)) return absl::StrCat("'", v, "' (from ", env, ")");
    return absl::StrCat("UCX's default (", ucx_default, ")");
  }

  static std::string PeerName(const Peer* peer) {
    return peer->name.empty() ? std::string("peer") : absl::StrCat("'", peer->name, "'");
  }

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

  // ---- Ops: free lists, the posted queue, the in-flight list ----

  Op* TakeOpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Op* op = free_ops_;
    if (op != nullptr) {
      free_ops_ = op->next;
      --free_count_;
      op->next = nullptr;
    } else {
      op = new Op;
      op->worker = this;
    }
    return op;
  }

  // Progress thread (or teardown): from the local list first, no lock.
  Op* TakeOp() {
    if (OnProgressThread() && local_free_ != nullptr) {
      Op* op = local_free_;
      local_free_ = op->next;
      --local_free_count_;
      op->next = nullptr;
      return op;
    }
    absl::MutexLock lock(&mu_);
    return TakeOpLocked();
  }

  // Returns a finished op for reuse.
  void Recycle(Op* op) {
    op->kind = Op::Kind::kOther;
    op->done = nullptr;
    op->task = nullptr;
    op->heap_header.reset();
    op->what = "send";
    op->request = nullptr;
    op->peer = nullptr;
    op->peer_id = 0;
    op->memh = nullptr;
    op->foreign_region = false;
    op->prev = nullptr;
    ++op->generation;
    if (OnProgressThread()) {
      op->next = local_free_;
      local_free_ = op;
      ++local_free_count_;
      return;
    }
    absl::MutexLock lock(&mu_);
    op->next = free_ops_;
    free_ops_ = op;
    ++free_count_;
  }

  static void FreeOps(Op*& list) {
    while (list != nullptr) {
      Op* next = list->next;
      delete list;
      list = next;
    }
  }

  // Appends op to the posted queue and wakes the progress thread if it
  // sleeps (one signal per sleep, not per op). False once the worker is
  // gone: the caller runs op inline, which fails it.
  bool EnqueueLocked(Op* op) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (worker_gone_) return false;
    op->next = nullptr;
    if (posted_tail_ != nullptr) {
      posted_tail_->next = op;
    } else {
      posted_head_ = op;
    }
    posted_tail_ = op;
    if (sleeping_) {
      sleeping_ = false;
      ucp_worker_signal(worker_);
    }
    return true;
  }

  void RunOp(Op* op) {
    switch (op->kind) {
      case Op::Kind::kSend:
        DoSend(op);
        return;
      case Op::Kind::kTask: {
        std::function<void()> fn = std::move(op->task);
        Recycle(op);
        fn();
        return;
      }
      case Op::Kind::kOther:
        Recycle(op);
        return;
    }
  }

  void LinkInFlight(Op* op) {
    op->in_flight = true;
    op->prev = nullptr;
    op->next = inflight_head_;
    if (inflight_head_ != nullptr) inflight_head_->prev = op;
    inflight_head_ = op;
    ++inflight_count_;
  }

  void UnlinkInFlight(Op* op) {
    if (!op->in_flight) return;
    op->in_flight = false;
    if (op->prev != nullptr) op->prev->next = op->next;
    if (op->next != nullptr) op->next->prev = op->prev;
    if (inflight_head_ == op) inflight_head_ = op->next;
    op->prev = op->next = nullptr;
    --inflight_count_;
  }

  // ---- Endpoints ----

  Peer* NewPeer() {
    SweepDead();
    auto owned = std::make_unique<Peer>();
    Peer* peer = owned.get();
    peer->owner = this;
    peer->id = (serial_ << 32) | (next_peer_++ & 0xffffffffu);
    peers_[peer->id] = std::move(owned);
    peer_count_.store(peers_.size());
    return peer;
  }

  Peer* FindPeer(uint64_t id) const {
    auto it = peers_.find(id);
    return it == peers_.end() ? nullptr : it->second.get();
  }

  // Frees the failed peers UCX is done with: no op points to them, their
  // endpoint is closed, no Connect waits on them. EndpointRefs to them
  // then fail at Send (their id is gone).
  void SweepDead() {
    if (closed_ || dead_.empty()) return;
    std::vector<uint64_t> keep;
    for (uint64_t id : dead_) {
      Peer* peer = FindPeer(id);
      if (peer == nullptr) continue;
      bool connecting = false;
      for (const auto& entry : pending_connects_) {
        connecting = connecting || entry.second->peer == peer;
      }
      if (peer->ops > 0 || peer->closing || peer->ep != nullptr || connecting) {
        keep.push_back(id);
        continue;
      }
      peers_.erase(id);
    }
    dead_.swap(keep);
    peer_count_.store(peers_.size());
  }

  // At max_peers: frees the incoming peer that has been silent longest
  // since its hello (nothing was delivered from it, so no EndpointRef to
  // it was handed out). False when every incoming peer has spoken.
  bool EvictSilentPeer() {
    while (!silent_.empty()) {
      const uint64_t id = silent_.front();
      silent_.pop_front();
      Peer* peer = FindPeer(id);
      if (peer == nullptr || peer->heard || !peer->failure.ok() || peer->ep != nullptr ||
          peer->ops > 0) {
        continue;
      }
      auto it = by_instance_.find(peer->instance);
      if (it != by_instance_.end() && it->second == peer) by_instance_.erase(it);
      --incoming_live_;
      peers_.erase(id);
      peer_count_.store(peers_.size());
      return true;
    }
    return false;
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

  // Once per endpoint, when it first carried a message: which transports
  // UCX chose for it (log line and transports_in_use()).
  void LogLanes(Peer* peer) {
    if (peer->lanes_logged || peer->ep == nullptr) return;
    peer->lanes_logged = true;
    std::vector<Lane> lanes = DescribeLanes(peer->ep);
    std::vector<std::string> parts;
    {
      absl::MutexLock lock(&tls_mu_);
      for (const Lane& lane : lanes) {
        parts.push_back(absl::StrCat(lane.transport, "/", lane.device,
                                     lane.roles.empty() ? "" : absl::StrCat(" (", lane.roles, ")")));
        bool seen = false;
        for (const std::string& t : tls_in_use_) seen = seen || t == lane.transport;
        if (!seen) tls_in_use_.push_back(lane.transport);
      }
    }
    OPTIMUS_LOG(Info, kLog, options_.name, ": endpoint to ", PeerName(peer), " uses ",
                parts.empty() ? std::string("(unknown transports)") : absl::StrJoin(parts, ", "));
  }

  // Progress thread: opens an endpoint and sends the hello.
  Peer* StartConnect(const std::string& peer_address, const std::string& identity,
                     std::shared_ptr<PendingConnect> pending) {
    Peer* peer = NewPeer();
    peer->address = peer_address;
    peer->trusted = true;  // Its address came from the caller (the coordinator's map).
    peer->identity = identity;
    pending->peer = peer;
    if (absl::Status s = OpenEndpoint(peer); !s.ok()) {
      FinishConnect(pending, s);
      return peer;
    }
    const uint64_t token = next_token_++;
    pending_connects_[token] = pending;
    Op* op = TakeOp();
    op->what = "hello";
    std::string rest;
    AppendU64(&rest, token);
    rest += options_.name;
    op->SetHeader(instance_, rest.data(), rest.size());
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
    const uint64_t generation = op->generation;
    Track(op, generation, ucp_am_send_nbx(peer->ep, kHelloAmId, op->header(), op->header_size,
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

  void DoSend(Op* op) {
    const uint64_t id = op->peer_id;
    op->peer_id = 0;
    op->peer = nullptr;  // Set below once the send goes to UCX.
    if (closed_) return Complete(op, absl::CancelledError("send: the UCX worker is shutting down"));
    if (id == 0) return Complete(op, absl::InvalidArgumentError("send on a null endpoint"));
    if ((id >> 32) != serial_) {
      return Complete(op, absl::InvalidArgumentError("send on another worker's endpoint"));
    }
    Peer* peer = FindPeer(id);
    if (peer == nullptr) {
      return Complete(op, absl::UnavailableError(
                              "send: the peer failed and was forgotten (its endpoint is closed)"));
    }
    if (op->am_id > kMaxUserAmId) {
      return Complete(op, absl::InvalidArgumentError(absl::StrCat(
                              "send: active message id ", op->am_id, " is reserved")));
    }
    if (op->payload == nullptr && op->payload_size > 0) {
      return Complete(op, absl::InvalidArgumentError(absl::StrCat(
                              "send: null payload of ", op->payload_size, " bytes")));
    }
    if (op->foreign_region) {
      return Complete(op, absl::InvalidArgumentError(
                              "send: the memory region belongs to another worker"));
    }
    if (peer->ep == nullptr && peer->failure.ok()) (void)OpenEndpoint(peer);
    if (!peer->failure.ok()) {
      return Complete(op, absl::Status(peer->failure.code(),
                                       absl::StrCat("send: ", peer->failure.message())));
    }
    op->peer = peer;
    ++peer->ops;
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    if (op->memh != nullptr) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      p.memh = op->memh;
    }
    // Eager or rendezvous is UCX's choice by size; no REPLY flag: the
    // receiver finds its way back through our instance id (see Peer).
    p.cb.send = &UcxWorker::OnSendDone;
    p.user_data = op;
    const uint64_t generation = op->generation;
    Track(op, generation, ucp_am_send_nbx(peer->ep, op->am_id + kFirstUserAmId, op->header(),
                              op->header_size, op->payload, op->payload_size, &p));
  }

  // Takes over a request returned by a ucp_*_nbx call for op, whose
  // generation was `generation` before the call. UCX 1.13 sometimes fails a
  // request inside the call, running its callback (which finished and
  // recycled op), and still returns the request (seen with
  // ucp_am_recv_data_nbx from a dead peer over tcp): then op has moved on
  // and the returned pointer is stale.
  void Track(Op* op, uint64_t generation, ucs_status_ptr_t st) {
    if (op->generation != generation) {
      OPTIMUS_LOG(Debug, kLog, options_.name, ": request completed inside its call");
      return;
    }
    if (st == nullptr) {
      Complete(op, absl::OkStatus());
    } else if (UCS_PTR_IS_ERR(st)) {
      Complete(op, FromUcs(UCS_PTR_STATUS(st), op->what));
    } else {
      op->request = st;
      LinkInFlight(op);
    }
  }

  // Finishes op: its done runs after the op went back to the free list (so
  // a done that sends again may reuse it).
  static void Complete(Op* op, absl::Status s) {
    UcxWorker* self = op->worker;
    self->UnlinkInFlight(op);
    if (op->peer != nullptr) {
      if (s.ok() && !op->peer->lanes_logged) self->LogLanes(op->peer);
      --op->peer->ops;
    }
    DoneCallback done = std::move(op->done);
    self->Recycle(op);
    if (done) done(std::move(s));
  }

  // A request UCX cancelled while this worker is not closing was cancelled
  // because its endpoint failed (UCX purges them when it closes a failed
  // endpoint, ours or its own): the peer failed, so UNAVAILABLE.
  absl::Status RequestStatus(ucs_status_t status, const char* what) const {
    if (status == UCS_ERR_CANCELED && !closed_) {
      return absl::UnavailableError(
          absl::StrCat(what, ": UCX: ", ucs_status_string(status), " (the peer failed)"));
    }
    return FromUcs(status, what);
  }

  static void OnSendDone(void* request, ucs_status_t status, void* user) {
    auto* op = static_cast<Op*>(user);
    ucp_request_free(request);
    Complete(op, op->worker->RequestStatus(status, op->what));
  }

  static void OnRecvDone(void* request, ucs_status_t status, size_t /*length*/, void* user) {
    auto* op = static_cast<Op*>(user);
    ucp_request_free(request);
    Complete(op, op->worker->RequestStatus(status, op->what));
  }

  static void OnCloseDone(void* request, ucs_status_t /*status*/, void* user) {
    auto* peer = static_cast<Peer*>(user);
    peer->closing = false;
    --peer->owner->closing_;
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
    if (entry->ucx_id == kAuthAmId) {
      self->OnAuth(sender, rest, rest_length, param);
      return UCS_OK;
    }
    if (entry->ucx_id == kAuthAckAmId) {
      self->OnAuthAck(rest, rest_length);
      return UCS_OK;
    }
    auto it = self->by_instance_.find(sender);
    if (self->options_.verify_peer &&
        (it == self->by_instance_.end() || !it->second->trusted)) {
      // Not proved who it is: dropped (a rendezvous payload with it).
      self->Refused("a message from a peer that has not proved who it is");
      return UCS_OK;
    }
    Peer* from = it == self->by_instance_.end() ? nullptr : it->second;
    if (from != nullptr) from->heard = true;
    UcxMessage msg(self, entry->user_id, absl::Span<const uint8_t>(rest, rest_length), data,
                   length, param, from);
    entry->handler(msg);
    // A kept rendezvous payload stays with UCX until received or dropped.
    // One the handler did not take is dropped here: returning UCS_OK lets
    // UCX acknowledge the sender, whose request then completes successfully.
    return msg.kept_rendezvous() ? UCS_INPROGRESS : UCS_OK;
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
    if (length < kMinAddressBytes || length > kMaxAddressBytes) {
      Refused("a hello with an address of impossible size");
      return;
    }
    const uint64_t token = LoadU64(rest);
    auto known = by_instance_.find(sender);
    Peer* peer = known != by_instance_.end() ? known->second : nullptr;
    if (peer == nullptr) {
      // Bounded: beyond max_peers, the longest-silent peer makes room or
      // the hello is dropped (its Connect times out).
      if (incoming_live_ >= options_.max_peers) SweepDead();
      if (incoming_live_ >= options_.max_peers && !EvictSilentPeer()) {
        if (hellos_refused_.fetch_add(1) % 10000 == 0) {
          OPTIMUS_LOG(Warning, kLog, options_.name, ": dropped a hello: ", incoming_live_,
                      " peers known (max_peers), none silent since its hello (",
                      hellos_refused_.load(), " dropped so far)");
        }
        return;
      }
      peer = NewPeer();
      peer->incoming = true;
      ++incoming_live_;
      silent_.push_back(peer->id);
      if (silent_.size() > 2 * incoming_live_ + 1024) {
        // Keep it to the peers still silent (it would grow with every
        // hello ever received otherwise).
        std::deque<uint64_t> still;
        for (uint64_t id : silent_) {
          const Peer* p = FindPeer(id);
          if (p != nullptr && !p->heard && p->failure.ok()) still.push_back(id);
        }
        silent_.swap(still);
      }
      peer->address.assign(static_cast<const char*>(data), length);
      peer->name.assign(reinterpret_cast<const char*>(rest) + sizeof(uint64_t),
                        rest_length - sizeof(uint64_t));
      peer->instance = sender;
      by_instance_[sender] = peer;
    }
    std::string challenge;
    if (options_.verify_peer) {
      challenge = RandomChallenge(kChallengeBytes);
      // No randomness, no handshake: a one-byte challenge nobody can
      // answer (verify_peer refuses proofs over it).
      if (challenge.empty()) challenge = "?";
      peer->challenge = challenge;
    }
    Op* op = TakeOp();
    op->what = "hello answer";
    std::string answer;
    AppendU64(&answer, token);
    answer.push_back(static_cast<char>(challenge.size()));
    answer += challenge;
    answer += options_.name;
    op->SetHeader(instance_, answer.data(), answer.size());
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &UcxWorker::OnSendDone;
    p.user_data = op;
    const uint64_t generation = op->generation;
    Track(op, generation, ucp_am_send_nbx(param->reply_ep, kHelloAckAmId, op->header(), op->header_size,
                              nullptr, 0, &p));
  }

  void OnHelloAck(uint64_t sender, const uint8_t* rest, size_t rest_length) {
    if (rest_length < sizeof(uint64_t)) return;
    const uint64_t token = LoadU64(rest);
    if (token == kByeToken) return OnBye(sender);
    auto it = pending_connects_.find(token);
    if (it == pending_connects_.end()) return;  // Timed out meanwhile.
    if (rest_length < sizeof(uint64_t) + 1) return;
    const size_t challenge_len = rest[sizeof(uint64_t)];
    const size_t name_at = sizeof(uint64_t) + 1 + challenge_len;
    if (rest_length < name_at) return;
    std::shared_ptr<PendingConnect> pending = it->second;
    Peer* peer = pending->peer;
    peer->name.assign(reinterpret_cast<const char*>(rest) + name_at, rest_length - name_at);
    peer->instance = sender;
    // Messages from this peer are answered on the endpoint we opened.
    by_instance_.emplace(sender, peer);
    LogLanes(peer);
    if (challenge_len == 0) {
      FinishConnect(pending, absl::OkStatus());
      return;
    }
    // The peer verifies: prove who we are; Connect finishes with its verdict.
    const absl::string_view challenge(reinterpret_cast<const char*>(rest) + sizeof(uint64_t) + 1,
                                      challenge_len);
    std::pair<std::string, std::string> claim;
    if (options_.prove) claim = options_.prove(challenge);
    std::string body;
    AppendU64(&body, token);
    const uint16_t id_len = static_cast<uint16_t>(std::min<size_t>(claim.first.size(), 0xffff));
    body.append(reinterpret_cast<const char*>(&id_len), sizeof(id_len));
    body.append(claim.first, 0, id_len);
    body += claim.second;
    Op* op = TakeOp();
    op->what = "proof";
    op->SetHeader(instance_, body.data(), body.size());
    op->done = [this, pending](absl::Status s) {
      if (!s.ok()) FinishConnect(pending, s);
    };
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    p.cb.send = &UcxWorker::OnSendDone;
    p.user_data = op;
    const uint64_t generation = op->generation;
    Track(op, generation, ucp_am_send_nbx(peer->ep, kAuthAmId, op->header(), op->header_size,
                                          nullptr, 0, &p));
  }

  // A connecting peer's proof: verify it, answer on UCX's reply endpoint
  // (no endpoint is opened to an address before its peer is trusted).
  void OnAuth(uint64_t sender, const uint8_t* rest, size_t rest_length,
              const ucp_am_recv_param_t* param) {
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
        rest_length < sizeof(uint64_t) + sizeof(uint16_t)) {
      Refused("a malformed proof");
      return;
    }
    const uint64_t token = LoadU64(rest);
    uint16_t id_len = 0;
    std::memcpy(&id_len, rest + sizeof(uint64_t), sizeof(id_len));
    const size_t id_at = sizeof(uint64_t) + sizeof(uint16_t);
    absl::Status verdict;
    auto it = by_instance_.find(sender);
    if (rest_length < id_at + id_len) {
      verdict = absl::InvalidArgumentError("malformed proof");
    } else if (!options_.verify_peer) {
      verdict = absl::OkStatus();  // Asked for nothing: nothing to check.
    } else if (it == by_instance_.end() || it->second->challenge.empty()) {
      verdict = absl::UnauthenticatedError("a proof without a hello (or answered already)");
    } else {
      Peer* peer = it->second;
      const std::string challenge = std::move(peer->challenge);
      peer->challenge.clear();
      const absl::string_view identity(reinterpret_cast<const char*>(rest) + id_at, id_len);
      const absl::string_view proof(reinterpret_cast<const char*>(rest) + id_at + id_len,
                                    rest_length - id_at - id_len);
      verdict = options_.verify_peer(identity, challenge, proof);
      if (verdict.ok()) {
        peer->trusted = true;
        peer->identity.assign(identity.data(), identity.size());
      }
    }
    if (!verdict.ok()) {
      Refused(absl::StrCat("a peer's proof (", verdict.message(), ")"));
    }
    std::string answer;
    AppendU64(&answer, token);
    answer.push_back(static_cast<char>(verdict.code()));
    answer.append(verdict.message().data(), std::min<size_t>(verdict.message().size(), 512));
    Op* op = TakeOp();
    op->what = "proof answer";
    op->SetHeader(instance_, answer.data(), answer.size());
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &UcxWorker::OnSendDone;
    p.user_data = op;
    const uint64_t generation = op->generation;
    Track(op, generation, ucp_am_send_nbx(param->reply_ep, kAuthAckAmId, op->header(),
                                          op->header_size, nullptr, 0, &p));
  }

  void OnAuthAck(const uint8_t* rest, size_t rest_length) {
    if (rest_length < sizeof(uint64_t) + 1) return;
    auto it = pending_connects_.find(LoadU64(rest));
    if (it == pending_connects_.end()) return;  // Timed out meanwhile.
    const auto code = static_cast<absl::StatusCode>(rest[sizeof(uint64_t)]);
    const std::string message(reinterpret_cast<const char*>(rest) + sizeof(uint64_t) + 1,
                              rest_length - sizeof(uint64_t) - 1);
    std::shared_ptr<PendingConnect> pending = it->second;
    FinishConnect(pending, code == absl::StatusCode::kOk
                               ? absl::OkStatus()
                               : absl::Status(code, absl::StrCat("the peer refused this worker: ",
                                                                 message)));
  }

  // Counts a refusal; logs the first few and then every 1000th.
  void Refused(absl::string_view what) {
    const uint64_t n = refused_.fetch_add(1) + 1;
    if (n <= 10 || n % 1000 == 0) {
      OPTIMUS_LOG(Warning, kLog, options_.name, ": refused ", what, " (", n, " so far)");
    }
  }

  // A peer said goodbye: its worker is being destroyed. Keepalive would not
  // tell when its process lives on (shared memory checks the pid), so fail
  // every endpoint to it now. Ignored without detect_peer_failure (no dead
  // peer is reported then).
  void OnBye(uint64_t sender) {
    if (!options_.detect_peer_failure) return;
    for (auto& entry : peers_) {
      Peer* peer = entry.second.get();
      if (peer->instance != sender || !peer->failure.ok()) continue;
      const absl::Status s = absl::UnavailableError(
          absl::StrCat("peer worker ", PeerName(peer), " was destroyed"));
      OPTIMUS_LOG(Info, kLog, options_.name, ": ", PeerName(peer), " said goodbye");
      // Closing from inside UCX's callback is not allowed; do it right after.
      const uint64_t id = peer->id;
      Post([this, id, s] { FailPeerById(id, s); });
    }
  }

  // Teardown: tells each live peer this worker is going away (see OnBye),
  // opening the endpoint first to peers that only sent to us. Waits for
  // the goodbyes to go out until give_up.
  void SayGoodbye(absl::Time give_up) {
    int pending = 0;
    std::set<uint64_t> told;
    for (auto& entry : peers_) {
      Peer* peer = entry.second.get();
      if (!peer->failure.ok() || peer->instance == 0 || !told.insert(peer->instance).second) {
        continue;
      }
      // Never open an endpoint to an address a peer gave without proof.
      if (options_.verify_peer && !peer->trusted) continue;
      if (peer->ep == nullptr && !OpenEndpoint(peer).ok()) continue;
      Op* op = TakeOp();
      op->what = "goodbye";
      const uint64_t token = kByeToken;
      op->SetHeader(instance_, &token, sizeof(token));
      ++pending;
      op->done = [&pending](absl::Status) { --pending; };
      ucp_request_param_t prm;
      std::memset(&prm, 0, sizeof(prm));
      prm.op_attr_mask =
          UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
      prm.flags = UCP_AM_SEND_FLAG_EAGER;
      prm.cb.send = &UcxWorker::OnSendDone;
      prm.user_data = op;
      const uint64_t generation = op->generation;
      Track(op, generation, ucp_am_send_nbx(peer->ep, kHelloAckAmId, op->header(), op->header_size,
                                nullptr, 0, &prm));
    }
    while (pending > 0 && absl::Now() < give_up) {
      ucp_worker_progress(worker_);
      RunPosted();
    }
    if (pending > 0) {
      // Still in flight (a dead or slow peer): the endpoint closes below
      // complete them; their done must not touch `pending` then.
      for (Op* op = inflight_head_; op != nullptr; op = op->next) {
        if (std::strcmp(op->what, "goodbye") == 0) op->done = nullptr;
      }
    }
  }

  static void OnEpError(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* peer = static_cast<Peer*>(arg);
    UcxWorker* self = peer->owner;
    // Inside ucp_worker_destroy (an endpoint whose failure UCX had not
    // reported yet): nothing may touch UCX any more.
    if (self->destroying_) return;
    OPTIMUS_LOG(Warning, kLog, self->options_.name, ": endpoint to ", PeerName(peer),
                " failed: ", ucs_status_string(status));
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
    const uint64_t id = peer->id;
    self->Post([self, id, s] { self->FailPeerById(id, s); });
  }

  // Marks the peer failed and closes its endpoint; later Sends fail at once.
  // Not reported once this worker is closing (its owner is destroying it).
  // The peer is then forgotten (freed once UCX is done with it): its
  // instance no longer finds it, and EndpointRefs to it fail at Send.
  void FailPeer(Peer* peer, const absl::Status& s) {
    const bool first = peer->failure.ok();
    if (first) peer->failure = s;
    CloseEndpoint(peer);
    if (!first || closed_) return;
    auto it = by_instance_.find(peer->instance);
    if (it != by_instance_.end() && it->second == peer) by_instance_.erase(it);
    if (peer->incoming) --incoming_live_;
    dead_.push_back(peer->id);
    if (options_.on_peer_failure) options_.on_peer_failure(RefOf(peer->id), s);
    SweepDead();
  }

  void FailPeerById(uint64_t id, const absl::Status& s) {
    if (Peer* peer = FindPeer(id)) FailPeer(peer, s);
  }

  void CloseEndpoint(Peer* peer) {
    if (peer->ep == nullptr) return;
    ucp_request_param_t p;
    std::memset(&p, 0, sizeof(p));
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    // FORCE: do not wait for a peer that may be dead; its pending requests
    // complete with an error (in peer-failure mode; without it UCX 1.13
    // leaves a rendezvous send to a dead peer pending, checked).
    p.flags = UCP_EP_CLOSE_FLAG_FORCE;
    p.cb.send = &UcxWorker::OnCloseDone;
    p.user_data = peer;
    ucs_status_ptr_t st = ucp_ep_close_nbx(peer->ep, &p);
    if (st != nullptr && !UCS_PTR_IS_ERR(st)) {
      ++closing_;
      peer->closing = true;
    }
    peer->ep = nullptr;
    if (peer->failure.ok()) peer->failure = absl::UnavailableError("endpoint closed");
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

  // Runs what was posted, in order; returns whether the loop should stop.
  // Also hands the progress thread's recycled ops back to the shared list.
  bool RunPosted() {
    Op* batch;
    bool stop;
    Op* excess = nullptr;
    {
      absl::MutexLock lock(&mu_);
      batch = posted_head_;
      posted_head_ = posted_tail_ = nullptr;
      stop = stop_;
      sleeping_ = false;
      while (local_free_ != nullptr) {
        Op* op = local_free_;
        local_free_ = op->next;
        if (free_count_ >= kMaxFreeOps && !closed_) {
          op->next = excess;
          excess = op;
          continue;
        }
        op->next = free_ops_;
        free_ops_ = op;
        ++free_count_;
      }
      local_free_count_ = 0;
    }
    FreeOps(excess);
    while (batch != nullptr) {
      Op* op = batch;
      batch = op->next;
      op->next = nullptr;
      RunOp(op);
    }
    return stop;
  }

  void ProgressLoop() {
    progress_id_ = std::this_thread::get_id();
    absl::Time last_event = absl::InfinitePast();
    const absl::Duration spin = options_.progress_spin;
    for (;;) {
      bool any = false;
      while (ucp_worker_progress(worker_) != 0) {
        any = true;
      }
      if (RunPosted()) break;
      if (spin > absl::ZeroDuration()) {
        const absl::Time now = absl::Now();
        if (any) last_event = now;
        if (now - last_event < spin) continue;
      }
      if (efd_ < 0) {
        absl::SleepFor(kNoWakeupNap);
        continue;
      }
      const ucs_status_t st = ucp_worker_arm(worker_);
      if (st == UCS_ERR_BUSY) continue;  // Events arrived meanwhile.
      {
        absl::MutexLock lock(&mu_);
        if (posted_head_ != nullptr || stop_) continue;
        sleeping_ = true;  // Posts from now on signal the worker.
      }
      struct pollfd pfd = {efd_, POLLIN, 0};
      poll(&pfd, 1, kIdlePollTimeoutMs);
    }
    Teardown();
  }

  // On the progress thread (or in the destructor when it never started):
  // fail what is posted, drop kept payloads, say goodbye to peers, close
  // endpoints (which completes what is in flight with an error), destroy
  // the worker.
  void Teardown() {
    const absl::Time start = absl::Now();
    closed_ = true;
    RunPosted();  // Sends posted before the stop fail with Cancelled.
    for (const auto& [token, pending] : pending_connects_) {
      absl::MutexLock lock(&pending->mu);
      pending->done = true;
      pending->status = absl::CancelledError("connect: the UCX worker is shutting down");
    }
    pending_connects_.clear();
    for (Kept* k : kept_) {
      ucp_am_data_release(worker_, k->desc);
      delete k;
    }
    kept_.clear();
    SayGoodbye(start + kGoodbyeBudget);
    // Cancelling may complete ops at once (and their callbacks may post
    // more); cancel each op that is still the one we saw.
    std::vector<std::pair<Op*, uint64_t>> to_cancel;
    for (Op* op = inflight_head_; op != nullptr; op = op->next) {
      to_cancel.emplace_back(op, op->generation);
    }
    for (const auto& [op, generation] : to_cancel) {
      if (op->generation == generation && op->in_flight) ucp_request_cancel(worker_, op->request);
    }
    for (auto& entry : peers_) CloseEndpoint(entry.second.get());
    const absl::Time give_up = start + kTeardownBudget;
    while ((inflight_count_ > 0 || closing_ > 0) && absl::Now() < give_up) {
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
    destroying_ = true;
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
    // Requests UCX never completed (it gave up within the budget): their
    // memory went with the worker; tell their owners.
    const size_t left = inflight_count_;
    while (inflight_head_ != nullptr) {
      Op* op = inflight_head_;
      Complete(op, absl::CancelledError(
                       absl::StrCat(op->what, ": the UCX worker was destroyed first")));
    }
    if (left > 0 || closing_ > 0) {
      OPTIMUS_LOG(Warning, kLog, options_.name, ": teardown gave up on ", left,
                  " requests and ", closing_, " endpoint closes after ",
                  absl::FormatDuration(kTeardownBudget));
    }
  }

  const WorkerOptions options_;
  const uint64_t instance_;  // Identifies this worker in our message headers.
  // Tags its peer ids, so an EndpointRef of another worker is told apart.
  const uint64_t serial_ = NextWorkerSerial();
  std::atomic<size_t> peer_count_{0};
  std::atomic<uint64_t> hellos_refused_{0};
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
  Op* posted_head_ ABSL_GUARDED_BY(mu_) = nullptr;  // Posted ops, oldest first.
  Op* posted_tail_ ABSL_GUARDED_BY(mu_) = nullptr;
  Op* free_ops_ ABSL_GUARDED_BY(mu_) = nullptr;
  size_t free_count_ ABSL_GUARDED_BY(mu_) = 0;
  bool sleeping_ ABSL_GUARDED_BY(mu_) = false;  // The progress thread waits in poll.
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool worker_gone_ ABSL_GUARDED_BY(mu_) = false;  // Set just before ucp_worker_destroy.

  mutable absl::Mutex tls_mu_;
  std::vector<std::string> tls_in_use_ ABSL_GUARDED_BY(tls_mu_);  // In order first seen.

  // Progress thread only (or the destructor's thread once it has joined).
  Op* local_free_ = nullptr;  // Recycled here, handed to free_ops_ by RunPosted.
  size_t local_free_count_ = 0;
  Op* inflight_head_ = nullptr;
  size_t inflight_count_ = 0;
  // By id (Peer::id; EndpointRefs carry it). A map of unique_ptrs: Peers
  // do not move while UCX holds pointers to them (error handler, closes).
  std::map<uint64_t, std::unique_ptr<Peer>> peers_;
  std::vector<uint64_t> dead_;     // Failed peers, freed by SweepDead.
  std::deque<uint64_t> silent_;    // Incoming peers in hello order (EvictSilentPeer).
  size_t incoming_live_ = 0;       // Incoming peers not failed (<= max_peers).
  uint64_t next_peer_ = 1;
  std::map<uint64_t, Peer*> by_instance_;  // Sender instance id -> way back.
  std::map<uint64_t, std::shared_ptr<PendingConnect>> pending_connects_;  // By token.
  uint64_t next_token_ = 1;
  std::atomic<uint64_t> refused_{0};
  std::set<ucp_mem_h> regions_;
  std::set<Kept*> kept_;
  int closing_ = 0;  // Endpoint closes not yet completed.
  bool closed_ = false;
  bool destroying_ = false;  // In ucp_worker_destroy.
};

UcxMemoryRegion::~UcxMemoryRegion() {
  absl::MutexLock lock(&core_->mu);
  // A destroyed worker has unmapped everything already.
  if (core_->worker != nullptr) core_->worker->Unmap(memh_);
}

void UcxMessage::ReceiveInto(void* dst, const MemoryRegion* region, DoneCallback done) {
  if (taken_) {
    done(absl::FailedPreconditionError("payload already received"));
    return;
  }
  taken_ = true;
  absl::StatusOr<ucp_mem_h> memh = worker_->MemhOf(region);
  if (!is_rendezvous()) {
    if (!memh.ok()) return done(memh.status());
    if (length_ > 0) std::memcpy(dst, data_, length_);
    done(absl::OkStatus());
    return;
  }
  if (!memh.ok()) {
    // Not taken after all: the payload is dropped when the handler returns.
    return done(memh.status());
  }
  worker_->ReceiveRendezvous(data_, dst, length_, *memh, std::move(done));
}

std::unique_ptr<PendingPayload> UcxMessage::Keep() {
  if (taken_ || length_ == 0) return nullptr;
  taken_ = true;
  if (!is_rendezvous()) {
    std::unique_ptr<uint8_t[]> bytes(new uint8_t[length_]);
    std::memcpy(bytes.get(), data_, length_);
    return std::make_unique<UcxPendingPayload>(worker_->core(), std::move(bytes), length_);
  }
  kept_rendezvous_ = true;
  Kept* k = worker_->AddKept(data_, length_, sender_);
  return std::make_unique<UcxPendingPayload>(worker_->core(), k, length_);
}

EndpointRef UcxMessage::reply_endpoint() const {
  return UcxWorker::RefOf(sender_ != nullptr ? sender_->id : 0);
}

UcxPendingPayload::~UcxPendingPayload() {
  if (kept_ == nullptr || taken_.load()) return;
  absl::MutexLock lock(&core_->mu);
  UcxWorker* w = core_->worker;
  if (w == nullptr) return;  // Dropped with the worker.
  Kept* k = kept_;
  w->Post([w, k] { w->DropKept(k); });
}

void UcxPendingPayload::ReceiveInto(void* dst, const MemoryRegion* region, DoneCallback done) {
  if (taken_.exchange(true)) {
    done(absl::FailedPreconditionError("payload already received"));
    return;
  }
  absl::Status error;
  {
    absl::MutexLock lock(&core_->mu);
    UcxWorker* w = core_->worker;
    if (w == nullptr) {
      error = absl::CancelledError("receive: the UCX worker was destroyed first");
    } else {
      absl::StatusOr<ucp_mem_h> memh = w->MemhOf(region);
      if (!memh.ok() || (dst == nullptr && size_ > 0)) {
        error = memh.ok() ? absl::InvalidArgumentError("receive into a null buffer")
                          : memh.status();
        if (kept_ != nullptr) {
          Kept* k = kept_;
          w->Post([w, k] { w->DropKept(k); });  // Not received after all.
        }
      } else if (kept_ == nullptr) {
        if (size_ > 0) std::memcpy(dst, bytes_.get(), size_);
        w->Post([done = std::move(done)] { done(absl::OkStatus()); });
        return;
      } else {
        Kept* k = kept_;
        ucp_mem_h h = *memh;
        w->Post([w, k, dst, h, done = std::move(done)]() mutable {
          w->ReceiveKept(k, dst, h, std::move(done));
        });
        return;
      }
    }
  }
  done(std::move(error));
}

}  // namespace

std::vector<std::string> UcxDetectionEnvironment(absl::string_view tls) {
  std::vector<std::string> env;
  for (const DetectionSetting& s : DetectionSettings()) {
    if (!TlsLoadsAny(tls.empty() ? absl::string_view("all") : tls, s.for_tls)) continue;
    env.push_back(absl::StrCat(s.env.front(), "=", s.value));
  }
  return env;
}

absl::StatusOr<std::unique_ptr<Worker>> NewUcxWorker(const WorkerOptions& options) {
  auto w = std::make_unique<UcxWorker>(options);
  if (auto s = w->Init(); !s.ok()) return s;
  return std::unique_ptr<Worker>(std::move(w));
}

}  // namespace transport
}  // namespace optimus
