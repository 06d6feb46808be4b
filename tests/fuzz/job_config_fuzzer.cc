// Fuzz target: job spec files (client/job_config.h), the YAML or JSON a
// trainer or an operator hands to optimus. Checks that any document is
// either read or refused with INVALID_ARGUMENT naming the source (never a
// crash, an uncaught yaml-cpp exception or a runaway recursion), and that
// what is read is consistent: explicit tensor groups name a group, and
// AssignGroups leaves every tensor in a group that exists.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "client/job_config.h"

namespace {

void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "job_config_fuzzer: invariant broken: %s\n", what);
    std::abort();
  }
}

// Tensors of a model the document does not list (what a trainer brings).
optimus::client::JobDef ModelTensors() {
  optimus::client::JobDef def;
  for (const char* name : {"embed.weight", "layers.0.attn.qkv.weight", "layers.0.attn.qkv.bias",
                           "layers.0.norm.weight", "head.weight"}) {
    optimus::client::TensorDef t;
    t.name = name;
    t.shape = {4, 4};
    def.tensors.push_back(t);
  }
  return def;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<optimus::client::JobConfig> c = optimus::client::ParseJobConfig(text, "fuzz.yaml");
  if (!c.ok()) {
    Require(c.status().code() == absl::StatusCode::kInvalidArgument,
            "a bad document is INVALID_ARGUMENT");
    Require(absl::StartsWith(c.status().message(), "fuzz.yaml"), "errors name the source");
    return 0;
  }
  const optimus::client::JobDef& def = c->def;
  Require(c->group_match.size() == def.param_groups.size(), "one pattern list per group");
  Require(c->tensor_group_set.size() == def.tensors.size(), "one group flag per tensor");
  for (size_t t = 0; t < def.tensors.size(); ++t) {
    if (c->tensor_group_set[t]) {
      Require(def.tensors[t].group < def.param_groups.size(), "an explicit group exists");
    }
  }
  // The tensors as the document lists them, or as a model brings them.
  optimus::client::JobDef target = c->has_tensors ? def : ModelTensors();
  if (c->has_tensors) target.param_groups.clear();
  if (optimus::client::AssignGroups(*c, &target).ok() && !c->group_match.empty()) {
    for (const optimus::client::TensorDef& t : target.tensors) {
      Require(t.group < target.param_groups.size(), "every tensor is in a group that exists");
    }
  }
  return 0;
}
