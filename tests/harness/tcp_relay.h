// A TCP relay on 127.0.0.1 for tests that need a slow network between two
// real endpoints: it accepts on its own port, connects to `target_port`
// for each connection, and copies bytes both ways, optionally holding each
// new connection (a slow connect and handshake) and each piece it reads (a
// slow link) for a while first.
#ifndef OPTIMUS_TESTS_HARNESS_TCP_RELAY_H_
#define OPTIMUS_TESTS_HARNESS_TCP_RELAY_H_

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace optimus {
namespace harness {

struct TcpRelayOptions {
  int target_port = 0;
  int listen_port = 0;  // 0: any free one.
  // Each accepted connection waits this long before the relay connects on
  // to the target (no byte passes meanwhile).
  absl::Duration connect_delay = absl::ZeroDuration();
  // Each piece read waits this long before it is passed on.
  absl::Duration piece_delay = absl::ZeroDuration();
};

class TcpRelay {
 public:
  static absl::StatusOr<std::unique_ptr<TcpRelay>> Start(const TcpRelayOptions& options);
  // Stops accepting, cuts every relayed connection, joins its threads.
  ~TcpRelay();
  TcpRelay(const TcpRelay&) = delete;
  TcpRelay& operator=(const TcpRelay&) = delete;

  int port() const { return port_; }
  std::string address() const;
  // Connections relayed so far (those the target accepted).
  int connections() const { return connections_.load(); }

 private:
  explicit TcpRelay(const TcpRelayOptions& options) : options_(options) {}
  void Accept();
  void Pump(int from, int to) const;

  const TcpRelayOptions options_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::atomic<int> connections_{0};
  std::thread acceptor_;
  std::mutex mu_;
  std::vector<int> fds_;             // Guarded by mu_.
  std::vector<std::thread> pumps_;   // Guarded by mu_.
};

}  // namespace harness
}  // namespace optimus

#endif  // OPTIMUS_TESTS_HARNESS_TCP_RELAY_H_
