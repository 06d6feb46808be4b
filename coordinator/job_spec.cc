#include "coordinator/job_spec.h"

#include <cmath>
#include <set>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "coordinator/shard_map.h"
#include "kernels/optimizer_spec.h"

namespace optimus {
namespace {

// 2^56 elements is far beyond any model, and keeps every byte count derived
// from it (elements * bytes per element) inside 64 bits.
constexpr uint64_t kMaxJobElems = uint64_t{1} << 56;

// Every worker costs an aggregation slot per chunk on the shards; a million
// is beyond any cluster and keeps world_size * dtype bytes a small int.
constexpr uint32_t kMaxWorldSize = 1 << 20;

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("invalid job spec: ", what));
}

// The optimizer's fields: kind and lr are the caller's to choose (a silent
// default learning rate would surprise); the rest is filled and checked by
// kernels::FillDefaultsAndValidate, the one place defaults live.
absl::Status CheckOptimizer(v1::OptimizerConfig& opt, uint32_t world_size) {
  absl::StatusOr<kernels::OptimizerKind> kind = kernels::OptimizerKindFromInt(opt.kind());
  if (!kind.ok()) return Invalid("optimizer.kind must be ADAMW, ADAM, SGD or LION");
  if (!(opt.lr() > 0) || !std::isfinite(opt.lr())) {
    return Invalid(absl::StrCat("optimizer.lr must be positive and finite, got ", opt.lr()));
  }
  if (!(opt.grad_scale() >= 0) || !std::isfinite(opt.grad_scale())) {
    return Invalid("optimizer.grad_scale must be >= 0 and finite (0: 1/world_size)");
  }
  kernels::OptimizerHyper h;
  h.kind = *kind;
  h.lr = opt.lr();
  h.beta1 = opt.beta1();
  h.beta2 = opt.beta2();
  h.eps = opt.eps();
  h.weight_decay = opt.weight_decay();
  h.momentum = opt.momentum();
  if (absl::Status s = kernels::FillDefaultsAndValidate(&h); !s.ok()) return Invalid(s.message());
  opt.set_beta1(h.beta1);
  opt.set_beta2(h.beta2);
  opt.set_eps(h.eps);
  opt.set_weight_decay(h.weight_decay);
  opt.set_momentum(h.momentum);
  if (opt.grad_scale() == 0) opt.set_grad_scale(1.0f / static_cast<float>(world_size));
  return absl::OkStatus();
}

// Parameter groups: each in range (kernels::ValidateGroupOverrides), names
// not repeated (an empty one may be), and every tensor naming one that exists.
absl::Status CheckGroups(const v1::JobSpec& spec) {
  std::set<std::string> names;
  for (int g = 0; g < spec.param_groups_size(); ++g) {
    const v1::ParamGroup& group = spec.param_groups(g);
    const std::string where = absl::StrCat("param_groups[", g, "]");
    if (!group.name().empty() && !names.insert(group.name()).second) {
      return Invalid(absl::StrCat(where, ".name \"", group.name(), "\" is used twice"));
    }
    kernels::GroupOverrides o;
    if (group.has_weight_decay()) o.weight_decay = group.weight_decay();
    if (group.has_lr_mult()) o.lr_mult = group.lr_mult();
    if (group.has_beta1()) o.beta1 = group.beta1();
    if (group.has_beta2()) o.beta2 = group.beta2();
    if (group.has_momentum()) o.momentum = group.momentum();
    if (absl::Status s = kernels::ValidateGroupOverrides(o, where); !s.ok()) {
      return Invalid(s.message());
    }
  }
  for (const v1::TensorSpec& tensor : spec.tensors()) {
    if (spec.param_groups_size() == 0 && tensor.group() != 0) {
      return Invalid(absl::StrCat("tensor \"", tensor.name(), "\" has group ", tensor.group(),
                                  " but the job has no param_groups (group must be 0)"));
    }
    if (spec.param_groups_size() > 0 &&
        tensor.group() >= static_cast<uint32_t>(spec.param_groups_size())) {
      return Invalid(absl::StrCat("tensor \"", tensor.name(), "\" has group ", tensor.group(),
                                  " but the job has ", spec.param_groups_size(),
                                  " param_groups"));
    }
  }
  if (!(spec.max_grad_norm() >= 0) || !std::isfinite(spec.max_grad_norm())) {
    return Invalid(absl::StrCat("max_grad_norm must be >= 0 and finite (0: no clipping), got ",
                                spec.max_grad_norm()));
  }
  return absl::OkStatus();
}

absl::Status OverQuota(absl::string_view what) {
  return absl::ResourceExhaustedError(absl::StrCat("job quota: ", what));
}

}  // namespace

uint64_t StateBytesPerElemOf(v1::OptimizerKind kind) {
  absl::StatusOr<kernels::OptimizerKind> k = kernels::OptimizerKindFromInt(kind);
  return k.ok() ? kernels::LayoutOf(*k).bytes_per_elem() : 0;
}

