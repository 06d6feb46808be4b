#include "common/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "httplib.h"

namespace optimus {
namespace {

struct HostPort {
  std::string host;  // An IPv4 or IPv6 address, without brackets.
  int port = 0;
};

absl::StatusOr<HostPort> ParseListenAddress(const std::string& address) {
  const auto bad = [&address](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "metrics address \"", address, "\" ", why,
        " (want HOST:PORT: 0.0.0.0:9090, [::]:9090, [::1]:0)"));
  };
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return bad("has no port");
  HostPort hp;
  if (!absl::SimpleAtoi(address.substr(colon + 1), &hp.port) || hp.port < 0 || hp.port > 65535) {
    return bad("has no port number in 0-65535");
  }
  hp.host = address.substr(0, colon);
  if (hp.host.empty() || hp.host == "*") {
    hp.host = "0.0.0.0";
    return hp;
  }
  if (hp.host.front() == '[') {
    if (hp.host.size() < 3 || hp.host.back() != ']') return bad("has an unclosed '['");
    hp.host = hp.host.substr(1, hp.host.size() - 2);
    in6_addr a6;
    if (inet_pton(AF_INET6, hp.host.c_str(), &a6) != 1) return bad("is not an IPv6 address");
    return hp;
  }
  if (hp.host.find(':') != std::string::npos) return bad("needs brackets around IPv6");
  in_addr a4;
  if (inet_pton(AF_INET, hp.host.c_str(), &a4) != 1) return bad("is not an IP address");
  return hp;
}

// httplib's ThreadPool queues every accepted connection, however many wait.
// This pool lets at most max_queued wait: enqueue (called by the accept loop)
// blocks until one is taken, so the loop accepts no more meanwhile. While
// the server stops, enqueue no longer blocks (the loop must end; each
// connection ends within the timeouts).
class BoundedTaskQueue : public httplib::TaskQueue {
 public:
  BoundedTaskQueue(size_t threads, size_t max_queued, std::shared_ptr<std::atomic<bool>> stopping)
      : max_queued_(max_queued), stopping_(std::move(stopping)) {
    for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { Serve(); });
  }
  ~BoundedTaskQueue() override = default;

  void enqueue(std::function<void()> fn) override {
    std::unique_lock<std::mutex> lock(mu_);
    // Polls `stopping` now and then: stop() does not reach this condition.
    while (jobs_.size() >= max_queued_ && !stopping_->load()) {
      room_.wait_for(lock, std::chrono::milliseconds(100));
    }
    jobs_.push_back(std::move(fn));
    work_.notify_one();
  }

  void shutdown() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      shutdown_ = true;
    }
    work_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

 private:
  void Serve() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_.wait(lock, [this] { return !jobs_.empty() || shutdown_; });
        if (jobs_.empty()) return;  // Shut down, nothing left.
        fn = std::move(jobs_.front());
        jobs_.pop_front();
      }
      room_.notify_one();
      fn();
    }
  }

  const size_t max_queued_;
  const std::shared_ptr<std::atomic<bool>> stopping_;
  std::mutex mu_;
  std::condition_variable work_;  // A job queued, or shutdown.
  std::condition_variable room_;  // A job taken.
  std::deque<std::function<void()>> jobs_;
  bool shutdown_ = false;
  std::vector<std::thread> threads_;
};

// httplib takes timeouts as seconds + microseconds.
std::pair<time_t, time_t> SecondsAndMicros(absl::Duration d) {
  const int64_t us = absl::ToInt64Microseconds(d);
  return {static_cast<time_t>(us / 1000000), static_cast<time_t>(us % 1000000)};
}

}  // namespace

