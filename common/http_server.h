// A minimal HTTP/1.0 server for /metrics and /healthz: one thread accepts
// connections on a TCP socket and hands them to a few serving threads that
// answer GET requests from fixed handlers, one request per connection. Not
// a general web server. A slow client cannot hold the probes: each
// connection has a deadline for its whole request and one for its whole
// answer, several are served at once, and connections beyond what the
// threads and a short queue hold are closed at once. A handle: Start()
// returns a running server or an error; the destructor stops it. Handlers
// run on the serving threads, possibly at the same time, and must be
// thread-safe.
#ifndef OPTIMUS_COMMON_HTTP_SERVER_H_
#define OPTIMUS_COMMON_HTTP_SERVER_H_

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace optimus {

struct HttpResponse {
  int code = 200;
  std::string content_type = "text/plain; version=0.0.4";
  std::string body;
};

// Answers a GET for one path.
using HttpHandler = std::function<HttpResponse()>;

// How an HttpServer copes with slow or many clients. Defaults suit probes
// and a Prometheus scraper.
struct HttpServerOptions {
  // Connections served at once (each on its own thread). Default 4.
  int threads = 4;
  // Accepted connections waiting for a thread (>= 1); more are closed at
  // once. Default 64.
  int max_queued = 64;
  // A client must send its whole request within this, and take the whole
  // answer within write_timeout, or it is dropped. Defaults 2 s and 10 s.
  absl::Duration read_timeout = absl::Seconds(2);
  absl::Duration write_timeout = absl::Seconds(10);
};

class HttpServer {
 public:
  // listen_address is "HOST:PORT" (port 0 picks a free one). Handlers are
  // keyed by exact path ("/metrics"); other paths get 404.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(
      const std::string& listen_address, std::map<std::string, HttpHandler> handlers,
      const HttpServerOptions& options = {});
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }
  // Connections closed unserved because every thread was busy and the
  // queue full, or dropped for missing a deadline.
  uint64_t connections_shed() const { return shed_.load(); }
  uint64_t connections_timed_out() const { return timed_out_.load(); }

 private:
  HttpServer() = default;
  void Loop();
  void ServeLoop() ABSL_LOCKS_EXCLUDED(mu_);
  void Serve(int fd);
  bool HasWorkOrStop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || !queue_.empty();
  }

  HttpServerOptions options_;
  std::map<std::string, HttpHandler> handlers_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd that ends the loop.
  int port_ = 0;
  std::thread thread_;
  std::vector<std::thread> servers_;
  absl::Mutex mu_;
  std::deque<int> queue_ ABSL_GUARDED_BY(mu_);  // Accepted, not served yet.
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::atomic<uint64_t> shed_{0};
  std::atomic<uint64_t> timed_out_{0};
};

// Sends "GET path" to 127.0.0.1:port and returns the body of a 200 answer
// (for tests and probes). Unavailable if the server cannot be reached,
// Internal for other status codes.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);

}  // namespace optimus

#endif  // OPTIMUS_COMMON_HTTP_SERVER_H_