absl::StatusOr<CheckedSpec> CheckAndFillSpec(v1::JobSpec& spec, const JobLimits& limits) {
  if (spec.name().empty()) return Invalid("name is empty");
  if (spec.world_size() < 1) return Invalid("world_size must be >= 1");
  if (spec.replication() > 1) {
    return Invalid(absl::StrCat("replication must be 0 or 1 (backups per chunk), got ",
                                spec.replication()));
  }
  if (spec.world_size() > kMaxWorldSize) {
    return Invalid(absl::StrCat("world_size must be <= ", kMaxWorldSize));
  }
  if (spec.tensors_size() < 1) return Invalid("at least one tensor is required");
  if (static_cast<uint64_t>(spec.tensors_size()) > limits.max_tensors) {
    return OverQuota(absl::StrCat("the job declares ", spec.tensors_size(),
                                  " tensors, more than the ", limits.max_tensors,
                                  " allowed (optimus-coord --max_tensors_per_job)"));
  }
  CheckedSpec out;
  std::set<std::string> names;
  for (int t = 0; t < spec.tensors_size(); ++t) {
    const v1::TensorSpec& tensor = spec.tensors(t);
    if (tensor.name().empty()) return Invalid(absl::StrCat("tensor ", t, " has an empty name"));
    if (!names.insert(tensor.name()).second) {
      return Invalid(absl::StrCat("tensor name \"", tensor.name(), "\" is used twice"));
    }
    // An empty shape is a scalar: one element.
    uint64_t n = 1;
    for (int64_t dim : tensor.shape()) {
      if (dim <= 0) {
        return Invalid(absl::StrCat("tensor \"", tensor.name(), "\" has dimension ", dim,
                                    "; every dimension must be positive"));
      }
      if (__builtin_mul_overflow(n, static_cast<uint64_t>(dim), &n) || n > kMaxJobElems) {
        return Invalid(absl::StrCat("tensor \"", tensor.name(), "\" is too large"));
      }
    }
    out.num_params += n;
    if (out.num_params > kMaxJobElems) return Invalid("the job has too many elements");
    out.tensor_num_elems.push_back(n);
  }
  absl::StatusOr<DType> grad = DTypeFromInt(spec.grad_dtype());
  if (spec.grad_dtype() == v1::DTYPE_UNSPECIFIED || !grad.ok()) {
    return Invalid("grad_dtype must be FP32, BF16 or FP16");
  }
  absl::StatusOr<DType> param = DTypeFromInt(spec.param_dtype());
  if (spec.param_dtype() == v1::DTYPE_UNSPECIFIED || !param.ok()) {
    return Invalid("param_dtype must be FP32, BF16 or FP16");
  }
  if (absl::Status s = CheckOptimizer(*spec.mutable_optimizer(), spec.world_size()); !s.ok()) {
    return s;
  }
  if (absl::Status s = CheckGroups(spec); !s.ok()) return s;
  if (spec.max_chunk_bytes() == 0) {
    // Sized for the wire: chunk_payload_bytes of pushed gradient.
    if (spec.chunk_payload_bytes() == 0) spec.set_chunk_payload_bytes(kDefaultChunkPayloadBytes);
    const uint64_t elems = spec.chunk_payload_bytes() / DTypeSize(*grad);
    if (elems == 0) {
      return Invalid(absl::StrCat("chunk_payload_bytes must be 0 (4 MiB) or at least ",
                                  DTypeSize(*grad), " (one ", DTypeName(*grad), " element)"));
    }
    spec.set_max_chunk_bytes(elems * 4);
  }
  if (spec.max_chunk_bytes() < 4) {
    return Invalid("max_chunk_bytes must be 0 (from chunk_payload_bytes) or at least 4 (one fp32 element)");
  }
  const uint64_t max_chunk_elems = spec.max_chunk_bytes() / 4;
  uint64_t num_chunks = 0;
  for (uint64_t n : out.tensor_num_elems) num_chunks += (n + max_chunk_elems - 1) / max_chunk_elems;
  if (num_chunks > limits.max_chunks) {
    return OverQuota(absl::StrCat("the job would have ", num_chunks, " chunks, more than the ",
                                  limits.max_chunks,
                                  " allowed (optimus-coord --max_chunks_per_job); raise "
                                  "max_chunk_bytes"));
  }
  out.num_chunks = num_chunks;
  const kernels::OptimizerKind kind = *kernels::OptimizerKindFromInt(spec.optimizer().kind());
  // A step that waits for a worker's commit (clipping, or skipping
  // non-finite steps) holds every chunk's gradients until then.
  const bool holds_grads = spec.max_grad_norm() > 0 || !spec.keep_nonfinite();
  out.bytes_per_elem = kernels::ShardBytesPerElem(kind, spec.world_size(), *grad, *param,
                                                  /*replicated=*/spec.replication() > 0,
                                                  holds_grads);
  out.state_bytes_per_elem = kernels::LayoutOf(kind).bytes_per_elem();
  // Below 2^64: elements < 2^56, bytes per element and copies small.
  const uint64_t copies = spec.replication() > 0 ? 2 : 1;
  out.chunk_overhead_bytes = kernels::ChunkOverheadBytes(spec.world_size());
  out.shard_bytes = copies * (out.num_params * out.bytes_per_elem +
                              num_chunks * out.chunk_overhead_bytes);
  if (limits.max_job_bytes > 0 && out.shard_bytes > limits.max_job_bytes) {
    return OverQuota(absl::StrCat("the job would take ", out.shard_bytes,
                                  " bytes of shard memory (", copies, " cop",
                                  copies > 1 ? "ies" : "y", " of ", out.num_params,
                                  " elements and ", num_chunks, " chunks), more than the ",
                                  limits.max_job_bytes,
                                  " allowed (optimus-coord --max_job_bytes)"));
  }
  return out;
}

}  // namespace optimus
