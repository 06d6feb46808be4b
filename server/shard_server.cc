// The shard server's wiring: what it owns, in which order it starts the
// parts (data plane, registration, heartbeats, metrics page) and stops them
// (heartbeats, metrics, chunks retired, step threads, data plane).
#include "server/shard_server.h"

#include <algorithm>
#include <functional>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cpu_count.h"
#include "common/huge_pages.h"
#include "common/logging.h"
#include "kernels/cpu/optimizer.h"
#include "server/shard.h"
#include "server/thread_priority.h"

namespace optimus {
namespace server {
namespace {
constexpr char kLog[] = "shard";

// n, or 0 for one per core this process may use (its affinity under its
// cgroup's CPU quota: a pod's CPU limit, taskset), not the machine's.
int CoresOr(int n) { return n > 0 ? n : UsableCores(); }

// Runs first on each step and kernel thread (or, for --step_nice below 0, on
// the UCX progress thread): makes it `nicer` nicer than the thread that
// started it (Linux: nice applies to one thread, and a new thread starts at
// its creator's), at most 19.
std::function<void()> StepThreadStart(int nicer) {
  if (nicer <= 0) return nullptr;
  return [nicer] {
    if (absl::Status s = LowerThisThreadPriority(nicer); !s.ok()) {
      OPTIMUS_LOG(Warning, kLog, "step thread: ", s.message());
    }
  };
}

// Idle batch receive buffers a shard keeps: one per worker sending a batch
// at the same time, for the W of most jobs (8 MiB at most).
constexpr size_t kKeptBatchBuffers = 8;

}  // namespace

std::function<void()> Shard::HoldStepThreadsForTest() {
  struct Gate {
    absl::Mutex mu;
    int in = 0;
    bool open = false;
  };
  auto gate = std::make_shared<Gate>();
  for (int i = 0; i < options_.step_threads; ++i) {
    Schedule([gate] {
      absl::MutexLock lock(&gate->mu);
      ++gate->in;
      gate->mu.Await(absl::Condition(&gate->open));
    });
  }
  {
    absl::MutexLock lock(&gate->mu);
    const int n = options_.step_threads;
    auto all_in = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(gate->mu) { return gate->in == n; };
    gate->mu.Await(absl::Condition(&all_in));
  }
  return [gate] {
    absl::MutexLock lock(&gate->mu);
    gate->open = true;
  };
}

StepExecutorHooks Shard::StepHooks() {
  StepExecutorHooks hooks;
  std::function<void()> lower = StepThreadStart(options_.step_nice);
  hooks.on_thread_start = [this, lower] {
    if (lower) lower();
    InstallStepHold();
  };
  hooks.after_task = [this] { FlushStepReplies(/*only_if_old=*/true); };
  hooks.before_wait = [this] { FlushStepReplies(/*only_if_old=*/false); };
  return hooks;
}

namespace {
ShardServerOptions Resolved(ShardServerOptions o) {
  o.step_threads = CoresOr(o.step_threads);
  o.kernel_threads = CoresOr(o.kernel_threads);
  if (o.staging_bytes == 0) o.staging_bytes = o.memory_limit_bytes / 8;
  o.staging_bytes = std::min(o.staging_bytes, o.memory_limit_bytes);
  return o;
}
}  // namespace

Shard::Shard(const ShardServerOptions& options, std::unique_ptr<CoordinatorLink> link)
    : options_(Resolved(options)),
      limits_(std::make_shared<PeerLimits>(PeerLimitOptions{options_.max_parked_pulls_per_peer,
                                                            options_.max_parked_pulls,
                                                            options_.max_inflight_bytes})),
      batch_buffers_(ReceiveBufferPool::Create(kKeptBatchBuffers, wire::kBatchBytes)),
      table_(options_.memory_limit_bytes, options_.huge_pages),
      kernel_pool_(std::make_unique<kernels::ThreadPool>(options_.kernel_threads,
                                                         StepThreadStart(options_.step_nice))),
      executor_(std::make_unique<StepExecutor>(options_.step_threads, StepHooks())),
      link_(std::move(link)) {
  if (!options.checkpoint_dir.empty()) {
    ckpt_writer_ = std::make_unique<CheckpointWriter>(options.checkpoint_max_bytes_per_second);
  }
}

Shard::~Shard() { Shutdown(); }

absl::Status Shard::Start() {
  transport::WorkerOptions wopts = options_.transport;
  // A backup that dies fails the forwards waiting for its answer at once.
  wopts.on_peer_failure = [this](transport::EndpointRef ep, const absl::Status& why) {
    FailForwardsTo(ep, why);
  };
  // Who may talk to this shard: workers of its jobs and other shards, each
  // proving it at the handshake (the secret comes with registration).
  wopts.verify_peer = [this](absl::string_view identity, absl::string_view challenge,
                             absl::string_view proof) {
    return VerifyPeer(identity, challenge, proof);
  };
  wopts.prove = [this](absl::string_view challenge) { return ProveSelf(challenge); };
  // Steps first (--step_nice below 0): the progress thread steps aside.
  if (options_.step_nice < 0) wopts.on_progress_start = StepThreadStart(-options_.step_nice);
  auto worker = transport::Worker::Create(wopts);
  if (!worker.ok()) return worker.status();
  worker_ = std::move(*worker);
  worker_->SetHandler(wire::kAmRequest, [this](transport::IncomingMessage& msg) { OnRequest(msg); });
  worker_->SetHandler(wire::kAmReply,
                      [this](transport::IncomingMessage& msg) { OnForwardReply(msg); });
  if (absl::Status s = worker_->Start(); !s.ok()) return s;
  staging_pool_ = StagingPool::Create(options_.staging_bytes, table_.memory(), MakeRegistrar(),
                                      [this](std::function<void()> fn) { Schedule(std::move(fn)); });
  staging_pool_->set_fold(options_.fold_gradients);
  staging_pool_->set_kernel_pool(kernel_pool_.get());
  OPTIMUS_LOG(Info, kLog, "memory budget ", options_.memory_limit_bytes >> 20, " MiB (",
              options_.staging_bytes >> 20, " MiB of it for gradients in flight), ",
              options_.step_threads, " step threads, ", options_.kernel_threads,
              " kernel threads; transparent huge pages: ",
              options_.huge_pages ? "asked for" : "not asked for", " (the kernel's mode: '",
              TransparentHugePageMode(), "')");
  // A coordinator that is starting (or a TLS handshake on a busy machine)
  // may not answer the first try: retry what may pass for a while before
  // giving up (then Kubernetes restarts the pod).
  {
    const absl::Time give_up = absl::Now() + absl::Seconds(30);
    absl::Duration pause = absl::Milliseconds(200);
    for (;;) {
      absl::Status s = Register();
      if (s.ok()) break;
      const bool transient = absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s);
      if (!transient || absl::Now() + pause > give_up) return s;
      OPTIMUS_LOG(Warning, kLog, "registering failed (", s.ToString(), "); retrying");
      absl::SleepFor(pause);
      pause = std::min(pause * 2, absl::Seconds(2));
    }
  }
  loader_thread_ = std::thread([this] { LoaderLoop(); });
  heartbeat_thread_ = std::thread([this] { HeartbeatLoop(); });
  if (!options_.metrics_address.empty()) {
    auto http = HttpServer::Start(
        options_.metrics_address,
        {{"/metrics",
          [this] {
            const ShardServerStats st = stats();
            ShardGauges g;
            g.shard_id = st.shard_id;
            g.memory_used_bytes = st.memory_used_bytes;
            g.memory_limit_bytes = options_.memory_limit_bytes;
            g.staging_limit_bytes = st.staging_limit_bytes;
            g.staging_in_use_bytes = st.staging_in_use_bytes;
            if (staging_pool_ != nullptr) {
              g.staging_held_bytes = staging_pool_->held();
              g.staging_waits = staging_pool_->waits();
            }
            g.chunks_owned = st.chunks_owned;
            g.batch_buffer_allocations = st.batch_buffer_allocations;
            g.unproved_refused = worker_ != nullptr ? worker_->refused_messages() : 0;
            g.parked_pulls = st.parked_pulls;
            g.peers_with_parked_pulls = st.peers_with_parked_pulls;
            g.parked_pull_refusals = st.parked_pull_refusals;
            g.inflight_bytes = st.inflight_bytes;
            g.inflight_refusals = st.inflight_refusals;
            g.transport_peers = st.transport_peers;
            g.transport_hellos_refused = st.hellos_refused;
            g.jobs = st.jobs;
            g.lease_age_seconds = absl::ToDoubleSeconds(
                absl::Now() - absl::FromUnixNanos(last_beat_unix_ns_.load()));
            return HttpResponse{200, "text/plain; version=0.0.4", RenderShardMetrics(metrics_, g)};
          }},
         // Liveness, from the shard's own state only: its heartbeat loop
         // keeps turning (whether or not the coordinator answers). A
         // coordinator outage of any length must not restart shards: their
         // memory is the jobs' optimizer state.
         {"/healthz", [this] {
            const absl::Time now = absl::Now();
            const absl::Duration loop_age = now - absl::FromUnixNanos(beat_loop_unix_ns_.load());
            // An attempt waits at most 5 s for the coordinator; the loop
            // sleeps at most a third of the lease between attempts.
            const absl::Duration stuck =
                std::max(absl::Seconds(60), 3 * absl::Milliseconds(lease_ms_.load()));
            const absl::Duration beat_age = now - absl::FromUnixNanos(last_beat_unix_ns_.load());
            const std::string coordinator =
                shard_id_.load() == 0
                    ? "not registered yet"
                    : absl::StrCat("last heartbeat answered ", absl::FormatDuration(beat_age),
                                   " ago");
            if (beat_loop_unix_ns_.load() != 0 && loop_age > stuck) {
              return HttpResponse{503, "text/plain",
                                  absl::StrCat("unhealthy: the heartbeat loop has not run for ",
                                               absl::FormatDuration(loop_age), "\n")};
            }
            return HttpResponse{200, "text/plain",
                                absl::StrCat("ok shard_id=", shard_id_.load(), " (", coordinator,
                                             ")\n")};
          }},
         // Readiness: registered, and the coordinator answered a heartbeat
         // within the lease (it can route new work here).
         {"/readyz", [this] {
            const absl::Duration age =
                absl::Now() - absl::FromUnixNanos(last_beat_unix_ns_.load());
            if (shard_id_.load() == 0 || age > absl::Milliseconds(lease_ms_.load())) {
              return HttpResponse{503, "text/plain",
                                  shard_id_.load() == 0
                                      ? std::string("not ready: not registered yet\n")
                                      : absl::StrCat("not ready: last heartbeat answered ",
                                                     absl::FormatDuration(age), " ago\n")};
            }
            return HttpResponse{200, "text/plain",
                                absl::StrCat("ready shard_id=", shard_id_.load(), "\n")};
          }}});
    if (!http.ok()) return http.status();
    http_ = std::move(*http);
  }
  return absl::OkStatus();
}

int Shard::metrics_port() const { return http_ != nullptr ? http_->port() : 0; }

ShardServerStats Shard::stats() const {
  ShardServerStats s;
  s.shard_id = shard_id_.load();
  s.steps_applied = metrics_.steps_applied.load();
  s.pushes_received = metrics_.pushes_received.load();
  s.requests_rejected = metrics_.requests_rejected.load();
  s.requests_refused_identity = metrics_.requests_refused_identity.load();
  s.unproved_refused = worker_ != nullptr ? worker_->refused_messages() : 0;
  s.pushes_duplicate = metrics_.pushes_duplicate.load();
  s.pulls_served = metrics_.pulls_served.load();
  s.checkpoint_stall_ns = metrics_.checkpoint_stall_ns.load();
  s.batches_received = metrics_.batches_received.load();
  s.reply_batches = metrics_.reply_batches.load();
  s.replies_batched = metrics_.replies_batched.load();
  s.batch_buffer_allocations = batch_buffers_->allocations();
  // Every byte still allocated, including chunks that retired but are
  // still referenced by an operation in flight.
  s.memory_used_bytes = table_.memory()->used();
  s.staging_limit_bytes = options_.staging_bytes;
  if (staging_pool_ != nullptr) {
    s.staging_in_use_bytes = staging_pool_->in_use();
    s.staging_waits = staging_pool_->waits();
  }
  for (const JobRef& job : table_.All()) {
    ++s.jobs;
    s.chunks_owned += static_cast<uint32_t>(job->num_chunks());
  }
  s.parked_pulls = limits_->parked();
  s.peers_with_parked_pulls = limits_->peers_with_parked();
  s.parked_pull_refusals = limits_->parked_refusals();
  s.inflight_bytes = limits_->inflight_bytes();
  s.inflight_refusals = limits_->inflight_refusals();
  if (worker_ != nullptr) {
    s.transport_peers = worker_->peer_count();
    s.hellos_refused = worker_->hellos_refused();
  }
  return s;
}

void Shard::Shutdown() {
  {
    absl::MutexLock lock(&stop_mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
  {
    absl::MutexLock lock(&load_mu_);
    load_stop_ = true;
  }
  if (loader_thread_.joinable()) loader_thread_.join();
  http_.reset();
  for (const JobRef& job : table_.All()) {
    for (const ChunkRef& chunk : job->Chunks()) {
      absl::MutexLock lock(&chunk->mu);
      const Phase phase = chunk->machine.phase();
      const bool idle = (phase == Phase::kCollecting && chunk->machine.parked_pulls() == 0 &&
                         chunk->machine.full_slots() == 0) ||
                        phase == Phase::kBackupReady || phase == Phase::kEmpty;
      if (idle) continue;
      OPTIMUS_LOG(Info, kLog, "in flight at shutdown: ", chunk->machine.DebugString(), "; ",
                  chunk->staging().DebugString());
    }
  }
  // Pulls parked here would otherwise wait for replies that never come:
  // send them back to the map (a drained shard's workers move on at once).
  if (worker_ != nullptr) {
    ReleaseAll(absl::FailedPreconditionError(
                   absl::StrCat("stale shard map: shard ", shard_id_.load(), " is shutting down")),
               ReplyHint{false, true});
  }
  // No step is scheduled after this; queued steps finish (their sends are
  // posted to the still-running worker).
  std::unique_ptr<StepExecutor> executor;
  {
    absl::MutexLock lock(&exec_mu_);
    executor = std::move(executor_);
  }
  executor.reset();
  // The worker's destructor joins the progress thread, so no handler or send
  // completion runs after this line. Operations it cancels complete during
  // the destruction (worker_ is already null then): closing_ makes their
  // callbacks send nothing.
  closing_.store(true);
  worker_.reset();
  {
    // Forwards never answered hold chunks: let them go.
    absl::MutexLock lock(&fwd_mu_);
    forwards_.clear();
  }
}

Registrar Shard::MakeRegistrar() {
  return [this](void* data, size_t size) { return worker_->RegisterMemory(data, size); };
}

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::Start(const ShardServerOptions& options) {
  if (options.coordinator_address.empty()) {
    return absl::InvalidArgumentError("ShardServerOptions.coordinator_address is required");
  }
  absl::StatusOr<std::unique_ptr<CoordinatorLink>> link =
      NewGrpcCoordinatorLink(options.coordinator_address, options.tls);
  if (!link.ok()) return link.status();
  return StartWithLink(options, *std::move(link));
}

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::StartWithLink(
    const ShardServerOptions& options, std::unique_ptr<CoordinatorLink> link) {
  if (link == nullptr) return absl::InvalidArgumentError("no coordinator link");
  auto shard = std::make_unique<Shard>(options, std::move(link));
  if (absl::Status s = shard->Start(); !s.ok()) return s;
  return std::unique_ptr<ShardServer>(std::move(shard));
}

}  // namespace server
}  // namespace optimus
