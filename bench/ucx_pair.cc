// bench/ucx_pair: what two bare UCX processes move with the settings of an
// optimus worker's peer-failure detection (UCP_ERR_HANDLING_MODE_PEER and
// transport::UcxDetectionEnvironment), in bursts shaped like a push: the
// sender posts --burst active messages of --size bytes from --buffers
// rotating buffers (a tensor's chunks, larger than the cache together),
// waits for all of them, and posts the next burst; the receiver takes each
// payload into rotating buffers of its own from inside its handler, as soon
// as it arrives. No optimus code runs in either process: the figure is what
// UCX and the host give a sender and a receiver that do nothing else, over
// tcp the ceiling for bench/dataplane's push and pull (over shared memory
// it is not one: this receiver reads over cma into 4 KiB pages on its one
// thread, where a shard receives into registered huge pages).
//
// Two ways to open the sender's endpoint, measured alternately --rounds
// times, one JSON line each:
//   addr  to the receiver's worker address (how optimus's workers connect);
//   cm    UCX's client-server flow: a listener and a socket address. Over
//         tcp these endpoints are connected end to end, and UCX 1.13 then
//         keeps tcp's zero-copy rendezvous lane (rma_bw) under
//         UCP_ERR_HANDLING_MODE_PEER, which address-connected tcp endpoints
//         lose ("lanes" in each line says which lanes the sender got).
// --gap_ms idles the sender between bursts (uncounted) and --evict_mb has
// the receiver (or, --evict_on=sender, the sender inside the gap) stream
// other memory between bursts, as a shard's steps and a worker's pull do
// between two pushes.
// The cm line carries ratio_to_addr (its goodput over the addr line of the
// same round), the baseline being the way optimus connects today.
//
//   bazel run -c opt //bench:ucx_pair -- --tls=tcp --size=4194304 --rounds=3
#include <sched.h>
#include <sys/prctl.h>
#include <signal.h>
#include <sys/wait.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/json.h"
#include "transport/ucx.h"

ABSL_FLAG(std::string, tls, "tcp", "UCX_TLS for both processes (UCX_NET_DEVICES=lo)");
ABSL_FLAG(uint64_t, size, 4 << 20, "bytes per message");
ABSL_FLAG(int, count, 1000, "timed messages per measurement (a tenth more go first, untimed)");
ABSL_FLAG(int, burst, 8, "messages posted at once; the next burst waits for all of them");
ABSL_FLAG(int, buffers, 8, "rotating buffers on each side (8 x 4 MiB: a 32 MiB tensor)");
ABSL_FLAG(int, rounds, 3, "alternating rounds of addr and cm");
ABSL_FLAG(double, gap_ms, 0,
          "idle time between bursts, not counted (the send direction idle, as while optimus "
          "pulls the next version between two pushes)");
ABSL_FLAG(int64_t, evict_mb, 0,
          "between bursts, the process named by --evict_on reads and writes this many MiB of "
          "other memory, as a shard's steps stream the optimizer state between two pushes (use "
          "with --gap_ms long enough to cover it, so that the sender's clock does not count it)");
ABSL_FLAG(std::string, evict_on, "receiver",
          "which process makes the --evict_mb pass: receiver (after each landed burst) or "
          "sender (before each burst after the first, inside the uncounted --gap_ms)");
ABSL_FLAG(double, timeout_s, 120, "give up on a measurement after this long");

