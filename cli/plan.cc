#include "cli/plan.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <utility>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace optimus {
namespace plan {
namespace {

// bench/kernels' server_step lines of 2026-11-23, as docs/benchmarks.md
// ("Optimizer kernels") records them: `bazel run -c opt //bench:kernels`
// (64 Mi parameters, best of 5 runs) on the development VM, 2 vCPUs of an
// AMD EPYC (Zen 3, AVX2), nothing else running. The headline lines (W = 1,
// 2, 4, 8 on both threads) and the thread sweep's W = 4 lines. Replace them
// with a run on the shard's own hardware: `--kernel_bench FILE`.
constexpr char kDefaultKernelBenchText[] = R"({"bench": "server_step", "sweep": "headline", "isa": "avx2", "workers": 1, "grad_dtype": "bf16", "out_dtype": "bf16", "params": 67108864, "threads": 2, "gparams_per_s": 1.723, "ceiling_gparams_per_s": 1.948, "ceiling_gbytes_per_s": 54.5, "unfused_gparams_per_s": 1.091, "ratio_to_ceiling": 0.885, "ratio_to_unfused": 1.58}
{"bench": "server_step", "sweep": "headline", "isa": "avx2", "workers": 2, "grad_dtype": "bf16", "out_dtype": "bf16", "params": 67108864, "threads": 2, "gparams_per_s": 1.218, "ceiling_gparams_per_s": 1.520, "ceiling_gbytes_per_s": 45.6, "unfused_gparams_per_s": 0.875, "ratio_to_ceiling": 0.801, "ratio_to_unfused": 1.39}
{"bench": "server_step", "sweep": "headline", "isa": "avx2", "workers": 4, "grad_dtype": "bf16", "out_dtype": "bf16", "params": 67108864, "threads": 2, "gparams_per_s": 1.236, "ceiling_gparams_per_s": 1.419, "ceiling_gbytes_per_s": 48.2, "unfused_gparams_per_s": 0.870, "ratio_to_ceiling": 0.871, "ratio_to_unfused": 1.42}
{"bench": "server_step", "sweep": "headline", "isa": "avx2", "workers": 8, "grad_dtype": "bf16", "out_dtype": "bf16", "params": 67108864, "threads": 2, "gparams_per_s": 0.791, "ceiling_gparams_per_s": 0.794, "ceiling_gbytes_per_s": 33.3, "unfused_gparams_per_s": 0.566, "ratio_to_ceiling": 0.997, "ratio_to_unfused": 1.40}
{"bench": "server_step", "sweep": "threads", "isa": "avx2", "workers": 4, "grad_dtype": "bf16", "out_dtype": "bf16", "params": 67108864, "threads": 1, "gparams_per_s": 0.632, "ceiling_gparams_per_s": 0.716, "ceiling_gbytes_per_s": 24.4, "unfused_gparams_per_s": 0.453, "ratio_to_ceiling": 0.883, "ratio_to_unfused": 1.39}
{"bench": "server_step", "sweep": "threads", "isa": "avx2", "workers": 4, "grad_dtype": "bf16", "out_dtype": "bf16", "params": 67108864, "threads": 2, "gparams_per_s": 1.175, "ceiling_gparams_per_s": 1.257, "ceiling_gbytes_per_s": 42.8, "unfused_gparams_per_s": 0.826, "ratio_to_ceiling": 0.935, "ratio_to_unfused": 1.42}
)";
constexpr char kDefaultKernelBenchSource[] =
    "bench/kernels of 2026-11-23 recorded in the repo (docs/benchmarks.md; 2 vCPUs of an AMD "
    "EPYC, Zen 3)";

// A shard keeps an eighth of its memory for gradients in flight unless told
// otherwise (server/shard_server.h staging_bytes); the rest is what it
// offers the coordinator.
uint64_t PlannableBytes(uint64_t memory_bytes) { return memory_bytes - memory_bytes / 8; }

// Placement gives up past this many shards (a search over millions of
// shards would take minutes; no deployment is that large per job).
constexpr uint64_t kMaxShards = uint64_t{1} << 20;
// A host shard without --host_memory: unbounded, to see what would spill.
constexpr uint64_t kUnboundedBytes = std::numeric_limits<uint64_t>::max() / 4;

absl::Status Invalid(absl::string_view what) {
  return absl::InvalidArgumentError(what);
}

std::string Grouped(uint64_t v) {
  std::string digits = absl::StrCat(v);
  std::string out;
  const int n = static_cast<int>(digits.size());
  for (int i = 0; i < n; ++i) {
    if (i > 0 && (n - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

// A flag's size as given: "32 GiB", "80 GiB", else grouped bytes.
std::string Iec(uint64_t bytes) {
  if (bytes >= (uint64_t{1} << 40) && bytes % (uint64_t{1} << 40) == 0) {
    return absl::StrCat(bytes >> 40, " TiB");
  }
  if (bytes >= (uint64_t{1} << 30) && bytes % (uint64_t{1} << 30) == 0) {
    return absl::StrCat(bytes >> 30, " GiB");
  }
  if (bytes >= (uint64_t{1} << 20) && bytes % (uint64_t{1} << 20) == 0) {
    return absl::StrCat(bytes >> 20, " MiB");
  }
  return absl::StrCat(Grouped(bytes), " B");
}

std::string FormatSeconds(double s) {
  if (s >= 1.0) return absl::StrFormat("%.2f s", s);
  if (s >= 1e-3) return absl::StrFormat("%.1f ms", s * 1e3);
  return absl::StrFormat("%.1f us", s * 1e6);
}

// "2 (bf16)"-style pieces of the accounting.
std::string DtypeBytes(DType d) { return absl::StrCat(DTypeSize(d), " B (", DTypeName(d), ")"); }

std::string MomentsName(kernels::OptimizerKind k) {
  switch (k) {
    case kernels::OptimizerKind::kAdamW:
    case kernels::OptimizerKind::kAdam:
      return "m, v";
    case kernels::OptimizerKind::kSgd:
      return "momentum";
    case kernels::OptimizerKind::kLion:
      return "m";
  }
  return "moments";
}

PlanLine Line(std::string key, std::string label, double value, std::string unit, std::string text,
              std::string accounting) {
  PlanLine l;
  l.key = std::move(key);
  l.label = std::move(label);
  l.value = value;
  l.unit = std::move(unit);
  l.text = std::move(text);
  l.accounting = std::move(accounting);
  return l;
}

PlanLine BytesLine(std::string key, std::string label, double bytes, std::string accounting) {
  return Line(std::move(key), std::move(label), bytes, "bytes", FormatBytes(bytes),
              std::move(accounting));
}

// What each shard holds and steps after a placement.
struct ShardLoad {
  bool is_dpu = false;
  uint64_t elems = 0;  // Primaries and backups: the elements it steps.
  uint64_t bytes = 0;  // Its planned bytes (elements and per-chunk bookkeeping).
};

std::map<uint64_t, ShardLoad> LoadsOf(const std::vector<ChunkSpec>& placed,
                                      absl::Span<const ShardInfo> shards, uint64_t bytes_per_elem,
                                      uint32_t world_size) {
  std::map<uint64_t, ShardLoad> loads;
  for (const ShardInfo& s : shards) loads[s.id].is_dpu = s.is_dpu;
  for (const ChunkSpec& c : placed) {
    const uint64_t need = kernels::ShardChunkBytes(c.num_elems, bytes_per_elem, world_size);
    for (uint64_t id : {c.shard_id, c.backup_shard_id}) {
      if (id == 0) continue;
      loads[id].elems += c.num_elems;
      loads[id].bytes += need;
    }
  }
  return loads;
}

absl::StatusOr<std::vector<ChunkSpec>> Place(const std::vector<ChunkSpec>& chunks,
                                             const std::vector<ShardInfo>& shards,
                                             uint64_t bytes_per_elem, uint32_t world_size,
                                             bool replicated) {
  const uint64_t overhead = kernels::ChunkOverheadBytes(world_size);
  absl::StatusOr<std::vector<ChunkSpec>> placed =
      PlaceChunks(chunks, shards, bytes_per_elem, overhead);
  if (placed.ok() && replicated) {
    placed = PlaceBackups(*std::move(placed), shards, bytes_per_elem, overhead);
  }
  return placed;
}

struct ShardCount {
  uint64_t shards = 0;       // The smallest count placement succeeded on.
  uint64_t lower_bound = 0;  // What the bytes alone need.
  std::map<uint64_t, ShardLoad> loads;
};

std::vector<ShardInfo> EqualShards(uint64_t n, uint64_t capacity, bool is_dpu) {
  std::vector<ShardInfo> shards(n);
  for (uint64_t i = 0; i < n; ++i) {
    shards[i].id = i + 1;
    shards[i].is_dpu = is_dpu;
    shards[i].memory_limit_bytes = capacity;
  }
  return shards;
}

// The smallest number of equal shards of `capacity` plannable bytes that
// the coordinator's placement (PlaceChunks, then PlaceBackups when
// replicated) puts every chunk on. Starts at the bytes' lower bound (almost
// always the answer: chunks are small next to a shard), then widens the
// step until placement succeeds and narrows back to the smallest count
// that does.
absl::StatusOr<ShardCount> SmallestShardCount(const std::vector<ChunkSpec>& chunks,
                                              uint64_t bytes_per_elem, uint32_t world_size,
                                              bool replicated, uint64_t capacity) {
  uint64_t one_copy = 0, largest = 0;
  for (const ChunkSpec& c : chunks) {
    const uint64_t need = kernels::ShardChunkBytes(c.num_elems, bytes_per_elem, world_size);
    one_copy += need;
    largest = std::max(largest, need);
  }
  if (largest > capacity) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a chunk needs ", FormatBytes(largest), ", more than a shard's ", FormatBytes(capacity),
        " of plannable memory: raise the shard memory or lower --chunk_payload_bytes"));
  }
  const uint64_t copies = replicated ? 2 : 1;
  ShardCount out;
  out.lower_bound = std::max<uint64_t>(copies, (one_copy * copies + capacity - 1) / capacity);
  if (out.lower_bound > kMaxShards) {
    return absl::ResourceExhaustedError(absl::StrCat("needs ", Grouped(out.lower_bound),
                                                     " shards, more than the ",
                                                     Grouped(kMaxShards), " a plan searches"));
  }
  auto attempt = [&](uint64_t n) {
    return Place(chunks, EqualShards(n, capacity, /*is_dpu=*/true), bytes_per_elem, world_size,
                 replicated);
  };
  uint64_t fail = out.lower_bound - 1;  // Largest count known to fail.
  uint64_t n = out.lower_bound;
  uint64_t step = 1;
  absl::StatusOr<std::vector<ChunkSpec>> placed = attempt(n);
  while (!placed.ok()) {
    if (placed.status().code() != absl::StatusCode::kResourceExhausted) return placed.status();
    fail = n;
    n = out.lower_bound + step;
    step *= 2;
    if (n > kMaxShards) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "placement did not succeed on up to ", Grouped(kMaxShards), " shards"));
    }
    placed = attempt(n);
  }
  std::vector<ChunkSpec> best = *std::move(placed);
  uint64_t lo = fail + 1, hi = n;
  while (lo < hi) {
    const uint64_t mid = lo + (hi - lo) / 2;
    absl::StatusOr<std::vector<ChunkSpec>> p = attempt(mid);
    if (p.ok()) {
      hi = mid;
      best = *std::move(p);
    } else {
      lo = mid + 1;
    }
  }
  out.shards = hi;
  const std::vector<ShardInfo> shards = EqualShards(hi, capacity, true);
  out.loads = LoadsOf(best, shards, bytes_per_elem, world_size);
  return out;
}

