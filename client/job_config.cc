#include "client/job_config.h"

#include <fnmatch.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include <yaml-cpp/yaml.h>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/model_presets.h"

namespace optimus {
namespace client {
namespace {

// Reads one document; every error names source:line: field.
class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  absl::Status Error(const YAML::Node& at, absl::string_view field, absl::string_view what) const {
    const YAML::Mark m = at.Mark();
    const std::string where =
        m.is_null() ? source_ : absl::StrCat(source_, ":", m.line + 1);
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": ", field.empty() ? "" : absl::StrCat(field, ": "), what));
  }

  static std::string Describe(const YAML::Node& n) {
    if (n.IsScalar()) return absl::StrCat("'", n.Scalar(), "'");
    if (n.IsSequence()) return "a list";
    if (n.IsMap()) return "a mapping";
    return "nothing";
  }

  // A mapping whose keys must all be in `known`.
  absl::Status Map(const YAML::Node& n, absl::string_view field,
                   const std::vector<std::string>& known) const {
    if (!n.IsMap()) return Error(n, field, absl::StrCat("expected a mapping, got ", Describe(n)));
    std::set<std::string> seen;
    for (const auto& kv : n) {
      if (!kv.first.IsScalar()) return Error(kv.first, field, "keys must be plain names");
      const std::string key = kv.first.Scalar();
      const std::string path = field.empty() ? key : absl::StrCat(field, ".", key);
      if (std::find(known.begin(), known.end(), key) == known.end()) {
        return Error(kv.first, path,
                     absl::StrCat("unknown field (known here: ", absl::StrJoin(known, ", "), ")"));
      }
      if (!seen.insert(key).second) return Error(kv.first, path, "given twice");
    }
    return absl::OkStatus();
  }

  absl::StatusOr<double> Number(const YAML::Node& n, absl::string_view field) const {
    double v = 0;
    if (!n.IsScalar() || !absl::SimpleAtod(n.Scalar(), &v) || !std::isfinite(v)) {
      return Error(n, field, absl::StrCat("expected a number, got ", Describe(n)));
    }
    return v;
  }

  absl::StatusOr<float> NonNegative(const YAML::Node& n, absl::string_view field) const {
    auto v = Number(n, field);
    if (!v.ok()) return v.status();
    if (*v < 0) return Error(n, field, absl::StrCat("must be >= 0, got ", n.Scalar()));
    if (*v > std::numeric_limits<float>::max()) return Error(n, field, "too large");
    return static_cast<float>(*v);
  }

  absl::StatusOr<uint64_t> Count(const YAML::Node& n, absl::string_view field) const {
    uint64_t v = 0;
    if (!n.IsScalar() || !absl::SimpleAtoi(n.Scalar(), &v)) {
      return Error(n, field, absl::StrCat("expected a whole number >= 0, got ", Describe(n)));
    }
    return v;
  }

  // A byte count: 4194304, "4MiB", "4M", "512KiB", "512K".
  absl::StatusOr<uint64_t> Bytes(const YAML::Node& n, absl::string_view field) const {
    if (!n.IsScalar()) return Error(n, field, absl::StrCat("expected a size, got ", Describe(n)));
    std::string s = absl::AsciiStrToLower(n.Scalar());
    uint64_t mult = 1;
    for (const auto& [suffix, m] : std::vector<std::pair<std::string, uint64_t>>{
             {"kib", 1ull << 10}, {"mib", 1ull << 20}, {"gib", 1ull << 30},
             {"k", 1ull << 10}, {"m", 1ull << 20}, {"g", 1ull << 30}}) {
      if (s.size() > suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0) {
        s.resize(s.size() - suffix.size());
        mult = m;
        break;
      }
    }
    uint64_t v = 0;
    if (!absl::SimpleAtoi(s, &v) || v > std::numeric_limits<uint64_t>::max() / mult) {
      return Error(n, field,
                   absl::StrCat("expected a size (bytes, or with KiB/MiB/GiB), got ", Describe(n)));
    }
    return v * mult;
  }

  absl::StatusOr<bool> Bool(const YAML::Node& n, absl::string_view field) const {
    if (n.IsScalar()) {
      const std::string s = absl::AsciiStrToLower(n.Scalar());
      if (s == "true" || s == "yes" || s == "on") return true;
      if (s == "false" || s == "no" || s == "off") return false;
    }
    return Error(n, field, absl::StrCat("expected true or false, got ", Describe(n)));
  }

  absl::StatusOr<std::string> String(const YAML::Node& n, absl::string_view field) const {
    if (!n.IsScalar() || n.Scalar().empty()) {
      return Error(n, field, absl::StrCat("expected a non-empty string, got ", Describe(n)));
    }
    return n.Scalar();
  }

