// `optimusctl job create -f`, run as an operator would (the real binary,
// with an admin certificate) against a real coordinator and shards
// (tests/harness, TLS): a job written down as a YAML file is created, its
// workers join it by name with the token the command printed, and it trains
// to the single-process reference bit for bit. Then: a token the
// coordinator makes is printed as a secret, and a second job of the same
// name is refused.

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/job_config.h"
#include "common/security.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/harness/cluster.h"
#include "tests/harness/optimusctl_run.h"
#include "tests/harness/status_assert.h"
#include "yaml-cpp/yaml.h"

namespace optimus {
namespace {

using harness::CliRun;
using harness::RunOptimusctl;

constexpr char kSpec[] = R"(# An operator's job spec (docs/job-spec.md).
name: from-yaml
world_size: 2
optimizer:
  type: AdamW
  params: {lr: 0.01, betas: [0.9, 0.95], weight_decay: 0.1}
dtypes: {grad: bf16, param: fp32}
max_chunk_bytes: 64KiB
replication: 1
tensors:
  - {name: weight, shape: [200, 257]}
  - {name: bias, shape: [37]}
)";

TEST(JobCreateCliTest, AJobFromAYamlFileTrainsOnTheLocalCluster) {
  ASSERT_OK_AND_ASSIGN(const std::string ca, harness::MakeTestCa(2));
  // The token a launcher chose for the job's workers (OPTIMUS_JOB_TOKEN).
  ASSERT_OK_AND_ASSIGN(const std::string token, security::NewToken());
  harness::ClusterOptions o;
  o.num_shards = 2;
  o.num_workers = 2;
  o.tls_root = ca;
  o.job_token = token;
  ASSERT_OK_AND_ASSIGN(auto c, harness::Cluster::Start(o));
  ASSERT_OK_AND_ASSIGN(const std::string dir, harness::NewTempDir("jobspec"));
  const std::string spec = dir + "/train.yaml";
  std::ofstream(spec) << kSpec;
  const std::string flags =
      absl::StrCat("--coordinator=", c->coordinator_address(), " --tls_dir=", ca, "/admin");

  CliRun r = RunOptimusctl(absl::StrCat(flags, " job create -f ", spec, " -o json"),
                        absl::StrCat(security::kJobTokenEnv, "='", token, "'"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json created = nlohmann::json::parse(r.out);
  EXPECT_EQ(created["name"], "from-yaml");
  EXPECT_EQ(created["job_token"], token);
  EXPECT_EQ(created["world_size"], 2);
  EXPECT_EQ(created["num_tensors"], 2);
  EXPECT_GE(created["num_chunks"].get<int>(), 4);  // 51400 + 37 elements, 16384 per chunk.
  EXPECT_EQ(created["shards"].size(), 2u);
  const uint64_t job_id = created["job_id"].get<uint64_t>();

  // The workers join it by name with that token; rank 0 sends the initial
  // values, as a trainer does for a new job.
  ASSERT_OK(c->JoinJob("from-yaml"));
  EXPECT_EQ(c->worker(0)->job_id(), job_id);
  EXPECT_EQ(c->worker(0)->resume_step(), 1u);
  for (uint32_t t = 0; t < c->worker(0)->tensors().size(); ++t) {
    std::vector<float> v(c->worker(0)->tensors()[t].num_elems);
    for (size_t i = 0; i < v.size(); ++i) v[i] = harness::InitialValue(t, i);
    ASSERT_OK(c->worker(0)->InitTensor(t, v.data(), v.size()));
  }
  constexpr uint64_t kSteps = 4;
  ASSERT_OK(c->Train(1, kSteps));
  // The reference reads the same file with the same parser.
  ASSERT_OK_AND_ASSIGN(const client::JobConfig config, client::LoadJobConfig(spec));
  ASSERT_EQ(config.def.tensors.size(), 2u);
  for (uint32_t t = 0; t < 2; ++t) {
    ASSERT_OK_AND_ASSIGN(const std::vector<float> got, c->PullFp32(t, kSteps + 1));
    ASSERT_OK_AND_ASSIGN(const std::vector<float> want,
                         harness::ReferenceParams(config.def, t, kSteps));
    EXPECT_EQ(got, want) << config.def.tensors[t].name;
  }

  // What the operator sees of it afterwards.
  ASSERT_OK(c->WaitApplied("from-yaml", kSteps));
  r = RunOptimusctl(absl::StrCat(flags, " job describe from-yaml -o yaml"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const YAML::Node job = YAML::Load(r.out);
  EXPECT_EQ(job["name"].as<std::string>(), "from-yaml");
  EXPECT_EQ(job["job_id"].as<uint64_t>(), job_id);
  EXPECT_EQ(job["state"].as<std::string>(), "ready");
  EXPECT_GE(job["current_step"].as<uint64_t>(), kSteps);
  EXPECT_EQ(job["replication"].as<int>(), 1);
  EXPECT_EQ(job["optimizer"]["beta2"].as<double>(), 0.95);
  r = RunOptimusctl(absl::StrCat(flags, " job list"));
  EXPECT_TRUE(absl::StrContains(r.out, "from-yaml")) << r.out;

  // Without OPTIMUS_JOB_TOKEN the coordinator makes the token; the table
  // says it is a secret.
  r = RunOptimusctl(absl::StrCat(flags, " job create -f ", spec, " --name=from-yaml-2"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(absl::StrContains(r.out, "job from-yaml-2 created (id ")) << r.out;
  const std::string kTokenLine =
      "worker token (a secret: give it only to the job's workers, as OPTIMUS_JOB_TOKEN): ";
  const size_t at = r.out.find(kTokenLine);
  ASSERT_NE(at, std::string::npos) << r.out;
  const std::string made = r.out.substr(at + kTokenLine.size(),
                                        r.out.find('\n', at) - at - kTokenLine.size());
  EXPECT_GE(made.size(), 32u);
  EXPECT_NE(made, token);

  // The same name again: refused, nothing changes.
  r = RunOptimusctl(absl::StrCat(flags, " job create -f ", spec));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_TRUE(absl::StrContains(r.err, "already exists")) << r.err;
  ASSERT_OK_AND_ASSIGN(const v1::StatusResponse status, c->Status());
  EXPECT_EQ(status.jobs_size(), 2);
}

}  // namespace
}  // namespace optimus
