#include "cli/plan_command.h"

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "client/job_config.h"
#include "common/model_presets.h"

namespace optimus {
namespace plan {
namespace {

using Json = nlohmann::ordered_json;

// What the flags hold until the command runs; owned by the callback.
struct PlanFlags {
  std::string model;
  std::string model_file;
  std::string params;
  uint32_t dp = 1, tp = 1, pp = 1, zero = 0;
  std::string optimizer = "adamw";
  std::string param_dtype = "bf16", grad_dtype = "bf16", master_dtype = "fp32";
  uint32_t gpus_per_node = 8;
  std::string gpu_memory = "80GiB";
  std::string dpu_memory = "26000MiB";  // A BlueField-3's budget (docs/operations.md).
  uint32_t dpu_cores = 16;
  std::string host_memory = "0";
  uint32_t host_cores = 32;
  uint32_t replication = 0;
  bool skip_nonfinite = true;
  double max_grad_norm = 0;
  std::string chunk_payload_bytes = "4MiB";
  std::string kernel_bench;
  std::string output = "table";

  // Set when the command's options are added.
  CLI::Option* model_opt = nullptr;
  CLI::Option* model_file_opt = nullptr;
  CLI::Option* params_opt = nullptr;
  CLI::Option* dp_opt = nullptr;
  CLI::Option* optimizer_opt = nullptr;
  CLI::Option* param_dtype_opt = nullptr;
  CLI::Option* grad_dtype_opt = nullptr;
  CLI::Option* replication_opt = nullptr;
  CLI::Option* skip_nonfinite_opt = nullptr;
  CLI::Option* max_grad_norm_opt = nullptr;
  CLI::Option* chunk_opt = nullptr;
};

// A failure with the exit code it gets: 2 usage, 1 anything else.
struct Failure {
  int code;
  std::string message;
};

absl::StatusOr<kernels::OptimizerKind> OptimizerFromName(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  if (n == "adamw") return kernels::OptimizerKind::kAdamW;
  if (n == "adam") return kernels::OptimizerKind::kAdam;
  if (n == "sgd") return kernels::OptimizerKind::kSgd;
  if (n == "lion") return kernels::OptimizerKind::kLion;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer '", name, "' (adamw, adam, sgd or lion)"));
}

kernels::OptimizerKind FromClient(client::Optimizer o) {
  switch (o) {
    case client::Optimizer::kAdamW: return kernels::OptimizerKind::kAdamW;
    case client::Optimizer::kAdam: return kernels::OptimizerKind::kAdam;
    case client::Optimizer::kSgd: return kernels::OptimizerKind::kSgd;
    case client::Optimizer::kLion: return kernels::OptimizerKind::kLion;
  }
  return kernels::OptimizerKind::kAdamW;
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading ", path));
  return ss.str();
}

// The PlanInput the flags describe, or why not.
absl::StatusOr<PlanInput> BuildInput(const PlanFlags& f, Failure* failure) {
  auto usage = [&](std::string message) {
    *failure = {2, std::move(message)};
    return absl::InvalidArgumentError(failure->message);
  };
  auto fail = [&](std::string message) {
    *failure = {1, std::move(message)};
    return absl::FailedPreconditionError(failure->message);
  };
  PlanInput in;
  const int sources = static_cast<int>(f.model_opt->count() > 0) +
                      static_cast<int>(f.model_file_opt->count() > 0) +
                      static_cast<int>(f.params_opt->count() > 0);
  if (sources != 1) {
    return usage("give the model with one of --model NAME, --model_file FILE or --params N");
  }
  // Settings a job spec file may carry; flags given on the command line win.
  if (f.model_opt->count() > 0) {
    absl::StatusOr<ModelPreset> preset = FindModelPreset(f.model);
    if (!preset.ok()) return usage(absl::StrCat("--model: ", preset.status().message()));
    in.model_name = preset->name;
    for (const PresetTensor& t : preset->tensors) in.tensor_num_elems.push_back(t.num_elems());
  } else if (f.params_opt->count() > 0) {
    absl::StatusOr<uint64_t> n = ParseParamCount(f.params);
    if (!n.ok()) return usage(absl::StrCat("--params: ", n.status().message()));
    in.model_name = absl::StrCat(f.params, " parameters (--params)");
    in.num_params = *n;
  }
  in.dp = f.dp;
  in.tp = f.tp;
  in.pp = f.pp;
  in.zero_stage = f.zero;
  in.replication = f.replication;
  in.holds_grads = f.skip_nonfinite || f.max_grad_norm > 0;
  absl::StatusOr<kernels::OptimizerKind> kind = OptimizerFromName(f.optimizer);
  if (!kind.ok()) return usage(absl::StrCat("--optimizer: ", kind.status().message()));
  in.optimizer = *kind;
  struct DtypeFlag {
    const char* flag;
    const std::string* value;
    DType* out;
  };
  for (const DtypeFlag& d : {DtypeFlag{"--param_dtype", &f.param_dtype, &in.param_dtype},
                             DtypeFlag{"--grad_dtype", &f.grad_dtype, &in.grad_dtype}}) {
    absl::StatusOr<DType> t = DTypeFromName(absl::AsciiStrToLower(*d.value));
    if (!t.ok()) return usage(absl::StrCat(d.flag, ": unknown dtype '", *d.value, "' (bf16, fp16 or fp32)"));
    *d.out = *t;
  }
  if (absl::AsciiStrToLower(f.master_dtype) == "none") {
    in.master_dtype.reset();
  } else {
    absl::StatusOr<DType> t = DTypeFromName(absl::AsciiStrToLower(f.master_dtype));
    if (!t.ok()) {
      return usage(absl::StrCat("--master_dtype: unknown dtype '", f.master_dtype,
                                "' (fp32, bf16, fp16 or none)"));
    }
    in.master_dtype = *t;
  }
  in.gpus_per_node = f.gpus_per_node;
  in.dpu_cores = f.dpu_cores;
  in.host_cores = f.host_cores;
  struct SizeFlag {
    const char* flag;
    const std::string* value;
    uint64_t* out;
  };
  for (const SizeFlag& s : {SizeFlag{"--gpu_memory", &f.gpu_memory, &in.gpu_memory_bytes},
                            SizeFlag{"--dpu_memory", &f.dpu_memory, &in.dpu_memory_bytes},
                            SizeFlag{"--host_memory", &f.host_memory, &in.host_memory_bytes},
                            SizeFlag{"--chunk_payload_bytes", &f.chunk_payload_bytes,
                                     &in.chunk_payload_bytes}}) {
    absl::StatusOr<uint64_t> b = ParseByteSize(*s.value);
    if (!b.ok()) return usage(absl::StrCat(s.flag, ": ", b.status().message()));
    *s.out = *b;
  }
  if (f.model_file_opt->count() > 0) {
    absl::StatusOr<client::JobConfig> c = client::LoadJobConfig(f.model_file);
    if (!c.ok()) return fail(absl::StrCat("--model_file: ", c.status().message()));
    if (!c->has_tensors) {
      return fail(absl::StrCat("--model_file: ", f.model_file,
                               " lists no `tensors` and names no `model` (docs/job-spec.md)"));
    }
    in.model_name = c->model.empty() ? f.model_file : absl::StrCat(f.model_file, " (", c->model, ")");
    for (const client::TensorDef& t : c->def.tensors) {
      uint64_t n = 1;
      for (int64_t d : t.shape) {
        if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) {
          return fail(absl::StrCat("--model_file: tensor '", t.name, "' has more than 2^64 elements"));
        }
      }
      in.tensor_num_elems.push_back(n);
    }
    const client::JobDef& def = c->def;
    if (f.dp_opt->count() == 0 && c->has_world_size) in.dp = def.world_size;
    if (f.optimizer_opt->count() == 0) in.optimizer = FromClient(def.optimizer.kind);
    if (f.param_dtype_opt->count() == 0) in.param_dtype = def.param_dtype;
    if (f.grad_dtype_opt->count() == 0) in.grad_dtype = def.grad_dtype;
    if (f.replication_opt->count() == 0) in.replication = def.replication;
    if (f.skip_nonfinite_opt->count() == 0 && f.max_grad_norm_opt->count() == 0) {
      in.holds_grads = def.skip_nonfinite || def.max_grad_norm > 0;
    }
    if (f.chunk_opt->count() == 0) {
      if (def.chunk_payload_bytes > 0) in.chunk_payload_bytes = def.chunk_payload_bytes;
      in.max_chunk_bytes = def.max_chunk_bytes;
    }
  }
  if (!f.kernel_bench.empty()) {
    absl::StatusOr<std::string> text = ReadFile(f.kernel_bench);
    if (!text.ok()) return fail(absl::StrCat("--kernel_bench: ", text.status().message()));
    absl::StatusOr<KernelBench> bench = ParseKernelBench(*text, f.kernel_bench);
    if (!bench.ok()) return fail(absl::StrCat("--kernel_bench: ", bench.status().message()));
    in.kernel = *std::move(bench);
  }
  return in;
}

Json ValueOf(const PlanLine& l) {
  if (l.unit.empty()) return l.text;
  if (l.unit == "bool") return l.value != 0;
  if (std::isfinite(l.value) && l.value == std::floor(l.value) && std::fabs(l.value) < 9.0e15) {
    if (l.value >= 0) return static_cast<uint64_t>(l.value);
    return static_cast<int64_t>(l.value);
  }
  return l.value;
}

Json Tree(const PlanInput& in, const PlanReport& report) {
  Json j;
  Json input;
  input["model"] = in.model_name;
  input["dp"] = in.dp;
  input["tp"] = in.tp;
  input["pp"] = in.pp;
  input["zero"] = in.zero_stage;
  input["optimizer"] = std::string(kernels::OptimizerName(in.optimizer));
  input["param_dtype"] = std::string(DTypeName(in.param_dtype));
  input["grad_dtype"] = std::string(DTypeName(in.grad_dtype));
  input["master_dtype"] = in.master_dtype ? std::string(DTypeName(*in.master_dtype)) : "none";
  input["gpus_per_node"] = in.gpus_per_node;
  input["gpu_memory_bytes"] = in.gpu_memory_bytes;
  input["dpu_memory_bytes"] = in.dpu_memory_bytes;
  input["dpu_cores"] = in.dpu_cores;
  input["host_memory_bytes"] = in.host_memory_bytes;
  input["host_cores"] = in.host_cores;
  input["replication"] = in.replication;
  input["holds_grads"] = in.holds_grads;
  input["chunk_payload_bytes"] = in.chunk_payload_bytes;
  input["max_chunk_bytes"] = in.max_chunk_bytes;
  input["kernel_bench"] = in.kernel.figures.empty() ? DefaultKernelBench().source : in.kernel.source;
  j["input"] = std::move(input);
  for (const PlanSection& s : report.sections) {
    Json section;
    for (const PlanLine& l : s.lines) {
      Json line;
      line["label"] = l.label;
      line["value"] = ValueOf(l);
      line["unit"] = l.unit;
      line["text"] = l.text;
      line["accounting"] = l.accounting;
      section[l.key] = std::move(line);
    }
    j[s.key] = std::move(section);
  }
  return j;
}

void EmitYaml(YAML::Emitter& e, const Json& j) {
  if (j.is_object()) {
    e << YAML::BeginMap;
    for (const auto& item : j.items()) {
      e << YAML::Key << item.key() << YAML::Value;
      EmitYaml(e, item.value());
    }
    e << YAML::EndMap;
  } else if (j.is_array()) {
    e << YAML::BeginSeq;
    for (const Json& v : j) EmitYaml(e, v);
    e << YAML::EndSeq;
  } else if (j.is_string()) {
    e << j.get<std::string>();
  } else if (j.is_boolean()) {
    e << j.get<bool>();
  } else if (j.is_number_unsigned()) {
    e << static_cast<unsigned long long>(j.get<uint64_t>());
  } else if (j.is_number_integer()) {
    e << static_cast<long long>(j.get<int64_t>());
  } else if (j.is_number_float()) {
    e << j.get<double>();
  } else {
    e << YAML::Null;
  }
}

void Run(const PlanFlags& f, int* exit_code, std::ostream& out, std::ostream& err) {
  Failure failure{0, ""};
  absl::StatusOr<PlanInput> in = BuildInput(f, &failure);
  if (!in.ok()) {
    err << "optimusctl plan: " << failure.message << "\n";
    if (failure.code == 2) err << "Run with --help for the flags.\n";
    *exit_code = failure.code;
    return;
  }
  absl::StatusOr<PlanReport> report = ComputePlan(*in);
  if (!report.ok()) {
    err << "optimusctl plan: " << report.status().message() << "\n";
    *exit_code = report.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
    return;
  }
  const std::string output = absl::AsciiStrToLower(f.output);
  if (output == "json") {
    out << RenderJson(*in, *report);
  } else if (output == "yaml") {
    out << RenderYaml(*in, *report);
  } else {
    out << RenderTable(*in, *report);
  }
  out.flush();
  *exit_code = 0;
}

// CLI11 validators that name what they expect.
CLI::Validator SizeValidator() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        absl::StatusOr<uint64_t> b = ParseByteSize(s);
        return b.ok() ? std::string() : std::string(b.status().message());
      },
      "SIZE");
}