namespace {

constexpr uint16_t kAmId = 1;

// --evict_mb's memory for the process named by --evict_on (empty in the
// other one).
std::vector<float> EvictionState(const char* side) {
  if (absl::GetFlag(FLAGS_evict_on) != side) return {};
  return std::vector<float>(static_cast<size_t>(absl::GetFlag(FLAGS_evict_mb)) << 18, 1.0f);
}

// One pass shaped like an optimizer step (read, update, write back); the
// sum goes to a volatile so that the pass is not dropped.
void EvictionPass(std::vector<float>& state) {
  static volatile float sink = 0;
  float sum = 0;
  for (float& x : state) {
    x = x * 0.999f + 0.001f;
    sum += x;
  }
  sink = sink + sum;
}

struct Ucx {
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  bool failed = false;
  std::string failure;
};

bool Init(Ucx* u) {
  ucp_params_t p;
  std::memset(&p, 0, sizeof(p));
  p.field_mask = UCP_PARAM_FIELD_FEATURES;
  p.features = UCP_FEATURE_AM;
  if (ucp_init(&p, nullptr, &u->context) != UCS_OK) return false;
  ucp_worker_params_t w;
  std::memset(&w, 0, sizeof(w));
  w.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  w.thread_mode = UCS_THREAD_MODE_SINGLE;
  return ucp_worker_create(u->context, &w, &u->worker) == UCS_OK;
}

void OnEpError(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* u = static_cast<Ucx*>(arg);
  u->failed = true;
  u->failure = ucs_status_string(status);
}

// The CPUs this process was allowed at start: the sender takes the first,
// the receiver the second (as bench/dataplane's split placement), or both
// share them when there is only one.
cpu_set_t g_allowed;
bool g_pin = false;

void PinTo(int nth_allowed) {
  if (!g_pin) return;
  const cpu_set_t& allowed = g_allowed;
  int seen = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    if (seen++ == nth_allowed) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      sched_setaffinity(0, sizeof(one), &one);
      return;
    }
  }
}

bool WriteAll(int fd, const void* data, size_t n) {
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = write(fd, p, n);
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* data, size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = read(fd, p, n);
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

// ---- Receiver (the child process) ----

struct Receiver {
  Ucx ucx;
  std::vector<char> buffers;
  size_t size = 0;
  int nbuf = 1;
  long arrived = 0;
  long landed = 0;
  ucp_ep_h ep = nullptr;  // cm: the endpoint made from the connection request.
};

void OnLanded(void* request, ucs_status_t, size_t, void* arg) {
  ++static_cast<Receiver*>(arg)->landed;
  ucp_request_free(request);
}

ucs_status_t OnMessage(void* arg, const void*, size_t, void* data, size_t length,
                       const ucp_am_recv_param_t* param) {
  auto* r = static_cast<Receiver*>(arg);
  if (length > r->size) return UCS_OK;
  char* dst = r->buffers.data() + (r->arrived++ % r->nbuf) * r->size;
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    std::memcpy(dst, data, length);
    ++r->landed;
    return UCS_OK;
  }
  ucp_request_param_t p;
  std::memset(&p, 0, sizeof(p));
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = &OnLanded;
  p.user_data = r;
  void* request = ucp_am_recv_data_nbx(r->ucx.worker, data, dst, length, &p);
  if (request == nullptr) ++r->landed;
  return UCS_OK;
}

void OnConnection(ucp_conn_request_h request, void* arg) {
  auto* r = static_cast<Receiver*>(arg);
  ucp_ep_params_t p;
  std::memset(&p, 0, sizeof(p));
  p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                 UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.conn_request = request;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = &OnEpError;
  p.err_handler.arg = &r->ucx;
  if (ucp_ep_create(r->ucx.worker, &p, &r->ep) != UCS_OK) r->ep = nullptr;
}