const KernelFigure* ChooseFigure(const KernelBench& bench, uint32_t workers) {
  const KernelFigure* best = nullptr;
  auto dist = [&](const KernelFigure& f) {
    return f.workers > workers ? f.workers - workers : workers - f.workers;
  };
  for (const KernelFigure& f : bench.figures) {
    if (best == nullptr) {
      best = &f;
      continue;
    }
    const bool fh = f.sweep == "headline", bh = best->sweep == "headline";
    if (fh != bh) {
      if (fh) best = &f;
      continue;
    }
    if (dist(f) != dist(*best)) {
      if (dist(f) < dist(*best)) best = &f;
      continue;
    }
    if (f.workers != best->workers) {
      if (f.workers > best->workers) best = &f;
      continue;
    }
    if (f.threads > best->threads) best = &f;
  }
  return best;
}

}  // namespace

std::string FormatParams(double p) {
  if (p >= 1e9) return absl::StrFormat("%.2f B params", p / 1e9);
  if (p >= 1e6) return absl::StrFormat("%.2f M params", p / 1e6);
  if (p >= 1e3) return absl::StrFormat("%.2f K params", p / 1e3);
  return absl::StrFormat("%.0f params", p);
}

std::string FormatBytes(double b) {
  const double a = std::fabs(b);
  if (a >= 1e12) return absl::StrFormat("%.2f TB", b / 1e12);
  if (a >= 1e9) return absl::StrFormat("%.2f GB", b / 1e9);
  if (a >= 1e6) return absl::StrFormat("%.2f MB", b / 1e6);
  if (a >= 1e3) return absl::StrFormat("%.2f KB", b / 1e3);
  return absl::StrFormat("%.0f B", b);
}

