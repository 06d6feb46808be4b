// optimus-local-cluster: the main job. Starts optimus-coord, S shard servers
// and W training workers on this machine (UCX over loopback), shows a live
// progress line, then checks the result against the same training done in
// one process with torch::optim::AdamW. Its last line is one JSON summary.
// Every child is stopped before it exits, on success, failure or Ctrl-C.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/clock.h"
#include "common/coordinator_channels.h"
#include "common/grpc_limits.h"
#include "deploy/local/mlp_task.h"
#include "grpcpp/grpcpp.h"
#include "common/security.h"
#include "proto/optimus.grpc.pb.h"

ABSL_FLAG(int, workers, 2, "training worker processes (W)");
ABSL_FLAG(int, shards, 2, "shard server processes (S)");
ABSL_FLAG(int, steps, 300, "training steps");
ABSL_FLAG(int, hidden, 256, "MLP hidden width");
ABSL_FLAG(uint64_t, seed, 1, "seed of the model and data");
ABSL_FLAG(std::string, bin_dir, "", "folder holding coordinator/, server/, deploy/local/ "
                                    "binaries (default: found from this program's runfiles)");
ABSL_FLAG(std::string, work_dir, "", "folder for logs and port files (default: a new temp dir)");
ABSL_FLAG(double, max_abs_diff, 1e-2, "largest allowed difference from the local AdamW run");
ABSL_FLAG(int, kill_coordinator_at_step, 0,
          "fault drill: SIGKILL optimus-coord when rank 0 reports this step, restart it from its "
          "state after --coordinator_down_ms (0: never)");
ABSL_FLAG(int, coordinator_down_ms, 1500, "how long the killed coordinator stays down");
ABSL_FLAG(int, coordinator_port, 0,
          "optimus-coord's port on 127.0.0.1 (0: any free one). A drill that keeps it down for "
          "minutes wants one outside the ephemeral range: meanwhile an outgoing connection may "
          "take the old port, and the restart could not listen on it");
ABSL_FLAG(int, checkpoint_every_steps, 0,
          "checkpoint the job every N steps into the work dir's ckpt/ folder (0: never)");
ABSL_FLAG(int, kill_shard_at_step, 0,
          "fault drill: SIGKILL shard 0 when rank 0 reports this step. With --replication=1 "
          "the coordinator promotes its chunks' backups and training goes on; with 0 it rolls "
          "the job back to its last checkpoint and the workers re-join (needs "
          "--checkpoint_every_steps). 0: never");
ABSL_FLAG(int, replication, 0, "backups per chunk of the job (0 or 1)");
ABSL_FLAG(std::string, stop_when_file, "",
          "train until this file exists (then a few more steps; at least --steps, at most "
          "10x): lets a test decide when training ends, whatever the machine's speed");
ABSL_FLAG(int, drain_shard_at_step, 0,
          "drill: drain shard 0 (optimusctl drain) when rank 0 reports this step, stop it once "
          "it holds no chunk; training goes on (0: never)");
ABSL_FLAG(bool, python_workers, false,
          "run the Python example python/examples/train_gpt.py (a small GPT on synthetic data, "
          "optimus.torch.DistributedOptimizer) as the W workers instead of the C++ MLP workers; "
          "success is a lower final loss (no single-process reference run)");
ABSL_FLAG(std::string, python_mode, "layerwise",
          "with --python_workers: DistributedOptimizer's mode (layerwise, delayed or none)");
ABSL_FLAG(std::string, python, "/usr/bin/python3",
          "with --python_workers: the interpreter (Debian's, with python3-torch)");
ABSL_FLAG(bool, insecure_plaintext, false,
          "plain-text gRPC with no authentication; default: TLS with a CA and certificates "
          "made in the work dir (scripts/make_local_ca.sh), workers proving a job token");
ABSL_FLAG(int, launcher_lag_ms, 0,
          "drills: wait this long after an event before choosing the last step (emulates a "
          "launcher that falls behind the workers' progress, as on a loaded machine; tests)");
ABSL_FLAG(int, worker_min_step_ms, 0,
          "each worker step takes at least this long (drills that last minutes, e.g. "
          "--coordinator_down_ms=180000, without tens of thousands of steps; same results)");
ABSL_FLAG(int, metrics_port, 0,
          "serve Prometheus /metrics and /healthz: the coordinator on this port, shard i on "
          "this port + 1 + i, and with --coordinators=N coordinator j > 0 on this port + "
          "shards + j (0: off)");
ABSL_FLAG(std::string, etcd_endpoints, "",
          "keep the coordinator's state in this etcd (HOST:PORT,...; one you run) instead of "
          "a state folder: optimus-coord's etcd mode, with leader election");
ABSL_FLAG(std::string, etcd_prefix, "/optimus-local",
          "with --etcd_endpoints: the key prefix of this cluster's state");
ABSL_FLAG(int, etcd_lease_ttl_s, 0,
          "with --etcd_endpoints: the leader's etcd lease TTL in seconds (optimus-coord "
          "--etcd_lease_ttl_s; a standby takes over within about it); 0: optimus-coord's default "
          "(--lease_ms rounded up, at least 2)");
ABSL_FLAG(int, coordinators, 1,
          "optimus-coord processes (with --etcd_endpoints): one leads, the others stand by "
          "without listening; shards, workers and this launcher are given every address");
ABSL_FLAG(int, kill_leader_at_step, 0,
          "drill (--coordinators >= 2): SIGKILL the leading optimus-coord when rank 0 reports "
          "this step (after the drain, when --drain_shard_at_step is the same step); a standby "
          "takes over and training goes on (0: never)");

// Drills end training this many steps after their event (restart, drain,
// failover, rollback), so there is training before and after it whatever the
// machine's speed; also far enough ahead that no worker has passed it yet
// (workers are at most one step apart).
constexpr int kStepsAfterEvent = 20;
// With a drill, workers may run up to this many times --steps while the
// event has not happened yet (then the drill fails on its own checks).
constexpr int kDrillStepCap = 10;
// The job optimus-train-worker creates (its --job default).
constexpr char kJobName[] = "local-mlp";

