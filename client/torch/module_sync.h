// The libtorch adapter of liboptimus: maps a torch::nn::Module's parameters
// onto a job's tensors (by name, in registration order), and moves their
// gradients to the shards and the updated parameters back.
// Borrows the Client and the Module, which must outlive it. Not thread-safe:
// use it from the training loop's thread.
#ifndef OPTIMUS_CLIENT_TORCH_MODULE_SYNC_H_
#define OPTIMUS_CLIENT_TORCH_MODULE_SYNC_H_

#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"

namespace optimus {
namespace client {

// The module's parameters as job tensors (named as in named_parameters()).
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

class ModuleSync {
 public:
  // Checks that the joined job has exactly the module's parameters (names,
  // shapes), allocates the staging buffers once (one contiguous arena for
  // the gradients, one for the parameters) and registers both with the
  // client's data plane (Client::RegisterBuffer), so that every push and
  // pull of every step reuses those two registrations. Errors: the
  // mismatch, or the transport's when registering fails.
  static absl::StatusOr<std::unique_ptr<ModuleSync>> Create(Client* client,
                                                            torch::nn::Module* module);
  // Forgets the staging registrations (Client::ForgetBuffer).
  ~ModuleSync();
  ModuleSync(const ModuleSync&) = delete;
  ModuleSync& operator=(const ModuleSync&) = delete;

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

 private:
  ModuleSync(Client* client, std::vector<torch::Tensor> params, std::vector<uint32_t> index);

  // Registers both arenas.
  absl::Status RegisterStaging();

  Client* client_;
  std::vector<torch::Tensor> params_;
  std::vector<uint32_t> index_;          // Job tensor index per parameter.
  // Every parameter's staging tensor is a view of one arena per dtype (its
  // start 64-byte aligned), registered once.
  torch::Tensor grad_arena_;                  // grad dtype.
  torch::Tensor param_arena_;                 // param dtype.
  std::vector<torch::Tensor> grad_staging_;   // grad dtype, contiguous views.
  std::vector<torch::Tensor> param_staging_;  // param dtype, contiguous views.
};

}  // namespace client
}  // namespace optimus

#endif  // OPTIMUS_CLIENT_TORCH_MODULE_SYNC_H_
