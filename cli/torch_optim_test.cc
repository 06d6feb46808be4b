// Reads files that Python's torch.save wrote (made here by Debian's
// /usr/bin/python3 with python3-torch; every test skips with a message
// without it): plain values through LoadTorchFile, and a real
// torch.optim.AdamW state through ReadTorchOptimFile, whose values the
// script also writes raw for comparison; then the ways such a file can be
// wrong for a job.
#include "cli/torch_optim.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cli/torch_pickle.h"
#include "gtest/gtest.h"
#include "torch/torch.h"

namespace optimus {
namespace {

constexpr char kMakeFiles[] = R"PY(
import collections, sys, torch
out = sys.argv[1]

# A real AdamW state: "w" is a transposed (non-contiguous) view, "b" misses
# the last step's gradient, "emb" is frozen; an int buffer rides along.
w = torch.nn.Parameter(torch.arange(12.).reshape(4, 3).t())
b = torch.nn.Parameter(torch.arange(5.) / 10)
emb = torch.nn.Parameter(torch.ones(2, 2), requires_grad=False)
opt = torch.optim.AdamW([{"params": [w], "weight_decay": 0.1, "name": "decay"},
                         {"params": [b, emb], "weight_decay": 0.0, "lr": 5e-4, "name": "no_decay"}],
                        lr=1e-3, betas=(0.9, 0.95))
for s in range(3):
    w.grad = torch.full((3, 4), 0.5 + s)
    b.grad = None if s == 2 else torch.full((5,), -1.0)
    opt.step()
# Copies: the optimizers below step w and b in place.
model = {"w": w.detach().clone(), "b": b.detach().clone(), "emb": emb.detach().clone(),
         "buf": torch.zeros(2, dtype=torch.int64)}
assert not model["w"].is_contiguous()  # Saved with its strides.
torch.save({"model": model, "optimizer": opt.state_dict(), "job_name": "py", "resume_step": 4},
           out + "/adamw.pt")
with open(out + "/adamw.bin", "wb") as f:
    for p in (w, b, emb):
        st = opt.state.get(p, {})
        for a in (p.detach(), st.get("exp_avg", torch.zeros_like(p)), st.get("exp_avg_sq", torch.zeros_like(p))):
            f.write(a.detach().contiguous().numpy().tobytes())

# The same with parameters (not tensors) in "model".
torch.save({"model": {"w": w, "b": b, "emb": emb}, "optimizer": opt.state_dict()}, out + "/params.pt")

# SGD without momentum: state {"momentum_buffer": None}, no step.
sgd = torch.optim.SGD([w, b, emb], lr=0.1)
sgd.step()
torch.save({"model": model, "optimizer": sgd.state_dict()}, out + "/sgd.pt")

# AMSGrad keeps a moment optimus does not.
ams = torch.optim.AdamW([w, b, emb], lr=1e-3, amsgrad=True)
ams.step()
torch.save({"model": model, "optimizer": ams.state_dict()}, out + "/amsgrad.pt")

def variant(name, **model_changes):
    m = dict(model)
    for k, v in model_changes.items():
        if v is None:
            del m[k]
        else:
            m[k] = v
    torch.save({"model": m, "optimizer": opt.state_dict()}, out + "/" + name + ".pt")
variant("int_w", w=torch.zeros(3, 4, dtype=torch.int32))
variant("shape_w", w=torch.zeros(4, 3))
variant("no_b", b=None)
variant("f64_w", w=model["w"].double())

torch.save({"model": model, "optimizer": opt.state_dict()}, out + "/legacy.pt",
           _use_new_zipfile_serialization=False)
torch.save({"model": {}, "counts": collections.Counter(a=1)}, out + "/object.pt")

x = torch.arange(6.)
torch.save({"i": 5, "neg": -3, "big": 2**40, "f": 1.5, "s": "x", "t": (1, 2.0, None, True),
            "l": [7], "od": collections.OrderedDict(a=1), "bf16": torch.ones(2, dtype=torch.bfloat16),
            "empty": torch.zeros(0, 3), "scalar": torch.tensor(2.5), "views": [x, x[2:5]]},
           out + "/values.pt")
)PY";

class TorchOptimTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (std::system("/usr/bin/python3 -c 'import torch' 2>/dev/null") != 0) return;
    std::string tmpl = ::testing::TempDir() + "pyfilesXXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    const std::string script = tmpl + "/make.py";
    std::ofstream(script) << kMakeFiles;
    ASSERT_EQ(std::system(absl::StrCat("/usr/bin/python3 ", script, " ", tmpl).c_str()), 0);
    *dir_ = tmpl;
  }
  void SetUp() override {
    if (dir_->empty()) GTEST_SKIP() << "python3-torch is not installed: no torch.save files";
  }
  static std::string File(const std::string& name) { return *dir_ + "/" + name; }

  // The job the AdamW file was made for: "w" [3, 4] in group 0 ("decay"),
  // "b" [5] and the frozen "emb" [2, 2] in group 1 ("no_decay").
  static v1::JobSpec Spec(v1::OptimizerKind kind = v1::OPTIMIZER_ADAMW, bool groups = true) {
    v1::JobSpec spec;
    spec.set_name("py");
    auto add = [&](const char* name, std::vector<int64_t> shape, uint32_t group, bool frozen) {
      v1::TensorSpec* t = spec.add_tensors();
      t->set_name(name);
      for (int64_t d : shape) t->add_shape(d);
      t->set_group(groups ? group : 0);
      t->set_frozen(frozen);
    };
    add("w", {3, 4}, 0, false);
    add("b", {5}, 1, false);
    add("emb", {2, 2}, 1, true);
    if (groups) {
      spec.add_param_groups()->set_name("decay");
      spec.add_param_groups()->set_name("no_decay");
    }
    spec.mutable_optimizer()->set_kind(kind);
    return spec;
  }

  static void ExpectInvalid(const std::string& file, const v1::JobSpec& spec,
                            const std::string& says) {
    absl::StatusOr<ImportedOptimizerState> got = ReadTorchOptimFile(File(file), spec);
    EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument) << file << ": " << got.status();
    EXPECT_NE(got.status().message().find(says), absl::string_view::npos)
        << file << ": " << got.status() << "\n  should say: " << says;
    EXPECT_NE(got.status().message().find(File(file)), absl::string_view::npos) << got.status();
  }

  static std::string* dir_;
};