  absl::StatusOr<DType> Dtype(const YAML::Node& n, absl::string_view field) const {
    auto s = String(n, field);
    if (!s.ok()) return s.status();
    const std::string v = absl::AsciiStrToLower(*s);
    if (v == "bf16" || v == "bfloat16") return DType::kBf16;
    if (v == "fp16" || v == "float16" || v == "half") return DType::kFp16;
    if (v == "fp32" || v == "float32" || v == "float") return DType::kFp32;
    return Error(n, field, absl::StrCat("unknown dtype '", *s, "' (bf16, fp16 or fp32)"));
  }

  // [beta1, beta2].
  absl::Status Betas(const YAML::Node& n, absl::string_view field, float* b1, float* b2) const {
    if (!n.IsSequence() || n.size() != 2) {
      return Error(n, field, absl::StrCat("expected [beta1, beta2], got ", Describe(n)));
    }
    float* out[2] = {b1, b2};
    for (size_t i = 0; i < 2; ++i) {
      auto v = Number(n[i], absl::StrCat(field, "[", i, "]"));
      if (!v.ok()) return v.status();
      if (*v < 0 || *v >= 1) {
        return Error(n[i], absl::StrCat(field, "[", i, "]"),
                     absl::StrCat("must be in [0, 1), got ", n[i].Scalar()));
      }
      *out[i] = static_cast<float>(*v);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<std::string>> Patterns(const YAML::Node& n,
                                                    absl::string_view field) const {
    std::vector<std::string> out;
    if (n.IsScalar()) {
      out.push_back(n.Scalar());
    } else if (n.IsSequence()) {
      for (size_t i = 0; i < n.size(); ++i) {
        auto s = String(n[i], absl::StrCat(field, "[", i, "]"));
        if (!s.ok()) return s.status();
        out.push_back(*s);
      }
    }
    if (out.empty() || out[0].empty()) {
      return Error(n, field, "expected a name pattern or a list of them");
    }
    return out;
  }

 private:
  std::string source_;
};

#define OPTIMUS_ASSIGN(lhs, expr)        \
  do {                                   \
    auto _v = (expr);                    \
    if (!_v.ok()) return _v.status();    \
    lhs = *_v;                           \
  } while (0)
#define OPTIMUS_CHECK_OK(expr)             \
  do {                                     \
    absl::Status _s = (expr);              \
    if (!_s.ok()) return _s;               \
  } while (0)

absl::Status ReadOptimizer(const Reader& r, const YAML::Node& n, JobDef* def) {
  OPTIMUS_CHECK_OK(r.Map(n, "optimizer", {"type", "params"}));
  if (n["type"]) {
    std::string type;
    OPTIMUS_ASSIGN(type, r.String(n["type"], "optimizer.type"));
    const std::string t = absl::AsciiStrToLower(type);
    if (t == "adamw") {
      def->optimizer.kind = Optimizer::kAdamW;
    } else if (t == "adam") {
      def->optimizer.kind = Optimizer::kAdam;
    } else if (t == "sgd") {
      def->optimizer.kind = Optimizer::kSgd;
    } else if (t == "lion") {
      def->optimizer.kind = Optimizer::kLion;
    } else {
      return r.Error(n["type"], "optimizer.type",
                     absl::StrCat("unknown optimizer '", type, "' (adamw, adam, sgd or lion)"));
    }
  }
  if (!n["params"]) return absl::OkStatus();
  const YAML::Node p = n["params"];
  OPTIMUS_CHECK_OK(r.Map(p, "optimizer.params",
                         {"lr", "betas", "eps", "weight_decay", "momentum", "grad_scale"}));
  OptimizerSpec& o = def->optimizer;
  if (p["lr"]) OPTIMUS_ASSIGN(o.lr, r.NonNegative(p["lr"], "optimizer.params.lr"));
  if (p["betas"]) OPTIMUS_CHECK_OK(r.Betas(p["betas"], "optimizer.params.betas", &o.beta1, &o.beta2));
  if (p["eps"]) OPTIMUS_ASSIGN(o.eps, r.NonNegative(p["eps"], "optimizer.params.eps"));
  if (p["weight_decay"]) {
    OPTIMUS_ASSIGN(o.weight_decay, r.NonNegative(p["weight_decay"], "optimizer.params.weight_decay"));
  }
  if (p["momentum"]) OPTIMUS_ASSIGN(o.momentum, r.NonNegative(p["momentum"], "optimizer.params.momentum"));
  if (p["grad_scale"]) {
    OPTIMUS_ASSIGN(o.grad_scale, r.NonNegative(p["grad_scale"], "optimizer.params.grad_scale"));
  }
  return absl::OkStatus();
}

absl::Status ReadGroups(const Reader& r, const YAML::Node& n, JobConfig* c) {
  if (!n.IsSequence()) {
    return r.Error(n, "param_groups", absl::StrCat("expected a list, got ", Reader::Describe(n)));
  }
  std::set<std::string> names;
  bool have_default = false;
  for (size_t i = 0; i < n.size(); ++i) {
    const YAML::Node g = n[i];
    const std::string f = absl::StrCat("param_groups[", i, "]");
    OPTIMUS_CHECK_OK(
        r.Map(g, f, {"name", "match", "weight_decay", "lr_mult", "betas", "momentum"}));
    ParamGroup pg;
    if (g["name"]) {
      OPTIMUS_ASSIGN(pg.name, r.String(g["name"], f + ".name"));
    } else {
      pg.name = absl::StrCat("group", i);
    }
    if (!names.insert(pg.name).second) {
      return r.Error(g, f + ".name", absl::StrCat("two groups are named '", pg.name, "'"));
    }
    std::vector<std::string> match;
    if (g["match"]) {
      OPTIMUS_ASSIGN(match, r.Patterns(g["match"], f + ".match"));
    } else if (have_default) {
      return r.Error(g, f + ".match",
                     "only one group may leave out `match` (the default group)");
    } else {
      have_default = true;
    }
    if (g["weight_decay"]) {
      float v = 0;
      OPTIMUS_ASSIGN(v, r.NonNegative(g["weight_decay"], f + ".weight_decay"));
      pg.weight_decay = v;
    }
    if (g["lr_mult"]) {
      float v = 0;
      OPTIMUS_ASSIGN(v, r.NonNegative(g["lr_mult"], f + ".lr_mult"));
      pg.lr_mult = v;
    }
    if (g["betas"]) {
      float b1 = 0, b2 = 0;
      OPTIMUS_CHECK_OK(r.Betas(g["betas"], f + ".betas", &b1, &b2));
      pg.beta1 = b1;
      pg.beta2 = b2;
    }
    if (g["momentum"]) {
      float v = 0;
      OPTIMUS_ASSIGN(v, r.NonNegative(g["momentum"], f + ".momentum"));
      pg.momentum = v;
    }
    c->def.param_groups.push_back(std::move(pg));
    c->group_match.push_back(std::move(match));
  }
  return absl::OkStatus();
}

absl::Status ReadTensors(const Reader& r, const YAML::Node& n, JobConfig* c,
                         std::vector<std::pair<size_t, YAML::Node>>* group_refs) {
  if (!n.IsSequence()) {
    return r.Error(n, "tensors", absl::StrCat("expected a list, got ", Reader::Describe(n)));
  }
  std::set<std::string> names;
  for (size_t i = 0; i < n.size(); ++i) {
    const YAML::Node t = n[i];
    const std::string f = absl::StrCat("tensors[", i, "]");
    OPTIMUS_CHECK_OK(r.Map(t, f, {"name", "shape", "group", "frozen"}));
    TensorDef td;
    if (!t["name"]) return r.Error(t, f + ".name", "missing");
    OPTIMUS_ASSIGN(td.name, r.String(t["name"], f + ".name"));
    if (!names.insert(td.name).second) {
      return r.Error(t["name"], f + ".name", absl::StrCat("two tensors are named '", td.name, "'"));
    }
    if (!t["shape"] || !t["shape"].IsSequence() || t["shape"].size() == 0) {
      return r.Error(t["shape"] ? t["shape"] : t, f + ".shape",
                     "expected a non-empty list of dimensions, e.g. [1024, 768]");
    }
    for (size_t d = 0; d < t["shape"].size(); ++d) {
      uint64_t dim = 0;
      OPTIMUS_ASSIGN(dim, r.Count(t["shape"][d], absl::StrCat(f, ".shape[", d, "]")));
      if (dim == 0 || dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return r.Error(t["shape"][d], absl::StrCat(f, ".shape[", d, "]"), "must be >= 1");
      }
      td.shape.push_back(static_cast<int64_t>(dim));
    }
    if (t["frozen"]) OPTIMUS_ASSIGN(td.frozen, r.Bool(t["frozen"], f + ".frozen"));
    if (t["group"]) group_refs->emplace_back(c->def.tensors.size(), t["group"]);
    c->def.tensors.push_back(std::move(td));
  }
  c->has_tensors = true;
  return absl::OkStatus();
}

// `model: llama-7b`: the tensors of a preset (common/model_presets.h).
absl::Status ReadModel(const Reader& r, const YAML::Node& n, JobConfig* c) {
  std::string name;
  OPTIMUS_ASSIGN(name, r.String(n, "model"));
  absl::StatusOr<ModelPreset> preset = FindModelPreset(name);
  if (!preset.ok()) return r.Error(n, "model", preset.status().message());
  for (PresetTensor& t : preset->tensors) {
    TensorDef td;
    td.name = std::move(t.name);
    td.shape = std::move(t.shape);
    c->def.tensors.push_back(std::move(td));
  }
  c->model = preset->name;
  c->has_tensors = true;
  return absl::OkStatus();
}

absl::StatusOr<JobConfig> Read(const Reader& r, const YAML::Node& root) {
  JobConfig c;
  if (root.IsNull()) return r.Error(root, "", "the document is empty");
  OPTIMUS_CHECK_OK(r.Map(root, "",
                         {"name", "world_size", "optimizer", "gradient_clipping",
                          "skip_nonfinite", "dtypes", "chunk_payload_bytes", "max_chunk_bytes",
                          "replication", "checkpoint", "param_groups", "model", "tensors"}));
  JobDef& def = c.def;
  if (root["name"]) {
    OPTIMUS_ASSIGN(def.name, r.String(root["name"], "name"));
    c.has_name = true;
  }
  if (root["world_size"]) {
    uint64_t w = 0;
    OPTIMUS_ASSIGN(w, r.Count(root["world_size"], "world_size"));
    if (w == 0 || w > 65536) return r.Error(root["world_size"], "world_size", "must be 1..65536");
    def.world_size = static_cast<uint32_t>(w);
    c.has_world_size = true;
  }
  if (root["optimizer"]) OPTIMUS_CHECK_OK(ReadOptimizer(r, root["optimizer"], &def));
  if (root["gradient_clipping"]) {
    OPTIMUS_ASSIGN(def.max_grad_norm, r.NonNegative(root["gradient_clipping"], "gradient_clipping"));
  }
  if (root["skip_nonfinite"]) {
    OPTIMUS_ASSIGN(def.skip_nonfinite, r.Bool(root["skip_nonfinite"], "skip_nonfinite"));
  }
  if (root["dtypes"]) {
    const YAML::Node d = root["dtypes"];
    OPTIMUS_CHECK_OK(r.Map(d, "dtypes", {"grad", "param"}));
    if (d["grad"]) OPTIMUS_ASSIGN(def.grad_dtype, r.Dtype(d["grad"], "dtypes.grad"));
    if (d["param"]) OPTIMUS_ASSIGN(def.param_dtype, r.Dtype(d["param"], "dtypes.param"));
  }
  if (root["chunk_payload_bytes"]) {
    OPTIMUS_ASSIGN(def.chunk_payload_bytes, r.Bytes(root["chunk_payload_bytes"], "chunk_payload_bytes"));
  }
  if (root["max_chunk_bytes"]) {
    OPTIMUS_ASSIGN(def.max_chunk_bytes, r.Bytes(root["max_chunk_bytes"], "max_chunk_bytes"));
  }
  if (root["replication"]) {
    uint64_t rep = 0;
    OPTIMUS_ASSIGN(rep, r.Count(root["replication"], "replication"));
    if (rep > 1) return r.Error(root["replication"], "replication", "must be 0 or 1");
    def.replication = static_cast<uint32_t>(rep);
  }
  if (root["checkpoint"]) {
    const YAML::Node k = root["checkpoint"];
    OPTIMUS_CHECK_OK(r.Map(k, "checkpoint", {"every_steps", "every_seconds", "keep_last"}));
    if (k["every_steps"]) {
      OPTIMUS_ASSIGN(def.checkpoint.every_steps, r.Count(k["every_steps"], "checkpoint.every_steps"));
    }
    if (k["every_seconds"]) {
      OPTIMUS_ASSIGN(def.checkpoint.every_seconds,
                     r.Count(k["every_seconds"], "checkpoint.every_seconds"));
    }
    if (k["keep_last"]) {
      uint64_t keep = 0;
      OPTIMUS_ASSIGN(keep, r.Count(k["keep_last"], "checkpoint.keep_last"));
      if (keep > 1000) return r.Error(k["keep_last"], "checkpoint.keep_last", "must be <= 1000");
      def.checkpoint.keep_last = static_cast<uint32_t>(keep);
    }
  }
  if (root["param_groups"]) OPTIMUS_CHECK_OK(ReadGroups(r, root["param_groups"], &c));
  std::vector<std::pair<size_t, YAML::Node>> group_refs;
  if (root["model"] && root["tensors"]) {
    return r.Error(root["tensors"], "tensors",
                   "give either `model` (a preset) or `tensors`, not both");
  }
  if (root["model"]) OPTIMUS_CHECK_OK(ReadModel(r, root["model"], &c));
  if (root["tensors"]) OPTIMUS_CHECK_OK(ReadTensors(r, root["tensors"], &c, &group_refs));
  c.tensor_group_set.assign(def.tensors.size(), false);
  for (const auto& [t, node] : group_refs) {
    const std::string f = absl::StrCat("tensors[", t, "].group");
    uint32_t g = 0;
    bool found = false;
    for (uint32_t i = 0; i < def.param_groups.size(); ++i) {
      if (node.IsScalar() && def.param_groups[i].name == node.Scalar()) {
        g = i;
        found = true;
      }
    }
    if (!found) {
      std::vector<std::string> known;
      for (const auto& pg : def.param_groups) known.push_back(pg.name);
      return r.Error(node, f,
                     absl::StrCat("no parameter group named ", Reader::Describe(node),
                                  known.empty() ? " (param_groups is empty)"
                                                : absl::StrCat(" (groups: ", absl::StrJoin(known, ", "), ")")));
    }
    def.tensors[t].group = g;
    c.tensor_group_set[t] = true;
  }
  return c;
}

#undef OPTIMUS_ASSIGN
#undef OPTIMUS_CHECK_OK

}  // namespace

bool GlobMatch(absl::string_view pattern, absl::string_view name) {
  return fnmatch(std::string(pattern).c_str(), std::string(name).c_str(), 0) == 0;
}

absl::StatusOr<JobConfig> ParseJobConfig(absl::string_view text, absl::string_view source) {
  Reader r{std::string(source)};
  YAML::Node root;
  try {
    root = YAML::Load(std::string(text));
  } catch (const YAML::Exception& e) {
    const std::string where =
        e.mark.is_null() ? std::string(source) : absl::StrCat(source, ":", e.mark.line + 1);
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": not valid YAML or JSON: ", e.msg));
  }
  try {
    return Read(r, root);
  } catch (const YAML::Exception& e) {  // Defensive: a conversion we missed.
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", e.what()));
  }
}

