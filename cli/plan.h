// Sizing a deployment (`optimusctl plan`): from a model, a parallelism layout
// (DP, TP, PP, ZeRO stage), the optimizer and dtypes and the hardware, what
// each GPU holds with and without optimus, what each DPU / host shard holds,
// how many shards the model needs (placed by the coordinator's own code,
// coordinator/shard_map.h, with the shard's own accounting,
// kernels::ShardBytesPerElem), and the predicted optimizer step time from
// measured kernel throughput (bench/kernels). Every figure comes with the
// line of arithmetic behind it.
// Pure computation over plain values (no I/O); safe from any thread.
#ifndef OPTIMUS_CLI_PLAN_H_
#define OPTIMUS_CLI_PLAN_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "coordinator/shard_map.h"
#include "kernels/optimizer_spec.h"

namespace optimus {
namespace plan {

// One `server_step` line of bench/kernels: the shard's fused pass (W bf16
// gradient slots summed, AdamW on fp32 master/m/v, a bf16 published copy).
struct KernelFigure {
  uint32_t workers = 0;       // W: gradient slots summed per element.
  uint32_t threads = 0;       // Threads the pass ran on.
  double gparams_per_s = 0;   // Elements per second over all threads, / 1e9.
  uint64_t params = 0;        // Elements per pass.
  std::string sweep;          // "headline", "threads" or "size".
  std::string isa;            // kernels::ActiveIsa() of the machine.
  int line = 0;               // Line of the source it came from (1-based).
  // Bytes the measured pass moves per element, as bench/kernels counts
  // them: 2W (bf16 slots) + 12 + 12 (fp32 p, m, v read and written) + 2
  // (bf16 copy written).
  double bytes_per_elem() const { return 2.0 * workers + 26.0; }
  // Memory traffic per second per core: what the prediction scales.
  double bytes_per_s_per_core() const {
    return gparams_per_s * 1e9 * bytes_per_elem() / threads;
  }
};

struct KernelBench {
  std::vector<KernelFigure> figures;  // The server_step lines, in order.
  std::string source;                 // Where they came from, for the accounting.
};

// Parses bench/kernels output: one JSON object per line (blank lines are
// skipped; lines of other benches are read and left out). INVALID_ARGUMENT
// naming `source` and the line for a line that is not a JSON object or a
// server_step line missing a field or with a non-positive figure, and when
// no server_step line is there at all ("run bench/kernels with
// --benches=server_step").
absl::StatusOr<KernelBench> ParseKernelBench(absl::string_view text, absl::string_view source);

// The figures recorded in the repo (docs/benchmarks.md): the default of
// `--kernel_bench`.
const KernelBench& DefaultKernelBench();

struct PlanInput {
  // The model: its tensors' element counts (a preset, a job spec), or, when
  // empty, one tensor of num_params elements (`--params`).
  std::string model_name;  // For display: "llama-70b", a file name, "--params".
  std::vector<uint64_t> tensor_num_elems;
  uint64_t num_params = 0;  // Used only when tensor_num_elems is empty.

  // Parallelism: GPUs = dp * tp * pp. Each of the dp replicas of a model
  // partition pushes its gradients to the shards (the job's world size per
  // chunk is dp).
  uint32_t dp = 1, tp = 1, pp = 1;
  // ZeRO stage 0-3: 1 partitions the optimizer state (and master) over DP,
  // 2 also the gradients, 3 also the weights.
  uint32_t zero_stage = 0;

  kernels::OptimizerKind optimizer = kernels::OptimizerKind::kAdamW;
  DType param_dtype = DType::kBf16;  // Weights on the GPU, published copies on shards.
  DType grad_dtype = DType::kBf16;   // Gradients on the GPU and on the wire.
  // The GPU's own master copy without optimus (mixed precision); nullopt:
  // none (the weights are the master, e.g. fp32 training). A shard always
  // keeps an fp32 master.
  std::optional<DType> master_dtype = DType::kFp32;

  // Hardware. One DPU per GPU, one host shard per node when
  // host_memory_bytes > 0.
  uint32_t gpus_per_node = 8;
  uint64_t gpu_memory_bytes = uint64_t{80} << 30;  // A100 80GB.
  // Each DPU's memory for optimus (the shard's --memory_limit_mb); an eighth
  // of it is kept for gradients in flight, as the shard does by default.
  // Default: what docs/operations.md sets on a BlueField-3 (32 GB of DRAM,
  // the rest for the DPU's own OS).
  uint64_t dpu_memory_bytes = uint64_t{26000} << 20;
  uint32_t dpu_cores = 16;                         // BlueField-3's Arm A78 cores.
  // Each node's host memory for a host shard; 0: no host shards (the plan
  // then says how much host memory the DPUs would need beside them).
  uint64_t host_memory_bytes = 0;
  uint32_t host_cores = 32;

  // Job settings that change what a shard holds per element.
  uint32_t replication = 0;  // 0 or 1: a backup of every chunk on another shard.
  // Steps wait for a commit round (clipping or skipping non-finite steps,
  // the job default): every chunk holds its gradients until then.
  bool holds_grads = true;
  // Chunk size as a job spec gives it: gradient bytes per push, or, when
  // max_chunk_bytes > 0, fp32 state bytes per chunk (which wins).
  uint64_t chunk_payload_bytes = kDefaultChunkPayloadBytes;
  uint64_t max_chunk_bytes = 0;

  // Measured fused-pass throughput; DefaultKernelBench() when empty.
  KernelBench kernel;
};

// One figure of the report.
struct PlanLine {
  std::string key;         // Stable name in -o json/yaml: "params", "total_bytes".
  std::string label;       // What the table prints: "parameters held".
  double value = 0;        // In `unit`.
  std::string unit;        // "params", "bytes", "shards", "seconds", "count",
                           // "bytes_per_elem", "bytes_per_s", "elements_per_s",
                           // "bool" (1 or 0); "" for text only.
  std::string text;        // The value as printed: "8.75 B params", "140.00 GB".
  std::string accounting;  // How it was computed, with the numbers.
};

struct PlanSection {
  std::string key;    // "model", "per_gpu", "shards", "cluster", "step_time".
  std::string title;  // "Per GPU (DP 2 x TP 2 x PP 4, ZeRO-3)".
  std::vector<PlanLine> lines;
};

struct PlanReport {
  std::vector<PlanSection> sections;
  // The line `key` of section `section`; nullptr when there is none.
  const PlanLine* Find(absl::string_view section, absl::string_view key) const;
};

// INVALID_ARGUMENT naming the flag (e.g. "--zero must be 0, 1, 2 or 3") when
// an input is out of range. A model that does not fit the cluster is not an
// error: the report says so and how many shards it needs.
absl::StatusOr<PlanReport> ComputePlan(const PlanInput& in);

// "8.75 B params", "124.44 M params"; "140.00 GB" (decimal: GB = 1e9 bytes,
// the paper's unit).
std::string FormatParams(double params);
std::string FormatBytes(double bytes);

}  // namespace plan
}  // namespace optimus

#endif  // OPTIMUS_CLI_PLAN_H_
