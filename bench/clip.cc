// bench/clip: what the clipping round costs a step (issue 11). One job of
// --params_mi Mi parameters (bf16 gradients and parameters, AdamW, W=2
// workers, 3 shard servers; tests/harness: real coordinator, shards and
// clients in this process, the data plane over UCX on lo) trains in three
// configurations, in alternating phases so the VM's drift hits all alike:
//
//   no_round  skip_nonfinite off, no clipping: pushes are answered as they
//             land and each chunk steps when its W pushes are in (the
//             baseline);
//   skip      skip_nonfinite on (the default): the round (every chunk's
//             partial sum of squares back with the push replies, a commit
//             from the workers) without clipping;
//   clip      max_grad_norm 1.0 and skip_nonfinite: the same round, the
//             gradient scaled by the clip coefficient.
//
// Prints one JSON line with the mean step time and steps/s of each, and the
// ratio of each to the baseline.
//
// Usage: bazel run -c opt //bench:clip -- [--params_mi=64] [--steps=10]
//        [--rounds=3] [--transport=ucx|loopback]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/json.h"
#include "tests/harness/cluster.h"

ABSL_FLAG(int64_t, params_mi, 64, "model size, Mi parameters");
ABSL_FLAG(int, steps, 10, "timed steps per phase");
ABSL_FLAG(int, rounds, 3, "phases of each configuration");
ABSL_FLAG(std::string, transport, "ucx", "data plane: ucx (UCX on lo) or loopback");

namespace optimus {
namespace bench {
namespace {

using harness::Cluster;

constexpr uint32_t kWorkers = 2;
constexpr uint64_t kWarmup = 2;

void Check(const absl::Status& s, const char* what) {
  if (s.ok()) return;
  std::fprintf(stderr, "bench/clip: %s: %s\n", what, s.ToString().c_str());
  std::exit(1);
}

client::JobDef Job(const std::string& name, int64_t params_mi, const std::string& config) {
  client::JobDef def = harness::SmallJob(name, kWorkers, /*max_chunk_bytes=*/0);
  def.tensors = {{"weight", {params_mi * 1024, 1024}}, {"bias", {1024}}};
  def.optimizer.lr = 1e-3f;
  def.skip_nonfinite = config != "no_round";
  def.max_grad_norm = config == "clip" ? 1.0f : 0.0f;
  return def;
}

int Main() {
  const int64_t params_mi = absl::GetFlag(FLAGS_params_mi);
  const int steps = absl::GetFlag(FLAGS_steps);
  const int rounds = absl::GetFlag(FLAGS_rounds);
  const std::string transport = absl::GetFlag(FLAGS_transport);
  if (params_mi <= 0 || steps < 1 || rounds < 1 ||
      (transport != "ucx" && transport != "loopback")) {
    std::fprintf(stderr, "bench/clip: --params_mi > 0, --steps >= 1, --rounds >= 1, "
                         "--transport=ucx|loopback\n");
    return 2;
  }
  harness::ClusterOptions options;
  options.transport =
      transport == "ucx" ? harness::TransportKind::kUcx : harness::TransportKind::kLoopback;
  options.num_shards = 3;
  options.num_workers = kWorkers;
  options.shard_memory_limit_bytes = uint64_t{4} << 30;
  options.wait = absl::Minutes(5);
  auto started = Cluster::Start(options);
  Check(started.status(), "starting the cluster");
  Cluster& c = **started;
  const char* configs[] = {"no_round", "skip", "clip"};
  std::map<std::string, double> total_ms;
  int job = 0;
  for (int round = 0; round < rounds; ++round) {
    for (const char* config : configs) {
      const std::string name = absl::StrCat(config, "-", job++);
      Check(c.CreateJob(Job(name, params_mi, config)), "creating a job");
      Check(c.Train(1, kWarmup), "warm-up");
      const absl::Time t0 = absl::Now();
      Check(c.Train(kWarmup + 1, kWarmup + steps), "training");
      total_ms[config] += absl::ToDoubleMilliseconds(absl::Now() - t0);
      Check(c.LeaveJob(), "leaving");
      Check(c.DeleteJob(name).status(), "deleting");
    }
  }
  const double n = static_cast<double>(rounds) * steps;
  const double base = total_ms["no_round"] / n;
  const double skip = total_ms["skip"] / n;
  const double clip = total_ms["clip"] / n;
  Json line;
  line["bench"] = "clip_round";
  line["transport"] = transport;
  line["params"] = static_cast<int64_t>(params_mi) << 20;
  line["workers"] = kWorkers;
  line["shards"] = 3;
  line["rounds"] = rounds;
  line["steps_per_phase"] = steps;
  line["no_round_ms_per_step"] = JsonRound(base, 1);
  line["skip_ms_per_step"] = JsonRound(skip, 1);
  line["clip_ms_per_step"] = JsonRound(clip, 1);
  line["no_round_steps_per_s"] = JsonRound(1000.0 / base, 3);
  line["clip_steps_per_s"] = JsonRound(1000.0 / clip, 3);
  line["ratio_skip_to_no_round"] = JsonRound(skip / base, 3);
  line["ratio_clip_to_no_round"] = JsonRound(clip / base, 3);
  line["clip_round_ms_per_step"] = JsonRound(clip - base, 1);
  std::printf("%s\n", JsonDump(line).c_str());
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace optimus

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return optimus::bench::Main();
}
