// bench/fault: what failures and their protection cost a training job, on a
// real coordinator, 3 shard servers and 2 worker clients in this process
// (gRPC and UCX on loopback). Prints one JSON object per line:
//
//   checkpoint_stall   median-free mean step time of a job checkpointed
//                      every --ckpt_every steps against the same job with no
//                      checkpoints, run in the same process one after the
//                      other: the stall workers see, as a fraction of a step.
//   recovery_rollback  a shard holding chunks is stopped (no replica): time
//                      until the coordinator has detected it (lease) and
//                      restored the job from its last checkpoint, and until
//                      the workers have re-joined and finished their first
//                      step again; with the lease and the step time for scale.
//
// Usage: bazel run -c opt //bench:fault -- [--params_mi=4] [--steps=40]
//        [--ckpt_every=2]
#include <cstdint>
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/checkpoint_files.h"
#include "tests/integration/ckpt_cluster.h"

ABSL_FLAG(int64_t, params_mi, 4, "model size, Mi parameters (one weight tensor)");
ABSL_FLAG(int, steps, 40, "timed steps per phase");
ABSL_FLAG(int, ckpt_every, 2, "checkpoint policy of the checkpointed phase, in steps");

namespace optimus {
namespace bench {
namespace {

using testing_ckpt::CkptCluster;

client::JobDef Job(const std::string& name, int64_t params_mi) {
  client::JobDef def = testing_ckpt::MakeJob(name, /*max_chunk_bytes=*/0);
  def.tensors = {{"weight", {params_mi * 1024, 1024}}, {"bias", {1024}}};
  def.optimizer.lr = 1e-3f;
  return def;
}

// Mean milliseconds per step over steps first..last, after the caller's
// warm-up.
double TimeSteps(CkptCluster& c, uint64_t first, uint64_t last) {
  const absl::Time t0 = absl::Now();
  c.Train(first, last);
  return absl::ToDoubleMilliseconds(absl::Now() - t0) / static_cast<double>(last - first + 1);
}

int Main() {
  const int64_t params_mi = absl::GetFlag(FLAGS_params_mi);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int every = absl::GetFlag(FLAGS_ckpt_every);
  if (params_mi <= 0 || steps < 2 || every < 1) {
    std::fprintf(stderr, "bench/fault: --params_mi > 0, --steps >= 2, --ckpt_every >= 1\n");
    return 2;
  }
  constexpr uint64_t kWarmup = 3;
  const std::string dir = testing_ckpt::NewTempDir();
  CkptCluster c(dir, 3);

  // Phase A: no checkpoints.
  c.CreateAndJoin(Job("plain", params_mi));
  c.Train(1, kWarmup);
  const double plain_ms = TimeSteps(c, kWarmup + 1, kWarmup + steps);

  // Phase B: the same job checkpointed every `every` steps by policy.
  client::JobDef def = Job("ckpt", params_mi);
  def.checkpoint.every_steps = static_cast<uint64_t>(every);
  def.checkpoint.keep_last = 2;
  c.CreateAndJoin(def);
  c.Train(1, kWarmup);
  const uint64_t last = kWarmup + static_cast<uint64_t>(steps);
  const double ckpt_ms = TimeSteps(c, kWarmup + 1, last);
  int complete = 0, total = 0;
  for (const auto& info : c.List("ckpt")) {
    ++total;
    complete += info.state() == v1::CHECKPOINT_STATE_COMPLETE;
  }
  const double state_mb = static_cast<double>(params_mi) * 12.0;  // fp32 master, m, v
  std::printf(
      "{\"bench\": \"checkpoint_stall\", \"params\": %lld, \"workers\": 2, \"shards\": 3, "
      "\"steps\": %d, \"ckpt_every_steps\": %d, \"state_mib_per_checkpoint\": %.1f, "
      "\"checkpoints_listed\": %d, \"checkpoints_complete_kept\": %d, "
      "\"step_ms_without\": %.3f, \"step_ms_with\": %.3f, \"stall_fraction\": %.4f}\n",
      static_cast<long long>(params_mi) << 20, steps, every, state_mb, total, complete,
      plain_ms, ckpt_ms, (ckpt_ms - plain_ms) / plain_ms);
  std::fflush(stdout);

  // Recovery without a replica: stop a shard, wait for rollback, re-join,
  // run one step.
  c.WaitApplied("ckpt", last);
  const absl::Time t0 = absl::Now();
  c.StopShard(0);
  bool rolled_back = false;
  const absl::Time give_up = t0 + absl::Seconds(60);
  while (!rolled_back && absl::Now() < give_up) {
    const v1::StatusResponse status = c.Status();  // outlives the loop
    for (const auto& j : status.jobs()) {
      rolled_back |= j.name() == "ckpt" && j.state() == v1::JOB_STATE_READY &&
                     j.job_id() > 2;
    }
    if (!rolled_back) absl::SleepFor(absl::Milliseconds(10));
  }
  if (!rolled_back) {
    std::fprintf(stderr, "bench/fault: the job was not rolled back within 60 s\n");
    return 1;
  }
  const absl::Time t1 = absl::Now();
  c.ConnectClients();
  c.JoinAll("ckpt");
  const uint64_t resume = c.client(0)->resume_step();
  c.Train(resume, resume);
  const absl::Time t2 = absl::Now();
  const double lease_ms = 2000;  // CoordinatorOptions' default lease
  std::printf(
      "{\"bench\": \"recovery_rollback\", \"lease_ms\": %.0f, \"step_ms\": %.3f, "
      "\"detect_and_restore_ms\": %.1f, \"first_step_done_ms\": %.1f, "
      "\"resume_step\": %llu, \"steps_redone\": %llu, "
      "\"ratio_to_lease_plus_one_step\": %.3f}\n",
      lease_ms, ckpt_ms, absl::ToDoubleMilliseconds(t1 - t0),
      absl::ToDoubleMilliseconds(t2 - t0), static_cast<unsigned long long>(resume),
      static_cast<unsigned long long>(last + 1 - resume),
      absl::ToDoubleMilliseconds(t2 - t0) / (lease_ms + ckpt_ms));
  std::fflush(stdout);
  (void)ckpt::RemoveTree(dir);
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace optimus

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return optimus::bench::Main();
}
