#include "client/torch/module_sync.h"

#include <algorithm>
#include <stdexcept>
#include <utility>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/torch_optim.h"
#include "common/huge_pages.h"
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

absl::StatusOr<std::unique_ptr<ModuleSync>> ModuleSync::Create(
    Client* client, torch::nn::Module* module, const ModuleSyncOptions& options) {
  std::vector<std::string> names;
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
    names.push_back(item.key());
    params.push_back(item.value());
    index.push_back(*idx);
  }
  if (params.size() != client->tensors().size()) {
    return absl::InvalidArgumentError(absl::StrCat("the module has ", params.size(),
                                                   " parameters, the job has ",
                                                   client->tensors().size(), " tensors"));
  }
  std::unique_ptr<ModuleSync> sync;
  try {
    sync.reset(new ModuleSync(client, module, std::move(names), std::move(params),
                              std::move(index), options));
  } catch (const std::exception& e) {
    return FromTorchException(e, "allocating the staging buffers");
  }
  if (absl::Status s = sync->RegisterStaging(); !s.ok()) return s;
  try {
    sync->InstallHooks();
  } catch (const std::exception& e) {
    return FromTorchException(e, "installing gradient hooks");
  }
  return sync;
}

namespace {

// Views of one arena of `dtype`, shaped as `params`, each starting on a
// 64-byte boundary of the arena. The client sends from and receives into
// the arenas: they are mapped on a 2 MiB boundary and, from 2 MiB on,
// advised for transparent huge pages (common/huge_pages.h), which saves a
// page walk and pin per 4 KiB on every shared-memory transfer.
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
  const int64_t elems = std::max<int64_t>(total, 1);
  const size_t bytes = static_cast<size_t>(elems * elem_bytes);
  void* data = MapAligned(bytes, /*huge_pages=*/true);
  if (data == nullptr) {
    throw std::runtime_error(absl::StrCat("out of memory mapping ", bytes,
                                          " bytes of staging for the module's tensors"));
  }
  *arena = torch::from_blob(
      data, {elems}, [bytes](void* p) { UnmapAligned(p, bytes); }, torch::dtype(dtype));
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

ModuleSync::ModuleSync(Client* client, torch::nn::Module* module,
                       std::vector<std::string> names, std::vector<torch::Tensor> params,
                       std::vector<uint32_t> index, const ModuleSyncOptions& options)
    : client_(client),
      module_(module),
      options_(options),
      names_(std::move(names)),
      params_(std::move(params)),
      index_(std::move(index)),
      state_(params_.size()) {
  grad_staging_ = CarveArena(params_, ToTorch(client_->grad_dtype()), &grad_arena_);
  param_staging_ = CarveArena(params_, ToTorch(client_->param_dtype()), &param_arena_);
  for (size_t i = 0; i < params_.size(); ++i) by_impl_[params_[i].unsafeGetTensorImpl()] = i;
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
  for (size_t i = 0; i < accumulators_.size(); ++i) {
    if (accumulators_[i] != nullptr) accumulators_[i]->del_post_hook(hook_handles_[i]);
  }
  bool drained = true;
  {
    absl::MutexLock lock(&mu_);
    // Errors of transfers nobody waits for any more are of no use here; a
    // transfer still in flight after the minute keeps its buffer (below).
    drained = DrainLocked(absl::Now() + absl::Minutes(1)).code() !=
              absl::StatusCode::kDeadlineExceeded;
  }
  client_->ForgetBuffer(grad_arena_.data_ptr(), ArenaBytes(grad_arena_));
  client_->ForgetBuffer(param_arena_.data_ptr(), ArenaBytes(param_arena_));
  if (!drained) {
    // The client may still write into or read from the arenas: leak them
    // rather than hand their memory back while a transfer can land there.
    new torch::Tensor(std::move(grad_arena_));
    new torch::Tensor(std::move(param_arena_));
  }
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

namespace {

absl::Status BlockingRefused(const char* call) {
  return absl::FailedPreconditionError(absl::StrCat(
      call, " is the blocking mode's, but overlapped steps are under way (WaitParams / ArmStep / "
            "FinishStep): call Synchronize first"));
}

}  // namespace

absl::Status ModuleSync::PushGrads(uint64_t step, absl::Duration timeout,
                                   const PushOptions& options) {
  {
    absl::MutexLock lock(&mu_);
    if (RunningLocked()) return BlockingRefused("PushGrads");
  }
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
  absl::MutexLock lock(&mu_);
  if (RunningLocked()) return BlockingRefused("PullParams");
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
    for (size_t i = 0; i < params_.size(); ++i) {
      params_[i].copy_(param_staging_[i]);
      state_[i].module_version = version;
    }
  } catch (const std::exception& e) {
    return FromTorchException(e, "writing pulled parameters");
  }
  return absl::OkStatus();
}

// ---- Overlapped steps ----
//
// Each parameter's transfers, as ParamState records them. The staging view
// of the parameters holds at most one version that is not in the module
// yet: a pull goes into it only when nothing is staged and no pull is in
// flight (IssuePull), and what landed is copied into the module
// (WriteStaged) or dropped before the next pull. The gradient view holds
// the last push; it is written again only after that push was waited for
// and the version after it landed (the client may send a push again, after
// a failover, until the next version of its tensor is pulled).
//
// Layerwise: WaitParams(t) writes version t (pulled by a hook or by
// FinishStep(t - 1)); a hook pushes step t and pulls version t + 1 of its
// parameter; FinishStep(t) pushes the rest and pulls what is not out yet.
// Delayed: WaitParams(t) writes version t - 1 (landed by FinishStep(t - 1))
// and pulls version t; a hook pushes step t once version t has landed
// (step t may only be pushed to a chunk that published version t), else
// FinishStep(t) does, after waiting for it.

class ModuleSync::GradHook : public torch::autograd::FunctionPostHook {
 public:
  GradHook(ModuleSync* sync, size_t i) : sync_(sync), i_(i) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    sync_->OnGradReady(i_);
    return outputs;
  }

