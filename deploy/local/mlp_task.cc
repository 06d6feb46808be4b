#include "deploy/local/mlp_task.h"

#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"

namespace optimus {
namespace local {
namespace {

torch::ScalarType ToTorch(DType d) {
  switch (d) {
    case DType::kFp32: return torch::kFloat32;
    case DType::kBf16: return torch::kBFloat16;
    case DType::kFp16: return torch::kFloat16;
  }
  return torch::kFloat32;
}

// The teacher is seeded separately from the student so both are fixed.
Mlp& Teacher(const TaskOptions& opts) {
  static Mlp* teacher = nullptr;
  static uint64_t teacher_seed = 0;
  if (teacher == nullptr || teacher_seed != opts.seed) {
    torch::manual_seed(static_cast<int64_t>(opts.seed * 7919 + 17));
    delete teacher;
    teacher = new Mlp(opts.in_features, opts.hidden / 2, opts.out_features);
    teacher_seed = opts.seed;
  }
  return *teacher;
}

Batch Generate(const TaskOptions& opts, int64_t stream) {
  Mlp& teacher = Teacher(opts);
  torch::manual_seed(stream);
  Batch b;
  b.x = torch::randn({opts.batch, opts.in_features});
  torch::NoGradGuard no_grad;
  b.y = teacher->forward(b.x) + 0.01 * torch::randn({opts.batch, opts.out_features});
  return b;
}

}  // namespace

MlpImpl::MlpImpl(int64_t in, int64_t hidden, int64_t out)
    : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
      fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
      fc3(register_module("fc3", torch::nn::Linear(hidden, out))) {}

torch::Tensor MlpImpl::forward(torch::Tensor x) {
  x = torch::gelu(fc1->forward(x));
  x = torch::gelu(fc2->forward(x));
  return fc3->forward(x);
}

Mlp MakeModel(const TaskOptions& opts) {
  torch::manual_seed(static_cast<int64_t>(opts.seed));
  return Mlp(opts.in_features, opts.hidden, opts.out_features);
}

Batch MakeBatch(const TaskOptions& opts, uint64_t step, uint32_t rank) {
  return Generate(opts, static_cast<int64_t>(opts.seed * 1000003 + step * 131 + rank));
}

Batch EvalBatch(const TaskOptions& opts) {
  TaskOptions big = opts;
  big.batch = 512;
  return Generate(big, static_cast<int64_t>(opts.seed * 1000003 + 999999937));
}

float Loss(Mlp& model, const Batch& batch) {
  torch::NoGradGuard no_grad;
  return torch::mse_loss(model->forward(batch.x), batch.y).item<float>();
}

void RoundParams(Mlp& model, DType dtype) {
  torch::NoGradGuard no_grad;
  for (auto& p : model->parameters()) p.copy_(p.to(ToTorch(dtype)).to(torch::kFloat32));
}

std::vector<float> FlattenParams(Mlp& model) {
  std::vector<float> out;
  for (auto& p : model->parameters()) {
    torch::Tensor c = p.detach().contiguous();
    out.insert(out.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  return out;
}

ReferenceResult RunReference(const TaskOptions& opts, uint32_t world_size, uint64_t steps) {
  Mlp master = MakeModel(opts);
  Mlp compute = MakeModel(opts);
  torch::optim::AdamW adamw(master->parameters(), torch::optim::AdamWOptions(opts.lr)
                                                      .betas({0.9, 0.999})
                                                      .eps(1e-8)
                                                      .weight_decay(opts.weight_decay));
  auto mp = master->parameters();
  auto cp = compute->parameters();
  for (uint64_t step = 1; step <= steps; ++step) {
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < mp.size(); ++i) cp[i].copy_(mp[i]);
    }
    RoundParams(compute, opts.param_dtype);
    std::vector<torch::Tensor> sum(mp.size());
    for (uint32_t r = 0; r < world_size; ++r) {
      compute->zero_grad();
      Batch b = MakeBatch(opts, step, r);
      torch::mse_loss(compute->forward(b.x), b.y).backward();
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < cp.size(); ++i) {
        torch::Tensor g = cp[i].grad().to(ToTorch(opts.grad_dtype)).to(torch::kFloat32);
        sum[i] = r == 0 ? g.clone() : sum[i] + g;
      }
    }
    {
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < mp.size(); ++i) {
        mp[i].mutable_grad() = sum[i] * (1.0f / static_cast<float>(world_size));
      }
    }
    adamw.step();
  }
  ReferenceResult result;
  result.master = FlattenParams(master);
  RoundParams(master, opts.param_dtype);
  result.final_loss = Loss(master, EvalBatch(opts));
  return result;
}

absl::Status WriteParams(const std::string& path, const std::vector<float>& values) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return absl::UnavailableError(absl::StrCat("cannot open ", tmp));
  const size_t n = std::fwrite(values.data(), sizeof(float), values.size(), f);
  const bool ok = n == values.size() && std::fflush(f) == 0;
  std::fclose(f);
  if (!ok) return absl::DataLossError(absl::StrCat("short write to ", tmp));
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> ReadParams(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  const std::streamsize size = in.tellg();
  if (size % 4 != 0) return absl::DataLossError(absl::StrCat(path, ": size not a multiple of 4"));
  std::vector<float> values(static_cast<size_t>(size / 4));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(values.data()), size);
  if (!in) return absl::DataLossError(absl::StrCat("short read from ", path));
  return values;
}

}  // namespace local
}  // namespace optimus