const PlanLine* PlanReport::Find(absl::string_view section, absl::string_view key) const {
  for (const PlanSection& s : sections) {
    if (s.key != section) continue;
    for (const PlanLine& l : s.lines) {
      if (l.key == key) return &l;
    }
  }
  return nullptr;
}

absl::StatusOr<KernelBench> ParseKernelBench(absl::string_view text, absl::string_view source) {
  KernelBench out;
  out.source = std::string(source);
  int line_no = 0;
  for (absl::string_view raw : absl::StrSplit(text, '\n')) {
    ++line_no;
    const absl::string_view line = absl::StripAsciiWhitespace(raw);
    if (line.empty()) continue;
    const std::string where = absl::StrCat(source, ":", line_no, ": ");
    nlohmann::json j =
        nlohmann::json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      return Invalid(absl::StrCat(where, "not a JSON object (bench/kernels prints one per line)"));
    }
    auto bench = j.find("bench");
    if (bench == j.end() || !bench->is_string() || bench->get<std::string>() != "server_step") {
      continue;
    }
    auto number = [&](const char* field, double* v) -> absl::Status {
      auto it = j.find(field);
      if (it == j.end() || !it->is_number() || !(it->get<double>() > 0) ||
          !std::isfinite(it->get<double>())) {
        return Invalid(absl::StrCat(where, "server_step line without a positive \"", field, "\""));
      }
      *v = it->get<double>();
      return absl::OkStatus();
    };
    double workers = 0, threads = 0, gparams = 0;
    if (absl::Status s = number("workers", &workers); !s.ok()) return s;
    if (absl::Status s = number("threads", &threads); !s.ok()) return s;
    if (absl::Status s = number("gparams_per_s", &gparams); !s.ok()) return s;
    if (workers != std::floor(workers) || threads != std::floor(threads) || workers > 1e6 ||
        threads > 1e6) {
      return Invalid(absl::StrCat(where, "\"workers\" and \"threads\" must be whole numbers"));
    }
    KernelFigure f;
    f.workers = static_cast<uint32_t>(workers);
    f.threads = static_cast<uint32_t>(threads);
    f.gparams_per_s = gparams;
    f.line = line_no;
    if (auto it = j.find("params"); it != j.end() && it->is_number_unsigned()) {
      f.params = it->get<uint64_t>();
    }
    if (auto it = j.find("sweep"); it != j.end() && it->is_string()) f.sweep = it->get<std::string>();
    if (auto it = j.find("isa"); it != j.end() && it->is_string()) f.isa = it->get<std::string>();
    out.figures.push_back(std::move(f));
  }
  if (out.figures.empty()) {
    return Invalid(absl::StrCat(source,
                                ": no server_step line (run bench/kernels with "
                                "--benches=server_step and save its standard output)"));
  }
  return out;
}

