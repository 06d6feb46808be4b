#include "cli/torch_optim.h"

#include <cmath>
#include <exception>
#include <map>
#include <memory>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cli/torch_pickle.h"
#include "kernels/optimizer_spec.h"
#include "torch/torch.h"

namespace optimus {
namespace {

using Kind = PyValue::Kind;

std::string ShapeText(absl::Span<const int64_t> shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

class Reader {
 public:
  Reader(std::string path, const v1::JobSpec& spec) : path_(std::move(path)), spec_(spec) {}

  absl::StatusOr<ImportedOptimizerState> Read();

 private:
  absl::Status Invalid(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": ", what));
  }
  // `v` as num_elems fp32 values of the tensor `t`'s shape.
  absl::StatusOr<std::vector<float>> Values(const PyValue& v, int t, const std::string& what) const;
  // Which spec tensor each optimizer.state index stands for.
  absl::StatusOr<std::map<int64_t, int>> TensorsByIndex(const PyValue& optimizer) const;
  absl::Status ReadState(const PyValue& entry, int t, const std::string& what,
                         const kernels::StateLayout& layout, bool step_required,
                         ImportedTensorState* out) const;

  const std::string path_;
  const v1::JobSpec& spec_;
};

absl::StatusOr<std::vector<float>> Reader::Values(const PyValue& v, int t,
                                                  const std::string& what) const {
  if (v.kind != Kind::kTensor) {
    return Invalid(absl::StrCat(what, " is a ", PyKindName(v.kind), ", not a tensor"));
  }
  if (!torch::isFloatingType(v.tensor.scalar_type())) {
    return Invalid(absl::StrCat(what, " has dtype ", c10::toString(v.tensor.scalar_type()),
                                "; a floating-point dtype is needed"));
  }
  const std::vector<int64_t> want(spec_.tensors(t).shape().begin(),
                                  spec_.tensors(t).shape().end());
  if (v.tensor.sizes().vec() != want) {
    return Invalid(absl::StrCat(what, " has shape ", ShapeText(v.tensor.sizes().vec()),
                                "; the job's tensor \"", spec_.tensors(t).name(), "\" is ",
                                ShapeText(want)));
  }
  const torch::Tensor f = v.tensor.to(torch::kFloat32).contiguous();
  const float* p = f.data_ptr<float>();
  return std::vector<float>(p, p + f.numel());
}

absl::StatusOr<std::map<int64_t, int>> Reader::TensorsByIndex(const PyValue& optimizer) const {
  std::map<int64_t, int> out;
  const PyValue* groups = optimizer.Find("param_groups");
  if (groups == nullptr) {
    for (int t = 0; t < spec_.tensors_size(); ++t) out[t] = t;
    return out;
  }
  if (groups->kind != Kind::kList) return Invalid("optimizer.param_groups is not a list");
  // The spec's groups: each tensor's index, in spec order, by group.
  const size_t num_groups = std::max(1, spec_.param_groups_size());
  std::vector<std::vector<int>> members(num_groups);
  for (int t = 0; t < spec_.tensors_size(); ++t) {
    const uint32_t g = spec_.tensors(t).group();
    if (g >= num_groups) {
      return Invalid(absl::StrCat("the spec's tensor \"", spec_.tensors(t).name(), "\" has group ",
                                  g, ", which it does not have"));
    }
    members[g].push_back(t);
  }
  if (groups->items.size() != num_groups) {
    return Invalid(absl::StrCat("optimizer.param_groups has ", groups->items.size(),
                                " groups; the job has ", num_groups));
  }
  for (size_t g = 0; g < num_groups; ++g) {
    const PyValue& group = *groups->items[g];
    const PyValue* params = group.kind == Kind::kDict ? group.Find("params") : nullptr;
    const std::string where = absl::StrCat("optimizer.param_groups[", g, "]");
    if (params == nullptr || params->kind != Kind::kList) {
      return Invalid(absl::StrCat(where, " has no \"params\" list"));
    }
    if (params->items.size() != members[g].size()) {
      return Invalid(absl::StrCat(where, " has ", params->items.size(),
                                  " params; the job's group ", g, " has ", members[g].size(),
                                  " tensors"));
    }
    for (size_t k = 0; k < members[g].size(); ++k) {
      const PyValue& index = *params->items[k];
      if (index.kind != Kind::kInt) return Invalid(absl::StrCat(where, ".params holds a non-int"));
      if (!out.emplace(index.integer, members[g][k]).second) {
        return Invalid(absl::StrCat(where, ".params repeats index ", index.integer));
      }
    }
  }
  return out;
}

absl::Status Reader::ReadState(const PyValue& entry, int t, const std::string& what,
                               const kernels::StateLayout& layout, bool step_required,
                               ImportedTensorState* out) const {
  if (entry.kind != Kind::kDict) return Invalid(absl::StrCat(what, " is not a dict"));
  std::set<std::string> allowed = {"step"};
  for (uint32_t a = 1; a < layout.num_arrays; ++a) allowed.insert(layout.names[a]);
  const std::string expected =
      absl::StrCat("a ", kernels::OptimizerName(*kernels::OptimizerKindFromInt(
                             spec_.optimizer().kind())),
                   " job's state holds ", absl::StrJoin(allowed, ", "));
  for (const auto& [key, value] : entry.entries) {
    if (key->kind != Kind::kString || allowed.count(key->string) == 0) {
      return Invalid(absl::StrCat(
          what, " holds ", key->kind == Kind::kString ? "\"" + key->string + "\"" : "a non-str key",
          "; ", expected));
    }
  }
  for (uint32_t a = 1; a < layout.num_arrays; ++a) {
    const PyValue* m = entry.Find(layout.names[a]);
    const std::string where = absl::StrCat(what, "[\"", layout.names[a], "\"]");
    if (m == nullptr) return Invalid(absl::StrCat(what, " has no \"", layout.names[a], "\"; ", expected));
    if (m->kind == Kind::kNone && std::string(layout.names[a]) == "momentum_buffer") {
      continue;  // torch.optim.SGD without momentum keeps None: zeros.
    }
    absl::StatusOr<std::vector<float>> values = Values(*m, t, where);
    if (!values.ok()) return values.status();
    out->moments[a - 1] = *std::move(values);
  }
  const PyValue* step = entry.Find("step");
  if (step == nullptr) {
    if (step_required) return Invalid(absl::StrCat(what, " has no \"step\""));
    return absl::OkStatus();
  }
  double steps = 0;
  if (step->kind == Kind::kInt) {
    steps = static_cast<double>(step->integer);
  } else if (step->kind == Kind::kFloat) {
    steps = step->number;
  } else if (step->kind == Kind::kTensor && step->tensor.numel() == 1) {
    steps = step->tensor.to(torch::kFloat64).item<double>();
  } else {
    return Invalid(absl::StrCat(what, "[\"step\"] is not a number or a one-element tensor"));
  }
  if (!(steps >= 0) || steps != std::floor(steps) || steps > 9.0e15) {
    return Invalid(absl::StrCat(what, "[\"step\"] is ", steps, ", not a count of steps"));
  }
  out->optimizer_steps = static_cast<uint64_t>(steps);
  return absl::OkStatus();
}

absl::StatusOr<ImportedOptimizerState> Reader::Read() {
  absl::StatusOr<kernels::OptimizerKind> kind =
      kernels::OptimizerKindFromInt(spec_.optimizer().kind());
  if (!kind.ok()) return kind.status();
  const kernels::StateLayout& layout = kernels::LayoutOf(*kind);
  absl::StatusOr<std::shared_ptr<PyValue>> root = LoadTorchFile(path_);
  if (!root.ok()) return root.status();
  if ((*root)->kind != Kind::kDict) return Invalid("holds no dict");
  const PyValue* model = (*root)->Find("model");
  if (model == nullptr || model->kind != Kind::kDict) return Invalid("has no \"model\" dict");
  const PyValue* optimizer = (*root)->Find("optimizer");
  if (optimizer == nullptr || optimizer->kind != Kind::kDict) {
    return Invalid("has no \"optimizer\" dict");
  }
  const PyValue* state = optimizer->Find("state");
  if (state == nullptr || state->kind != Kind::kDict) {
    return Invalid("has no \"optimizer\"[\"state\"] dict");
  }
  ImportedOptimizerState out;
  if (const PyValue* r = (*root)->Find("resume_step"); r != nullptr && r->kind == Kind::kInt) {
    out.resume_step = r->integer > 0 ? static_cast<uint64_t>(r->integer) : 0;
  }
  // Lookups by name: a model may hold thousands of tensors.
  std::map<std::string, const PyValue*> by_name;
  for (const auto& [k, v] : model->entries) {
    if (k->kind == Kind::kString) by_name.emplace(k->string, v.get());
  }
  out.tensors.resize(spec_.tensors_size());
  for (int t = 0; t < spec_.tensors_size(); ++t) {
    ImportedTensorState& ts = out.tensors[t];
    ts.name = spec_.tensors(t).name();
    auto it = by_name.find(ts.name);
    if (it == by_name.end()) {
      return Invalid(absl::StrCat("\"model\" has no tensor \"", ts.name, "\""));
    }
    absl::StatusOr<std::vector<float>> master =
        Values(*it->second, t, absl::StrCat("model[\"", ts.name, "\"]"));
    if (!master.ok()) return master.status();
    ts.master = *std::move(master);
    ts.moments.assign(layout.num_arrays - 1, std::vector<float>(ts.master.size(), 0.0f));
  }
  absl::StatusOr<std::map<int64_t, int>> tensor_of = TensorsByIndex(*optimizer);
  if (!tensor_of.ok()) return tensor_of.status();
  // Adam's bias correction needs the step; SGD has none, and Lion's
  // reference implementation keeps none.
  const bool step_required =
      *kind == kernels::OptimizerKind::kAdam || *kind == kernels::OptimizerKind::kAdamW;
  for (const auto& [key, entry] : state->entries) {
    if (key->kind != Kind::kInt) return Invalid("optimizer.state has a key that is not an int");
    auto it = tensor_of->find(key->integer);
    if (it == tensor_of->end()) {
      return Invalid(absl::StrCat("optimizer.state[", key->integer,
                                  "] stands for no tensor of the job"));
    }
    const int t = it->second;
    const std::string what =
        absl::StrCat("optimizer.state[", key->integer, "] (tensor \"", spec_.tensors(t).name(), "\")");
    if (absl::Status s = ReadState(*entry, t, what, layout, step_required, &out.tensors[t]);
        !s.ok()) {
      return s;
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<ImportedOptimizerState> ReadTorchOptimFile(const std::string& path,
                                                          const v1::JobSpec& spec) {
  // libtorch reports by exception (dtype conversions): converted here.
  try {
    return Reader(path, spec).Read();
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", e.what()));
  }
}

}  // namespace optimus
