// optimus-train-worker: one data-parallel worker of the local cluster's job,
// and the example of integrating a libtorch loop (client/torch/trainer.h):
// the lines marked "optimus" are all it takes. Rank 0 creates the job and
// sends the initial values; each step's gradients leave from autograd hooks
// as backward produces them, and the next step's parameters come back as
// the shards publish them. Progress goes to stdout as one JSON object per
// line.
#include <algorithm>
#include <memory>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/client.h"
#include "client/torch/trainer.h"
#include "common/logging.h"
#include "deploy/local/mlp_task.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070",
          "optimus-coord address host:port, or several (a leader and its standbys) "
          "comma-separated");
ABSL_FLAG(std::string, job, "local-mlp", "job name");
ABSL_FLAG(int, rank, 0, "this worker's rank");
ABSL_FLAG(int, world_size, 2, "number of workers");
ABSL_FLAG(int, steps, 300, "training steps");
ABSL_FLAG(int, hidden, 256, "MLP hidden width");
ABSL_FLAG(uint64_t, seed, 1, "seed of the model and the synthetic data");
ABSL_FLAG(std::string, params_out, "", "rank 0 writes the final parameters here (raw fp32)");
ABSL_FLAG(std::string, transports, "",
          "UCX transports (UCX_TLS syntax); empty: UCX_TLS from the environment, or UCX's choice");
ABSL_FLAG(std::string, net_devices, "",
          "UCX network devices (the local cluster passes lo); empty: UCX_NET_DEVICES from the "
          "environment, or all");
ABSL_FLAG(int, timeout_s, 60, "per-step wait limit, seconds");
ABSL_FLAG(uint64_t, checkpoint_every_steps, 0,
          "rank 0 creates the job with this checkpoint policy (needs --checkpoint_dir on the "
          "coordinator and shards); 0: none");
ABSL_FLAG(int, replication, 0,
          "rank 0 creates the job with this many backups per chunk (0 or 1)");
ABSL_FLAG(std::string, stop_file, "",
          "a file the launcher writes (atomically) with the last step to train: once it "
          "exists, training ends after that step instead of --steps (drills end a set number "
          "of steps after their event, whatever the machine's speed)");
ABSL_FLAG(std::string, update_mode, "layerwise",
          "layerwise (exact: each step's forward uses the previous step's result) or delayed "
          "(one step stale: the optimizer step overlaps the whole next iteration)");
ABSL_FLAG(int, min_step_ms, 0,
          "each step takes at least this long (the worker sleeps the rest): lets a drill that "
          "lasts minutes, e.g. a coordinator outage, run without tens of thousands of steps; "
          "the results are the same bits. 0: no pause");
ABSL_FLAG(bool, follow_rollback, false,
          "when a push or pull fails because the job lost a shard, re-join the job the "
          "coordinator restores from its last checkpoint and continue from its resume step");

