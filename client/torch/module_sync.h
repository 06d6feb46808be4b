// The libtorch adapter of liboptimus: maps a torch::nn::Module's parameters
// onto a job's tensors (by name, in registration order), and moves their
// gradients to the shards and the updated parameters back, either blocking
// (PushGrads / PullParams) or overlapped with backward and forward
// (WaitParams / ArmStep / FinishStep, see "Overlapped steps" below).
// Borrows the Client and the Module, which must outlive it. Use it from the
// training loop's thread; its autograd hooks may run on libtorch's backward
// threads, which it allows for (an internal lock).
#ifndef OPTIMUS_CLIENT_TORCH_MODULE_SYNC_H_
#define OPTIMUS_CLIENT_TORCH_MODULE_SYNC_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/client.h"

namespace optimus {
namespace client {

// The module's parameters as job tensors (named as in named_parameters()).
// Buffers (BatchNorm running statistics and the like) are not job tensors:
// see ModuleSync::ExportState.
std::vector<TensorDef> TensorDefsFromModule(const torch::nn::Module& module);

// Converts an exception thrown by libtorch into a Status (the one converter
// for libtorch errors).
absl::Status FromTorchException(const std::exception& e, absl::string_view what);

// Starts the joined job from an optimizer state saved by PyTorch in the
// torch-optim layout (torch.save({"model": model.state_dict(), "optimizer":
// optimizer.state_dict()}), or what `optimusctl checkpoint export
// --format=torch-optim` writes): master values, moments and per-tensor step
// counts, sent with Client::InitTensorState instead of InitTensor (one rank
// only). Tensors are matched by name, state by index as load_state_dict
// does; a file for another optimizer, shape or set of tensors is refused.
absl::Status InitFromTorchOptimFile(Client* client, const std::string& path);

// Which parameters an overlapped step's forward uses.
enum class UpdateMode {
  // Exact: step t's forward uses version t (the parameters after step
  // t - 1), the same result as the blocking calls and as torch.optim. The
  // optimizer step and the transfers overlap backward (gradients go out as
  // autograd produces them) and the next forward (each submodule waits only
  // for its own parameters).
  kLayerwise,
  // One step of staleness, as DeepSpeed's delayed parameter update: step
  // t's forward uses version t - 1 (the parameters after step t - 2; steps
  // 1 and 2 both use version 1), so the step and all the transfers overlap
  // the whole next iteration. Each gradient is still applied exactly once,
  // to the newest master weights; it was only computed on older ones.
  kDelayed,
};

struct ModuleSyncOptions {
  // For the overlapped calls (the blocking ones ignore it). Default
  // kLayerwise.
  UpdateMode mode = UpdateMode::kLayerwise;
};

// Overlapped steps. Per step t (one backward; see "Gradient accumulation"
// for several):
//
//   sync->WaitParams(t, timeout);        // the parameters step t's forward uses
//   torch::Tensor loss = loss_fn(model->forward(x), y);
//   sync->ArmStep(t, timeout, {lr});     // before backward
//   loss.backward();                     // each gradient is pushed when ready
//   sync->FinishStep();                  // the rest; pulls for step t + 1 go out
//
// WaitParams(t) writes into the module every parameter that step t's forward
// uses (the whole model: the safe default). To overlap the forward too, wait
// per submodule instead, right before each submodule's forward (libtorch's
// C++ modules have no forward pre-hooks, so the model's forward calls it):
//
//   sync->WaitParams(t, *block1, timeout); x = block1->forward(x);
//   sync->WaitParams(t, *block2, timeout); x = block2->forward(x);
//
// Misuse is an error, never stale values used silently: a backward that
// reaches a parameter whose forward ran before WaitParams wrote the values
// that step needs throws from loss.backward() (a std::runtime_error naming
// the parameter, the version it used and the one it needed), and FinishStep
// returns the same error as FAILED_PRECONDITION. (Writing a parameter after
// a forward used it also makes autograd refuse the backward, for the values
// it saved.) The first WaitParams pulls the first step's parameters itself;
// every later step's come from the previous FinishStep.
//
// Every gradient is cast into the parameter's staging view (registered
// once) and pushed from an autograd hook on the parameter's gradient
// accumulator, in backward order, without waiting; a parameter whose hook
// did not fire this step is pushed as "no gradient" (Client::Push with
// nullptr: left alone unless another rank has one), never as zeros.
//
// Gradient accumulation: supported. Run the backward of every micro-batch
// but the last without arming; arm before the last one. Hooks read the
// accumulated .grad (post-accumulation hooks), so the push carries the sum
// of all micro-batches; a parameter that got a gradient in an earlier
// micro-batch but not in the last is pushed with its accumulated .grad.
// Zero the gradients after FinishStep as usual (model->zero_grad()).
//
// After the last step, Synchronize(timeout) waits for everything in flight
// and writes the newest parameters (version last step + 1, in either mode)
// into the module: call it before exporting or evaluating the model. (A
// forward without backward is not checked: evaluating between steps uses
// whatever the module holds, i.e. the version the last WaitParams wrote.)
//
// Buffers (BatchNorm running statistics and the like) are kept per worker:
// optimus never sends them (they are not job tensors), as with DDP's
// broadcast_buffers=false. ExportState returns them with the parameters.
class ModuleSync {
 public:
  // Checks that the joined job has exactly the module's parameters (names,
  // shapes), allocates the staging buffers once (one contiguous arena for
  // the gradients, one for the parameters) and registers both with the
  // client's data plane (Client::RegisterBuffer), so that every push and
  // pull of every step reuses those two registrations, and installs the
  // gradient hooks (idle until a step is armed). Errors: the mismatch, or
  // the transport's when registering fails.
  static absl::StatusOr<std::unique_ptr<ModuleSync>> Create(
      Client* client, torch::nn::Module* module, const ModuleSyncOptions& options = {});
  // Waits (up to a minute) for the transfers still in flight, removes the
  // hooks and forgets the staging registrations (Client::ForgetBuffer).
  ~ModuleSync();
  ModuleSync(const ModuleSync&) = delete;
  ModuleSync& operator=(const ModuleSync&) = delete;