const KernelBench& DefaultKernelBench() {
  static const KernelBench* bench = [] {
    absl::StatusOr<KernelBench> b = ParseKernelBench(kDefaultKernelBenchText, "default");
    // The text above is ours: a failure here is a bug caught by plan_test.
    auto* out = new KernelBench(b.ok() ? *std::move(b) : KernelBench{});
    out->source = kDefaultKernelBenchSource;
    return out;
  }();
  return *bench;
}

absl::StatusOr<PlanReport> ComputePlan(const PlanInput& in) {
  // ---- checks, named as the flags are ----
  if (in.dp < 1) return Invalid("--dp must be >= 1");
  if (in.tp < 1) return Invalid("--tp must be >= 1");
  if (in.pp < 1) return Invalid("--pp must be >= 1");
  if (in.zero_stage > 3) return Invalid("--zero must be 0, 1, 2 or 3");
  if (in.replication > 1) return Invalid("--replication must be 0 or 1");
  if (in.gpus_per_node < 1) return Invalid("--gpus_per_node must be >= 1");
  if (in.gpu_memory_bytes == 0) return Invalid("--gpu_memory must be > 0");
  if (in.dpu_memory_bytes < 8) return Invalid("--dpu_memory must be > 0");
  if (in.dpu_cores < 1) return Invalid("--dpu_cores must be >= 1");
  if (in.host_memory_bytes > 0 && in.host_cores < 1) return Invalid("--host_cores must be >= 1");
  if (uint64_t{in.dp} * in.tp * in.pp > (uint64_t{1} << 20)) {
    return Invalid("--dp x --tp x --pp: more than 1,048,576 GPUs");
  }
  if (in.dp > 65536) return Invalid("--dp must be <= 65536 (a job's largest world size)");
  // As the coordinator sizes chunks (coordinator/job_spec.cc).
  const uint64_t chunk_elems = in.max_chunk_bytes > 0
                                   ? in.max_chunk_bytes / 4
                                   : in.chunk_payload_bytes / DTypeSize(in.grad_dtype);
  if (chunk_elems == 0) {
    return Invalid(in.max_chunk_bytes > 0
                       ? std::string("max_chunk_bytes must be at least 4 (one fp32 element)")
                       : absl::StrCat("--chunk_payload_bytes must hold one ",
                                      DTypeName(in.grad_dtype), " gradient element"));
  }
  std::vector<uint64_t> tensors = in.tensor_num_elems;
  if (tensors.empty()) tensors.push_back(in.num_params);
  uint64_t params = 0;
  for (uint64_t n : tensors) {
    if (__builtin_add_overflow(params, n, &params) || params > (uint64_t{1} << 50)) {
      return Invalid("the model has more than 2^50 parameters");
    }
  }
  if (params == 0) return Invalid("the model has no parameters");
  const KernelBench& kernel = in.kernel.figures.empty() ? DefaultKernelBench() : in.kernel;
  if (kernel.figures.empty()) return Invalid("--kernel_bench: no server_step figures");

  PlanReport report;
  const uint32_t W = in.dp;
  const uint64_t gpus = uint64_t{in.dp} * in.tp * in.pp;
  const uint64_t nodes = (gpus + in.gpus_per_node - 1) / in.gpus_per_node;
  const kernels::StateLayout& layout = kernels::LayoutOf(in.optimizer);
  const uint64_t moment_arrays = layout.num_arrays - 1;
  const uint64_t moment_bytes = 4 * moment_arrays;  // fp32 each
  const std::string moments = MomentsName(in.optimizer);
  const uint64_t pb = DTypeSize(in.param_dtype), gb = DTypeSize(in.grad_dtype);
  const uint64_t mb = in.master_dtype ? DTypeSize(*in.master_dtype) : 0;
  const uint64_t states_per_param = pb + gb + mb + moment_bytes;
  const std::string opt_name(kernels::OptimizerName(in.optimizer));
  const std::string states_breakdown = absl::StrCat(
      pb, " weights (", DTypeName(in.param_dtype), ") + ", gb, " gradients (",
      DTypeName(in.grad_dtype), ")",
      mb > 0 ? absl::StrCat(" + ", mb, " master (", DTypeName(*in.master_dtype), ")") : "",
      " + ", moment_bytes, " ", opt_name, " ", moments, " (fp32)");

  // ---- the model ----
  {
    PlanSection s;
    s.key = "model";
    s.title = absl::StrCat("Model: ", in.model_name);
    s.lines.push_back(Line(
        "params", "parameters", static_cast<double>(params), "params", FormatParams(params),
        in.tensor_num_elems.empty()
            ? absl::StrCat(Grouped(params), " parameters as given (--params)")
            : absl::StrCat("the sum of the elements of its ", tensors.size(), " tensors: ",
                           Grouped(params))));
    s.lines.push_back(BytesLine(
        "model_states_bytes", "model states", static_cast<double>(params) * states_per_param,
        absl::StrCat(FormatParams(params), " x ", states_per_param, " B (", states_breakdown,
                     ")")));
    s.lines.push_back(Line(
        "gpus", "GPUs", static_cast<double>(gpus), "count", absl::StrCat(gpus),
        absl::StrCat("DP ", in.dp, " x TP ", in.tp, " x PP ", in.pp, " = ", gpus, " on ", nodes,
                     " node", nodes > 1 ? "s" : "", " of ", in.gpus_per_node)));
    report.sections.push_back(std::move(s));
  }

  // ---- per GPU ----
  {
    PlanSection s;
    s.key = "per_gpu";
    s.title = absl::StrCat("Per GPU (DP ", in.dp, " x TP ", in.tp, " x PP ", in.pp, ", ZeRO-",
                           in.zero_stage, ", ", Iec(in.gpu_memory_bytes), ")");
    const double p = static_cast<double>(params) / (uint64_t{in.tp} * in.pp);
    const std::string pt = FormatParams(p);
    const uint32_t z = in.zero_stage;
    const double w_div = z >= 3 ? in.dp : 1, g_div = z >= 2 ? in.dp : 1, o_div = z >= 1 ? in.dp : 1;
    auto divided = [&](double div, uint32_t stage, const char* what) {
      if (in.dp == 1) return std::string();
      return div > 1 ? absl::StrCat(" / DP ", in.dp, " (ZeRO-", z, " partitions ", what, ")")
                     : absl::StrCat(" (ZeRO-", z, " keeps whole ", what, "; ZeRO-", stage,
                                    " would partition them)");
    };
    const double weights = p * pb / w_div;
    const double grads = p * gb / g_div;
    const double opt = p * moment_bytes / o_div;
    const double master = p * mb / o_div;
    const double total = weights + grads + opt + master;
    const double stays = weights + grads;
    const double gpu = static_cast<double>(in.gpu_memory_bytes);
    s.lines.push_back(Line(
        "params", "parameters held", p, "params", pt,
        absl::StrCat(Grouped(params), " / (TP ", in.tp, " x PP ", in.pp, ")",
                     in.dp > 1 ? absl::StrCat("; each of the DP ", in.dp,
                                              " replicas holds the same partition")
                               : "")));
    s.lines.push_back(BytesLine(
        "model_states_bytes", "model states, no ZeRO", p * states_per_param,
        absl::StrCat(pt, " x ", states_per_param, " B (", states_breakdown, ")")));
    s.lines.push_back(BytesLine(
        "weights_bytes", "weights", weights,
        absl::StrCat(pt, " x ", DtypeBytes(in.param_dtype), divided(w_div, 3, "weights"))));
    s.lines.push_back(BytesLine(
        "grads_bytes", "gradients", grads,
        absl::StrCat(pt, " x ", DtypeBytes(in.grad_dtype), divided(g_div, 2, "gradients"))));
    s.lines.push_back(BytesLine(
        "optimizer_state_bytes", absl::StrCat("optimizer state (", moments, ")"), opt,
        absl::StrCat(pt, " x ", moment_bytes, " B (", opt_name, " ", moments, ", fp32)",
                     divided(o_div, 1, "optimizer state"))));
    s.lines.push_back(BytesLine(
        "master_bytes", "master weights", master,
        mb > 0 ? absl::StrCat(pt, " x ", DtypeBytes(*in.master_dtype),
                              divided(o_div, 1, "the master"))
               : "none (--master_dtype none: the weights are the master)"));
    s.lines.push_back(BytesLine(
        "total_bytes", "total without offload", total,
        absl::StrCat("weights + gradients + optimizer state + master with ZeRO-", z, "; ",
                     total <= gpu ? absl::StrCat("leaves ", FormatBytes(gpu - total), " of ",
                                                 Iec(in.gpu_memory_bytes),
                                                 " for activations and buffers")
                                  : absl::StrCat("over the GPU's ", Iec(in.gpu_memory_bytes),
                                                 " by ", FormatBytes(total - gpu)))));
    s.lines.push_back(BytesLine(
        "offload_optimizer_state_bytes", absl::StrCat("offloaded: optimizer state (", moments, ")"),
        opt,
        absl::StrCat(pt, " x ", moment_bytes, " B (fp32 ", moments, ")",
                     o_div > 1 ? absl::StrCat(" / ", in.dp, " (ZeRO-", z, " over DP ", in.dp, ")")
                               : "",
                     ": the optimizer state alone")));
    s.lines.push_back(BytesLine(
        "offload_with_master_bytes", "offloaded: optimizer state + master", opt + master,
        absl::StrCat(pt, " x ", moment_bytes + mb, " B (",
                     mb > 0 ? absl::StrCat(DTypeName(*in.master_dtype), " master + ") : "",
                     "fp32 ", moments, ")",
                     o_div > 1 ? absl::StrCat(" / ", in.dp, " (ZeRO-", z, " over DP ", in.dp, ")")
                               : "",
                     ": optimus moves the master off the GPU too")));
    s.lines.push_back(BytesLine(
        "with_optimus_bytes", "total with optimus (stays on the GPU)", stays,
        absl::StrCat("weights + gradients; ",
                     stays <= gpu ? absl::StrCat("leaves ", FormatBytes(gpu - stays), " of ",
                                                 Iec(in.gpu_memory_bytes),
                                                 " for activations and buffers")
                                  : absl::StrCat("over the GPU's ", Iec(in.gpu_memory_bytes),
                                                 " by ", FormatBytes(stays - gpu)))));
    report.sections.push_back(std::move(s));
  }

  // ---- what a shard holds, and how many the model needs ----
  const std::vector<ChunkSpec> chunks = SplitTensors(tensors, chunk_elems);
  auto bytes_per_elem = [&](bool replicated) {
    return kernels::ShardBytesPerElem(in.optimizer, W, in.grad_dtype, in.param_dtype, replicated,
                                      in.holds_grads);
  };
  auto per_elem_breakdown = [&](bool replicated) {
    std::string s = absl::StrCat(layout.bytes_per_elem(), " (fp32 master, ", moments, ") + ",
                                 2 * pb, " (two ", DTypeName(in.param_dtype),
                                 " published versions)");
    if (replicated) absl::StrAppend(&s, " + 4 (fp32 gradient sum forwarded to the backup)");
    if (in.holds_grads) {
      absl::StrAppend(
          &s, " + ", kernels::GradHoldBytesPerElem(W, in.grad_dtype),
          kernels::FoldsGradients(W, in.grad_dtype)
              ? " (fp32 running sum of the gradients, held for the commit round)"
              : absl::StrCat(" (", W, " worker", W > 1 ? "s'" : "'", " ",
                             DTypeName(in.grad_dtype), " gradients, held for the commit round)"));
    }
    return s;
  };
  const bool replicated = in.replication > 0;
  const uint64_t bpe = bytes_per_elem(replicated);
  const uint64_t overhead = kernels::ChunkOverheadBytes(W);
  uint64_t one_copy = 0;
  for (const ChunkSpec& c : chunks) one_copy += kernels::ShardChunkBytes(c.num_elems, bpe, W);
  const uint64_t copies = replicated ? 2 : 1;
  const uint64_t dpu_cap = PlannableBytes(in.dpu_memory_bytes);
  // Shards needed without and with replication.
  const absl::StatusOr<ShardCount> needed[2] = {
      SmallestShardCount(chunks, bytes_per_elem(false), W, false, dpu_cap),
      SmallestShardCount(chunks, bytes_per_elem(true), W, true, dpu_cap)};
  {
    PlanSection s;
    s.key = "shards";
    s.title = absl::StrCat("Optimizer shards (", opt_name, ", W = DP = ", W, ", replication ",
                           in.replication, ")");
    s.lines.push_back(Line(
        "bytes_per_elem", "shard bytes per parameter", static_cast<double>(bpe), "bytes_per_elem",
        absl::StrCat(bpe, " B"),
        absl::StrCat(per_elem_breakdown(replicated), " (kernels::ShardBytesPerElem)")));
    s.lines.push_back(Line(
        "chunks", "chunks", static_cast<double>(chunks.size()), "count", Grouped(chunks.size()),
        absl::StrCat(tensors.size(), " tensor", tensors.size() > 1 ? "s" : "", " cut into chunks of ",
                     Grouped(chunk_elems), " elements (",
                     in.max_chunk_bytes > 0
                         ? absl::StrCat("max_chunk_bytes ", Iec(in.max_chunk_bytes), " of fp32")
                         : absl::StrCat(Iec(in.chunk_payload_bytes), " of ",
                                        DTypeName(in.grad_dtype), " gradient per push"),
                     "); each costs ",
                     Grouped(overhead), " B of bookkeeping (kernels::ChunkOverheadBytes)")));
    s.lines.push_back(BytesLine(
        "optimizer_state_bytes", absl::StrCat("optimizer state (fp32 master, ", moments, ")"),
        static_cast<double>(params) * layout.bytes_per_elem() * copies,
        absl::StrCat(FormatParams(params), " x ", layout.bytes_per_elem(), " B",
                     replicated ? " x 2 copies" : "", ", over all shards")));
    s.lines.push_back(BytesLine(
        "total_bytes", "all shards hold", static_cast<double>(one_copy * copies),
        absl::StrCat(FormatParams(params), " x ", bpe, " B + ", Grouped(chunks.size()),
                     " chunks x ", Grouped(overhead), " B", replicated ? ", x 2 copies" : "",
                     " (kernels::ShardChunkBytes)")));
    s.lines.push_back(BytesLine(
        "dpu_shard_capacity_bytes", "plannable per DPU shard", static_cast<double>(dpu_cap),
        absl::StrCat(Iec(in.dpu_memory_bytes),
                     " (--dpu_memory) less an eighth kept for gradients in flight (the shard's "
                     "default staging)")));
    for (uint32_t r : {0u, 1u}) {
      const bool rep = r > 0;
      const std::string key = absl::StrCat("dpu_shards_needed_replication_", r);
      const std::string label = absl::StrCat("DPU shards needed, replication ", r);
      const absl::StatusOr<ShardCount>& n = needed[r];
      if (!n.ok()) {
        s.lines.push_back(Line(key, label, 0, "", "none", std::string(n.status().message())));
        continue;
      }
      uint64_t all = 0;
      for (const ChunkSpec& c : chunks) {
        all += kernels::ShardChunkBytes(c.num_elems, bytes_per_elem(rep), W);
      }
      if (rep) all *= 2;
      s.lines.push_back(Line(
          key, label, static_cast<double>(n->shards), "shards", Grouped(n->shards),
          absl::StrCat("the smallest N for which the coordinator's placement (PlaceChunks",
                       rep ? " + PlaceBackups" : "", ") puts every chunk on N DPU shards of ",
                       FormatBytes(dpu_cap), " at ", bytes_per_elem(rep),
                       " B per parameter; the bytes alone need ", Grouped(n->lower_bound), " (",
                       FormatBytes(all), " / ", FormatBytes(dpu_cap), ", rounded up); this cluster has ",
                       gpus, " DPUs (one per GPU)",
                       gpus >= n->shards ? "" : ": the rest needs host memory or more DPUs")));
    }
    report.sections.push_back(std::move(s));
  }

  // ---- this cluster: one DPU per GPU, one host shard per node ----
  const KernelFigure* fig = ChooseFigure(kernel, W);
  const double step_bytes = static_cast<double>(W * gb + 2 * layout.bytes_per_elem() + pb);
  const double elems_per_s_per_core = fig->bytes_per_s_per_core() / step_bytes;
  auto step_seconds = [&](uint64_t elems, uint32_t cores) {
    return static_cast<double>(elems) / (elems_per_s_per_core * cores);
  };
  uint64_t max_dpu_elems = 0, max_host_elems = 0;
  bool placed_ok = false;
  {
    PlanSection s;
    s.key = "cluster";
    const bool host_given = in.host_memory_bytes > 0;
    s.title = absl::StrCat("This cluster (", gpus, " DPU shards of ", Iec(in.dpu_memory_bytes),
                           ", one per GPU", host_given ? absl::StrCat("; ", nodes,
                                                                      " host shards of ",
                                                                      Iec(in.host_memory_bytes))
                                                       : "; no host shards",
                           ")");
    std::vector<ShardInfo> shards;
    for (uint64_t i = 0; i < gpus; ++i) {
      ShardInfo d;
      d.id = i + 1;
      d.is_dpu = true;
      d.memory_limit_bytes = dpu_cap;
      shards.push_back(d);
    }
    const uint64_t host_cap = host_given ? PlannableBytes(in.host_memory_bytes) : kUnboundedBytes;
    for (uint64_t i = 0; i < nodes; ++i) {
      ShardInfo h;
      h.id = gpus + i + 1;
      h.is_dpu = false;
      h.memory_limit_bytes = host_cap;
      shards.push_back(h);
    }
    absl::StatusOr<std::vector<ChunkSpec>> placed = Place(chunks, shards, bpe, W, replicated);
    if (!placed.ok()) {
      s.lines.push_back(Line("fits", "fits", 0, "bool", "no",
                             absl::StrCat("the coordinator's placement: ",
                                          placed.status().message())));
    } else {
      placed_ok = true;
      const std::map<uint64_t, ShardLoad> loads = LoadsOf(*placed, shards, bpe, W);
      uint64_t max_dpu_bytes = 0, max_host_bytes = 0, host_bytes = 0;
      for (const auto& [id, l] : loads) {
        if (l.is_dpu) {
          max_dpu_bytes = std::max(max_dpu_bytes, l.bytes);
          max_dpu_elems = std::max(max_dpu_elems, l.elems);
        } else {
          max_host_bytes = std::max(max_host_bytes, l.bytes);
          max_host_elems = std::max(max_host_elems, l.elems);
          host_bytes += l.bytes;
        }
      }
      const bool on_dpus = host_bytes == 0;
      s.lines.push_back(Line(
          "fits", "fits", on_dpus || host_given ? 1 : 0, "bool",
          on_dpus ? "yes, on the DPUs" : host_given ? "yes, with host shards" : "no",
          on_dpus ? absl::StrCat("the coordinator's placement puts every chunk",
                                 replicated ? " and its backup" : "", " on the ", gpus, " DPUs")
          : host_given
              ? absl::StrCat("the coordinator's placement fills the DPUs first and puts ",
                             FormatBytes(host_bytes), " on the host shards")
              : absl::StrCat("the DPUs hold ", FormatBytes(static_cast<double>(dpu_cap) * gpus),
                             "; ", FormatBytes(host_bytes),
                             " more needs host shards (--host_memory) or more DPUs")));
      s.lines.push_back(BytesLine(
          "dpu_optimizer_state_bytes",
          absl::StrCat("per DPU shard: optimizer state (fp32 master, ", moments, ")"),
          static_cast<double>(max_dpu_elems) * layout.bytes_per_elem(),
          absl::StrCat(FormatParams(max_dpu_elems), " (the fullest DPU shard",
                       replicated ? ", primaries and backups" : "", ") x ",
                       layout.bytes_per_elem(), " B")));
      s.lines.push_back(BytesLine(
          "dpu_shard_bytes", "per DPU shard: all it holds", static_cast<double>(max_dpu_bytes),
          absl::StrCat(FormatParams(max_dpu_elems), " x ", bpe, " B + its chunks' bookkeeping; ",
                       "of ", FormatBytes(dpu_cap), " plannable")));
      if (!on_dpus || host_given) {
        s.lines.push_back(BytesLine(
            "host_optimizer_state_bytes",
            absl::StrCat("per host shard: optimizer state (fp32 master, ", moments, ")"),
            static_cast<double>(max_host_elems) * layout.bytes_per_elem(),
            absl::StrCat(FormatParams(max_host_elems), " (the fullest host shard) x ",
                         layout.bytes_per_elem(), " B")));
        s.lines.push_back(BytesLine(
            "host_shard_bytes", "per host shard: all it holds",
            static_cast<double>(max_host_bytes),
            absl::StrCat(FormatParams(max_host_elems), " x ", bpe,
                         " B + its chunks' bookkeeping",
                         host_given ? absl::StrCat("; of ", FormatBytes(host_cap), " plannable")
                                    : "")));
      }
      if (!on_dpus && !host_given) {
        // The budget a node's host shard needs: what spills, plus the
        // staging eighth the shard keeps.
        const double need = std::ceil(static_cast<double>(max_host_bytes) * 8.0 / 7.0);
        s.lines.push_back(BytesLine(
            "host_memory_needed_bytes", "host memory needed per node", need,
            absl::StrCat(FormatBytes(max_host_bytes),
                         " spill to the fullest node's host shard, x 8/7 for its staging; "
                         "give it with --host_memory")));
      }
    }
    report.sections.push_back(std::move(s));
  }

  // ---- predicted optimizer step time ----
  {
    PlanSection s;
    s.key = "step_time";
    s.title = "Optimizer step time (predicted from measured kernel throughput)";
    s.lines.push_back(Line(
        "kernel_bytes_per_s_per_core", "measured fused pass, per core",
        fig->bytes_per_s_per_core(), "bytes_per_s", absl::StrCat(FormatBytes(fig->bytes_per_s_per_core()), "/s"),
        absl::StrFormat("%s, line %d: server_step W=%u (%s), %.3f G elements/s on %u thread%s x "
                        "%.0f B per element / %u",
                        kernel.source, fig->line, fig->workers,
                        fig->sweep.empty() ? "no sweep" : fig->sweep, fig->gparams_per_s,
                        fig->threads, fig->threads > 1 ? "s" : "", fig->bytes_per_elem(),
                        fig->threads)));
    s.lines.push_back(Line(
        "elems_per_s_per_core", "step rate per core", elems_per_s_per_core, "elements_per_s",
        absl::StrFormat("%.3f G elements/s", elems_per_s_per_core / 1e9),
        absl::StrFormat("%s/s / %.0f B per element (%u x %u B gradient slots + %u B %s state "
                        "read and written + %u B published copy)",
                        FormatBytes(fig->bytes_per_s_per_core()), step_bytes, W,
                        static_cast<unsigned>(gb), static_cast<unsigned>(2 * layout.bytes_per_elem()),
                        opt_name, static_cast<unsigned>(pb))));
    const std::string scaling =
        " (assumes the rate scales with cores; memory bandwidth caps it, and cores unlike the "
        "measured machine's need their own --kernel_bench)";
    if (placed_ok) {
      if (max_dpu_elems > 0) {
        const double t = step_seconds(max_dpu_elems, in.dpu_cores);
        s.lines.push_back(Line(
            "dpu_step_seconds", "per DPU shard, this cluster", t, "seconds", FormatSeconds(t),
            absl::StrCat(FormatParams(max_dpu_elems), " stepped on the fullest DPU shard / (",
                         absl::StrFormat("%.3f G", elems_per_s_per_core / 1e9),
                         " elements/s x ", in.dpu_cores, " cores)", scaling)));
      }
      if (max_host_elems > 0) {
        const double t = step_seconds(max_host_elems, in.host_cores);
        s.lines.push_back(Line(
            "host_step_seconds", "per host shard, this cluster", t, "seconds", FormatSeconds(t),
            absl::StrCat(FormatParams(max_host_elems), " stepped on the fullest host shard / (",
                         absl::StrFormat("%.3f G", elems_per_s_per_core / 1e9),
                         " elements/s x ", in.host_cores, " cores)", scaling)));
      }
    }
    const absl::StatusOr<ShardCount>& n = needed[replicated ? 1 : 0];
    if (n.ok()) {
      uint64_t max_elems = 0;
      for (const auto& [id, l] : n->loads) max_elems = std::max(max_elems, l.elems);
      const double t = step_seconds(max_elems, in.dpu_cores);
      s.lines.push_back(Line(
          "needed_dpu_step_seconds",
          absl::StrCat("per DPU shard, on the ", Grouped(n->shards), " needed"), t, "seconds",
          FormatSeconds(t),
          absl::StrCat(FormatParams(max_elems), " stepped on the fullest of ", Grouped(n->shards),
                       " DPU shards (replication ", in.replication, ") / (",
                       absl::StrFormat("%.3f G", elems_per_s_per_core / 1e9), " elements/s x ",
                       in.dpu_cores, " cores)", scaling)));
    }
    report.sections.push_back(std::move(s));
  }
  return report;
}

}  // namespace plan
}  // namespace optimus
