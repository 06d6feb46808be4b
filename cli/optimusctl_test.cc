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
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "cli/test_json.h"
#include "cli/torch_pickle.h"
#include "common/checkpoint_files.h"
#include "coordinator/coordinator.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kernels/optimizer_spec.h"
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
  virtual CoordinatorOptions Options() { return CoordinatorOptions(); }
  void SetUp() override {
    auto server = CoordinatorServer::Start(Options());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    stub_ = v1::Coordinator::NewStub(
        grpc::CreateChannel(server_->address(), grpc::InsecureChannelCredentials()));
  }

  uint64_t RegisterShard(v1::ShardKind kind, const std::string& host) {
    v1::RegisterShardRequest req;
    v1::ShardCapabilities* caps = req.mutable_capabilities();
    caps->set_kind(kind);
    caps->set_arch("aarch64");
    caps->set_memory_limit_bytes(uint64_t{1} << 30);
    caps->set_data_address("ucx:" + host);
    caps->set_hostname(host);
    grpc::ClientContext ctx;
    v1::RegisterShardResponse resp;
    EXPECT_TRUE(stub_->RegisterShard(&ctx, req, &resp).ok());
    return resp.shard_id();
  }

  void CreateJob(uint32_t replication = 0) {
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
    spec->set_max_chunk_bytes(64 << 10);  // 4 + 1 chunks.
    spec->set_replication(replication);
    grpc::ClientContext ctx;
    v1::CreateJobResponse resp;
    grpc::Status s = stub_->CreateJob(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }

  // One heartbeat per shard, as a real shard sends it: each job of its
  // assignments at the current epoch, every chunk loaded, and its backups
  // seeded when `seeded`.
  void BeatAll(const std::vector<uint64_t>& shards, bool seeded) {
    for (uint64_t id : shards) {
      v1::HeartbeatRequest req;
      req.set_shard_id(id);
      v1::HeartbeatResponse first;
      {
        grpc::ClientContext ctx;
        if (!stub_->Heartbeat(&ctx, req, &first).ok()) continue;
      }
      for (const auto& a : first.assignments()) {
        grpc::ClientContext ctx;
        v1::GetShardMapRequest get;
        get.set_job_id(a.job_id());
        v1::ShardMap map;
        if (!stub_->GetShardMap(&ctx, get, &map).ok()) continue;
        uint32_t primary = 0, backup = 0;
        for (const auto& c : map.chunks()) {
          primary += c.shard_id() == id;
          backup += c.backup_shard_id() == id;
        }
        v1::ShardJobProgress* p = req.add_jobs();
        p->set_job_id(a.job_id());
        p->set_map_epoch(map.epoch());
        p->set_chunks_loaded(primary + backup);
        p->set_primary_chunks(primary);
        p->set_backup_chunks(backup);
        p->set_backups_seeded(seeded ? backup : 0);
      }
      grpc::ClientContext ctx;
      v1::HeartbeatResponse resp;
      stub_->Heartbeat(&ctx, req, &resp);
    }
  }

  // Fake shards heartbeating every 100 ms until StopBeating().
  void StartBeating(std::vector<uint64_t> shards, bool seeded) {
    beater_ = std::thread([this, shards, seeded] {
      while (!stop_beating_.WaitForNotificationWithTimeout(absl::Milliseconds(100))) {
        BeatAll(shards, seeded);
      }
    });
  }
  void StopBeating() {
    if (!beater_.joinable()) return;
    stop_beating_.Notify();
    beater_.join();
  }
  void TearDown() override { StopBeating(); }

  std::unique_ptr<CoordinatorServer> server_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::thread beater_;
  absl::Notification stop_beating_;
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
  // 64064 elements at 12 (AdamW) + 2*2 (published) + 4 (the fp32 sum the
  // 4 workers' gradients fold into, held until the commit) = 20 bytes each,
  // and each of the job's 5 chunks' bookkeeping, fit on the DPU alone.
  EXPECT_EQ(shards.array[0]["memory_planned_bytes"].AsUint(),
            64064u * 20 + 5 * kernels::ChunkOverheadBytes(4));
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

TEST_F(OptimusctlTest, DrainMarksTheShardAndStatusShowsIt) {
  const uint64_t a = RegisterShard(v1::SHARD_KIND_DPU, "bf-0");
  const uint64_t b = RegisterShard(v1::SHARD_KIND_DPU, "bf-1");
  CreateJob();
  StartBeating({a, b}, /*seeded=*/false);  // Keep their leases.
  const std::string coord = absl::StrCat("--coordinator=", server_->address());
  RunResult r = RunOptimusctl(absl::StrCat(coord, " drain ", a));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, ::testing::MatchesRegex("shard 1 draining: [0-9]+ chunks to move\n"));
  r = RunOptimusctl(absl::StrCat(coord, " status --json"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  absl::StatusOr<JsonValue> doc = ParseJson(r.out);
  ASSERT_TRUE(doc.ok()) << doc.status();
  EXPECT_EQ((*doc)["shards"].array[0]["state"].string, "draining");
  EXPECT_EQ((*doc)["shards"].array[1]["state"].string, "up");
  r = RunOptimusctl(absl::StrCat(coord, " status"));
  EXPECT_THAT(r.out, HasSubstr("DRAINING"));

  r = RunOptimusctl(absl::StrCat(coord, " drain 9"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("no shard with id 9"));
  r = RunOptimusctl(absl::StrCat(coord, " drain"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("drain needs one shard id"));
  r = RunOptimusctl(absl::StrCat(coord, " drain bf-0"));
  EXPECT_EQ(r.exit_code, 2);
  r = RunOptimusctl(absl::StrCat(coord, " drain 1 --wait --wait_s=0"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--wait_s"));
}

TEST_F(OptimusctlTest, DrainWaitReturnsOnceTheShardHoldsNoChunk) {
  const uint64_t a = RegisterShard(v1::SHARD_KIND_DPU, "bf-0");
  const uint64_t b = RegisterShard(v1::SHARD_KIND_DPU, "bf-1");
  const uint64_t c = RegisterShard(v1::SHARD_KIND_DPU, "bf-2");
  CreateJob(/*replication=*/1);
  const std::string coord = absl::StrCat("--coordinator=", server_->address());
  RunResult r = RunOptimusctl(absl::StrCat(coord, " status"));
  EXPECT_THAT(r.out, HasSubstr("syncing 0/5"));  // No backup seeded yet.
  StartBeating({a, b, c}, /*seeded=*/true);
  // The status shows the job's replicas in sync once the shards say so.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    r = RunOptimusctl(absl::StrCat(coord, " status"));
    if (r.out.find("5/5 in sync") != std::string::npos) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_THAT(r.out, HasSubstr("5/5 in sync"));

  r = RunOptimusctl(absl::StrCat(coord, " drain ", a, " --wait --wait_s=30"));
  EXPECT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_THAT(r.out, HasSubstr("shard 1 draining: "));
  EXPECT_THAT(r.out, HasSubstr("shard 1 drained: it holds no chunk and can be stopped"));
  r = RunOptimusctl(absl::StrCat(coord, " status --json"));
  absl::StatusOr<JsonValue> doc = ParseJson(r.out);
  ASSERT_TRUE(doc.ok()) << doc.status();
  EXPECT_EQ((*doc)["shards"].array[0]["chunks_owned"].AsUint(), 0u);
  EXPECT_EQ((*doc)["jobs"].array[0]["state"].string, "ready");  // Through the whole drain.
  EXPECT_EQ((*doc)["jobs"].array[0]["replication"].AsUint(), 1u);
  EXPECT_EQ((*doc)["jobs"].array[0]["chunks_with_backup"].AsUint(), 5u);
}

TEST_F(OptimusctlTest, DrainWaitGivesUpAfterWaitSeconds) {
  const uint64_t a = RegisterShard(v1::SHARD_KIND_DPU, "bf-0");
  const uint64_t b = RegisterShard(v1::SHARD_KIND_DPU, "bf-1");
  CreateJob();
  // Alive, but the temporary backups are never seeded (the job never steps).
  StartBeating({a, b}, /*seeded=*/false);
  const auto start = std::chrono::steady_clock::now();
  const RunResult r = RunOptimusctl(
      absl::StrCat("--coordinator=", server_->address(), " drain ", a, " --wait --wait_s=1"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("still holds"));
  EXPECT_THAT(r.out, HasSubstr("shard 1: draining, "));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
}

TEST_F(OptimusctlTest, JobDeleteEndsAJobAndIsRefusedWhileWorkersAreJoined) {
  const uint64_t shard = RegisterShard(v1::SHARD_KIND_DPU, "bf-0");
  CreateJob();
  StartBeating({shard}, /*seeded=*/false);  // Keep its lease: the job must not fail.
  {
    grpc::ClientContext ctx;
    v1::JoinJobRequest req;
    req.set_job_name("gpt-small");
    req.set_rank(2);
    req.set_world_size(4);
    v1::JoinJobResponse resp;
    ASSERT_TRUE(stub_->JoinJob(&ctx, req, &resp).ok());
  }
  const std::string coord = absl::StrCat("--coordinator=", server_->address());
  RunResult r = RunOptimusctl(absl::StrCat(coord, " job delete gpt-small"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("1 workers joined (ranks 2)"));
  r = RunOptimusctl(absl::StrCat(coord, " status --json"));
  absl::StatusOr<JsonValue> doc = ParseJson(r.out);
  ASSERT_TRUE(doc.ok()) << doc.status();
  ASSERT_EQ((*doc)["jobs"].array.size(), 1u);  // Still there.

  r = RunOptimusctl(absl::StrCat(coord, " job delete gpt-small --force"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // 64064 elements at 20 bytes on the one shard.
  EXPECT_THAT(r.out, HasSubstr("job gpt-small (id 1, "));
  EXPECT_THAT(r.out, HasSubstr(") deleted: 1.3 MiB of shard memory freed"));
  EXPECT_THAT(r.out, HasSubstr("1 workers were still joined"));
  r = RunOptimusctl(absl::StrCat(coord, " status --json"));
  doc = ParseJson(r.out);
  ASSERT_TRUE(doc.ok()) << doc.status();
  EXPECT_TRUE((*doc)["jobs"].array.empty());
  EXPECT_EQ((*doc)["shards"].array[0]["memory_planned_bytes"].AsUint(), 0u);

  r = RunOptimusctl(absl::StrCat(coord, " job delete gpt-small"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("no job named \"gpt-small\""));
  for (const char* bad : {" job", " job delete", " job delete a b", " job frob a",
                          " status --force", " job delete a --json"}) {
    r = RunOptimusctl(absl::StrCat(coord, bad));
    EXPECT_EQ(r.exit_code, 2) << bad;
    EXPECT_THAT(r.err, HasSubstr("usage: optimusctl")) << bad;
  }
}

// A coordinator with a short lease, so that a shard that stops beating is
// DOWN within a second.
class OptimusctlShortLeaseTest : public OptimusctlTest {
 protected:
  CoordinatorOptions Options() override {
    CoordinatorOptions o;
    o.lease = absl::Milliseconds(300);
    o.sweep_interval = absl::Milliseconds(50);
    return o;
  }
};

TEST_F(OptimusctlShortLeaseTest, ShardForgetRemovesOnlyADownShard) {
  const uint64_t a = RegisterShard(v1::SHARD_KIND_DPU, "bf-0");
  const uint64_t b = RegisterShard(v1::SHARD_KIND_DPU, "bf-1");
  StartBeating({b}, /*seeded=*/false);
  const std::string coord = absl::StrCat("--coordinator=", server_->address());
  RunResult r = RunOptimusctl(absl::StrCat(coord, " shard forget ", b));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("is UP"));
  // Shard a never beats: it goes DOWN.
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    r = RunOptimusctl(absl::StrCat(coord, " status --json"));
    if (r.out.find("\"down\"") != std::string::npos) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  r = RunOptimusctl(absl::StrCat(coord, " shard forget ", a));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "shard 1 (host bf-0) forgotten: it was DOWN; if it comes back it registers "
                   "under a new id\n");
  r = RunOptimusctl(absl::StrCat(coord, " status --json"));
  absl::StatusOr<JsonValue> doc = ParseJson(r.out);
  ASSERT_TRUE(doc.ok()) << doc.status();
  ASSERT_EQ((*doc)["shards"].array.size(), 1u);
  EXPECT_EQ((*doc)["shards"].array[0]["shard_id"].AsUint(), b);
  r = RunOptimusctl(absl::StrCat(coord, " shard forget ", a));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("no shard with id 1"));
  for (const char* bad : {" shard", " shard forget", " shard forget bf-0", " shard forget 0",
                          " shard frob 1"}) {
    r = RunOptimusctl(absl::StrCat(coord, bad));
    EXPECT_EQ(r.exit_code, 2) << bad;
  }
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
  r = RunOptimusctl("checkpoint export --path=/nonexistent --out=/tmp/x.pt --format=pickle");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown export format \"pickle\" (optimus or torch-optim)"));
  r = RunOptimusctl("status --format=torch-optim");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--format goes with checkpoint export only"));
}

// `checkpoint export --path=DIR --format=...` needs no coordinator.
TEST(OptimusctlExportTest, WritesTheLayoutItIsAskedFor) {
  std::string dir = ::testing::TempDir() + "ckptXXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  v1::CheckpointManifest m;
  m.set_job_name("j");
  m.set_step(3);
  v1::TensorSpec* w = m.mutable_spec()->add_tensors();
  w->set_name("w");
  w->add_shape(2);
  m.mutable_spec()->mutable_optimizer()->set_kind(v1::OPTIMIZER_SGD);
  m.mutable_spec()->mutable_optimizer()->set_lr(0.1f);
  const float master[2] = {1, 2}, momentum[2] = {3, 4};
  const float* arrays[] = {master, momentum};
  absl::StatusOr<v1::CheckpointFile> f = ckpt::WriteDataFile(dir, "w0", 0, 0, 2, arrays);
  ASSERT_TRUE(f.ok()) << f.status();
  f->set_optimizer_steps(2);
  *m.add_files() = *f;
  ASSERT_TRUE(ckpt::WriteManifest(dir, m).ok());
  for (const char* format : {"", "--format=optimus", "--format=torch-optim"}) {
    const std::string out = absl::StrCat(dir, "/out", std::string(format).size(), ".pt");
    const RunResult r = RunOptimusctl(
        absl::StrCat("checkpoint export --path=", dir, " --out=", out, " ", format));
    ASSERT_EQ(r.exit_code, 0) << format << ": " << r.err;
    EXPECT_THAT(r.out, HasSubstr("exported " + dir + " to " + out));
    absl::StatusOr<std::shared_ptr<PyValue>> root = LoadTorchFile(out);
    ASSERT_TRUE(root.ok()) << root.status();
    const bool torch_optim = std::string(format) == "--format=torch-optim";
    EXPECT_EQ((*root)->Find("model") != nullptr, torch_optim) << format;
    EXPECT_EQ((*root)->Find("params") != nullptr, !torch_optim) << format;
  }
}

}  // namespace
}  // namespace optimus
