// bench/fault: what failures and their protection cost a training job, on a
// real coordinator, 3 shard servers and 2 worker clients in this process
// (tests/harness: gRPC on 127.0.0.1, the data plane over UCX on lo, or the
// in-process loopback transport with --transport=loopback). Prints one JSON
// object per line:
//
//   checkpoint_stall   mean step time of one job in phases where a
//                      checkpoint is taken every --ckpt_every steps against
//                      phases without, alternating (--rounds of each): the
//                      slowdown workers see, as a fraction of step time
//                      (stall_fraction), and per checkpoint in steps; and
//                      the direct stall: time steps waited for checkpoint
//                      copies (shard counters), as a fraction of the
//                      checkpointed phases' time (direct_stall_fraction).
//   recovery_rollback  a shard holding chunks is stopped (no replica): time
//                      until the coordinator has detected it (lease) and
//                      restored the job from its last checkpoint, and until
//                      the workers have re-joined and finished their first
//                      step again; with the lease and the step time for scale.
//   recovery_failover  a replicated job (replication 1) trains on while the
//                      shard holding primaries is stopped: the time from the
//                      stop until the coordinator has detected it (lease),
//                      and until the first step completes after the backups
//                      took over; against detection + one step.
//
// Usage: bazel run -c opt //bench:fault -- [--params_mi=4] [--steps=20]
//        [--ckpt_every=10] [--rounds=4] [--transport=ucx|loopback]
#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/checkpoint_files.h"
#include "common/json.h"
#include "tests/harness/cluster.h"

ABSL_FLAG(int64_t, params_mi, 4, "model size, Mi parameters (one weight tensor)");
ABSL_FLAG(int, steps, 20, "timed steps per phase");
ABSL_FLAG(int, ckpt_every, 10, "in the checkpointed phases, a checkpoint every N steps");
ABSL_FLAG(int, rounds, 4, "phases with and without checkpoints, each");
ABSL_FLAG(std::string, transport, "ucx",
          "data plane: ucx (UCX on lo, as the published figures) or loopback (in-process)");

