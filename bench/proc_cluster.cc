#include "bench/proc_cluster.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/grpc_limits.h"
#include "absl/time/clock.h"

namespace optimus {
namespace bench {
namespace {

std::vector<pid_t>& Children() {
  static auto* children = new std::vector<pid_t>();
  return *children;
}

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

}  // namespace

std::string FindBinRoot(const char* argv0, const std::string& bin_dir,
                        const std::vector<std::string>& needs) {
  std::vector<std::string> candidates;
  if (!bin_dir.empty()) candidates.push_back(bin_dir);
  if (const char* r = std::getenv("RUNFILES_DIR")) candidates.push_back(absl::StrCat(r, "/optimus"));
  candidates.push_back(absl::StrCat(argv0, ".runfiles/optimus"));
  candidates.push_back(".");
  for (const auto& c : candidates) {
    if (std::all_of(needs.begin(), needs.end(),
                    [&c](const std::string& n) { return Exists(c + "/" + n); })) {
      return c;
    }
  }
  return "";
}

bool WaitPid(pid_t pid, absl::Duration timeout, int* status) {
  const absl::Time give_up = absl::Now() + timeout;
  for (;;) {
    const pid_t r = waitpid(pid, status, WNOHANG);
    if (r == pid || r < 0) {
      auto& c = Children();
      c.erase(std::remove(c.begin(), c.end(), pid), c.end());
      return true;
    }
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(10));
  }
}

std::string ShellLine(const std::vector<std::string>& env, const std::vector<std::string>& args) {
  std::vector<std::string> parts;
  for (const auto& e : env) parts.push_back(e);
  for (const auto& a : args) {
    const bool plain = a.find_first_of(" ;'\"$&|<>*?") == std::string::npos;
    parts.push_back(plain ? a : absl::StrCat("'", a, "'"));
  }
  return absl::StrJoin(parts, " ");
}

pid_t Spawn(const std::vector<std::string>& env, const std::vector<std::string>& args,
            const std::string& log_path, int* stdout_fd) {
  int fds[2] = {-1, -1};
  if (stdout_fd != nullptr && pipe(fds) != 0) return -1;
  const pid_t pid = fork();
  if (pid == 0) {
    const int log = open(log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (log >= 0) {
      dup2(log, 2);
      dup2(stdout_fd != nullptr ? fds[1] : log, 1);
    }
    if (stdout_fd != nullptr) {
      close(fds[0]);
      close(fds[1]);
    }
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    for (const auto& e : env) putenv(const_cast<char*>(e.c_str()));
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execvp(argv[0], argv.data());
    std::fprintf(stderr, "exec %s: %s\n", argv[0], std::strerror(errno));
    _exit(127);
  }
  if (stdout_fd != nullptr) {
    close(fds[1]);
    *stdout_fd = fds[0];
  }
  if (pid > 0) Children().push_back(pid);
  return pid;
}

void Stop(pid_t pid) {
  if (pid <= 0) return;
  int status = 0;
  kill(pid, SIGTERM);
  if (!WaitPid(pid, absl::Seconds(10), &status)) {
    kill(pid, SIGKILL);
    WaitPid(pid, absl::Seconds(5), &status);
  }
}

void KillChildren() {
  for (pid_t p : Children()) {
    if (p > 0) kill(p, SIGKILL);
  }
}

namespace {
void KillChildrenAndExit(int sig) {
  KillChildren();
  _exit(128 + sig);
}
}  // namespace

void KillChildrenOnSignals() {
  signal(SIGINT, KillChildrenAndExit);
  signal(SIGTERM, KillChildrenAndExit);
  signal(SIGPIPE, SIG_IGN);
}

FILE* TakeStdoutForJson() {
  const int json_fd = dup(1);
  if (json_fd < 0) return nullptr;
  dup2(2, 1);
  return fdopen(json_fd, "w");
}

[[noreturn]] void Die(const std::string& who, const std::string& msg) {
  std::fprintf(stderr, "%s: %s\n", who.c_str(), msg.c_str());
  KillChildren();
  std::exit(1);
}

absl::StatusOr<std::string> MakeWorkDir(const std::string& work_dir, const std::string& name) {
  if (!work_dir.empty()) {
    if (mkdir(work_dir.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::InternalError(absl::StrCat("mkdir ", work_dir, ": ", std::strerror(errno)));
    }
    return work_dir;
  }
  std::string tmpl = absl::StrCat("/tmp/optimus-", name, "-XXXXXX");
  if (mkdtemp(tmpl.data()) == nullptr) {
    return absl::InternalError(absl::StrCat("mkdtemp ", tmpl, ": ", std::strerror(errno)));
  }
  return tmpl;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string Tail(const std::string& path) {
  std::string s = ReadFile(path);
  return s.size() > 1500 ? s.substr(s.size() - 1500) : s;
}

int FreePort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  int port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  close(fd);
  return port;
}

std::vector<std::string> PinnedTo(const std::string& cpus, std::vector<std::string> args) {
  if (cpus.empty()) return args;
  std::vector<std::string> out{"taskset", "-c", cpus};
  out.insert(out.end(), args.begin(), args.end());
  return out;
}

absl::Status StartProcCluster(const ProcClusterOptions& o, ProcCluster* c) {
  const std::string port_file = absl::StrCat(o.work_dir, "/coord.port");
  unlink(port_file.c_str());
  const std::vector<std::string> coord_args =
      PinnedTo(o.cpus, {o.bin_root + "/coordinator/optimus-coord", "--listen=127.0.0.1:0",
                        "--port_file=" + port_file, "--lease_ms=2000"});
  c->transports = o.transports;
  c->commands.push_back(ShellLine({}, coord_args));
  c->coord = Spawn({}, coord_args, absl::StrCat(o.work_dir, "/coord.log"));
  if (c->coord < 0) return absl::InternalError("cannot start optimus-coord");
  std::string port;
  for (int i = 0; i < 500 && port.empty(); ++i) {
    std::ifstream in(port_file);
    std::getline(in, port);
    if (port.empty()) absl::SleepFor(absl::Milliseconds(20));
  }
  if (port.empty()) {
    return absl::InternalError("optimus-coord did not start:\n" + Tail(o.work_dir + "/coord.log"));
  }
  c->coord_addr = "127.0.0.1:" + port;
  for (int i = 0; i < o.num_shards; ++i) {
    std::vector<std::string> args = {o.bin_root + "/server/optimus-shard",
                                     "--coordinator=" + c->coord_addr, "--kind=host",
                                     "--net_devices=lo",
                                     absl::StrCat("--memory_limit_mb=", o.shard_memory_mb)};
    if (!o.transports.empty()) args.push_back("--transports=" + o.transports);
    const int mport = o.metrics ? FreePort() : 0;
    if (o.metrics) args.push_back(absl::StrCat("--metrics_port=", mport));
    args.insert(args.end(), o.shard_args.begin(), o.shard_args.end());
    args = PinnedTo(o.cpus, std::move(args));
    c->commands.push_back(ShellLine({}, args));
    const pid_t pid = Spawn({}, args, absl::StrCat(o.work_dir, "/shard-", i, ".log"));
    if (pid < 0) return absl::InternalError("cannot start optimus-shard");
    c->shards.push_back(pid);
    if (o.metrics) c->metrics_ports.push_back(mport);
  }
  c->stub = v1::Coordinator::NewStub(
      CreateLimitedChannel(c->coord_addr, grpc::InsecureChannelCredentials()));
  int up = 0;
  for (int i = 0; i < 1000 && up < o.num_shards; ++i) {
    v1::StatusResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
    up = 0;
    if (c->stub->Status(&ctx, v1::StatusRequest(), &resp).ok()) {
      for (const auto& s : resp.shards()) up += s.state() == v1::SHARD_STATE_UP;
    }
    if (up < o.num_shards) absl::SleepFor(absl::Milliseconds(20));
  }
  if (up < o.num_shards) {
    return absl::InternalError(absl::StrCat(up, " of ", o.num_shards, " shards registered:\n",
                                            Tail(o.work_dir + "/shard-0.log")));
  }
  return absl::OkStatus();
}

void StopProcCluster(ProcCluster* c) {
  for (pid_t p : c->shards) Stop(p);
  Stop(c->coord);
  c->shards.clear();
  c->coord = -1;
}

}  // namespace bench
}  // namespace optimus
