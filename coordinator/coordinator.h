// optimus-coord as a running server: `CoordinatorServer` is a handle that
// owns a core (`Coordinator`, coordinator_core.h), its gRPC service and
// server, the lease thread (marks silent shards DOWN, never waiting for
// the tables), the planning thread (failover, replication, checkpoint
// policies, rollback, forgetting long-DOWN shards; woken at once by the
// lease thread when a shard went DOWN) and the /metrics endpoint, and
// stops them all in Shutdown() or its destructor. This header is what other
// packages include to start a coordinator in-process; it brings the core
// and CoordinatorOptions along.
#ifndef OPTIMUS_COORDINATOR_COORDINATOR_H_
#define OPTIMUS_COORDINATOR_COORDINATOR_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/http_server.h"
#include "coordinator/coordinator_core.h"
#include "coordinator/coordinator_options.h"

namespace grpc {
class Server;
}  // namespace grpc

namespace optimus {

class CoordinatorService;

// A running coordinator: the core, its gRPC server and its two threads.
// Start() either returns a serving handle or an error; Shutdown() (or the
// destructor) ends open WatchShardMap streams, stops the server and the
// sweeper, and may be called from any thread, more than once.
class CoordinatorServer {
 public:
  // INVALID_ARGUMENT for bad options (lease, sweep_interval or
  // down_shard_grace out of range, max_rpc_threads < 4); UNAVAILABLE when
  // the address cannot
  // be bound; the core's error when its state cannot be recovered.
  static absl::StatusOr<std::unique_ptr<CoordinatorServer>> Start(const CoordinatorOptions& options);
  ~CoordinatorServer();
  CoordinatorServer(const CoordinatorServer&) = delete;
  CoordinatorServer& operator=(const CoordinatorServer&) = delete;

  // The bound port (never 0).
  int port() const { return port_; }
  // "HOST:PORT" to dial: the listen host with the bound port; a wildcard
  // host (0.0.0.0, [::], *) becomes 127.0.0.1.
  std::string address() const;
  // Borrowed; valid until this handle is destroyed.
  Coordinator* core() { return core_.get(); }
  // Map reads refused so far for being past max_concurrent_map_reads.
  // Takes no lock of the core's.
  uint64_t map_reads_refused() const;
  // Control calls being served now, and calls dropped because their
  // client had given up (the service's counters: no table needed).
  int calls_in_progress() const;
  uint64_t calls_dropped() const;
  // The /metrics and /healthz port, or 0 when they are off.
  int metrics_port() const;
  // The Prometheus text that /metrics serves.
  std::string RenderMetrics() const;

  void Shutdown();

 private:
  CoordinatorServer();
  // Every sweep_interval: the lease sweep; wakes the planning loop when a
  // shard went DOWN.
  void LeaseLoop(absl::Duration interval);
  // Every sweep_interval, or at once when the lease loop lost a shard.
  void PlanningLoop(absl::Duration interval);

  std::unique_ptr<Coordinator> core_;
  std::unique_ptr<CoordinatorService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<HttpServer> http_;
  std::string host_;
  int port_ = 0;
  absl::Mutex loops_mu_;
  bool stop_loops_ ABSL_GUARDED_BY(loops_mu_) = false;
  bool shards_went_down_ ABSL_GUARDED_BY(loops_mu_) = false;
  std::thread lease_thread_;
  std::thread planning_thread_;
  absl::Mutex shutdown_mu_;
  bool shut_down_ ABSL_GUARDED_BY(shutdown_mu_) = false;
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_COORDINATOR_H_
