// Runs the real optimusctl binary against a real coordinator started in this
// process, as an operator would.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "cli/test_json.h"
#include "coordinator/coordinator.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {
namespace {

using ::testing::HasSubstr;

struct RunResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

RunResult RunOptimusctl(const std::string& args) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* tmpdir = std::getenv("TEST_TMPDIR");
  EXPECT_NE(srcdir, nullptr);
  EXPECT_NE(tmpdir, nullptr);
  const std::string binary = absl::StrCat(srcdir, "/optimus/cli/optimusctl");
  const std::string err_path = absl::StrCat(tmpdir, "/optimusctl_stderr.txt");
  const std::string command = absl::StrCat(binary, " ", args, " 2>", err_path);
  RunResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) {
    ADD_FAILURE() << "popen failed: " << command;
    return result;
  }
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) result.out.append(buf, n);
  const int status = pclose(pipe);
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream err(err_path);
  std::stringstream ss;
  ss << err.rdbuf();
  result.err = ss.str();
  return result;
}

// A port on 127.0.0.1 that nothing listens on (bound, read back, released).
int UnusedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  EXPECT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  close(fd);
  return ntohs(addr.sin_port);
}

class OptimusctlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = CoordinatorServer::Start(CoordinatorOptions());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ = v1::Coordinator::NewStub(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  }

  void RegisterShard(v1::ShardKind kind, const std::string& host) {
    v1::RegisterShardRequest req;
    v1::ShardCapabilities* caps = req.mutable_capabilities();
    caps->set_kind(kind);
    caps->set_arch("aarch64");
    caps->set_memory_limit_bytes(uint64_t{1} << 30);
    caps->set_data_address("ucx:" + host);
    caps->set_hostname(host);
    grpc::ClientContext ctx;
    v1::RegisterShardResponse resp;
    ASSERT_TRUE(stub_->RegisterShard(&ctx, req, &resp).ok());
  }

  void CreateJob() {
    v1::CreateJobRequest req;
    v1::JobSpec* spec = req.mutable_spec();
    spec->set_name("gpt-small");
    spec->set_world_size(4);
    v1::TensorSpec* w = spec->add_tensors();
    w->set_name("embed");
    w->add_shape(1000);
    w->add_shape(64);
    v1::TensorSpec* b = spec->add_tensors();
    b->set_name("bias");
    b->add_shape(64);
    spec->mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
    spec->mutable_optimizer()->set_lr(3e-4f);
    spec->set_grad_dtype(v1::DTYPE_BF16);
    spec->set_param_dtype(v1::DTYPE_BF16);
    grpc::ClientContext ctx;
    v1::CreateJobResponse resp;
    grpc::Status s = stub_->CreateJob(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }

  std::unique_ptr<CoordinatorServer> server_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
};

TEST_F(OptimusctlTest, StatusJsonDescribesTheCluster) {
  RegisterShard(v1::SHARD_KIND_DPU, "bf-0");
  RegisterShard(v1::SHARD_KIND_HOST, "cpu-0");
  CreateJob();

  const RunResult r = RunOptimusctl(absl::StrCat("--coordinator=", server_->address(), " status --json"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  absl::StatusOr<JsonValue> doc = ParseJson(r.out);
  ASSERT_TRUE(doc.ok()) << doc.status() << "\n" << r.out;
  const JsonValue& shards = (*doc)["shards"];
  ASSERT_EQ(shards.array.size(), 2u);
  EXPECT_EQ(shards.array[0]["kind"].string, "dpu");
  EXPECT_EQ(shards.array[1]["kind"].string, "host");
  EXPECT_EQ(shards.array[0]["state"].string, "up");
  EXPECT_EQ(shards.array[0]["memory_limit_bytes"].AsUint(), uint64_t{1} << 30);
  // 64064 elements at 12 + 4*2 + 2*2 = 24 bytes each fit on the DPU alone.
  EXPECT_EQ(shards.array[0]["memory_planned_bytes"].AsUint(), 64064u * 24);
  EXPECT_EQ(shards.array[1]["memory_planned_bytes"].AsUint(), 0u);
  const JsonValue& jobs = (*doc)["jobs"];
  ASSERT_EQ(jobs.array.size(), 1u);
  EXPECT_EQ(jobs.array[0]["name"].string, "gpt-small");
  EXPECT_EQ(jobs.array[0]["state"].string, "pending");
  EXPECT_EQ(jobs.array[0]["world_size"].AsUint(), 4u);
  EXPECT_TRUE(jobs.array[0]["num_params"].IsInteger());
  EXPECT_EQ(jobs.array[0]["num_params"].AsUint(), 64064u);
  EXPECT_EQ(jobs.array[0]["num_tensors"].AsUint(), 2u);
}

TEST_F(OptimusctlTest, StatusTableNamesShardsAndJobs) {
  RegisterShard(v1::SHARD_KIND_DPU, "bf-0");
  CreateJob();
  const RunResult r = RunOptimusctl(absl::StrCat("status --coordinator ", server_->address()));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("SHARDS (1)"));
  EXPECT_THAT(r.out, HasSubstr("bf-0"));
  EXPECT_THAT(r.out, HasSubstr("1.0 GiB"));
  EXPECT_THAT(r.out, HasSubstr("gpt-small"));
  EXPECT_THAT(r.out, HasSubstr("0/4"));
  EXPECT_THAT(r.out, HasSubstr("PENDING"));
}

TEST(OptimusctlErrorsTest, UnreachableCoordinatorExitsOneWithAClearMessage) {
  const std::string address = absl::StrCat("127.0.0.1:", UnusedPort());
  const auto start = std::chrono::steady_clock::now();
  const RunResult r = RunOptimusctl(absl::StrCat("--coordinator=", address, " --timeout_ms=2000 status"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("cannot reach coordinator at " + address + ":"));
  EXPECT_TRUE(r.out.empty()) << r.out;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(OptimusctlErrorsTest, UsageErrorsExitTwo) {
  RunResult r = RunOptimusctl("frobnicate");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown command \"frobnicate\""));
  EXPECT_THAT(r.err, HasSubstr("usage: optimusctl"));
  r = RunOptimusctl("");
  EXPECT_EQ(r.exit_code, 2);
  r = RunOptimusctl("status --bogus");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown flag --bogus"));
}

}  // namespace
}  // namespace optimus
