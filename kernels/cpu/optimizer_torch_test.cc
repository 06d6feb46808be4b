// FusedStep against libtorch's own optimizers (torch::optim::AdamW, Adam,
// SGD with momentum): the server must reproduce what a trainer would get
// from torch, up to the rounding differences of torch's FMA-based kernels.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <memory>
#include <random>
#include <vector>

#include "common/dtype.h"
#include "gtest/gtest.h"
#include "kernels/cpu/optimizer.h"

namespace optimus {
namespace kernels {
namespace {

constexpr int64_t kNumElems = 10007;  // odd: exercises the vector tails
constexpr int kSteps = 12;
constexpr int kWorkers = 2;

// torch takes double hyper-parameters; pass exactly the float values that
// OptimizerHyper holds so both sides derive the same constants.
std::unique_ptr<torch::optim::Optimizer> MakeTorchOptimizer(
    const OptimizerHyper& h, const torch::Tensor& param) {
  const double lr = h.lr, b1 = h.beta1, b2 = h.beta2, eps = h.eps,
               wd = h.weight_decay, momentum = h.momentum;
  switch (h.kind) {
    case OptimizerKind::kAdamW:
      return std::make_unique<torch::optim::AdamW>(
          std::vector<torch::Tensor>{param},
          torch::optim::AdamWOptions(lr).betas({b1, b2}).eps(eps).weight_decay(wd));
    case OptimizerKind::kAdam:
      return std::make_unique<torch::optim::Adam>(
          std::vector<torch::Tensor>{param},
          torch::optim::AdamOptions(lr).betas({b1, b2}).eps(eps).weight_decay(wd));
    case OptimizerKind::kSgd:
      return std::make_unique<torch::optim::SGD>(
          std::vector<torch::Tensor>{param},
          torch::optim::SGDOptions(lr).momentum(momentum).weight_decay(wd));
    case OptimizerKind::kLion:
      break;  // torch has no Lion; optimizer_test.cc checks it against double.
  }
  return nullptr;
}

// Runs kSteps steps of both and returns the largest |torch - ours| over the
// master weights.
double MaxAbsDiffAgainstTorch(const OptimizerHyper& hyper, DType grad_dtype) {
  std::mt19937 rng(1234 + static_cast<int>(hyper.kind));
  std::normal_distribution<float> dist(0.0f, 1.0f);

  std::vector<float> master(kNumElems), m(kNumElems, 0.0f), v(kNumElems, 0.0f);
  for (float& x : master) x = dist(rng);
  std::vector<float> out(kNumElems);

  torch::Tensor param =
      torch::from_blob(master.data(), {kNumElems}, torch::kFloat32).clone();
  param.set_requires_grad(true);
  std::unique_ptr<torch::optim::Optimizer> opt = MakeTorchOptimizer(hyper, param);

  for (int t = 1; t <= kSteps; ++t) {
    // Each worker's gradient, as it would arrive on the wire (fp32 or bf16),
    // and the fp32 value torch would see after the same conversion.
    std::vector<std::vector<float>> grads_f32(kWorkers, std::vector<float>(kNumElems));
    std::vector<std::vector<uint16_t>> grads_bf16(kWorkers,
                                                  std::vector<uint16_t>(kNumElems));
    std::vector<const void*> slots;
    for (int w = 0; w < kWorkers; ++w) {
      for (int64_t i = 0; i < kNumElems; ++i) {
        float g = dist(rng) * 0.1f;
        grads_bf16[w][i] = FloatToBf16(g);
        if (grad_dtype == DType::kBf16) g = Bf16ToFloat(grads_bf16[w][i]);
        grads_f32[w][i] = g;
      }
      slots.push_back(grad_dtype == DType::kBf16
                          ? static_cast<const void*>(grads_bf16[w].data())
                          : static_cast<const void*>(grads_f32[w].data()));
    }
    // torch's gradient: the average over workers, summed in rank order.
    const float grad_scale = 1.0f / kWorkers;
    std::vector<float> avg(kNumElems);
    for (int64_t i = 0; i < kNumElems; ++i) {
      avg[i] = (grads_f32[0][i] + grads_f32[1][i]) * grad_scale;
    }
    param.mutable_grad() =
        torch::from_blob(avg.data(), {kNumElems}, torch::kFloat32).clone();
    opt->step();

    StepInputs in;
    in.grads = slots;
    in.grad_dtype = grad_dtype;
    in.grad_scale = grad_scale;
    in.step = t;
    const absl::Status s = FusedStep(hyper, in, kNumElems,
                                     ChunkState{master.data(), m.data(), v.data()},
                                     out.data(), DType::kFp32);
    EXPECT_TRUE(s.ok()) << s;
  }
  const torch::Tensor ours =
      torch::from_blob(master.data(), {kNumElems}, torch::kFloat32);
  return (param.detach() - ours).abs().max().item<double>();
}

OptimizerHyper AdamWHyper() {
  OptimizerHyper h;
  h.kind = OptimizerKind::kAdamW;
  h.lr = 1e-3f;
  h.weight_decay = 0.1f;
  return h;
}

OptimizerHyper AdamHyper() {
  OptimizerHyper h;
  h.kind = OptimizerKind::kAdam;
  h.lr = 3e-3f;
  h.beta1 = 0.85f;
  h.beta2 = 0.995f;
  h.eps = 1e-6f;
  h.weight_decay = 0.01f;
  return h;
}

OptimizerHyper SgdHyper() {
  OptimizerHyper h;
  h.kind = OptimizerKind::kSgd;
  h.lr = 0.05f;
  h.momentum = 0.9f;
  h.weight_decay = 1e-3f;
  return h;
}

constexpr double kMaxAbsDiff = 1e-6;

TEST(OptimizerTorchTest, AdamWMatchesTorch) {
  for (DType d : {DType::kFp32, DType::kBf16}) {
    const double diff = MaxAbsDiffAgainstTorch(AdamWHyper(), d);
    std::cout << "AdamW grads " << DTypeName(d) << ": max |torch - ours| = " << diff
              << " (ActiveIsa " << ActiveIsa() << ")\n";
    EXPECT_LE(diff, kMaxAbsDiff);
  }
}

TEST(OptimizerTorchTest, AdamMatchesTorch) {
  for (DType d : {DType::kFp32, DType::kBf16}) {
    const double diff = MaxAbsDiffAgainstTorch(AdamHyper(), d);
    std::cout << "Adam grads " << DTypeName(d) << ": max |torch - ours| = " << diff << "\n";
    EXPECT_LE(diff, kMaxAbsDiff);
  }
}

TEST(OptimizerTorchTest, SgdMomentumMatchesTorch) {
  for (DType d : {DType::kFp32, DType::kBf16}) {
    const double diff = MaxAbsDiffAgainstTorch(SgdHyper(), d);
    std::cout << "SGD grads " << DTypeName(d) << ": max |torch - ours| = " << diff << "\n";
    EXPECT_LE(diff, kMaxAbsDiff);
  }
}

}  // namespace
}  // namespace kernels
}  // namespace optimus
