// Runs the real optimusctl binary against a real coordinator started in this
// process, as an operator would.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
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
#include "cli/output.h"
#include "cli/torch_pickle.h"
#include "common/checkpoint_files.h"
#include "coordinator/coordinator.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "yaml-cpp/yaml.h"
#include "kernels/optimizer_spec.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// The document `text` holds; discarded (and a test failure) when it is not
// valid JSON.
Json ParseOrFail(const std::string& text) {
  Json doc = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  EXPECT_FALSE(doc.is_discarded()) << "not JSON: " << text;
  return doc;
}

// A YAML document as the JSON tree it says: quoted scalars are strings,
// plain ones null, booleans or numbers.
Json YamlToJson(const YAML::Node& y) {
  if (y.IsMap()) {
    Json out = Json::object();
    for (const auto& kv : y) out[kv.first.as<std::string>()] = YamlToJson(kv.second);
    return out;
  }
  if (y.IsSequence()) {
    Json out = Json::array();
    for (const auto& v : y) out.push_back(YamlToJson(v));
    return out;
  }
  if (y.IsNull()) return nullptr;
  const std::string text = y.as<std::string>();
  if (y.Tag() == "!") return text;  // Quoted.
  if (text == "true" || text == "false") return text == "true";
  const Json number = Json::parse(text, nullptr, false);
  EXPECT_TRUE(number.is_number()) << "plain scalar that is no number: " << text;
  return number;
}

// `doc` without the fields that change from one call to the next.
Json WithoutLeaseAges(Json doc) {
  if (doc.is_object()) {
    doc.erase("lease_age_ms");
    for (auto it = doc.begin(); it != doc.end(); ++it) *it = WithoutLeaseAges(*it);
  } else if (doc.is_array()) {
    for (Json& value : doc) value = WithoutLeaseAges(value);
  }
  return doc;
}

struct RunResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};

