// The training task the local cluster runs: a small MLP regressing a fixed
// random "teacher" MLP on synthetic data generated from (seed, step, rank), so
// nothing is downloaded and every process can regenerate any batch. Also the
// single-process reference: the same mixed-precision training with
// torch::optim::AdamW on the averaged gradients. Not thread-safe (libtorch's
// global RNG is seeded here); use from one thread.
#ifndef OPTIMUS_DEPLOY_LOCAL_MLP_TASK_H_
#define OPTIMUS_DEPLOY_LOCAL_MLP_TASK_H_

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "absl/status/statusor.h"
#include "common/dtype.h"

namespace optimus {
namespace local {

struct TaskOptions {
  int64_t in_features = 32;
  int64_t hidden = 256;
  int64_t out_features = 8;
  int64_t batch = 64;       // Per worker per step.
  uint64_t seed = 1;
  float lr = 2e-3f;
  float weight_decay = 0.01f;
  DType grad_dtype = DType::kBf16;
  DType param_dtype = DType::kBf16;
};

struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t in, int64_t hidden, int64_t out);
  torch::Tensor forward(torch::Tensor x);
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

// The student with its deterministic initial values.
Mlp MakeModel(const TaskOptions& opts);

struct Batch {
  torch::Tensor x;
  torch::Tensor y;
};

// Worker `rank`'s batch for `step` (1-based). Same on every process.
Batch MakeBatch(const TaskOptions& opts, uint64_t step, uint32_t rank);

// A fixed held-out batch for reporting loss.
Batch EvalBatch(const TaskOptions& opts);

// Mean squared error of `model` on `batch`.
float Loss(Mlp& model, const Batch& batch);

// Rounds every parameter of `model` to dtype and back (what the shards publish).
void RoundParams(Mlp& model, DType dtype);

// Flattened copy of all parameters, in named_parameters() order.
std::vector<float> FlattenParams(Mlp& model);

struct ReferenceResult {
  std::vector<float> master;  // Final fp32 master weights, flattened.
  float final_loss = 0;       // Eval loss with the published (rounded) params.
};

// Single process, `steps` steps over `world_size` simulated workers: each
// computes its batch's gradient on the published (param_dtype-rounded)
// weights; gradients are cast to grad_dtype, summed in rank order in fp32 and
// averaged; torch::optim::AdamW steps the fp32 master.
ReferenceResult RunReference(const TaskOptions& opts, uint32_t world_size, uint64_t steps);

// Writes / reads flattened parameters as raw little-endian fp32.
absl::Status WriteParams(const std::string& path, const std::vector<float>& values);
absl::StatusOr<std::vector<float>> ReadParams(const std::string& path);

}  // namespace local
}  // namespace optimus

#endif  // OPTIMUS_DEPLOY_LOCAL_MLP_TASK_H_
