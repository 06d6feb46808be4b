// optimus-coord: the control-plane server. Parses flags into
// CoordinatorOptions, serves until SIGTERM or SIGINT, then shuts down and
// exits 0.
#include <signal.h>

#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/http_server.h"
#include "common/logging.h"
#include "common/version.h"
#include "coordinator/coordinator.h"
#include "coordinator/etcd_client.h"
#include "coordinator/etcd_leader.h"
#include "coordinator/etcd_state_store.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7070", "gRPC listen address HOST:PORT; port 0 picks one");
ABSL_FLAG(int, lease_ms, 2000, "A shard with no heartbeat for this many ms is marked DOWN");
ABSL_FLAG(int, sweep_ms, 200, "How often leases are checked, in ms");
ABSL_FLAG(int, max_rpc_threads, 256,
          "Most threads the gRPC server runs calls on; a call finding them all busy is refused "
          "with RESOURCE_EXHAUSTED (clients retry). Heartbeats need none; map watches take at "
          "most half. At least 4");
ABSL_FLAG(int, max_concurrent_map_reads, 32,
          "Most GetJob / GetShardMap calls served at once; past it a map read is refused at once "
          "with RESOURCE_EXHAUSTED and its caller retries with jittered backoff (optimus-shard "
          "and the client library do). Bounds the threads and CPU a fetch storm (every shard "
          "fetching a new job's map) takes from other calls. At least 1");
ABSL_FLAG(int, max_queued_map_reads, 16384,
          "Map reads that wait, in arrival order and without a thread, for one of the "
          "--max_concurrent_map_reads; past both a read is refused with RESOURCE_EXHAUSTED. A "
          "waiting read costs a few KB. At least 0");
ABSL_FLAG(double, map_fetches_per_s, 4096,
          "Shards per second that may fetch a new part of a job's map (a new job, or a part a "
          "failover or drain changed); half a second's worth at once, the others are given "
          "later slots in their heartbeat replies. Spreads a new job's fetch storm on a large "
          "cluster. 0: no pacing");
ABSL_FLAG(std::string, port_file, "",
          "If set, the bound port is written to this file (atomically) once serving");
ABSL_FLAG(int, metrics_port, 0, "HTTP port for /metrics, /healthz and /readyz; 0: off");
ABSL_FLAG(std::string, metrics_host, "0.0.0.0",
          "Address the --metrics_port listens on: 0.0.0.0 (every IPv4 address), :: (every IPv6 "
          "address, and IPv4 where the kernel maps it), or one address such as 127.0.0.1 or ::1");
ABSL_FLAG(std::string, state_dir, "",
          "Folder for durable state (shards, jobs, maps), loaded at start; empty: memory only. "
          "Not with --etcd_endpoints");
ABSL_FLAG(std::string, etcd_endpoints, "",
          "etcd mode: HOST:PORT,HOST:PORT of an etcd cluster (plain text) that keeps the state, "
          "with leader election among the coordinators sharing --etcd_prefix; a standby does not "
          "listen on --listen until it leads (docs/operations.md, etcd mode)");
ABSL_FLAG(std::string, etcd_prefix, "/optimus",
          "etcd mode: the keys' prefix (state under PREFIX/state/, election PREFIX/election)");
ABSL_FLAG(std::string, advertise_address, "",
          "etcd mode: where clients reach this coordinator, put in the election's value; "
          "empty: --listen");
ABSL_FLAG(int, etcd_lease_ttl_s, 0,
          "etcd mode: TTL of the leader's etcd lease in seconds (a standby takes over within "
          "it); 0: --lease_ms rounded up to seconds, at least 2 (etcd's minimum)");
ABSL_FLAG(int64_t, etcd_max_request_bytes, 1536 * 1024,
          "etcd mode: the cluster's --max-request-bytes (a state write stays below it)");
ABSL_FLAG(int, etcd_max_txn_ops, 128,
          "etcd mode: the cluster's --max-txn-ops (most keys one state write changes at once)");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "Folder for checkpoints, shared with the shards' --checkpoint_dir; empty: off");
ABSL_FLAG(bool, rollback_on_shard_loss, true,
          "Restore a job whose shard is lost (no replica) from its newest checkpoint");
ABSL_FLAG(absl::Duration, down_shard_grace, absl::Minutes(10),
          "A shard DOWN for longer than this leaves the coordinator's tables and status "
          "(optimusctl shard forget removes one at once); e.g. 10m, 1h; inf keeps them");