HttpServer::HttpServer() = default;

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(
    const std::string& listen_address, std::map<std::string, HttpHandler> handlers,
    const HttpServerOptions& options) {
  if (options.threads < 1 || options.max_queued < 0 ||
      options.read_timeout <= absl::ZeroDuration() ||
      options.write_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "http server options: threads must be >= 1, max_queued >= 0 and timeouts > 0");
  }
  absl::StatusOr<HostPort> hp = ParseListenAddress(listen_address);
  if (!hp.ok()) return hp.status();

  std::unique_ptr<HttpServer> s(new HttpServer());
  s->handlers_ = std::move(handlers);
  s->server_ = std::make_unique<httplib::Server>();
  httplib::Server& srv = *s->server_;
  const size_t threads = static_cast<size_t>(options.threads);
  const size_t max_queued = static_cast<size_t>(options.max_queued);
  std::shared_ptr<std::atomic<bool>> stopping = s->stopping_;
  srv.new_task_queue = [threads, max_queued, stopping] {
    return new BoundedTaskQueue(threads, max_queued, stopping);
  };
  const auto [read_s, read_us] = SecondsAndMicros(options.read_timeout);
  const auto [write_s, write_us] = SecondsAndMicros(options.write_timeout);
  srv.set_read_timeout(read_s, read_us);
  srv.set_write_timeout(write_s, write_us);
  // httplib waits for a request's first byte for the keep-alive timeout,
  // which it counts in whole seconds.
  srv.set_keep_alive_timeout(static_cast<time_t>(
      absl::ToInt64Seconds(absl::Ceil(options.read_timeout, absl::Seconds(1)))));
  // One request per connection: an idle keep-alive connection (a scraper's,
  // between scrapes) would hold a serving thread for nothing.
  srv.set_keep_alive_max_count(1);

  // httplib's default options add SO_REUSEPORT, which lets a second process
  // bind the same port and take half the connections (two shards given one
  // --metrics_port would both start). SO_REUSEADDR only: a restart can bind
  // over connections in TIME_WAIT, a port in use is refused.
  srv.set_socket_options([](int sock) {
    const int one = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  });

  HttpServer* raw = s.get();
  // One route for every path, looked up exactly (httplib's patterns are
  // regular expressions).
  srv.Get(".*", [raw](const httplib::Request& req, httplib::Response& res) {
    auto it = raw->handlers_.find(req.path);
    if (it == raw->handlers_.end()) {
      res.status = 404;
      res.set_content(absl::StrCat("no handler for ", req.path, "\n"), "text/plain");
      return;
    }
    HttpResponse r = it->second();
    res.status = r.code;
    res.set_content(r.body, r.content_type);
  });
  // Called once each answer is written or given up on.
  srv.set_logger([raw](const httplib::Request&, const httplib::Response&) {
    raw->answered_.fetch_add(1);
  });

  errno = 0;
  if (hp->port == 0) {
    s->port_ = srv.bind_to_any_port(hp->host);
  } else {
    s->port_ = srv.bind_to_port(hp->host, hp->port) ? hp->port : -1;
  }
  if (s->port_ <= 0) {
    const int err = errno;
    return absl::UnavailableError(absl::StrCat("cannot listen on ", listen_address,
                                               err != 0 ? ": " : "",
                                               err != 0 ? strerror(err) : ""));
  }
  auto listen_ended = std::make_shared<std::atomic<bool>>(false);
  s->thread_ = std::thread([raw, listen_ended] {
    raw->server_->listen_after_bind();
    listen_ended->store(true);
  });
  // httplib's stop() only acts on a server that is running: wait until the
  // accept loop has started, so that the destructor can always stop it.
  while (!srv.is_running() && !listen_ended->load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (listen_ended->load()) {
    return absl::UnavailableError(absl::StrCat("cannot serve on ", listen_address));
  }
  return s;
}

HttpServer::~HttpServer() {
  stopping_->store(true);
  if (server_ != nullptr) server_->stop();
  // The accept loop ends, then its pool finishes the connections it holds.
  if (thread_.joinable()) thread_.join();
}

std::string HttpListenAddress(const std::string& host, int port) {
  const bool v6 = host.find(':') != std::string::npos && host[0] != '[';
  return absl::StrCat(v6 ? "[" : "", host, v6 ? "]" : "", ":", port);
}

absl::StatusOr<std::string> HttpGet(const std::string& host, int port, const std::string& path) {
  httplib::Client client(host, port);
  client.set_connection_timeout(5, 0);
  client.set_read_timeout(5, 0);
  client.set_write_timeout(5, 0);
  httplib::Result res = client.Get(path);
  if (!res) {
    return absl::UnavailableError(absl::StrCat("GET ", path, " from ", host, ":", port, ": ",
                                               httplib::to_string(res.error())));
  }
  if (res->status != 200) {
    return absl::InternalError(absl::StrCat("GET ", path, " from ", host, ":", port, ": HTTP ",
                                            res->status, " ", res->body));
  }
  return std::move(res->body);
}

absl::StatusOr<std::string> HttpGet(int port, const std::string& path) {
  return HttpGet("127.0.0.1", port, path);
}

}  // namespace optimus
