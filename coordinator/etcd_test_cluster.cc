#include "coordinator/etcd_test_cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "coordinator/etcd_client.h"

extern char** environ;

namespace optimus {
namespace {
int PickOnePort();
}  // namespace

int PickFreePort() {
  // bind(0) may hand the same port out twice in a row once it is closed:
  // never give one out twice.
  static absl::Mutex mu(absl::kConstInit);
  static std::set<int>* given = new std::set<int>();
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int port = PickOnePort();
    absl::MutexLock lock(&mu);
    if (port != 0 && given->insert(port).second) return port;
  }
  return 0;
}

namespace {
int PickOnePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  int port = 0;
  socklen_t len = sizeof(addr);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}
}  // namespace

std::string TestFolder(const std::string& name) {
  const char* t = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(t != nullptr ? t : "/tmp", "/", name);
  if (std::system(absl::StrCat("rm -rf '", dir, "'").c_str()) != 0) {
    // Nothing there to remove, or it stays: mkdir below reports nothing either.
  }
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

absl::StatusOr<pid_t> SpawnLogged(const std::vector<std::string>& argv, const std::string& log) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int rc = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat("cannot start ", argv[0], ": ", strerror(rc)));
  }
  return pid;
}

std::string EtcdTestCluster::Binary() {
  const char* env = std::getenv("OPTIMUS_ETCD_BIN");
  const std::string path = env != nullptr && *env != '\0' ? env : "/usr/bin/etcd";
  return ::access(path.c_str(), X_OK) == 0 ? path : "";
}

std::string EtcdTestCluster::endpoints_flag() const { return absl::StrJoin(endpoints_, ","); }

absl::StatusOr<std::unique_ptr<EtcdTestCluster>> EtcdTestCluster::Start(int members,
                                                                        const std::string& name) {
  const std::string bin = Binary();
  if (bin.empty()) return absl::FailedPreconditionError(kMissing);
  std::unique_ptr<EtcdTestCluster> c(new EtcdTestCluster());
  c->folder_ = TestFolder(name);
  std::vector<int> peer_ports;
  for (int i = 0; i < members; ++i) {
    c->endpoints_.push_back(absl::StrCat("127.0.0.1:", PickFreePort()));
    peer_ports.push_back(PickFreePort());
  }
  std::vector<std::string> initial;
  for (int i = 0; i < members; ++i) {
    initial.push_back(absl::StrCat("m", i, "=http://127.0.0.1:", peer_ports[i]));
  }
  for (int i = 0; i < members; ++i) {
    const std::string client_url = absl::StrCat("http://", c->endpoints_[i]);
    const std::string peer_url = absl::StrCat("http://127.0.0.1:", peer_ports[i]);
    std::vector<std::string> argv = {
        bin,
        absl::StrCat("--name=m", i),
        absl::StrCat("--data-dir=", c->folder_, "/m", i),
        absl::StrCat("--listen-client-urls=", client_url),
        absl::StrCat("--advertise-client-urls=", client_url),
        absl::StrCat("--listen-peer-urls=", peer_url),
        absl::StrCat("--initial-advertise-peer-urls=", peer_url),
        absl::StrCat("--initial-cluster=", absl::StrJoin(initial, ",")),
        "--initial-cluster-state=new",
        absl::StrCat("--initial-cluster-token=optimus-test-", ::getpid()),
        "--logger=zap",
        "--log-outputs=stderr",
    };
    absl::StatusOr<pid_t> pid = SpawnLogged(argv, absl::StrCat(c->folder_, "/m", i, ".log"));
    if (!pid.ok()) return pid.status();
    c->pids_.push_back(*pid);
  }
  // Ready when every member answers a linearizable read (through the
  // raft leader). A generous hang guard: etcd starts in about a second.
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  for (int i = 0; i < members; ++i) {
    EtcdClientOptions o;
    o.endpoints = {c->endpoints_[i]};
    o.call_timeout = absl::Seconds(2);
    auto client = EtcdClient::Create(o);
    if (!client.ok()) return client.status();
    while (true) {
      etcdserverpb::RangeRequest req;
      req.set_key("/ready");
      absl::StatusOr<etcdserverpb::RangeResponse> r = (*client)->Range(req);
      if (r.ok()) break;
      int wstatus = 0;
      if (::waitpid(c->pids_[i], &wstatus, WNOHANG) == c->pids_[i]) {
        c->pids_[i] = 0;
        std::ifstream in(absl::StrCat(c->folder_, "/m", i, ".log"));
        std::stringstream text;
        text << in.rdbuf();
        std::string tail = text.str();
        if (tail.size() > 2000) tail = tail.substr(tail.size() - 2000);
        return absl::InternalError(absl::StrCat("etcd member m", i, " exited: ", tail));
      }
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat("etcd member m", i, " at ",
                                                        c->endpoints_[i], " never answered: ",
                                                        r.status().ToString()));
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
  }
  return c;
}

void EtcdTestCluster::Kill(int i) {
  if (pids_[i] <= 0) return;
  ::kill(pids_[i], SIGKILL);
  int wstatus = 0;
  ::waitpid(pids_[i], &wstatus, 0);
  pids_[i] = 0;
}

EtcdTestCluster::~EtcdTestCluster() {
  for (size_t i = 0; i < pids_.size(); ++i) Kill(static_cast<int>(i));
}

}  // namespace optimus
