// The C++ half of the PyTorch comparison suite (compare_test.py writes a
// case folder, runs this, and checks what it wrote against torch.optim; the
// file contract is FORMAT.md). Runs one case on a real in-process cluster:
// a coordinator, `shards` shard servers and W worker clients over UCX on
// loopback, each worker in its own thread pushing its recorded gradients
// with the case's per-step learning rate and gradient multiplier, then takes
// a checkpoint after the last step and exports it in the torch-optim layout.
//
//   driver --case=DIR --out=DIR
//
// Exit 0 when the case ran (whether its numbers are right is the Python
// side's call), 1 with the reason on stderr otherwise.
#include <cmath>
#include <cstring>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "cli/export.h"
#include "common/checkpoint_files.h"
#include "client/client.h"
#include "client/torch/module_sync.h"
#include "common/dtype.h"
#include "nlohmann/json.hpp"
#include "tests/harness/cluster.h"

namespace optimus {
namespace {

using json = nlohmann::json;

constexpr absl::Duration kWait = absl::Seconds(60);

struct Case {
  json spec;
  client::JobDef def;
  uint32_t world = 3;
  int shards = 3;
  uint64_t steps = 0;
  std::vector<uint64_t> numel;
  std::vector<float> lr, grad_mult;
  // no_grad[step-1][rank][tensor]
  std::vector<std::vector<std::vector<bool>>> no_grad;
  std::vector<std::vector<float>> init;  // Per tensor.
  // grads[step-1][rank][tensor]: num_elems values.
  std::vector<std::vector<std::vector<std::vector<float>>>> grads;
  bool init_state = false;
};

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot open ", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

absl::Status WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

absl::StatusOr<client::Optimizer> KindOf(const std::string& name) {
  if (name == "adamw") return client::Optimizer::kAdamW;
  if (name == "adam") return client::Optimizer::kAdam;
  if (name == "sgd") return client::Optimizer::kSgd;
  if (name == "lion") return client::Optimizer::kLion;
  return absl::InvalidArgumentError(absl::StrCat("unknown optimizer ", name));
}

absl::StatusOr<Case> LoadCase(const std::string& dir) {
  absl::StatusOr<std::string> text = ReadFile(dir + "/case.json");
  if (!text.ok()) return text.status();
  Case c;
  try {
    c.spec = json::parse(*text);
    const json& j = c.spec;
    c.world = j.at("world_size").get<uint32_t>();
    c.shards = j.at("shards").get<int>();
    c.steps = j.at("steps").get<uint64_t>();
    client::JobDef& d = c.def;
    d.name = j.at("name").get<std::string>();
    d.world_size = c.world;
    d.max_chunk_bytes = j.value("max_chunk_bytes", 0);
    const json& o = j.at("optimizer");
    absl::StatusOr<client::Optimizer> kind = KindOf(o.at("kind").get<std::string>());
    if (!kind.ok()) return kind.status();
    d.optimizer.kind = *kind;
    d.optimizer.lr = o.value("lr", 1e-3f);
    d.optimizer.beta1 = o.value("beta1", 0.0f);
    d.optimizer.beta2 = o.value("beta2", 0.0f);
    d.optimizer.eps = o.value("eps", 0.0f);
    d.optimizer.weight_decay = o.value("weight_decay", 0.0f);
    d.optimizer.momentum = o.value("momentum", 0.0f);
    if (*kind != client::Optimizer::kSgd) d.optimizer.momentum = 0.0f;
    for (const json& g : j.value("param_groups", json::array())) {
      client::ParamGroup pg;
      pg.name = g.value("name", "");
      if (g.contains("weight_decay")) pg.weight_decay = g["weight_decay"].get<float>();
      if (g.contains("lr_mult")) pg.lr_mult = g["lr_mult"].get<float>();
      if (g.contains("beta1")) pg.beta1 = g["beta1"].get<float>();
      if (g.contains("beta2")) pg.beta2 = g["beta2"].get<float>();
      if (g.contains("momentum")) pg.momentum = g["momentum"].get<float>();
      d.param_groups.push_back(pg);
    }
    d.max_grad_norm = j.value("max_grad_norm", 0.0f);
    d.skip_nonfinite = j.value("skip_nonfinite", true);
    const std::string gd = j.value("grad_dtype", "fp32");
    const std::string pd = j.value("param_dtype", "bf16");
    absl::StatusOr<DType> gdt = DTypeFromName(gd);
    absl::StatusOr<DType> pdt = DTypeFromName(pd);
    if (!gdt.ok()) return gdt.status();
    if (!pdt.ok()) return pdt.status();
    d.grad_dtype = *gdt;
    d.param_dtype = *pdt;
    for (const json& t : j.at("tensors")) {
      client::TensorDef td;
      td.name = t.at("name").get<std::string>();
      td.shape = t.at("shape").get<std::vector<int64_t>>();
      td.group = t.value("group", 0u);
      td.frozen = t.value("frozen", false);
      uint64_t n = 1;
      for (int64_t s : td.shape) n *= static_cast<uint64_t>(s);
      c.numel.push_back(n);
      d.tensors.push_back(td);
    }
    c.lr = j.at("lr").get<std::vector<float>>();
    c.grad_mult = j.at("grad_mult").get<std::vector<float>>();
    if (c.lr.size() != c.steps || c.grad_mult.size() != c.steps) {
      return absl::InvalidArgumentError("lr and grad_mult need one value per step");
    }
    c.no_grad.assign(c.steps, std::vector<std::vector<bool>>(
                                  c.world, std::vector<bool>(d.tensors.size(), false)));
    for (const json& e : j.value("no_grad", json::array())) {
      const uint64_t s = e.at(0).get<uint64_t>();
      const uint32_t r = e.at(1).get<uint32_t>();
      const uint32_t t = e.at(2).get<uint32_t>();
      if (s < 1 || s > c.steps || r >= c.world || t >= d.tensors.size()) {
        return absl::InvalidArgumentError(absl::StrCat("bad no_grad entry ", e.dump()));
      }
      c.no_grad[s - 1][r][t] = true;
    }
    c.init_state = j.value("init_state", false);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(dir, "/case.json: ", e.what()));
  }
  uint64_t total = 0;
  for (uint64_t n : c.numel) total += n;
  absl::StatusOr<std::string> init = ReadFile(dir + "/init.bin");
  if (!init.ok()) return init.status();
  if (init->size() != total * 4) return absl::InvalidArgumentError("init.bin has the wrong size");
  absl::StatusOr<std::string> grads = ReadFile(dir + "/grads.bin");
  if (!grads.ok()) return grads.status();
  if (grads->size() != total * 4 * c.world * c.steps) {
    return absl::InvalidArgumentError("grads.bin has the wrong size");
  }
  const float* ip = reinterpret_cast<const float*>(init->data());
  for (uint64_t n : c.numel) {
    c.init.emplace_back(ip, ip + n);
    ip += n;
  }
  const float* gp = reinterpret_cast<const float*>(grads->data());
  c.grads.resize(c.steps);
  for (uint64_t s = 0; s < c.steps; ++s) {
    c.grads[s].resize(c.world);
    for (uint32_t r = 0; r < c.world; ++r) {
      for (uint64_t n : c.numel) {
        c.grads[s][r].emplace_back(gp, gp + n);
        gp += n;
      }
    }
  }
  return c;
}

// The bytes a rank pushes: the case's fp32 values in the job's grad dtype.
std::vector<uint8_t> GradBytes(const std::vector<float>& v, DType dtype) {
  std::vector<uint8_t> out(v.size() * DTypeSize(dtype));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::kFp32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else {
      const uint16_t h = dtype == DType::kBf16 ? FloatToBf16(v[i]) : FloatToFp16(v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

struct RankResult {
  absl::Status status;
  std::vector<client::StepReport> reports;
};

// One worker: push every tensor of each step (no gradient where the case
// says so), learn the step's report, pull the next version.
void RunRank(const Case& c, client::Client* w, uint32_t rank, RankResult* out) {
  const size_t nt = c.def.tensors.size();
  // Push buffers stay untouched until the next version is pulled.
  std::vector<std::vector<uint8_t>> push(nt);
  std::vector<std::vector<uint8_t>> pulled(nt);
  for (uint64_t s = 1; s <= c.steps; ++s) {
    client::PushOptions opts;
    opts.lr = c.lr[s - 1];
    opts.grad_mult = c.grad_mult[s - 1];
    std::vector<client::Ticket> tickets;
    for (uint32_t t = 0; t < nt; ++t) {
      const bool none = c.no_grad[s - 1][rank][t] || c.def.tensors[t].frozen;
      const void* grad = nullptr;
      if (!none) {
        push[t] = GradBytes(c.grads[s - 1][rank][t], c.def.grad_dtype);
        grad = push[t].data();
      }
      absl::StatusOr<client::Ticket> tk = w->Push(t, s, grad, c.numel[t], opts);
      if (!tk.ok()) {
        out->status = tk.status();
        return;
      }
      tickets.push_back(*tk);
    }
    for (client::Ticket tk : tickets) {
      if (absl::Status st = w->Wait(tk, kWait); !st.ok()) {
        out->status = absl::Status(st.code(), absl::StrCat("rank ", rank, " push of step ", s,
                                                           ": ", st.message()));
        return;
      }
    }
    if (c.def.max_grad_norm > 0 || c.def.skip_nonfinite) {
      absl::StatusOr<client::StepReport> rep = w->StepResult(s, kWait);
      if (!rep.ok()) {
        out->status = rep.status();
        return;
      }
      out->reports.push_back(*rep);
    }
    tickets.clear();
    for (uint32_t t = 0; t < nt; ++t) {
      pulled[t].resize(c.numel[t] * DTypeSize(c.def.param_dtype));
      absl::StatusOr<client::Ticket> tk = w->Pull(t, s + 1, pulled[t].data(), c.numel[t]);
      if (!tk.ok()) {
        out->status = tk.status();
        return;
      }
      tickets.push_back(*tk);
    }
    for (client::Ticket tk : tickets) {
      if (absl::Status st = w->Wait(tk, kWait); !st.ok()) {
        out->status = absl::Status(st.code(), absl::StrCat("rank ", rank, " pull of version ",
                                                           s + 1, ": ", st.message()));
        return;
      }
    }
  }
}

json NumberOrString(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;
}

absl::Status Run(const std::string& case_dir, const std::string& out_dir) {
  absl::StatusOr<Case> loaded = LoadCase(case_dir);
  if (!loaded.ok()) return loaded.status();
  const Case& c = *loaded;
  absl::StatusOr<std::string> ckpt_dir = harness::NewTempDir("compare-ckpt");
  if (!ckpt_dir.ok()) return ckpt_dir.status();
  harness::ClusterOptions opts;
  opts.transport = harness::TransportKind::kUcx;
  opts.num_shards = c.shards;
  opts.num_workers = c.world;
  opts.checkpoint_dir = *ckpt_dir;
  opts.wait = kWait;
  absl::StatusOr<std::unique_ptr<harness::Cluster>> started = harness::Cluster::Start(opts);
  if (!started.ok()) return started.status();
  harness::Cluster& cluster = **started;
  if (absl::Status s = cluster.ConnectWorkers(); !s.ok()) return s;
  if (absl::Status s = cluster.worker(0)->CreateJob(c.def); !s.ok()) return s;
  {
    std::vector<absl::Status> joined(c.world);
    std::vector<std::thread> th;
    for (uint32_t r = 0; r < c.world; ++r) {
      th.emplace_back([&, r] { joined[r] = cluster.worker(r)->Join(c.def.name, r, c.world); });
    }
    for (std::thread& t : th) t.join();
    for (const absl::Status& s : joined) {
      if (!s.ok()) return s;
    }
  }
  client::Client* w0 = cluster.worker(0);
  if (c.init_state) {
    // Start from a torch optimizer's state, as a trainer would.
    if (absl::Status s = client::InitFromTorchOptimFile(w0, case_dir + "/init_state.pt"); !s.ok()) {
      return s;
    }
  } else {
    for (uint32_t t = 0; t < c.def.tensors.size(); ++t) {
      if (absl::Status s = w0->InitTensor(t, c.init[t].data(), c.numel[t]); !s.ok()) return s;
    }
  }
  std::vector<RankResult> results(c.world);
  {
    std::vector<std::thread> th;
    for (uint32_t r = 0; r < c.world; ++r) {
      th.emplace_back([&, r] { RunRank(c, cluster.worker(r), r, &results[r]); });
    }
    for (std::thread& t : th) t.join();
  }
  for (const RankResult& r : results) {
    if (!r.status.ok()) return r.status;
  }
  // Every rank was told the same.
  for (uint32_t r = 1; r < c.world; ++r) {
    for (size_t s = 0; s < results[0].reports.size(); ++s) {
      const client::StepReport& a = results[0].reports[s];
      const client::StepReport& b = results[r].reports[s];
      const bool same_norm = a.grad_norm == b.grad_norm ||
                             (std::isnan(a.grad_norm) && std::isnan(b.grad_norm));
      if (!same_norm || a.clip_coef != b.clip_coef || a.skipped != b.skipped) {
        return absl::InternalError(absl::StrCat("rank ", r, " was told another result for step ",
                                                s + 1, " than rank 0"));
      }
    }
  }
  // The published parameters after the last step.
  std::string published;
  for (uint32_t t = 0; t < c.def.tensors.size(); ++t) {
    absl::StatusOr<std::vector<float>> p = cluster.PullFp32(t, c.steps + 1);
    if (!p.ok()) return p.status();
    published.append(reinterpret_cast<const char*>(p->data()), p->size() * 4);
  }
  if (absl::Status s = WriteFile(out_dir + "/published.bin", published); !s.ok()) return s;
  // A checkpoint of the final state, exported as torch.optim would save it
  // (ordered once the coordinator has heard every shard reach it).
  if (absl::Status s = cluster.WaitApplied(c.def.name, c.steps); !s.ok()) return s;
  absl::StatusOr<v1::CheckpointInfo> ck = cluster.CreateCheckpoint(c.def.name);
  if (!ck.ok()) return ck.status();
  absl::StatusOr<v1::CheckpointInfo> done = cluster.WaitCheckpoint(c.def.name, ck->checkpoint_id());
  if (!done.ok()) return done.status();
  if (done->state() != v1::CHECKPOINT_STATE_COMPLETE) {
    return absl::InternalError(absl::StrCat("checkpoint failed: ", done->error()));
  }
  if (absl::Status s = ExportCheckpointToTorch(done->path(), out_dir + "/final.pt",
                                               ExportFormat::kTorchOptim);
      !s.ok()) {
    return s;
  }
  json res;
  res["grad_norm"] = json::array();
  res["found_inf"] = json::array();
  res["skipped"] = json::array();
  res["clip_coef"] = json::array();
  for (const client::StepReport& r : results[0].reports) {
    res["grad_norm"].push_back(NumberOrString(r.grad_norm));
    res["found_inf"].push_back(r.found_inf);
    res["skipped"].push_back(r.skipped);
    res["clip_coef"].push_back(r.clip_coef);
  }
  res["resume_step"] = w0->resume_step();
  // The optimizer steps each tensor's checkpoint files record.
  absl::StatusOr<v1::CheckpointManifest> m = ckpt::ReadManifest(done->path());
  if (!m.ok()) return m.status();
  absl::StatusOr<std::vector<uint64_t>> counts = ckpt::OptimizerStepsOf(done->path(), *m);
  if (!counts.ok()) return counts.status();
  res["optimizer_steps"] = *counts;
  return WriteFile(out_dir + "/result.json", res.dump(1));
}

}  // namespace
}  // namespace optimus

int main(int argc, char** argv) {
  std::string case_dir, out_dir;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--case=", 0) == 0) case_dir = a.substr(7);
    if (a.rfind("--out=", 0) == 0) out_dir = a.substr(6);
  }
  if (case_dir.empty() || out_dir.empty()) {
    std::cerr << "usage: driver --case=DIR --out=DIR\n";
    return 2;
  }
  absl::Status s = optimus::Run(case_dir, out_dir);
  if (!s.ok()) {
    std::cerr << "driver: " << s << "\n";
    return 1;
  }
  return 0;
}