  UpdateMode mode() const { return options_.mode; }

  // Sends the module's current values as version 1 (call on one rank only).
  absl::Status InitFromModule();

  // Starts the job from an optimizer state saved by PyTorch in the
  // torch-optim layout (torch.save({"model": model.state_dict(),
  // "optimizer": optimizer.state_dict()}), or what `optimusctl checkpoint
  // export --format=torch-optim` writes): master values, moments and step
  // counts, instead of InitFromModule (one rank only). The module's own
  // values are not used. (The free function above, for this client.)
  absl::Status InitFromTorchOptimFile(const std::string& path) {
    return client::InitFromTorchOptimFile(client_, path);
  }

  // ---- Blocking (no overlap) ----
  // FAILED_PRECONDITION while overlapped steps are under way (between the
  // first WaitParams and Synchronize).

  // Pushes every parameter's gradient for `step`, cast to the job's grad
  // dtype, with the step's learning rate and gradient multiplier, and waits
  // until the shards hold them. A parameter whose .grad is undefined is
  // pushed without one: it is left alone this step (as torch.optim does),
  // unless another rank has one. The step's StepReport (clipping, found_inf)
  // is then client->StepResult(step).
  absl::Status PushGrads(uint64_t step, absl::Duration timeout,
                         const PushOptions& options = PushOptions{});

  // Pulls every parameter at `version` and writes it into the module.
  absl::Status PullParams(uint64_t version, absl::Duration timeout);

  // ---- Overlapped (see above) ----

  // The version of the parameters step `step`'s forward uses in this mode
  // (layerwise: step; delayed: step - 1, but at least the first step's).
  uint64_t ForwardVersion(uint64_t step) const;

  // Before step `step`'s forward: waits for the parameters it uses (every
  // parameter, or those of `submodule` and its children) and writes them
  // into the module. Errors: FAILED_PRECONDITION for a step other than the
  // current one (the first WaitParams starts at any step, e.g.
  // client->resume_step(); later, the step after the last FinishStep) or
  // while a step is armed; INVALID_ARGUMENT for a submodule holding a
  // parameter that is not the synced module's; DEADLINE_EXCEEDED (the call
  // may be repeated); a shard's error.
  absl::Status WaitParams(uint64_t step, absl::Duration timeout);
  absl::Status WaitParams(uint64_t step, const torch::nn::Module& submodule,
                          absl::Duration timeout);

  // Before the step's (last) backward: from now until FinishStep, each
  // parameter's gradient is pushed for `step` with `options` when autograd
  // has accumulated it. `timeout` bounds what the hooks and FinishStep may
  // wait for. FAILED_PRECONDITION when a step is already armed, when `step`
  // is not the current step, or before the first WaitParams.
  absl::Status ArmStep(uint64_t step, absl::Duration timeout,
                       const PushOptions& options = PushOptions{});

  // After the armed step's backward: pushes every parameter not pushed yet
  // (its accumulated .grad, or "no gradient"), then issues the pulls the
  // next step needs that are not out yet (layerwise: version step + 1 of
  // every parameter; a hook pulls its parameter's right after pushing it,
  // and each comes back as its chunks publish). Does not wait for the pushes
  // (delayed mode: a push waits for its tensor's previous step to be
  // published, which has normally happened during the backward). The
  // step's StepReport is then client->StepResult(step). Errors:
  // FAILED_PRECONDITION when no step is armed or the forward used stale
  // parameters (the step's pushes are then incomplete: stop training);
  // the first error of a push or hook.
  absl::Status FinishStep();

