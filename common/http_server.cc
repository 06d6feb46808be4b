#include "common/http_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"

namespace optimus {
namespace {

// A request line and headers larger than this are refused (no bodies here).
constexpr size_t kMaxRequestBytes = 8192;

// Milliseconds left until `deadline` for poll(2), at least 0.
int MsLeft(absl::Time deadline) {
  const int64_t ms = absl::ToInt64Milliseconds(deadline - absl::Now());
  return ms <= 0 ? 0 : static_cast<int>(std::min<int64_t>(ms, 1 << 30));
}

const char* Reason(int code) {
  switch (code) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 503: return "Service Unavailable";
    default: return "Error";
  }
}

// Sends all of `data` unless the peer fails or `deadline` passes (false).
// Never blocks past the deadline: a client that stops reading cannot hold
// the thread.
bool WriteAll(int fd, const std::string& data, absl::Time deadline) {
  size_t off = 0;
  while (off < data.size()) {
    const ssize_t n =
        send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      off += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p = {fd, POLLOUT, 0};
      if (poll(&p, 1, MsLeft(deadline)) <= 0) return false;
      continue;
    }
    return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(
    const std::string& listen_address, std::map<std::string, HttpHandler> handlers,
    const HttpServerOptions& options) {
  if (options.threads < 1 || options.max_queued < 1 ||
      options.read_timeout <= absl::ZeroDuration() ||
      options.write_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "http server options: threads and max_queued must be >= 1, timeouts > 0");
  }
  const size_t colon = listen_address.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(listen_address.substr(colon + 1), &port) ||
      port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address \"", listen_address, "\" is not HOST:PORT"));
  }
  std::string host = listen_address.substr(0, colon);
  if (host.empty() || host == "*") host = "0.0.0.0";
  sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics host \"", host, "\" is not IPv4"));
  }
  std::unique_ptr<HttpServer> s(new HttpServer());
  s->options_ = options;
  s->handlers_ = std::move(handlers);
  s->listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (s->listen_fd_ < 0) return absl::UnavailableError(absl::StrCat("socket: ", strerror(errno)));
  const int one = 1;
  setsockopt(s->listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(s->listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      listen(s->listen_fd_, 64) != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", listen_address, ": ", strerror(errno)));
  }
  socklen_t len = sizeof(addr);
  getsockname(s->listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  s->port_ = ntohs(addr.sin_port);
  s->wake_fd_ = eventfd(0, EFD_CLOEXEC);
  if (s->wake_fd_ < 0) return absl::UnavailableError("eventfd failed");
  HttpServer* raw = s.get();
  for (int i = 0; i < options.threads; ++i) {
    s->servers_.emplace_back([raw] { raw->ServeLoop(); });
  }
  s->thread_ = std::thread([raw] { raw->Loop(); });
  return s;
}

HttpServer::~HttpServer() {
  if (thread_.joinable()) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof(one));
    thread_.join();
  }
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  // A thread in Serve finishes within the deadlines.
  for (std::thread& t : servers_) {
    if (t.joinable()) t.join();
  }
  {
    absl::MutexLock lock(&mu_);
    for (int fd : queue_) close(fd);
    queue_.clear();
  }
  if (listen_fd_ >= 0) close(listen_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

void HttpServer::ServeLoop() {
  for (;;) {
    int fd;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(this, &HttpServer::HasWorkOrStop));
      if (stop_) return;
      fd = queue_.front();
      queue_.pop_front();
    }
    Serve(fd);
    close(fd);
  }
}

void HttpServer::Loop() {
  for (;;) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    if (fds[0].revents & POLLIN) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) {
        bool queued = false;
        {
          absl::MutexLock lock(&mu_);
          if (queue_.size() < static_cast<size_t>(options_.max_queued)) {
            queue_.push_back(fd);
            queued = true;
          }
        }
        if (!queued) {
          shed_.fetch_add(1);
          close(fd);  // Every thread busy and the queue full: shed it.
        }
      }
    }
  }
}

void HttpServer::Serve(int fd) {
  // The whole request within read_timeout: a client trickling bytes is
  // dropped as one that sends none.
  const absl::Time read_deadline = absl::Now() + options_.read_timeout;
  std::string req;
  char buf[1024];
  while (req.find("\r\n\r\n") == std::string::npos && req.find("\n\n") == std::string::npos) {
    pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, MsLeft(read_deadline)) <= 0) {
      timed_out_.fetch_add(1);
      return;
    }
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) return;
    req.append(buf, static_cast<size_t>(n));
    if (req.size() > kMaxRequestBytes) break;
  }
  HttpResponse resp;
  std::vector<std::string> first = absl::StrSplit(req.substr(0, req.find('\n')), ' ');
  if (first.size() < 2) {
    resp = {400, "text/plain", "malformed request line\n"};
  } else if (first[0] != "GET") {
    resp = {405, "text/plain", "only GET is served here\n"};
  } else {
    std::string path = first[1];
    path = path.substr(0, path.find('?'));
    auto it = handlers_.find(path);
    if (it == handlers_.end()) {
      resp = {404, "text/plain", absl::StrCat("no handler for ", path, "\n")};
    } else {
      resp = it->second();
    }
  }
  const absl::Time write_deadline = absl::Now() + options_.write_timeout;
  if (!WriteAll(fd,
                absl::StrCat("HTTP/1.0 ", resp.code, " ", Reason(resp.code),
                             "\r\nContent-Type: ", resp.content_type,
                             "\r\nContent-Length: ", resp.body.size(),
                             "\r\nConnection: close\r\n\r\n", resp.body),
                write_deadline)) {
    timed_out_.fetch_add(1);
  }
}

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::UnavailableError("socket failed");
  sockaddr_in addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to 127.0.0.1:", port));
  }
  WriteAll(fd, absl::StrCat("GET ", path, " HTTP/1.0\r\n\r\n"), absl::Now() + absl::Seconds(5));
  std::string resp;
  char buf[4096];
  for (;;) {
    pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, 5000) <= 0) break;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    resp.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  const size_t body = resp.find("\r\n\r\n");
  if (resp.compare(0, 12, "HTTP/1.0 200") != 0 || body == std::string::npos) {
    return absl::InternalError(absl::StrCat("GET ", path, ": ", resp.substr(0, resp.find('\r'))));
  }
  return resp.substr(body + 4);
}

}  // namespace optimus
