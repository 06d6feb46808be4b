// optimus-coord's etcd mode with the real binaries and a real etcd: one of
// two coordinators leads and serves, the other (standby) answers /healthz,
// says not ready on /readyz and does not listen for gRPC; when the leader
// is SIGKILLed the standby leads with the same shards, jobs and maps; a
// killed etcd member (of three) changes nothing; SIGTERM hands over at
// once; a leader whose election key is gone exits with status 3; the state
// folder and etcd cannot both be asked for.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <functional>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "coordinator/etcd_client.h"
#include "coordinator/etcd_test_cluster.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/optimus.grpc.pb.h"
#include "proto/optimus.pb.h"

namespace optimus {
namespace {

using google::protobuf::util::MessageDifferencer;

// Hang guard for anything awaited; never a speed requirement.
constexpr absl::Duration kHangGuard = absl::Seconds(90);
// The coordinators' etcd lease TTL (--etcd_lease_ttl_s). Their shard lease
// (--lease_ms) is a minute: the shards registered here never heartbeat, and
// must stay UP while the state is compared.
constexpr int kTtlS = 4;
constexpr int kLeaseMs = 60000;

const char kBinary[] = "coordinator/optimus-coord";

struct Coord {
  pid_t pid = 0;
  int grpc_port = 0;
  int http_port = 0;
  std::string port_file;
  std::string log;
};

bool FileExists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool WaitFor(const std::function<bool()>& done, absl::Duration guard = kHangGuard) {
  const absl::Time deadline = absl::Now() + guard;
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return true;
}

// The HTTP status of GET path on 127.0.0.1:port; -1 when nothing answers.
int HttpGet(int port, const std::string& path) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  const std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
  if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    ::close(fd);
    return -1;
  }
  char buf[256];
  const ssize_t n = ::read(fd, buf, sizeof(buf) - 1);
  ::close(fd);
  if (n < 12) return -1;
  buf[n] = '\0';
  int code = -1;
  if (std::sscanf(buf, "HTTP/%*s %d", &code) != 1) return -1;
  return code;
}

bool Listening(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

Coord StartCoord(const std::string& folder, const std::string& name, const std::string& etcd,
                 const std::string& prefix) {
  Coord c;
  c.grpc_port = PickFreePort();
  c.http_port = PickFreePort();
  c.port_file = absl::StrCat(folder, "/", name, ".port");
  c.log = absl::StrCat(folder, "/", name, ".log");
  std::vector<std::string> argv = {
      kBinary,
      absl::StrCat("--listen=127.0.0.1:", c.grpc_port),
      absl::StrCat("--advertise_address=127.0.0.1:", c.grpc_port),
      "--insecure_plaintext",
      absl::StrCat("--port_file=", c.port_file),
      absl::StrCat("--metrics_port=", c.http_port),
      "--metrics_host=127.0.0.1",
      absl::StrCat("--etcd_endpoints=", etcd),
      absl::StrCat("--etcd_prefix=", prefix),
      absl::StrCat("--lease_ms=", kLeaseMs),
      absl::StrCat("--etcd_lease_ttl_s=", kTtlS),
  };
  absl::StatusOr<pid_t> pid = SpawnLogged(argv, c.log);
  EXPECT_TRUE(pid.ok()) << pid.status();
  c.pid = pid.ok() ? *pid : 0;
  return c;
}

// The exit status (as waitpid gives it) once the process ends; nullopt if
// it is still running after `guard`.
std::optional<int> WaitExit(pid_t pid, absl::Duration guard = kHangGuard) {
  int wstatus = 0;
  std::optional<int> out;
  WaitFor(
      [&] {
        if (::waitpid(pid, &wstatus, WNOHANG) == pid) out = wstatus;
        return out.has_value();
      },
      guard);
  return out;
}

void Stop(Coord* c) {
  if (c->pid <= 0) return;
  ::kill(c->pid, SIGKILL);
  int wstatus;
  ::waitpid(c->pid, &wstatus, 0);
  c->pid = 0;
}

std::unique_ptr<v1::Coordinator::Stub> StubFor(const Coord& c) {
  return v1::Coordinator::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", c.grpc_port),
                                                      grpc::InsecureChannelCredentials()));
}

v1::RegisterShardRequest HostShard(const std::string& host) {
  v1::RegisterShardRequest req;
  v1::ShardCapabilities* c = req.mutable_capabilities();
  c->set_kind(v1::SHARD_KIND_HOST);
  c->set_memory_limit_bytes(64 << 20);
  c->set_data_address("ucx-" + host);
  c->set_hostname(host);
  return req;
}

v1::CreateJobRequest SmallJob(const std::string& name) {
  v1::CreateJobRequest req;
  v1::JobSpec* s = req.mutable_spec();
  s->set_name(name);
  s->set_world_size(2);
  v1::TensorSpec* t = s->add_tensors();
  t->set_name("w");
  t->add_shape(1000);
  t->add_shape(700);
  s->mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  s->mutable_optimizer()->set_lr(1e-3f);
  s->set_grad_dtype(v1::DTYPE_BF16);
  s->set_param_dtype(v1::DTYPE_BF16);
  s->set_max_chunk_bytes(256 * 1024);
  return req;
}

