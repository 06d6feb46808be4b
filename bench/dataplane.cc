// bench/dataplane: optimus's data plane against ucx_perftest on the same
// transport and message size (issue 12). The coordinator and the shards are
// the real binaries (//coordinator:optimus-coord, //server:optimus-shard),
// started as child processes exactly as a deployment starts them, so the
// shards are separate processes reached over real UCX; the workers are
// liboptimus clients, one thread each, in this process. Prints one JSON
// object per line:
//
//   cluster      once per (transport, shards): the exact commands started.
//   push, pull   per (transport, message size, workers W, shards S): the
//                goodput of pushing (or pulling) one bf16 tensor cut into
//                chunks of msg_bytes of payload (the job's
//                chunk_payload_bytes): bytes moved by all W workers together /
//                wall time, in GB/s (1e9 bytes/s). Push phases time only the
//                pushes of a step (every worker sends every chunk, the shards
//                answer as each lands), then pull the next version untimed (the
//                shards must have applied the step before the next push); pull
//                phases pull the published version over and over. Requests are
//                issued corked (Client::Cork), as the torch adapters issue
//                them: a pull's requests, which carry no payload, go in one
//                message per shard (--goodput_cork=false: one per chunk). Each
//                iteration runs from the first worker's start to the last
//                worker's end; optimus_gbps is the median iteration. Baseline:
//                ucx_perftest -t ucp_am_bw, one client and one server process,
//                same UCX_TLS and message size, run right before the case, the
//                median of --perftest_repeats runs; ratio = optimus_gbps /
//                ucx_perftest_gbps, and the same for the best iteration and the
//                best run (ratio_best). Two more baselines: ucx_perftest -e
//                with the UCX settings of optimus's peer-failure detection
//                (ucx_perftest_detect_gbps, ratio_detect: the transports
//                optimus runs on; over tcp UCX 1.13 then has no zero-copy
//                rendezvous lane), and perftest with one message of the
//                tensor's size (ratio_ws: buffers as large as the case's).
//                Also: the shards' memory_used and RSS, the step tail from
//                /metrics when the shard exports it, allocations per message in
//                this (the workers') process.
//   small_tensors  steps per second (pull every tensor, push every tensor)
//                of a job of --small_tensors tensors of --small_elems
//                elements, against a job of one tensor of the same bytes
//                (the baseline: the same bytes in a few large chunks), in
//                alternating phases; the ratio, messages per second and
//                allocations per message.
//
// Usage: bazel run -c opt //bench:dataplane -- [--cases=goodput,small_tensors]
//        [--tls='tcp;sm'] [--sizes=64K,256K,1M,4M] [--workers=1,2]
//        [--shards=1,2] [--seconds=1] [--tensor_mib=32]
//        [--small_tensors=2000 --small_elems=4096 --small_steps=10]
// Each --tls entry is a UCX_TLS value given to the shards (--transports),
// to the workers (WorkerOptions::transports) and to ucx_perftest. A
// transport optimus cannot connect over has its cases printed with an
// "error" and skipped.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <new>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/proc_cluster.h"
#include "client/client.h"
#include "common/dtype.h"
#include "common/grpc_status.h"
#include "common/http_server.h"
#include "common/huge_pages.h"
#include "common/json.h"
#include "grpcpp/grpcpp.h"
#include "proto/optimus.grpc.pb.h"
#include "transport/ucx.h"

ABSL_FLAG(std::string, cases, "goodput,small_tensors,staging",
          "which cases: goodput, small_tensors, staging");
ABSL_FLAG(std::string, tls, "tcp;sm", "';'-separated UCX_TLS values, one set of cases each");
ABSL_FLAG(std::string, sizes, "64K,256K,1M,4M", "message (chunk payload) sizes: N, NK, NM");
ABSL_FLAG(std::string, workers, "1,2", "worker counts W");
ABSL_FLAG(std::string, shards, "1,2", "shard counts S");
ABSL_FLAG(double, seconds, 1.0, "target length of each timed phase, seconds");
ABSL_FLAG(bool, user_huge_pages, true,
          "goodput: the workers' gradient and parameter buffers are mapped like the torch "
          "adapters' staging arenas (2 MiB aligned, advised for transparent huge pages); false: "
          "ordinary 4 KiB pages");
ABSL_FLAG(bool, goodput_cork, true,
          "goodput: issue each push and pull under Client::Cork, as ModuleSync and the Python "
          "optimizer do (a pull's requests, which carry no payload, go in one message per "
          "shard); false: one request message per chunk");
ABSL_FLAG(int64_t, tensor_mib, 32, "goodput: MiB of bf16 payload per worker per push or pull");
ABSL_FLAG(bool, commit_round, false,
          "goodput and small_tensors: jobs with a commit round (skip_nonfinite, the JobDef "
          "default): a push is answered after its chunk's reduce (a norm pass on a step "
          "thread) and the step runs after every chunk's commit, so the timed pushes do not "
          "share the shard's cores with steps");
ABSL_FLAG(std::string, optimizer, "sgd", "the jobs' optimizer: sgd (lightest step) or adamw");
ABSL_FLAG(int, small_tensors, 2000, "small_tensors: tensors in the job");
ABSL_FLAG(int64_t, small_elems, 4096, "small_tensors: elements per tensor");
ABSL_FLAG(int, small_steps, 10, "small_tensors: timed steps per phase");
ABSL_FLAG(int, small_rounds, 2, "small_tensors: phases of each job, alternating");
ABSL_FLAG(int, small_workers, 2, "small_tensors: workers");
ABSL_FLAG(std::string, staging_workers, "8,2",
          "staging: worker counts; each runs the staging pool against the all-slots layout");
ABSL_FLAG(int64_t, staging_params, int64_t{64} << 20, "staging: parameters in the job");
ABSL_FLAG(int, staging_steps, 3, "staging: timed steps per layout");
ABSL_FLAG(int64_t, staging_pool_mb, 0,
          "staging: the pool layout's --staging_mb (0: an eighth of the budget, at least 256)");
ABSL_FLAG(double, staging_pace_ms, 0,
          "staging: > 0: the job is one tensor per 4 MiB chunk and each worker pushes them one "
          "at a time this many ms apart, as a backward pass hands out layers (the publish tail "
          "then shows the step's own latency, not a queue of chunks landed at once); 0: one "
          "tensor pushed whole");
ABSL_FLAG(std::string, staging_tls, "", "staging: UCX_TLS (empty: UCX's choice)");
ABSL_FLAG(bool, small_batch, true,
          "small_tensors: cork each step's pulls and pushes (Client::Cork: small chunks go in "
          "one message per shard); false: one message per chunk");
ABSL_FLAG(int, small_shards, 2, "small_tensors: shards");
ABSL_FLAG(std::string, small_tls, "tcp", "small_tensors: UCX_TLS");
ABSL_FLAG(std::string, ucx_perftest, "ucx_perftest", "ucx_perftest binary (PATH is searched)");
ABSL_FLAG(int, perftest_repeats, 5, "ucx_perftest runs per case; the median is the baseline");
ABSL_FLAG(bool, perftest_detect, true,
          "goodput: also run ucx_perftest -e with the UCX settings of optimus's peer-failure "
          "detection (ucx_perftest_detect_gbps, ratio_detect)");
ABSL_FLAG(int64_t, perftest_mib, 256, "MiB each ucx_perftest run sends");
ABSL_FLAG(int, shard_memory_mb, 3072, "each shard's --memory_limit_mb");
ABSL_FLAG(std::string, shard_args, "", "extra optimus-shard flags, space-separated");
ABSL_FLAG(bool, shard_huge_pages, true,
          "start the shards with --huge_pages (as the Helm chart does); false: 4 KiB pages");
ABSL_FLAG(std::string, step_tail_metric, "optimus_shard_publish_tail_seconds",
          "the shard's histogram of 'last push landed -> version pullable' (read if present)");
ABSL_FLAG(std::string, bin_dir, "", "folder holding coordinator/optimus-coord and "
                                    "server/optimus-shard (default: this program's runfiles)");