// Runs optimusctl with `args` (and `env`, "NAME=VALUE ...", in its
// environment).
RunResult RunOptimusctl(const std::string& args, const std::string& env = "") {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* tmpdir = std::getenv("TEST_TMPDIR");
  EXPECT_NE(srcdir, nullptr);
  EXPECT_NE(tmpdir, nullptr);
  const std::string binary = absl::StrCat(srcdir, "/optimus/cli/optimusctl");
  const std::string err_path = absl::StrCat(tmpdir, "/optimusctl_stderr.txt");
  const std::string command =
      absl::StrCat(env.empty() ? "" : "env " + env + " ", binary, " ", args, " 2>", err_path);
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
  // A long lease: the fake shards beat every 100 ms, and a loaded machine
  // can hold that thread back for seconds (a 2 s lease was lost that way,
  // failing a drain that needs its shards alive). Tests of a shard going
  // DOWN use OptimusctlShortLeaseTest.
  virtual CoordinatorOptions Options() {
    CoordinatorOptions o;
    o.lease = absl::Minutes(1);
    return o;
  }
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
  Json doc = ParseOrFail(r.out);
  ASSERT_FALSE(doc.is_discarded()) << "\n" << r.out;
  const Json& shards = doc["shards"];
  ASSERT_EQ(shards.size(), 2u);
  EXPECT_EQ(shards[0]["kind"].get<std::string>(), "dpu");
  EXPECT_EQ(shards[1]["kind"].get<std::string>(), "host");
  EXPECT_EQ(shards[0]["state"].get<std::string>(), "up");
  EXPECT_EQ(shards[0]["memory_limit_bytes"].get<uint64_t>(), uint64_t{1} << 30);
  // 64064 elements at 12 (AdamW) + 2*2 (published) + 4 (the fp32 sum the
  // 4 workers' gradients fold into, held until the commit) = 20 bytes each,
  // and each of the job's 5 chunks' bookkeeping, fit on the DPU alone.
  EXPECT_EQ(shards[0]["memory_planned_bytes"].get<uint64_t>(),
            64064u * 20 + 5 * kernels::ChunkOverheadBytes(4));
  EXPECT_EQ(shards[1]["memory_planned_bytes"].get<uint64_t>(), 0u);
  const Json& jobs = doc["jobs"];
  ASSERT_EQ(jobs.size(), 1u);
  EXPECT_EQ(jobs[0]["name"].get<std::string>(), "gpt-small");
  EXPECT_EQ(jobs[0]["state"].get<std::string>(), "pending");
  EXPECT_EQ(jobs[0]["world_size"].get<uint64_t>(), 4u);
  EXPECT_TRUE(jobs[0]["num_params"].is_number_integer());
  EXPECT_EQ(jobs[0]["num_params"].get<uint64_t>(), 64064u);
  EXPECT_EQ(jobs[0]["num_tensors"].get<uint64_t>(), 2u);
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
  Json doc = ParseOrFail(r.out);
  ASSERT_FALSE(doc.is_discarded());
  EXPECT_EQ(doc["shards"][0]["state"].get<std::string>(), "draining");
  EXPECT_EQ(doc["shards"][1]["state"].get<std::string>(), "up");
  r = RunOptimusctl(absl::StrCat(coord, " status"));
  EXPECT_THAT(r.out, HasSubstr("DRAINING"));

  r = RunOptimusctl(absl::StrCat(coord, " drain 9"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("no shard with id 9"));
  r = RunOptimusctl(absl::StrCat(coord, " drain"));
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("SHARD_ID is required"));
  EXPECT_THAT(r.err, HasSubstr("usage: optimusctl drain"));
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
  Json doc = ParseOrFail(r.out);
  ASSERT_FALSE(doc.is_discarded());
  EXPECT_EQ(doc["shards"][0]["chunks_owned"].get<uint64_t>(), 0u);
  EXPECT_EQ(doc["jobs"][0]["state"].get<std::string>(), "ready");  // Through the whole drain.
  EXPECT_EQ(doc["jobs"][0]["replication"].get<uint64_t>(), 1u);
  EXPECT_EQ(doc["jobs"][0]["chunks_with_backup"].get<uint64_t>(), 5u);
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
  EXPECT_THAT(r.err, HasSubstr("shard 1: draining, "));  // Progress goes to stderr.
  EXPECT_THAT(r.out, HasSubstr("shard 1 draining: "));
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
  Json doc = ParseOrFail(r.out);
  ASSERT_FALSE(doc.is_discarded());
  ASSERT_EQ(doc["jobs"].size(), 1u);  // Still there.

  r = RunOptimusctl(absl::StrCat(coord, " job delete gpt-small --force"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // 64064 elements at 20 bytes on the one shard.
  EXPECT_THAT(r.out, HasSubstr("job gpt-small (id 1, "));
  EXPECT_THAT(r.out, HasSubstr(") deleted: 1.3 MiB of shard memory freed"));
  EXPECT_THAT(r.out, HasSubstr("1 workers were still joined"));
  r = RunOptimusctl(absl::StrCat(coord, " status --json"));
  doc = ParseOrFail(r.out);
  ASSERT_FALSE(doc.is_discarded());
  EXPECT_TRUE(doc["jobs"].empty());
  EXPECT_EQ(doc["shards"][0]["memory_planned_bytes"].get<uint64_t>(), 0u);

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
// DOWN within seconds (3 s: the beating one must not lose its lease while
// a loaded machine holds its thread back).
class OptimusctlShortLeaseTest : public OptimusctlTest {
 protected:
  CoordinatorOptions Options() override {
    CoordinatorOptions o;
    o.lease = absl::Seconds(3);
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
  // Shard a never beats: it goes DOWN (a generous deadline).
  const absl::Time deadline = absl::Now() + absl::Minutes(1);
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
  Json doc = ParseOrFail(r.out);
  ASSERT_FALSE(doc.is_discarded());
  ASSERT_EQ(doc["shards"].size(), 1u);
  EXPECT_EQ(doc["shards"][0]["shard_id"].get<uint64_t>(), b);
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
  // Every command that calls the coordinator says so the same way.
  for (const char* command : {"checkpoint list some-job", "checkpoint create some-job",
                              "job delete some-job", "shard forget 7", "drain 7"}) {
    const RunResult c = RunOptimusctl(
        absl::StrCat("--coordinator=", address, " --timeout_ms=1000 ", command));
    EXPECT_EQ(c.exit_code, 1) << command << ": " << c.err;
    EXPECT_THAT(c.err, HasSubstr("cannot reach coordinator at " + address + ":")) << command;
  }
}

// A leader and a standby (state in etcd): the standby does not listen, and
// optimusctl talks to whichever does, in either order of the list.
TEST_F(OptimusctlTest, SeveralCoordinatorAddressesReachTheOneThatListens) {
  RegisterShard(v1::SHARD_KIND_DPU, "bf-0");
  const std::string standby = absl::StrCat("127.0.0.1:", UnusedPort());
  for (const std::string& list :
       {standby + "," + server_->address(), server_->address() + ", " + standby}) {
    const RunResult r = RunOptimusctl(absl::StrCat("--coordinator='", list, "' status --json"));
    ASSERT_EQ(r.exit_code, 0) << list << ": " << r.err;
    EXPECT_EQ(ParseOrFail(r.out)["shards"].size(), 1u) << list;
  }
  // $OPTIMUS_COORDINATOR takes a list too.
  const RunResult r =
      RunOptimusctl("shard list -o json", "OPTIMUS_COORDINATOR=" + standby + "," + server_->address());
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

TEST(OptimusctlErrorsTest, BadCoordinatorListsAreUsageErrors) {
  const struct {
    std::string list, says;
  } kCases[] = {
      {"a:1,,b:2", "entry 2 is empty"},
      {"a:1,b", "\"b\" (in \"a:1,b\"): no port"},
      {"a:1,a:1", "listed twice"},
      {"a:99999", "not a number from 1 to 65535"},
  };
  for (const auto& c : kCases) {
    const RunResult r = RunOptimusctl("--coordinator=" + c.list + " status");
    EXPECT_EQ(r.exit_code, 2) << c.list;
    EXPECT_THAT(r.err, HasSubstr("--coordinator")) << c.list;
    EXPECT_THAT(r.err, HasSubstr(c.says)) << c.list;
    EXPECT_TRUE(r.out.empty()) << c.list << ": " << r.out;
  }
  // Nobody at any address: the command fails naming them all.
  const std::string both =
      absl::StrCat("127.0.0.1:", UnusedPort(), ",127.0.0.1:", UnusedPort());
  const RunResult r = RunOptimusctl("--coordinator=" + both + " --timeout_ms=1000 status");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("cannot reach coordinator at " + both + ":"));
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
  EXPECT_THAT(r.err, HasSubstr("unknown flag --bogus for `optimusctl status`"));
  r = RunOptimusctl("checkpoint export --path=/nonexistent --out=/tmp/x.pt --format=pickle");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown export format \"pickle\" (optimus or torch-optim)"));
  r = RunOptimusctl("status --format=torch-optim");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown flag --format=torch-optim for `optimusctl status`"));
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

// ---- The command line itself: help, usage errors, output formats ----------

TEST(OptimusctlHelpTest, RootHelpListsEveryCommandTheGlobalFlagsAndExitCodes) {
  for (const char* args : {"--help", "-h"}) {
    const RunResult r = RunOptimusctl(args);
    ASSERT_EQ(r.exit_code, 0) << args << ": " << r.err;
    EXPECT_THAT(r.out, HasSubstr("usage: optimusctl [OPTIONS] COMMAND"));
    for (const char* command : {"status", "job", "shard", "checkpoint", "drain", "version"}) {
      EXPECT_THAT(r.out, ::testing::ContainsRegex(absl::StrCat("\n  ", command, " ")))
          << command;
    }
    for (const char* flag : {"--coordinator", "--timeout_ms", "--tls_dir",
                             "--insecure_plaintext", "--version"}) {
      EXPECT_THAT(r.out, HasSubstr(flag));
    }
    EXPECT_THAT(r.out, HasSubstr("OPTIMUS_COORDINATOR"));
    EXPECT_THAT(r.out, HasSubstr("Exit codes:"));
    EXPECT_THAT(r.out, HasSubstr("2  usage error"));
    EXPECT_TRUE(r.err.empty()) << r.err;
  }
}

TEST(OptimusctlHelpTest, GroupHelpListsItsCommands) {
  const struct {
    const char* group;
    std::vector<std::string> commands;
  } kGroups[] = {
      {"job", {"list", "describe", "create", "delete"}},
      {"shard", {"list", "describe", "drain", "forget"}},
      {"checkpoint", {"create", "list", "restore", "export"}},
  };
  for (const auto& g : kGroups) {
    const RunResult r = RunOptimusctl(absl::StrCat(g.group, " --help"));
    ASSERT_EQ(r.exit_code, 0) << g.group << ": " << r.err;
    EXPECT_THAT(r.out, HasSubstr(absl::StrCat("usage: optimusctl ", g.group, " [OPTIONS] COMMAND")));
    for (const std::string& c : g.commands) {
      EXPECT_THAT(r.out, ::testing::ContainsRegex("\n  " + c + " ")) << g.group << " " << c;
    }
  }
}

// Every command's --help names its own flags and arguments, and not the
// flags of other commands.
TEST(OptimusctlHelpTest, EveryCommandsHelpNamesItsOwnFlags) {
  const std::vector<std::string> kOutput = {"-o,--output", "--json"};
  const struct {
    std::string command;
    std::vector<std::string> names;
  } kCommands[] = {
      {"status", kOutput},
      {"version", kOutput},
      {"job list", kOutput},
      {"job describe", {"NAME", "-o,--output", "--json"}},
      {"job create", {"-f,--file", "--name", "--world_size", "-o,--output", "OPTIMUS_JOB_TOKEN"}},
      {"job delete", {"NAME", "--force"}},
      {"shard list", kOutput},
      {"shard describe", {"SHARD_ID", "-o,--output"}},
      {"shard drain", {"SHARD_ID", "--wait", "--wait_s"}},
      {"shard forget", {"SHARD_ID"}},
      {"drain", {"SHARD_ID", "--wait", "--wait_s", "shard drain"}},
      {"checkpoint create", {"JOB", "--wait", "-o,--output"}},
      {"checkpoint list", {"JOB", "-o,--output", "--json"}},
      {"checkpoint restore", {"JOB", "--checkpoint", "--as", "--max_chunk_bytes", "-o,--output"}},
      {"checkpoint export", {"JOB", "--checkpoint", "--path", "--out", "--format", "torch-optim"}},
  };
  const std::vector<std::string> kElsewhere = {"--force", "--wait_s", "--max_chunk_bytes",
                                               "--path", "--file"};
  for (const auto& c : kCommands) {
    const RunResult r = RunOptimusctl(c.command + " --help");
    ASSERT_EQ(r.exit_code, 0) << c.command << ": " << r.err;
    EXPECT_THAT(r.out, HasSubstr("usage: optimusctl " + c.command)) << r.out;
    for (const std::string& name : c.names) {
      EXPECT_THAT(r.out, HasSubstr(name)) << c.command << " --help:\n" << r.out;
    }
    for (const std::string& other : kElsewhere) {
      const bool own = std::find(c.names.begin(), c.names.end(), other) != c.names.end() ||
                       (other == "--file" && c.command == "job create");
      if (!own) {
        EXPECT_THAT(r.out, Not(HasSubstr(other))) << c.command << " --help";
      }
    }
    // The global flags are pointed to, not repeated as the command's own.
    EXPECT_THAT(r.out, HasSubstr("Global flags (see optimusctl --help)"));
  }
}

TEST(OptimusctlUsageTest, AFlagAnotherCommandTakesExitsTwoNamingIt) {
  const struct {
    std::string args, flag, command;
  } kCases[] = {
      {"status --as=x", "--as=x", "status"},
      {"status --wait", "--wait", "status"},
      {"job delete a --wait_s=3", "--wait_s=3", "job delete"},
      {"checkpoint list j --force", "--force", "checkpoint list"},
      {"shard forget 3 -o json", "-o", "shard forget"},
      {"version --coordinatr=x", "--coordinatr=x", "version"},
  };
  for (const auto& c : kCases) {
    // A coordinator that is never reached: nothing runs.
    const RunResult r = RunOptimusctl("--coordinator=127.0.0.1:1 " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args;
    EXPECT_THAT(r.err, HasSubstr("unknown flag " + c.flag + " for `optimusctl " + c.command + "`"))
        << c.args;
    EXPECT_THAT(r.err, HasSubstr("usage: optimusctl " + c.command)) << c.args;
    EXPECT_TRUE(r.out.empty()) << c.args << ": " << r.out;
  }
  RunResult r = RunOptimusctl("status -o xml");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("unknown output format \"xml\" (table, json or yaml)"));
  r = RunOptimusctl("status -o json --json");
  EXPECT_EQ(r.exit_code, 2);
  r = RunOptimusctl("--timeout_ms=0 status");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--timeout_ms"));
  r = RunOptimusctl("--coordinator= status");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--coordinator"));
  r = RunOptimusctl("job");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("`optimusctl job` needs a command"));
  r = RunOptimusctl("checkpoint export --out=/tmp/x.pt");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("needs a JOB (with the coordinator) or --path=DIR"));
  r = RunOptimusctl("checkpoint export j --path=/tmp/c --out=/tmp/x.pt");
  EXPECT_EQ(r.exit_code, 2);
}

TEST(OptimusctlVersionTest, PrintsTheVersion) {
  RunResult r = RunOptimusctl("version");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, ::testing::StartsWith("optimusctl "));
  r = RunOptimusctl("--version");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, ::testing::StartsWith("optimusctl "));
  r = RunOptimusctl("version -o json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  Json doc = ParseOrFail(r.out);
  EXPECT_TRUE(doc["version"].is_string());
  EXPECT_EQ(YamlToJson(YAML::Load(RunOptimusctl("version -o yaml").out)), doc);
}

