// optimus-coord: the control-plane server. Parses flags into
// CoordinatorOptions, serves until SIGTERM or SIGINT, then shuts down and
// exits 0.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/http_server.h"
#include "common/logging.h"
#include "common/version.h"
#include "coordinator/coordinator.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:7070", "gRPC listen address HOST:PORT; port 0 picks one");
ABSL_FLAG(int, lease_ms, 2000, "A shard with no heartbeat for this many ms is marked DOWN");
ABSL_FLAG(int, sweep_ms, 200, "How often leases are checked, in ms");
ABSL_FLAG(int, max_rpc_threads, 256,
          "Most threads the gRPC server runs calls on; a call finding them all busy is refused "
          "with RESOURCE_EXHAUSTED (clients retry). Heartbeats need none; map watches take at "
          "most half. At least 4");
ABSL_FLAG(std::string, port_file, "",
          "If set, the bound port is written to this file (atomically) once serving");
ABSL_FLAG(int, metrics_port, 0, "HTTP port for /metrics, /healthz and /readyz; 0: off");
ABSL_FLAG(std::string, metrics_host, "0.0.0.0",
          "Address the --metrics_port listens on: 0.0.0.0 (every IPv4 address), :: (every IPv6 "
          "address, and IPv4 where the kernel maps it), or one address such as 127.0.0.1 or ::1");
ABSL_FLAG(std::string, state_dir, "",
          "Folder for durable state (shards, jobs, maps), loaded at start; empty: memory only");
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

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("optimus-coord [--listen=HOST:PORT] [--lease_ms=N] [--port_file=PATH]");
  absl::FlagsUsageConfig usage_config;
  usage_config.version_string = [] { return optimus::VersionLine("optimus-coord"); };
  absl::SetFlagsUsageConfig(usage_config);
  absl::ParseCommandLine(argc, argv);
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
  auto server = optimus::CoordinatorServer::Start(options);
  if (!server.ok()) {
    OPTIMUS_LOG(Error, "coord", "cannot start: ", server.status().ToString());
    return 1;
  }
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
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
