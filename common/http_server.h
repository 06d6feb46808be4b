// The small HTTP server behind /metrics, /healthz and /readyz, on Debian's
// cpp-httplib (libcpp-httplib): GET requests answered from fixed handlers by
// a pool of `threads` serving threads, with read and write timeouts, on an
// IPv4 or IPv6 address. Not a general web server. A slow client holds at
// most one serving thread, and only until its timeout: a scraper that stops
// reading a large /metrics answer does not delay the probes while another
// thread is free. A handle: Start() returns a running server or an error;
// the destructor stops it. Accepted connections waiting for a thread are
// bounded (max_queued); beyond them the server stops accepting until one is
// served. Handlers run on the serving threads, possibly at
// the same time, and must be thread-safe.
#ifndef OPTIMUS_COMMON_HTTP_SERVER_H_
#define OPTIMUS_COMMON_HTTP_SERVER_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace httplib {
class Server;
}  // namespace httplib

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
  // Connections served at once, each on its own thread of the pool (>= 1).
  // Accepted connections beyond them wait in the pool's queue for a free
  // thread. Default 4.
  int threads = 4;
  // Accepted connections that may wait for a thread (>= 0). When that many
  // wait, the server accepts no more until one is taken: later clients wait
  // in the kernel's listen backlog (which the kernel bounds), so a flood of
  // connections costs the process at most threads + max_queued + 1 sockets.
  // Default 64.
  int max_queued = 64;
  // A client that sends nothing for read_timeout (before its request or in
  // the middle of it; rounded up to whole seconds before the first byte) is
  // dropped, and so is one that takes nothing of its answer for
  // write_timeout. Each applies to one wait, not to a whole request or
  // answer. Both > 0. Defaults 2 s and 10 s.
  absl::Duration read_timeout = absl::Seconds(2);
  absl::Duration write_timeout = absl::Seconds(10);
};

class HttpServer {
 public:
  // listen_address is "HOST:PORT": an IPv4 address ("0.0.0.0:9090",
  // "127.0.0.1:0"), an IPv6 address in brackets ("[::]:9090", "[::1]:0"),
  // or "*:PORT" / ":PORT" for 0.0.0.0. Port 0 picks a free one. "[::]"
  // takes IPv4 connections too where the kernel maps them (Linux's default,
  // net.ipv6.bindv6only=0). Handlers are keyed by exact path ("/metrics");
  // other paths get 404, the query string is ignored. INVALID_ARGUMENT for a
  // malformed address or bad options, UNAVAILABLE when the address cannot
  // be bound.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(
      const std::string& listen_address, std::map<std::string, HttpHandler> handlers,
      const HttpServerOptions& options = {});
  // Stops accepting and waits for the connections being served, each of
  // which ends within the timeouts.
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }
  // Requests answered (or given up on, for a client that stopped reading
  // or went away) so far.
  uint64_t requests_answered() const { return answered_.load(); }

 private:
  HttpServer();

  std::map<std::string, HttpHandler> handlers_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;  // Runs the accept loop (httplib's listen).
  // Set when the server stops: its pool's queue no longer holds the accept
  // loop back.
  std::shared_ptr<std::atomic<bool>> stopping_ = std::make_shared<std::atomic<bool>>(false);
  int port_ = 0;
  std::atomic<uint64_t> answered_{0};
};

// "HOST:PORT" for HttpServer::Start from a host flag and a port: an IPv6
// address ("::", "::1") gets its brackets.
std::string HttpListenAddress(const std::string& host, int port);

// Sends "GET path" to 127.0.0.1:port (or host:port; host is an IPv4 or IPv6
// address without brackets, or a name) and returns the body of a 200 answer
// (for tests and probes). UNAVAILABLE if the server cannot be reached or
// does not answer within 5 s, INTERNAL for other status codes.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);
absl::StatusOr<std::string> HttpGet(const std::string& host, int port, const std::string& path);

}  // namespace optimus

#endif  // OPTIMUS_COMMON_HTTP_SERVER_H_