ABSL_FLAG(std::string, work_dir, "", "folder for logs (default: a new temp dir)");
ABSL_FLAG(std::string, placement, "split",
          "split: the workers (this process, and ucx_perftest's client) on the first half "
          "of the CPUs, the coordinator and shards (and ucx_perftest's server) on the other "
          "half, as a shard with cores of its own (a DPU's, or a host's given to it) runs; "
          "shared: wherever the scheduler puts them. Needs 2+ CPUs and taskset, else shared");

// Where the benchmark's processes run (--placement): `workers` and `servers`
// are taskset -c lists, both empty when nothing is pinned.
struct Placement {
  std::string name = "shared";
  std::string workers, servers;
};
Placement g_placement;

// Pins this process (before it starts any thread) to the workers' CPUs and
// says which CPUs the servers get.
Placement MakePlacement(const std::string& want) {
  Placement p;
  if (want != "split" && want != "shared") {
    std::fprintf(stderr, "bench/dataplane: --placement must be split or shared, not %s\n",
                 want.c_str());
    std::exit(2);
  }
  // The CPUs this process may run on (a container's cpuset may hold fewer
  // than the machine has), split in two halves.
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
    }
  }
  const bool taskset = access("/usr/bin/taskset", X_OK) == 0 || access("/bin/taskset", X_OK) == 0;
  if (want != "split" || cpus.size() < 2 || !taskset) {
    if (want == "split") {
      std::fprintf(stderr, "bench/dataplane: --placement=split needs 2+ CPUs and taskset; "
                           "running shared\n");
    }
    return p;
  }
  const size_t half = cpus.size() / 2;
  cpu_set_t set;
  CPU_ZERO(&set);
  for (size_t i = 0; i < half; ++i) CPU_SET(cpus[i], &set);
  if (sched_setaffinity(0, sizeof(set), &set) != 0) {
    std::fprintf(stderr, "bench/dataplane: sched_setaffinity: %s; running shared\n",
                 std::strerror(errno));
    return p;
  }
  p.name = "split";
  p.workers = absl::StrJoin(cpus.begin(), cpus.begin() + half, ",");
  p.servers = absl::StrJoin(cpus.begin() + half, cpus.end(), ",");
  return p;
}

// What the lines say of it.
std::string PlacementText() {
  return g_placement.name == "split"
             ? absl::StrCat("split: workers on CPUs ", g_placement.workers, ", servers on ",
                            g_placement.servers)
             : std::string("shared");
}

// ---- Allocation counter: every operator new in this process (the workers:
// client library, transport, gRPC). The shards run in other processes. ----
// GCC flags free() of what (our) operator new returned once both inline.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
namespace {
std::atomic<uint64_t> g_allocations{0};
}  // namespace

