#include "client/torch/module_sync.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/torch_optim.h"
#include "kernels/optimizer_spec.h"
#include "proto/optimus.pb.h"

namespace optimus {
namespace client {
namespace {

torch::ScalarType ToTorch(DType d) {
  switch (d) {
    case DType::kFp32: return torch::kFloat32;
    case DType::kBf16: return torch::kBFloat16;
    case DType::kFp16: return torch::kFloat16;
  }
  return torch::kFloat32;
}

absl::Status WaitAll(Client* client, const std::vector<Ticket>& tickets, absl::Duration timeout) {
  absl::Status first;
  const absl::Time deadline = absl::Now() + timeout;
  for (Ticket t : tickets) {
    absl::Status s = client->Wait(t, std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!s.ok() && first.ok()) first = s;
  }
  return first;
}

}  // namespace

absl::Status FromTorchException(const std::exception& e, absl::string_view what) {
  return absl::InternalError(absl::StrCat(what, ": libtorch: ", e.what()));
}

std::vector<TensorDef> TensorDefsFromModule(const torch::nn::Module& module) {
  std::vector<TensorDef> defs;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    TensorDef d;
    d.name = item.key();
    d.frozen = !item.value().requires_grad();
    for (int64_t s : item.value().sizes()) d.shape.push_back(s);
    defs.push_back(std::move(d));
  }
  return defs;
}

absl::StatusOr<std::unique_ptr<ModuleSync>> ModuleSync::Create(Client* client,
                                                               torch::nn::Module* module) {
  std::vector<torch::Tensor> params;
  std::vector<uint32_t> index;
  for (const auto& item : module->named_parameters(/*recurse=*/true)) {
    auto idx = client->TensorIndex(item.key());
    if (!idx.ok()) return idx.status();
    const TensorInfo& info = client->tensors()[*idx];
    std::vector<int64_t> shape(item.value().sizes().begin(), item.value().sizes().end());
    if (shape != info.shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", item.key(), " has shape [", absl::StrJoin(shape, ","),
                       "] but the job's tensor has [", absl::StrJoin(info.shape, ","), "]"));
    }
    if (item.value().scalar_type() != torch::kFloat32) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", item.key(), " is not float32 (master copies are fp32)"));
    }
    params.push_back(item.value());
    index.push_back(*idx);
  }
  if (params.size() != client->tensors().size()) {
    return absl::InvalidArgumentError(absl::StrCat("the module has ", params.size(),
                                                   " parameters, the job has ",
                                                   client->tensors().size(), " tensors"));
  }
  std::unique_ptr<ModuleSync> sync(new ModuleSync(client, std::move(params), std::move(index)));
  if (absl::Status s = sync->RegisterStaging(); !s.ok()) return s;
  return sync;
}

namespace {

// Views of one arena of `dtype`, shaped as `params`, each starting on a
// 64-byte boundary of the arena.
std::vector<torch::Tensor> CarveArena(const std::vector<torch::Tensor>& params,
                                      torch::ScalarType dtype, torch::Tensor* arena) {
  const int64_t elem_bytes = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t align = 64 / elem_bytes;
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const auto& p : params) {
    offsets.push_back(total);
    total += (p.numel() + align - 1) / align * align;
  }
  *arena = torch::empty({std::max<int64_t>(total, 1)}, torch::dtype(dtype));
  std::vector<torch::Tensor> views;
  for (size_t i = 0; i < params.size(); ++i) {
    views.push_back(arena->narrow(0, offsets[i], params[i].numel()).view(params[i].sizes()));
  }
  return views;
}

size_t ArenaBytes(const torch::Tensor& arena) {
  return static_cast<size_t>(arena.numel()) * arena.element_size();
}

}  // namespace

ModuleSync::ModuleSync(Client* client, std::vector<torch::Tensor> params,
                       std::vector<uint32_t> index)
    : client_(client), params_(std::move(params)), index_(std::move(index)) {
  grad_staging_ = CarveArena(params_, ToTorch(client_->grad_dtype()), &grad_arena_);
  param_staging_ = CarveArena(params_, ToTorch(client_->param_dtype()), &param_arena_);
}