absl::StatusOr<JobConfig> LoadJobConfig(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read job spec ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading job spec ", path));
  return ParseJobConfig(ss.str(), path);
}

absl::Status AssignGroups(const JobConfig& config, JobDef* def) {
  if (config.group_match.empty()) return absl::OkStatus();
  if (def->param_groups.empty()) def->param_groups = config.def.param_groups;
  int default_group = -1;
  for (size_t g = 0; g < config.group_match.size(); ++g) {
    if (config.group_match[g].empty()) default_group = static_cast<int>(g);
  }
  std::vector<size_t> hits(config.group_match.size(), 0);
  bool need_default = false;
  for (size_t t = 0; t < def->tensors.size(); ++t) {
    TensorDef& td = def->tensors[t];
    // A tensor listed in the config with an explicit group keeps it.
    if (t < config.tensor_group_set.size() && config.tensor_group_set[t] &&
        config.has_tensors && config.def.tensors[t].name == td.name) {
      ++hits[td.group];
      continue;
    }
    int chosen = -1;
    for (size_t g = 0; g < config.group_match.size() && chosen < 0; ++g) {
      for (const std::string& p : config.group_match[g]) {
        if (GlobMatch(p, td.name)) {
          chosen = static_cast<int>(g);
          break;
        }
      }
    }
    if (chosen < 0) {
      if (default_group < 0) {
        need_default = true;
        td.group = static_cast<uint32_t>(config.group_match.size());
        continue;
      }
      chosen = default_group;
    }
    ++hits[chosen];
    td.group = static_cast<uint32_t>(chosen);
  }
  for (size_t g = 0; g < config.group_match.size(); ++g) {
    if (!config.group_match[g].empty() && hits[g] == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter group '", def->param_groups[g].name, "' matches no tensor (patterns: ",
          absl::StrJoin(config.group_match[g], ", "), ")"));
    }
  }
  if (need_default) {
    ParamGroup d;
    d.name = "default";
    for (const auto& pg : def->param_groups) {
      if (pg.name == d.name) {
        return absl::InvalidArgumentError(
            "some tensors match no parameter group, and the group that would take them, "
            "'default', is already a group with patterns: add a group without `match`");
      }
    }
    def->param_groups.push_back(d);
  }
  return absl::OkStatus();
}

}  // namespace client
}  // namespace optimus
