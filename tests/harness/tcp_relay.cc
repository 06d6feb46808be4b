#include "tests/harness/tcp_relay.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace optimus {
namespace harness {
namespace {

sockaddr_in Loopback(int port) {
  sockaddr_in a;
  std::memset(&a, 0, sizeof(a));
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return a;
}

absl::Status ErrnoError(const std::string& what) {
  const int e = errno;
  return absl::Status(absl::ErrnoToStatusCode(e), absl::StrCat(what, ": ", std::strerror(e)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<TcpRelay>> TcpRelay::Start(const TcpRelayOptions& options) {
  std::unique_ptr<TcpRelay> r(new TcpRelay(options));
  r->listen_fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (r->listen_fd_ < 0) return ErrnoError("relay socket");
  const int one = 1;
  ::setsockopt(r->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in a = Loopback(options.listen_port);
  socklen_t len = sizeof(a);
  if (::bind(r->listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    return ErrnoError(absl::StrCat("relay bind to port ", options.listen_port));
  }
  if (::listen(r->listen_fd_, 16) != 0) return ErrnoError("relay listen");
  if (::getsockname(r->listen_fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    return ErrnoError("relay getsockname");
  }
  r->port_ = ntohs(a.sin_port);
  TcpRelay* self = r.get();
  r->acceptor_ = std::thread([self] { self->Accept(); });
  return r;
}

TcpRelay::~TcpRelay() {
  stop_ = true;
  if (listen_fd_ >= 0) ::shutdown(listen_fd_, SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  // The acceptor is gone: nothing adds to fds_ or pumps_ any more.
  for (int fd : fds_) ::shutdown(fd, SHUT_RDWR);
  for (std::thread& t : pumps_) t.join();
  for (int fd : fds_) ::close(fd);
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

std::string TcpRelay::address() const { return absl::StrCat("127.0.0.1:", port_); }

void TcpRelay::Accept() {
  for (;;) {
    const int in = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (in < 0 || stop_) {
      if (in >= 0) ::close(in);
      return;
    }
    if (options_.connect_delay > absl::ZeroDuration()) absl::SleepFor(options_.connect_delay);
    const int out = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a = Loopback(options_.target_port);
    if (out < 0 || ::connect(out, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      ::close(in);
      if (out >= 0) ::close(out);
      continue;
    }
    connections_.fetch_add(1);
    std::lock_guard<std::mutex> lock(mu_);
    fds_.push_back(in);
    fds_.push_back(out);
    pumps_.emplace_back([this, in, out] { Pump(in, out); });
    pumps_.emplace_back([this, in, out] { Pump(out, in); });
  }
}

void TcpRelay::Pump(int from, int to) const {
  std::vector<char> buf(64 * 1024);
  for (;;) {
    const ssize_t n = ::read(from, buf.data(), buf.size());
    if (n <= 0) break;
    if (options_.piece_delay > absl::ZeroDuration()) absl::SleepFor(options_.piece_delay);
    // MSG_NOSIGNAL: a peer that closed first must not kill the test with
    // SIGPIPE.
    if (::send(to, buf.data(), static_cast<size_t>(n), MSG_NOSIGNAL) != n) break;
  }
  ::shutdown(to, SHUT_WR);
}

}  // namespace harness
}  // namespace optimus
