// bench/kernels: throughput of the shard server's fused optimizer pass,
// against baselines measured in the same run. Prints one JSON object per line:
//
//   adamw_fp32   fp32 params, grads and moments. The fused AdamW step against
//                (a) the bandwidth ceiling: a pass with the same access
//                pattern (read p, g, m, v; write p, m, v) and no math, and
//                (b) torch::optim::AdamW on a tensor of the same size.
//   server_step  W bf16 gradient slots summed in rank order, AdamW on the
//                fp32 state and a bf16 published copy, in one pass, against
//                (a) a no-math pass with the fused pass's access pattern and
//                (b) the best unfused pipeline: a vectorized pass summing the
//                W slots into fp32, the fp32 step, then a vectorized cast.
//   grad_norm    the gradient-norm pass of global clipping
//                (kernels::GradSumOfSquares) over W bf16 slots (--norm_workers),
//                against the bandwidth ceiling of reading the same bytes: a
//                pass with the same reads, prefetches, split and order and no
//                math (kernels::ReadGradsPass). Two headline lines: slots
//                mapped as the shard server maps them ("slots": "mmap"), and
//                slots from this file's aligned_alloc ("aligned_alloc"), a
//                layout the pass is slower on; sweeps use "mmap".
//
// Each figure is the best of --reps timed runs after one warm-up run (the
// best, because on a shared machine noise only ever adds time). Runs of the
// candidates are interleaved so drift hits them alike. Sweeps over the number
// of threads (1..--threads) and over sizes (--sizes, in Mi parameters) follow
// the headline lines; their lines carry "sweep": "threads" or "size".
//
// Usage: bazel run -c opt //bench:kernels -- [--params_mi=64] [--threads=N]
//        [--reps=5] [--sizes=1,4,16,64,256] [--sweeps=true] [--libtorch=true]
//        [--benches=adamw_fp32,server_step,grad_norm] [--norm_workers=3]
#include <sys/mman.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/dtype.h"
#include "common/json.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/passes.h"
#include "kernels/cpu/thread_pool.h"

ABSL_FLAG(int64_t, params_mi, 64, "parameters (Mi = 2^20) for the headline lines");
ABSL_FLAG(int64_t, params, 0, "exact parameter count for the headline lines; overrides --params_mi");
ABSL_FLAG(int, threads, 0, "threads for the headline lines; 0: all cores");
ABSL_FLAG(int, reps, 5, "timed runs per figure (best is kept), after one warm-up");
ABSL_FLAG(std::string, sizes, "1,4,16,64,256", "size sweep, Mi parameters each");
ABSL_FLAG(std::string, workers, "1,2,4,8", "server_step worker counts");
ABSL_FLAG(bool, sweeps, true, "also run the thread and size sweeps");
ABSL_FLAG(bool, libtorch, true, "measure torch::optim::AdamW (slow at large sizes)");
ABSL_FLAG(std::string, benches, "adamw_fp32,server_step,grad_norm",
          "which benches to run (headline lines and sweeps)");
ABSL_FLAG(int, norm_workers, 3, "grad_norm: number of bf16 gradient slots");