std::string* TorchOptimTest::dir_ = new std::string;

TEST_F(TorchOptimTest, ReadsPlainValuesAndTensors) {
  absl::StatusOr<std::shared_ptr<PyValue>> root = LoadTorchFile(File("values.pt"));
  ASSERT_TRUE(root.ok()) << root.status();
  const PyValue& v = **root;
  EXPECT_EQ(v.Find("i")->integer, 5);
  EXPECT_EQ(v.Find("neg")->integer, -3);
  EXPECT_EQ(v.Find("big")->integer, int64_t{1} << 40);
  EXPECT_EQ(v.Find("f")->number, 1.5);
  EXPECT_EQ(v.Find("s")->string, "x");
  const PyValue* t = v.Find("t");
  ASSERT_EQ(t->kind, PyValue::Kind::kTuple);
  ASSERT_EQ(t->items.size(), 4u);
  EXPECT_EQ(t->items[2]->kind, PyValue::Kind::kNone);
  EXPECT_TRUE(t->items[3]->boolean);
  ASSERT_EQ(v.Find("l")->items.size(), 1u);  // APPEND: a list of one.
  EXPECT_EQ(v.Find("l")->items[0]->integer, 7);
  EXPECT_EQ(v.Find("od")->Find("a")->integer, 1);
  EXPECT_EQ(v.Find("bf16")->tensor.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(v.Find("empty")->tensor.sizes(), (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(v.Find("scalar")->tensor.dim(), 0);
  EXPECT_EQ(v.Find("scalar")->tensor.item<float>(), 2.5f);
  const PyValue* views = v.Find("views");
  ASSERT_EQ(views->items.size(), 2u);
  EXPECT_TRUE(torch::equal(views->items[1]->tensor, torch::arange(2, 5, torch::kFloat32)));
}

TEST_F(TorchOptimTest, ReadsARealAdamWStateByNameAndGroup) {
  absl::StatusOr<ImportedOptimizerState> got = ReadTorchOptimFile(File("adamw.pt"), Spec());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->resume_step, 4u);
  ASSERT_EQ(got->tensors.size(), 3u);
  EXPECT_EQ(got->tensors[0].optimizer_steps, 3u);
  EXPECT_EQ(got->tensors[1].optimizer_steps, 2u);  // No gradient at the last step.
  EXPECT_EQ(got->tensors[2].optimizer_steps, 0u);  // Frozen: no state.
  // Every value as torch has it (the script wrote them raw, row-major).
  std::ifstream in(File("adamw.bin"), std::ios::binary);
  std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(raw.size(), (12 + 5 + 4) * 3 * sizeof(float));
  const float* want = reinterpret_cast<const float*>(raw.data());
  for (const ImportedTensorState& t : got->tensors) {
    ASSERT_EQ(t.moments.size(), 2u);
    for (const std::vector<float>* a : {&t.master, &t.moments[0], &t.moments[1]}) {
      for (float x : *a) EXPECT_EQ(x, *want++) << t.name;
    }
  }
  ASSERT_TRUE(ReadTorchOptimFile(File("params.pt"), Spec()).ok());
  absl::StatusOr<ImportedOptimizerState> f64 = ReadTorchOptimFile(File("f64_w.pt"), Spec());
  ASSERT_TRUE(f64.ok()) << f64.status();
  EXPECT_EQ(f64->tensors[0].master, got->tensors[0].master);
}

TEST_F(TorchOptimTest, SgdWithoutMomentumHasZeroBuffersAndNoSteps) {
  absl::StatusOr<ImportedOptimizerState> got =
      ReadTorchOptimFile(File("sgd.pt"), Spec(v1::OPTIMIZER_SGD, /*groups=*/false));
  ASSERT_TRUE(got.ok()) << got.status();
  for (const ImportedTensorState& t : got->tensors) {
    ASSERT_EQ(t.moments.size(), 1u);
    EXPECT_EQ(t.moments[0], std::vector<float>(t.master.size(), 0.0f)) << t.name;
    EXPECT_EQ(t.optimizer_steps, 0u);
  }
}

TEST_F(TorchOptimTest, FilesThatDoNotFitTheJobAreRefusedNamingWhy) {
  ExpectInvalid("no_b.pt", Spec(), "\"model\" has no tensor \"b\"");
  ExpectInvalid("shape_w.pt", Spec(), "model[\"w\"] has shape [4, 3]; the job's tensor \"w\" is [3, 4]");
  ExpectInvalid("int_w.pt", Spec(), "model[\"w\"] has dtype Int; a floating-point dtype is needed");
  ExpectInvalid("amsgrad.pt", Spec(v1::OPTIMIZER_ADAMW, false), "holds \"max_exp_avg_sq\"");
  ExpectInvalid("adamw.pt", Spec(v1::OPTIMIZER_SGD), "holds \"exp_avg\"; a sgd job's state holds");
  ExpectInvalid("sgd.pt", Spec(v1::OPTIMIZER_ADAMW, false), "holds \"momentum_buffer\"");
  ExpectInvalid("adamw.pt", Spec(v1::OPTIMIZER_ADAMW, false),
                "optimizer.param_groups has 2 groups; the job has 1");
  v1::JobSpec moved = Spec();
  moved.mutable_tensors(1)->set_group(0);  // "b" now in group 0.
  ExpectInvalid("adamw.pt", moved, "optimizer.param_groups[0] has 1 params; the job's group 0 has 2");
  ExpectInvalid("legacy.pt", Spec(), "not a torch.save zip file");
  ExpectInvalid("object.pt", Spec(), "unsupported Python object collections.Counter");
  EXPECT_EQ(ReadTorchOptimFile(File("missing.pt"), Spec()).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace optimus