CLI::Validator CountValidator() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        absl::StatusOr<uint64_t> n = ParseParamCount(s);
        return n.ok() ? std::string() : std::string(n.status().message());
      },
      "N");
}

// A decimal number with an optional exponent, then a suffix.
bool SplitNumber(absl::string_view text, double* value, std::string* suffix) {
  text = absl::StripAsciiWhitespace(text);
  size_t i = 0;
  while (i < text.size() && (absl::ascii_isdigit(text[i]) || text[i] == '.')) ++i;
  // An exponent: e or E, an optional sign, digits.
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    size_t j = i + 1;
    if (j < text.size() && (text[j] == '+' || text[j] == '-')) ++j;
    if (j < text.size() && absl::ascii_isdigit(text[j])) {
      while (j < text.size() && absl::ascii_isdigit(text[j])) ++j;
      i = j;
    }
  }
  if (i == 0 || !absl::SimpleAtod(text.substr(0, i), value) || !std::isfinite(*value)) return false;
  *suffix = std::string(absl::StripAsciiWhitespace(text.substr(i)));
  return true;
}

}  // namespace

absl::StatusOr<uint64_t> ParseByteSize(absl::string_view text) {
  double v = 0;
  std::string suffix;
  const auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected a size such as 80GiB, 32GB, 512MiB or a byte count, got '", text, "'"));
  };
  if (!SplitNumber(text, &v, &suffix) || v < 0) return bad();
  const std::string s = absl::AsciiStrToLower(suffix);
  double mult = 0;
  if (s.empty() || s == "b") {
    mult = 1;
  } else if (s == "k" || s == "kib") {
    mult = 1024.0;
  } else if (s == "m" || s == "mib") {
    mult = 1048576.0;
  } else if (s == "g" || s == "gib") {
    mult = 1073741824.0;
  } else if (s == "t" || s == "tib") {
    mult = 1099511627776.0;
  } else if (s == "kb") {
    mult = 1e3;
  } else if (s == "mb") {
    mult = 1e6;
  } else if (s == "gb") {
    mult = 1e9;
  } else if (s == "tb") {
    mult = 1e12;
  } else {
    return bad();
  }
  const double bytes = std::floor(v * mult);
  if (bytes > 4.6e18) return absl::InvalidArgumentError(absl::StrCat("'", text, "' is too large"));
  return static_cast<uint64_t>(bytes);
}