 private:
  ModuleSync* sync_;
  size_t i_;
};

namespace {

absl::Duration Remaining(absl::Time deadline) {
  return std::max(deadline - absl::Now(), absl::ZeroDuration());
}

}  // namespace

void ModuleSync::InstallHooks() {
  accumulators_.resize(params_.size());
  hook_handles_.resize(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!params_[i].requires_grad()) continue;  // Frozen: never a gradient.
    accumulators_[i] = torch::autograd::impl::grad_accumulator(params_[i]);
    if (accumulators_[i] == nullptr) continue;
    hook_handles_[i] = accumulators_[i]->add_post_hook(std::make_unique<GradHook>(this, i));
  }
}

uint64_t ModuleSync::ForwardVersion(uint64_t step) const {
  absl::MutexLock lock(&mu_);
  const uint64_t first = first_step_ != 0 ? first_step_ : step;
  if (options_.mode == UpdateMode::kLayerwise || step <= first) return step;
  return std::max(first, step - 1);
}

absl::Status ModuleSync::IssuePull(size_t i, uint64_t version) {
  ParamState& st = state_[i];
  if (st.pull_version != 0 || st.staged_version != 0) {
    return absl::InternalError(absl::StrCat("pulling version ", version, " of ", names_[i],
                                            " while its staging view is in use"));
  }
  auto t = client_->Pull(index_[i], version, param_staging_[i].data_ptr(),
                         static_cast<size_t>(param_staging_[i].numel()));
  if (!t.ok()) return t.status();
  st.pull_version = version;
  st.pull_ticket = *t;
  return absl::OkStatus();
}

absl::Status ModuleSync::CompletePull(size_t i, absl::Time deadline) {
  ParamState& st = state_[i];
  if (st.pull_version == 0) return absl::OkStatus();
  absl::Status s = client_->Wait(st.pull_ticket, Remaining(deadline));
  if (s.code() == absl::StatusCode::kDeadlineExceeded) return s;  // Still in flight.
  const uint64_t version = st.pull_version;
  st.pull_version = 0;
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("pulling version ", version, " of ", names_[i],
                                               ": ", s.message()));
  }
  st.staged_version = version;
  return absl::OkStatus();
}

absl::Status ModuleSync::CompletePush(size_t i, absl::Time deadline) {
  ParamState& st = state_[i];
  if (st.push_step == 0) return absl::OkStatus();
  absl::Status s = client_->Wait(st.push_ticket, Remaining(deadline));
  if (s.code() == absl::StatusCode::kDeadlineExceeded) return s;
  const uint64_t step = st.push_step;
  st.push_step = 0;
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("pushing the gradient of ", names_[i],
                                               " for step ", step, ": ", s.message()));
  }
  return absl::OkStatus();
}

absl::Status ModuleSync::WriteStaged(size_t i) {
  ParamState& st = state_[i];
  if (st.staged_version == 0) return absl::OkStatus();
  try {
    torch::NoGradGuard no_grad;
    params_[i].copy_(param_staging_[i]);
  } catch (const std::exception& e) {
    return FromTorchException(e, absl::StrCat("writing ", names_[i]));
  }
  st.module_version = st.staged_version;
  st.staged_version = 0;
  return absl::OkStatus();
}