ABSL_FLAG(std::string, tls_dir, "",
          "Folder with ca.crt, tls.crt, tls.key (a Kubernetes TLS Secret with its CA): TLS for "
          "gRPC, client certificates give roles (docs/operations.md, Security); empty: "
          "$OPTIMUS_TLS_DIR");
ABSL_FLAG(bool, insecure_plaintext, false,
          "Serve plain-text gRPC with no authentication (local clusters and tests only)");
ABSL_FLAG(uint64_t, max_chunks_per_job, optimus::kMaxChunksPerJob,
          "Most chunks one job may have (its map travels in one gRPC message; each chunk costs "
          "a shard 8 KiB of bookkeeping); a job over it is refused with RESOURCE_EXHAUSTED");
ABSL_FLAG(uint64_t, max_tensors_per_job, optimus::kMaxTensorsPerJob,
          "Most tensors one job may declare; a job over it is refused with RESOURCE_EXHAUSTED");
ABSL_FLAG(uint64_t, max_job_bytes, 0,
          "Most shard memory one job may take over all its copies (state, published copies, "
          "gradients held, per-chunk bookkeeping), in bytes; 0: no quota");
ABSL_FLAG(bool, verbose, false, "Log debug lines too");
ABSL_FLAG(std::string, log_format, "text", "text, or json (one object per line, for log collectors)");

