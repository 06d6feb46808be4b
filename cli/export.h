// `optimusctl checkpoint export`: turns a complete checkpoint folder into a
// file that PyTorch loads directly with torch.load (a torch.save-format zip
// written by torch::pickle_save). Stateless and thread-safe; the output file
// belongs to the caller.
//
// Two layouts. ExportFormat::kOptimus (the default) holds one dict:
//   "step":      int, the checkpoint's step - 1
//   "resume_step": int, the step training resumes at
//   "job_name":  str
//   "optimizer": {"kind": str, "lr", "beta1", "beta2", "eps",
//                 "weight_decay", "momentum": float}
//   "param_groups": [{"name": str, "params": [tensor names], "lr": float
//                 (last lr x lr_mult), "lr_mult", "weight_decay", "beta1",
//                 "beta2", "momentum": float (the group's own where set,
//                 else the optimizer's)}]; one group holding every tensor
//                 when the job has no param_groups
//   "frozen":    [tensor names]
//   "last_lr":   float, the lr of the checkpoint's last step (0: none
//                 known); "max_grad_norm": float; "skip_nonfinite": bool
//   "params":    {tensor name: fp32 tensor of its shape} (master weights)
//   "state":     {tensor name: {"exp_avg"/"exp_avg_sq"/"momentum_buffer":
//                 fp32 tensor of its shape, "step": float tensor (optimizer
//                 steps the tensor took; 0 when it never stepped)}}
// "state" mirrors torch.optim's per-parameter state (keyed by name).
//
// ExportFormat::kTorchOptim is the torch-optim layout of
// tests/torch_compare/FORMAT.md: {"model": {name: fp32 tensor},
// "optimizer": a torch.optim state_dict (what optimizer.load_state_dict
// takes), "job_name", "resume_step"}.
//
// The per-tensor step comes from the files' optimizer_steps; a checkpoint
// written before shards recorded them (every file 0, step > 1) counts
// step - 1 for every tensor that is not frozen.
#ifndef OPTIMUS_CLI_EXPORT_H_
#define OPTIMUS_CLI_EXPORT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace optimus {

enum class ExportFormat {
  kOptimus,     // "optimus": tensors and state by name, the job's settings.
  kTorchOptim,  // "torch-optim": model + torch.optim state_dict.
};

// "optimus" or "torch-optim"; INVALID_ARGUMENT naming `name` otherwise.
absl::StatusOr<ExportFormat> ParseExportFormat(absl::string_view name);

// Reads the manifest in `checkpoint_dir`, verifies every file (DATA_LOSS
// naming a corrupted one, or a tensor whose files disagree on its
// optimizer steps) and writes `out_path` atomically in `format`. INTERNAL
// with the path when it cannot be written.
absl::Status ExportCheckpointToTorch(const std::string& checkpoint_dir,
                                     const std::string& out_path,
                                     ExportFormat format = ExportFormat::kOptimus);

}  // namespace optimus

#endif  // OPTIMUS_CLI_EXPORT_H_