absl::Status ModuleSync::BringTo(size_t i, uint64_t version, absl::Time deadline) {
  ParamState& st = state_[i];
  if (st.module_version == version) return absl::OkStatus();
  if (st.pull_version != 0 && st.pull_version < version) {
    // An older version still on its way: let it land, then drop it.
    if (absl::Status s = CompletePull(i, deadline); !s.ok()) return s;
  }
  if (st.staged_version != 0 && st.staged_version < version) st.staged_version = 0;
  if (st.pull_version > version || st.staged_version > version) {
    return absl::InternalError(absl::StrCat("bringing ", names_[i], " to version ", version,
                                            " but a newer one is on its way"));
  }
  if (st.pull_version == 0 && st.staged_version == 0) {
    if (absl::Status s = IssuePull(i, version); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ModuleSync::WaitParams(uint64_t step, absl::Duration timeout) {
  std::vector<size_t> all(params_.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  absl::MutexLock lock(&mu_);
  return WaitParamsLocked(step, all, timeout);
}

absl::Status ModuleSync::WaitParams(uint64_t step, const torch::nn::Module& submodule,
                                    absl::Duration timeout) {
  std::vector<size_t> which;
  for (const auto& item : submodule.named_parameters(/*recurse=*/true)) {
    auto it = by_impl_.find(item.value().unsafeGetTensorImpl());
    if (it == by_impl_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("WaitParams: the submodule's parameter ", item.key(),
                       " is not a parameter of the synced module"));
    }
    which.push_back(it->second);
  }
  absl::MutexLock lock(&mu_);
  return WaitParamsLocked(step, which, timeout);
}

absl::Status ModuleSync::WaitParamsLocked(uint64_t step, const std::vector<size_t>& which,
                                          absl::Duration timeout) {
  if (!hook_error_.ok()) return hook_error_;
  if (step == 0) return absl::InvalidArgumentError("steps start at 1");
  if (armed_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "WaitParams(", step, ") while step ", step_, " is armed: call FinishStep first"));
  }
  if (!RunningLocked()) {
    first_step_ = step;
    step_ = step;
  } else if (step != step_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "WaitParams(", step, "): the parameters of step ", step,
        " were never pulled; the current step is ", step_,
        " (steps run in order: WaitParams(t), ArmStep(t), backward, FinishStep())"));
  }
  const bool delayed = options_.mode == UpdateMode::kDelayed;
  const uint64_t version = delayed && step > first_step_ ? step - 1 : step;
  const absl::Time deadline = absl::Now() + timeout;
  {
    // The pulls this issues go out together, small ones batched per shard
    // (BringTo only waits for requests sent before).
    BatchScope batch(client_);
    for (size_t i : which) {
      if (absl::Status s = BringTo(i, version, deadline); !s.ok()) return s;
    }
  }
  for (size_t i : which) {
    if (state_[i].module_version == version) continue;
    if (absl::Status s = CompletePull(i, deadline); !s.ok()) return s;
    if (absl::Status s = WriteStaged(i); !s.ok()) return s;
  }
  if (delayed && step > first_step_) {
    // Version `step` is what this step's pushes need; it lands during the
    // forward and backward.
    BatchScope batch(client_);
    for (size_t i : which) {
      const ParamState& st = state_[i];
      if (st.pull_version == 0 && st.staged_version == 0 && st.module_version < step) {
        if (absl::Status s = IssuePull(i, step); !s.ok()) return s;
      }
    }
  }
  return absl::OkStatus();
}

