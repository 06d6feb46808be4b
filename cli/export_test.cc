// Exports a checkpoint written with the real file format and loads the
// result back with torch::pickle_load, with torch_optim's reader and with
// Python's torch (torch.load, torch.optim's load_state_dict), checking
// names, shapes, steps, groups and values.
#include "cli/export.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cli/torch_optim.h"
#include "cli/torch_pickle.h"
#include "common/checkpoint_files.h"
#include "gtest/gtest.h"
#include "torch/torch.h"

namespace optimus {
namespace {

std::string TempDir() {
  std::string tmpl = ::testing::TempDir() + "exportXXXXXX";
  EXPECT_NE(mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

// A two-tensor AdamW checkpoint whose "w" (3x4) is split over two files
// and "b" (5) is one file; value = array * 1000 + element.
v1::CheckpointManifest WriteCheckpoint(const std::string& dir) {
  v1::CheckpointManifest m;
  m.set_job_name("exp");
  m.set_step(11);
  v1::JobSpec* spec = m.mutable_spec();
  auto* w = spec->add_tensors();
  w->set_name("w");
  w->add_shape(3);
  w->add_shape(4);
  auto* b = spec->add_tensors();
  b->set_name("b");
  b->add_shape(5);
  spec->mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  spec->mutable_optimizer()->set_lr(0.01f);
  auto write = [&](uint32_t t, uint64_t off, uint64_t n) {
    std::vector<std::vector<float>> arrays(3, std::vector<float>(n));
    for (int a = 0; a < 3; ++a) {
      for (uint64_t i = 0; i < n; ++i) arrays[a][i] = a * 1000.0f + (off + i) + t * 100;
    }
    const float* ptrs[] = {arrays[0].data(), arrays[1].data(), arrays[2].data()};
    auto f = ckpt::WriteDataFile(dir, absl::StrCat("t", t, "-", off), t, off, n, ptrs);
    EXPECT_TRUE(f.ok()) << f.status();
    *m.add_files() = *f;
  };
  write(0, 0, 7);
  write(0, 7, 5);
  write(1, 0, 5);
  EXPECT_TRUE(ckpt::WriteManifest(dir, m).ok());
  return m;
}

TEST(ExportTest, TorchLoadsParamsAndMomentsByName) {
  const std::string dir = TempDir();
  WriteCheckpoint(dir);
  const std::string out = dir + "/export.pt";
  ASSERT_TRUE(ExportCheckpointToTorch(dir, out).ok());
  std::ifstream in(out, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // torch.save's zip format starts with a local file header.
  ASSERT_GT(bytes.size(), 4u);
  EXPECT_EQ(std::string(bytes.data(), 2), "PK");
  c10::IValue v = torch::pickle_load(bytes);
  ASSERT_TRUE(v.isGenericDict());
  auto root = v.toGenericDict();
  EXPECT_EQ(root.at("step").toInt(), 10);
  EXPECT_EQ(root.at("resume_step").toInt(), 11);
  EXPECT_EQ(root.at("optimizer").toGenericDict().at("kind").toStringRef(), "adamw");
  auto params = root.at("params").toGenericDict();
  auto state = root.at("state").toGenericDict();
  torch::Tensor w = params.at("w").toTensor();
  EXPECT_EQ(w.sizes(), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(w.scalar_type(), torch::kFloat32);
  torch::Tensor want = torch::arange(12, torch::kFloat32).reshape({3, 4});
  EXPECT_TRUE(torch::equal(w, want));
  auto ws = state.at("w").toGenericDict();
  EXPECT_TRUE(torch::equal(ws.at("exp_avg").toTensor(), want + 1000));
  EXPECT_TRUE(torch::equal(ws.at("exp_avg_sq").toTensor(), want + 2000));
  EXPECT_EQ(ws.at("step").toTensor().item<float>(), 10.0f);
  EXPECT_TRUE(torch::equal(params.at("b").toTensor(), torch::arange(5, torch::kFloat32) + 100));

  // And Python's torch.load (Debian's python3-torch, from install_deps.sh).
  if (std::system("/usr/bin/python3 -c 'import torch' 2>/dev/null") != 0) {
    GTEST_SKIP() << "python3-torch is not installed: torch.load not checked from Python";
  }
  const std::string check = absl::StrCat(
      "/usr/bin/python3 -c \"import torch; d = torch.load('", out, "'); ",
      "assert d['step'] == 10 and d['optimizer']['kind'] == 'adamw'; ",
      "w = d['params']['w']; assert w.dtype == torch.float32 and tuple(w.shape) == (3, 4); ",
      "assert torch.equal(w, torch.arange(12.).reshape(3, 4)); ",
      "assert torch.equal(d['state']['w']['exp_avg_sq'], w + 2000)\"");
  EXPECT_EQ(std::system(check.c_str()), 0) << check;
}

bool HavePythonTorch() {
  return std::system("/usr/bin/python3 -c 'import torch' 2>/dev/null") == 0;
}

// Runs `script` with Debian's python3; its exit status.
int RunPython(const std::string& dir, const std::string& script) {
  const std::string path = dir + "/check.py";
  std::ofstream(path) << script;
  return std::system(absl::StrCat("/usr/bin/python3 ", path).c_str());
}

// A checkpoint at step 11 of a job with parameter groups and a frozen
// tensor, as the shards write it since issue 11:
//   "w" [3, 4] group 0 ("decay": wd 0.1, beta2 0.95), 2 files, 10 steps;
//   "b" [5]    group 1 ("no_decay": wd 0, lr x0.5), 9 steps (one skipped);
//   "emb" [2, 2] group 1, frozen: 0 steps, zero moments.
// Value = array * 1000 + element + tensor * 100; last lr 2e-3.
v1::CheckpointManifest WriteGroupedCheckpoint(const std::string& dir,
                                              v1::OptimizerKind kind = v1::OPTIMIZER_ADAMW) {
  v1::CheckpointManifest m;
  m.set_job_name("grouped");
  m.set_step(11);
  m.set_last_lr(2e-3f);
  v1::JobSpec* spec = m.mutable_spec();
  auto add = [&](const char* name, std::vector<int64_t> shape, uint32_t group, bool frozen) {
    v1::TensorSpec* t = spec->add_tensors();
    t->set_name(name);
    for (int64_t d : shape) t->add_shape(d);
    t->set_group(group);
    t->set_frozen(frozen);
  };
  add("w", {3, 4}, 0, false);
  add("b", {5}, 1, false);
  add("emb", {2, 2}, 1, true);
  v1::ParamGroup* decay = spec->add_param_groups();
  decay->set_name("decay");
  decay->set_weight_decay(0.1f);
  decay->set_beta2(0.95f);
  v1::ParamGroup* no_decay = spec->add_param_groups();
  no_decay->set_name("no_decay");
  no_decay->set_weight_decay(0.0f);
  no_decay->set_lr_mult(0.5f);
  v1::OptimizerConfig* o = spec->mutable_optimizer();
  o->set_kind(kind);
  o->set_lr(1e-3f);
  if (kind == v1::OPTIMIZER_SGD) {
    o->set_momentum(0.9f);
  } else {
    o->set_beta1(0.9f);
    o->set_beta2(0.999f);
    o->set_eps(1e-8f);
  }
  o->set_weight_decay(0.01f);
  spec->set_max_grad_norm(1.0f);
  const int num_arrays = kind == v1::OPTIMIZER_SGD ? 2 : 3;
  auto write = [&](uint32_t t, uint64_t off, uint64_t n, uint64_t steps, float last_lr) {
    std::vector<std::vector<float>> arrays(num_arrays, std::vector<float>(n));
    for (int a = 0; a < num_arrays; ++a) {
      for (uint64_t i = 0; i < n; ++i) {
        arrays[a][i] = (t == 2 && a > 0) ? 0.0f : a * 1000.0f + (off + i) + t * 100;
      }
    }
    std::vector<const float*> ptrs;
    for (auto& a : arrays) ptrs.push_back(a.data());
    auto f = ckpt::WriteDataFile(dir, absl::StrCat("t", t, "-", off), t, off, n, ptrs);
    EXPECT_TRUE(f.ok()) << f.status();
    f->set_optimizer_steps(steps);
    f->set_last_lr(last_lr);
    *m.add_files() = *f;
  };
  write(0, 0, 7, 10, 2e-3f);
  write(0, 7, 5, 10, 2e-3f);
  write(1, 0, 5, 9, 1.9e-3f);
  write(2, 0, 4, 0, 0.0f);
  EXPECT_TRUE(ckpt::WriteManifest(dir, m).ok());
  return m;
}

TEST(ExportTest, FormatNames) {
  EXPECT_EQ(*ParseExportFormat("optimus"), ExportFormat::kOptimus);
  EXPECT_EQ(*ParseExportFormat("torch-optim"), ExportFormat::kTorchOptim);
  absl::Status s = ParseExportFormat("torch").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("\"torch\""), absl::string_view::npos) << s;
}

TEST(ExportTest, DefaultLayoutHasGroupsFrozenTensorsAndPerTensorSteps) {
  const std::string dir = TempDir();
  WriteGroupedCheckpoint(dir);
  const std::string out = dir + "/export.pt";
  ASSERT_TRUE(ExportCheckpointToTorch(dir, out).ok());
  absl::StatusOr<std::shared_ptr<PyValue>> root = LoadTorchFile(out);
  ASSERT_TRUE(root.ok()) << root.status();
  const PyValue* state = (*root)->Find("state");
  ASSERT_NE(state, nullptr);
  EXPECT_EQ(state->Find("w")->Find("step")->tensor.item<float>(), 10.0f);
  EXPECT_EQ(state->Find("b")->Find("step")->tensor.item<float>(), 9.0f);
  EXPECT_EQ(state->Find("emb")->Find("step")->tensor.item<float>(), 0.0f);
  const PyValue* groups = (*root)->Find("param_groups");
  ASSERT_NE(groups, nullptr);
  ASSERT_EQ(groups->items.size(), 2u);
  const PyValue& no_decay = *groups->items[1];
  EXPECT_EQ(no_decay.Find("name")->string, "no_decay");
  ASSERT_EQ(no_decay.Find("params")->items.size(), 2u);
  EXPECT_EQ(no_decay.Find("params")->items[1]->string, "emb");
  EXPECT_FLOAT_EQ(no_decay.Find("lr")->number, 1e-3f);  // 2e-3 x 0.5.
  EXPECT_FLOAT_EQ(no_decay.Find("beta2")->number, 0.999f);  // The optimizer's.
  EXPECT_FLOAT_EQ(groups->items[0]->Find("beta2")->number, 0.95f);
  EXPECT_FLOAT_EQ(groups->items[0]->Find("weight_decay")->number, 0.1f);
  ASSERT_EQ((*root)->Find("frozen")->items.size(), 1u);
  EXPECT_EQ((*root)->Find("frozen")->items[0]->string, "emb");
  EXPECT_FLOAT_EQ((*root)->Find("last_lr")->number, 2e-3f);
  EXPECT_FLOAT_EQ((*root)->Find("max_grad_norm")->number, 1.0f);
  EXPECT_TRUE((*root)->Find("skip_nonfinite")->boolean);
}

TEST(ExportTest, TorchOptimLayoutHoldsModelAndAStateDict) {
  const std::string dir = TempDir();
  WriteGroupedCheckpoint(dir);
  const std::string out = dir + "/optim.pt";
  ASSERT_TRUE(ExportCheckpointToTorch(dir, out, ExportFormat::kTorchOptim).ok());
  absl::StatusOr<std::shared_ptr<PyValue>> root = LoadTorchFile(out);
  ASSERT_TRUE(root.ok()) << root.status();
  EXPECT_EQ((*root)->Find("job_name")->string, "grouped");
  EXPECT_EQ((*root)->Find("resume_step")->integer, 11);
  const PyValue* model = (*root)->Find("model");
  ASSERT_NE(model, nullptr);
  EXPECT_TRUE(torch::equal(model->Find("w")->tensor,
                           torch::arange(12, torch::kFloat32).reshape({3, 4})));
  EXPECT_TRUE(torch::equal(model->Find("emb")->tensor,
                           torch::arange(4, torch::kFloat32).reshape({2, 2}) + 200));
  const PyValue* optimizer = (*root)->Find("optimizer");
  ASSERT_NE(optimizer, nullptr);
  const PyValue* state = optimizer->Find("state");
  ASSERT_NE(state, nullptr);
  ASSERT_EQ(state->entries.size(), 2u);  // The frozen "emb" (index 2) has none.
  EXPECT_EQ(state->Find(int64_t{2}), nullptr);
  EXPECT_EQ(state->Find(int64_t{0})->Find("step")->tensor.item<float>(), 10.0f);
  EXPECT_EQ(state->Find(int64_t{1})->Find("step")->tensor.item<float>(), 9.0f);
  EXPECT_TRUE(torch::equal(state->Find(int64_t{1})->Find("exp_avg_sq")->tensor,
                           torch::arange(5, torch::kFloat32) + 2100));
  const PyValue* groups = optimizer->Find("param_groups");
  ASSERT_EQ(groups->items.size(), 2u);
  const PyValue& decay = *groups->items[0];
  EXPECT_EQ(decay.Find("name")->string, "decay");
  ASSERT_EQ(decay.Find("params")->items.size(), 1u);
  EXPECT_EQ(decay.Find("params")->items[0]->integer, 0);
  EXPECT_FLOAT_EQ(decay.Find("lr")->number, 2e-3f);
  ASSERT_EQ(decay.Find("betas")->kind, PyValue::Kind::kTuple);
  EXPECT_FLOAT_EQ(decay.Find("betas")->items[1]->number, 0.95f);
  EXPECT_FLOAT_EQ(decay.Find("weight_decay")->number, 0.1f);
  EXPECT_FLOAT_EQ(decay.Find("eps")->number, 1e-8f);
  EXPECT_FALSE(decay.Find("amsgrad")->boolean);
  EXPECT_EQ(decay.Find("foreach")->kind, PyValue::Kind::kNone);
  const PyValue& no_decay = *groups->items[1];
  ASSERT_EQ(no_decay.Find("params")->items.size(), 2u);
  EXPECT_EQ(no_decay.Find("params")->items[1]->integer, 2);
  EXPECT_FLOAT_EQ(no_decay.Find("lr")->number, 1e-3f);
}

TEST(ExportTest, TorchOptimRoundTripsThroughTheReader) {
  for (v1::OptimizerKind kind : {v1::OPTIMIZER_ADAMW, v1::OPTIMIZER_SGD}) {
    const std::string dir = TempDir();
    const v1::CheckpointManifest m = WriteGroupedCheckpoint(dir, kind);
    const std::string out = dir + "/optim.pt";
    ASSERT_TRUE(ExportCheckpointToTorch(dir, out, ExportFormat::kTorchOptim).ok());
    absl::StatusOr<ImportedOptimizerState> got = ReadTorchOptimFile(out, m.spec());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->resume_step, 11u);
    ASSERT_EQ(got->tensors.size(), 3u);
    const std::vector<uint64_t> steps = {10, 9, 0};
    for (uint32_t t = 0; t < 3; ++t) {
      const ImportedTensorState& ts = got->tensors[t];
      EXPECT_EQ(ts.name, m.spec().tensors(t).name());
      EXPECT_EQ(ts.optimizer_steps, steps[t]) << ts.name;
      ASSERT_EQ(ts.moments.size(), kind == v1::OPTIMIZER_SGD ? 1u : 2u);
      for (size_t i = 0; i < ts.master.size(); ++i) {
        EXPECT_EQ(ts.master[i], i + t * 100.0f) << ts.name << " " << i;
        for (size_t a = 0; a < ts.moments.size(); ++a) {
          EXPECT_EQ(ts.moments[a][i], t == 2 ? 0.0f : (a + 1) * 1000.0f + i + t * 100) << ts.name;
        }
      }
    }
  }
}

TEST(ExportTest, FilesThatDisagreeOnATensorsStepsAreDataLoss) {
  const std::string dir = TempDir();
  v1::CheckpointManifest m = WriteGroupedCheckpoint(dir);
  m.mutable_files(1)->set_optimizer_steps(7);  // The second file of "w".
  ASSERT_TRUE(ckpt::WriteManifest(dir, m).ok());
  for (ExportFormat f : {ExportFormat::kOptimus, ExportFormat::kTorchOptim}) {
    absl::Status s = ExportCheckpointToTorch(dir, dir + "/x.pt", f);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find("tensor \"w\""), absl::string_view::npos) << s;
  }
}

// What the test is for: Python's torch.optim takes the file as it takes its
// own state_dict, and steps on from it.
TEST(ExportTest, TorchOptimizersLoadTheExportedStateDict) {
  if (!HavePythonTorch()) GTEST_SKIP() << "python3-torch is not installed";
  for (v1::OptimizerKind kind : {v1::OPTIMIZER_ADAMW, v1::OPTIMIZER_ADAM, v1::OPTIMIZER_SGD}) {
    const std::string dir = TempDir();
    WriteGroupedCheckpoint(dir, kind);
    const std::string out = dir + "/optim.pt";
    ASSERT_TRUE(ExportCheckpointToTorch(dir, out, ExportFormat::kTorchOptim).ok());
    const std::string cls = kind == v1::OPTIMIZER_SGD    ? "SGD"
                            : kind == v1::OPTIMIZER_ADAM ? "Adam"
                                                         : "AdamW";
    const std::string script = absl::StrCat(R"PY(
import sys, torch
cls = torch.optim.)PY", cls, R"PY(
d = torch.load(sys.argv[0].replace("check.py", "optim.pt"))
m = d["model"]
params = {n: torch.nn.Parameter(t.clone()) for n, t in m.items()}
params["emb"].requires_grad_(False)
kw = {"momentum": 0.9} if cls is torch.optim.SGD else {}
opt = cls([{"params": [params["w"]]}, {"params": [params["b"], params["emb"]]}], lr=1.0, **kw)
# The same keys as torch's own state_dict of this optimizer, plus "name".
own = set(opt.state_dict()["param_groups"][0].keys())
for g in d["optimizer"]["param_groups"]:
    assert set(g.keys()) - {"name"} == own, (set(g.keys()), own)
opt.load_state_dict(d["optimizer"])
g0, g1 = opt.param_groups
assert abs(g0["lr"] - 2e-3) < 1e-9 and abs(g1["lr"] - 1e-3) < 1e-9, (g0["lr"], g1["lr"])
assert abs(g0["weight_decay"] - 0.1) < 1e-7 and g1["weight_decay"] == 0.0
assert g0["name"] == "decay" and g1["name"] == "no_decay"
st = opt.state[params["w"]]
first = "momentum_buffer" if cls is torch.optim.SGD else "exp_avg"
assert torch.equal(st[first], torch.arange(12.).reshape(3, 4) + 1000), st[first]
assert params["emb"] not in opt.state
if cls is not torch.optim.SGD:
    assert abs(g0["betas"][1] - 0.95) < 1e-7
    assert float(st["step"]) == 10.0 and float(opt.state[params["b"]]["step"]) == 9.0
# And it steps on from there.
params["w"].grad = torch.ones(3, 4)
params["b"].grad = torch.ones(5)
opt.step()
if cls is not torch.optim.SGD:
    assert float(opt.state[params["w"]]["step"]) == 11.0
assert not torch.equal(params["w"].detach(), m["w"])
assert torch.equal(params["emb"].detach(), m["emb"])
)PY");
    EXPECT_EQ(RunPython(dir, script), 0) << cls;
  }
}

TEST(ExportTest, CorruptedCheckpointIsRefusedAndNothingIsWritten) {
  const std::string dir = TempDir();
  v1::CheckpointManifest m = WriteCheckpoint(dir);
  const std::string victim = dir + "/" + m.files(1).name();
  FILE* f = std::fopen(victim.c_str(), "r+b");
  ASSERT_NE(f, nullptr);
  std::fseek(f, 50, SEEK_SET);
  std::fputc(0x7f, f);
  std::fclose(f);
  const std::string out = dir + "/export.pt";
  absl::Status s = ExportCheckpointToTorch(dir, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find(victim), absl::string_view::npos) << s;
  EXPECT_FALSE(std::ifstream(out).good());
  EXPECT_EQ(ExportCheckpointToTorch(dir + "/missing", out).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace optimus
