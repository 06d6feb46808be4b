// bench/e2e: how much of the optimizer optimus leaves exposed in a training
// iteration (issue 13 item 5). W workers (threads of this process, each a
// real liboptimus Client) run a model whose accelerator compute is emulated
// from a profile: per-layer forward and backward times (slept: GPU time does
// not use the CPU) and the layers' real parameter shapes. They push real
// bf16 gradients of the real sizes to, and pull real bf16 parameters from,
// real optimus-shard processes (started with optimus-coord as children, as
// a deployment starts them) running AdamW, in four schedules:
//
//   compute     the profile alone: no optimizer at all (the baseline);
//   no_overlap  today's blocking ModuleSync: pull every parameter, forward,
//               backward, push every gradient and wait (PullParams /
//               PushGrads);
//   layerwise   ModuleSync's layerwise mode: each tensor's gradient is pushed
//               when the backward reaches it (its share of the layer's
//               backward time, in backward order) and its next version is
//               pulled right after (answered as its chunks publish); each
//               layer's forward waits only for its own tensors;
//   delayed     ModuleSync's delayed mode: step t's forward uses version
//               t - 1; version t is pulled during iteration t and each push
//               of step t goes out once its tensor's version t has landed
//               (at the end of backward otherwise).
//
// The schedules are ModuleSync's (client/torch/module_sync.h), replayed on
// the Client without libtorch so that no CPU time goes to what an
// accelerator would do (casting gradients, copying parameters).
//
// Prints one JSON object per line: the cluster's commands; per (profile,
// mode) the mean and median iteration (the slowest rank's) and the exposed
// fraction (iteration - compute) / compute, compute being the compute-only
// mode's mean (and median) iteration in the same run; per profile a summary with the paper's
// ZeRO-Infinity figure beside them and the issue's two goals. It fails
// unless every rank ends with the same parameters and training moved them.
//
// Profiles (the OptimusNIC paper's Table 3, A100, torch
// TransformerDecoderLayer of d_model 3072 and dim_feedforward 12288: 151M
// parameters each):
//   paper1  1 layer,  forward 147.283 ms, backward 255.772 ms;
//           ZeRO-Infinity's CPU offload: +59.2% per iteration;
//   paper2  2 layers, forward 200.493 ms, backward 550.389 ms (halved per
//           layer); ZeRO-Infinity: +51.7%.
//
// Usage: bazel run -c opt //bench:e2e -- [--profiles=paper1,paper2]
//        [--workers=2] [--shards=2] [--iterations=8] [--warmup=2]
//        [--d_model=3072 --d_ff=12288] [--tls=] [--skip_nonfinite=false]
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "bench/proc_cluster.h"
#include "client/client.h"
#include "common/json.h"

ABSL_FLAG(std::string, profiles, "paper1,paper2", "profiles to run: paper1, paper2");
ABSL_FLAG(int, workers, 2, "workers W (threads, one Client each)");
ABSL_FLAG(int, shards, 2, "optimus-shard processes S");
ABSL_FLAG(int, iterations, 8, "timed iterations per mode");
ABSL_FLAG(int, warmup, 2, "untimed iterations before them, per mode");
ABSL_FLAG(int64_t, d_model, 3072, "the layers' d_model (3072: the paper's 151M parameters)");
ABSL_FLAG(int64_t, d_ff, 12288, "the layers' dim_feedforward");
ABSL_FLAG(std::string, tls, "", "UCX_TLS for shards and workers; empty: UCX's choice");
ABSL_FLAG(bool, skip_nonfinite, false,
          "create the job with skip_nonfinite (a commit round per step: no chunk steps before "
          "every rank pushed every tensor)");
ABSL_FLAG(int64_t, shard_memory_mb, 0, "each shard's --memory_limit_mb; 0: from the model size");
ABSL_FLAG(std::string, shard_args, "", "extra optimus-shard flags, space-separated");
ABSL_FLAG(std::string, bin_dir, "", "folder holding coordinator/optimus-coord and "
                                    "server/optimus-shard (default: this binary's runfiles)");
ABSL_FLAG(std::string, work_dir, "", "folder for logs (default: a new temp dir)");