absl::Status ModuleSync::ArmStep(uint64_t step, absl::Duration timeout,
                                 const PushOptions& options) {
  absl::MutexLock lock(&mu_);
  if (!hook_error_.ok()) return hook_error_;
  if (!RunningLocked()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ArmStep(", step, ") before any WaitParams: the forward must use parameters pulled "
        "from the job; call WaitParams(", step, ", ...) before it"));
  }
  if (armed_) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ArmStep(", step, "): step ", step_, " is already armed (call FinishStep after its "
        "backward before arming another step)"));
  }
  if (step != step_) {
    return absl::FailedPreconditionError(
        absl::StrCat("ArmStep(", step, "): the current step is ", step_));
  }
  armed_ = true;
  push_options_ = options;
  armed_timeout_ = timeout;
  for (ParamState& st : state_) {
    st.pushed_this_step = false;
    st.deferred = false;
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> ModuleSync::ReadyToPush(size_t i, uint64_t step, absl::Time deadline) {
  ParamState& st = state_[i];
  if (absl::Status s = CompletePush(i, deadline); !s.ok()) {
    if (s.code() == absl::StatusCode::kDeadlineExceeded && deadline == absl::InfinitePast()) {
      return false;
    }
    return s;
  }
  if (options_.mode == UpdateMode::kLayerwise) return true;
  if (st.module_version >= step || st.staged_version >= step) return true;
  if (st.pull_version != step) {
    if (deadline == absl::InfinitePast()) return false;
    // Not waited for this step (its submodule's forward did not run): the
    // backward is over, so the module may take what is staged now.
    if (absl::Status s = CompletePull(i, deadline); !s.ok()) return s;
    if (absl::Status s = WriteStaged(i); !s.ok()) return s;
    if (st.module_version >= step) return true;
    if (absl::Status s = IssuePull(i, step); !s.ok()) return s;
  }
  absl::Status s = CompletePull(i, deadline);
  if (s.code() == absl::StatusCode::kDeadlineExceeded && deadline == absl::InfinitePast()) {
    return false;
  }
  if (!s.ok()) return s;
  return true;
}

absl::Status ModuleSync::PushOne(size_t i, const torch::Tensor& grad) {
  ParamState& st = state_[i];
  const void* src = nullptr;
  if (grad.defined()) {
    try {
      torch::NoGradGuard no_grad;
      grad_staging_[i].copy_(grad);  // Casts with round-to-nearest-even.
    } catch (const std::exception& e) {
      return FromTorchException(e, absl::StrCat("casting the gradient of ", names_[i]));
    }
    src = grad_staging_[i].data_ptr();
  }
  auto t = client_->Push(index_[i], step_, src, static_cast<size_t>(grad_staging_[i].numel()),
                         push_options_);
  if (!t.ok()) {
    return absl::Status(t.status().code(), absl::StrCat("pushing the gradient of ", names_[i],
                                                        ": ", t.status().message()));
  }
  st.push_step = step_;
  st.push_ticket = *t;
  st.pushed_this_step = true;
  st.deferred = false;
  st.accumulated = false;
  return absl::OkStatus();
}

void ModuleSync::OnGradReady(size_t i) {
  absl::MutexLock lock(&mu_);
  if (!RunningLocked() || !hook_error_.ok()) return;
  ParamState& st = state_[i];
  const bool delayed = options_.mode == UpdateMode::kDelayed;
  const uint64_t needed = delayed && step_ > first_step_ ? step_ - 1 : step_;
  if (st.module_version != needed) {
    hook_error_ = absl::FailedPreconditionError(absl::StrCat(
        "optimus: the forward of step ", step_, " used parameter ", names_[i],
        st.module_version == 0 ? std::string(" before any values were pulled into it")
                               : absl::StrCat(" at version ", st.module_version),
        ", but step ", step_, " needs version ", needed, ": call WaitParams(", step_,
        ", ...) for the whole model, or for the submodule holding it, before its forward"));
    throw std::runtime_error(std::string(hook_error_.message()));
  }
  if (!armed_) {
    st.accumulated = true;  // Pushed by FinishStep, with what the last backward adds.
    return;
  }
  if (st.pushed_this_step) {
    hook_error_ = absl::FailedPreconditionError(absl::StrCat(
        "optimus: parameter ", names_[i], " got a second gradient while step ", step_,
        " was armed: with gradient accumulation, arm only before the last micro-batch's "
        "backward"));
    throw std::runtime_error(std::string(hook_error_.message()));
  }
  // Waits only for what is already due (the previous step's push answered).
  absl::StatusOr<bool> ready =
      ReadyToPush(i, step_, delayed ? absl::InfinitePast() : absl::Now() + armed_timeout_);
  if (!ready.ok()) {
    hook_error_ = ready.status();
    return;
  }
  if (!*ready) {
    st.deferred = true;
    return;
  }
  if (absl::Status s = PushOne(i, params_[i].grad()); !s.ok()) {
    hook_error_ = s;
    return;
  }
  if (!delayed && st.pull_version == 0 && st.staged_version == 0) {
    // The next version: parked on the shards until the step is applied,
    // answered as each chunk publishes (often before backward ends).
    if (absl::Status s = IssuePull(i, step_ + 1); !s.ok()) hook_error_ = s;
  }
}

absl::Status ModuleSync::FinishStep() {
  absl::MutexLock lock(&mu_);
  if (!armed_) {
    return absl::FailedPreconditionError(
        RunningLocked() ? absl::StrCat("FinishStep: step ", step_,
                                       " is not armed (ArmStep before its backward)")
                        : std::string("FinishStep before any WaitParams / ArmStep"));
  }
  armed_ = false;
  if (!hook_error_.ok()) return hook_error_;
  const absl::Time deadline = absl::Now() + armed_timeout_;
  // What has to happen before a push or a pull is waited for first, outside
  // the batch (corked requests leave only at the end of it).
  std::vector<size_t> to_push;
  for (size_t i = 0; i < params_.size(); ++i) {
    ParamState& st = state_[i];
    if (st.pushed_this_step) continue;
    to_push.push_back(i);
    absl::StatusOr<bool> ready = ReadyToPush(i, step_, deadline);
    if (!ready.ok()) return hook_error_ = ready.status();
  }
  const bool layerwise = options_.mode == UpdateMode::kLayerwise;
  if (layerwise) {
    // The next pull needs the staging view: what a forward did not take
    // (a submodule that did not run) goes into the module now. (Pulls of
    // the next version, issued by the hooks, stay in flight.)
    for (size_t i = 0; i < params_.size(); ++i) {
      ParamState& st = state_[i];
      if (st.pull_version != 0 && st.pull_version <= step_) {
        if (absl::Status s = CompletePull(i, deadline); !s.ok()) return hook_error_ = s;
      }
      if (st.staged_version != 0 && st.staged_version <= step_) {
        if (absl::Status s = WriteStaged(i); !s.ok()) return hook_error_ = s;
      }
    }
  }
  {
    BatchScope batch(client_);
    for (size_t i : to_push) {
      const ParamState& st = state_[i];
      // A gradient from the hook (delayed mode) or from unarmed backwards;
      // none otherwise, whatever .grad holds.
      torch::Tensor grad = st.deferred || st.accumulated ? params_[i].grad() : torch::Tensor();
      if (absl::Status s = PushOne(i, grad); !s.ok()) return hook_error_ = s;
    }
    if (layerwise) {
      for (size_t i = 0; i < params_.size(); ++i) {
        const ParamState& st = state_[i];
        if (st.pull_version != 0 || st.staged_version != 0) continue;  // From its hook.
        if (absl::Status s = IssuePull(i, step_ + 1); !s.ok()) return hook_error_ = s;
      }
    }
  }
  for (ParamState& st : state_) st.accumulated = false;
  ++step_;
  return absl::OkStatus();
}

absl::Status ModuleSync::DrainLocked(absl::Time deadline) {
  absl::Status first;
  for (size_t i = 0; i < params_.size(); ++i) {
    absl::Status s = CompletePush(i, deadline);
    if (s.ok()) s = CompletePull(i, deadline);
    if (!s.ok() && first.ok()) first = s;
    state_[i].staged_version = 0;
  }
  return first;
}

absl::Status ModuleSync::Synchronize(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  if (!RunningLocked()) return absl::OkStatus();
  if (armed_) {
    return absl::FailedPreconditionError(
        absl::StrCat("Synchronize while step ", step_, " is armed: call FinishStep first"));
  }
  if (!hook_error_.ok()) return hook_error_;
  const absl::Time deadline = absl::Now() + timeout;
  // step_ is one past the last finished step: its version is the newest.
  const uint64_t version = step_;
  {
    BatchScope batch(client_);
    for (size_t i = 0; i < params_.size(); ++i) {
      if (absl::Status s = CompletePush(i, deadline); !s.ok()) return s;
      if (absl::Status s = BringTo(i, version, deadline); !s.ok()) return s;
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (absl::Status s = CompletePull(i, deadline); !s.ok()) return s;
    if (absl::Status s = WriteStaged(i); !s.ok()) return s;
  }
  for (ParamState& st : state_) {
    const uint64_t v = st.module_version;
    st = ParamState{};
    st.module_version = v;
  }
  first_step_ = 0;
  step_ = 0;
  return absl::OkStatus();
}

std::vector<std::pair<std::string, torch::Tensor>> ModuleSync::ExportState() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : module_->named_parameters(/*recurse=*/true)) {
    out.emplace_back(item.key(), item.value().detach());
  }
  for (const auto& item : module_->named_buffers(/*recurse=*/true)) {
    out.emplace_back(item.key(), item.value().detach());
  }
  return out;
}

}  // namespace client
}  // namespace optimus