namespace optimus {
namespace bench {
namespace {

using Clock = std::chrono::steady_clock;

// 64-byte aligned, zero-initialized by the caller's fill; freed with free().
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
using Buffer = std::unique_ptr<T[], FreeDeleter>;

template <typename T>
Buffer<T> Alloc(size_t num_elems) {
  const size_t bytes = ((num_elems * sizeof(T) + 63) / 64) * 64;
  void* p = std::aligned_alloc(64, bytes);
  if (p == nullptr) {
    std::fprintf(stderr, "bench/kernels: out of memory allocating %zu bytes\n", bytes);
    std::exit(1);
  }
  return Buffer<T>(static_cast<T*>(p));
}

// A buffer mapped from the kernel, as the shard server maps its buffers of
// 64 KiB and more (server/job_table.cc): page aligned, and adjacent maps of
// one size lie a whole number of sizes apart. The pass over several slots is
// sensitive to how the slots lie relative to each other (docs/benchmarks.md).
struct Mapped {
  void* data = nullptr;
  size_t bytes = 0;
  explicit Mapped(size_t n_bytes) : bytes(n_bytes) {
    data = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data == MAP_FAILED) {
      std::fprintf(stderr, "bench/kernels: mmap of %zu bytes failed\n", bytes);
      std::exit(1);
    }
  }
  ~Mapped() { munmap(data, bytes); }
  Mapped(const Mapped&) = delete;
  Mapped& operator=(const Mapped&) = delete;
};

// Fills with small normal values (no denormals, no overflow over many steps),
// split over the pool so pages are touched before timing.
void FillNormal(float* dst, size_t n, float stddev, uint32_t seed, kernels::ThreadPool* pool) {
  pool->ParallelFor(n, 1 << 16, [&](size_t b, size_t e) {
    std::mt19937 rng(seed + static_cast<uint32_t>(b >> 16));
    std::normal_distribution<float> dist(0.0f, stddev);
    for (size_t i = b; i < e; ++i) dst[i] = dist(rng);
  });
}

void FillConst(float* dst, size_t n, float value, kernels::ThreadPool* pool) {
  pool->ParallelFor(n, 1 << 16, [&](size_t b, size_t e) { std::fill(dst + b, dst + e, value); });
}

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "bench/kernels: %s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

double SecondsOf(const std::function<void()>& fn) {
  const auto t0 = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Runs every candidate once to warm up, then `reps` rounds of all of them in
// turn; returns each one's best time in seconds.
std::vector<double> BestTimes(const std::vector<std::function<void()>>& candidates, int reps) {
  std::vector<double> best(candidates.size(), 1e300);
  for (const auto& c : candidates) c();
  for (int r = 0; r < reps; ++r) {
    for (size_t i = 0; i < candidates.size(); ++i) {
      best[i] = std::min(best[i], SecondsOf(candidates[i]));
    }
  }
  return best;
}

kernels::OptimizerHyper AdamW() {
  kernels::OptimizerHyper h;
  h.kind = kernels::OptimizerKind::kAdamW;
  h.lr = 1e-4f;
  h.weight_decay = 0.01f;
  return h;
}

const char* SweepName(const char* sweep) { return sweep == nullptr ? "" : sweep; }

// ---- adamw_fp32 ----------------------------------------------------------

void BenchAdamWFp32(size_t n, int threads, int reps, bool with_libtorch, const char* sweep) {
  kernels::ThreadPool pool(threads);
  Buffer<float> p = Alloc<float>(n), g = Alloc<float>(n), m = Alloc<float>(n), v = Alloc<float>(n);
  FillNormal(p.get(), n, 1.0f, 1, &pool);
  FillNormal(g.get(), n, 1e-2f, 2, &pool);
  FillConst(m.get(), n, 0.0f, &pool);
  FillConst(v.get(), n, 0.0f, &pool);

  const void* slots[1] = {g.get()};
  kernels::StepInputs in;
  in.grads = absl::MakeConstSpan(slots, 1);
  in.grad_dtype = DType::kFp32;
  in.grad_scale = 1.0f;
  const kernels::OptimizerHyper hyper = AdamW();
  kernels::ChunkState state{p.get(), m.get(), v.get()};
  int64_t step = 0;

  auto fused = [&] {
    in.step = ++step;
    Check(kernels::FusedStep(hyper, in, n, state, nullptr, DType::kFp32, &pool), "FusedStep");
  };
  auto ceiling = [&] {
    Check(kernels::BandwidthCeilingPass(in, n, state, nullptr, DType::kFp32, 0, &pool),
          "BandwidthCeilingPass");
  };
  const std::vector<double> t = BestTimes({fused, ceiling}, reps);
  const double x = n / t[0] / 1e9, c = n / t[1] / 1e9;

  double l = 0;
  if (with_libtorch) {
    // torch's intra-op pool gets the same number of threads.
    torch::set_num_threads(threads);
    torch::NoGradGuard no_grad_for_setup;
    torch::Tensor tp = torch::from_blob(p.get(), {static_cast<int64_t>(n)}, torch::kFloat32).clone();
    torch::Tensor tg = torch::from_blob(g.get(), {static_cast<int64_t>(n)}, torch::kFloat32).clone();
    tp.set_requires_grad(true);
    tp.mutable_grad() = tg;
    torch::optim::AdamW opt(std::vector<torch::Tensor>{tp},
                            torch::optim::AdamWOptions(hyper.lr)
                                .betas({hyper.beta1, hyper.beta2})
                                .eps(hyper.eps)
                                .weight_decay(hyper.weight_decay));
    const std::vector<double> tt = BestTimes({[&] { opt.step(); }}, std::max(2, reps / 2));
    l = n / tt[0] / 1e9;
  }
  Json line;
  line["bench"] = "adamw_fp32";
  line["sweep"] = SweepName(sweep);
  line["isa"] = std::string(kernels::ActiveIsa());
  line["params"] = n;
  line["threads"] = threads;
  line["gparams_per_s"] = JsonRound(x, 4);
  line["ceiling_gparams_per_s"] = JsonRound(c, 4);
  line["ceiling_gbytes_per_s"] = JsonRound(c * 28.0, 2);
  line["libtorch_gparams_per_s"] = with_libtorch ? Json(JsonRound(l, 6)) : Json(nullptr);
  line["ratio_to_ceiling"] = JsonRound(x / c, 3);
  line["ratio_to_libtorch"] = with_libtorch ? Json(JsonRound(x / l, 6)) : Json(nullptr);
  std::printf("%s\n", JsonDump(line).c_str());
  std::fflush(stdout);
}

// ---- server_step -----------------------------------------------------------

void BenchServerStep(size_t n, int workers, int threads, int reps, const char* sweep) {
  kernels::ThreadPool pool(threads);
  Buffer<float> p = Alloc<float>(n), m = Alloc<float>(n), v = Alloc<float>(n);
  Buffer<float> sum = Alloc<float>(n);  // the unfused pipeline's fp32 gradient
  Buffer<uint16_t> out = Alloc<uint16_t>(n);
  std::vector<Buffer<uint16_t>> slots;
  std::vector<const void*> slot_ptrs;
  {
    Buffer<float> tmp = Alloc<float>(n);
    for (int w = 0; w < workers; ++w) {
      FillNormal(tmp.get(), n, 1e-2f, 10 + w, &pool);
      slots.push_back(Alloc<uint16_t>(n));
      kernels::CastFromFp32(tmp.get(), n, slots.back().get(), DType::kBf16, &pool);
      slot_ptrs.push_back(slots.back().get());
    }
  }
  FillNormal(p.get(), n, 1.0f, 1, &pool);
  FillConst(m.get(), n, 0.0f, &pool);
  FillConst(v.get(), n, 0.0f, &pool);
  FillConst(sum.get(), n, 0.0f, &pool);

  kernels::StepInputs in;
  in.grads = absl::MakeConstSpan(slot_ptrs);
  in.grad_dtype = DType::kBf16;
  in.grad_scale = 1.0f / static_cast<float>(workers);
  const kernels::OptimizerHyper hyper = AdamW();
  kernels::ChunkState state{p.get(), m.get(), v.get()};
  int64_t step = 0;

  auto fused = [&] {
    in.step = ++step;
    Check(kernels::FusedStep(hyper, in, n, state, out.get(), DType::kBf16, &pool), "FusedStep");
  };
  auto ceiling = [&] {
    Check(kernels::BandwidthCeilingPass(in, n, state, out.get(), DType::kBf16, 0, &pool),
          "BandwidthCeilingPass");
  };
  auto unfused = [&] {
    Check(kernels::SumGradsToFp32(in, n, sum.get(), &pool), "SumGradsToFp32");
    const void* one[1] = {sum.get()};
    kernels::StepInputs fp32_in;
    fp32_in.grads = absl::MakeConstSpan(one, 1);
    fp32_in.grad_dtype = DType::kFp32;
    fp32_in.grad_scale = 1.0f;
    fp32_in.step = ++step;
    Check(kernels::FusedStep(hyper, fp32_in, n, state, nullptr, DType::kFp32, &pool), "step");
    kernels::CastFromFp32(p.get(), n, out.get(), DType::kBf16, &pool);
  };
  const std::vector<double> t = BestTimes({fused, ceiling, unfused}, reps);
  const double x = n / t[0] / 1e9, c = n / t[1] / 1e9, u = n / t[2] / 1e9;
  // Bytes per parameter of the fused pass: W bf16 slots + p, m, v read;
  // p, m, v and the bf16 copy written.
  const double bytes_per_param = 2.0 * workers + 12 + 12 + 2;
  Json line;
  line["bench"] = "server_step";
  line["sweep"] = SweepName(sweep);
  line["isa"] = std::string(kernels::ActiveIsa());
  line["workers"] = workers;
  line["grad_dtype"] = "bf16";
  line["out_dtype"] = "bf16";
  line["params"] = n;
  line["threads"] = threads;
  line["gparams_per_s"] = JsonRound(x, 4);
  line["ceiling_gparams_per_s"] = JsonRound(c, 4);
  line["ceiling_gbytes_per_s"] = JsonRound(c * bytes_per_param, 2);
  line["unfused_gparams_per_s"] = JsonRound(u, 4);
  line["ratio_to_ceiling"] = JsonRound(x / c, 3);
  line["ratio_to_unfused"] = JsonRound(x / u, 3);
  std::printf("%s\n", JsonDump(line).c_str());
  std::fflush(stdout);
}

// ---- grad_norm -------------------------------------------------------------

void BenchGradNorm(size_t n, int workers, int threads, int reps, bool mapped_slots,
                   const char* sweep) {
  kernels::ThreadPool pool(threads);
  std::vector<Buffer<uint16_t>> allocated;
  std::vector<std::unique_ptr<Mapped>> mapped;
  std::vector<const void*> slot_ptrs;
  {
    Buffer<float> tmp = Alloc<float>(n);
    for (int w = 0; w < workers; ++w) {
      FillNormal(tmp.get(), n, 1e-2f, 10 + w, &pool);
      void* slot;
      if (mapped_slots) {
        mapped.push_back(std::make_unique<Mapped>(2 * n));
        slot = mapped.back()->data;
      } else {
        allocated.push_back(Alloc<uint16_t>(n));
        slot = allocated.back().get();
      }
      kernels::CastFromFp32(tmp.get(), n, slot, DType::kBf16, &pool);
      slot_ptrs.push_back(slot);
    }
  }
  kernels::StepInputs in;
  in.grads = absl::MakeConstSpan(slot_ptrs);
  in.grad_dtype = DType::kBf16;
  in.grad_scale = 1.0f / static_cast<float>(workers);

  double sum_of_squares = 0;
  uint32_t bits = 0;
  auto norm = [&] {
    absl::StatusOr<double> r = kernels::GradSumOfSquares(in, n, &pool);
    Check(r.status(), "GradSumOfSquares");
    sum_of_squares = *r;
  };
  auto ceiling = [&] {
    absl::StatusOr<uint32_t> r = kernels::ReadGradsPass(in, n, &pool);
    Check(r.status(), "ReadGradsPass");
    bits |= *r;
  };
  const std::vector<double> t = BestTimes({norm, ceiling}, reps);
  const double bytes = 2.0 * workers * static_cast<double>(n);  // W bf16 slots read
  const double x = bytes / t[0] / 1e9, c = bytes / t[1] / 1e9;
  Json line;
  line["bench"] = "grad_norm";
  line["sweep"] = SweepName(sweep);
  line["isa"] = std::string(kernels::ActiveIsa());
  line["workers"] = workers;
  line["grad_dtype"] = "bf16";
  line["slots"] = mapped_slots ? "mmap" : "aligned_alloc";
  line["params"] = n;
  line["threads"] = threads;
  line["gparams_per_s"] = JsonRound(n / t[0] / 1e9, 4);
  line["gbytes_per_s"] = JsonRound(x, 2);
  line["ceiling_gbytes_per_s"] = JsonRound(c, 2);
  line["ratio_to_ceiling"] = JsonRound(x / c, 3);
  line["grad_norm"] = std::sqrt(sum_of_squares);
  line["read_bits"] = bits;
  std::printf("%s\n", JsonDump(line).c_str());
  std::fflush(stdout);
}

std::vector<int64_t> ParseList(const std::string& s, const char* flag) {
  std::vector<int64_t> out;
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int64_t x;
    if (!absl::SimpleAtoi(part, &x) || x <= 0) {
      std::fprintf(stderr, "bench/kernels: --%s: '%s' is not a positive integer\n", flag,
                   std::string(part).c_str());
      std::exit(2);
    }
    out.push_back(x);
  }
  return out;
}

int Main() {
  const int nproc = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = absl::GetFlag(FLAGS_threads) > 0 ? absl::GetFlag(FLAGS_threads) : nproc;
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  const bool libtorch = absl::GetFlag(FLAGS_libtorch);
  if (absl::GetFlag(FLAGS_params_mi) <= 0) {
    std::fprintf(stderr, "bench/kernels: --params_mi must be positive\n");
    return 2;
  }
  const size_t n = absl::GetFlag(FLAGS_params) > 0
                       ? static_cast<size_t>(absl::GetFlag(FLAGS_params))
                       : static_cast<size_t>(absl::GetFlag(FLAGS_params_mi)) << 20;
  const std::vector<int64_t> sizes = ParseList(absl::GetFlag(FLAGS_sizes), "sizes");
  const std::vector<int64_t> workers = ParseList(absl::GetFlag(FLAGS_workers), "workers");
  const int norm_workers = absl::GetFlag(FLAGS_norm_workers);
  if (norm_workers <= 0) {
    std::fprintf(stderr, "bench/kernels: --norm_workers must be positive\n");
    return 2;
  }
  bool adamw = false, server = false, norm = false;
  for (absl::string_view b : absl::StrSplit(absl::GetFlag(FLAGS_benches), ',', absl::SkipEmpty())) {
    if (b == "adamw_fp32") {
      adamw = true;
    } else if (b == "server_step") {
      server = true;
    } else if (b == "grad_norm") {
      norm = true;
    } else {
      std::fprintf(stderr, "bench/kernels: --benches: unknown bench '%s'\n",
                   std::string(b).c_str());
      return 2;
    }
  }

  if (adamw) BenchAdamWFp32(n, threads, reps, libtorch, "headline");
  if (server) {
    for (int64_t w : workers) BenchServerStep(n, static_cast<int>(w), threads, reps, "headline");
  }
  if (norm) {
    BenchGradNorm(n, norm_workers, threads, reps, /*mapped_slots=*/true, "headline");
    BenchGradNorm(n, norm_workers, threads, reps, /*mapped_slots=*/false, "headline");
  }
  if (!absl::GetFlag(FLAGS_sweeps)) return 0;
  for (int t = 1; t <= nproc; ++t) {
    if (adamw) BenchAdamWFp32(n, t, reps, libtorch, "threads");
    if (server) BenchServerStep(n, 4, t, reps, "threads");
    if (norm) BenchGradNorm(n, norm_workers, t, reps, /*mapped_slots=*/true, "threads");
  }
  for (int64_t mi : sizes) {
    const size_t sn = static_cast<size_t>(mi) << 20;
    if (adamw) BenchAdamWFp32(sn, threads, reps, libtorch, "size");
    if (server) BenchServerStep(sn, 4, threads, reps, "size");
    if (norm) BenchGradNorm(sn, norm_workers, threads, reps, /*mapped_slots=*/true, "size");
  }
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace optimus

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return optimus::bench::Main();
}