grpc::Status Call(const std::function<grpc::Status(grpc::ClientContext*)>& f) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  return f(&ctx);
}

// What a user sees of the state: shards (id, host, state) and jobs (id,
// name, state, map epoch) in status, and each job's map.
struct Seen {
  std::vector<std::string> shards;
  std::vector<std::string> jobs;
  std::vector<v1::ShardMap> maps;
};

Seen Look(v1::Coordinator::Stub* stub) {
  Seen seen;
  v1::StatusResponse st;
  grpc::Status s = Call([&](grpc::ClientContext* ctx) {
    return stub->Status(ctx, v1::StatusRequest(), &st);
  });
  EXPECT_TRUE(s.ok()) << s.error_message();
  for (const v1::ShardStatus& sh : st.shards()) {
    seen.shards.push_back(absl::StrCat(sh.shard_id(), " ", sh.capabilities().hostname(), " ",
                                       v1::ShardState_Name(sh.state())));
  }
  for (const v1::JobStatus& j : st.jobs()) {
    seen.jobs.push_back(absl::StrCat(j.job_id(), " ", j.name(), " ", v1::JobState_Name(j.state()),
                                     " epoch ", j.map_epoch()));
    v1::GetShardMapRequest req;
    req.set_job_id(j.job_id());
    v1::ShardMap map;
    grpc::Status m = Call([&](grpc::ClientContext* ctx) { return stub->GetShardMap(ctx, req, &map); });
    EXPECT_TRUE(m.ok()) << m.error_message();
    seen.maps.push_back(map);
  }
  return seen;
}

void ExpectSameState(const Seen& a, const Seen& b) {
  EXPECT_EQ(a.shards, b.shards);
  EXPECT_EQ(a.jobs, b.jobs);
  ASSERT_EQ(a.maps.size(), b.maps.size());
  for (size_t i = 0; i < a.maps.size(); ++i) {
    EXPECT_TRUE(MessageDifferencer::Equals(a.maps[i], b.maps[i]))
        << a.maps[i].ShortDebugString() << "\nvs\n" << b.maps[i].ShortDebugString();
  }
}

// Registers shards on the leader and creates one job.
void MakeState(v1::Coordinator::Stub* stub, const std::vector<std::string>& hosts) {
  for (const std::string& h : hosts) {
    v1::RegisterShardResponse r;
    grpc::Status s = Call([&](grpc::ClientContext* ctx) {
      return stub->RegisterShard(ctx, HostShard(h), &r);
    });
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  v1::CreateJobResponse r;
  grpc::Status s = Call([&](grpc::ClientContext* ctx) {
    return stub->CreateJob(ctx, SmallJob("llm"), &r);
  });
  ASSERT_TRUE(s.ok()) << s.error_message();
}

class LeaderElectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (EtcdTestCluster::Binary().empty()) GTEST_SKIP() << EtcdTestCluster::kMissing;
  }
  void TearDown() override {
    Stop(&c1_);
    Stop(&c2_);
  }

  // Starts the cluster, c1 (which leads) and c2 (standby, checked).
  void StartTwo(int members, const std::string& name) {
    auto cluster = EtcdTestCluster::Start(members, name);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    prefix_ = "/" + name;
    c1_ = StartCoord(cluster_->folder(), "c1", cluster_->endpoints_flag(), prefix_);
    ASSERT_TRUE(WaitFor([&] { return FileExists(c1_.port_file); })) << ReadFile(c1_.log);
    EXPECT_EQ(HttpGet(c1_.http_port, "/readyz"), 200);
    c2_ = StartCoord(cluster_->folder(), "c2", cluster_->endpoints_flag(), prefix_);
    ASSERT_TRUE(WaitFor([&] { return HttpGet(c2_.http_port, "/healthz") == 200; }))
        << ReadFile(c2_.log);
    ASSERT_TRUE(WaitFor([&] { return absl::StrContains(ReadFile(c2_.log), "standby:"); }));
    ExpectStandby(c2_);
  }

  void ExpectStandby(const Coord& c) {
    EXPECT_EQ(HttpGet(c.http_port, "/readyz"), 503);
    EXPECT_FALSE(Listening(c.grpc_port)) << "a standby must not listen for gRPC";
    EXPECT_FALSE(FileExists(c.port_file));
  }

  std::unique_ptr<EtcdTestCluster> cluster_;
  std::string prefix_;
  Coord c1_, c2_;
};