  // After the last FinishStep: waits for every push and pull in flight,
  // writes the newest parameters (version last step + 1) into the module and
  // ends the overlapped run (the blocking calls work again; a later
  // WaitParams starts a new run). OK at once when nothing ran.
  absl::Status Synchronize(absl::Duration timeout);

  // The module's state as torch's state_dict() names it: every parameter
  // (as the module holds it: call Synchronize first for the newest values)
  // then every buffer (this worker's own; see "Buffers" above), in
  // named_parameters() / named_buffers() order. The tensors are the
  // module's own (detached), not copies.
  std::vector<std::pair<std::string, torch::Tensor>> ExportState() const;

 private:
  class GradHook;
  // One parameter's transfers (see module_sync.cc for the invariants).
  struct ParamState {
    uint64_t module_version = 0;   // Written into the module's parameter (0: none).
    uint64_t staged_version = 0;   // Landed in the staging view, not yet written (0: none).
    uint64_t pull_version = 0;     // A pull in flight into the staging view (0: none).
    Ticket pull_ticket = 0;
    uint64_t push_step = 0;        // A push in flight from the grad view, not waited (0: none).
    Ticket push_ticket = 0;
    bool pushed_this_step = false;  // Pushed for the armed step.
    bool deferred = false;          // Delayed mode: its hook fired; pushed by FinishStep.
    bool accumulated = false;       // Got a gradient in an unarmed backward of this step.
  };

  ModuleSync(Client* client, torch::nn::Module* module, std::vector<std::string> names,
             std::vector<torch::Tensor> params, std::vector<uint32_t> index,
             const ModuleSyncOptions& options);

  // Registers both arenas.
  absl::Status RegisterStaging();
  // Adds the post-accumulation hooks.
  void InstallHooks();

  // Called by parameter i's hook after autograd accumulated its gradient.
  // Throws std::runtime_error when the forward used stale values.
  void OnGradReady(size_t i) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Status WaitParamsLocked(uint64_t step, const std::vector<size_t>& which,
                                absl::Duration timeout) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Parameter i's pull of `version` into its staging view (the view must be
  // free: nothing staged, no pull in flight).
  absl::Status IssuePull(size_t i, uint64_t version) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for parameter i's pull in flight, if any (it is then staged).
  absl::Status CompletePull(size_t i, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for parameter i's push in flight, if any.
  absl::Status CompletePush(size_t i, absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Copies parameter i's staged values into the module.
  absl::Status WriteStaged(size_t i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Brings parameter i to `version` in the module (pulling it if nothing
  // newer is staged or in flight).
  absl::Status BringTo(size_t i, uint64_t version, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Delayed mode: whether parameter i may push step `step` now (its
  // previous push waited, version `step` published), waiting until
  // `deadline` for that (InfinitePast: not at all).
  absl::StatusOr<bool> ReadyToPush(size_t i, uint64_t step, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Casts parameter i's gradient (undefined: no gradient) into its grad
  // view and pushes it for the armed step.
  absl::Status PushOne(size_t i, const torch::Tensor& grad) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Waits for every ticket in flight (for the destructor and Synchronize).
  absl::Status DrainLocked(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Where overlapped steps are under way.
  bool RunningLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return step_ != 0; }

  Client* client_;
  torch::nn::Module* module_;
  const ModuleSyncOptions options_;
  std::vector<std::string> names_;
  std::vector<torch::Tensor> params_;
  std::vector<uint32_t> index_;          // Job tensor index per parameter.
  // Parameter i of a TensorImpl (for per-submodule waits).
  std::unordered_map<const void*, size_t> by_impl_;
  // Every parameter's staging tensor is a view of one arena per dtype (its
  // start 64-byte aligned), registered once.
  torch::Tensor grad_arena_;                  // grad dtype.
  torch::Tensor param_arena_;                 // param dtype.
  std::vector<torch::Tensor> grad_staging_;   // grad dtype, contiguous views.
  std::vector<torch::Tensor> param_staging_;  // param dtype, contiguous views.
  // The gradient accumulators the hooks sit on (kept alive: autograd only
  // holds them while a graph does) and the hooks' handles.
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hook_handles_;

  mutable absl::Mutex mu_;
  std::vector<ParamState> state_ ABSL_GUARDED_BY(mu_);
  uint64_t first_step_ ABSL_GUARDED_BY(mu_) = 0;  // The run's first step (0: no run).
  uint64_t step_ ABSL_GUARDED_BY(mu_) = 0;        // The current step (0: no run).
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  PushOptions push_options_ ABSL_GUARDED_BY(mu_);
  absl::Duration armed_timeout_ ABSL_GUARDED_BY(mu_);
  absl::Status hook_error_ ABSL_GUARDED_BY(mu_);  // First error in a hook this step.
};

}  // namespace client
}  // namespace optimus

#endif  // OPTIMUS_CLIENT_TORCH_MODULE_SYNC_H_