namespace optimus {
namespace bench {
namespace {

FILE* g_out = stdout;

constexpr absl::Duration kWait = absl::Seconds(120);

[[noreturn]] void Die(const std::string& msg) { bench::Die("bench/e2e", msg); }

// ---- Profiles ----

struct Layer {
  double forward_ms = 0;
  double backward_ms = 0;
};

struct Profile {
  std::string name;
  std::vector<Layer> layers;
  double zero_infinity_exposed = 0;  // The paper's added fraction per iteration.
};

Profile MakeProfile(const std::string& name) {
  Profile p;
  p.name = name;
  if (name == "paper1") {
    p.layers = {{147.283, 255.772}};
    p.zero_infinity_exposed = 0.592;
  } else if (name == "paper2") {
    p.layers = {{200.493 / 2, 550.389 / 2}, {200.493 / 2, 550.389 / 2}};
    p.zero_infinity_exposed = 0.517;
  } else {
    Die(absl::StrCat("unknown profile ", name, " (paper1, paper2)"));
  }
  return p;
}

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  uint64_t num_elems = 0;
  int layer = 0;
  uint64_t offset = 0;  // Elements into the arenas.
};

// torch.nn.TransformerDecoderLayer(d_model, nhead, dim_feedforward)'s
// parameters, per layer in registration order.
std::vector<TensorSpec> ModelTensors(int layers, int64_t d, int64_t ff) {
  std::vector<TensorSpec> out;
  uint64_t offset = 0;
  for (int l = 0; l < layers; ++l) {
    const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
        {"self_attn.in_proj_weight", {3 * d, d}},
        {"self_attn.in_proj_bias", {3 * d}},
        {"self_attn.out_proj.weight", {d, d}},
        {"self_attn.out_proj.bias", {d}},
        {"multihead_attn.in_proj_weight", {3 * d, d}},
        {"multihead_attn.in_proj_bias", {3 * d}},
        {"multihead_attn.out_proj.weight", {d, d}},
        {"multihead_attn.out_proj.bias", {d}},
        {"linear1.weight", {ff, d}},
        {"linear1.bias", {ff}},
        {"linear2.weight", {d, ff}},
        {"linear2.bias", {d}},
        {"norm1.weight", {d}},
        {"norm1.bias", {d}},
        {"norm2.weight", {d}},
        {"norm2.bias", {d}},
        {"norm3.weight", {d}},
        {"norm3.bias", {d}},
    };
    for (const auto& [name, shape] : shapes) {
      TensorSpec t;
      t.name = absl::StrCat("layers.", l, ".", name);
      t.shape = shape;
      t.num_elems = 1;
      for (int64_t s : shape) t.num_elems *= static_cast<uint64_t>(s);
      t.layer = l;
      t.offset = offset;
      offset += (t.num_elems + 31) / 32 * 32;  // 64-byte aligned views.
      out.push_back(std::move(t));
    }
  }
  return out;
}

// The order a layer's gradients are ready in backward (post-norm decoder
// layer: norm3 and linear2 last in forward, first in backward).
std::vector<size_t> BackwardOrder(const std::vector<TensorSpec>& tensors, int layer) {
  const std::vector<std::string> order = {
      "norm3.bias", "norm3.weight", "linear2.bias", "linear2.weight", "linear1.bias",
      "linear1.weight", "norm2.bias", "norm2.weight", "multihead_attn.out_proj.bias",
      "multihead_attn.out_proj.weight", "multihead_attn.in_proj_bias",
      "multihead_attn.in_proj_weight", "norm1.bias", "norm1.weight",
      "self_attn.out_proj.bias", "self_attn.out_proj.weight", "self_attn.in_proj_bias",
      "self_attn.in_proj_weight"};
  std::vector<size_t> out;
  for (const auto& n : order) {
    const std::string full = absl::StrCat("layers.", layer, ".", n);
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (tensors[i].name == full) out.push_back(i);
    }
  }
  return out;
}

// ---- Workers ----

// A request in flight for one tensor.
struct InFlight {
  bool pending = false;
  client::Ticket ticket = 0;
  uint64_t version = 0;  // The pull's version or the push's step.
};