absl::Status ModuleSync::RegisterStaging() {
  for (const torch::Tensor* arena : {&grad_arena_, &param_arena_}) {
    absl::Status s = client_->RegisterBuffer(arena->data_ptr(), ArenaBytes(*arena));
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("registering the staging buffers: ", s.message()));
    }
  }
  return absl::OkStatus();
}

ModuleSync::~ModuleSync() {
  client_->ForgetBuffer(grad_arena_.data_ptr(), ArenaBytes(grad_arena_));
  client_->ForgetBuffer(param_arena_.data_ptr(), ArenaBytes(param_arena_));
}

absl::Status ModuleSync::InitFromModule() {
  for (size_t i = 0; i < params_.size(); ++i) {
    torch::Tensor values = params_[i].detach().contiguous();
    absl::Status s = client_->InitTensor(index_[i], values.data_ptr<float>(),
                                         static_cast<size_t>(values.numel()));
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status InitFromTorchOptimFile(Client* client, const std::string& path) {
  // The job's spec as far as the reader needs it: names, shapes, groups,
  // frozen tensors, the optimizer (its state's names).
  v1::JobSpec spec;
  for (const TensorInfo& t : client->tensors()) {
    v1::TensorSpec* ts = spec.add_tensors();
    ts->set_name(t.name);
    for (int64_t d : t.shape) ts->add_shape(d);
    ts->set_group(t.group);
    ts->set_frozen(t.frozen);
  }
  for (uint32_t g = 0; g < client->num_param_groups(); ++g) spec.add_param_groups();
  // client::Optimizer lists the kinds in proto order, from 1.
  spec.mutable_optimizer()->set_kind(
      static_cast<v1::OptimizerKind>(static_cast<int>(client->optimizer()) + 1));
  absl::StatusOr<ImportedOptimizerState> state = ReadTorchOptimFile(path, spec);
  if (!state.ok()) return state.status();
  for (uint32_t t = 0; t < state->tensors.size(); ++t) {
    const ImportedTensorState& it = state->tensors[t];
    TensorState ts;
    ts.master = it.master.data();
    ts.m = it.moments.size() > 0 ? it.moments[0].data() : nullptr;
    ts.v = it.moments.size() > 1 ? it.moments[1].data() : nullptr;
    ts.steps = it.optimizer_steps;
    absl::Status s = client->InitTensorState(t, ts, it.master.size());
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ModuleSync::PushGrads(uint64_t step, absl::Duration timeout,
                                   const PushOptions& options) {
  std::vector<Ticket> tickets;
  absl::Status first;
  try {
    torch::NoGradGuard no_grad;
    // Small parameters (biases, norms) go to each shard in one message.
    BatchScope batch(client_);
    for (size_t i = 0; i < params_.size(); ++i) {
      const torch::Tensor& g = params_[i].grad();
      const void* src = nullptr;
      if (g.defined()) {
        grad_staging_[i].copy_(g);  // Casts with round-to-nearest-even.
        src = grad_staging_[i].data_ptr();
      }
      auto t = client_->Push(index_[i], step, src,
                             static_cast<size_t>(grad_staging_[i].numel()), options);
      if (!t.ok()) {
        first = t.status();
        break;
      }
      tickets.push_back(*t);
    }
  } catch (const std::exception& e) {
    first = FromTorchException(e, "casting gradients");
  }
  absl::Status waited = WaitAll(client_, tickets, timeout);
  return first.ok() ? waited : first;
}

absl::Status ModuleSync::PullParams(uint64_t version, absl::Duration timeout) {
  std::vector<Ticket> tickets;
  absl::Status first;
  {
    BatchScope batch(client_);
    for (size_t i = 0; i < params_.size(); ++i) {
      auto t = client_->Pull(index_[i], version, param_staging_[i].data_ptr(),
                             static_cast<size_t>(param_staging_[i].numel()));
      if (!t.ok()) {
        first = t.status();
        break;
      }
      tickets.push_back(*t);
    }
  }
  absl::Status waited = WaitAll(client_, tickets, timeout);
  if (!first.ok()) return first;
  if (!waited.ok()) return waited;
  try {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) params_[i].copy_(param_staging_[i]);
  } catch (const std::exception& e) {
    return FromTorchException(e, "writing pulled parameters");
  }
  return absl::OkStatus();
}

}  // namespace client
}  // namespace optimus
