// One-call integration of a libtorch training loop: joins (or creates) the
// job from the environment or arguments (client/session.h), maps the
// module (ModuleSync), sends the initial values when the job is new, and
// runs overlapped steps (gradients pushed from autograd hooks as backward
// produces them, the next version pulled as the shards publish it). A job
// rolled back to its last checkpoint after a lost shard is re-joined inside
// BeginStep / EndStep: step() then goes back to the restored step.
//
//   optimus::client::TrainerOptions o;            // RANK, WORLD_SIZE,
//   o.job.optimizer.lr = 1e-3f;                   // OPTIMUS_COORDINATOR
//   auto trainer = optimus::client::Trainer::Create(model.get(), o);
//   if (!trainer.ok()) ...;
//   for (uint64_t s = (*trainer)->step(); s <= steps; s = (*trainer)->step()) {
//     (*trainer)->BeginStep({schedule(s)});        // parameters of step s in
//     loss_fn(model->forward(x), y).backward();   // the module; pushes armed
//     (*trainer)->EndStep();                      // the rest; pulls go out
//   }
//   (*trainer)->Finish();                         // newest parameters; leave
//
// Every call returns a Status; errors are the session's, ModuleSync's or a
// shard's. Use it from the training loop's thread.
#ifndef OPTIMUS_CLIENT_TORCH_TRAINER_H_
#define OPTIMUS_CLIENT_TORCH_TRAINER_H_

#include <cstdint>
#include <memory>

#include <torch/torch.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/session.h"
#include "client/torch/module_sync.h"

namespace optimus {
namespace client {

struct TrainerOptions {
  // Who this process is and which job: coordinator, rank, world size, job
  // name, job spec file; each from the environment when left unset
  // (client/session.h).
  SessionOptions session;
  // The job to create when it does not exist yet: optimizer, groups,
  // clipping, dtypes, replication, checkpoints (a job spec file replaces
  // all of it). Its tensors are the module's parameters.
  JobDef job;
  // Layerwise (exact, the default) or delayed (one step stale).
  ModuleSyncOptions sync;
  // How long one call may wait for the shards. Default 5 minutes.
  absl::Duration timeout = absl::Minutes(5);
  // Re-join a job the coordinator rolled back to its last checkpoint after
  // losing a shard without a replica (training goes on from the restored
  // step). Off: such errors are returned. Default on.
  bool follow_rollback = true;
};

class Trainer {
 public:
  // Joins or creates the job (with retries while the coordinator or the
  // job is not there yet), checks it holds exactly the module's parameters,
  // and sends their values as version 1 when this is rank 0 of a new job.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(torch::nn::Module* module,
                                                         TrainerOptions options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // The step BeginStep runs next: the job's resume step at first (1 for a
  // new job), one more after each EndStep, the restored step after a
  // rollback.
  uint64_t step() const { return step_; }
  uint32_t rank() const { return session_.rank; }
  uint32_t world_size() const { return session_.world_size; }
  // Borrowed; replaced after a rollback (do not keep them across steps).
  Client* client() const { return session_.client.get(); }
  ModuleSync* sync() const { return sync_.get(); }
  // Rollbacks followed so far.
  uint64_t rollbacks() const { return rollbacks_; }

  // Before the forward of step(): writes the parameters this step uses into
  // the module and arms the step's gradient pushes with `options` (its
  // learning rate, gradient multiplier).
  absl::Status BeginStep(const PushOptions& options = PushOptions{});
  // After the backward: pushes what the hooks have not, issues the next
  // step's pulls and advances step(). The step's clipping / overflow report
  // is then client()->StepResult(step).
  absl::Status EndStep();
  // After the last step: writes the newest parameters into the module and
  // leaves the job (it can then be deleted without --force). Its error is
  // Synchronize's; a coordinator that cannot be reached to leave
  // (Client::Leave tries again within its rpc_timeout) is only logged: the
  // training result is in the module either way.
  absl::Status Finish();

 private:
  Trainer(torch::nn::Module* module, TrainerOptions options, Session session);
  // A failed call: re-joins when the job was rolled back and that is
  // followed (OK, step() is the restored step), else returns `why`.
  absl::Status Recover(const absl::Status& why);

  torch::nn::Module* module_;
  TrainerOptions options_;
  Session session_;
  std::unique_ptr<ModuleSync> sync_;
  uint64_t step_ = 1;
  bool armed_ = false;
  uint64_t rollbacks_ = 0;
};

}  // namespace client
}  // namespace optimus

#endif  // OPTIMUS_CLIENT_TORCH_TRAINER_H_