struct Worker {
  uint32_t rank = 0;
  std::unique_ptr<client::Client> client;
  std::vector<uint16_t> grads;   // bf16 gradients, the arena pushed from.
  std::vector<uint16_t> params;  // bf16 parameters, the arena pulled into.
  std::vector<InFlight> pulls;
  std::vector<InFlight> pushes;
};

struct Model {
  Profile profile;
  std::vector<TensorSpec> tensors;
  std::vector<std::vector<size_t>> forward_tensors;   // Per layer.
  std::vector<std::vector<size_t>> backward_tensors;  // Per layer, ready order.
  // Each tensor's share of its layer's backward time.
  std::vector<double> backward_share;
  double compute_ms() const {
    double ms = 0;
    for (const auto& l : profile.layers) ms += l.forward_ms + l.backward_ms;
    return ms;
  }
};

enum class Mode { kCompute, kNoOverlap, kLayerwise, kDelayed };

const char* ModeName(Mode m) {
  switch (m) {
    case Mode::kCompute: return "compute";
    case Mode::kNoOverlap: return "no_overlap";
    case Mode::kLayerwise: return "layerwise";
    case Mode::kDelayed: return "delayed";
  }
  return "?";
}

// The emulated accelerator: work of `ms` starts when the previous work ends
// or now (whichever is later) and ends `ms` later. Sleeping to an absolute
// time keeps sleep overshoot from adding up.
class Timeline {
 public:
  void Run(double ms) {
    cursor_ = std::max(cursor_, absl::Now()) + absl::Microseconds(ms * 1000.0);
    absl::SleepFor(cursor_ - absl::Now());
  }

 private:
  absl::Time cursor_ = absl::InfinitePast();
};