// Writes to `fd` what the sender connects to (the worker address, or the
// listener's port), then receives `expect` messages.
int RunReceiver(bool cm, int fd, long expect) {
  PinTo(1);
  Receiver r;
  r.size = absl::GetFlag(FLAGS_size);
  r.nbuf = std::max(1, absl::GetFlag(FLAGS_buffers));
  r.buffers.assign(r.size * r.nbuf, 0);
  if (!Init(&r.ucx)) return 1;
  ucp_am_handler_param_t h;
  std::memset(&h, 0, sizeof(h));
  h.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                 UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  h.id = kAmId;
  h.cb = &OnMessage;
  h.arg = &r;
  h.flags = UCP_AM_FLAG_WHOLE_MSG;
  if (ucp_worker_set_am_recv_handler(r.ucx.worker, &h) != UCS_OK) return 1;
  std::string what;
  ucp_listener_h listener = nullptr;
  if (cm) {
    sockaddr_in sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sin_family = AF_INET;
    sa.sin_port = 0;
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    ucp_listener_params_t lp;
    std::memset(&lp, 0, sizeof(lp));
    lp.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lp.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    lp.sockaddr.addrlen = sizeof(sa);
    lp.conn_handler.cb = &OnConnection;
    lp.conn_handler.arg = &r;
    if (ucp_listener_create(r.ucx.worker, &lp, &listener) != UCS_OK) return 1;
    ucp_listener_attr_t la;
    la.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    if (ucp_listener_query(listener, &la) != UCS_OK) return 1;
    const uint16_t port = ntohs(reinterpret_cast<const sockaddr_in*>(&la.sockaddr)->sin_port);
    what.assign(reinterpret_cast<const char*>(&port), sizeof(port));
  } else {
    ucp_address_t* address = nullptr;
    size_t length = 0;
    if (ucp_worker_get_address(r.ucx.worker, &address, &length) != UCS_OK) return 1;
    what.assign(reinterpret_cast<const char*>(address), length);
    ucp_worker_release_address(r.ucx.worker, address);
  }
  const uint64_t n = what.size();
  if (!WriteAll(fd, &n, sizeof(n)) || !WriteAll(fd, what.data(), what.size())) return 1;
  close(fd);
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(absl::GetFlag(FLAGS_timeout_s));
  // --evict_mb: a pass shaped like an optimizer step (read, update, write
  // back) over memory the payloads do not use, once per landed burst.
  std::vector<float> state = EvictionState("receiver");
  const long burst = std::max(1, absl::GetFlag(FLAGS_burst));
  long evicted_at = 0;
  while (r.landed < expect && !r.ucx.failed && std::chrono::steady_clock::now() < give_up) {
    ucp_worker_progress(r.ucx.worker);
    if (!state.empty() && r.landed - evicted_at >= burst) {
      evicted_at = r.landed - r.landed % burst;
      EvictionPass(state);
    }
  }
  // Let the sender see its last completions before this process goes.
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(300);
  while (std::chrono::steady_clock::now() < until) ucp_worker_progress(r.ucx.worker);
  return r.landed >= expect ? 0 : 1;
}

// ---- Sender (this process) ----

struct Result {
  double gbps = 0;
  std::string lanes;
  std::string error;
};

std::string LanesOf(ucp_ep_h ep) {
  char* text = nullptr;
  size_t size = 0;
  FILE* f = open_memstream(&text, &size);
  if (f == nullptr) return "";
  ucp_ep_print_info(ep, f);
  std::fclose(f);
  std::vector<std::string> lanes;
  for (absl::string_view line : absl::StrSplit(absl::string_view(text, size), '\n')) {
    const size_t at = line.find("lane[");
    if (at == absl::string_view::npos) continue;
    std::vector<absl::string_view> words = absl::StrSplit(line.substr(at), ' ', absl::SkipWhitespace());
    lanes.push_back(absl::StrJoin(words, " "));
  }
  std::free(text);
  return absl::StrJoin(lanes, "; ");
}