void* operator new(size_t n) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) { return operator new(n); }
void* operator new(size_t n, const std::nothrow_t&) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(n == 0 ? 1 : n);
}
void* operator new[](size_t n, const std::nothrow_t& t) noexcept { return operator new(n, t); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

namespace optimus {
namespace bench {
namespace {

uint64_t Allocations() { return g_allocations.load(std::memory_order_relaxed); }

}  // namespace

// Where the JSON lines go (set by main).
FILE* g_out = stdout;

namespace {

// ---- Child processes (bench/proc_cluster) ----

[[noreturn]] void Die(const std::string& msg) { bench::Die("bench/dataplane", msg); }

// GET http://127.0.0.1:port/path (common/http_server's client); the body,
// or empty.
std::string HttpGetBody(int port, const std::string& path) {
  return optimus::HttpGet(port, path).value_or("");
}

// VmRSS of a process, bytes (0 if unknown).
uint64_t RssBytes(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (absl::StartsWith(line, "VmRSS:")) {
      uint64_t kb = 0;
      std::istringstream(line.substr(6)) >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

// CPU time (user + system) of this process so far, seconds.
double SelfCpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// CPU time (user + system) of another process so far, seconds.
double ProcCpuSeconds(pid_t pid) {
  std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  const size_t paren = stat.rfind(')');
  if (paren == std::string::npos) return 0;
  std::vector<std::string> f = absl::StrSplit(stat.substr(paren + 2), ' ');
  // Fields 14 and 15 of stat (utime, stime) are 11 and 12 after the name.
  double ut = 0, st = 0;
  if (f.size() < 13 || !absl::SimpleAtod(f[11], &ut) || !absl::SimpleAtod(f[12], &st)) return 0;
  return (ut + st) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// ---- /metrics ----

// Prometheus text: sample name (with labels stripped) -> summed value, and
// histogram buckets by their "le".
struct Metrics {
  std::map<std::string, double> values;
  std::map<std::string, std::map<double, double>> buckets;  // name -> le -> count
};

Metrics ParseMetrics(const std::string& text) {
  Metrics m;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.empty() || line[0] == '#') continue;
    const size_t sp = line.rfind(' ');
    if (sp == absl::string_view::npos) continue;
    double v = 0;
    if (!absl::SimpleAtod(line.substr(sp + 1), &v)) continue;
    absl::string_view key = line.substr(0, sp);
    const size_t brace = key.find('{');
    const std::string name(key.substr(0, brace));
    if (absl::EndsWith(name, "_bucket") && brace != absl::string_view::npos) {
      const size_t le = key.find("le=\"");
      if (le == absl::string_view::npos) continue;
      absl::string_view rest = key.substr(le + 4);
      rest = rest.substr(0, rest.find('"'));
      double bound = 0;
      if (rest == "+Inf") {
        bound = INFINITY;
      } else if (!absl::SimpleAtod(rest, &bound)) {
        continue;
      }
      m.buckets[name.substr(0, name.size() - 7)][bound] += v;
      continue;
    }
    m.values[name] += v;
  }
  return m;
}

// The step tail between two scrapes of the same shard, as a JSON object, or
// null when the shard does not export the metric.
Json StepTailJson(const Metrics& before, const Metrics& after) {
  std::string name = absl::GetFlag(FLAGS_step_tail_metric);
  if (after.values.count(name + "_count") == 0) {
    // Whatever the shard calls it: a histogram named like a tail.
    name.clear();
    for (const auto& [n, v] : after.values) {
      if (absl::EndsWith(n, "_count") && (n.find("tail") != std::string::npos ||
                                          n.find("pullable") != std::string::npos)) {
        name = n.substr(0, n.size() - 6);
        break;
      }
    }
    if (name.empty()) return nullptr;
  }
  auto get = [](const Metrics& m, const std::string& k) {
    auto it = m.values.find(k);
    return it == m.values.end() ? 0.0 : it->second;
  };
  const double count = get(after, name + "_count") - get(before, name + "_count");
  const double sum = get(after, name + "_sum") - get(before, name + "_sum");
  Json out;
  out["metric"] = name;
  out["count"] = static_cast<uint64_t>(count);  // A sample count, whole.
  out["mean_s"] = count > 0 ? sum / count : 0.0;
  auto ab = after.buckets.find(name);
  if (ab != after.buckets.end() && count > 0) {
    auto bb = before.buckets.find(name);
    for (double q : {0.5, 0.99}) {
      for (const auto& [le, c] : ab->second) {
        double prev = 0;
        if (bb != before.buckets.end()) {
          auto it = bb->second.find(le);
          if (it != bb->second.end()) prev = it->second;
        }
        if (c - prev >= q * count) {
          const Json bound = std::isinf(le) ? Json("+Inf") : Json(le);
          out[q == 0.5 ? "p50_le_s" : "p99_le_s"] = bound;
          break;
        }
      }
    }
  }
  return out;
}

// ---- A cluster of real processes ----

absl::Status StartCluster(const std::string& root, const std::string& dir,
                          const std::string& tls, int num_shards, ProcCluster* c,
                          const std::vector<std::string>& extra_shard_args = {}) {
  ProcClusterOptions o;
  o.bin_root = root;
  o.work_dir = dir;
  o.num_shards = num_shards;
  o.transports = tls;
  o.shard_memory_mb = static_cast<uint64_t>(absl::GetFlag(FLAGS_shard_memory_mb));
  o.metrics = true;
  o.cpus = g_placement.servers;
  // As the Helm chart deploys them (dpu.hugePages, host.hugePages); a
  // --huge_pages in --shard_args comes later and wins.
  o.shard_args.push_back(
      absl::StrCat("--huge_pages=", absl::GetFlag(FLAGS_shard_huge_pages) ? "true" : "false"));
  for (absl::string_view a :
       absl::StrSplit(absl::GetFlag(FLAGS_shard_args), ' ', absl::SkipEmpty())) {
    o.shard_args.emplace_back(a);
  }
  o.shard_args.insert(o.shard_args.end(), extra_shard_args.begin(), extra_shard_args.end());
  return StartProcCluster(o, c);
}

void StopCluster(ProcCluster* c) { StopProcCluster(c); }

std::vector<Metrics> ScrapeShards(const ProcCluster& c) {
  std::vector<Metrics> out;
  for (int port : c.metrics_ports) out.push_back(ParseMetrics(HttpGetBody(port, "/metrics")));
  return out;
}

absl::Status DeleteJob(const ProcCluster& c, const std::string& name) {
  v1::DeleteJobRequest req;
  req.set_job_name(name);
  req.set_force(true);
  v1::DeleteJobResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  return FromGrpc(c.stub->DeleteJob(&ctx, req, &resp));
}

// ---- Workers ----

// Runs fn(rank) on W threads; the first error.
absl::Status OnWorkers(int workers, const std::function<absl::Status(int)>& fn) {
  std::vector<absl::Status> results(workers);
  std::vector<std::thread> threads;
  for (int r = 0; r < workers; ++r) threads.emplace_back([&, r] { results[r] = fn(r); });
  for (auto& t : threads) t.join();
  for (int r = 0; r < workers; ++r) {
    if (!results[r].ok()) {
      return absl::Status(results[r].code(), absl::StrCat("rank ", r, ": ", results[r].message()));
    }
  }
  return absl::OkStatus();
}

absl::Status WaitAll(client::Client* c, const std::vector<client::Ticket>& tickets) {
  absl::Status first;
  for (client::Ticket t : tickets) {
    absl::Status s = c->Wait(t, absl::Seconds(60));
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

client::Optimizer OptimizerFlag() {
  return absl::GetFlag(FLAGS_optimizer) == "adamw" ? client::Optimizer::kAdamW
                                                   : client::Optimizer::kSgd;
}

// W clients joined to a new job `def` (rank 0 creates it and sends initial
// values).
absl::StatusOr<std::vector<std::unique_ptr<client::Client>>> StartJob(const ProcCluster& c,
                                                                      const client::JobDef& def) {
  std::vector<std::unique_ptr<client::Client>> clients;
  for (uint32_t r = 0; r < def.world_size; ++r) {
    client::ClientOptions o;
    o.coordinator_address = c.coord_addr;
    o.transport.name = absl::StrCat("bench-worker", r);
    o.transport.transports = c.transports;
    o.transport.net_devices = "lo";
    auto cl = client::Client::Connect(o);
    if (!cl.ok()) return cl.status();
    clients.push_back(std::move(*cl));
  }
  if (auto s = clients[0]->CreateJob(def); !s.ok()) return s;
  for (uint32_t r = 0; r < def.world_size; ++r) {
    if (auto s = clients[r]->Join(def.name, r, def.world_size); !s.ok()) return s;
  }
  for (uint32_t t = 0; t < clients[0]->tensors().size(); ++t) {
    std::vector<float> v(clients[0]->tensors()[t].num_elems, 0.01f);
    if (auto s = clients[0]->InitTensor(t, v.data(), v.size()); !s.ok()) return s;
  }
  return clients;
}

// What UCX picked for the workers' endpoints (empty until the transport
// reports it).
std::string TransportsInUse(const std::vector<std::unique_ptr<client::Client>>& clients) {
  std::vector<std::string> all;
  for (const auto& c : clients) {
    std::string t = c->transports_in_use();
    if (std::find(all.begin(), all.end(), t) == all.end()) all.push_back(t);
  }
  return absl::StrJoin(all, " | ");
}

// ---- ucx_perftest ----

struct Perftest {
  double gbps = 0;       // Median of the runs.
  double best_gbps = 0;  // Best run.
  std::vector<double> runs_gbps;
  std::string server_cmd, client_cmd;
  absl::Status status;
};

// One client/server run; GB/s (1e9 bytes/s).
// detect: as optimus's workers run, with UCP_ERR_HANDLING_MODE_PEER (-e)
// and the UCX settings a worker with peer-failure detection applies.
absl::StatusOr<double> PerftestOnce(const std::string& dir, const std::string& tls,
                                    uint64_t msg_bytes, bool detect, Perftest* out) {
  const int port = FreePort();
  const uint64_t iters = std::clamp<uint64_t>(
      (static_cast<uint64_t>(absl::GetFlag(FLAGS_perftest_mib)) << 20) / msg_bytes, 50, 50000);
  const uint64_t warmup = std::max<uint64_t>(iters / 10, 5);
  std::vector<std::string> env{"UCX_TLS=" + tls, "UCX_NET_DEVICES=lo"};
  if (detect) {
    for (std::string& e : transport::UcxDetectionEnvironment(tls)) env.push_back(std::move(e));
  }
  std::vector<std::string> common{"-t",
                                  "ucp_am_bw",
                                  "-s",
                                  absl::StrCat(msg_bytes),
                                  "-n",
                                  absl::StrCat(iters),
                                  "-w",
                                  absl::StrCat(warmup),
                                  "-p",
                                  absl::StrCat(port),
                                  "-f"};
  if (detect) common.push_back("-e");
  // Where optimus's shard and workers run: the server receives what a push
  // sends (ucx_perftest's client sends).
  std::vector<std::string> server{absl::GetFlag(FLAGS_ucx_perftest)};
  server.insert(server.end(), common.begin(), common.end());
  server = PinnedTo(g_placement.servers, std::move(server));
  std::vector<std::string> client{absl::GetFlag(FLAGS_ucx_perftest), "127.0.0.1"};
  client.insert(client.end(), common.begin(), common.end());
  client = PinnedTo(g_placement.workers, std::move(client));
  out->server_cmd = ShellLine(env, server);
  out->client_cmd = ShellLine(env, client);
  const pid_t srv = Spawn(env, server, dir + "/perftest-server.log");
  if (srv < 0) return absl::InternalError("cannot start ucx_perftest");
  std::string output;
  int status = 0;
  // The server listens on its port a moment after it starts; a client that
  // comes too early fails to connect and is started again.
  for (int attempt = 0; attempt < 20; ++attempt) {
    absl::SleepFor(absl::Milliseconds(attempt == 0 ? 200 : 300));
    int fd = -1;
    const pid_t cl = Spawn(env, client, dir + "/perftest-client.log", &fd);
    if (cl < 0) break;
    output.clear();
    char buf[4096];
    for (;;) {
      const ssize_t n = read(fd, buf, sizeof(buf));
      if (n <= 0) break;
      output.append(buf, static_cast<size_t>(n));
    }
    close(fd);
    if (!WaitPid(cl, absl::Seconds(120), &status)) {
      kill(cl, SIGKILL);
      WaitPid(cl, absl::Seconds(5), &status);
    }
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) break;
  }
  if (!WaitPid(srv, absl::Seconds(10), &status)) Stop(srv);
  // -f prints one line of numbers: iterations, latency 50%/average/overall
  // (usec), bandwidth average/overall (MB/s: 2^20 bytes/s), message rate.
  for (absl::string_view line : absl::StrSplit(output, '\n')) {
    std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    double bw = 0;
    if (f.size() >= 8 && absl::SimpleAtod(f[5], &bw)) return bw * 1048576.0 / 1e9;
  }
  return absl::InternalError(absl::StrCat("ucx_perftest gave no result (UCX_TLS=", tls,
                                          "); client output:\n", output,
                                          Tail(dir + "/perftest-client.log")));
}

Perftest RunPerftest(const std::string& dir, const std::string& tls, uint64_t msg_bytes,
                     bool detect = false) {
  Perftest p;
  for (int i = 0; i < std::max(1, absl::GetFlag(FLAGS_perftest_repeats)); ++i) {
    auto r = PerftestOnce(dir, tls, msg_bytes, detect, &p);
    if (!r.ok()) {
      p.status = r.status();
      return p;
    }
    p.runs_gbps.push_back(*r);
  }
  std::vector<double> sorted = p.runs_gbps;
  std::sort(sorted.begin(), sorted.end());
  p.gbps = sorted[sorted.size() / 2];
  p.best_gbps = sorted.back();
  return p;
}

// ---- Goodput cases ----

// Goodputs of a phase's iterations, GB/s.
struct Figures {
  double median = 0, mean = 0, best = 0;
  int iterations = 0;
};

Figures FiguresOf(std::vector<double> v) {
  Figures f;
  if (v.empty()) return f;
  std::sort(v.begin(), v.end());
  f.iterations = static_cast<int>(v.size());
  f.median = v[v.size() / 2];
  f.best = v.back();
  for (double x : v) f.mean += x / v.size();
  return f;
}

struct Goodput {
  Figures push, pull;
  double step_ms = 0;            // Push + step + pull of the next version.
  double push_allocs_per_msg = 0, pull_allocs_per_msg = 0;
  uint32_t chunks = 0;
  uint64_t tensor_bytes = 0;
  std::vector<uint64_t> memory_used, rss;
  std::vector<Json> step_tail;  // StepTailJson per shard.
  std::string in_use;
  uint64_t registrations = 0;  // All workers', over the whole case.
};

// A goodput case's tensor: --tensor_mib, at least two chunks per shard,
// whole chunks.
uint64_t GoodputTensorBytes(uint64_t msg_bytes, int shards) {
  const uint64_t min_bytes = static_cast<uint64_t>(absl::GetFlag(FLAGS_tensor_mib)) << 20;
  const uint64_t chunks =
      std::max<uint64_t>((min_bytes + msg_bytes - 1) / msg_bytes, 2 * static_cast<uint64_t>(shards));
  return chunks * msg_bytes;
}

// A worker's gradients or parameters, where the trainer keeps them: the
// torch adapters' staging arenas (client/torch/module_sync.cc, the Python
// optimizer) are mapped on a 2 MiB boundary and advised for huge pages;
// --user_huge_pages=false gives ordinary 4 KiB-page memory instead.
class UserBuffer {
 public:
  UserBuffer() = default;
  UserBuffer(const UserBuffer&) = delete;
  UserBuffer& operator=(const UserBuffer&) = delete;
  UserBuffer(UserBuffer&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(o.size_) {}
  ~UserBuffer() { UnmapAligned(data_, size_); }
  void assign(size_t bytes, uint8_t value) {
    UnmapAligned(data_, size_);
    data_ = static_cast<uint8_t*>(MapAligned(bytes, absl::GetFlag(FLAGS_user_huge_pages)));
    if (data_ == nullptr) {
      std::fprintf(stderr, "dataplane: out of memory mapping %zu bytes\n", bytes);
      std::exit(1);
    }
    size_ = bytes;
    std::memset(data_, value, bytes);
  }
  uint8_t* data() { return data_; }
  size_t size() const { return size_; }
  uint8_t& operator[](size_t i) { return data_[i]; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

absl::StatusOr<Goodput> RunGoodput(const ProcCluster& c, const std::string& name,
                                   uint64_t msg_bytes, int workers, int shards) {
  Goodput g;
  g.tensor_bytes = GoodputTensorBytes(msg_bytes, shards);
  const uint64_t elems = g.tensor_bytes / DTypeSize(DType::kBf16);
  client::JobDef def;
  def.name = name;
  def.world_size = static_cast<uint32_t>(workers);
  def.tensors = {{"t", {static_cast<int64_t>(elems)}}};
  def.optimizer.kind = OptimizerFlag();
  def.optimizer.lr = 1e-3f;
  def.grad_dtype = DType::kBf16;
  def.param_dtype = DType::kBf16;
  // Without a commit round a push is answered as it lands and the chunk's
  // step runs at once, on the cores the next pushes land on.
  def.skip_nonfinite = absl::GetFlag(FLAGS_commit_round);
  // The message size: bytes of one chunk's gradient push.
  def.chunk_payload_bytes = msg_bytes;
  const std::vector<Metrics> before = ScrapeShards(c);
  auto started = StartJob(c, def);
  if (!started.ok()) return started.status();
  std::vector<std::unique_ptr<client::Client>>& cl = *started;
  g.chunks = cl[0]->tensors()[0].num_chunks;
  g.in_use = TransportsInUse(cl);
  std::vector<UserBuffer> grads(workers), params(workers);
  for (int r = 0; r < workers; ++r) {
    grads[r].assign(g.tensor_bytes, 0);
    // bf16 1e-3 (0x3a83) in every element.
    for (size_t i = 0; i + 1 < grads[r].size(); i += 2) {
      grads[r][i] = 0x83;
      grads[r][i + 1] = 0x3a;
    }
    params[r].assign(g.tensor_bytes, 0);
  }
  Barrier barrier(workers);
  // Issued as the torch adapters issue them: corked, so that the requests
  // without a payload (a pull's) go in one message per shard.
  const bool cork = absl::GetFlag(FLAGS_goodput_cork);
  auto issue_and_wait = [&](int r, const auto& issue) -> absl::Status {
    absl::StatusOr<client::Ticket> t;
    {
      std::optional<client::BatchScope> batch;
      if (cork) batch.emplace(cl[r].get());
      t = issue(*cl[r]);
    }
    if (!t.ok()) return t.status();
    return cl[r]->Wait(*t, absl::Seconds(60));
  };
  auto pull = [&](int r, uint64_t version) {
    return issue_and_wait(
        r, [&](client::Client& c) { return c.Pull(0, version, params[r].data(), elems); });
  };
  auto push = [&](int r, uint64_t step) {
    return issue_and_wait(
        r, [&](client::Client& c) { return c.Push(0, step, grads[r].data(), elems); });
  };
  // Warm-up: endpoints, registrations; step 1 applied; calibration.
  absl::Duration pull_one, push_one;
  if (auto s = OnWorkers(workers, [&](int r) {
        absl::Time t0 = absl::Now();
        if (auto s = pull(r, 1); !s.ok()) return s;
        if (r == 0) pull_one = absl::Now() - t0;
        barrier.Wait();
        t0 = absl::Now();
        if (auto s = push(r, 1); !s.ok()) return s;
        if (r == 0) push_one = absl::Now() - t0;
        return pull(r, 2);
      });
      !s.ok()) {
    return s;
  }
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const int pull_iters = std::clamp(
      static_cast<int>(seconds / std::max(1e-6, absl::ToDoubleSeconds(pull_one))), 3, 2000);
  const int push_steps = std::clamp(
      static_cast<int>(seconds / std::max(1e-6, absl::ToDoubleSeconds(push_one))), 3, 500);
  // An iteration of a phase runs from the first worker's start to the last
  // worker's end: its goodput is every worker's bytes over that time.
  auto goodputs = [&](const std::vector<std::vector<absl::Time>>& st,
                      const std::vector<std::vector<absl::Time>>& en, int iters) {
    std::vector<double> out;
    for (int i = 0; i < iters; ++i) {
      absl::Time s0 = st[0][i], e0 = en[0][i];
      for (int r = 1; r < workers; ++r) {
        s0 = std::min(s0, st[r][i]);
        e0 = std::max(e0, en[r][i]);
      }
      out.push_back(static_cast<double>(g.tensor_bytes) * workers /
                    absl::ToDoubleSeconds(e0 - s0) / 1e9);
    }
    return out;
  };
  // Pull phase: version 2 over and over, all workers at once.
  std::vector<std::vector<absl::Time>> ps(workers, std::vector<absl::Time>(pull_iters)),
      pe(workers, std::vector<absl::Time>(pull_iters));
  uint64_t allocs0 = Allocations();
  if (auto s = OnWorkers(workers, [&](int r) {
        for (int i = 0; i < pull_iters; ++i) {
          barrier.Wait();
          ps[r][i] = absl::Now();
          if (auto s = pull(r, 2); !s.ok()) return s;
          pe[r][i] = absl::Now();
        }
        return absl::OkStatus();
      });
      !s.ok()) {
    return s;
  }
  g.pull_allocs_per_msg = static_cast<double>(Allocations() - allocs0) /
                          (static_cast<double>(pull_iters) * workers * g.chunks);
  g.pull = FiguresOf(goodputs(ps, pe, pull_iters));
  // Push phase: steps 2..; each step's pushes timed from the first worker's
  // start to the last worker's last answer; the pull of the next version
  // (the step applied) untimed.
  ps.assign(workers, std::vector<absl::Time>(push_steps));
  pe.assign(workers, std::vector<absl::Time>(push_steps));
  allocs0 = Allocations();
  const absl::Time loop0 = absl::Now();
  if (auto s = OnWorkers(workers, [&](int r) {
        for (int i = 0; i < push_steps; ++i) {
          const uint64_t step = 2 + i;
          barrier.Wait();
          ps[r][i] = absl::Now();
          if (auto s = push(r, step); !s.ok()) return s;
          pe[r][i] = absl::Now();
          if (auto s = pull(r, step + 1); !s.ok()) return s;
        }
        return absl::OkStatus();
      });
      !s.ok()) {
    return s;
  }
  const absl::Duration loop = absl::Now() - loop0;
  g.push_allocs_per_msg = static_cast<double>(Allocations() - allocs0) /
                          (2.0 * push_steps * workers * g.chunks);
  g.push = FiguresOf(goodputs(ps, pe, push_steps));
  g.step_ms = absl::ToDoubleMilliseconds(loop) / push_steps;
  const std::vector<Metrics> after = ScrapeShards(c);
  for (size_t i = 0; i < c.shards.size(); ++i) {
    auto it = after[i].values.find("optimus_shard_memory_used_bytes");
    g.memory_used.push_back(it == after[i].values.end() ? 0 : static_cast<uint64_t>(it->second));
    g.rss.push_back(RssBytes(c.shards[i]));
    g.step_tail.push_back(StepTailJson(before[i], after[i]));
  }
  for (auto& client : cl) {
    g.registrations += client->registration_stats().registrations;
    (void)client->Leave();
  }
  cl.clear();
  if (auto s = DeleteJob(c, name); !s.ok()) return s;
  return g;
}

// The kernel's default TCP congestion control (empty where unreadable),
// read once per run.
const std::string& TcpCongestionControl() {
  static const std::string* cc = new std::string(
      absl::StripTrailingAsciiWhitespace(ReadFile("/proc/sys/net/ipv4/tcp_congestion_control")));
  return *cc;
}

// Where every line's figures were measured: the placement, and the kernel's
// TCP congestion control, which loopback tcp's speed depends on (with bbr's
// pacing ucx_perftest reads about half of what it reads with cubic on the
// same VM).
void AddWhereItRan(Json& line) {
  line["placement"] = PlacementText();
  line["tcp_congestion_control"] = TcpCongestionControl();
}

// The fields that name a case, first in each of its lines.
Json CaseLine(const std::string& kase, const std::string& tls, uint64_t msg_bytes, int workers,
              int shards) {
  Json line;
  line["bench"] = "dataplane";
  line["case"] = kase;
  line["transport"] = tls;
  line["msg_bytes"] = msg_bytes;
  line["workers"] = workers;
  line["shards"] = shards;
  AddWhereItRan(line);
  return line;
}

void PrintGoodput(const std::string& tls, uint64_t msg_bytes, int workers, int shards,
                  const Goodput& g, const Perftest& p, const Perftest& pd, const Perftest& ws,
                  int cluster_id) {
  for (const char* kase : {"push", "pull"}) {
    const bool is_push = std::strcmp(kase, "push") == 0;
    const Figures& f = is_push ? g.push : g.pull;
    // The second baseline: ucx_perftest moving the tensor's bytes as one
    // message, so that its buffers are as large as the case's (a 4 MiB
    // message sent again and again stays in the CPU's cache; a tensor of
    // many chunks cannot).
    Json line = CaseLine(kase, tls, msg_bytes, workers, shards);
    line["optimus_gbps"] = JsonRound(f.median, 3);
    line["ucx_perftest_gbps"] = JsonRound(p.gbps, 3);
    line["ratio"] = JsonRound(p.gbps > 0 ? f.median / p.gbps : 0.0, 3);
    line["unit"] = "GB/s (1e9 bytes/s), medians";
    line["optimus_mean_gbps"] = JsonRound(f.mean, 3);
    line["optimus_best_gbps"] = JsonRound(f.best, 3);
    line["ucx_perftest_best_gbps"] = JsonRound(p.best_gbps, 3);
    line["ratio_best"] = JsonRound(p.best_gbps > 0 ? f.best / p.best_gbps : 0.0, 3);
    line["chunks"] = g.chunks;
    line["transports_in_use"] = g.in_use;
    line["tensor_bytes"] = g.tensor_bytes;
    line["user_huge_pages"] = absl::GetFlag(FLAGS_user_huge_pages);
    line["corked"] = absl::GetFlag(FLAGS_goodput_cork);
    line["iterations"] = f.iterations;
    line["step_ms"] = JsonRound(g.step_ms, 2);
    line["allocs_per_msg"] =
        JsonRound(is_push ? g.push_allocs_per_msg : g.pull_allocs_per_msg, 2);
    line["registrations"] = g.registrations;
    line["ucx_perftest_runs_gbps"] = p.runs_gbps;
    line["shard_memory_used_bytes"] = g.memory_used;
    line["shard_rss_bytes"] = g.rss;
    line["step_tail"] = g.step_tail;
    line["cluster"] = cluster_id;
    line["ucx_perftest_server_cmd"] = p.server_cmd;
    line["ucx_perftest_client_cmd"] = p.client_cmd;
    // The third: ucx_perftest on the transports optimus runs on, with
    // peer-failure detection (ucx_perftest -e and the same UCX settings).
    if (pd.status.ok() && pd.gbps > 0) {
      line["ucx_perftest_detect_gbps"] = JsonRound(pd.gbps, 3);
      line["ratio_detect"] = JsonRound(f.median / pd.gbps, 3);
      line["ucx_perftest_detect_runs_gbps"] = pd.runs_gbps;
      line["ucx_perftest_detect_client_cmd"] = pd.client_cmd;
    } else if (!pd.status.ok()) {
      line["ucx_perftest_detect_error"] = pd.status.ToString();
    }
    if (ws.status.ok() && ws.gbps > 0) {
      line["ucx_perftest_ws_gbps"] = ws.gbps;
      line["ratio_ws"] = JsonRound(f.median / ws.gbps, 3);
      line["ucx_perftest_ws_msg_bytes"] = g.tensor_bytes;
      line["ucx_perftest_ws_client_cmd"] = ws.client_cmd;
    } else if (!ws.status.ok()) {
      line["ucx_perftest_ws_error"] = ws.status.ToString();
    }
    std::fprintf(g_out, "%s\n", JsonDump(line).c_str());
    std::fflush(g_out);
  }
}

// A case that could not run; with the baseline when it was measured.
void PrintError(const std::string& kase, const std::string& tls, uint64_t msg_bytes,
                int workers, int shards, const absl::Status& s, const Perftest* p = nullptr) {
  Json line = CaseLine(kase, tls, msg_bytes, workers, shards);
  if (p != nullptr && p->status.ok() && p->gbps > 0) {
    line["optimus_gbps"] = nullptr;
    line["ucx_perftest_gbps"] = p->gbps;
    line["ucx_perftest_client_cmd"] = p->client_cmd;
  }
  line["error"] = s.ToString();
  std::fprintf(g_out, "%s\n", JsonDump(line).c_str());
  std::fflush(g_out);
}

void PrintCluster(int id, const ProcCluster& c, int shards) {
  Json line;
  line["bench"] = "dataplane";
  line["event"] = "cluster";
  AddWhereItRan(line);
  line["cluster"] = id;
  line["transport"] = c.transports;
  line["shards"] = shards;
  line["workers_in"] =
      "this process, one liboptimus client per thread, WorkerOptions.transports = transport, "
      "net_devices = lo";
  line["commands"] = c.commands;
  std::fprintf(g_out, "%s\n", JsonDump(line).c_str());
  std::fflush(g_out);
}

// ---- Many small tensors ----

struct SmallResult {
  double steps_per_s = 0;
  double allocs_per_msg = 0;
  double worker_cpu_s = 0;         // This process (all workers).
  double shard_cpu_s = 0;          // All shard processes.
  uint64_t messages_per_step = 0;  // All workers, pushes + pulls.
};

// One phase of `steps` steps (pull every tensor, push every tensor) on every
// worker, from step `first`.
absl::StatusOr<SmallResult> SmallPhase(const ProcCluster& pc,
                                       std::vector<std::unique_ptr<client::Client>>& cl,
                                       std::vector<std::vector<std::vector<uint8_t>>>& grads,
                                       std::vector<std::vector<std::vector<uint8_t>>>& params,
                                       uint64_t first, int steps) {
  const int workers = static_cast<int>(cl.size());
  const uint32_t num_tensors = static_cast<uint32_t>(cl[0]->tensors().size());
  uint64_t chunks = 0;
  for (const auto& t : cl[0]->tensors()) chunks += t.num_chunks;
  auto shard_cpu = [&pc] {
    double sum = 0;
    for (pid_t p : pc.shards) sum += ProcCpuSeconds(p);
    return sum;
  };
  const double shard_cpu0 = shard_cpu();
  const double cpu0 = SelfCpuSeconds();
  const uint64_t allocs0 = Allocations();
  const absl::Time t0 = absl::Now();
  absl::Status s = OnWorkers(workers, [&](int r) {
    client::Client* c = cl[r].get();
    std::vector<client::Ticket> tickets;
    tickets.reserve(num_tensors);
    for (int i = 0; i < steps; ++i) {
      const uint64_t step = first + i;
      const bool batch = absl::GetFlag(FLAGS_small_batch);
      tickets.clear();
      if (batch) c->Cork();
      for (uint32_t t = 0; t < num_tensors; ++t) {
        auto k = c->Pull(t, step, params[r][t].data(), c->tensors()[t].num_elems);
        if (!k.ok()) return k.status();
        tickets.push_back(*k);
      }
      if (batch) c->Uncork();
      if (auto s = WaitAll(c, tickets); !s.ok()) return s;
      tickets.clear();
      if (batch) c->Cork();
      for (uint32_t t = 0; t < num_tensors; ++t) {
        auto k = c->Push(t, step, grads[r][t].data(), c->tensors()[t].num_elems);
        if (!k.ok()) return k.status();
        tickets.push_back(*k);
      }
      if (batch) c->Uncork();
      if (auto s = WaitAll(c, tickets); !s.ok()) return s;
    }
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  SmallResult out;
  out.steps_per_s = steps / absl::ToDoubleSeconds(absl::Now() - t0);
  out.worker_cpu_s = SelfCpuSeconds() - cpu0;
  out.shard_cpu_s = shard_cpu() - shard_cpu0;
  out.messages_per_step = 2 * chunks * workers;
  out.allocs_per_msg = static_cast<double>(Allocations() - allocs0) /
                       (static_cast<double>(out.messages_per_step) * steps);
  return out;
}

void RunSmallTensors(const std::string& root, const std::string& dir) {
  const std::string tls = absl::GetFlag(FLAGS_small_tls);
  const int workers = absl::GetFlag(FLAGS_small_workers);
  const int shards = absl::GetFlag(FLAGS_small_shards);
  const int num_tensors = absl::GetFlag(FLAGS_small_tensors);
  const int64_t elems = absl::GetFlag(FLAGS_small_elems);
  const int steps = absl::GetFlag(FLAGS_small_steps);
  const int rounds = absl::GetFlag(FLAGS_small_rounds);
  ProcCluster c;
  if (auto s = StartCluster(root, dir, tls, shards, &c); !s.ok()) {
    StopCluster(&c);
    return PrintError("small_tensors", tls, 0, workers, shards, s);
  }
  PrintCluster(1000, c, shards);
  auto job = [&](const std::string& name, bool small) {
    client::JobDef def;
    def.name = name;
    def.world_size = static_cast<uint32_t>(workers);
    if (small) {
      for (int t = 0; t < num_tensors; ++t) def.tensors.push_back({absl::StrCat("t", t), {elems}});
    } else {
      def.tensors = {{"all", {elems * num_tensors}}};
    }
    def.optimizer.kind = OptimizerFlag();
    def.optimizer.lr = 1e-3f;
    // With --commit_round, pushes are acked after the round's reduce, by
    // the shards' step threads.
    def.skip_nonfinite = absl::GetFlag(FLAGS_commit_round);
    return def;
  };
  struct Job {
    std::string name;
    std::vector<std::unique_ptr<client::Client>> clients;
    std::vector<std::vector<std::vector<uint8_t>>> grads, params;
    uint64_t next_step = 1;
    double total_s = 0;
    int total_steps = 0;
    double allocs = 0;
    double worker_cpu_s = 0, shard_cpu_s = 0;
    uint64_t messages_per_step = 0;
  };
  Job jobs[2];
  absl::Status error;
  for (int k = 0; k < 2 && error.ok(); ++k) {
    jobs[k].name = k == 0 ? "small" : "one_tensor";
    auto cl = StartJob(c, job(jobs[k].name, k == 0));
    if (!cl.ok()) {
      error = cl.status();
      break;
    }
    jobs[k].clients = std::move(*cl);
    jobs[k].grads.resize(workers);
    jobs[k].params.resize(workers);
    for (int r = 0; r < workers; ++r) {
      for (const auto& t : jobs[k].clients[0]->tensors()) {
        jobs[k].grads[r].emplace_back(t.num_elems * 2, 0);
        jobs[k].params[r].emplace_back(t.num_elems * 2, 0);
      }
    }
    // Warm-up: 2 steps.
    auto w = SmallPhase(c, jobs[k].clients, jobs[k].grads, jobs[k].params, 1, 2);
    if (!w.ok()) error = w.status();
    jobs[k].next_step = 3;
  }
  for (int round = 0; round < rounds && error.ok(); ++round) {
    for (Job& j : jobs) {
      auto r = SmallPhase(c, j.clients, j.grads, j.params, j.next_step, steps);
      if (!r.ok()) {
        error = r.status();
        break;
      }
      j.next_step += steps;
      j.total_s += steps / r->steps_per_s;
      j.total_steps += steps;
      j.allocs += r->allocs_per_msg * steps;
      j.worker_cpu_s += r->worker_cpu_s;
      j.shard_cpu_s += r->shard_cpu_s;
      j.messages_per_step = r->messages_per_step;
    }
  }
  if (!error.ok()) {
    PrintError("small_tensors", tls, 0, workers, shards, error);
  } else {
    const double small = jobs[0].total_steps / jobs[0].total_s;
    const double big = jobs[1].total_steps / jobs[1].total_s;
    std::vector<uint64_t> rss;
    for (pid_t p : c.shards) rss.push_back(RssBytes(p));
    const double per_msg = jobs[0].messages_per_step * jobs[0].total_steps;
    Json line;
    line["bench"] = "dataplane";
    line["case"] = "small_tensors";
    AddWhereItRan(line);
    line["batched"] = absl::GetFlag(FLAGS_small_batch);
    line["commit_round"] = absl::GetFlag(FLAGS_commit_round);
    line["transport"] = tls;
    line["workers"] = workers;
    line["shards"] = shards;
    line["tensors"] = num_tensors;
    line["elems_per_tensor"] = static_cast<int64_t>(elems);
    line["bytes_per_step_per_worker"] = static_cast<int64_t>(elems * num_tensors * 2 * 2);
    line["steps"] = jobs[0].total_steps;
    line["steps_per_s"] = JsonRound(small, 3);
    line["baseline"] = "one tensor of the same elements";
    line["baseline_chunks"] = jobs[1].clients[0]->tensors()[0].num_chunks;
    line["baseline_steps_per_s"] = JsonRound(big, 3);
    line["ratio"] = JsonRound(small / big, 3);
    line["messages_per_step"] = static_cast<uint64_t>(jobs[0].messages_per_step);
    line["messages_per_s"] = static_cast<int64_t>(std::llround(small * jobs[0].messages_per_step));
    line["allocs_per_msg"] = JsonRound(jobs[0].allocs / jobs[0].total_steps, 2);
    line["baseline_allocs_per_msg"] = JsonRound(jobs[1].allocs / jobs[1].total_steps, 2);
    line["worker_cpu_us_per_msg"] = JsonRound(jobs[0].worker_cpu_s * 1e6 / per_msg, 2);
    line["shard_cpu_us_per_msg"] = JsonRound(jobs[0].shard_cpu_s * 1e6 / per_msg, 2);
    line["shard_rss_bytes"] = rss;
    std::fprintf(g_out, "%s\n", JsonDump(line).c_str());
    std::fflush(g_out);
  }
  for (Job& j : jobs) j.clients.clear();
  StopCluster(&c);
}

// ---- Main ----

absl::StatusOr<uint64_t> ParseSize(absl::string_view s) {
  uint64_t mult = 1;
  if (!s.empty() && (s.back() == 'K' || s.back() == 'k')) mult = 1024;
  if (!s.empty() && (s.back() == 'M' || s.back() == 'm')) mult = 1024 * 1024;
  if (mult != 1) s.remove_suffix(1);
  uint64_t v = 0;
  if (!absl::SimpleAtoi(s, &v) || v == 0) {
    return absl::InvalidArgumentError(absl::StrCat("bad size '", s, "'"));
  }
  return v * mult;
}

std::vector<int> IntList(const std::string& flag) {
  std::vector<int> out;
  for (absl::string_view p : absl::StrSplit(flag, ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(p, &v) || v < 1) Die(absl::StrCat("bad count '", p, "'"));
    out.push_back(v);
  }
  return out;
}

// ---- staging: memory per parameter and step rate, pool vs all slots ----

struct StagingResult {
  double steps_per_s = 0;
  double memory_used = 0;  // The shard's accounting (state + staging held).
  uint64_t rss = 0;
  double tail_mean_s = 0, step_mean_s = 0;  // publish tail, kernel (means).
  double queue_mean_s = 0;  // The tail's part before the kernel starts.
  double staging_held = 0, staging_limit = 0, waits = 0, folds = 0;
};

// One shard, W workers pushing and pulling one tensor of `params` bf16
// elements (AdamW, no commit round: the pool is what holds gradients), in
// the given layout; memory read after the timed steps.
absl::StatusOr<StagingResult> StagingRun(const std::string& root, const std::string& dir,
                                         int workers, int64_t params, bool fold, int id) {
  const std::string tls = absl::GetFlag(FLAGS_staging_tls);
  // State 16 B per parameter; the pool: its default (an eighth of the
  // budget) for the pool, every chunk's W slots for the all-slots layout.
  const int64_t state_mb = (params * 16 >> 20) + 64;
  const int64_t pool_mb = absl::GetFlag(FLAGS_staging_pool_mb);
  const int64_t staging_mb = fold ? (pool_mb > 0 ? pool_mb : std::max<int64_t>(256, (state_mb + 256) / 7))
                                  : (params * 2 * workers >> 20) + 64;
  std::vector<std::string> extra{absl::StrCat("--memory_limit_mb=", state_mb + staging_mb),
                                 absl::StrCat("--staging_mb=", staging_mb),
                                 absl::StrCat("--fold_gradients=", fold ? "true" : "false")};
  ProcCluster c;
  if (auto s = StartCluster(root, dir, tls, 1, &c, extra); !s.ok()) {
    StopCluster(&c);
    return s;
  }
  PrintCluster(id, c, 1);
  client::JobDef def;
  def.name = fold ? "staging-pool" : "staging-all-slots";
  def.world_size = static_cast<uint32_t>(workers);
  const double pace_ms = absl::GetFlag(FLAGS_staging_pace_ms);
  // Paced: one tensor per chunk (4 MiB of bf16 payload, the default chunk).
  const int64_t piece = pace_ms > 0 ? int64_t{2} << 20 : params;
  const int64_t pieces = (params + piece - 1) / piece;
  for (int64_t i = 0; i < pieces; ++i) {
    def.tensors.push_back({absl::StrCat("w", i), {std::min(piece, params - i * piece)}});
  }
  def.optimizer.kind = client::Optimizer::kAdamW;
  def.optimizer.lr = 1e-3f;
  def.skip_nonfinite = false;
  auto cl = StartJob(c, def);
  if (!cl.ok()) {
    StopCluster(&c);
    return cl.status();
  }
  std::vector<std::vector<uint8_t>> grads(workers, std::vector<uint8_t>(params * 2, 0x3c));
  std::vector<std::vector<uint8_t>> got(workers, std::vector<uint8_t>(params * 2));
  auto step_all = [&](uint64_t step) {
    return OnWorkers(workers, [&](int r) -> absl::Status {
      client::Client* w = (*cl)[r].get();
      std::vector<client::Ticket> tickets;
      for (int64_t i = 0; i < pieces; ++i) {
        auto p = w->Pull(static_cast<uint32_t>(i), step, got[r].data() + i * piece * 2,
                         def.tensors[i].shape[0]);
        if (!p.ok()) return p.status();
        tickets.push_back(*p);
      }
      for (client::Ticket t : tickets) {
        if (auto s = w->Wait(t, absl::Seconds(120)); !s.ok()) return s;
      }
      tickets.clear();
      for (int64_t i = 0; i < pieces; ++i) {
        if (i > 0 && pace_ms > 0) absl::SleepFor(absl::Milliseconds(pace_ms));
        auto t = w->Push(static_cast<uint32_t>(i), step, grads[r].data() + i * piece * 2,
                         def.tensors[i].shape[0]);
        if (!t.ok()) return t.status();
        tickets.push_back(*t);
      }
      for (client::Ticket t : tickets) {
        if (auto s = w->Wait(t, absl::Seconds(120)); !s.ok()) return s;
      }
      return absl::OkStatus();
    });
  };
  StagingResult out;
  absl::Status s = step_all(1);  // Warm-up: buffers made, pages touched.
  const Metrics before = ScrapeShards(c)[0];
  const int steps = absl::GetFlag(FLAGS_staging_steps);
  const absl::Time t0 = absl::Now();
  for (int i = 0; i < steps && s.ok(); ++i) s = step_all(2 + i);
  const double secs = absl::ToDoubleSeconds(absl::Now() - t0);
  if (s.ok()) {
    // The last version, so that the shard is idle when it is measured.
    s = OnWorkers(workers, [&](int r) -> absl::Status {
      for (int64_t i = 0; i < pieces; ++i) {
        auto p = (*cl)[r]->Pull(static_cast<uint32_t>(i), 2 + steps,
                                got[r].data() + i * piece * 2, def.tensors[i].shape[0]);
        if (!p.ok()) return p.status();
        if (auto s = (*cl)[r]->Wait(*p, absl::Seconds(120)); !s.ok()) return s;
      }
      return absl::OkStatus();
    });
  }
  const Metrics after = ScrapeShards(c)[0];
  out.rss = RssBytes(c.shards[0]);
  auto get = [](const Metrics& m, const std::string& k) {
    auto it = m.values.find(k);
    return it == m.values.end() ? 0.0 : it->second;
  };
  auto mean = [&](const std::string& n) {
    const double count = get(after, n + "_count") - get(before, n + "_count");
    return count > 0 ? (get(after, n + "_sum") - get(before, n + "_sum")) / count : 0.0;
  };
  out.steps_per_s = steps / secs;
  out.memory_used = get(after, "optimus_shard_memory_used_bytes");
  out.tail_mean_s = mean("optimus_shard_publish_tail_seconds");
  out.step_mean_s = mean("optimus_shard_step_seconds");
  out.queue_mean_s = mean("optimus_shard_step_queue_seconds");
  out.staging_held = get(after, "optimus_shard_staging_held_bytes");
  out.staging_limit = get(after, "optimus_shard_staging_limit_bytes");
  out.waits = get(after, "optimus_shard_staging_waits_total");
  out.folds = get(after, "optimus_shard_folds_total");
  cl->clear();
  (void)DeleteJob(c, def.name);
  StopCluster(&c);
  if (!s.ok()) return s;
  return out;
}

void RunStaging(const std::string& root, const std::string& dir) {
  const int64_t params = absl::GetFlag(FLAGS_staging_params);
  int id = 2000;
  for (int w : IntList(absl::GetFlag(FLAGS_staging_workers))) {
    StagingResult r[2];
    absl::Status error;
    // Alternating, twice each (the baseline first); the faster run of each
    // layout is reported (memory is the same in both runs).
    for (int round = 0; round < 2 && error.ok(); ++round) {
      for (int k = 0; k < 2 && error.ok(); ++k) {
        auto got = StagingRun(root, dir, w, params, /*fold=*/k == 1, ++id);
        if (!got.ok()) {
          error = got.status();
        } else if (got->steps_per_s > r[k].steps_per_s) {
          r[k] = *got;
        }
      }
    }
    if (!error.ok()) {
      PrintError("staging", absl::GetFlag(FLAGS_staging_tls), 0, w, 1, error);
      continue;
    }
    const double p = static_cast<double>(params);
    const auto tail_over_kernel = [](const auto& x) {
      return x.step_mean_s > 0 ? x.tail_mean_s / x.step_mean_s : 0.0;
    };
    Json line;
    line["bench"] = "dataplane";
    line["case"] = "staging";
    AddWhereItRan(line);
    line["workers"] = w;
    line["pace_ms"] = JsonRound(absl::GetFlag(FLAGS_staging_pace_ms), 1);
    line["params"] = static_cast<int64_t>(params);
    line["optimizer"] = "adamw";
    line["dtypes"] = "bf16";
    line["steps_per_s"] = JsonRound(r[1].steps_per_s, 4);
    line["memory_used_per_param"] = JsonRound(r[1].memory_used / p, 2);
    line["rss_per_param"] = JsonRound(r[1].rss / p, 2);
    line["memory_used_less_staging_per_param"] =
        JsonRound((r[1].memory_used - r[1].staging_held) / p, 2);
    line["staging_limit_bytes"] = static_cast<int64_t>(std::llround(r[1].staging_limit));
    line["staging_held_bytes"] = static_cast<int64_t>(std::llround(r[1].staging_held));
    line["staging_waits"] = static_cast<int64_t>(std::llround(r[1].waits));
    line["folds"] = static_cast<int64_t>(std::llround(r[1].folds));
    line["publish_tail_mean_s"] = JsonRound(r[1].tail_mean_s, 5);
    line["kernel_mean_s"] = JsonRound(r[1].step_mean_s, 5);
    line["step_queue_mean_s"] = JsonRound(r[1].queue_mean_s, 5);
    line["tail_over_kernel"] = JsonRound(tail_over_kernel(r[1]), 3);
    line["baseline"] = "all slots (--fold_gradients=false, pool = W slots per parameter)";
    line["baseline_steps_per_s"] = JsonRound(r[0].steps_per_s, 4);
    line["baseline_memory_used_per_param"] = JsonRound(r[0].memory_used / p, 2);
    line["baseline_rss_per_param"] = JsonRound(r[0].rss / p, 2);
    line["baseline_tail_over_kernel"] = JsonRound(tail_over_kernel(r[0]), 3);
    line["ratio_steps_per_s"] =
        JsonRound(r[0].steps_per_s > 0 ? r[1].steps_per_s / r[0].steps_per_s : 0.0, 3);
    std::fprintf(g_out, "%s\n", JsonDump(line).c_str());
    std::fflush(g_out);
  }
}

int Main(const char* argv0) {
  // Before any thread starts: they inherit it.
  g_placement = MakePlacement(absl::GetFlag(FLAGS_placement));
  KillChildrenOnSignals();
  const std::string root = FindBinRoot(argv0, absl::GetFlag(FLAGS_bin_dir));
  if (root.empty()) {
    Die("cannot find coordinator/optimus-coord and server/optimus-shard; run through "
        "`bazel run //bench:dataplane` or pass --bin_dir");
  }
  absl::StatusOr<std::string> made = MakeWorkDir(absl::GetFlag(FLAGS_work_dir), "dataplane");
  if (!made.ok()) Die(made.status().ToString());
  const std::string dir = *made;
  std::fprintf(stderr, "bench/dataplane: logs in %s\n", dir.c_str());
  const std::vector<std::string> cases = absl::StrSplit(absl::GetFlag(FLAGS_cases), ',');
  auto wants = [&](const char* c) {
    return std::find(cases.begin(), cases.end(), c) != cases.end();
  };
  std::vector<uint64_t> sizes;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_sizes), ',', absl::SkipEmpty())) {
    auto v = ParseSize(s);
    if (!v.ok()) Die(v.status().ToString());
    sizes.push_back(*v);
  }
  const std::vector<int> workers = IntList(absl::GetFlag(FLAGS_workers));
  const std::vector<int> shard_counts = IntList(absl::GetFlag(FLAGS_shards));
  const absl::Time t0 = absl::Now();
  int cluster_id = 0;
  int job = 0;
  if (wants("goodput")) {
    for (absl::string_view tls_view :
         absl::StrSplit(absl::GetFlag(FLAGS_tls), ';', absl::SkipEmpty())) {
      const std::string tls(tls_view);
      std::map<uint64_t, Perftest> ws_baselines;  // By message (tensor) size.
      for (int shards : shard_counts) {
        ProcCluster c;
        ++cluster_id;
        if (auto s = StartCluster(root, dir, tls, shards, &c); !s.ok()) {
          StopCluster(&c);
          PrintError("cluster", tls, 0, 0, shards, s);
          continue;
        }
        PrintCluster(cluster_id, c, shards);
        // A transport optimus cannot use here fails every case alike: after
        // the first failure only the baseline is measured.
        absl::Status unusable;
        for (uint64_t msg : sizes) {
          const Perftest p = RunPerftest(dir, tls, msg);
          if (!p.status.ok()) PrintError("ucx_perftest", tls, msg, 1, 0, p.status);
          Perftest pd;
          if (absl::GetFlag(FLAGS_perftest_detect)) pd = RunPerftest(dir, tls, msg, true);
          if (!pd.status.ok()) PrintError("ucx_perftest_detect", tls, msg, 1, 0, pd.status);
          const uint64_t tensor = GoodputTensorBytes(msg, shards);
          auto cached = ws_baselines.find(tensor);
          if (cached == ws_baselines.end()) {
            cached = ws_baselines.emplace(tensor, RunPerftest(dir, tls, tensor)).first;
          }
          const Perftest& ws = cached->second;
          for (int w : workers) {
            if (!unusable.ok()) {
              PrintError("push+pull", tls, msg, w, shards, unusable, &p);
              continue;
            }
            const std::string name = absl::StrCat("dp-", job++);
            auto g = RunGoodput(c, name, msg, w, shards);
            if (!g.ok()) {
              unusable = g.status();
              PrintError("push+pull", tls, msg, w, shards, unusable, &p);
              (void)DeleteJob(c, name);
              continue;
            }
            PrintGoodput(tls, msg, w, shards, *g, p, pd, ws, cluster_id);
          }
        }
        StopCluster(&c);
      }
    }
  }
  if (wants("small_tensors")) RunSmallTensors(root, dir);
  if (wants("staging")) RunStaging(root, dir);
  std::fprintf(stderr, "bench/dataplane: done in %.0f s\n",
               absl::ToDoubleSeconds(absl::Now() - t0));
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace optimus

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // The cluster it starts is a throwaway on loopback: plain text, asked for
  // here (the processes inherit it). Authentication costs one handshake per
  // connection, nothing per request worth measuring.
  setenv("OPTIMUS_INSECURE_PLAINTEXT", "1", /*overwrite=*/0);
  optimus::bench::g_out = optimus::bench::TakeStdoutForJson();
  if (optimus::bench::g_out == nullptr) return 1;
  return optimus::bench::Main(argv[0]);
}
