// Job specs as files: a JSON or YAML document describing a job (optimizer,
// parameter groups, clipping, dtypes, replication, checkpoints, and
// optionally its tensors or a model preset), read into a client::JobDef.
// The one parser for the project: trainers (client::JoinOrCreate, the
// Python package) and operators' tools use it. The schema is in
// docs/job-spec.md.
//
// Errors name the source, the line and the field:
//   "train.yaml:7: optimizer.params.lr: expected a number, got 'fast'"
// Unknown fields are errors (a misspelt key never silently does nothing).
#ifndef OPTIMUS_CLIENT_JOB_CONFIG_H_
#define OPTIMUS_CLIENT_JOB_CONFIG_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "client/client.h"

namespace optimus {
namespace client {

struct JobConfig {
  // Everything the document sets; what it does not set keeps JobDef's
  // defaults. def.tensors is filled only from a `tensors:` list or a
  // `model:` preset (a trainer takes its tensors from its model instead:
  // AssignGroups).
  JobDef def;
  // Per entry of def.param_groups, the tensor-name patterns of its `match:`
  // list (shell globs: `*`, `?`, `[...]`, matched against the whole name).
  // A group without patterns is the default group, which tensors matching
  // no other group join; with no such group, one named "default" with the
  // optimizer's own settings is added at the end when some tensor needs it.
  std::vector<std::vector<std::string>> group_match;
  // Per entry of def.tensors: whether its `group:` was given (AssignGroups
  // keeps it).
  std::vector<bool> tensor_group_set;
  // The preset the document's `model:` named (its canonical name, e.g.
  // "llama-7b"; def.tensors then holds the preset's tensors); empty when
  // none.
  std::string model;
  // Whether the document set these (a trainer's own values apply otherwise).
  bool has_name = false;
  bool has_world_size = false;
  bool has_tensors = false;
};

// Parses a job spec. JSON documents are read as YAML (JSON is YAML's flow
// style), so both formats give the same errors with line numbers. `source`
// names the document in errors (a file name, "<inline>").
absl::StatusOr<JobConfig> ParseJobConfig(absl::string_view text, absl::string_view source);

// Reads and parses the file at `path`.
absl::StatusOr<JobConfig> LoadJobConfig(const std::string& path);

// Sets each tensor's group from config.group_match (first group whose
// pattern matches the tensor's name, else the default group) and, when a
// default group has to be added, adds it to def->param_groups. A `tensors:`
// entry's explicit `group:` is kept. No groups in the config: every tensor
// in group 0, def->param_groups left empty. INVALID_ARGUMENT when a
// pattern list matches no tensor at all (a typo would otherwise put every
// tensor in the default group silently).
absl::Status AssignGroups(const JobConfig& config, JobDef* def);

// Whether `name` matches the shell glob `pattern` (whole string).
bool GlobMatch(absl::string_view pattern, absl::string_view name);

}  // namespace client
}  // namespace optimus

#endif  // OPTIMUS_CLIENT_JOB_CONFIG_H_