namespace {

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "optimus-train-worker rank %d: %s: %s\n", absl::GetFlag(FLAGS_rank),
               what.c_str(), s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);  // Workers, shards and the coordinator share 2 cores.
  const int rank = absl::GetFlag(FLAGS_rank);
  uint64_t steps = static_cast<uint64_t>(absl::GetFlag(FLAGS_steps));
  const std::string stop_file = absl::GetFlag(FLAGS_stop_file);
  bool stop_read = false;

  optimus::local::TaskOptions task;
  task.hidden = absl::GetFlag(FLAGS_hidden);
  task.seed = absl::GetFlag(FLAGS_seed);
  optimus::local::Mlp model = optimus::local::MakeModel(task);

  optimus::client::TrainerOptions o;                                         // optimus
  o.session.coordinator = absl::GetFlag(FLAGS_coordinator);                  // optimus
  o.session.rank = rank;                                                     // optimus
  o.session.world_size = absl::GetFlag(FLAGS_world_size);                    // optimus
  o.session.job_name = absl::GetFlag(FLAGS_job);                             // optimus
  o.job.optimizer.lr = task.lr;                                              // optimus
  o.job.optimizer.weight_decay = task.weight_decay;                          // optimus
  // The local cluster's own settings (not needed elsewhere).
  o.session.client.transport.transports = absl::GetFlag(FLAGS_transports);
  o.session.client.transport.net_devices = absl::GetFlag(FLAGS_net_devices);
  o.job.grad_dtype = task.grad_dtype;
  o.job.param_dtype = task.param_dtype;
  o.job.checkpoint.every_steps = absl::GetFlag(FLAGS_checkpoint_every_steps);
  o.job.replication = static_cast<uint32_t>(absl::GetFlag(FLAGS_replication));
  o.timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));
  o.follow_rollback = absl::GetFlag(FLAGS_follow_rollback);
  const std::string mode = absl::GetFlag(FLAGS_update_mode);
  if (mode != "layerwise" && mode != "delayed") {
    return Fail("--update_mode", absl::InvalidArgumentError(
                                     absl::StrCat("'", mode, "': layerwise or delayed")));
  }
  o.sync.mode = mode == "delayed" ? optimus::client::UpdateMode::kDelayed
                                  : optimus::client::UpdateMode::kLayerwise;
  auto trainer = optimus::client::Trainer::Create(model.get(), o);           // optimus
  if (!trainer.ok()) return Fail("join the job", trainer.status());

  const optimus::local::Batch eval = optimus::local::EvalBatch(task);
  float initial_loss = 0;
  std::vector<double> step_ms;
  for (uint64_t step = (*trainer)->step(); step <= steps; step = (*trainer)->step()) {
    if (!stop_file.empty() && !stop_read && access(stop_file.c_str(), R_OK) == 0) {
      std::ifstream in(stop_file);
      uint64_t last = 0;
      if (in >> last && last > 0) {
        stop_read = true;
        // The launcher writes a step ahead of every worker (workers are at
        // most a step apart); past it, this run cannot match the others.
        if (last + 1 < step) {
          return Fail("stop file", absl::FailedPreconditionError(absl::StrCat(
                                        "asks to stop after step ", last, " but step ", step,
                                        " is under way")));
        }
        steps = last;
        if (step > steps) break;
      }
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (auto s = (*trainer)->BeginStep(); !s.ok()) {                        // optimus
      return Fail(absl::StrCat("begin step ", step), s);
    }
    step = (*trainer)->step();  // Another one if the job was rolled back.
    if (step == 1) initial_loss = optimus::local::Loss(model, eval);
    model->zero_grad();
    optimus::local::Batch b = optimus::local::MakeBatch(task, step, rank);
    torch::Tensor loss = torch::mse_loss(model->forward(b.x), b.y);
    loss.backward();
    if (auto s = (*trainer)->EndStep(); !s.ok()) {                          // optimus
      return Fail(absl::StrCat("end step ", step), s);
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    step_ms.push_back(ms);
    if (ms < absl::GetFlag(FLAGS_min_step_ms)) {
      absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_min_step_ms) - ms));
    }
    if (rank == 0) {
      std::printf("{\"event\": \"step\", \"step\": %llu, \"steps\": %llu, \"loss\": %.6f, "
                  "\"step_ms\": %.3f}\n",
                  static_cast<unsigned long long>(step), static_cast<unsigned long long>(steps),
                  loss.item<float>(), ms);
      std::fflush(stdout);
    }
  }
  // The newest parameters into the model; done with the job (once every
  // rank has left, it can be deleted without --force).
  if (auto s = (*trainer)->Finish(); !s.ok()) return Fail("finish", s);     // optimus
  const float final_loss = optimus::local::Loss(model, eval);
  std::sort(step_ms.begin(), step_ms.end());
  const double median = step_ms.empty() ? 0 : step_ms[step_ms.size() / 2];
  if (rank == 0) {
    const std::string out = absl::GetFlag(FLAGS_params_out);
    if (!out.empty()) {
      if (auto s = optimus::local::WriteParams(out, optimus::local::FlattenParams(model)); !s.ok()) {
        return Fail("write parameters", s);
      }
    }
    std::printf("{\"event\": \"done\", \"steps\": %llu, \"initial_loss\": %.6f, "
                "\"final_loss\": %.6f, \"step_ms_median\": %.3f, \"rollbacks\": %llu}\n",
                static_cast<unsigned long long>(steps), initial_loss, final_loss, median,
                static_cast<unsigned long long>((*trainer)->rollbacks()));
    std::fflush(stdout);
  }
  return 0;
}
