#include "kernels/optimizer_spec.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace optimus {
namespace kernels {
namespace {

const StateLayout kAdamLayout = {3, {"master", "exp_avg", "exp_avg_sq"}};
const StateLayout kSgdLayout = {2, {"master", "momentum_buffer", nullptr}};
const StateLayout kLionLayout = {2, {"master", "exp_avg", nullptr}};

bool FiniteNonNegative(float x) { return x >= 0 && std::isfinite(x); }
bool UnitInterval(float x) { return x >= 0 && x < 1; }

}  // namespace

absl::StatusOr<OptimizerKind> OptimizerKindFromInt(int value) {
  switch (value) {
    case 1: return OptimizerKind::kAdamW;
    case 2: return OptimizerKind::kAdam;
    case 3: return OptimizerKind::kSgd;
    case 4: return OptimizerKind::kLion;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("unknown optimizer kind ", value, " (ADAMW, ADAM, SGD or LION)"));
  }
}

absl::string_view OptimizerName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW: return "adamw";
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kSgd: return "sgd";
    case OptimizerKind::kLion: return "lion";
  }
  return "unknown";
}

OptimizerHyper DefaultHyper(OptimizerKind kind) {
  OptimizerHyper h;
  h.kind = kind;
  switch (kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam:
      h.beta1 = 0.9f;
      h.beta2 = 0.999f;
      h.eps = 1e-8f;
      break;
    case OptimizerKind::kLion:
      h.beta1 = 0.9f;
      h.beta2 = 0.99f;
      h.eps = 0.0f;
      break;
    case OptimizerKind::kSgd:
      h.beta1 = 0.0f;
      h.beta2 = 0.0f;
      h.eps = 0.0f;
      break;
  }
  return h;
}

absl::Status FillDefaultsAndValidate(OptimizerHyper* hyper) {
  const OptimizerHyper d = DefaultHyper(hyper->kind);
  if (hyper->lr == 0) hyper->lr = d.lr;
  if (hyper->beta1 == 0) hyper->beta1 = d.beta1;
  if (hyper->beta2 == 0) hyper->beta2 = d.beta2;
  if (hyper->eps == 0) hyper->eps = d.eps;
  auto invalid = [](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("optimizer.", what));
  };
  if (!(hyper->lr > 0) || !std::isfinite(hyper->lr)) {
    return invalid(absl::StrCat("lr must be positive and finite, got ", hyper->lr));
  }
  if (!FiniteNonNegative(hyper->weight_decay)) return invalid("weight_decay must be >= 0 and finite");
  if (!UnitInterval(hyper->momentum)) return invalid("momentum must be in [0, 1)");
  if (!UnitInterval(hyper->beta1)) return invalid("beta1 must be in [0, 1)");
  if (!UnitInterval(hyper->beta2)) return invalid("beta2 must be in [0, 1)");
  if (!FiniteNonNegative(hyper->eps)) return invalid("eps must be >= 0 and finite");
  return absl::OkStatus();
}

absl::Status ValidateGroupOverrides(const GroupOverrides& group, absl::string_view where) {
  auto invalid = [&](absl::string_view field, float value, absl::string_view rule) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ".", field, " must be ", rule, ", got ", value));
  };
  if (group.weight_decay.has_value() && !FiniteNonNegative(*group.weight_decay)) {
    return invalid("weight_decay", *group.weight_decay, ">= 0 and finite");
  }
  if (group.lr_mult.has_value() && (!(*group.lr_mult > 0) || !std::isfinite(*group.lr_mult))) {
    return invalid("lr_mult", *group.lr_mult, "positive and finite");
  }
  if (group.beta1.has_value() && !UnitInterval(*group.beta1)) {
    return invalid("beta1", *group.beta1, "in [0, 1)");
  }
  if (group.beta2.has_value() && !UnitInterval(*group.beta2)) {
    return invalid("beta2", *group.beta2, "in [0, 1)");
  }
  if (group.momentum.has_value() && !UnitInterval(*group.momentum)) {
    return invalid("momentum", *group.momentum, "in [0, 1)");
  }
  return absl::OkStatus();
}

OptimizerHyper WithGroupOverrides(OptimizerHyper base, const GroupOverrides& group) {
  if (group.weight_decay) base.weight_decay = *group.weight_decay;
  if (group.beta1) base.beta1 = *group.beta1;
  if (group.beta2) base.beta2 = *group.beta2;
  if (group.momentum) base.momentum = *group.momentum;
  return base;
}

const StateLayout& LayoutOf(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW:
    case OptimizerKind::kAdam: return kAdamLayout;
    case OptimizerKind::kSgd: return kSgdLayout;
    case OptimizerKind::kLion: return kLionLayout;
  }
  return kAdamLayout;
}

bool FoldsGradients(uint32_t world_size, DType grad_dtype) {
  return uint64_t{world_size} * DTypeSize(grad_dtype) > 4;
}

uint64_t GradHoldBytesPerElem(uint32_t world_size, DType grad_dtype) {
  return FoldsGradients(world_size, grad_dtype) ? 4 : uint64_t{world_size} * DTypeSize(grad_dtype);
}

uint64_t ShardBytesPerElem(OptimizerKind kind, uint32_t world_size, DType grad_dtype,
                           DType param_dtype, bool replicated, bool holds_grads) {
  return LayoutOf(kind).bytes_per_elem() +
         2 * DTypeSize(param_dtype) /* published versions v and v+1 */ +
         (replicated ? 4 : 0) /* fp32 gradient sum forwarded to the backup */ +
         (holds_grads ? GradHoldBytesPerElem(world_size, grad_dtype) : 0);
}

}  // namespace kernels
}  // namespace optimus