Result Measure(bool cm) {
  Result out;
  const size_t size = absl::GetFlag(FLAGS_size);
  const long count = std::max(1, absl::GetFlag(FLAGS_count));
  const long warm = std::max(1L, count / 10);
  int pipe_fd[2];
  if (pipe(pipe_fd) != 0) return {0, "", "pipe failed"};
  const pid_t child = fork();
  if (child < 0) return {0, "", "fork failed"};
  if (child == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // Never outlives the sender.
    close(pipe_fd[0]);
    _exit(RunReceiver(cm, pipe_fd[1], count + warm));
  }
  close(pipe_fd[1]);
  auto finish = [&](Result r) {
    int status = 0;
    if (!r.error.empty()) kill(child, SIGKILL);
    waitpid(child, &status, 0);
    return r;
  };
  uint64_t n = 0;
  std::string what;
  if (!ReadAll(pipe_fd[0], &n, sizeof(n)) || n > (1 << 20)) {
    close(pipe_fd[0]);
    return finish({0, "", "the receiver did not start"});
  }
  what.resize(n);
  const bool got = ReadAll(pipe_fd[0], what.data(), n);
  close(pipe_fd[0]);
  if (!got) return finish({0, "", "the receiver did not start"});
  PinTo(0);
  Ucx u;
  if (!Init(&u)) return finish({0, "", "ucp_init failed"});
  sockaddr_in sa;
  std::memset(&sa, 0, sizeof(sa));
  ucp_ep_params_t p;
  std::memset(&p, 0, sizeof(p));
  p.field_mask = UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  p.err_handler.cb = &OnEpError;
  p.err_handler.arg = &u;
  if (cm) {
    uint16_t port = 0;
    std::memcpy(&port, what.data(), sizeof(port));
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port);
    inet_pton(AF_INET, "127.0.0.1", &sa.sin_addr);
    p.field_mask |= UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
    p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    p.sockaddr.addrlen = sizeof(sa);
  } else {
    p.field_mask |= UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    p.address = reinterpret_cast<const ucp_address_t*>(what.data());
  }
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(u.worker, &p, &ep) != UCS_OK) return finish({0, "", "ucp_ep_create failed"});
  const int nbuf = std::max(1, absl::GetFlag(FLAGS_buffers));
  const int burst = std::max(1, absl::GetFlag(FLAGS_burst));
  std::vector<char> buffers(size * nbuf, 1);
  std::vector<void*> in_flight;
  long sent = 0, done = 0;
  const std::chrono::duration<double, std::milli> gap(absl::GetFlag(FLAGS_gap_ms));
  // --evict_on=sender: the pass runs at the start of each gap.
  std::vector<float> sender_state = EvictionState("sender");
  std::chrono::duration<double> idle(0);
  auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::duration<double>(absl::GetFlag(FLAGS_timeout_s));
  while (done < count + warm && !u.failed) {
    if (std::chrono::steady_clock::now() > deadline) {
      u.failed = true;
      u.failure = "timed out";
      break;
    }
    if (in_flight.empty()) {
      if (gap.count() > 0 && sent > 0) {
        const auto idle_from = std::chrono::steady_clock::now();
        if (!sender_state.empty()) EvictionPass(sender_state);
        while (std::chrono::steady_clock::now() - idle_from < gap) ucp_worker_progress(u.worker);
        idle += std::chrono::steady_clock::now() - idle_from;
      }
      for (int i = 0; i < burst && sent < count + warm; ++i, ++sent) {
        ucp_request_param_t sp;
        std::memset(&sp, 0, sizeof(sp));
        void* request = ucp_am_send_nbx(ep, kAmId, nullptr, 0,
                                        buffers.data() + (sent % nbuf) * size, size, &sp);
        if (UCS_PTR_IS_ERR(request)) {
          u.failed = true;
          u.failure = ucs_status_string(UCS_PTR_STATUS(request));
          break;
        }
        if (request == nullptr) {
          ++done;
        } else {
          in_flight.push_back(request);
        }
      }
    }
    ucp_worker_progress(u.worker);
    for (size_t i = 0; i < in_flight.size();) {
      if (ucp_request_check_status(in_flight[i]) == UCS_INPROGRESS) {
        ++i;
        continue;
      }
      ucp_request_free(in_flight[i]);
      in_flight[i] = in_flight.back();
      in_flight.pop_back();
      if (++done == warm) {
        start = std::chrono::steady_clock::now();
        idle = std::chrono::duration<double>(0);
      }
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start - idle).count();
  out.lanes = LanesOf(ep);
  if (u.failed) {
    out.error = u.failure;
  } else {
    out.gbps = static_cast<double>(count) * static_cast<double>(size) / seconds / 1e9;
  }
  for (void* request : in_flight) {
    ucp_request_cancel(u.worker, request);
    ucp_request_free(request);
  }
  ucp_request_param_t cp;
  std::memset(&cp, 0, sizeof(cp));
  cp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  cp.flags = UCP_EP_CLOSE_FLAG_FORCE;
  void* closing = ucp_ep_close_nbx(ep, &cp);
  while (closing != nullptr && !UCS_PTR_IS_ERR(closing) &&
         ucp_request_check_status(closing) == UCS_INPROGRESS) {
    ucp_worker_progress(u.worker);
  }
  if (closing != nullptr && !UCS_PTR_IS_ERR(closing)) ucp_request_free(closing);
  ucp_worker_destroy(u.worker);
  ucp_cleanup(u.context);
  return finish(out);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_evict_mb) < 0 || absl::GetFlag(FLAGS_evict_mb) > (int64_t{1} << 20)) {
    std::fprintf(stderr, "ucx_pair: --evict_mb must be 0 to 1048576\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_evict_on) != "receiver" && absl::GetFlag(FLAGS_evict_on) != "sender") {
    std::fprintf(stderr, "ucx_pair: --evict_on must be receiver or sender\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_evict_mb) > 0 && absl::GetFlag(FLAGS_evict_on) == "sender" &&
      absl::GetFlag(FLAGS_gap_ms) <= 0) {
    // The sender's pass runs inside the gap: without one it would never run.
    std::fprintf(stderr, "ucx_pair: --evict_on=sender needs --gap_ms above 0\n");
    return 2;
  }
  g_pin = sched_getaffinity(0, sizeof(g_allowed), &g_allowed) == 0 && CPU_COUNT(&g_allowed) >= 2;
  const std::string tls = absl::GetFlag(FLAGS_tls);
  // What an optimus worker would run with; the environment wins where it
  // sets a variable, as it does for optimus.
  setenv("UCX_TLS", tls.c_str(), 0);
  setenv("UCX_NET_DEVICES", "lo", 0);
  for (const std::string& kv : optimus::transport::UcxDetectionEnvironment(tls)) {
    const size_t eq = kv.find('=');
    setenv(kv.substr(0, eq).c_str(), kv.substr(eq + 1).c_str(), 0);
  }
  int failures = 0;
  for (int round = 1; round <= absl::GetFlag(FLAGS_rounds); ++round) {
    double addr_gbps = 0;
    for (bool cm : {false, true}) {
      const Result r = Measure(cm);
      optimus::Json line = optimus::Json::object();
      line["bench"] = "ucx_pair";
      line["tls"] = tls;
      line["connect"] = cm ? "cm" : "addr";
      line["round"] = round;
      line["msg_bytes"] = absl::GetFlag(FLAGS_size);
      line["burst"] = absl::GetFlag(FLAGS_burst);
      line["buffers"] = absl::GetFlag(FLAGS_buffers);
      line["gap_ms"] = absl::GetFlag(FLAGS_gap_ms);
      line["evict_mb"] = absl::GetFlag(FLAGS_evict_mb);
      line["evict_on"] = absl::GetFlag(FLAGS_evict_on);
      line["lanes"] = r.lanes;
      if (!r.error.empty()) {
        line["error"] = r.error;
        ++failures;
      } else {
        line["gbps"] = optimus::JsonRound(r.gbps, 3);
        if (!cm) addr_gbps = r.gbps;
        if (cm && addr_gbps > 0) line["ratio_to_addr"] = optimus::JsonRound(r.gbps / addr_gbps, 3);
      }
      std::printf("%s\n", optimus::JsonDump(line).c_str());
      std::fflush(stdout);
    }
  }
  return failures == 0 ? 0 : 1;
}
