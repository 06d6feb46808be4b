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

c10::impl::GenericDict NewDict() {
  return c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
}

absl::Status Export(const std::string& dir, const std::string& out_path) {
  absl::StatusOr<v1::CheckpointManifest> m = ckpt::ReadManifest(dir);
  if (!m.ok()) return m.status();
  if (auto s = ckpt::VerifyCheckpoint(dir, *m); !s.ok()) return s;
  // The arrays of each data file, named as torch.optim names its state.
  absl::StatusOr<kernels::OptimizerKind> kind =
      kernels::OptimizerKindFromInt(m->spec().optimizer().kind());
  if (!kind.ok()) {
    return absl::DataLossError(
        absl::StrCat(dir, ": the manifest's spec names no known optimizer"));
  }
  const kernels::StateLayout& layout = kernels::LayoutOf(*kind);
  const std::vector<std::string> arrays(layout.names.begin(),
                                        layout.names.begin() + layout.num_arrays);
  c10::impl::GenericDict params = NewDict();
  c10::impl::GenericDict state = NewDict();
  for (int t = 0; t < m->spec().tensors_size(); ++t) {
    const v1::TensorSpec& spec = m->spec().tensors(t);
    std::vector<int64_t> shape(spec.shape().begin(), spec.shape().end());
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<torch::Tensor> out;
    std::vector<float*> dst;
    for (size_t a = 0; a < arrays.size(); ++a) {
      out.push_back(torch::empty(shape, torch::kFloat32));
      dst.push_back(out.back().data_ptr<float>());
    }
    if (auto s = ckpt::ReadTensorRange(dir, *m, static_cast<uint32_t>(t), 0,
                                       static_cast<uint64_t>(n), absl::MakeSpan(dst));
        !s.ok()) {
      return s;
    }
    params.insert(spec.name(), out[0]);
    c10::impl::GenericDict per = NewDict();
    for (size_t a = 1; a < arrays.size(); ++a) per.insert(arrays[a], out[a]);
    per.insert("step", torch::tensor(static_cast<float>(m->step() - 1)));
    state.insert(spec.name(), per);
  }
  const v1::OptimizerConfig& o = m->spec().optimizer();
  c10::impl::GenericDict opt = NewDict();
  opt.insert("kind", std::string(kernels::OptimizerName(*kind)));
  opt.insert("lr", static_cast<double>(o.lr()));
  opt.insert("beta1", static_cast<double>(o.beta1()));
  opt.insert("beta2", static_cast<double>(o.beta2()));
  opt.insert("eps", static_cast<double>(o.eps()));
  opt.insert("weight_decay", static_cast<double>(o.weight_decay()));
  opt.insert("momentum", static_cast<double>(o.momentum()));
  c10::impl::GenericDict root = NewDict();
  root.insert("job_name", m->job_name());
  root.insert("step", static_cast<int64_t>(m->step() - 1));
  root.insert("resume_step", static_cast<int64_t>(m->step()));
  root.insert("optimizer", opt);
  root.insert("params", params);
  root.insert("state", state);
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(root));
  return ckpt::WriteFileAtomically(out_path, absl::string_view(bytes.data(), bytes.size()));
}

}  // namespace

absl::Status ExportCheckpointToTorch(const std::string& checkpoint_dir,
                                     const std::string& out_path) {
  // libtorch reports by exception: converted here, at its only edge.
  try {
    return Export(checkpoint_dir, out_path);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("exporting ", checkpoint_dir, ": ", e.what()));
  }
}

}  // namespace optimus
