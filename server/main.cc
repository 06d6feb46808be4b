// optimus-shard: runs one optimizer shard server until SIGTERM or SIGINT.
#include <pthread.h>
#include <signal.h>

#include <csignal>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/synchronization/mutex.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/http_server.h"
#include "common/logging.h"
#include "common/version.h"
#include "server/shard_server.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070",
          "optimus-coord gRPC address HOST:PORT, or several (a leader and its standbys, state "
          "in etcd) as HOST:PORT,HOST:PORT: the shard follows whichever leads");
ABSL_FLAG(std::string, kind, "host", "dpu (BlueField Arm cores) or host (CPU fallback)");
ABSL_FLAG(int64_t, memory_limit_mb, 1024, "state budget for all jobs on this shard, MiB");
ABSL_FLAG(int64_t, staging_mb, 0,
          "MiB of the memory budget kept for gradients in flight (pushes land and are summed "
          "there); 0: an eighth of --memory_limit_mb");
ABSL_FLAG(bool, fold_gradients, true,
          "fold pushed gradients into a running sum as they land; false: hold W slots per chunk "
          "step (a benchmark baseline)");
ABSL_FLAG(int, step_threads, 0,
          "threads running optimizer steps and gradient folds (one chunk each); 0: one per core "
          "this process may use (its CPU affinity, capped by its cgroup's CPU quota)");
ABSL_FLAG(int, kernel_threads, 0,
          "threads splitting one chunk's optimizer step; 0: one per core this process may use");
ABSL_FLAG(int, step_nice, 0,
          "how much nicer (0-19) than the rest of the shard the step and kernel threads run; "
          "above 0 the UCX progress thread (landing pushes, serving pulls) gets the cores first "
          "where steps compete with it for them; below 0 (-19 to -1) the other way round: the "
          "progress thread runs that much nicer, so landed chunks are stepped first");
ABSL_FLAG(bool, huge_pages, false,
          "advise the shard's buffers of 2 MiB or more (state, published copies, gradient "
          "staging) for transparent huge pages: shared-memory transfers over 4 KiB pages pin "
          "every page (about 2x slower). Off by default: in a VM whose free memory goes back "
          "to its host, first touching huge pages can stall the VM for seconds");
ABSL_FLAG(std::string, transports, "",
          "UCX transports (UCX_TLS syntax, e.g. rc,sm,self); empty: UCX_TLS from the environment, "
          "or UCX's choice among all it finds");
ABSL_FLAG(std::string, net_devices, "",
          "UCX network devices (UCX_NET_DEVICES syntax; lo keeps traffic local); empty: "
          "UCX_NET_DEVICES from the environment, or all");
ABSL_FLAG(int, progress_spin_us, 50,
          "microseconds the UCX progress thread keeps polling after its last event before it "
          "sleeps on the wake-up fd; 0: sleep at once (least CPU, more latency)");
ABSL_FLAG(int, metrics_port, 0, "HTTP port for /metrics, /healthz and /readyz; 0: off");
ABSL_FLAG(std::string, metrics_host, "0.0.0.0",
          "Address the --metrics_port listens on: 0.0.0.0 (every IPv4 address), :: (every IPv6 "
          "address, and IPv4 where the kernel maps it), or one address such as 127.0.0.1 or ::1");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "folder for checkpoints, shared with optimus-coord's --checkpoint_dir; empty: off");
ABSL_FLAG(int64_t, checkpoint_max_mb_per_s, 0,
          "most MiB/s the background checkpoint writer puts on disk; 0: no limit");
ABSL_FLAG(std::string, tls_dir, "",
          "Folder with ca.crt, tls.crt, tls.key: TLS to the coordinator with this shard's client "
          "certificate (common name shard:<who>); empty: $OPTIMUS_TLS_DIR");
ABSL_FLAG(bool, insecure_plaintext, false,
          "Plain-text gRPC to the coordinator, no authentication (local clusters and tests only)");
ABSL_FLAG(bool, audit_versions, false,
          "log each chunk version this shard makes with the CRC-32C of its published copy "
          "(drills: no two shards hold one version with different bytes); costs a pass over "
          "each published copy");
ABSL_FLAG(uint64_t, max_parked_pulls_per_peer, 65536,
          "Most pulls one peer may have waiting for their version or being sent; more are "
          "refused with RESOURCE_EXHAUSTED");
ABSL_FLAG(uint64_t, max_parked_pulls, 262144,
          "Most pulls waiting or being sent on this shard in all; more are refused with "
          "RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, max_inflight_mb, 256,
          "Most MiB of temporary buffers for requests being received (batches, inits with "
          "optimizer state, backups' seeds), on top of --memory_limit_mb; more are refused "
          "with RESOURCE_EXHAUSTED");
ABSL_FLAG(uint64_t, max_peers, 65536,
          "Most data-plane peers that connected to this shard kept at once (beyond it the one "
          "silent longest since its hello makes room, or the hello is dropped); peers that "
          "failed are forgotten");
ABSL_FLAG(std::string, failure_domain, "",
          "shards that fail together (the server this DPU sits in, a rack): a chunk's backup is "
          "placed outside its primary's domain when another domain has room; empty: the "
          "hostname");