// -o json and -o yaml of every read command: the same document.
TEST_F(OptimusctlTest, JsonAndYamlOutputsCarryTheSameFields) {
  const uint64_t a = RegisterShard(v1::SHARD_KIND_DPU, "bf-0");
  const uint64_t b = RegisterShard(v1::SHARD_KIND_HOST, "true");  // YAML would read a bool.
  CreateJob();
  StartBeating({a, b}, /*seeded=*/false);  // Keep their leases; the job gets READY.
  const std::string coord = absl::StrCat("--coordinator=", server_->address());
  // Compare outputs of a cluster that no longer changes (but for lease ages).
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline &&
         RunOptimusctl(coord + " job list").out.find("READY") == std::string::npos) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  for (const std::string& command :
       std::vector<std::string>{"status", "job list", "job describe gpt-small", "shard list",
                                absl::StrCat("shard describe ", a)}) {
    const RunResult json = RunOptimusctl(absl::StrCat(coord, " ", command, " -o json"));
    ASSERT_EQ(json.exit_code, 0) << command << ": " << json.err;
    const Json doc = ParseOrFail(json.out);
    ASSERT_FALSE(doc.is_discarded()) << command;
    EXPECT_EQ(ParseOrFail(RunOptimusctl(absl::StrCat(coord, " ", command, " --json")).out)
                  .is_discarded(),
              false);
    const RunResult yaml = RunOptimusctl(absl::StrCat(coord, " ", command, " -o yaml"));
    ASSERT_EQ(yaml.exit_code, 0) << command << ": " << yaml.err;
    const Json from_yaml = YamlToJson(YAML::Load(yaml.out));
    EXPECT_EQ(WithoutLeaseAges(from_yaml), WithoutLeaseAges(doc))
        << command << "\nYAML:\n" << yaml.out << "\nJSON:\n" << json.out;
  }
  Json doc = ParseOrFail(RunOptimusctl(absl::StrCat(coord, " job describe gpt-small -o json")).out);
  EXPECT_EQ(doc["name"].get<std::string>(), "gpt-small");
  EXPECT_EQ(doc["world_size"].get<uint64_t>(), 4u);
  EXPECT_EQ(doc["num_chunks"].get<uint64_t>(), 5u);
  EXPECT_EQ(doc["optimizer"]["lr"].get<double>(), 0.0003);
  doc = ParseOrFail(RunOptimusctl(absl::StrCat(coord, " shard list -o json")).out);
  ASSERT_EQ(doc["shards"].size(), 2u);
  EXPECT_EQ(doc["shards"][1]["hostname"].get<std::string>(), "true");
  // Tables for people.
  RunResult r = RunOptimusctl(absl::StrCat(coord, " job list"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, ::testing::ContainsRegex("gpt-small +READY +0/4 +0 +2 +64064 +.* +5 +1 +0 "));
  r = RunOptimusctl(absl::StrCat(coord, " job describe gpt-small"));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("Name:             gpt-small\n"));
  EXPECT_THAT(r.out, HasSubstr("Chunks:           5 (map epoch 1)\n"));
  EXPECT_THAT(r.out, HasSubstr("adamw"));
  r = RunOptimusctl(absl::StrCat(coord, " shard describe ", a));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("Host:            bf-0\n"));
  r = RunOptimusctl(absl::StrCat(coord, " job describe nosuchjob"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("no job named \"nosuchjob\""));
  r = RunOptimusctl(absl::StrCat(coord, " shard describe 99"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("no shard with id 99"));
}

TEST_F(OptimusctlTest, TheCoordinatorComesFromOptimusCoordinatorWhenNotGiven) {
  RegisterShard(v1::SHARD_KIND_DPU, "bf-0");
  const std::string env = "OPTIMUS_COORDINATOR=" + server_->address();
  RunResult r = RunOptimusctl("shard list -o json", env);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(ParseOrFail(r.out)["shards"][0]["hostname"].get<std::string>(), "bf-0");
  // --coordinator wins over the environment.
  r = RunOptimusctl(absl::StrCat("shard list --coordinator=", server_->address()),
                    "OPTIMUS_COORDINATOR=127.0.0.1:1");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("bf-0"));
  const std::string nobody = absl::StrCat("127.0.0.1:", UnusedPort());
  r = RunOptimusctl("--timeout_ms=2000 status", "OPTIMUS_COORDINATOR=" + nobody);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("cannot reach coordinator at " + nobody));
}