namespace {

std::vector<pid_t> g_children;  // Every process started, for cleanup.

void KillAll(int sig) {
  for (pid_t p : g_children) {
    if (p > 0) kill(p, sig);
  }
}

void OnSignal(int sig) {
  KillAll(SIGKILL);
  _exit(128 + sig);
}

bool Exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

// mkdir -p; empty, or why it could not.
std::string MakeDirs(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (!ec && std::filesystem::is_directory(path, ec)) return "";
  return absl::StrCat("cannot create folder ", path, ": ",
                      ec ? ec.message() : std::string("a file is in the way"));
}

// rm -f.
void RemoveFile(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove(path, ec);
}

// Finds the folder under which "server/optimus-shard" etc. live.
std::string FindBinRoot(const char* argv0) {
  std::vector<std::string> candidates;
  if (!absl::GetFlag(FLAGS_bin_dir).empty()) candidates.push_back(absl::GetFlag(FLAGS_bin_dir));
  if (const char* r = std::getenv("RUNFILES_DIR")) candidates.push_back(absl::StrCat(r, "/optimus"));
  candidates.push_back(absl::StrCat(argv0, ".runfiles/optimus"));
  std::string self(argv0);
  const size_t slash = self.rfind('/');
  if (slash != std::string::npos) candidates.push_back(self.substr(0, slash) + "/../..");
  candidates.push_back(".");
  for (const auto& c : candidates) {
    if (Exists(c + "/server/optimus-shard") && Exists(c + "/coordinator/optimus-coord") &&
        Exists(c + "/deploy/local/optimus-train-worker")) {
      return c;
    }
  }
  return "";
}

// Finds the folder holding python/optimus/ (sources and _C.so) and
// python/examples/: this program's runfiles (a data dependency).
// The source-tree folder (runfiles) holding `relative_path`; "" if none.
std::string FindRunfilesRoot(const char* argv0, const std::string& bin_root,
                             const std::vector<std::string>& relative_paths) {
  std::vector<std::string> candidates;
  if (const char* r = std::getenv("RUNFILES_DIR")) candidates.push_back(absl::StrCat(r, "/optimus"));
  candidates.push_back(absl::StrCat(argv0, ".runfiles/optimus"));
  candidates.push_back(bin_root);
  if (!absl::GetFlag(FLAGS_bin_dir).empty()) {
    candidates.push_back(absl::StrCat(absl::GetFlag(FLAGS_bin_dir), "/deploy/local/local_cluster.runfiles/optimus"));
  }
  for (const auto& c : candidates) {
    bool all = true;
    for (const auto& p : relative_paths) all = all && Exists(c + "/" + p);
    if (all) return c;
  }
  return "";
}

std::string FindPythonRoot(const char* argv0, const std::string& bin_root) {
  return FindRunfilesRoot(argv0, bin_root,
                          {"python/optimus/__init__.py", "python/optimus/_C.so",
                           "python/examples/train_gpt.py"});
}

// Starts argv with stdout/stderr to `log_path`, or stdout to a pipe when
// stdout_pipe is given.
pid_t Spawn(const std::vector<std::string>& args, const std::string& log_path,
            int* stdout_pipe = nullptr,
            const std::vector<std::string>& env = std::vector<std::string>()) {
  int fds[2] = {-1, -1};
  if (stdout_pipe != nullptr && pipe(fds) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (log >= 0) {
      dup2(log, 2);
      dup2(stdout_pipe != nullptr ? fds[1] : log, 1);
    }
    if (stdout_pipe != nullptr) {
      close(fds[0]);
      close(fds[1]);
    }
    // Die with the launcher even if it is killed with SIGKILL.
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    for (const auto& kv : env) putenv(const_cast<char*>(kv.c_str()));
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    std::fprintf(stderr, "exec %s: %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  if (stdout_pipe != nullptr) {
    close(fds[1]);
    *stdout_pipe = fds[0];
  }
  if (pid > 0) g_children.push_back(pid);
  return pid;
}

// Waits for pid with a timeout; true if it exited (status in *status).
bool WaitFor(pid_t pid, absl::Duration timeout, int* status) {
  const absl::Time give_up = absl::Now() + timeout;
  while (absl::Now() < give_up) {
    const pid_t r = waitpid(pid, status, WNOHANG);
    if (r == pid) return true;
    if (r < 0) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

void StopChild(pid_t pid) {
  int status = 0;
  kill(pid, SIGTERM);
  if (!WaitFor(pid, absl::Seconds(10), &status)) {
    kill(pid, SIGKILL);
    WaitFor(pid, absl::Seconds(5), &status);
  }
}

// Whether job `name` has a complete checkpoint to roll back to.
using CoordStub = optimus::LeaderStub<optimus::v1::Coordinator>;

bool HasCompleteCheckpoint(CoordStub& stub, const std::string& name) {
  optimus::v1::ListCheckpointsRequest req;
  req.set_job_name(name);
  optimus::v1::ListCheckpointsResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
  if (!stub.Call(&optimus::v1::Coordinator::Stub::ListCheckpoints, &ctx, req, &resp).ok()) {
    return false;
  }
  for (const auto& c : resp.checkpoints()) {
    if (c.state() == optimus::v1::CHECKPOINT_STATE_COMPLETE) return true;
  }
  return false;
}

std::string TailOf(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  return s.size() > 2000 ? s.substr(s.size() - 2000) : s;
}

// Minimal field extraction from the worker's one-line JSON objects.
bool JsonNumber(absl::string_view line, absl::string_view key, double* out) {
  const std::string pat = absl::StrCat("\"", key, "\": ");
  const size_t at = line.find(pat);
  if (at == absl::string_view::npos) return false;
  absl::string_view rest = line.substr(at + pat.size());
  const size_t end = rest.find_first_of(",}");
  return absl::SimpleAtod(rest.substr(0, end), out);
}

int Die(const std::string& msg) {
  std::fprintf(stderr, "\noptimus-local-cluster: %s\n", msg.c_str());
  KillAll(SIGKILL);
  return 1;
}

// Rank 0's progress lines (JSON, one per step), read from its stdout pipe.
// The launcher may lag the workers by many lines; ReadAvailable takes what
// the pipe holds now, so that a stop step can be chosen past all of it.
class ProgressReader {
 public:
  explicit ProgressReader(int fd) : fd_(fd) {}
  // The next line (without its newline), waiting for it; false at the end
  // of the stream (a last line without a newline is still returned).
  bool Next(std::string* line) {
    for (;;) {
      const size_t nl = buf_.find('\n');
      if (nl != std::string::npos) {
        *line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return true;
      }
      if (fd_ < 0 || !Read()) {
        if (buf_.empty()) return false;
        *line = std::move(buf_);
        buf_.clear();
        return true;
      }
    }
  }
  // Reads whatever the pipe holds now, without waiting.
  void ReadAvailable() {
    for (;;) {
      pollfd p = {fd_, POLLIN, 0};
      if (fd_ < 0 || poll(&p, 1, 0) <= 0 || !Read()) return;
    }
  }
  // The highest step of the whole lines read and not yet taken by Next.
  int MaxPendingStep() const {
    int best = 0;
    size_t start = 0;
    for (size_t nl = buf_.find('\n'); nl != std::string::npos; nl = buf_.find('\n', start)) {
      absl::string_view l(buf_.data() + start, nl - start);
      double step = 0;
      if (l.find("\"event\": \"step\"") != absl::string_view::npos &&
          JsonNumber(l, "step", &step)) {
        best = std::max(best, static_cast<int>(step));
      }
      start = nl + 1;
    }
    return best;
  }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  // One read(); false at the end of the stream or on an error.
  bool Read() {
    char chunk[4096];
    ssize_t n;
    do {
      n = read(fd_, chunk, sizeof(chunk));
    } while (n < 0 && errno == EINTR);
    if (n <= 0) return false;
    buf_.append(chunk, static_cast<size_t>(n));
    return true;
  }

  int fd_;
  std::string buf_;
};

// Stops (SIGSTOP) the given processes and waits until each is stopped or
// gone (state 'T' in /proc/PID/stat), for up to 10 s.
void PauseAll(const std::vector<pid_t>& pids) {
  for (pid_t p : pids) {
    if (p > 0) kill(p, SIGSTOP);
  }
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  for (pid_t p : pids) {
    while (p > 0 && absl::Now() < give_up) {
      std::ifstream in(absl::StrCat("/proc/", p, "/stat"));
      std::string stat;
      if (!std::getline(in, stat)) break;  // Gone.
      const size_t paren = stat.rfind(')');
      if (paren == std::string::npos || paren + 2 >= stat.size()) break;
      const char state = stat[paren + 2];
      if (state == 'T' || state == 't' || state == 'Z' || state == 'X') break;
      absl::SleepFor(absl::Milliseconds(1));
    }
  }
}

void ResumeAll(const std::vector<pid_t>& pids) {
  for (pid_t p : pids) {
    if (p > 0) kill(p, SIGCONT);
  }
}

// A port on 127.0.0.1 below the ephemeral range that nothing is bound to
// now; 0 if none found. A standby coordinator does not listen until it
// leads: meanwhile a port of the ephemeral range could be taken by an
// outgoing connection's local end, and the standby could never listen.
int FreePortBelowEphemeral() {
  int low = 32768;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r"); f != nullptr) {
    if (std::fscanf(f, "%d", &low) != 1) low = 32768;
    std::fclose(f);
  }
  if (low <= 10100) return 0;
  std::mt19937 rng(static_cast<uint32_t>(getpid()) ^
                   static_cast<uint32_t>(absl::ToUnixNanos(absl::Now())));
  std::uniform_int_distribution<int> pick(10000, low - 1);
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int port = pick(rng);
    const int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) return 0;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    const bool free = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    close(fd);
    if (free) return port;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  signal(SIGINT, OnSignal);
  signal(SIGTERM, OnSignal);
  signal(SIGPIPE, SIG_IGN);
  const int workers = absl::GetFlag(FLAGS_workers);
  const int shards = absl::GetFlag(FLAGS_shards);
  const int steps = absl::GetFlag(FLAGS_steps);
  if (workers < 1 || shards < 1 || steps < 1) return Die("--workers, --shards, --steps must be >= 1");

  const std::string root = FindBinRoot(argv[0]);
  if (root.empty()) {
    return Die("cannot find optimus-coord/optimus-shard/optimus-train-worker; "
               "run through `bazel run //deploy/local:local_cluster` or pass --bin_dir");
  }
  std::string dir = absl::GetFlag(FLAGS_work_dir);
  if (dir.empty()) {
    char tmpl[] = "/tmp/optimus-local-XXXXXX";
    if (mkdtemp(tmpl) == nullptr) return Die("cannot create a temp dir");
    dir = tmpl;
  } else if (std::string why = MakeDirs(dir); !why.empty()) {
    return Die(why);
  }
  const bool python_workers = absl::GetFlag(FLAGS_python_workers);
  std::string python_root;
  if (python_workers) {
    python_root = FindPythonRoot(argv[0], root);
    if (python_root.empty()) {
      return Die("cannot find python/optimus (with _C.so) and python/examples/train_gpt.py; "
                 "build //deploy/local:local_cluster (they are its data) and run it from "
                 "bazel-bin or through bazel run");
    }
    const std::string mode = absl::GetFlag(FLAGS_python_mode);
    if (mode != "layerwise" && mode != "delayed" && mode != "none") {
      return Die("--python_mode must be layerwise, delayed or none");
    }
    if (absl::GetFlag(FLAGS_kill_coordinator_at_step) > 0 ||
        absl::GetFlag(FLAGS_kill_leader_at_step) > 0 ||
        absl::GetFlag(FLAGS_kill_shard_at_step) > 0 ||
        absl::GetFlag(FLAGS_drain_shard_at_step) > 0 ||
        !absl::GetFlag(FLAGS_stop_when_file).empty() ||
        absl::GetFlag(FLAGS_checkpoint_every_steps) > 0 || absl::GetFlag(FLAGS_replication) > 0) {
      return Die("--python_workers runs plain training: the drills, checkpoints and "
                 "replication flags are for the C++ workers");
    }
  }
  std::fprintf(stderr, "optimus-local-cluster: %d shards, %d %sworkers, %d steps; logs in %s\n",
               shards, workers, python_workers ? "Python " : "", steps, dir.c_str());

  // 0. TLS: a local CA and a certificate per process (scripts/make_local_ca.sh);
  // workers prove a job token. Or plain text when asked for.
  const bool plaintext = absl::GetFlag(FLAGS_insecure_plaintext);
  const std::string tls_dir = dir + "/tls";
  std::string job_token;
  if (!plaintext) {
    const std::string scripts = FindRunfilesRoot(argv[0], root, {"scripts/make_local_ca.sh"});
    if (scripts.empty()) return Die("cannot find scripts/make_local_ca.sh (a data dependency)");
    const std::string cmd = absl::StrCat(scripts, "/scripts/make_local_ca.sh ", tls_dir,
                                         " --shards ", shards, " >/dev/null");
    if (std::system(cmd.c_str()) != 0) return Die("making the local CA failed: " + cmd);
    auto token = optimus::security::NewToken();
    if (!token.ok()) return Die(std::string(token.status().message()));
    job_token = *token;
    std::fprintf(stderr,
                 "optimus-local-cluster: TLS with the CA in %s (optimusctl --tls_dir=%s/admin)\n",
                 tls_dir.c_str(), tls_dir.c_str());
  }
  // `who`: coordinator, shard-<i>, admin or trainer.
  auto tls_flag = [&](const std::string& who) {
    return plaintext ? std::string("--insecure_plaintext") : "--tls_dir=" + tls_dir + "/" + who;
  };
  std::vector<std::string> worker_env =
      plaintext ? std::vector<std::string>{"OPTIMUS_INSECURE_PLAINTEXT=1"}
                : std::vector<std::string>{"OPTIMUS_TLS_DIR=" + tls_dir + "/trainer",
                                           "OPTIMUS_JOB_TOKEN=" + job_token};

  // 1. Coordinator on an ephemeral port, its durable state in the work dir.
  const std::string port_file = dir + "/coord.port";
  RemoveFile(port_file);
  const std::string state_dir = dir + "/coord-state";
  const int metrics_port = absl::GetFlag(FLAGS_metrics_port);
  const int ckpt_every = absl::GetFlag(FLAGS_checkpoint_every_steps);
  const int kill_shard_at = absl::GetFlag(FLAGS_kill_shard_at_step);
  const int replication = absl::GetFlag(FLAGS_replication);
  const int drain_at = absl::GetFlag(FLAGS_drain_shard_at_step);
  if (ckpt_every < 0 || kill_shard_at < 0 || drain_at < 0) return Die("negative step flags");
  if (replication != 0 && replication != 1) return Die("--replication must be 0 or 1");
  if (kill_shard_at > 0 && drain_at > 0) return Die("drain and kill drills are exclusive");
  if (kill_shard_at > 0 && ckpt_every == 0 && replication == 0) {
    return Die("--kill_shard_at_step needs --checkpoint_every_steps (rollback needs a "
               "checkpoint) or --replication=1");
  }
  if (kill_shard_at > 0 && replication == 0 && kill_shard_at <= ckpt_every) {
    return Die("--kill_shard_at_step must come after the first checkpoint (> --checkpoint_every_steps)");
  }
  const std::string ckpt_dir = dir + "/ckpt";
  if (ckpt_every > 0) {
    if (std::string why = MakeDirs(ckpt_dir); !why.empty()) return Die(why);
  }
  if (metrics_port < 0 || metrics_port + shards > 65535) return Die("--metrics_port out of range");
  const std::string etcd = absl::GetFlag(FLAGS_etcd_endpoints);
  const int num_coords = absl::GetFlag(FLAGS_coordinators);
  const int kill_leader_at = absl::GetFlag(FLAGS_kill_leader_at_step);
  if (num_coords < 1 || num_coords > 9) return Die("--coordinators must be 1 to 9");
  if (num_coords > 1 && etcd.empty()) {
    return Die("--coordinators > 1 needs --etcd_endpoints: a standby takes over from the state "
               "in etcd");
  }
  if (kill_leader_at < 0) return Die("negative step flags");
  if (kill_leader_at > 0 && num_coords < 2) {
    return Die("--kill_leader_at_step needs --coordinators >= 2 (a standby to take over)");
  }
  if (kill_leader_at > 0 && (absl::GetFlag(FLAGS_kill_coordinator_at_step) > 0 || kill_shard_at > 0)) {
    return Die("--kill_leader_at_step, --kill_coordinator_at_step and --kill_shard_at_step are "
               "exclusive");
  }
  if (!etcd.empty() && absl::GetFlag(FLAGS_kill_coordinator_at_step) > 0) {
    return Die("--kill_coordinator_at_step restarts optimus-coord from its state folder; with "
               "--etcd_endpoints use --coordinators=2 --kill_leader_at_step");
  }
  if (metrics_port > 0 && metrics_port + shards + num_coords > 65535) {
    return Die("--metrics_port out of range");
  }
  // Coordinator i's flags, listening on `listen`: its state in the work
  // dir's folder, or in etcd (then it stands by until elected, and says
  // where it listens once it leads: --advertise_address).
  auto coord_args = [&](int i, const std::string& listen) {
    std::vector<std::string> args{root + "/coordinator/optimus-coord", "--listen=" + listen,
                                  "--lease_ms=2000", tls_flag("coordinator")};
    if (etcd.empty()) {
      args.push_back("--port_file=" + port_file);
      args.push_back("--state_dir=" + state_dir);
    } else {
      args.push_back("--etcd_endpoints=" + etcd);
      args.push_back("--etcd_prefix=" + absl::GetFlag(FLAGS_etcd_prefix));
      args.push_back("--advertise_address=" + listen);
      if (absl::GetFlag(FLAGS_etcd_lease_ttl_s) > 0) {
        args.push_back(absl::StrCat("--etcd_lease_ttl_s=", absl::GetFlag(FLAGS_etcd_lease_ttl_s)));
      }
    }
    if (metrics_port > 0) {
      args.push_back(absl::StrCat("--metrics_port=",
                                  i == 0 ? metrics_port : metrics_port + shards + i));
    }
    if (ckpt_every > 0) args.push_back("--checkpoint_dir=" + ckpt_dir);
    return args;
  };
  auto coord_log = [&](int i) {
    return etcd.empty() ? dir + "/coord.log" : absl::StrCat(dir, "/coord-", i, ".log");
  };
  const int coordinator_port = absl::GetFlag(FLAGS_coordinator_port);
  if (coordinator_port < 0 || coordinator_port > 65535) return Die("--coordinator_port out of range");
  // Every coordinator's process and address; coord_addr, what shards,
  // workers and this launcher are given, lists them all.
  std::vector<pid_t> coord_pids(num_coords, -1);
  std::vector<std::string> coord_listen(num_coords);
  std::string coord_addr;
  if (etcd.empty()) {
    coord_pids[0] =
        Spawn(coord_args(0, absl::StrCat("127.0.0.1:", coordinator_port)), coord_log(0));
    if (coord_pids[0] < 0) return Die("cannot start optimus-coord");
    std::string port;
    for (int i = 0; i < 300 && port.empty(); ++i) {
      std::ifstream in(port_file);
      std::getline(in, port);
      if (port.empty()) absl::SleepFor(absl::Milliseconds(50));
    }
    if (port.empty()) return Die("optimus-coord did not start:\n" + TailOf(coord_log(0)));
    coord_listen[0] = coord_addr = "127.0.0.1:" + port;
  } else {
    for (int i = 0; i < num_coords; ++i) {
      const int p = num_coords == 1 && coordinator_port > 0 ? coordinator_port
                                                            : FreePortBelowEphemeral();
      if (p == 0) return Die("no free port below the ephemeral range for optimus-coord");
      coord_listen[i] = absl::StrCat("127.0.0.1:", p);
      coord_pids[i] = Spawn(coord_args(i, coord_listen[i]), coord_log(i));
      if (coord_pids[i] < 0) return Die("cannot start optimus-coord");
      absl::StrAppend(&coord_addr, i == 0 ? "" : ",", coord_listen[i]);
    }
    std::fprintf(stderr, "optimus-local-cluster: %d coordinators (%s), state in etcd at %s\n",
                 num_coords, coord_addr.c_str(), etcd.c_str());
  }
  pid_t coord = coord_pids[0];  // The state-folder mode's one coordinator.

  // 2. Shard servers; wait until all are registered.
  std::vector<pid_t> shard_pids;
  for (int i = 0; i < shards; ++i) {
    std::vector<std::string> args{root + "/server/optimus-shard", "--coordinator=" + coord_addr,
                                  "--kind=host", "--net_devices=lo", "--memory_limit_mb=512",
                                  tls_flag(absl::StrCat("shard-", i))};
    if (metrics_port > 0) args.push_back(absl::StrCat("--metrics_port=", metrics_port + 1 + i));
    if (ckpt_every > 0) args.push_back("--checkpoint_dir=" + ckpt_dir);
    shard_pids.push_back(Spawn(args, absl::StrCat(dir, "/shard-", i, ".log")));
  }
  optimus::security::TlsOptions admin_tls;
  if (plaintext) {
    admin_tls.plaintext = true;
  } else {
    admin_tls.dir = tls_dir + "/admin";
  }
  auto admin_channels =
      optimus::CoordinatorChannels::Dial(coord_addr, admin_tls, "optimus-local-cluster");
  if (!admin_channels.ok()) return Die(std::string(admin_channels.status().message()));
  CoordStub stub(*admin_channels);
  // Each coordinator on its own, to tell which one leads (only it listens).
  std::vector<std::unique_ptr<optimus::v1::Coordinator::Stub>> each_coord;
  for (int i = 0; i < num_coords; ++i) {
    each_coord.push_back(optimus::v1::Coordinator::NewStub((*admin_channels)->channel(i)));
  }
  auto leader_index = [&]() -> int {
    for (int i = 0; i < num_coords; ++i) {
      if (coord_pids[i] < 0) continue;
      optimus::v1::StatusRequest req;
      req.set_page_size(1);
      optimus::v1::StatusResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
      if (each_coord[i]->Status(&ctx, req, &resp).ok()) return i;
    }
    return -1;
  };
  if (!etcd.empty() &&
      !(*admin_channels)->WaitForConnected(absl::Now() + absl::Seconds(60))) {
    std::string logs;
    for (int i = 0; i < num_coords; ++i) absl::StrAppend(&logs, TailOf(coord_log(i)), "\n");
    return Die("no optimus-coord took the lead within 60 s:\n" + logs);
  }
  int up = 0;
  for (int i = 0; i < 900 && up < shards; ++i) {
    optimus::v1::StatusRequest req;
    optimus::v1::StatusResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    up = 0;
    if (stub.Call(&optimus::v1::Coordinator::Stub::Status, &ctx, req, &resp).ok()) {
      for (const auto& s : resp.shards()) up += s.state() == optimus::v1::SHARD_STATE_UP;
    }
    if (up < shards) absl::SleepFor(absl::Milliseconds(50));
  }
  if (up < shards) {
    return Die(absl::StrCat(up, " of ", shards, " shards registered:\n",
                            TailOf(dir + "/shard-0.log")));
  }

  // 3. Workers; rank 0's stdout drives the progress line. In a drill they
  // train until the launcher writes the last step into stop_file.
  const int kill_at = absl::GetFlag(FLAGS_kill_coordinator_at_step);
  const std::string stop_when = absl::GetFlag(FLAGS_stop_when_file);
  const bool open_ended = kill_at > 0 || kill_shard_at > 0 || drain_at > 0 ||
                          kill_leader_at > 0 || !stop_when.empty();
  const std::string stop_file = dir + "/stop-after-step";
  RemoveFile(stop_file);
  // Until the stop file: at most kDrillStepCap x --steps in a drill;
  // without a bound when a test decides (--stop_when_file).
  const int worker_steps =
      !stop_when.empty() ? (1 << 30) : (open_ended ? steps * kDrillStepCap : steps);
  int final_steps = steps;
  bool stop_written = false;
  std::vector<pid_t> worker_pids;
  int progress_fd = -1;
  std::unique_ptr<ProgressReader> progress;  // Rank 0's stdout, once started.
  // Writes the last step into the stop file: kStepsAfterEvent past the
  // event and past every step a worker may have reached. This launcher can
  // be many steps behind rank 0's progress lines (a drain's Status calls, a
  // shard's shutdown, a loaded machine), so the workers are paused while it
  // reads every line already written and writes the file: the step chosen is
  // then ahead of all of them, whatever the machine's speed (workers are at
  // most a step or two apart, the margin is 20).
  auto stop_after = [&](int event_step) {
    if (stop_written) return;
    if (absl::GetFlag(FLAGS_launcher_lag_ms) > 0) {
      absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_launcher_lag_ms)));
    }
    PauseAll(worker_pids);
    int seen = event_step;
    if (progress != nullptr) {
      progress->ReadAvailable();
      seen = std::max(seen, progress->MaxPendingStep());
    }
    final_steps = std::max(steps, seen + kStepsAfterEvent);
    const std::string tmp = stop_file + ".tmp";
    {
      std::ofstream out(tmp);
      out << final_steps << "\n";
    }
    rename(tmp.c_str(), stop_file.c_str());  // Workers never read half a number.
    stop_written = true;
    ResumeAll(worker_pids);
    std::fprintf(stderr, "training ends after step %d\n", final_steps);
  };
  const std::string params_file = dir + "/params-rank0.bin";
  for (int r = 0; r < workers && python_workers; ++r) {
    // torchrun's variables, and the coordinator: the example's one-call setup.
    std::vector<std::string> env = {
        absl::StrCat("RANK=", r), absl::StrCat("WORLD_SIZE=", workers),
        "OPTIMUS_COORDINATOR=" + coord_addr, "OPTIMUS_JOB=local-gpt",
        "PYTHONPATH=" + python_root + "/python", "UCX_NET_DEVICES=lo",
        "PYTHONDONTWRITEBYTECODE=1"};
    env.insert(env.end(), worker_env.begin(), worker_env.end());
    std::vector<std::string> args = {absl::GetFlag(FLAGS_python),
                                     python_root + "/python/examples/train_gpt.py",
                                     absl::StrCat("--steps=", steps),
                                     absl::StrCat("--seed=", absl::GetFlag(FLAGS_seed)),
                                     "--mode=" + absl::GetFlag(FLAGS_python_mode)};
    worker_pids.push_back(Spawn(args, absl::StrCat(dir, "/worker-", r, ".log"),
                                r == 0 ? &progress_fd : nullptr, env));
  }
  for (int r = 0; r < workers && !python_workers; ++r) {
    std::vector<std::string> args = {root + "/deploy/local/optimus-train-worker",
                                     "--coordinator=" + coord_addr,
                                     absl::StrCat("--rank=", r),
                                     absl::StrCat("--world_size=", workers),
                                     absl::StrCat("--steps=", worker_steps),
                                     absl::StrCat("--hidden=", absl::GetFlag(FLAGS_hidden)),
                                     absl::StrCat("--seed=", absl::GetFlag(FLAGS_seed)),
                                     "--net_devices=lo"};
    if (r == 0) args.push_back("--params_out=" + params_file);
    if (open_ended) args.push_back("--stop_file=" + stop_file);
    if (absl::GetFlag(FLAGS_worker_min_step_ms) > 0) {
      args.push_back(absl::StrCat("--min_step_ms=", absl::GetFlag(FLAGS_worker_min_step_ms)));
    }
    if (ckpt_every > 0) args.push_back(absl::StrCat("--checkpoint_every_steps=", ckpt_every));
    if (kill_shard_at > 0 && replication == 0) args.push_back("--follow_rollback");
    if (replication > 0) args.push_back(absl::StrCat("--replication=", replication));
    worker_pids.push_back(Spawn(args, absl::StrCat(dir, "/worker-", r, ".log"),
                                r == 0 ? &progress_fd : nullptr, worker_env));
  }
  double initial_loss = NAN, final_loss = NAN, step_ms_median = NAN;
  bool coord_down = false;
  absl::Time restart_at;
  int killed_at_step = 0, restarted_at_step = 0, last_step = 0;
  // The fault drill: SIGKILL the coordinator, then restart it on the same
  // port from its state folder while the workers keep training.
  int shard_killed_at_step = 0;
  int drained_at_step = 0, drain_done_at_step = 0;
  uint64_t drain_id = 0;
  // The leader-kill drill: which coordinator led and was killed, when, and
  // which one leads after it (found by asking each: only the leader
  // listens) and how long after the kill it first answered.
  int killed_leader = -1, new_leader = -1;
  int leader_killed_at_step = 0, new_leader_at_step = 0;
  absl::Time leader_killed_time;
  absl::Duration leader_gap;
  // Training ends a set number of steps after the last of the drill's
  // events: the drain done and the new leader found, when both are asked.
  auto drain_done = [&] { return drain_at == 0 || drain_done_at_step > 0; };
  auto leader_back = [&] { return kill_leader_at == 0 || new_leader >= 0; };
  auto shard0_id = [&]() -> uint64_t {
    // Shard 0 logs its id when it registers.
    std::ifstream in(dir + "/shard-0.log");
    std::string line;
    while (std::getline(in, line)) {
      const size_t at = line.find("registered shard_id=");
      if (at != std::string::npos) return std::strtoull(line.c_str() + at + 20, nullptr, 10);
    }
    return 0;
  };
  auto drill = [&]() -> bool {
    if (kill_shard_at > 0 && shard_killed_at_step == 0 && last_step >= kill_shard_at &&
        (replication > 0 || HasCompleteCheckpoint(stub, kJobName))) {
      // Without a replica the job rolls back: only once a checkpoint exists.
      kill(shard_pids[0], SIGKILL);
      // Reap it at once, as an init system or container runtime would:
      // peers on shared memory find a dead process by its pid, and a
      // zombie still has one.
      int st = 0;
      if (WaitFor(shard_pids[0], absl::Seconds(5), &st)) shard_pids[0] = -1;
      shard_killed_at_step = last_step;
      std::fprintf(stderr, "fault drill: killed optimus-shard 0 (SIGKILL) at step %d\n", last_step);
      stop_after(last_step);
    }
    if (!stop_when.empty() && Exists(stop_when)) stop_after(last_step);
    if (drain_at > 0 && drained_at_step == 0 && last_step >= drain_at) {
      drain_id = shard0_id();
      optimus::v1::DrainShardRequest req;
      req.set_shard_id(drain_id);
      optimus::v1::DrainShardResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      const grpc::Status st =
          stub.Call(&optimus::v1::Coordinator::Stub::DrainShard, &ctx, req, &resp);
      if (!st.ok()) {
        std::fprintf(stderr, "drill: drain of shard %llu refused: %s\n",
                     static_cast<unsigned long long>(drain_id), st.error_message().c_str());
        return false;
      }
      drained_at_step = last_step;
      std::fprintf(stderr, "drill: draining optimus-shard 0 (id %llu, %u chunks) at step %d\n",
                   static_cast<unsigned long long>(drain_id), resp.chunks_to_move(), last_step);
    }
    if (drained_at_step > 0 && drain_done_at_step == 0) {
      optimus::v1::StatusRequest req;
      optimus::v1::StatusResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
      if (stub.Call(&optimus::v1::Coordinator::Stub::Status, &ctx, req, &resp).ok()) {
        for (const auto& sh : resp.shards()) {
          if (sh.shard_id() == drain_id && sh.chunks_owned() == 0) {
            drain_done_at_step = last_step;
            StopChild(shard_pids[0]);
            shard_pids[0] = -1;
            std::fprintf(stderr, "drill: shard 0 drained at step %d and stopped\n", last_step);
            if (leader_back()) stop_after(last_step);
          }
        }
      }
    }
    if (kill_leader_at > 0 && leader_killed_at_step == 0 && last_step >= kill_leader_at) {
      // None answering (an election under way): try again at the next step.
      if (const int leader = leader_index(); leader >= 0) {
        kill(coord_pids[leader], SIGKILL);
        int st = 0;
        if (WaitFor(coord_pids[leader], absl::Seconds(5), &st)) coord_pids[leader] = -1;
        killed_leader = leader;
        leader_killed_at_step = last_step;
        leader_killed_time = absl::Now();
        std::fprintf(stderr,
                     "fault drill: killed the leading optimus-coord %d (%s, SIGKILL) at step %d\n",
                     leader, coord_listen[leader].c_str(), last_step);
      }
    }
    if (leader_killed_at_step > 0 && new_leader < 0) {
      if (const int leader = leader_index(); leader >= 0) {
        new_leader = leader;
        new_leader_at_step = last_step;
        leader_gap = absl::Now() - leader_killed_time;
        std::fprintf(stderr,
                     "fault drill: optimus-coord %d (%s) leads at step %d, %.0f ms after the "
                     "kill\n",
                     leader, coord_listen[leader].c_str(), last_step,
                     absl::ToDoubleMilliseconds(leader_gap));
        if (drain_done()) stop_after(last_step);
      }
    }
    if (kill_at > 0 && killed_at_step == 0 && last_step >= kill_at) {
      kill(coord, SIGKILL);
      int st = 0;
      WaitFor(coord, absl::Seconds(5), &st);
      killed_at_step = last_step;
      coord_down = true;
      restart_at = absl::Now() + absl::Milliseconds(absl::GetFlag(FLAGS_coordinator_down_ms));
      std::fprintf(stderr, "fault drill: killed optimus-coord (SIGKILL) at step %d\n", last_step);
    }
    if (coord_down && absl::Now() >= restart_at) {
      coord = Spawn(coord_args(0, coord_addr), dir + "/coord-restarted.log");
      if (coord < 0) return false;
      coord_down = false;
      restarted_at_step = last_step;
      std::fprintf(stderr, "fault drill: restarted optimus-coord at step %d\n", last_step);
      stop_after(last_step);
    }
    return true;
  };
  {
    progress = std::make_unique<ProgressReader>(progress_fd);
    std::string line;
    const bool tty = isatty(2);
    while (progress->Next(&line)) {
      absl::string_view l(line);
      double step = 0, loss = 0, ms = 0;
      if (l.find("\"event\": \"step\"") != absl::string_view::npos && JsonNumber(l, "step", &step) &&
          JsonNumber(l, "loss", &loss) && JsonNumber(l, "step_ms", &ms)) {
        const int s = static_cast<int>(step);
        last_step = s;
        if (!drill()) return Die("cannot restart optimus-coord");
        if (tty) {
          std::fprintf(stderr, "\rstep %d/%d  loss %.5f  step %.1f ms   ", s, final_steps, loss, ms);
        } else if (s == 1 || s % 50 == 0 || s == final_steps) {
          std::fprintf(stderr, "step %d/%d  loss %.5f  step %.1f ms\n", s, final_steps, loss, ms);
        }
      } else if (l.find("\"event\": \"done\"") != absl::string_view::npos) {
        double done_steps = 0;
        if (JsonNumber(l, "steps", &done_steps)) final_steps = static_cast<int>(done_steps);
        JsonNumber(l, "initial_loss", &initial_loss);
        JsonNumber(l, "final_loss", &final_loss);
        JsonNumber(l, "step_ms_median", &step_ms_median);
      }
    }
    if (tty) std::fprintf(stderr, "\n");
    progress->Close();
    if (coord_down) {  // Training ended before the restart was due.
      restart_at = absl::Now();
      if (!drill()) return Die("cannot restart optimus-coord");
    }
    // Training ended before a standby was seen leading: wait for it (a
    // generous bound, against a hang only).
    for (int i = 0; i < 600 && leader_killed_at_step > 0 && new_leader < 0; ++i) {
      drill();
      if (new_leader < 0) absl::SleepFor(absl::Milliseconds(100));
    }
  }
  bool workers_ok = true;
  for (int r = 0; r < workers; ++r) {
    int status = 0;
    if (!WaitFor(worker_pids[r], absl::Minutes(5), &status)) {
      kill(worker_pids[r], SIGKILL);
      WaitFor(worker_pids[r], absl::Seconds(5), &status);
      workers_ok = false;
    } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      workers_ok = false;
    }
    if (!workers_ok) {
      std::fprintf(stderr, "worker %d failed; its log:\n%s\n", r,
                   TailOf(absl::StrCat(dir, "/worker-", r, ".log")).c_str());
    }
  }

  // 4. After a drill, the restarted coordinator must know the cluster again:
  // every shard back UP (heartbeating under its old id) and the job READY.
  if (kill_leader_at > 0 && new_leader < 0) {
    workers_ok = false;
    std::string logs;
    for (int i = 0; i < num_coords; ++i) absl::StrAppend(&logs, TailOf(coord_log(i)), "\n");
    std::fprintf(stderr, "no standby took over after the leader was killed:\n%s\n", logs.c_str());
  }
  if (kill_at > 0 || (kill_leader_at > 0 && new_leader >= 0)) {
    // Every shard but a drained and stopped one.
    const int want_up = shards - (drain_done_at_step > 0 ? 1 : 0);
    bool recovered = false;
    for (int i = 0; i < 100 && !recovered; ++i) {
      optimus::v1::StatusRequest req;
      optimus::v1::StatusResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
      if (stub.Call(&optimus::v1::Coordinator::Stub::Status, &ctx, req, &resp).ok()) {
        int up_now = 0;
        for (const auto& s : resp.shards()) up_now += s.state() == optimus::v1::SHARD_STATE_UP;
        recovered = up_now == want_up && resp.jobs_size() == 1 &&
                    resp.jobs(0).state() == optimus::v1::JOB_STATE_READY;
      }
      if (!recovered) absl::SleepFor(absl::Milliseconds(100));
    }
    if (!recovered) {
      workers_ok = false;
      std::fprintf(stderr, "the %s coordinator did not recover the cluster:\n%s\n",
                   kill_at > 0 ? "restarted" : "new leading",
                   TailOf(kill_at > 0 ? dir + "/coord-restarted.log" : coord_log(new_leader))
                       .c_str());
    }
  }

  // 5. Stop the servers (SIGTERM: clean shutdown), coordinator last.
  for (pid_t p : shard_pids) {
    if (p > 0) StopChild(p);
  }
  if (etcd.empty()) {
    StopChild(coord);
  } else {
    for (pid_t p : coord_pids) {
      if (p > 0) StopChild(p);
    }
  }
  g_children.clear();
  if (!workers_ok) return Die("training failed");

  if (python_workers) {
    std::printf("{\"summary\": \"local_cluster\", \"workers\": %d, \"shards\": %d, "
                "\"steps\": %d, \"python_workers\": true, \"mode\": \"%s\", "
                "\"initial_loss\": %.6f, \"final_loss\": %.6f, \"step_ms_median\": %.3f}\n",
                workers, shards, final_steps, absl::GetFlag(FLAGS_python_mode).c_str(),
                initial_loss, final_loss, step_ms_median);
    std::fflush(stdout);
    return final_loss < initial_loss ? 0 : 1;
  }

  // 6. The same training in one process with torch::optim::AdamW.
  std::fprintf(stderr, "running the single-process torch::optim::AdamW reference...\n");
  torch::set_num_threads(2);
  optimus::local::TaskOptions task;
  task.hidden = absl::GetFlag(FLAGS_hidden);
  task.seed = absl::GetFlag(FLAGS_seed);
  optimus::local::ReferenceResult ref =
      optimus::local::RunReference(task, static_cast<uint32_t>(workers),
                                   static_cast<uint64_t>(final_steps));
  auto got = optimus::local::ReadParams(params_file);
  if (!got.ok()) return Die(got.status().ToString());
  if (got->size() != ref.master.size()) {
    return Die(absl::StrCat("parameter count ", got->size(), " vs reference ", ref.master.size()));
  }
  double max_diff = 0;
  for (size_t i = 0; i < got->size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(static_cast<double>((*got)[i]) - ref.master[i]));
  }
  std::fprintf(stderr, "reference final loss %.6f\n", ref.final_loss);
  std::printf("{\"summary\": \"local_cluster\", \"workers\": %d, \"shards\": %d, \"steps\": %d, "
              "\"initial_loss\": %.6f, \"final_loss\": %.6f, "
              "\"max_abs_diff_vs_local_adamw\": %.3g, \"step_ms_median\": %.3f%s}\n",
              workers, shards, final_steps, initial_loss, final_loss, max_diff, step_ms_median,
              absl::StrCat(kill_at > 0 ? absl::StrCat(", \"coordinator_killed_at_step\": ",
                                                       killed_at_step,
                                                       ", \"coordinator_restarted_at_step\": ",
                                                       restarted_at_step)
                                       : "",
                           kill_shard_at > 0
                               ? absl::StrCat(", \"shard_killed_at_step\": ", shard_killed_at_step)
                               : "",
                           replication > 0 ? absl::StrCat(", \"replication\": ", replication)
                                           : "",
                           drain_at > 0
                               ? absl::StrCat(", \"drain_started_at_step\": ", drained_at_step,
                                              ", \"drained_at_step\": ", drain_done_at_step)
                               : "",
                           num_coords > 1 ? absl::StrCat(", \"coordinators\": ", num_coords) : "",
                           kill_leader_at > 0
                               ? absl::StrCat(", \"leader_killed_at_step\": ", leader_killed_at_step,
                                              ", \"killed_leader\": ", killed_leader,
                                              ", \"new_leader\": ", new_leader,
                                              ", \"new_leader_at_step\": ", new_leader_at_step,
                                              ", \"leader_gap_ms\": ",
                                              absl::ToInt64Milliseconds(leader_gap),
                                              ", \"etcd_lease_ttl_s\": ",
                                              absl::GetFlag(FLAGS_etcd_lease_ttl_s) > 0
                                                  ? absl::GetFlag(FLAGS_etcd_lease_ttl_s)
                                                  : 2)
                               : "")
                  .c_str());
  std::fflush(stdout);
  const bool ok = final_loss < initial_loss && max_diff <= absl::GetFlag(FLAGS_max_abs_diff);
  return ok ? 0 : 1;
}