namespace {

// Writes via a temporary file and rename(2), so a reader polling for the
// file never sees it half-written.
absl::Status WritePortFile(const std::string& path, int port) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << port << "\n";
    out.flush();
    if (!out) return absl::InternalError(absl::StrCat("cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

// Logs loudly and ends the process at once: this coordinator no longer
// leads (its lease ran out, its election key is gone, or a state write was
// fenced off). Nothing more may be served or written; a supervisor
// restarts it, as a standby.
[[noreturn]] void ExitLostLeadership(const absl::Status& why) {
  OPTIMUS_LOG(Error, "coord", "LEADERSHIP LOST: ", why.ToString(),
              "; exiting with status 3 (restart as a standby)");
  std::fflush(stderr);
  std::_Exit(3);
}

// etcd mode: campaign; while standby answer /healthz (alive) and /readyz
// (503, standby) only; once elected load the state from etcd and serve;
// on SIGTERM/SIGINT stop serving, write the last state and resign, so that
// a standby leads at once.
int RunEtcdMode(optimus::CoordinatorOptions options, const std::string& port_file,
                const sigset_t& stop_signals) {
  absl::StatusOr<std::vector<std::string>> endpoints =
      optimus::ParseEtcdEndpoints(absl::GetFlag(FLAGS_etcd_endpoints));
  if (!endpoints.ok()) {
    std::fprintf(stderr, "optimus-coord: --etcd_endpoints: %s\n",
                 std::string(endpoints.status().message()).c_str());
    return 2;
  }
  const std::string prefix = absl::GetFlag(FLAGS_etcd_prefix);
  if (!absl::StartsWith(prefix, "/") || absl::EndsWith(prefix, "/")) {
    std::fprintf(stderr,
                 "optimus-coord: --etcd_prefix must start with / and not end with one, e.g. "
                 "/optimus (got \"%s\")\n", prefix.c_str());
    return 2;
  }
  if (absl::GetFlag(FLAGS_etcd_lease_ttl_s) < 0 || absl::GetFlag(FLAGS_etcd_max_txn_ops) < 1 ||
      absl::GetFlag(FLAGS_etcd_max_request_bytes) < 64 * 1024) {
    std::fprintf(stderr, "optimus-coord: --etcd_lease_ttl_s must be >= 0, --etcd_max_txn_ops "
                         ">= 1, --etcd_max_request_bytes >= 65536\n");
    return 2;
  }
  optimus::EtcdClientOptions client_options;
  client_options.endpoints = *endpoints;
  auto client = optimus::EtcdClient::Create(client_options);
  if (!client.ok()) {
    OPTIMUS_LOG(Error, "coord", "etcd client: ", client.status().ToString());
    return 1;
  }
  optimus::EtcdLeadershipOptions lead_options;
  lead_options.prefix = prefix;
  lead_options.value = absl::GetFlag(FLAGS_advertise_address).empty()
                           ? options.listen_address
                           : absl::GetFlag(FLAGS_advertise_address);
  const int64_t lease_s = (absl::ToInt64Milliseconds(options.lease) + 999) / 1000;
  lead_options.ttl_seconds = absl::GetFlag(FLAGS_etcd_lease_ttl_s) > 0
                                 ? absl::GetFlag(FLAGS_etcd_lease_ttl_s)
                                 : std::max<int64_t>(2, lease_s);
  optimus::EtcdLeadership leadership(client->get(), lead_options, ExitLostLeadership);

  std::unique_ptr<optimus::HttpServer> standby_http;
  if (!options.metrics_address.empty()) {
    auto http = optimus::HttpServer::Start(
        options.metrics_address,
        {{"/healthz", [] { return optimus::HttpResponse{200, "text/plain", "ok\n"}; }},
         {"/readyz",
          [] { return optimus::HttpResponse{503, "text/plain", "standby: not the leader\n"}; }},
         {"/metrics", [] {
            return optimus::HttpResponse{200, "text/plain; version=0.0.4",
                                         "# TYPE optimus_coord_leader gauge\n"
                                         "optimus_coord_leader 0\n"};
          }}});
    if (!http.ok()) {
      OPTIMUS_LOG(Error, "coord", "cannot start: ", http.status().ToString());
      return 1;
    }
    standby_http = std::move(*http);
  }
  if (absl::Status s = leadership.Start(); !s.ok()) {
    OPTIMUS_LOG(Error, "coord", "cannot start: etcd at ", (*client)->Describe(), ": ",
                s.ToString());
    return 1;
  }
  {
    auto leader = (*client)->Leader(leadership.election());
    OPTIMUS_LOG(Info, "coord", "standby: campaigning in ", leadership.election(), " at ",
                (*client)->Describe(), " as ", lead_options.value, "; leader now: ",
                !leader.ok() ? leader.status().ToString()
                             : (leader->has_value() ? (*leader)->value() : "none"));
  }

  absl::Mutex mu;
  bool stopping = false;
  std::unique_ptr<optimus::CoordinatorServer> server;
  std::thread leader_thread([&] {
    const absl::Time campaign_start = absl::Now();
    absl::StatusOr<v3electionpb::LeaderKey> key = leadership.Campaign();
    if (!key.ok()) {
      if (key.status().code() == absl::StatusCode::kCancelled) return;
      OPTIMUS_LOG(Error, "coord", "campaign failed: ", key.status().ToString());
      std::fflush(stderr);
      std::_Exit(1);
    }
    absl::MutexLock lock(&mu);
    if (stopping) return;
    const absl::Time elected = absl::Now();
    OPTIMUS_LOG(Info, "coord", "elected leader (key ", key->key(), ", revision ", key->rev(),
                ") after ", absl::FormatDuration(elected - campaign_start),
                " as standby; loading state from etcd");
    standby_http.reset();  // The server's own takes the port.
    optimus::EtcdStateStoreOptions store_options;
    store_options.prefix = prefix;
    store_options.max_request_bytes = absl::GetFlag(FLAGS_etcd_max_request_bytes);
    store_options.max_txn_ops = absl::GetFlag(FLAGS_etcd_max_txn_ops);
    store_options.on_fenced = ExitLostLeadership;
    options.state_store = std::make_shared<optimus::EtcdStateStore>(
        client->get(), optimus::EtcdFence{key->key(), key->rev()}, store_options);
    auto started = optimus::CoordinatorServer::Start(options);
    if (!started.ok()) {
      OPTIMUS_LOG(Error, "coord", "cannot start as leader: ", started.status().ToString());
      std::fflush(stderr);
      std::_Exit(1);
    }
    if (!port_file.empty()) {
      absl::Status s = WritePortFile(port_file, (*started)->port());
      if (!s.ok()) {
        OPTIMUS_LOG(Error, "coord", s.ToString());
        std::fflush(stderr);
        std::_Exit(1);
      }
    }
    OPTIMUS_LOG(Info, "coord", "leading: serving ", absl::FormatDuration(absl::Now() - elected),
                " after the election");
    server = std::move(*started);
  });

  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  OPTIMUS_LOG(Info, "coord", "received signal ", signal_number, ", shutting down");
  {
    absl::MutexLock lock(&mu);
    stopping = true;
  }
  leadership.CancelCampaign();
  leader_thread.join();
  if (server != nullptr) {
    server->Shutdown();
    // The last state is written as the core goes, while the election key
    // is still ours.
    server.reset();
  }
  // A standby leads at once rather than after a TTL.
  if (absl::Status s = leadership.Resign(); !s.ok()) {
    OPTIMUS_LOG(Warning, "coord", "resigning: ", s.ToString());
  }
  OPTIMUS_LOG(Info, "coord", "resigned");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("optimus-coord [--listen=HOST:PORT] [--lease_ms=N] [--port_file=PATH]");
  absl::FlagsUsageConfig usage_config;
  usage_config.version_string = [] { return optimus::VersionLine("optimus-coord"); };
  absl::SetFlagsUsageConfig(usage_config);
  absl::ParseCommandLine(argc, argv);
  // absl::Mutex's deadlock detector (on in Debian's build of absl) keeps a
  // graph of every lock order: a tenth of the coordinator's CPU at 24k
  // heartbeats a second. The tests keep it; the service runs without it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (absl::GetFlag(FLAGS_verbose)) optimus::SetMinLogLevel(optimus::LogLevel::kDebug);
  optimus::LogFormat log_format;
  if (!optimus::ParseLogFormat(absl::GetFlag(FLAGS_log_format), &log_format)) {
    std::fprintf(stderr, "optimus-coord: --log_format must be text or json\n");
    return 2;
  }
  optimus::SetLogFormat(log_format);

  // Block the stop signals in every thread (gRPC's threads inherit this mask)
  // and collect them synchronously below with sigwait.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  optimus::CoordinatorOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen);
  options.tls.dir = absl::GetFlag(FLAGS_tls_dir);
  options.tls.plaintext = absl::GetFlag(FLAGS_insecure_plaintext);
  options.lease = absl::Milliseconds(absl::GetFlag(FLAGS_lease_ms));
  options.job_limits.max_chunks = absl::GetFlag(FLAGS_max_chunks_per_job);
  options.job_limits.max_tensors = absl::GetFlag(FLAGS_max_tensors_per_job);
  options.job_limits.max_job_bytes = absl::GetFlag(FLAGS_max_job_bytes);
  options.sweep_interval = absl::Milliseconds(absl::GetFlag(FLAGS_sweep_ms));
  options.max_rpc_threads = absl::GetFlag(FLAGS_max_rpc_threads);
  options.max_concurrent_map_reads = absl::GetFlag(FLAGS_max_concurrent_map_reads);
  options.max_queued_map_reads = absl::GetFlag(FLAGS_max_queued_map_reads);
  options.map_fetches_per_s = absl::GetFlag(FLAGS_map_fetches_per_s);
  options.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  options.rollback_on_shard_loss = absl::GetFlag(FLAGS_rollback_on_shard_loss);
  options.state_dir = absl::GetFlag(FLAGS_state_dir);
  options.down_shard_grace = absl::GetFlag(FLAGS_down_shard_grace);
  if (options.down_shard_grace < absl::ZeroDuration()) {
    std::fprintf(stderr, "optimus-coord: --down_shard_grace must be >= 0 (or inf)\n");
    return 2;
  }
  if (absl::GetFlag(FLAGS_metrics_port) > 0) {
    options.metrics_address =
        optimus::HttpListenAddress(absl::GetFlag(FLAGS_metrics_host), absl::GetFlag(FLAGS_metrics_port));
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!absl::GetFlag(FLAGS_etcd_endpoints).empty()) {
    if (!options.state_dir.empty()) {
      std::fprintf(stderr,
                   "optimus-coord: --state_dir and --etcd_endpoints are exclusive: the state "
                   "lives in a folder (one coordinator) or in etcd (several), not both\n");
      return 2;
    }
    return RunEtcdMode(options, port_file, stop_signals);
  }
  auto server = optimus::CoordinatorServer::Start(options);
  if (!server.ok()) {
    OPTIMUS_LOG(Error, "coord", "cannot start: ", server.status().ToString());
    return 1;
  }
  if (!port_file.empty()) {
    absl::Status s = WritePortFile(port_file, (*server)->port());
    if (!s.ok()) {
      OPTIMUS_LOG(Error, "coord", s.ToString());
      return 1;
    }
  }
  int signal_number = 0;
  sigwait(&stop_signals, &signal_number);
  OPTIMUS_LOG(Info, "coord", "received signal ", signal_number, ", shutting down");
  (*server)->Shutdown();
  return 0;
}