// Bad job spec files: exit 1 with the file, line and field; nothing is sent.
TEST(OptimusctlJobCreateTest, BadSpecFilesSayWhatIsWrong) {
  const std::string dir = ::testing::TempDir();
  const auto write = [&](const std::string& name, const std::string& text) {
    const std::string path = dir + "/" + name;
    std::ofstream(path) << text;
    return path;
  };
  const std::string coord = absl::StrCat("--coordinator=127.0.0.1:", UnusedPort());
  RunResult r = RunOptimusctl(
      coord + " job create -f " + write("typo.yaml", "name: j\noptimizr: {type: adamw}\n"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("typo.yaml:2: optimizr: unknown field"));
  r = RunOptimusctl(coord + " job create -f " + write("notensors.yaml", "name: j\nworld_size: 2\n"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("notensors.yaml: no `tensors:` list"));
  r = RunOptimusctl(coord + " job create -f " +
                    write("noname.yaml", "world_size: 2\ntensors: [{name: w, shape: [4]}]\n"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("the job has no name (set `name:` or --name)"));
  r = RunOptimusctl(coord + " job create -f " + dir + "/does-not-exist.yaml");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("does-not-exist.yaml"));
  r = RunOptimusctl(coord + " job create");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("--file is required"));
}

// A job created from a file on a coordinator with no shards: refused,
// exit 1, with the coordinator's reason.
TEST_F(OptimusctlTest, JobCreateReportsTheCoordinatorsRefusal) {
  const std::string path = ::testing::TempDir() + "/j.yaml";
  std::ofstream(path) << "name: j\nworld_size: 2\ntensors: [{name: w, shape: [4]}]\n";
  const RunResult r = RunOptimusctl(
      absl::StrCat("--coordinator=", server_->address(), " job create -f ", path));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("job \"j\""));
}

}  // namespace
}  // namespace optimus
