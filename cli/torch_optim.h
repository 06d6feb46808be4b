// Reading an optimizer state in the torch-optim layout (the layout of
// `optimusctl checkpoint export --format=torch-optim`, specified in
// tests/torch_compare/FORMAT.md) that Python's torch.save or the export
// wrote, to start a job from it:
//   {"model": {name: tensor}, "optimizer": {"state": {i: {"step": ...,
//    moment: tensor}}, "param_groups": [{"params": [i, ...], ...}]},
//    "job_name": str, "resume_step": int}
// Stateless and thread-safe; the result belongs to the caller.
#ifndef OPTIMUS_CLI_TORCH_OPTIM_H_
#define OPTIMUS_CLI_TORCH_OPTIM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "proto/optimus.pb.h"

namespace optimus {

struct ImportedTensorState {
  std::string name;
  std::vector<float> master;  // num_elems fp32 values, row-major.
  // The optimizer's moments in kernels::LayoutOf(kind) order (its names
  // after "master"), num_elems values each; zeros for a tensor without a
  // state entry (never stepped, or frozen), and for SGD's momentum_buffer
  // None (torch.optim.SGD without momentum).
  std::vector<std::vector<float>> moments;
  // Optimizer steps taken (the state's "step"); 0 without a state entry,
  // and for SGD and Lion, whose state may have no step.
  uint64_t optimizer_steps = 0;
};

struct ImportedOptimizerState {
  std::vector<ImportedTensorState> tensors;  // In the spec's tensor order.
  uint64_t resume_step = 0;                  // The file's "resume_step"; 0 when absent.
};

// Reads `path` for a job of `spec` (its tensors, groups and optimizer kind).
// Tensors are found by name in "model" (other entries, such as buffers,
// are ignored) and their state by index in optimizer.state. When the file
// has optimizer.param_groups, the indices are mapped as torch.optim's
// load_state_dict maps them: the k-th index of the file's group g is the
// k-th tensor of the spec's group g (group 0 holding every tensor when the
// spec has no param_groups), so the file's groups must match the spec's in
// number and size; without param_groups, index i is the spec's tensor i.
// Floating-point tensors of any width are converted to fp32.
// NOT_FOUND when the file does not exist; INVALID_ARGUMENT naming the path
// and the entry when it is not a torch.save file of this layout, a tensor
// is missing from "model", has another shape than the spec's or a
// non-float dtype, a state entry holds other moments than the optimizer's
// (e.g. "max_exp_avg_sq", or Adam's for an SGD job), an Adam/AdamW entry
// has no step, or a state index names no tensor.
absl::StatusOr<ImportedOptimizerState> ReadTorchOptimFile(const std::string& path,
                                                          const v1::JobSpec& spec);

}  // namespace optimus

#endif  // OPTIMUS_CLI_TORCH_OPTIM_H_