absl::StatusOr<uint64_t> ParseParamCount(absl::string_view text) {
  double v = 0;
  std::string suffix;
  const auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected a parameter count such as 70e9, 70B, 124M or 124439808, got '", text, "'"));
  };
  if (!SplitNumber(text, &v, &suffix)) return bad();
  const std::string s = absl::AsciiStrToLower(suffix);
  double mult = 0;
  if (s.empty()) {
    mult = 1;
  } else if (s == "k") {
    mult = 1e3;
  } else if (s == "m") {
    mult = 1e6;
  } else if (s == "b" || s == "g") {
    mult = 1e9;
  } else if (s == "t") {
    mult = 1e12;
  } else {
    return bad();
  }
  const double n = v * mult;
  if (n < 1 || n > 1125899906842624.0 /* 2^50 */) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' must be from 1 to 2^50 parameters"));
  }
  // 8.75e9 and 1.5B are whole; 1.5 is not.
  if (n != std::floor(n)) {
    return absl::InvalidArgumentError(absl::StrCat("'", text, "' is not a whole number"));
  }
  return static_cast<uint64_t>(n);
}

std::string RenderTable(const PlanInput& in, const PlanReport& report) {
  std::string out = absl::StrCat(
      "optimusctl plan: ", in.model_name, "; DP ", in.dp, " x TP ", in.tp, " x PP ", in.pp,
      ", ZeRO-", in.zero_stage, ", ", kernels::OptimizerName(in.optimizer), " (",
      DTypeName(in.param_dtype), " weights, ", DTypeName(in.grad_dtype), " gradients, ",
      in.master_dtype ? absl::StrCat(DTypeName(*in.master_dtype), " master")
                      : std::string("no master copy"),
      ")\n", "GB = 10^9 bytes; B params = 10^9 parameters. Under each figure: how it was "
             "computed.\n");
  for (const PlanSection& s : report.sections) {
    absl::StrAppend(&out, "\n", s.title, "\n");
    for (const PlanLine& l : s.lines) {
      absl::StrAppendFormat(&out, "  %-52s %s\n", l.label, l.text);
      absl::StrAppend(&out, "      = ", l.accounting, "\n");
    }
  }
  return out;
}

