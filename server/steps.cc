// Carrying out what a chunk's state machine asks for, and the step threads
// that run the kernels: a primary's step (the fused sum-over-workers +
// optimizer + cast pass, or the sum forwarded to a backup and a step from
// it), the clipping round's reduce pass, and a backup's forwarded step.
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/durable_file.h"
#include "common/logging.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/passes.h"
#include "server/shard.h"

namespace optimus {
namespace server {
namespace {
constexpr char kLog[] = "shard";
// How long a forward answered "retry" waits before it is sent again (the
// backup loads our map within a heartbeat; it is asked again meanwhile).
constexpr absl::Duration kForwardRetryDelay = absl::Milliseconds(10);

// The tensor's group settings (a config without per-tensor entries, as unit
// tests build, uses the job's).
JobConfig::Tensor RulesOf(const JobConfig& c, uint32_t tensor) {
  if (tensor < c.tensors.size()) return c.tensors[tensor];
  JobConfig::Tensor t;
  t.hyper = c.hyper;
  return t;
}

}  // namespace

void Shard::ScheduleFold(const ChunkRef& chunk) {
  Schedule([this, chunk] {
    metrics_.folds.fetch_add(1);
    chunk->staging().Fold(kernel_pool_.get());
  });
}

void Shard::Carry(const JobRef& job, const ChunkRef& chunk, Actions a) {
  if (a.empty()) return;
  for (const Refusal& r : a.refusals) {
    metrics_.requests_rejected.fetch_add(1);
    if (r.parked_pull) limits_->Unpark(r.to.peer);
    Reply(r.to.peer, r.to.request_id, r.status, r.hint);
  }
  for (const Ack& ack : a.acks) SendAck(ack);
  if (a.reduce) Schedule([this, job, chunk] { RunReduce(job, chunk); });
  // Counted before any worker can see the version.
  if (a.published != 0) metrics_.steps_applied.fetch_add(1);
  if (a.published != 0 && options_.audit_versions) AuditVersion(*job, *chunk, a.published, true);
  // Workers first: the copy and the next step come after their pulls.
  for (const PullReply& p : a.sends) SendVersion(job, chunk, p);
  if (a.step_waits_for_snapshot || a.step_released_by_snapshot) {
    absl::MutexLock lock(&chunk->mu);
    const absl::Time now = absl::Now();
    if (a.step_released_by_snapshot) {
      metrics_.checkpoint_stall_ns.fetch_add(absl::ToInt64Nanoseconds(now - chunk->blocked_since));
    }
    if (a.step_waits_for_snapshot) chunk->blocked_since = now;
  }
  if (a.snapshot_by_policy) BeginPolicyCheckpoint(job, a.snapshot_checkpoint);
  if (a.snapshot_checkpoint != 0) FinishSnapshot(job, chunk, a.snapshot_checkpoint);
  if (a.schedule_step) Schedule([this, job, chunk] { RunStep(job, chunk); });
  if (a.apply_forwarded) Schedule([this, job, chunk] { RunForwardedStep(job, chunk); });
  if (a.send_seed) SendForward(job, chunk, a.seed_gen, a.seed_version, /*seed=*/true);
  if (a.retry_later) {
    const uint64_t gen = a.retry_gen;
    Schedule([this, job, chunk, gen] {
      absl::SleepFor(kForwardRetryDelay);
      Actions r;
      {
        absl::MutexLock lock(&chunk->mu);
        r = chunk->machine.RetryTimer(gen);
      }
      Carry(job, chunk, std::move(r));
    });
  }
  if (a.beat_now) BeatNow();
  if (a.retired) {
    chunk->staging().Abandon();  // Waiting pushes dropped, buffers back.
    // Out of the job's table; freed when the last operation lets go.
    absl::MutexLock lock(&job->mu);
    auto it = job->chunks.find(ChunkKey(chunk->name.tensor, chunk->name.chunk));
    if (it != job->chunks.end() && it->second == chunk) job->chunks.erase(it);
  }
}

void Shard::AuditVersion(const Job& job, const Chunk& chunk, uint64_t version, bool primary) {
  // Before the version's sends: the buffer holds it until the step after
  // next, which needs every worker's pull of it first.
  const uint32_t crc = Crc32c(0, chunk.published(version), chunk.published_bytes());
  OPTIMUS_LOG(Info, kLog, "audit: made job=", job.config.job_id, " tensor=", chunk.name.tensor,
              " chunk=", chunk.name.chunk, " version=", version,
              " role=", primary ? "primary" : "backup", " crc32c=", absl::Hex(crc, absl::kZeroPad8));
}

void Shard::Schedule(std::function<void()> task) {
  absl::MutexLock lock(&exec_mu_);
  if (executor_ != nullptr) executor_->Schedule(std::move(task));
}

absl::Status Shard::StepKernel(const Job& job, const Chunk& chunk, uint64_t step, float lr,
                               uint64_t optimizer_step, absl::Span<const void* const> grads,
                               DType grad_dtype, float scale) {
  const JobConfig::Tensor rules = RulesOf(job.config, chunk.name.tensor);
  kernels::OptimizerHyper hyper = rules.hyper;
  hyper.lr = lr * rules.lr_mult;
  kernels::StepInputs in;
  in.grads = grads;
  in.grad_dtype = grad_dtype;
  in.grad_scale = scale;
  in.step = static_cast<int64_t>(optimizer_step);
  kernels::ChunkState state{chunk.master(), chunk.m(), chunk.v()};
  return kernels::FusedStep(hyper, in, chunk.num_elems, state, chunk.published(step + 1),
                            job.config.param_dtype, kernel_pool_.get());
}

void Shard::SkipKernel(const Chunk& chunk, uint64_t step) {
  // The state is untouched, so version step + 1 publishes the same values.
  std::memcpy(chunk.published(step + 1), chunk.published(step), chunk.published_bytes());
}

void Shard::RunReduce(const JobRef& job, const ChunkRef& chunk) {
  ReduceInputs r;
  {
    absl::MutexLock lock(&chunk->mu);
    r = chunk->machine.GetReduceInputs();
  }
  if (!r.run) return;
  const JobConfig& c = job->config;
  ChunkStaging& staging = chunk->staging();
  const ChunkStaging::Inputs staged =
      staging.Use(r.step, r.ranks, kernel_pool_.get());
  kernels::StepInputs in;
  in.grads = absl::MakeConstSpan(staged.grads);
  in.grad_dtype = staged.dtype;
  in.grad_scale = c.grad_scale * r.params.grad_mult;
  // The gradient the step would apply, exactly (the same sum, the same
  // scale), squared and added up in double in a fixed order.
  absl::StatusOr<double> sum = !staged.status.ok() ? absl::StatusOr<double>(staged.status)
                               : staged.grads.empty()
                                   ? absl::StatusOr<double>(0.0)
                                   : kernels::GradSumOfSquares(in, chunk->num_elems,
                                                               kernel_pool_.get());
  staging.Unuse();
  double sum_squares;
  if (sum.ok()) {
    sum_squares = *sum;
  } else {
    OPTIMUS_LOG(Error, kLog, "gradient norm pass failed for job ", c.job_id, " tensor ",
                chunk->name.tensor, " chunk ", chunk->name.chunk, ": ", sum.status().ToString());
    sum_squares = std::nan("");  // The step is skipped everywhere.
  }
  Actions a;
  {
    absl::MutexLock lock(&chunk->mu);
    a = chunk->machine.ReduceDone(sum_squares);
  }
  Carry(job, chunk, std::move(a));
}

void Shard::RunStep(const JobRef& job, const ChunkRef& chunk) {
  const JobConfig& c = job->config;
  StepPlan plan;
  {
    absl::MutexLock lock(&chunk->mu);
    plan = chunk->machine.BeginKernel();
    if (plan.blocked_by_snapshot) chunk->blocked_since = absl::Now();
  }
  if (!plan.run) return;
  const size_t n = chunk->num_elems;
  absl::Status s;
  ChunkStaging& staging = chunk->staging();
  // The step's gradients: the W slots, or the running sum they were folded
  // into (the last one folded now); the same bits either way.
  const ChunkStaging::Inputs staged =
      plan.skip ? ChunkStaging::Inputs{} : staging.Use(plan.step, plan.ranks, kernel_pool_.get());
  if (!staged.status.ok()) {
    OPTIMUS_LOG(Error, kLog, "job ", c.job_id, " tensor ", chunk->name.tensor, " chunk ",
                chunk->name.chunk, " step ", plan.step, ": ", staged.status.ToString(),
                "; the step is skipped");
    plan.skip = true;
  }
  const std::vector<const void*>& slots = staged.grads;
  const DType slots_dtype = staged.dtype;
  // The kernel alone (the fold of the last push, above, is not in it).
  const absl::Time start = absl::Now();
  if (staged.all_landed != absl::Time()) {
    metrics_.step_queue.Observe(absl::ToDoubleSeconds(start - staged.all_landed));
  }
  // The averaged gradient times the step's multiplier and clip coefficient
  // (exactly the job's grad_scale when both are 1).
  const float scale = c.grad_scale * plan.params.grad_mult * plan.clip_coef;
  ForwardedStep fwd;
  fwd.skip = plan.skip;
  fwd.lr = plan.params.lr;
  fwd.partial = plan.partial;
  if (plan.skip) {
    SkipKernel(*chunk, plan.step);
    if (plan.forward_sum) SendForward(job, chunk, plan.gen, plan.step, /*seed=*/false, fwd);
  } else if (plan.forward_sum) {
    // To a seeded backup: sum once (in rank order, scaled, exactly as
    // FusedStep sums), forward the sum, and step from it on both sides, so
    // primary and backup stay bitwise equal (and equal to the fused step,
    // which every other step uses: no extra pass without a backup to feed).
    float* sum = chunk->sum();
    kernels::StepInputs in;
    in.grads = absl::MakeConstSpan(slots);
    in.grad_dtype = slots_dtype;
    in.grad_scale = scale;
    in.step = static_cast<int64_t>(plan.optimizer_step);
    s = kernels::SumGradsToFp32(in, n, sum, kernel_pool_.get());
    if (s.ok()) {
      SendForward(job, chunk, plan.gen, plan.step, /*seed=*/false, fwd);
      const void* sum_ptr[1] = {sum};
      s = StepKernel(*job, *chunk, plan.step, plan.params.lr, plan.optimizer_step,
                     absl::MakeConstSpan(sum_ptr, 1), DType::kFp32, 1.0f);
    } else {
      absl::MutexLock lock(&chunk->mu);
      chunk->machine.SumNotForwarded();  // Seed the backup after the step.
    }
  } else {
    s = StepKernel(*job, *chunk, plan.step, plan.params.lr, plan.optimizer_step,
                   absl::MakeConstSpan(slots), slots_dtype, scale);
  }
  // The gradients are spent: their buffers go back to the pool before the
  // version is published (the next step's pushes may need them).
  staging.StepDone(plan.step);
  metrics_.step_latency.Observe(absl::ToDoubleSeconds(absl::Now() - start));
  metrics_.params_stepped.fetch_add(n);
  if (!s.ok()) {
    // Our own invariant (the job config was validated at load): say so loudly.
    OPTIMUS_LOG(Error, kLog, "optimizer step failed for job ", c.job_id, " tensor ",
                chunk->name.tensor, " chunk ", chunk->name.chunk, ": ", s.ToString());
  }
  Actions a;
  {
    absl::MutexLock lock(&chunk->mu);
    a = chunk->machine.KernelDone();
  }
  if (a.published != 0 && staged.all_landed != absl::Time()) {
    metrics_.publish_tail.Observe(absl::ToDoubleSeconds(absl::Now() - staged.all_landed));
  }
  Carry(job, chunk, std::move(a));
}

void Shard::RunForwardedStep(const JobRef& job, const ChunkRef& chunk) {
  uint64_t step;
  bool skip;
  float lr;
  uint64_t optimizer_step;
  {
    absl::MutexLock lock(&chunk->mu);
    step = chunk->machine.version();  // SumOffered checked the step starts here.
    skip = chunk->machine.forwarded_skip();
    lr = chunk->machine.forwarded_lr();
    optimizer_step = chunk->machine.optimizer_steps() + 1;
  }
  const void* sum_ptr[1] = {chunk->sum()};
  absl::Status s;
  if (skip) {
    SkipKernel(*chunk, step);
  } else {
    s = StepKernel(*job, *chunk, step, lr, optimizer_step, absl::MakeConstSpan(sum_ptr, 1),
                   DType::kFp32, 1.0f);
  }
  Requester from;
  Actions a;
  {
    absl::MutexLock lock(&chunk->mu);
    from = chunk->forward_from;
    a = chunk->machine.ForwardedStepDone(s.ok());
  }
  if (s.ok()) metrics_.backup_steps.fetch_add(1);
  if (a.published != 0 && options_.audit_versions) AuditVersion(*job, *chunk, a.published, false);
  a.published = 0;  // Counted as a backup step, not a published one.
  Reply(from.peer, from.request_id, s);
  Carry(job, chunk, std::move(a));
}

}  // namespace server
}  // namespace optimus
