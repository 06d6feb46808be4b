// optimus-train-worker: one data-parallel worker of the local cluster's job.
// Rank 0 creates the job and sends the initial values; every rank then, per
// step, pulls the parameters, runs forward/backward on its own batch, and
// pushes the gradients. Progress goes to stdout as one JSON object per line.
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
#include "client/torch/module_sync.h"
#include "common/logging.h"
#include "deploy/local/mlp_task.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:7070", "optimus-coord address host:port");
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
ABSL_FLAG(bool, follow_rollback, false,
          "when a push or pull fails because the job lost a shard, re-join the job the "
          "coordinator restores from its last checkpoint and continue from its resume step");

namespace {

using optimus::client::Client;

int Fail(const std::string& what, const absl::Status& s) {
  std::fprintf(stderr, "optimus-train-worker rank %d: %s: %s\n", absl::GetFlag(FLAGS_rank),
               what.c_str(), s.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  torch::set_num_threads(1);  // Workers, shards and the coordinator share 2 cores.
  const uint32_t rank = static_cast<uint32_t>(absl::GetFlag(FLAGS_rank));
  const uint32_t world = static_cast<uint32_t>(absl::GetFlag(FLAGS_world_size));
  uint64_t steps = static_cast<uint64_t>(absl::GetFlag(FLAGS_steps));
  const std::string stop_file = absl::GetFlag(FLAGS_stop_file);
  bool stop_read = false;
  const std::string job = absl::GetFlag(FLAGS_job);
  const absl::Duration timeout = absl::Seconds(absl::GetFlag(FLAGS_timeout_s));

  optimus::local::TaskOptions task;
  task.hidden = absl::GetFlag(FLAGS_hidden);
  task.seed = absl::GetFlag(FLAGS_seed);

  optimus::client::ClientOptions options;
  options.coordinator_address = absl::GetFlag(FLAGS_coordinator);
  options.transport.transports = absl::GetFlag(FLAGS_transports);
  options.transport.net_devices = absl::GetFlag(FLAGS_net_devices);
  options.transport.name = absl::StrCat("worker", rank);
  auto first = Client::Connect(options);
  if (!first.ok()) return Fail("connect", first.status());
  std::unique_ptr<Client> client = std::move(*first);

  optimus::local::Mlp model = optimus::local::MakeModel(task);
  if (rank == 0) {
    optimus::client::JobDef def;
    def.name = job;
    def.world_size = world;
    def.tensors = optimus::client::TensorDefsFromModule(*model);
    def.optimizer.kind = optimus::client::Optimizer::kAdamW;
    def.optimizer.lr = task.lr;
    def.optimizer.weight_decay = task.weight_decay;
    def.grad_dtype = task.grad_dtype;
    def.param_dtype = task.param_dtype;
    def.checkpoint.every_steps = absl::GetFlag(FLAGS_checkpoint_every_steps);
    def.replication = static_cast<uint32_t>(absl::GetFlag(FLAGS_replication));
    if (auto s = client->CreateJob(def); !s.ok()) return Fail("create job", s);
  }
  // Other ranks may get here before rank 0 created the job.
  absl::Status joined;
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  do {
    joined = client->Join(job, rank, world);
    if (joined.code() != absl::StatusCode::kNotFound) break;
    absl::SleepFor(absl::Milliseconds(100));
  } while (absl::Now() < give_up);
  if (!joined.ok()) return Fail("join", joined);

  auto made = optimus::client::ModuleSync::Create(client.get(), model.get());
  if (!made.ok()) return Fail("map module", made.status());
  std::unique_ptr<optimus::client::ModuleSync> sync = std::move(*made);
  if (rank == 0) {
    if (auto s = sync->InitFromModule(); !s.ok()) return Fail("send initial values", s);
  }

  // After a lost shard the coordinator restores the job from its last
  // checkpoint under the same name; a new client joins it (the old job's
  // FAILED state, or the old job before its failure is noticed, is refused
  // here by its resume step) and training goes on from the resume step.
  uint64_t last_resume = 0;
  auto rejoin = [&](const absl::Status& why, uint64_t* step) -> absl::Status {
    std::fprintf(stderr, "optimus-train-worker rank %u: step %llu failed (%s); re-joining\n",
                 rank, static_cast<unsigned long long>(*step), why.ToString().c_str());
    sync.reset();
    client.reset();
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      auto c = Client::Connect(options);
      if (!c.ok()) return c.status();
      absl::Status j = (*c)->Join(job, rank, world);
      if (j.ok() && (*c)->resume_step() > 0 && (*c)->resume_step() != last_resume) {
        client = std::move(*c);
        break;
      }
      absl::SleepFor(absl::Milliseconds(200));
    }
    if (client == nullptr) return absl::DeadlineExceededError("no restored job to re-join");
    auto m = optimus::client::ModuleSync::Create(client.get(), model.get());
    if (!m.ok()) return m.status();
    sync = std::move(*m);
    last_resume = client->resume_step();
    *step = last_resume;
    std::fprintf(stderr, "optimus-train-worker rank %u: resuming at step %llu\n", rank,
                 static_cast<unsigned long long>(*step));
    return absl::OkStatus();
  };
  const bool follow = absl::GetFlag(FLAGS_follow_rollback);

  const optimus::local::Batch eval = optimus::local::EvalBatch(task);
  float initial_loss = 0;
  std::vector<double> step_ms;
  for (uint64_t step = 1; step <= steps;) {
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
    if (auto s = sync->PullParams(step, timeout); !s.ok()) {
      if (!follow) return Fail(absl::StrCat("pull version ", step), s);
      if (auto r = rejoin(s, &step); !r.ok()) return Fail("re-join", r);
      continue;
    }
    if (step == 1) initial_loss = optimus::local::Loss(model, eval);
    model->zero_grad();
    optimus::local::Batch b = optimus::local::MakeBatch(task, step, rank);
    torch::Tensor loss = torch::mse_loss(model->forward(b.x), b.y);
    loss.backward();
    if (auto s = sync->PushGrads(step, timeout); !s.ok()) {
      if (!follow) return Fail(absl::StrCat("push step ", step), s);
      if (auto r = rejoin(s, &step); !r.ok()) return Fail("re-join", r);
      continue;
    }
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    step_ms.push_back(ms);
    if (rank == 0) {
      std::printf("{\"event\": \"step\", \"step\": %llu, \"steps\": %llu, \"loss\": %.6f, "
                  "\"step_ms\": %.3f}\n",
                  static_cast<unsigned long long>(step), static_cast<unsigned long long>(steps),
                  loss.item<float>(), ms);
      std::fflush(stdout);
    }
    ++step;
  }
  if (auto s = sync->PullParams(steps + 1, timeout); !s.ok()) {
    return Fail("pull final parameters", s);
  }
  // Done with the job: once every rank has left, it can be deleted without
  // --force. A failure here costs nothing but that, so it is only reported.
  if (auto s = client->Leave(); !s.ok()) {
    std::fprintf(stderr, "optimus-train-worker rank %u: leaving the job: %s\n", rank,
                 s.ToString().c_str());
  }
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
                "\"final_loss\": %.6f, \"step_ms_median\": %.3f}\n",
                static_cast<unsigned long long>(steps), initial_loss, final_loss, median);
    std::fflush(stdout);
  }
  return 0;
}
