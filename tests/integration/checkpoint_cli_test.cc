// optimusctl's checkpoint commands, run as an operator would (the real
// binary) against a real coordinator and shards (tests/harness, over the
// loopback transport): create --wait, list,
// status, export (loaded back with torch::pickle_load and compared with the
// parameters the shards serve), restore --as (workers resume at the
// checkpoint's step), and bad input exits non-zero with a clear message.

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/checkpoint_files.h"
#include "gtest/gtest.h"
#include "kernels/cpu/optimizer.h"
#include "tests/harness/cluster.h"
#include "tests/harness/optimusctl_run.h"
#include "tests/harness/status_assert.h"
#include "torch/torch.h"

namespace optimus {
namespace {

using harness::CliRun;

CliRun Optimusctl(const std::string& coordinator, const std::string& args) {
  return harness::RunOptimusctl(absl::StrCat("--coordinator=", coordinator, " ", args));
}

constexpr uint32_t kWorkers = 2;

TEST(CheckpointCliTest, CreateListStatusExportRestore) {
  ASSERT_OK_AND_ASSIGN(const std::string dir, harness::NewTempDir("ckpt"));
  harness::ClusterOptions o;
  o.num_shards = 2;
  o.num_workers = kWorkers;
  o.checkpoint_dir = dir;
  ASSERT_OK_AND_ASSIGN(auto c, harness::Cluster::Start(o));
  client::JobDef def = harness::SmallJob("cli", kWorkers);
  def.param_dtype = DType::kFp32;  // Pulled values are the fp32 master itself.
  ASSERT_OK(c->CreateJob(def));
  ASSERT_OK(c->Train(1, 4));
  ASSERT_OK(c->WaitApplied("cli", 4));
  const std::string addr = c->coordinator_address();

  CliRun r = Optimusctl(addr, "checkpoint create cli --wait");
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  EXPECT_TRUE(absl::StrContains(r.out, "at step 5: complete")) << r.out;

  r = Optimusctl(addr, "checkpoint list cli");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(absl::StrContains(r.out, "COMPLETE")) << r.out;
  EXPECT_TRUE(absl::StrContains(r.out, dir + "/cli/ckpt-000005")) << r.out;
  r = Optimusctl(addr, "checkpoint list cli --json");
  EXPECT_TRUE(absl::StrContains(r.out, "\"state\":\"complete\"")) << r.out;
  r = Optimusctl(addr, "status");
  EXPECT_TRUE(absl::StrContains(r.out, "#5 step 5 COMPLETE")) << r.out;

  // Export and load it back as torch.load would.
  const std::string out = dir + "/cli.pt";
  r = Optimusctl(addr, "checkpoint export cli --out=" + out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream in(out, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto root = torch::pickle_load(bytes).toGenericDict();
  EXPECT_EQ(root.at("step").toInt(), 4);
  auto params = root.at("params").toGenericDict();
  for (uint32_t t = 0; t < 2; ++t) {
    const std::string name = c->worker(0)->tensors()[t].name;
    torch::Tensor got = params.at(name).toTensor();
    EXPECT_EQ(got.sizes().vec(), c->worker(0)->tensors()[t].shape);
    ASSERT_OK_AND_ASSIGN(std::vector<uint8_t> served, c->Pull(t, 5));
    ASSERT_EQ(served.size(), static_cast<size_t>(got.numel()) * 4);
    EXPECT_EQ(std::memcmp(served.data(), got.data_ptr<float>(), served.size()), 0) << name;
    auto st = root.at("state").toGenericDict().at(name).toGenericDict();
    EXPECT_EQ(st.at("exp_avg_sq").toTensor().sizes(), got.sizes());
    EXPECT_GT(st.at("exp_avg_sq").toTensor().sum().item<float>(), 0.0f);
  }
  // --path works without asking the coordinator.
  r = Optimusctl("127.0.0.1:1", "checkpoint export --path=" + dir + "/cli/ckpt-000005 --out=" +
                                    dir + "/again.pt");
  EXPECT_EQ(r.exit_code, 0) << r.err;

  // Restore under a new name; its workers resume at step 5.
  r = Optimusctl(addr, "checkpoint restore cli --as=cli2 --max_chunk_bytes=32768");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(absl::StrContains(r.out, "resume at step 5")) << r.out;
  ASSERT_OK(c->JoinJob("cli2"));
  EXPECT_EQ(c->worker(0)->resume_step(), 5u);
  ASSERT_OK(c->Train(5, 6));

  // Bad input: a clear message, a non-zero exit, nothing changes.
  r = Optimusctl(addr, "checkpoint restore nosuchjob");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(r.err, "nosuchjob")) << r.err;
  r = Optimusctl(addr, "checkpoint restore cli --as=cli2");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(r.err, "already exists")) << r.err;
  r = Optimusctl(addr, "checkpoint create nosuchjob");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(r.err, "no job named")) << r.err;
  r = Optimusctl(addr, "checkpoint export cli");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_TRUE(absl::StrContains(r.err, "--out")) << r.err;
  r = Optimusctl(addr, "checkpoint frobnicate cli");
  EXPECT_EQ(r.exit_code, 2);
  ASSERT_OK_AND_ASSIGN(const v1::StatusResponse status, c->Status());
  EXPECT_EQ(status.jobs_size(), 2);
  EXPECT_TRUE(ckpt::RemoveTree(dir).ok());
}

}  // namespace
}  // namespace optimus
