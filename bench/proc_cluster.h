// The real optimus-coord and optimus-shard binaries started as child
// processes on this machine (as a deployment starts them), for benchmarks
// whose workers are liboptimus clients in the benchmark's own process.
// Children die with the process (PR_SET_PDEATHSIG) and on KillChildren().
// Not thread-safe: call from the benchmark's main thread.
#ifndef OPTIMUS_BENCH_PROC_CLUSTER_H_
#define OPTIMUS_BENCH_PROC_CLUSTER_H_

#include <sys/types.h>

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {
namespace bench {

// The folder holding coordinator/optimus-coord and server/optimus-shard:
// `bin_dir` if set, else the runfiles of argv0 (bazel run), else ".".
// Empty when none holds every binary of `needs`.
// `needs`: the binaries (paths under the folder) that must be there.
std::string FindBinRoot(const char* argv0, const std::string& bin_dir,
                        const std::vector<std::string>& needs = {"server/optimus-shard",
                                                                 "coordinator/optimus-coord"});

// Starts args (argv[0] searched in PATH) with `env` ("NAME=value") added,
// stdout and stderr to log_path, or stdout to a pipe whose read end is
// *stdout_fd when given. -1 when fork (or pipe) fails.
pid_t Spawn(const std::vector<std::string>& env, const std::vector<std::string>& args,
            const std::string& log_path, int* stdout_fd = nullptr);
// Waits up to `timeout` for pid; true when it exited (*status set).
bool WaitPid(pid_t pid, absl::Duration timeout, int* status);
// SIGTERM, then SIGKILL after 10 s.
void Stop(pid_t pid);
// SIGKILL to every child still running (e.g. from a signal handler).
void KillChildren();
// A file's contents (empty if unreadable), and its last 1500 bytes (for
// error messages from logs).
std::string ReadFile(const std::string& path);
std::string Tail(const std::string& path);
// A command line as a shell would take it (for printing what was run).
std::string ShellLine(const std::vector<std::string>& env, const std::vector<std::string>& args);

// `args` run on `cpus` (a `taskset -c` list), or as they are when `cpus` is empty.
std::vector<std::string> PinnedTo(const std::string& cpus, std::vector<std::string> args);
// A TCP port free on 127.0.0.1 right now (0 if none).
int FreePort();

// ---- A benchmark process ----

// Its JSON lines go to the original stdout (the FILE* returned; null when it
// cannot be had); whatever else writes to stdout (UCX logs there by
// default) goes to stderr from then on.
FILE* TakeStdoutForJson();
// SIGINT and SIGTERM kill the children (KillChildren) before the process
// exits; SIGPIPE is ignored.
void KillChildrenOnSignals();
// Says "`who`: msg" on stderr, kills the children and exits with 1.
[[noreturn]] void Die(const std::string& who, const std::string& msg);
// `work_dir` (created if missing) or a new folder /tmp/optimus-`name`-XXXXXX.
absl::StatusOr<std::string> MakeWorkDir(const std::string& work_dir, const std::string& name);

// Threads of a benchmark meeting at the start of each timed phase: Wait
// returns once n threads have called it (then it is ready for the next
// round).
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void Wait() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    const uint64_t gen = gen_;
    if (++waiting_ == n_) {
      waiting_ = 0;
      ++gen_;
      return;
    }
    struct Arg {
      const Barrier* self;
      uint64_t gen;
    } arg{this, gen};
    mu_.Await(absl::Condition(
        +[](Arg* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->self->gen_ != a->gen; }, &arg));
  }

 private:
  absl::Mutex mu_;
  const int n_;
  int waiting_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t gen_ ABSL_GUARDED_BY(mu_) = 0;
};

struct ProcClusterOptions {
  std::string bin_root;   // FindBinRoot's folder. Required.
  std::string work_dir;   // Logs and the coordinator's port file. Required.
  int num_shards = 2;
  // UCX_TLS for the shards (--transports); empty: UCX's choice.
  std::string transports;
  uint64_t shard_memory_mb = 3072;
  // Extra optimus-shard flags.
  std::vector<std::string> shard_args;
  // Each shard serves /metrics on a free port (ProcCluster::metrics_ports).
  bool metrics = false;
  // CPUs the coordinator and the shards run on (`taskset -c` list, e.g.
  // "1" or "4-7"); empty: wherever the scheduler puts them.
  std::string cpus;
};

struct ProcCluster {
  std::string transports;  // ProcClusterOptions::transports.
  pid_t coord = -1;
  std::string coord_addr;  // host:port.
  std::vector<pid_t> shards;
  std::vector<int> metrics_ports;  // With ProcClusterOptions::metrics, per shard.
  std::unique_ptr<v1::Coordinator::Stub> stub;
  std::vector<std::string> commands;  // What was started, as shell lines.
};

// Starts the coordinator and the shards, and waits until every shard is UP.
absl::Status StartProcCluster(const ProcClusterOptions& options, ProcCluster* c);
// Stops the shards, then the coordinator.
void StopProcCluster(ProcCluster* c);

}  // namespace bench
}  // namespace optimus

#endif  // OPTIMUS_BENCH_PROC_CLUSTER_H_