TEST_F(LeaderElectionTest, StandbyLeadsWithTheSameStateWhenTheLeaderIsKilled) {
  StartTwo(1, "takeover");
  auto stub1 = StubFor(c1_);
  MakeState(stub1.get(), {"a", "b", "c"});
  const Seen before = Look(stub1.get());
  ASSERT_EQ(before.shards.size(), 3u);
  ASSERT_EQ(before.jobs.size(), 1u);
  ASSERT_GT(before.maps[0].chunks_size(), 0);

  ::kill(c1_.pid, SIGKILL);
  const absl::Time killed = absl::Now();
  ASSERT_TRUE(WaitExit(c1_.pid).has_value());
  c1_.pid = 0;
  ASSERT_TRUE(WaitFor([&] { return FileExists(c2_.port_file); })) << ReadFile(c2_.log);
  // A figure, not a requirement: the lease's TTL plus etcd's expiry check.
  std::printf("takeover after SIGKILL of the leader: %.2f s (etcd lease TTL %d s)\n",
              absl::ToDoubleSeconds(absl::Now() - killed), kTtlS);
  EXPECT_EQ(HttpGet(c2_.http_port, "/readyz"), 200);
  auto stub2 = StubFor(c2_);
  ExpectSameState(before, Look(stub2.get()));
}

TEST_F(LeaderElectionTest, AKilledEtcdMemberChangesNothingAndSigtermHandsOver) {
  StartTwo(3, "three_members");
  auto stub1 = StubFor(c1_);
  MakeState(stub1.get(), {"a", "b"});

  // m0 is the first endpoint both coordinators use.
  cluster_->Kill(0);
  // Three TTLs without m0: the leader keeps its lease through the others
  // (waitpid would reap it had it exited) and the standby stays one.
  absl::SleepFor(absl::Seconds(3 * kTtlS));
  int wstatus;
  EXPECT_EQ(::waitpid(c1_.pid, &wstatus, WNOHANG), 0) << ReadFile(c1_.log);
  EXPECT_EQ(::waitpid(c2_.pid, &wstatus, WNOHANG), 0) << ReadFile(c2_.log);
  ExpectStandby(c2_);
  // Writes still go through.
  {
    v1::RegisterShardResponse r;
    grpc::Status s = Call([&](grpc::ClientContext* ctx) {
      return stub1->RegisterShard(ctx, HostShard("c"), &r);
    });
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  const Seen before = Look(stub1.get());
  ASSERT_EQ(before.shards.size(), 3u);

  ::kill(c1_.pid, SIGTERM);
  const absl::Time stopped = absl::Now();
  std::optional<int> ended = WaitExit(c1_.pid);
  ASSERT_TRUE(ended.has_value());
  c1_.pid = 0;
  EXPECT_TRUE(WIFEXITED(*ended) && WEXITSTATUS(*ended) == 0) << *ended;
  ASSERT_TRUE(WaitFor([&] { return FileExists(c2_.port_file); })) << ReadFile(c2_.log);
  std::printf("takeover after SIGTERM of the leader: %.2f s\n",
              absl::ToDoubleSeconds(absl::Now() - stopped));
  auto stub2 = StubFor(c2_);
  ExpectSameState(before, Look(stub2.get()));
}

TEST_F(LeaderElectionTest, ALeaderWhoseElectionKeyIsGoneExitsAndTheStandbyLeads) {
  StartTwo(1, "key_gone");
  EtcdClientOptions o;
  o.endpoints = cluster_->endpoints();
  auto client = EtcdClient::Create(o);
  ASSERT_TRUE(client.ok());
  auto leader = (*client)->Leader(prefix_ + "/election");
  ASSERT_TRUE(leader.ok()) << leader.status();
  ASSERT_TRUE(leader->has_value());
  EXPECT_EQ((*leader)->value(), absl::StrCat("127.0.0.1:", c1_.grpc_port));
  etcdserverpb::DeleteRangeRequest del;
  del.set_key((*leader)->key());
  ASSERT_TRUE((*client)->DeleteRange(del).ok());

  std::optional<int> ended = WaitExit(c1_.pid);
  ASSERT_TRUE(ended.has_value());
  c1_.pid = 0;
  EXPECT_TRUE(WIFEXITED(*ended) && WEXITSTATUS(*ended) == 3) << *ended;
  EXPECT_TRUE(absl::StrContains(ReadFile(c1_.log), "LEADERSHIP LOST"));
  ASSERT_TRUE(WaitFor([&] { return FileExists(c2_.port_file); })) << ReadFile(c2_.log);
}

TEST(LeaderElectionFlagsTest, StateDirAndEtcdAreExclusive) {
  const std::string folder = TestFolder("flags");
  const std::string log = folder + "/coord.log";
  absl::StatusOr<pid_t> pid = SpawnLogged(
      {kBinary, "--insecure_plaintext", "--state_dir=" + folder,
       "--etcd_endpoints=127.0.0.1:1"},
      log);
  ASSERT_TRUE(pid.ok()) << pid.status();
  std::optional<int> ended = WaitExit(*pid);
  ASSERT_TRUE(ended.has_value());
  EXPECT_TRUE(WIFEXITED(*ended) && WEXITSTATUS(*ended) == 2) << *ended;
  EXPECT_TRUE(absl::StrContains(ReadFile(log), "exclusive")) << ReadFile(log);
}

}  // namespace
}  // namespace optimus