namespace optimus {
namespace bench {
namespace {

using harness::Cluster;

constexpr uint32_t kWorkers = 2;

client::JobDef Job(const std::string& name, int64_t params_mi) {
  client::JobDef def = harness::SmallJob(name, kWorkers, /*max_chunk_bytes=*/0);
  def.tensors = {{"weight", {params_mi * 1024, 1024}}, {"bias", {1024}}};
  def.optimizer.lr = 1e-3f;
  return def;
}

// Exits with a message naming what failed: a benchmark with a broken
// cluster has no figure to print.
void Check(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "bench/fault: %s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}

template <typename T>
T Check(absl::StatusOr<T> v, const char* what) {
  Check(v.status(), what);
  return std::move(*v);
}

// Mean milliseconds per step over steps first..last, after the caller's
// warm-up.
double TimeSteps(Cluster& c, uint64_t first, uint64_t last) {
  const absl::Time t0 = absl::Now();
  Check(c.Train(first, last), "training");
  return absl::ToDoubleMilliseconds(absl::Now() - t0) / static_cast<double>(last - first + 1);
}

int Main() {
  const int64_t params_mi = absl::GetFlag(FLAGS_params_mi);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int every = absl::GetFlag(FLAGS_ckpt_every);
  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (params_mi <= 0 || steps < 2 || every < 1 || absl::GetFlag(FLAGS_rounds) < 1 ||
      (transport != "ucx" && transport != "loopback")) {
    std::fprintf(stderr,
                 "bench/fault: --params_mi > 0, --steps >= 2, --ckpt_every >= 1, "
                 "--rounds >= 1, --transport=ucx|loopback\n");
    return 2;
  }
  constexpr uint64_t kWarmup = 3;
  const std::string dir = Check(harness::NewTempDir("benchfault"), "temp folder");
  harness::ClusterOptions options;
  options.transport =
      transport == "ucx" ? harness::TransportKind::kUcx : harness::TransportKind::kLoopback;
  options.num_shards = 3;
  options.num_workers = kWorkers;
  options.checkpoint_dir = dir;
  std::unique_ptr<Cluster> cluster = Check(Cluster::Start(options), "starting the cluster");
  Cluster& c = *cluster;

  // One job; phases with and without checkpoints alternate (ABAB...) so
  // that warm-up and the VM's drift hit both alike. In a "with" phase a
  // checkpoint is ordered every `every` steps (what a policy does); the
  // snapshot is taken at a step boundary and written in the background
  // while the phase goes on; its completion is awaited (untimed, reported)
  // before the next phase.
  Check(c.CreateJob(Job("ckpt", params_mi)), "creating job ckpt");
  Check(c.Train(1, kWarmup), "warm-up");
  uint64_t step = kWarmup + 1;
  double without_ms = 0, with_ms = 0, tail_wait_ms = 0, stall_ms = 0;
  auto stall_ns = [&c] {
    uint64_t ns = 0;
    for (size_t i = 0; i < c.num_shards(); ++i) ns += c.shard(i)->stats().checkpoint_stall_ns;
    return ns;
  };
  int ordered = 0, untimed_steps = 0;
  const int rounds = absl::GetFlag(FLAGS_rounds);
  for (int round = 0; round < rounds; ++round) {
    without_ms += TimeSteps(c, step, step + steps - 1);
    step += steps;
    uint64_t last_id = 0;
    for (int done = 0; done < steps; done += every) {
      const int n = std::min(every, steps - done);
      auto info = c.CreateCheckpoint("ckpt");
      if (info.ok()) {
        ++ordered;
        last_id = info->checkpoint_id();
      }
      const uint64_t ns0 = stall_ns();
      with_ms += TimeSteps(c, step, step + n - 1) * n;
      stall_ms += static_cast<double>(stall_ns() - ns0) / 1e6;
      step += n;
    }
    // Untimed steps until the phase's last checkpoint is complete, so its
    // write does not spill into the next phase (its snapshot step may lie
    // ahead, at the job's pace).
    const absl::Time w0 = absl::Now();
    while (last_id != 0 && untimed_steps < 1000) {
      bool busy = false;
      for (const auto& info : Check(c.ListCheckpoints("ckpt"), "listing checkpoints")) {
        busy |= info.checkpoint_id() >= last_id &&
                info.state() == v1::CHECKPOINT_STATE_IN_PROGRESS;
      }
      if (!busy) break;
      Check(c.Train(step, step), "training");
      ++step;
      ++untimed_steps;
    }
    tail_wait_ms += absl::ToDoubleMilliseconds(absl::Now() - w0);
  }
  const uint64_t last = step - 1;
  const double plain_ms = without_ms / rounds;
  const double ckpt_ms = with_ms / (static_cast<double>(rounds) * steps);
  int complete = 0, total = 0;
  for (const auto& info : Check(c.ListCheckpoints("ckpt"), "listing checkpoints")) {
    ++total;
    complete += info.state() == v1::CHECKPOINT_STATE_COMPLETE;
  }
  const double state_mb = static_cast<double>(params_mi) * 12.0;  // fp32 master, m, v
  const double slowdown = (ckpt_ms - plain_ms) / plain_ms;
  {
    Json line;
    line["bench"] = "checkpoint_stall";
    line["transport"] = transport;
    line["params"] = static_cast<int64_t>(params_mi) << 20;
    line["workers"] = 2;
    line["shards"] = 3;
    line["rounds"] = rounds;
    line["steps_per_phase"] = steps;
    line["ckpt_every_steps"] = every;
    line["state_mib_per_checkpoint"] = JsonRound(state_mb, 1);
    line["checkpoints_ordered"] = ordered;
    line["checkpoints_complete_kept"] = complete;
    line["step_ms_without"] = JsonRound(plain_ms, 3);
    line["step_ms_with"] = JsonRound(ckpt_ms, 3);
    line["stall_fraction"] = JsonRound(slowdown, 4);
    line["stall_per_checkpoint_in_steps"] = JsonRound(slowdown * every, 4);
    line["direct_stall_ms"] = JsonRound(stall_ms, 2);
    line["direct_stall_fraction"] = JsonRound(stall_ms / with_ms, 5);
    line["untimed_tail_steps"] = untimed_steps;
    line["untimed_tail_ms"] = JsonRound(tail_wait_ms, 1);
    std::printf("%s\n", JsonDump(line).c_str());
  }
  (void)total;
  std::fflush(stdout);

  // Recovery without a replica: stop a shard, wait for rollback, re-join,
  // run one step.
  Check(c.WaitApplied("ckpt", last), "waiting for the last step");
  const uint64_t ckpt_job_id = c.worker(0)->job_id();
  const absl::Time t0 = absl::Now();
  Check(c.KillShard(0), "killing shard 0");
  Check(c.WaitStatus("job ckpt rolled back and READY",
                     [ckpt_job_id](const v1::StatusResponse& status) {
                       for (const auto& j : status.jobs()) {
                         if (j.name() == "ckpt" && j.state() == v1::JOB_STATE_READY &&
                             j.job_id() > ckpt_job_id) {
                           return true;
                         }
                       }
                       return false;
                     },
                     absl::Seconds(60)),
        "rollback");
  const absl::Time t1 = absl::Now();
  Check(c.JoinJob("ckpt"), "re-joining job ckpt");
  const uint64_t resume = c.worker(0)->resume_step();
  Check(c.Train(resume, resume), "the first step after the rollback");
  const absl::Time t2 = absl::Now();
  const double lease_ms = absl::ToDoubleMilliseconds(options.lease);
  {
    Json line;
    line["bench"] = "recovery_rollback";
    line["transport"] = transport;
    line["lease_ms"] = static_cast<int64_t>(std::llround(lease_ms));
    line["step_ms"] = JsonRound(ckpt_ms, 3);
    line["detect_and_restore_ms"] = JsonRound(absl::ToDoubleMilliseconds(t1 - t0), 1);
    line["first_step_done_ms"] = JsonRound(absl::ToDoubleMilliseconds(t2 - t0), 1);
    line["resume_step"] = resume;
    line["steps_redone"] = static_cast<uint64_t>(last + 1 - resume);
    line["ratio_to_lease_plus_one_step"] =
        JsonRound(absl::ToDoubleMilliseconds(t2 - t0) / (lease_ms + ckpt_ms), 3);
    std::printf("%s\n", JsonDump(line).c_str());
  }
  std::fflush(stdout);

  // Failover with a replica: a job with replication 1 on the two shards left;
  // workers keep training while shard 1 is stopped.
  client::JobDef rdef = Job("repl", params_mi);
  rdef.replication = 1;
  Check(c.CreateJob(rdef), "creating job repl");
  Check(c.Train(1, kWarmup), "warm-up of repl");
  const double repl_ms = TimeSteps(c, kWarmup + 1, kWarmup + 10);
  const uint64_t first = kWarmup + 11, final_step = kWarmup + 40;
  std::vector<absl::Time> done;
  absl::Status trained;
  std::thread trainer([&] { trained = c.Train(first, final_step, &done); });
  absl::SleepFor(absl::Milliseconds(5 * repl_ms));
  const absl::Time k0 = absl::Now();
  Check(c.KillShard(1), "killing shard 1");
  absl::Time detected = absl::InfiniteFuture();
  while (absl::Now() < k0 + absl::Seconds(30)) {
    int down = 0;
    const v1::StatusResponse status = Check(c.Status(), "status");
    for (const auto& sh : status.shards()) down += sh.state() == v1::SHARD_STATE_DOWN;
    if (down >= 2) {
      detected = absl::Now();
      break;
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
  trainer.join();
  Check(trained, "training through the failover");
  absl::Time resumed = absl::InfiniteFuture();
  for (absl::Time t : done) {
    if (t > detected) {
      resumed = t;
      break;
    }
  }
  if (detected == absl::InfiniteFuture() || resumed == absl::InfiniteFuture() ||
      done.size() != final_step - first + 1) {
    std::fprintf(stderr, "bench/fault: failover did not complete (%zu steps done)\n",
                 done.size());
    return 1;
  }
  const double detect_ms = absl::ToDoubleMilliseconds(detected - k0);
  const double recovery_ms = absl::ToDoubleMilliseconds(resumed - k0);
  {
    Json line;
    line["bench"] = "recovery_failover";
    line["transport"] = transport;
    line["replication"] = 1;
    line["lease_ms"] = static_cast<int64_t>(std::llround(lease_ms));
    line["step_ms"] = JsonRound(repl_ms, 3);
    line["step_ms_unreplicated"] = JsonRound(plain_ms, 3);
    line["detect_ms"] = JsonRound(detect_ms, 1);
    line["first_step_done_ms"] = JsonRound(recovery_ms, 1);
    line["steps_redone"] = 0;
    line["ratio_to_detect_plus_one_step"] = JsonRound(recovery_ms / (detect_ms + repl_ms), 3);
    std::printf("%s\n", JsonDump(line).c_str());
  }
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
