// The real optimus-coord and optimus-shard binaries started as child
// processes on this machine (as a deployment starts them), for benchmarks
// whose workers are liboptimus clients in the benchmark's own process.
// Children die with the process (PR_SET_PDEATHSIG) and on KillChildren().
// Not thread-safe: call from the benchmark's main thread.
#ifndef OPTIMUS_BENCH_PROC_CLUSTER_H_
#define OPTIMUS_BENCH_PROC_CLUSTER_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {
namespace bench {

// The folder holding coordinator/optimus-coord and server/optimus-shard:
// `bin_dir` if set, else the runfiles of argv0 (bazel run), else ".".
// Empty when none holds both.
std::string FindBinRoot(const char* argv0, const std::string& bin_dir);

// Starts args (argv[0] searched in PATH) with `env` added, stdout and
// stderr to log_path. -1 when fork fails.
pid_t Spawn(const std::vector<std::string>& env, const std::vector<std::string>& args,
            const std::string& log_path);
// SIGTERM, then SIGKILL after 10 s.
void Stop(pid_t pid);
// SIGKILL to every child still running (e.g. from a signal handler).
void KillChildren();
// The last 1500 bytes of a file (for error messages from logs).
std::string Tail(const std::string& path);
// A command line as a shell would take it (for printing what was run).
std::string ShellLine(const std::vector<std::string>& args);

struct ProcClusterOptions {
  std::string bin_root;   // FindBinRoot's folder. Required.
  std::string work_dir;   // Logs and the coordinator's port file. Required.
  int num_shards = 2;
  // UCX_TLS for the shards (--transports); empty: UCX's choice.
  std::string transports;
  uint64_t shard_memory_mb = 3072;
  // Extra optimus-shard flags.
  std::vector<std::string> shard_args;
};

struct ProcCluster {
  pid_t coord = -1;
  std::string coord_addr;  // host:port.
  std::vector<pid_t> shards;
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
