// Helpers for the transport tests (transport_test, ucx_test, loopback_test):
// a handler that collects what arrives, a byte pattern, a blocking send, and
// a peer worker in another process (PeerProcess). Test-only. Sink is
// thread-safe; the functions are stateless; a PeerProcess belongs to one
// thread.
#ifndef OPTIMUS_TRANSPORT_TEST_UTIL_H_
#define OPTIMUS_TRANSPORT_TEST_UTIL_H_

#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace optimus {
namespace transport {
namespace test_util {

inline constexpr absl::Duration kWait = absl::Seconds(10);

struct Received {
  std::string header;
  std::vector<uint8_t> payload;
  bool rendezvous = false;
  absl::Status status;
};

// Collects what arrives on a handler; receives payloads unless told to
// ignore them.
class Sink {
 public:
  void Handle(IncomingMessage& msg) {
    auto r = std::make_shared<Received>();
    r->header.assign(reinterpret_cast<const char*>(msg.header().data()), msg.header().size());
    r->rendezvous = msg.is_rendezvous();
    if (ignore_payloads.load()) {
      absl::MutexLock lock(&mu_);
      r->status = absl::CancelledError("ignored");
      got_.push_back(r);
      return;
    }
    r->payload.resize(msg.payload_size());
    msg.ReceiveInto(r->payload.data(), [this, r](absl::Status s) {
      absl::MutexLock lock(&mu_);
      r->status = s;
      got_.push_back(r);
    });
  }

  // Until n messages are complete (payload received or ignored).
  bool WaitFor(size_t n, absl::Duration timeout = kWait) {
    absl::MutexLock lock(&mu_);
    auto enough = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return got_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }

  std::vector<std::shared_ptr<Received>> got() {
    absl::MutexLock lock(&mu_);
    return got_;
  }

  std::atomic<bool> ignore_payloads{false};

 private:
  absl::Mutex mu_;
  std::vector<std::shared_ptr<Received>> got_ ABSL_GUARDED_BY(mu_);
};

inline std::vector<uint8_t> Pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 31 + seed + (i >> 12));
  return v;
}

inline absl::Span<const uint8_t> Bytes(const std::string& s) {
  return absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// Sends and waits for the send's completion; DEADLINE_EXCEEDED when it does
// not complete within kWait (a hang).
inline absl::Status SendAndWait(Worker* w, EndpointRef ep, uint16_t id, const std::string& hdr,
                                const void* payload, size_t size) {
  // Shared with the callback, which may still run after a timeout.
  struct State {
    absl::Notification done;
    absl::Status result;
  };
  auto state = std::make_shared<State>();
  w->Send(ep, id, Bytes(hdr), payload, size, [state](absl::Status s) {
    state->result = s;
    state->done.Notify();
  });
  if (!state->done.WaitForNotificationWithTimeout(kWait)) {
    return absl::DeadlineExceededError("send did not complete");
  }
  return state->result;
}

// transport/test_peer (a data dependency of the test) running in a child
// process, driven over its stdin/stdout (see test_peer.cc for the commands).
// The destructor kills it if it still runs.
class PeerProcess {
 public:
  PeerProcess() = default;
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;
  ~PeerProcess() {
    Kill();
    if (to_child_ >= 0) close(to_child_);
    if (from_child_ >= 0) close(from_child_);
  }

  // Starts test_peer with these flags and reads its address.
  absl::Status Start(const std::vector<std::string>& flags) {
    const char* srcdir = std::getenv("TEST_SRCDIR");
    if (srcdir == nullptr) return absl::FailedPreconditionError("TEST_SRCDIR unset");
    const std::string binary = absl::StrCat(srcdir, "/optimus/transport/test_peer");
    if (access(binary.c_str(), X_OK) != 0) {
      // The aarch64 cross build under qemu (deploy/aarch64) makes the test
      // binaries only; the peer runs natively in //transport:transport_test.
      return absl::NotFoundError(absl::StrCat(binary, " is not built here"));
    }
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) return absl::InternalError("pipe");
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, in[0], 0);
    posix_spawn_file_actions_adddup2(&actions, out[1], 1);
    posix_spawn_file_actions_addclose(&actions, in[1]);
    posix_spawn_file_actions_addclose(&actions, out[0]);
    std::vector<std::string> args = {binary};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const int rc = posix_spawn(&pid_, binary.c_str(), &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    close(in[0]);
    close(out[1]);
    to_child_ = in[1];
    from_child_ = out[0];
    if (rc != 0) {
      pid_ = -1;
      return absl::InternalError(absl::StrCat("posix_spawn ", binary, ": ", rc));
    }
    std::string line = ReadLine("ADDRESS ", kWait);
    if (line.empty()) return absl::UnavailableError("test_peer did not start");
    address_ = absl::HexStringToBytes(line.substr(8));
    return absl::OkStatus();
  }

  const std::string& address() const { return address_; }

  void Command(const std::string& line) {
    const std::string l = line + "\n";
    (void)!write(to_child_, l.data(), l.size());
  }

  // The next line from the child that starts with prefix (others are
  // skipped), or "" after timeout or when the child is gone.
  std::string ReadLine(const std::string& prefix, absl::Duration timeout = kWait) {
    const absl::Time give_up = absl::Now() + timeout;
    for (;;) {
      for (size_t nl; (nl = buffer_.find('\n')) != std::string::npos;) {
        std::string line = buffer_.substr(0, nl);
        buffer_.erase(0, nl + 1);
        if (absl::StartsWith(line, prefix)) return line;
      }
      const absl::Duration left = give_up - absl::Now();
      if (left <= absl::ZeroDuration()) return "";
      struct pollfd pfd = {from_child_, POLLIN, 0};
      if (poll(&pfd, 1, static_cast<int>(absl::ToInt64Milliseconds(left)) + 1) <= 0) continue;
      char chunk[4096];
      const ssize_t n = read(from_child_, chunk, sizeof(chunk));
      if (n <= 0) return "";
      buffer_.append(chunk, n);
    }
  }

  // SIGKILL, and reaps it.
  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    int status;
    waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string buffer_;
  std::string address_;
};

}  // namespace test_util
}  // namespace transport
}  // namespace optimus

#endif  // OPTIMUS_TRANSPORT_TEST_UTIL_H_