ABSL_FLAG(bool, verbose, false, "debug logging");
ABSL_FLAG(std::string, log_format, "text", "text, or json (one object per line, for log collectors)");

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("optimus-shard --coordinator=HOST:PORT[,HOST:PORT...] [--kind=dpu|host]");
  absl::FlagsUsageConfig usage_config;
  usage_config.version_string = [] { return optimus::VersionLine("optimus-shard"); };
  absl::SetFlagsUsageConfig(usage_config);
  absl::ParseCommandLine(argc, argv);
  // absl::Mutex's deadlock detector (on in Debian's build of absl) keeps a
  // graph of every lock order: a tenth of the coordinator's CPU at 24k
  // heartbeats a second. The tests keep it; the service runs without it.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (absl::GetFlag(FLAGS_verbose)) optimus::SetMinLogLevel(optimus::LogLevel::kDebug);
  optimus::LogFormat log_format;
  if (!optimus::ParseLogFormat(absl::GetFlag(FLAGS_log_format), &log_format)) {
    std::fprintf(stderr, "optimus-shard: --log_format must be text or json\n");
    return 2;
  }
  optimus::SetLogFormat(log_format);

  optimus::server::ShardServerOptions options;
  options.coordinator_address = absl::GetFlag(FLAGS_coordinator);
  options.tls.dir = absl::GetFlag(FLAGS_tls_dir);
  options.tls.plaintext = absl::GetFlag(FLAGS_insecure_plaintext);
  const std::string kind = absl::GetFlag(FLAGS_kind);
  if (kind != "dpu" && kind != "host") {
    std::fprintf(stderr, "optimus-shard: --kind must be dpu or host, got '%s'\n", kind.c_str());
    return 2;
  }
  options.is_dpu = kind == "dpu";
  if (absl::GetFlag(FLAGS_memory_limit_mb) <= 0) {
    std::fprintf(stderr, "optimus-shard: --memory_limit_mb must be positive\n");
    return 2;
  }
  options.memory_limit_bytes = static_cast<uint64_t>(absl::GetFlag(FLAGS_memory_limit_mb)) << 20;
  options.step_threads = absl::GetFlag(FLAGS_step_threads);
  options.kernel_threads = absl::GetFlag(FLAGS_kernel_threads);
  options.step_nice = absl::GetFlag(FLAGS_step_nice);
  options.huge_pages = absl::GetFlag(FLAGS_huge_pages);
  if (options.step_threads < 0 || options.kernel_threads < 0) {
    std::fprintf(stderr,
                 "optimus-shard: --step_threads and --kernel_threads must be >= 0 (0: one per core)\n");
    return 2;
  }
  if (options.step_nice < -19 || options.step_nice > 19) {
    std::fprintf(stderr, "optimus-shard: --step_nice must be -19 to 19 (above 0 the step threads "
                         "run that much nicer; below 0 the UCX progress thread does)\n");
    return 2;
  }
  const int64_t staging_mb = absl::GetFlag(FLAGS_staging_mb);
  if (staging_mb < 0 || staging_mb >= absl::GetFlag(FLAGS_memory_limit_mb)) {
    std::fprintf(stderr,
                 "optimus-shard: --staging_mb must be >= 0 and below --memory_limit_mb (the rest "
                 "holds the jobs' state)\n");
    return 2;
  }
  options.staging_bytes = static_cast<uint64_t>(staging_mb) << 20;
  options.fold_gradients = absl::GetFlag(FLAGS_fold_gradients);
  options.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  options.failure_domain = absl::GetFlag(FLAGS_failure_domain);
  options.audit_versions = absl::GetFlag(FLAGS_audit_versions);
  if (absl::GetFlag(FLAGS_checkpoint_max_mb_per_s) < 0) {
    std::fprintf(stderr, "optimus-shard: --checkpoint_max_mb_per_s must be >= 0\n");
    return 2;
  }
  options.checkpoint_max_bytes_per_second =
      static_cast<uint64_t>(absl::GetFlag(FLAGS_checkpoint_max_mb_per_s)) << 20;
  options.transport.transports = absl::GetFlag(FLAGS_transports);
  options.transport.net_devices = absl::GetFlag(FLAGS_net_devices);
  if (absl::GetFlag(FLAGS_progress_spin_us) < 0) {
    std::fprintf(stderr, "optimus-shard: --progress_spin_us must be >= 0\n");
    return 2;
  }
  options.transport.progress_spin = absl::Microseconds(absl::GetFlag(FLAGS_progress_spin_us));
  options.transport.name = "shard";
  if (absl::GetFlag(FLAGS_max_inflight_mb) <= 0 || absl::GetFlag(FLAGS_max_peers) == 0 ||
      absl::GetFlag(FLAGS_max_parked_pulls_per_peer) == 0 ||
      absl::GetFlag(FLAGS_max_parked_pulls) == 0) {
    std::fprintf(stderr,
                 "optimus-shard: --max_inflight_mb, --max_peers, --max_parked_pulls_per_peer and "
                 "--max_parked_pulls must be > 0\n");
    return 2;
  }
  options.max_parked_pulls_per_peer = absl::GetFlag(FLAGS_max_parked_pulls_per_peer);
  options.max_parked_pulls = absl::GetFlag(FLAGS_max_parked_pulls);
  options.max_inflight_bytes = static_cast<uint64_t>(absl::GetFlag(FLAGS_max_inflight_mb)) << 20;
  options.transport.max_peers = absl::GetFlag(FLAGS_max_peers);
  if (absl::GetFlag(FLAGS_metrics_port) > 0) {
    options.metrics_address =
        optimus::HttpListenAddress(absl::GetFlag(FLAGS_metrics_host), absl::GetFlag(FLAGS_metrics_port));
  }

  // Block the stop signals in every thread (threads inherit the mask) and
  // take them synchronously below.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  auto server = optimus::server::ShardServer::Start(options);
  if (!server.ok()) {
    std::fprintf(stderr, "optimus-shard: %s\n", server.status().ToString().c_str());
    return 1;
  }
  int sig = 0;
  sigwait(&stop_signals, &sig);
  OPTIMUS_LOG(Info, "shard", "signal ", sig, ", shutting down");
  (*server)->Shutdown();
  return 0;
}
