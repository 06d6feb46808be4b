#include "cli/export.h"

#include <exception>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_files.h"
#include "kernels/optimizer_spec.h"
#include "proto/optimus.pb.h"
#include "torch/torch.h"

namespace optimus {
namespace {

using c10::IValue;
using c10::impl::GenericDict;
using c10::impl::GenericList;

GenericDict NewDict() { return GenericDict(c10::StringType::get(), c10::AnyType::get()); }
GenericList NewList() { return GenericList(c10::AnyType::get()); }
IValue Tuple2(double a, double b) { return c10::ivalue::Tuple::create({IValue(a), IValue(b)}); }

// A checkpoint read whole: its manifest, every tensor's arrays and the
// optimizer steps each tensor took.
struct Loaded {
  v1::CheckpointManifest m;
  kernels::OptimizerKind kind = kernels::OptimizerKind::kAdamW;
  std::vector<std::vector<torch::Tensor>> arrays;  // By tensor: master, then the moments.
  std::vector<uint64_t> steps;                     // By tensor.
};

// A parameter group as it steps: its own settings where set, else the
// optimizer's; the implicit one when the job has none.
struct Group {
  std::string name;
  std::vector<int> tensors;  // Spec indices, in spec order.
  float lr_mult = 1, weight_decay = 0, beta1 = 0, beta2 = 0, momentum = 0;
};

std::vector<Group> GroupsOf(const v1::JobSpec& spec) {
  const v1::OptimizerConfig& o = spec.optimizer();
  std::vector<Group> groups(std::max(1, spec.param_groups_size()));
  for (size_t g = 0; g < groups.size(); ++g) {
    Group& out = groups[g];
    out.weight_decay = o.weight_decay();
    out.beta1 = o.beta1();
    out.beta2 = o.beta2();
    out.momentum = o.momentum();
    if (static_cast<int>(g) >= spec.param_groups_size()) continue;
    const v1::ParamGroup& p = spec.param_groups(static_cast<int>(g));
    out.name = p.name();
    if (p.has_lr_mult()) out.lr_mult = p.lr_mult();
    if (p.has_weight_decay()) out.weight_decay = p.weight_decay();
    if (p.has_beta1()) out.beta1 = p.beta1();
    if (p.has_beta2()) out.beta2 = p.beta2();
    if (p.has_momentum()) out.momentum = p.momentum();
  }
  for (int t = 0; t < spec.tensors_size(); ++t) {
    const uint32_t g = spec.tensors(t).group();
    if (g < groups.size()) groups[g].tensors.push_back(t);
  }
  return groups;
}

// The lr of the checkpoint's last step; the job's configured lr when no
// step recorded one (an older checkpoint, or none taken).
float BaseLr(const v1::CheckpointManifest& m) {
  return m.last_lr() > 0 ? m.last_lr() : m.spec().optimizer().lr();
}


absl::StatusOr<Loaded> Load(const std::string& dir) {
  Loaded out;
  absl::StatusOr<v1::CheckpointManifest> m = ckpt::ReadManifest(dir);
  if (!m.ok()) return m.status();
  out.m = *std::move(m);
  if (auto s = ckpt::VerifyCheckpoint(dir, out.m); !s.ok()) return s;
  absl::StatusOr<kernels::OptimizerKind> kind =
      kernels::OptimizerKindFromInt(out.m.spec().optimizer().kind());
  if (!kind.ok()) {
    return absl::DataLossError(
        absl::StrCat(dir, ": the manifest's spec names no known optimizer"));
  }
  out.kind = *kind;
  absl::StatusOr<std::vector<uint64_t>> steps = ckpt::OptimizerStepsOf(dir, out.m);
  if (!steps.ok()) return steps.status();
  out.steps = *std::move(steps);
  const kernels::StateLayout& layout = kernels::LayoutOf(out.kind);
  for (int t = 0; t < out.m.spec().tensors_size(); ++t) {
    const v1::TensorSpec& spec = out.m.spec().tensors(t);
    std::vector<int64_t> shape(spec.shape().begin(), spec.shape().end());
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<torch::Tensor> arrays;
    std::vector<float*> dst;
    for (uint32_t a = 0; a < layout.num_arrays; ++a) {
      arrays.push_back(torch::empty(shape, torch::kFloat32));
      dst.push_back(arrays.back().data_ptr<float>());
    }
    if (auto s = ckpt::ReadTensorRange(dir, out.m, static_cast<uint32_t>(t), 0,
                                       static_cast<uint64_t>(n), absl::MakeSpan(dst));
        !s.ok()) {
      return s;
    }
    out.arrays.push_back(std::move(arrays));
  }
  return out;
}

IValue OptimusLayout(const Loaded& c) {
  const v1::JobSpec& spec = c.m.spec();
  const kernels::StateLayout& layout = kernels::LayoutOf(c.kind);
  GenericDict params = NewDict();
  GenericDict state = NewDict();
  GenericList frozen = NewList();
  for (int t = 0; t < spec.tensors_size(); ++t) {
    const std::string& name = spec.tensors(t).name();
    params.insert(name, c.arrays[t][0]);
    GenericDict per = NewDict();
    for (uint32_t a = 1; a < layout.num_arrays; ++a) per.insert(layout.names[a], c.arrays[t][a]);
    per.insert("step", torch::tensor(static_cast<float>(c.steps[t])));
    state.insert(name, per);
    if (spec.tensors(t).frozen()) frozen.push_back(name);
  }
  GenericList groups = NewList();
  for (const Group& g : GroupsOf(spec)) {
    GenericDict d = NewDict();
    d.insert("name", g.name);
    GenericList names = NewList();
    for (int t : g.tensors) names.push_back(spec.tensors(t).name());
    d.insert("params", names);
    d.insert("lr", static_cast<double>(BaseLr(c.m) * g.lr_mult));
    d.insert("lr_mult", static_cast<double>(g.lr_mult));
    d.insert("weight_decay", static_cast<double>(g.weight_decay));
    d.insert("beta1", static_cast<double>(g.beta1));
    d.insert("beta2", static_cast<double>(g.beta2));
    d.insert("momentum", static_cast<double>(g.momentum));
    groups.push_back(d);
  }
  const v1::OptimizerConfig& o = spec.optimizer();
  GenericDict opt = NewDict();
  opt.insert("kind", std::string(kernels::OptimizerName(c.kind)));
  opt.insert("lr", static_cast<double>(o.lr()));
  opt.insert("beta1", static_cast<double>(o.beta1()));
  opt.insert("beta2", static_cast<double>(o.beta2()));
  opt.insert("eps", static_cast<double>(o.eps()));
  opt.insert("weight_decay", static_cast<double>(o.weight_decay()));
  opt.insert("momentum", static_cast<double>(o.momentum()));
  GenericDict root = NewDict();
  root.insert("job_name", c.m.job_name());
  root.insert("step", static_cast<int64_t>(c.m.step() - 1));
  root.insert("resume_step", static_cast<int64_t>(c.m.step()));
  root.insert("optimizer", opt);
  root.insert("param_groups", groups);
  root.insert("frozen", frozen);
  root.insert("last_lr", static_cast<double>(c.m.last_lr()));
  root.insert("max_grad_norm", static_cast<double>(spec.max_grad_norm()));
  root.insert("skip_nonfinite", !spec.keep_nonfinite());
  root.insert("params", params);
  root.insert("state", state);
  return root;
}

// One entry of optimizer.param_groups with the keys (and defaults) that
// torch.optim's state_dict has for the kind in Debian's torch 1.13
// (export_test checks them against the installed torch), plus "name".
// Lion follows lion-pytorch: lr, betas, weight_decay.
GenericDict TorchGroup(const Group& g, kernels::OptimizerKind kind, const v1::OptimizerConfig& o,
                       float base_lr) {
  GenericDict d = NewDict();
  // The group's lr is the step's times lr_mult, computed in fp32 as the shards do.
  d.insert("lr", static_cast<double>(base_lr * g.lr_mult));
  switch (kind) {
    case kernels::OptimizerKind::kAdamW:
    case kernels::OptimizerKind::kAdam:
      d.insert("betas", Tuple2(g.beta1, g.beta2));
      d.insert("eps", static_cast<double>(o.eps()));
      d.insert("weight_decay", static_cast<double>(g.weight_decay));
      d.insert("amsgrad", false);
      d.insert("foreach", IValue());
      d.insert("maximize", false);
      d.insert("capturable", false);
      if (kind == kernels::OptimizerKind::kAdam) {
        d.insert("differentiable", false);
        d.insert("fused", false);
      }
      break;
    case kernels::OptimizerKind::kSgd:
      d.insert("momentum", static_cast<double>(g.momentum));
      d.insert("dampening", 0.0);
      d.insert("weight_decay", static_cast<double>(g.weight_decay));
      d.insert("nesterov", false);
      d.insert("maximize", false);
      d.insert("foreach", IValue());
      d.insert("differentiable", false);
      break;
    case kernels::OptimizerKind::kLion:
      d.insert("betas", Tuple2(g.beta1, g.beta2));
      d.insert("weight_decay", static_cast<double>(g.weight_decay));
      break;
  }
  d.insert("name", g.name);
  GenericList params = NewList();
  for (int t : g.tensors) params.push_back(static_cast<int64_t>(t));
  d.insert("params", params);
  return d;
}

IValue TorchOptimLayout(const Loaded& c) {
  const v1::JobSpec& spec = c.m.spec();
  const kernels::StateLayout& layout = kernels::LayoutOf(c.kind);
  GenericDict model = NewDict();
  GenericDict state(c10::IntType::get(), c10::AnyType::get());
  for (int t = 0; t < spec.tensors_size(); ++t) {
    model.insert(spec.tensors(t).name(), c.arrays[t][0]);
    // torch.optim keeps no state for a parameter that never stepped.
    if (c.steps[t] == 0) continue;
    GenericDict per = NewDict();
    per.insert("step", torch::tensor(static_cast<float>(c.steps[t])));
    for (uint32_t a = 1; a < layout.num_arrays; ++a) per.insert(layout.names[a], c.arrays[t][a]);
    state.insert(static_cast<int64_t>(t), per);
  }
  GenericList groups = NewList();
  for (const Group& g : GroupsOf(spec)) {
    groups.push_back(TorchGroup(g, c.kind, spec.optimizer(), BaseLr(c.m)));
  }
  GenericDict optimizer = NewDict();
  optimizer.insert("state", state);
  optimizer.insert("param_groups", groups);
  GenericDict root = NewDict();
  root.insert("model", model);
  root.insert("optimizer", optimizer);
  root.insert("job_name", c.m.job_name());
  root.insert("resume_step", static_cast<int64_t>(c.m.step()));
  return root;
}

absl::Status Export(const std::string& dir, const std::string& out_path, ExportFormat format) {
  absl::StatusOr<Loaded> c = Load(dir);
  if (!c.ok()) return c.status();
  const IValue root = format == ExportFormat::kTorchOptim ? TorchOptimLayout(*c) : OptimusLayout(*c);
  const std::vector<char> bytes = torch::pickle_save(root);
  return ckpt::WriteFileAtomically(out_path, absl::string_view(bytes.data(), bytes.size()));
}

}  // namespace

absl::StatusOr<ExportFormat> ParseExportFormat(absl::string_view name) {
  if (name == "optimus") return ExportFormat::kOptimus;
  if (name == "torch-optim") return ExportFormat::kTorchOptim;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown export format \"", name, "\" (optimus or torch-optim)"));
}

absl::Status ExportCheckpointToTorch(const std::string& checkpoint_dir,
                                     const std::string& out_path, ExportFormat format) {
  // libtorch reports by exception: converted here, at its only edge.
  try {
    return Export(checkpoint_dir, out_path, format);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("exporting ", checkpoint_dir, ": ", e.what()));
  }
}

}  // namespace optimus
