// CoordinatorServer: starting and stopping the gRPC server, the sweeper and
// the /metrics endpoint around a Coordinator. See coordinator.h.
#include <chrono>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/grpc_limits.h"
#include "common/logging.h"
#include "coordinator/coordinator.h"
#include "coordinator/coordinator_metrics.h"
#include "coordinator/grpc_service.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/resource_quota.h"

namespace optimus {
namespace {

constexpr char kLog[] = "coord";

}  // namespace

CoordinatorServer::CoordinatorServer() = default;

absl::StatusOr<std::unique_ptr<CoordinatorServer>> CoordinatorServer::Start(
    const CoordinatorOptions& options) {
  if (options.lease <= absl::ZeroDuration() || options.sweep_interval <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("coordinator options: lease and sweep_interval must be > 0");
  }
  if (options.down_shard_grace < absl::ZeroDuration()) {
    return absl::InvalidArgumentError("coordinator options: down_shard_grace must be >= 0");
  }
  if (options.max_rpc_threads < 4) {
    return absl::InvalidArgumentError(absl::StrCat(
        "coordinator options: max_rpc_threads must be >= 4 (gRPC keeps pollers among them), "
        "not ", options.max_rpc_threads));
  }
  if (options.max_concurrent_map_reads < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "coordinator options: max_concurrent_map_reads must be >= 1, not ",
        options.max_concurrent_map_reads));
  }
  if (options.max_queued_map_reads < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "coordinator options: max_queued_map_reads must be >= 0, not ",
        options.max_queued_map_reads));
  }
  if (!(options.map_fetches_per_s >= 0) || std::isinf(options.map_fetches_per_s)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "coordinator options: map_fetches_per_s must be a finite number >= 0, not ",
        options.map_fetches_per_s));
  }
  const size_t colon = options.listen_address.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("listen address \"", options.listen_address, "\" is not HOST:PORT"));
  }
  absl::StatusOr<security::TlsMaterial> tls =
      security::LoadTls(options.tls, /*need_cert=*/true, "optimus-coord");
  if (!tls.ok()) return tls.status();
  std::unique_ptr<CoordinatorServer> s(new CoordinatorServer());
  s->host_ = options.listen_address.substr(0, colon);
  if (s->host_.empty() || s->host_ == "0.0.0.0" || s->host_ == "[::]" || s->host_ == "*") {
    s->host_ = "127.0.0.1";
  }
  s->core_ = std::make_unique<Coordinator>(options);
  if (absl::Status r = s->core_->Recover(); !r.ok()) return r;
  if (!tls->plaintext) {
    if (absl::Status k = s->core_->EnsureDataPlaneKey(); !k.ok()) return k;
  }
  // Watches hold a thread each for as long as they last: at most half of
  // the threads, so that other calls always find one.
  s->service_ = std::make_unique<CoordinatorService>(s->core_.get(), tls->plaintext,
                                                     options.max_rpc_threads / 2,
                                                     options.max_concurrent_map_reads,
                                                     options.while_reading_map,
                                                     options.max_queued_map_reads);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen_address, security::ServerCredentials(*tls), &s->port_);
  builder.RegisterService(s->service_.get());
  ApplyGrpcLimits(builder);
  // The one place the server's threads are capped: without a cap, every
  // call blocked on the tables or the disk held a thread of its own (2,719
  // threads at 4,000 shards in bench/control_plane).
  grpc::ResourceQuota quota("optimus-coord");
  quota.SetMaxThreads(options.max_rpc_threads);
  builder.SetResourceQuota(quota);
  s->server_ = builder.BuildAndStart();
  if (s->server_ == nullptr || s->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("coordinator cannot listen on ", options.listen_address));
  }
  CoordinatorServer* raw = s.get();
  const absl::Duration interval = options.sweep_interval;
  s->lease_thread_ = std::thread([raw, interval] { raw->LeaseLoop(interval); });
  s->planning_thread_ = std::thread([raw, interval] { raw->PlanningLoop(interval); });
  if (!options.metrics_address.empty()) {
    auto http = HttpServer::Start(
        options.metrics_address,
        {{"/metrics", [raw] { return HttpResponse{200, "text/plain; version=0.0.4",
                                                  raw->RenderMetrics()}; }},
         {"/healthz", [] { return HttpResponse{200, "text/plain", "ok\n"}; }},
         // Serving: its state was recovered before the HTTP server started.
         {"/readyz", [] { return HttpResponse{200, "text/plain", "ready\n"}; }}});
    if (!http.ok()) return http.status();
    s->http_ = std::move(*http);
  }
  OPTIMUS_LOG(Info, kLog, "coordinator listening on ", s->address(),
              tls->plaintext ? " (INSECURE plain text)" : absl::StrCat(" (TLS from ", tls->dir, ")"),
              " lease=", absl::FormatDuration(options.lease),
              " max_rpc_threads=", options.max_rpc_threads,
              " max_concurrent_map_reads=", options.max_concurrent_map_reads,
              " max_queued_map_reads=", options.max_queued_map_reads,
              " map_fetches_per_s=", options.map_fetches_per_s,
              " down_shard_grace=", absl::FormatDuration(options.down_shard_grace));
  return s;
}