absl::Status Named(const absl::Status& s, const std::string& what) {
  return s.ok() ? s : absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

absl::Status IssuePull(const Model& m, Worker* w, size_t i, uint64_t version) {
  InFlight& f = w->pulls[i];
  if (f.pending) return absl::InternalError(absl::StrCat("pull of ", m.tensors[i].name, " twice"));
  auto t = w->client->Pull(static_cast<uint32_t>(i), version, w->params.data() + m.tensors[i].offset,
                           m.tensors[i].num_elems);
  if (!t.ok()) return Named(t.status(), absl::StrCat("pull ", m.tensors[i].name));
  f = InFlight{true, *t, version};
  return absl::OkStatus();
}

// Waits for tensor i's pull (or push) in flight; `timeout` zero: only if
// already done (DEADLINE_EXCEEDED otherwise, the request stays in flight).
absl::Status Complete(InFlight* f, client::Client* c, absl::Duration timeout) {
  if (!f->pending) return absl::OkStatus();
  absl::Status s = c->Wait(f->ticket, timeout);
  if (s.code() == absl::StatusCode::kDeadlineExceeded) return s;
  f->pending = false;
  return s;
}

absl::Status IssuePush(const Model& m, Worker* w, size_t i, uint64_t step) {
  if (absl::Status s = Complete(&w->pushes[i], w->client.get(), kWait); !s.ok()) return s;
  auto t = w->client->Push(static_cast<uint32_t>(i), step,
                           w->grads.data() + m.tensors[i].offset, m.tensors[i].num_elems);
  if (!t.ok()) return Named(t.status(), absl::StrCat("push ", m.tensors[i].name));
  w->pushes[i] = InFlight{true, *t, step};
  return absl::OkStatus();
}

absl::Status CompleteAll(Worker* w) {
  for (size_t i = 0; i < w->pulls.size(); ++i) {
    if (absl::Status s = Complete(&w->pulls[i], w->client.get(), kWait); !s.ok()) return s;
    if (absl::Status s = Complete(&w->pushes[i], w->client.get(), kWait); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status PullAllBlocking(const Model& m, Worker* w, uint64_t version) {
  {
    client::BatchScope batch(w->client.get());
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      if (absl::Status s = IssuePull(m, w, i, version); !s.ok()) return s;
    }
  }
  return CompleteAll(w);
}

// One worker's iterations first..last in `mode`. On entry every tensor's
// version `first` is in w->params and nothing is in flight; on return
// version last + 1 is (compute mode: nothing moves). Appends each timed
// iteration's wall time, ms.
absl::Status RunWorker(const Model& m, Worker* w, Mode mode, uint64_t first, uint64_t last,
                       uint64_t timed_from, Barrier* barrier, std::vector<double>* iteration_ms) {
  client::Client* c = w->client.get();
  const size_t n = m.tensors.size();
  const int layers = static_cast<int>(m.profile.layers.size());
  barrier->Wait();
  if (mode == Mode::kLayerwise || mode == Mode::kDelayed) {
    // WaitParams(first) pulls version `first` itself.
    client::BatchScope batch(c);
    for (size_t i = 0; i < n; ++i) {
      if (absl::Status s = IssuePull(m, w, i, first); !s.ok()) return s;
    }
  }
  Timeline gpu;
  for (uint64_t t = first; t <= last; ++t) {
    const absl::Time start = absl::Now();
    // ---- Forward ----
    if (mode == Mode::kNoOverlap) {
      if (absl::Status s = PullAllBlocking(m, w, t); !s.ok()) return s;
    }
    for (int l = 0; l < layers; ++l) {
      if (mode == Mode::kLayerwise || mode == Mode::kDelayed) {
        // WaitParams(t, layer l): its tensors' forward version has landed.
        for (size_t i : m.forward_tensors[l]) {
          if (absl::Status s = Complete(&w->pulls[i], c, kWait); !s.ok()) return s;
        }
        if (mode == Mode::kDelayed && t > first) {
          // ...then version t goes out: it lands during this iteration.
          client::BatchScope batch(c);
          for (size_t i : m.forward_tensors[l]) {
            if (absl::Status s = IssuePull(m, w, i, t); !s.ok()) return s;
          }
        }
      }
      gpu.Run(m.profile.layers[l].forward_ms);
    }
    // ---- Backward ----
    std::vector<size_t> deferred;
    for (int l = layers - 1; l >= 0; --l) {
      for (size_t i : m.backward_tensors[l]) {
        gpu.Run(m.profile.layers[l].backward_ms * m.backward_share[i]);
        if (mode == Mode::kLayerwise) {
          // Pushed, then its next version pulled: answered as it publishes.
          if (absl::Status s = IssuePush(m, w, i, t); !s.ok()) return s;
          if (absl::Status s = IssuePull(m, w, i, t + 1); !s.ok()) return s;
        } else if (mode == Mode::kDelayed) {
          // Step t goes only to a chunk that published version t, and the
          // previous push must be answered: else FinishStep pushes it.
          absl::Status pulled =
              t == first ? absl::OkStatus() : Complete(&w->pulls[i], c, absl::ZeroDuration());
          absl::Status pushed = Complete(&w->pushes[i], c, absl::ZeroDuration());
          for (const absl::Status* s : {&pulled, &pushed}) {
            if (!s->ok() && s->code() != absl::StatusCode::kDeadlineExceeded) return *s;
          }
          const bool landed = pulled.ok();
          const bool answered = pushed.ok();
          if (landed && answered) {
            if (absl::Status s = IssuePush(m, w, i, t); !s.ok()) return s;
          } else {
            deferred.push_back(i);
          }
        }
      }
    }
    // ---- FinishStep ----
    if (mode == Mode::kNoOverlap) {
      {
        client::BatchScope batch(c);
        for (size_t i = 0; i < n; ++i) {
          if (absl::Status s = IssuePush(m, w, i, t); !s.ok()) return s;
        }
      }
      if (absl::Status s = CompleteAll(w); !s.ok()) return s;
    } else if (mode == Mode::kDelayed) {
      for (size_t i : deferred) {
        if (absl::Status s = Complete(&w->pulls[i], c, kWait); !s.ok()) return s;
      }
      client::BatchScope batch(c);
      for (size_t i : deferred) {
        if (absl::Status s = IssuePush(m, w, i, t); !s.ok()) return s;
      }
    }
    if (t >= timed_from) iteration_ms->push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
  }
  // Synchronize: everything answered, version last + 1 in the arena.
  if (absl::Status s = CompleteAll(w); !s.ok()) return s;
  if (mode == Mode::kDelayed) return PullAllBlocking(m, w, last + 1);
  return absl::OkStatus();
}

struct Figures {
  double mean_ms = 0;
  double median_ms = 0;
};

Figures FiguresOf(std::vector<double> v) {
  Figures f;
  if (v.empty()) return f;
  f.mean_ms = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  std::sort(v.begin(), v.end());
  f.median_ms = v[v.size() / 2];
  return f;
}

absl::Status RunProfile(const std::string& root, const std::string& dir, const Profile& profile) {
  const int workers = absl::GetFlag(FLAGS_workers);
  const int shards = absl::GetFlag(FLAGS_shards);
  Model m;
  m.profile = profile;
  const int layers = static_cast<int>(profile.layers.size());
  m.tensors = ModelTensors(layers, absl::GetFlag(FLAGS_d_model), absl::GetFlag(FLAGS_d_ff));
  m.forward_tensors.resize(layers);
  m.backward_tensors.resize(layers);
  m.backward_share.resize(m.tensors.size());
  std::vector<uint64_t> layer_elems(layers, 0);
  uint64_t params = 0, arena_elems = 0;
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    m.forward_tensors[m.tensors[i].layer].push_back(i);
    layer_elems[m.tensors[i].layer] += m.tensors[i].num_elems;
    params += m.tensors[i].num_elems;
    arena_elems = m.tensors[i].offset + (m.tensors[i].num_elems + 31) / 32 * 32;
  }
  for (int l = 0; l < layers; ++l) m.backward_tensors[l] = BackwardOrder(m.tensors, l);
  for (size_t i = 0; i < m.tensors.size(); ++i) {
    m.backward_share[i] = static_cast<double>(m.tensors[i].num_elems) /
                          static_cast<double>(layer_elems[m.tensors[i].layer]);
  }

  // AdamW's state is 18 bytes per parameter on the shards (fp32 master and
  // two moments, two bf16 published versions); room for uneven placement
  // and the staging pool (an eighth of the budget).
  int64_t shard_mb = absl::GetFlag(FLAGS_shard_memory_mb);
  if (shard_mb == 0) {
    shard_mb = static_cast<int64_t>(static_cast<double>(params) / shards * 18 * 1.5 / (1 << 20)) +
               512;
  }
  ProcClusterOptions po;
  po.bin_root = root;
  po.work_dir = dir;
  po.num_shards = shards;
  po.transports = absl::GetFlag(FLAGS_tls);
  po.shard_memory_mb = static_cast<uint64_t>(shard_mb);
  for (absl::string_view a :
       absl::StrSplit(absl::GetFlag(FLAGS_shard_args), ' ', absl::SkipEmpty())) {
    po.shard_args.emplace_back(a);
  }
  ProcCluster cluster;
  if (absl::Status s = StartProcCluster(po, &cluster); !s.ok()) return s;
  {
    Json line;
    line["bench"] = "e2e";
    line["profile"] = profile.name;
    line["cluster"] = cluster.commands;
    std::fprintf(g_out, "%s\n", JsonDump(line).c_str());
    std::fflush(g_out);
  }

  // Workers: connect, rank 0 creates the job, all join, rank 0 sends the
  // initial values.
  std::vector<Worker> ws(workers);
  client::JobDef def;
  def.name = absl::StrCat("e2e-", profile.name);
  def.world_size = static_cast<uint32_t>(workers);
  for (const auto& t : m.tensors) def.tensors.push_back({t.name, t.shape});
  def.optimizer.kind = client::Optimizer::kAdamW;
  def.optimizer.lr = 1e-4f;
  def.optimizer.weight_decay = 0.01f;
  def.grad_dtype = DType::kBf16;
  def.param_dtype = DType::kBf16;
  def.skip_nonfinite = absl::GetFlag(FLAGS_skip_nonfinite);
  for (int r = 0; r < workers; ++r) {
    Worker& w = ws[r];
    w.rank = static_cast<uint32_t>(r);
    client::ClientOptions o;
    o.coordinator_address = cluster.coord_addr;
    o.transport.name = absl::StrCat("e2e-worker", r);
    o.transport.transports = absl::GetFlag(FLAGS_tls);
    o.transport.net_devices = "lo";
    o.ready_timeout = absl::Minutes(5);
    auto c = client::Client::Connect(o);
    if (!c.ok()) return c.status();
    w.client = std::move(*c);
    // Gradients of a plausible size, alternating in sign (bf16 +-2^-7).
    w.grads.resize(arena_elems);
    for (size_t i = 0; i < arena_elems; ++i) w.grads[i] = (i & 1) ? 0xBC00 : 0x3C00;
    w.params.assign(arena_elems, 0);
    w.pulls.resize(m.tensors.size());
    w.pushes.resize(m.tensors.size());
    if (absl::Status s = w.client->RegisterBuffer(w.grads.data(), arena_elems * 2); !s.ok()) return s;
    if (absl::Status s = w.client->RegisterBuffer(w.params.data(), arena_elems * 2); !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = ws[0].client->CreateJob(def); !s.ok()) return Named(s, "create job");
  for (int r = 0; r < workers; ++r) {
    if (absl::Status s = ws[r].client->Join(def.name, static_cast<uint32_t>(r), def.world_size);
        !s.ok()) {
      return Named(s, "join");
    }
  }
  {
    uint64_t largest = 0;
    for (const auto& t : m.tensors) largest = std::max(largest, t.num_elems);
    std::vector<float> init(largest, 0.01f);
    for (size_t i = 0; i < m.tensors.size(); ++i) {
      if (absl::Status s = ws[0].client->InitTensor(static_cast<uint32_t>(i), init.data(),
                                                    m.tensors[i].num_elems);
          !s.ok()) {
        return Named(s, "init");
      }
    }
  }
  for (auto& w : ws) {
    if (absl::Status s = PullAllBlocking(m, &w, 1); !s.ok()) return s;
  }

  const int iterations = absl::GetFlag(FLAGS_iterations);
  const int warmup = absl::GetFlag(FLAGS_warmup);
  uint64_t next_step = 1;
  double compute_ms = 0, compute_median_ms = 0;
  std::vector<std::pair<Mode, double>> exposed;
  for (Mode mode : {Mode::kCompute, Mode::kNoOverlap, Mode::kLayerwise, Mode::kDelayed}) {
    const uint64_t first = next_step;
    const uint64_t last = first + static_cast<uint64_t>(warmup + iterations) - 1;
    Barrier barrier(workers);
    std::vector<std::vector<double>> times(workers);
    std::vector<absl::Status> status(workers);
    std::vector<std::thread> threads;
    for (int r = 0; r < workers; ++r) {
      threads.emplace_back([&, r] {
        status[r] = RunWorker(m, &ws[r], mode, first, last, first + warmup, &barrier, &times[r]);
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < workers; ++r) {
      if (!status[r].ok()) {
        return Named(status[r], absl::StrCat(ModeName(mode), " rank ", r));
      }
    }
    // Ranks run in lock step (every step needs every rank's pushes): the
    // slowest rank's mean is the iteration.
    Figures f;
    for (int r = 0; r < workers; ++r) {
      Figures fr = FiguresOf(times[r]);
      if (fr.mean_ms > f.mean_ms) f = fr;
    }
    if (mode == Mode::kCompute) {
      compute_ms = f.mean_ms;
      compute_median_ms = f.median_ms;
    } else {
      next_step = last + 1;
    }
    const double frac = compute_ms > 0 ? (f.mean_ms - compute_ms) / compute_ms : 0;
    const double frac_median =
        compute_median_ms > 0 ? (f.median_ms - compute_median_ms) / compute_median_ms : 0;
    if (mode != Mode::kCompute) exposed.emplace_back(mode, frac);
    Json line;
    line["bench"] = "e2e";
    line["profile"] = profile.name;
    line["mode"] = ModeName(mode);
    line["layers"] = layers;
    line["params"] = static_cast<uint64_t>(params);
    line["workers"] = workers;
    line["shards"] = shards;
    line["iterations"] = iterations;
    line["profile_compute_ms"] = JsonRound(m.compute_ms(), 3);
    line["iteration_ms"] = JsonRound(f.mean_ms, 3);
    line["iteration_ms_median"] = JsonRound(f.median_ms, 3);
    line["exposed_fraction"] = JsonRound(frac, 4);
    line["exposed_fraction_median"] = JsonRound(frac_median, 4);
    line["skip_nonfinite"] = absl::GetFlag(FLAGS_skip_nonfinite);
    line["transports"] = ws[0].client->transports_in_use();
    std::fprintf(g_out, "%s\n", JsonDump(line).c_str());
    std::fflush(g_out);
  }
  // What came back is the job's parameters: every rank holds the same
  // bytes of the last version, and training moved them off their initial
  // values.
  bool same = true;
  for (int r = 1; r < workers; ++r) same = same && ws[r].params == ws[0].params;
  size_t moved = 0;
  const uint16_t initial = 0x3C24;  // 0.01f in bf16 (round to nearest even).
  for (const auto& t : m.tensors) moved += ws[0].params[t.offset] != initial;
  if (!same) return absl::InternalError("the ranks pulled different parameters");
  if (moved == 0) return absl::InternalError("no tensor moved off its initial values");
  double no_overlap = 0, layerwise = 0, delayed = 0;
  for (const auto& [mode, frac] : exposed) {
    if (mode == Mode::kNoOverlap) no_overlap = frac;
    if (mode == Mode::kLayerwise) layerwise = frac;
    if (mode == Mode::kDelayed) delayed = frac;
  }
  Json summary;
  summary["bench"] = "e2e";
  summary["profile"] = profile.name;
  summary["summary"] = true;
  summary["compute_ms"] = JsonRound(compute_ms, 3);
  summary["exposed_no_overlap"] = JsonRound(no_overlap, 4);
  summary["exposed_layerwise"] = JsonRound(layerwise, 4);
  summary["exposed_delayed"] = JsonRound(delayed, 4);
  summary["zero_infinity_paper"] = JsonRound(profile.zero_infinity_exposed, 3);
  summary["layerwise_at_most_half_of_no_overlap"] = layerwise <= no_overlap / 2;
  summary["delayed_under_10pct"] = delayed < 0.10;
  std::fprintf(g_out, "%s\n", JsonDump(summary).c_str());
  std::fflush(g_out);
  for (auto& w : ws) {
    w.client->ForgetBuffer(w.grads.data(), arena_elems * 2);
    w.client->ForgetBuffer(w.params.data(), arena_elems * 2);
    w.client.reset();
  }
  StopProcCluster(&cluster);
  return absl::OkStatus();
}

int Main(const char* argv0) {
  KillChildrenOnSignals();
  const std::string root = FindBinRoot(argv0, absl::GetFlag(FLAGS_bin_dir));
  if (root.empty()) Die("cannot find optimus-coord and optimus-shard (use --bin_dir)");
  absl::StatusOr<std::string> made = MakeWorkDir(absl::GetFlag(FLAGS_work_dir), "e2e");
  if (!made.ok()) Die(made.status().ToString());
  const std::string dir = *made;
  for (absl::string_view name :
       absl::StrSplit(absl::GetFlag(FLAGS_profiles), ',', absl::SkipEmpty())) {
    if (absl::Status s = RunProfile(root, dir, MakeProfile(std::string(name))); !s.ok()) {
      Die(absl::StrCat(s.ToString(), " (logs in ", dir, ")"));
    }
  }
  return 0;
}

}  // namespace
}  // namespace bench
}  // namespace optimus

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  // The cluster it starts is a throwaway on loopback: plain text, asked for
  // here (the processes inherit it). Authentication costs one handshake per
  // connection, nothing per request worth measuring.
  setenv("OPTIMUS_INSECURE_PLAINTEXT", "1", /*overwrite=*/0);
  optimus::bench::g_out = optimus::bench::TakeStdoutForJson();
  if (optimus::bench::g_out == nullptr) return 1;
  return optimus::bench::Main(argv[0]);
}
