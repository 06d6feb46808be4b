// Exports a checkpoint written with the real file format and loads the
// result back with torch::pickle_load (what torch.load reads), checking
// names, shapes and every value.
#include "cli/export.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_files.h"
#include "gtest/gtest.h"
#include "torch/torch.h"

namespace optimus {
namespace {

std::string TempDir() {
  std::string tmpl = absl::StrCat(std::getenv("TEST_TMPDIR"), "/exportXXXXXX");
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