void CoordinatorServer::LeaseLoop(absl::Duration interval) {
  while (true) {
    {
      absl::MutexLock lock(&loops_mu_);
      if (loops_mu_.AwaitWithTimeout(absl::Condition(&stop_loops_), interval)) return;
    }
    // The lease table's lock alone: a placement holding the tables for
    // seconds does not delay this.
    if (core_->SweepLeases(core_->Now()) > 0) {
      absl::MutexLock lock(&loops_mu_);
      shards_went_down_ = true;
    }
  }
}

void CoordinatorServer::PlanningLoop(absl::Duration interval) {
  auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(loops_mu_) {
    return stop_loops_ || shards_went_down_;
  };
  while (true) {
    {
      absl::MutexLock lock(&loops_mu_);
      loops_mu_.AwaitWithTimeout(absl::Condition(&woken), interval);
      if (stop_loops_) return;
      shards_went_down_ = false;
    }
    // Failover first: it waits for the tables only to move chunks, the
    // shards are DOWN already.
    core_->SweepExpiredLeases(core_->Now());
    core_->TickReplication(core_->Now());
    core_->TickCheckpoints(absl::Now());
    core_->RollbackFailedJobs();
    core_->ForgetLongDownShards(core_->Now());
  }
}

uint64_t CoordinatorServer::map_reads_refused() const { return service_->map_reads_refused(); }

int CoordinatorServer::calls_in_progress() const { return service_->calls_in_progress(); }

uint64_t CoordinatorServer::calls_dropped() const { return service_->dropped(); }

int CoordinatorServer::metrics_port() const { return http_ != nullptr ? http_->port() : 0; }

std::string CoordinatorServer::RenderMetrics() const {
  v1::StatusResponse st = core_->Status();
  core_->FillLastCheckpoints(&st);
  const std::vector<uint64_t> errors = service_->errors();
  const Coordinator::Counters counters = core_->counters();
  CoordinatorMetricsInput in;
  in.status = &st;
  in.errors_by_code = errors;
  in.jobs_deleted = counters.jobs_deleted;
  in.shards_forgotten = counters.shards_forgotten;
  in.calls_dropped = service_->dropped();
  in.calls_in_progress = service_->calls_in_progress();
  in.map_reads_refused = service_->map_reads_refused();
  in.heartbeats_deferred = counters.heartbeats_deferred;
  in.map_parts_serialized = counters.map_parts_serialized;
  in.map_parts_reused = counters.map_parts_reused;
  in.map_fetches_delayed = counters.map_fetches_delayed;
  using Why = Coordinator::JobRefusal;
  in.jobs_refused_quota = counters.jobs_refused[static_cast<int>(Why::kQuota)];
  in.jobs_refused_map_size = counters.jobs_refused[static_cast<int>(Why::kMapSize)];
  in.jobs_refused_capacity = counters.jobs_refused[static_cast<int>(Why::kCapacity)];
  return RenderCoordinatorMetrics(in);
}

std::string CoordinatorServer::address() const { return absl::StrCat(host_, ":", port_); }

void CoordinatorServer::Shutdown() {
  {
    absl::MutexLock lock(&shutdown_mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  http_.reset();
  core_->BeginShutdown();  // Ends WatchShardMap streams.
  // Gives in-flight unary calls a moment, then cancels what is left.
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  server_->Wait();
  {
    absl::MutexLock lock(&loops_mu_);
    stop_loops_ = true;
  }
  if (lease_thread_.joinable()) lease_thread_.join();
  if (planning_thread_.joinable()) planning_thread_.join();
  OPTIMUS_LOG(Info, kLog, "coordinator stopped");
}

CoordinatorServer::~CoordinatorServer() {
  if (server_ != nullptr) Shutdown();
}

}  // namespace optimus
