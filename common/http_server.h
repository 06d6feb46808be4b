// A minimal HTTP/1.0 server for /metrics and /healthz: one thread accepts
// connections on a TCP socket and answers GET requests from fixed handlers,
// one request per connection. Not a general web server. A handle: Start()
// returns a running server or an error; the destructor stops it. Handlers run
// on the server's thread and must be thread-safe with respect to the caller.
#ifndef OPTIMUS_COMMON_HTTP_SERVER_H_
#define OPTIMUS_COMMON_HTTP_SERVER_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace optimus {

struct HttpResponse {
  int code = 200;
  std::string content_type = "text/plain; version=0.0.4";
  std::string body;
};

// Answers a GET for one path.
using HttpHandler = std::function<HttpResponse()>;

class HttpServer {
 public:
  // listen_address is "HOST:PORT" (port 0 picks a free one). Handlers are
  // keyed by exact path ("/metrics"); other paths get 404.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(
      const std::string& listen_address, std::map<std::string, HttpHandler> handlers);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  int port() const { return port_; }

 private:
  HttpServer() = default;
  void Loop();
  void Serve(int fd);

  std::map<std::string, HttpHandler> handlers_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd that ends the loop.
  int port_ = 0;
  std::thread thread_;
};

// Sends "GET path" to 127.0.0.1:port and returns the body of a 200 answer
// (for tests and probes). Unavailable if the server cannot be reached,
// Internal for other status codes.
absl::StatusOr<std::string> HttpGet(int port, const std::string& path);

}  // namespace optimus

#endif  // OPTIMUS_COMMON_HTTP_SERVER_H_
