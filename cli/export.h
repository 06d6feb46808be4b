// `optimusctl checkpoint export`: turns a complete checkpoint folder into a
// file that PyTorch loads directly with torch.load (a torch.save-format zip
// written by torch::pickle_save). Stateless and thread-safe; the output file
// belongs to the caller.
//
// The file holds one dict:
//   "step":      int, steps applied (the checkpoint's step - 1)
//   "resume_step": int, the step training resumes at
//   "job_name":  str
//   "optimizer": {"kind": str, "lr", "beta1", "beta2", "eps",
//                 "weight_decay", "momentum": float}
//   "params":    {tensor name: fp32 tensor of its shape} (master weights)
//   "state":     {tensor name: {"exp_avg"/"exp_avg_sq"/"momentum_buffer":
//                 fp32 tensor of its shape, "step": float tensor}}
// "state" mirrors torch.optim's per-parameter state (keyed by name).
#ifndef OPTIMUS_CLI_EXPORT_H_
#define OPTIMUS_CLI_EXPORT_H_

#include <string>

#include "absl/status/status.h"

namespace optimus {

// Reads the manifest in `checkpoint_dir`, verifies every file (DATA_LOSS
// naming a corrupted one) and writes `out_path` atomically. INTERNAL with
// the path when it cannot be written.
absl::Status ExportCheckpointToTorch(const std::string& checkpoint_dir,
                                     const std::string& out_path);

}  // namespace optimus

#endif  // OPTIMUS_CLI_EXPORT_H_