std::string RenderJson(const PlanInput& in, const PlanReport& report) {
  return Tree(in, report).dump(2, ' ', false, Json::error_handler_t::replace) + "\n";
}

std::string RenderYaml(const PlanInput& in, const PlanReport& report) {
  YAML::Emitter e;
  EmitYaml(e, Tree(in, report));
  return std::string(e.c_str()) + "\n";
}

void AddPlanCommand(CLI::App* root, int* exit_code) {
  AddPlanCommand(root, exit_code, &std::cout, &std::cerr);
}

void AddPlanCommand(CLI::App* root, int* exit_code, std::ostream* out, std::ostream* err) {
  auto f = std::make_shared<PlanFlags>();
  CLI::App* sub = root->add_subcommand(
      "plan",
      "Size a deployment: per GPU memory with and without offload, per DPU / host shard "
      "optimizer state, shards needed, predicted optimizer step time. Needs no coordinator.");
  sub->footer(
      "Examples:\n"
      "  optimusctl plan --model=llama-70b --dp=2 --tp=2 --pp=4 --zero=3\n"
      "  optimusctl plan --params=70e9 --dp=2 --tp=2 --pp=4 --zero=3 -o json\n"
      "  optimusctl plan --model_file=job.yaml --dp=8 --dpu_memory=16GiB --host_memory=512GiB\n"
      "Sizes: 80GiB, 32GB, 512MiB (K/M/G/T alone are binary). Exit codes: 0 ok, 1 failure, 2 "
      "usage.");
  std::vector<std::string> presets = ModelPresetNames();
  f->model_opt = sub->add_option("--model", f->model,
                                 absl::StrCat("a published model: ", absl::StrJoin(presets, ", ")))
                     ->check(CLI::IsMember(presets, CLI::ignore_case));
  f->model_file_opt =
      sub->add_option("--model_file", f->model_file,
                      "a job spec (YAML/JSON, docs/job-spec.md) with `tensors` or `model`; its "
                      "world_size, optimizer, dtypes, replication and clipping apply unless "
                      "given as flags")
          ->check(CLI::ExistingFile);
  f->params_opt = sub->add_option("--params", f->params,
                                  "a parameter count instead of a model: 70e9, 70B, 124M")
                      ->check(CountValidator());
  f->model_opt->excludes(f->model_file_opt)->excludes(f->params_opt);
  f->model_file_opt->excludes(f->params_opt);
  f->dp_opt = sub->add_option("--dp", f->dp, "data-parallel degree (workers per chunk)")
                  ->check(CLI::Range(1u, 65536u))
                  ->capture_default_str();
  sub->add_option("--tp", f->tp, "tensor-parallel degree")
      ->check(CLI::Range(1u, 1u << 20))
      ->capture_default_str();
  sub->add_option("--pp", f->pp, "pipeline-parallel degree")
      ->check(CLI::Range(1u, 1u << 20))
      ->capture_default_str();
  sub->add_option("--zero", f->zero,
                  "ZeRO stage: 1 partitions optimizer state over DP, 2 also gradients, 3 also "
                  "weights")
      ->check(CLI::Range(0u, 3u))
      ->capture_default_str();
  f->optimizer_opt =
      sub->add_option("--optimizer", f->optimizer, "adamw, adam, sgd or lion")
          ->check(CLI::IsMember(std::vector<std::string>{"adamw", "adam", "sgd", "lion"}, CLI::ignore_case))
          ->capture_default_str();
  f->param_dtype_opt =
      sub->add_option("--param_dtype", f->param_dtype, "weights on the GPU and published copies")
          ->check(CLI::IsMember(std::vector<std::string>{"bf16", "fp16", "fp32"}, CLI::ignore_case))
          ->capture_default_str();
  f->grad_dtype_opt =
      sub->add_option("--grad_dtype", f->grad_dtype, "gradients on the GPU and on the wire")
          ->check(CLI::IsMember(std::vector<std::string>{"bf16", "fp16", "fp32"}, CLI::ignore_case))
          ->capture_default_str();
  sub->add_option("--master_dtype", f->master_dtype,
                  "the GPU's master copy without optimus; none: the weights are the master "
                  "(a shard always keeps fp32)")
      ->check(CLI::IsMember(std::vector<std::string>{"fp32", "bf16", "fp16", "none"}, CLI::ignore_case))
      ->capture_default_str();
  sub->add_option("--gpus_per_node", f->gpus_per_node, "GPUs (and DPUs) per node")
      ->check(CLI::Range(1u, 1024u))
      ->capture_default_str();
  sub->add_option("--gpu_memory", f->gpu_memory, "memory per GPU")
      ->check(SizeValidator())
      ->capture_default_str();
  sub->add_option("--dpu_memory", f->dpu_memory,
                  "memory per DPU for its shard (its --memory_limit_mb: ~12000MiB on a "
                  "BlueField-2, ~26000MiB on a BlueField-3); an eighth stays for gradients in "
                  "flight")
      ->check(SizeValidator())
      ->capture_default_str();
  sub->add_option("--dpu_cores", f->dpu_cores, "cores per DPU")
      ->check(CLI::Range(1u, 4096u))
      ->capture_default_str();
  sub->add_option("--host_memory", f->host_memory,
                  "memory per node for a host shard; 0: none (the plan says what would spill)")
      ->check(SizeValidator())
      ->capture_default_str();
  sub->add_option("--host_cores", f->host_cores, "cores per node for the host shard")
      ->check(CLI::Range(1u, 4096u))
      ->capture_default_str();
  f->replication_opt =
      sub->add_option("--replication", f->replication, "backups per chunk: 0 or 1")
          ->check(CLI::Range(0u, 1u))
          ->capture_default_str();
  f->skip_nonfinite_opt =
      sub->add_option("--skip_nonfinite", f->skip_nonfinite,
                      "steps wait for the commit round (the job default): chunks hold their "
                      "gradients until then")
          ->capture_default_str();
  f->max_grad_norm_opt =
      sub->add_option("--max_grad_norm", f->max_grad_norm,
                      "gradient clipping (> 0 also holds gradients for the commit round)")
          ->check(CLI::NonNegativeNumber)
          ->capture_default_str();
  f->chunk_opt = sub->add_option("--chunk_payload_bytes", f->chunk_payload_bytes,
                                 "gradient bytes per chunk push")
                     ->check(SizeValidator())
                     ->capture_default_str();
  sub->add_option("--kernel_bench", f->kernel_bench,
                  "bench/kernels output (JSON lines) measured on the shards' cores; default: the "
                  "figures recorded in the repo")
      ->check(CLI::ExistingFile);
  sub->add_option("-o,--output", f->output, "table, json or yaml")
      ->check(CLI::IsMember(std::vector<std::string>{"table", "json", "yaml"}, CLI::ignore_case))
      ->capture_default_str();
  sub->callback([f, exit_code, out, err] { Run(*f, exit_code, *out, *err); });
}

}  // namespace plan
}  // namespace optimus
