#include "server/shard_server.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/dtype.h"
#include "common/grpc_status.h"
#include "common/http_server.h"
#include "common/metrics.h"
#include "common/logging.h"
#include "common/wire.h"
#include "grpcpp/grpcpp.h"
#include "kernels/cpu/optimizer.h"
#include "kernels/cpu/passes.h"
#include "kernels/cpu/thread_pool.h"
#include "proto/optimus.grpc.pb.h"
#include "common/checkpoint_files.h"
#include "server/checkpoint_writer.h"
#include "server/step_executor.h"

namespace optimus {
namespace server {
namespace {

constexpr char kLog[] = "shard";
// Cache-line alignment so the SIMD kernels load whole lines.
constexpr size_t kAlignBytes = 64;

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
using AlignedBytes = std::unique_ptr<uint8_t[], FreeDeleter>;

AlignedBytes AllocZeroed(size_t size_bytes) {
  size_t rounded = (size_bytes + kAlignBytes - 1) / kAlignBytes * kAlignBytes;
  if (rounded == 0) rounded = kAlignBytes;
  auto* p = static_cast<uint8_t*>(std::aligned_alloc(kAlignBytes, rounded));
  if (p != nullptr) std::memset(p, 0, rounded);
  return AlignedBytes(p);
}

// What the job needs to know, taken from the coordinator's JobSpec once.
struct JobConfig {
  uint64_t job_id = 0;
  uint64_t map_epoch = 0;  // Guarded by jobs_mu_ once the job is loaded.
  uint32_t replication = 0;
  uint32_t world_size = 0;
  DType grad_dtype = DType::kFp32;
  DType param_dtype = DType::kBf16;
  float grad_scale = 1.0f;
  kernels::OptimizerHyper hyper;
};

enum class SlotState : uint8_t { kEmpty = 0, kReceiving = 1, kFull = 2 };

// What this shard is for a chunk under the loaded map.
enum class Role : uint8_t {
  kPrimary = 0,  // Takes pushes and pulls; forwards each step to the backup.
  kBackup = 1,   // Applies the primary's forwarded steps; promoted on failover.
  kRetired = 2,  // No longer on this shard (moved, or fenced): refuses everything.
};

// A primary's forward of the step being published to the chunk's backup.
enum class Forward : uint8_t {
  kNone = 0,        // No backup, or the forward was acknowledged.
  kInFlight = 1,    // Sent; waiting for the backup's answer.
  kNeedsSeed = 2,   // Send the state (after the kernel) instead of the sum.
  kRetryLater = 3,  // The backup has not loaded our map yet; a timer resends.
  kWaitMap = 4,     // The backup is unreachable: wait for a map that replaces it.
};

// A pull waiting for a version that is not published yet.
struct ParkedPull {
  transport::EndpointRef reply_ep;
  uint64_t request_id = 0;
  uint64_t version = 0;
};

// One chunk's state on this shard. The buffers never move after creation.
// Version v is published in published[v % 2]; steps run one at a time.
struct Chunk {
  uint32_t tensor = 0;
  uint32_t chunk = 0;
  uint64_t num_elems = 0;
  uint64_t offset_elems = 0;      // Of the chunk's first element in its tensor.
  AlignedBytes master, m, v;      // fp32.
  AlignedBytes slots;             // world_size slots of grad dtype, rank order.
  AlignedBytes published[2];      // param dtype.
  std::vector<std::unique_ptr<transport::MemoryRegion>> regions;
  std::vector<const void*> grad_ptrs;  // Into `slots`, rank order; fixed at load.

  absl::Mutex mu;
  uint64_t published_version ABSL_GUARDED_BY(mu) = 0;  // 0: not initialized.
  bool init_receiving ABSL_GUARDED_BY(mu) = false;
  std::vector<SlotState> slot_state ABSL_GUARDED_BY(mu);
  uint32_t full_slots ABSL_GUARDED_BY(mu) = 0;
  bool step_running ABSL_GUARDED_BY(mu) = false;
  // Pull replies still being sent out of published[i]; a step may not
  // overwrite a buffer while its count is non-zero.
  int sends_inflight[2] ABSL_GUARDED_BY(mu) = {0, 0};
  bool step_blocked_on_sends ABSL_GUARDED_BY(mu) = false;
  // A checkpoint copy of master/m/v is being taken right after a publish
  // (off the workers' path); the next step waits for it.
  bool snapshot_copying ABSL_GUARDED_BY(mu) = false;
  bool step_blocked_on_snapshot ABSL_GUARDED_BY(mu) = false;
  absl::Time blocked_since ABSL_GUARDED_BY(mu);
  std::vector<ParkedPull> parked ABSL_GUARDED_BY(mu);
  // Oldest version ever held: 1, or the step a restored chunk starts at.
  uint64_t first_version ABSL_GUARDED_BY(mu) = 1;
  // True while a step's kernel may be writing master/m/v.
  bool in_kernel ABSL_GUARDED_BY(mu) = false;
  // A checkpoint waiting for this chunk to reach version capture_step
  // (0: none); the snapshot is taken the moment that version is published.
  uint64_t capture_step ABSL_GUARDED_BY(mu) = 0;
  uint64_t capture_checkpoint ABSL_GUARDED_BY(mu) = 0;

  // ---- Replication (jobs with replication 1) ----
  Role role ABSL_GUARDED_BY(mu) = Role::kPrimary;
  uint64_t primary_shard ABSL_GUARDED_BY(mu) = 0;
  uint64_t backup_shard ABSL_GUARDED_BY(mu) = 0;  // 0: none.
  transport::EndpointRef backup_ep ABSL_GUARDED_BY(mu);
  // Bumped whenever the backup changes; a forward's answer for an older
  // generation is ignored.
  uint64_t backup_gen ABSL_GUARDED_BY(mu) = 0;
  // Primary: the backup holds our state (acknowledged a seed, or both loaded
  // the same checkpoint), so forwarding the sum is enough.
  bool backup_seeded ABSL_GUARDED_BY(mu) = false;
  // Backup: holds the primary's state at published_version.
  bool seeded ABSL_GUARDED_BY(mu) = false;
  // The fp32 summed, scaled gradient of the step being applied: what the
  // primary forwards and both sides step with. Allocated with the chunk in
  // replicated jobs, or when a map first gives the chunk a backup (a drain
  // of an unreplicated job); never freed or moved after that.
  AlignedBytes sum ABSL_GUARDED_BY(mu);
  // Primary: step whose publication waits for the kernel and the forward
  // (0: none), and where those stand.
  uint64_t pub_step ABSL_GUARDED_BY(mu) = 0;
  bool pub_kernel_done ABSL_GUARDED_BY(mu) = false;
  Forward forward ABSL_GUARDED_BY(mu) = Forward::kNone;
};

// Jobs and their chunks are never removed while the server runs (job deletion
// comes later), so handlers may keep raw pointers to them.
struct Job {
  JobConfig config;
  uint32_t num_arrays = 1;  // Checkpointed per chunk: master and the moments.
  uint64_t memory_bytes = 0;    // Guarded by jobs_mu_ once loaded.
  bool has_v = false;
  // Keyed by (tensor << 32 | chunk). Guarded by jobs_mu_ once loaded; entries
  // are added when a new map places a chunk here and never removed (a chunk
  // that leaves is retired), so Chunk pointers stay valid.
  absl::flat_hash_map<uint64_t, std::unique_ptr<Chunk>> chunks;
};

// A forward waiting for the backup's answer.
struct PendingForward {
  Job* job = nullptr;
  Chunk* chunk = nullptr;
  uint64_t gen = 0;
  bool seed = false;
  transport::EndpointRef ep;
  std::shared_ptr<std::vector<float>> staging;  // A seed's payload.
};

uint64_t ChunkKey(uint32_t tensor, uint32_t chunk) {
  return (static_cast<uint64_t>(tensor) << 32) | chunk;
}

absl::StatusOr<kernels::OptimizerKind> KindFromProto(v1::OptimizerKind k) {
  switch (k) {
    case v1::OPTIMIZER_ADAMW: return kernels::OptimizerKind::kAdamW;
    case v1::OPTIMIZER_ADAM: return kernels::OptimizerKind::kAdam;
    case v1::OPTIMIZER_SGD: return kernels::OptimizerKind::kSgd;
    case v1::OPTIMIZER_LION: return kernels::OptimizerKind::kLion;
    default: return absl::InvalidArgumentError(absl::StrCat("unknown optimizer kind ", k));
  }
}

class ShardServerImpl : public ShardServer {
 public:
  explicit ShardServerImpl(const ShardServerOptions& options)
      : options_(options),
        kernel_pool_(std::make_unique<kernels::ThreadPool>(options.kernel_threads)),
        executor_(std::make_unique<StepExecutor>(options.step_threads)) {
    if (!options.checkpoint_dir.empty()) {
      ckpt_writer_ = std::make_unique<CheckpointWriter>(options.checkpoint_max_bytes_per_second);
    }
  }

  ~ShardServerImpl() override { Shutdown(); }

  absl::Status Init() {
    transport::WorkerOptions wopts = options_.transport;
    // A backup that dies fails the forwards waiting for its answer at once.
    wopts.on_peer_failure = [this](transport::EndpointRef ep, const absl::Status& why) {
      FailForwardsTo(ep, why);
    };
    auto worker = transport::Worker::Create(wopts);
    if (!worker.ok()) return worker.status();
    worker_ = std::move(*worker);
    worker_->SetHandler(wire::kAmRequest,
                        [this](transport::IncomingMessage& msg) { OnRequest(msg); });
    worker_->SetHandler(wire::kAmReply,
                        [this](transport::IncomingMessage& msg) { OnForwardReply(msg); });
    if (auto s = worker_->Start(); !s.ok()) return s;

    // Reconnect quickly after a coordinator restart: gRPC's default backoff
    // grows to minutes, and the restarted coordinator expects a heartbeat
    // within two leases.
    grpc::ChannelArguments channel_args;
    channel_args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    channel_args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
    channel_args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
    channel_ = grpc::CreateCustomChannel(options_.coordinator_address,
                                         grpc::InsecureChannelCredentials(), channel_args);
    stub_ = v1::Coordinator::NewStub(channel_);
    if (auto s = Register(); !s.ok()) return s;
    heartbeat_thread_ = std::thread([this] { HeartbeatLoop(); });
    if (!options_.metrics_address.empty()) {
      auto http = HttpServer::Start(
          options_.metrics_address,
          {{"/metrics", [this] { return HttpResponse{200, "text/plain; version=0.0.4",
                                                     RenderMetrics()}; }},
           {"/healthz", [this] { return Health(); }}});
      if (!http.ok()) return http.status();
      http_ = std::move(*http);
    }
    return absl::OkStatus();
  }

  int metrics_port() const override { return http_ != nullptr ? http_->port() : 0; }

  // Healthy while registered and the last heartbeat is younger than the lease.
  HttpResponse Health() const {
    const absl::Duration age = absl::Now() - absl::FromUnixNanos(last_beat_unix_ns_.load());
    if (shard_id_.load() == 0 || age > absl::Milliseconds(lease_ms_.load())) {
      return {503, "text/plain",
              absl::StrCat("unhealthy: last heartbeat ", absl::FormatDuration(age), " ago\n")};
    }
    return {200, "text/plain", absl::StrCat("ok shard_id=", shard_id_.load(), "\n")};
  }

  std::string RenderMetrics() const {
    const ShardServerStats st = stats();
    MetricsText m;
    const MetricLabels id = {{"shard_id", absl::StrCat(st.shard_id)}};
    step_latency_.Render(&m, "optimus_shard_step_seconds",
                         "Latency of one fused optimizer step over one chunk.");
    m.Counter("optimus_shard_steps_total", "Chunk steps applied.", st.steps_applied, id);
    m.Counter("optimus_shard_optimizer_params_total",
              "Parameters updated by the optimizer (rate = optimizer throughput).",
              params_stepped_.load(), id);
    m.Counter("optimus_shard_pushed_bytes_total", "Gradient bytes received from workers.",
              pushed_bytes_.load(), id);
    m.Counter("optimus_shard_pulled_bytes_total", "Parameter bytes sent to workers.",
              pulled_bytes_.load(), id);
    m.Counter("optimus_shard_duplicate_pushes_total", "Repeated pushes acknowledged and dropped.",
              st.pushes_duplicate, id);
    m.Counter("optimus_shard_checkpoint_stall_seconds_total",
              "Time steps and requests waited for checkpoint copies of their chunk.",
              static_cast<double>(checkpoint_stall_ns_.load()) / 1e9, id);
    m.Counter("optimus_shard_forwards_total",
              "Steps and seeds sent to backups (replication).", forwards_sent_.load(), id);
    m.Counter("optimus_shard_backup_steps_total",
              "Forwarded steps this shard applied as a backup.",
              forwarded_steps_applied_.load(), id);
    m.Counter("optimus_shard_backup_seeds_total",
              "Chunk states this shard received as a new backup.", seeds_received_.load(), id);
    m.Gauge("optimus_shard_memory_used_bytes", "Bytes of job state allocated.",
            st.memory_used_bytes, id);
    m.Gauge("optimus_shard_memory_limit_bytes", "State budget of this shard.",
            options_.memory_limit_bytes, id);
    m.Gauge("optimus_shard_chunks_owned", "Chunks held for all jobs.", st.chunks_owned, id);
    m.Gauge("optimus_shard_lease_age_seconds", "Time since the last accepted heartbeat.",
            absl::ToDoubleSeconds(absl::Now() - absl::FromUnixNanos(last_beat_unix_ns_.load())),
            id);
    for (int c = 1; c < kNumCodes; ++c) {
      m.Counter("optimus_shard_errors_total", "Requests refused, by error kind.",
                errors_[c].load(),
                {{"shard_id", absl::StrCat(st.shard_id)},
                 {"kind", absl::StatusCodeToString(static_cast<absl::StatusCode>(c))}});
    }
    return m.text();
  }

  uint64_t shard_id() const override { return shard_id_.load(); }

  ShardServerStats stats() const override {
    ShardServerStats s;
    s.shard_id = shard_id_.load();
    s.steps_applied = steps_applied_.load();
    s.pushes_received = pushes_received_.load();
    s.requests_rejected = requests_rejected_.load();
    s.pushes_duplicate = pushes_duplicate_.load();
    s.pulls_served = pulls_served_.load();
    s.checkpoint_stall_ns = checkpoint_stall_ns_.load();
    absl::MutexLock lock(&jobs_mu_);
    for (const auto& [id, job] : jobs_) {
      s.memory_used_bytes += job->memory_bytes;
      s.chunks_owned += static_cast<uint32_t>(job->chunks.size());
    }
    return s;
  }

  void Shutdown() override {
    {
      absl::MutexLock lock(&stop_mu_);
      if (stopped_) return;
      stopped_ = true;
    }
    if (heartbeat_thread_.joinable()) heartbeat_thread_.join();
    http_.reset();
    DumpChunkStates();
    // Pulls parked here would otherwise wait for replies that never come:
    // send them back to the map (a drained shard's workers move on at once).
    RetireAll(absl::StrCat("shard ", shard_id_.load(), " is shutting down"));
    // No step is scheduled after this; queued steps finish (their sends are
    // posted to the still-running worker).
    std::unique_ptr<StepExecutor> executor;
    {
      absl::MutexLock lock(&exec_mu_);
      executor = std::move(executor_);
    }
    executor.reset();
    // The worker's destructor joins the progress thread, so no handler or
    // send completion runs after this line. Operations it cancels complete
    // during the destruction (worker_ is already null then): closing_ makes
    // their callbacks send nothing.
    closing_.store(true);
    worker_.reset();
  }

 private:
  // ---- Control plane -------------------------------------------------------

  absl::Status Register() {
    v1::RegisterShardRequest req;
    auto* caps = req.mutable_capabilities();
    caps->set_kind(options_.is_dpu ? v1::SHARD_KIND_DPU : v1::SHARD_KIND_HOST);
#if defined(__aarch64__)
    caps->set_arch("aarch64");
#elif defined(__x86_64__)
    caps->set_arch("x86_64");
#else
    caps->set_arch("unknown");
#endif
    caps->set_cores(std::max(1u, std::thread::hardware_concurrency()));
    caps->set_memory_limit_bytes(options_.memory_limit_bytes);
    caps->set_data_address(worker_->address());
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    caps->set_hostname(host);
    caps->set_checkpoints(!options_.checkpoint_dir.empty());
    v1::RegisterShardResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    auto s = FromGrpc(stub_->RegisterShard(&ctx, req, &resp));
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("registering with coordinator at ",
                                                 options_.coordinator_address, ": ",
                                                 s.message()));
    }
    shard_id_.store(resp.shard_id());
    lease_ms_.store(resp.lease_ms());
    last_beat_unix_ns_.store(absl::ToUnixNanos(absl::Now()));
    OPTIMUS_LOG(Info, kLog, "registered shard_id=", resp.shard_id(),
                " kind=", options_.is_dpu ? "dpu" : "host", " lease_ms=", resp.lease_ms(),
                " isa=", kernels::ActiveIsa());
    return absl::OkStatus();
  }

  absl::Duration HeartbeatInterval() const {
    if (options_.heartbeat_interval > absl::ZeroDuration()) return options_.heartbeat_interval;
    return std::max(absl::Milliseconds(lease_ms_.load()) / 3, absl::Milliseconds(50));
  }

  void HeartbeatLoop() {
    for (;;) {
      {
        absl::MutexLock lock(&stop_mu_);
        stop_mu_.AwaitWithTimeout(absl::Condition(this, &ShardServerImpl::StopOrBeat),
                                  HeartbeatInterval());
        if (stopped_) return;
        beat_now_ = false;
      }
      absl::Status s = HeartbeatOnce();
      if (!s.ok()) {
        OPTIMUS_LOG(Warning, kLog, "heartbeat failed: ", s.ToString());
      }
    }
  }

  bool StopOrBeat() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(stop_mu_) { return stopped_ || beat_now_; }

  // Asks the heartbeat thread to beat (and so load a newer map) now. Safe
  // from the progress thread.
  void BeatNow() {
    absl::MutexLock lock(&stop_mu_);
    beat_now_ = true;
  }

  absl::Status HeartbeatOnce() {
    v1::HeartbeatRequest req;
    req.set_shard_id(shard_id_.load());
    {
      absl::MutexLock lock(&jobs_mu_);
      uint64_t used = 0;
      uint32_t held = 0;  // Chunks held as primary or backup (not retired).
      for (const auto& [id, job] : jobs_) {
        used += job->memory_bytes;
        auto* p = req.add_jobs();
        p->set_job_id(id);
        p->set_map_epoch(job->config.map_epoch);
        uint64_t min_applied = UINT64_MAX, max_applied = 0;
        uint32_t primaries = 0, backups = 0, seeded = 0, replicated = 0;
        for (const auto& [key, chunk] : job->chunks) {
          absl::MutexLock clock(&chunk->mu);
          if (chunk->role == Role::kBackup) {
            ++backups;
            if (chunk->seeded) ++seeded;
            continue;
          }
          if (chunk->role != Role::kPrimary) continue;
          ++primaries;
          if (chunk->backup_shard != 0 && chunk->backup_seeded) ++replicated;
          const uint64_t applied =
              chunk->published_version > 0 ? chunk->published_version - 1 : 0;
          min_applied = std::min(min_applied, applied);
          max_applied = std::max(max_applied, applied);
        }
        p->set_chunks_loaded(primaries + backups);
        held += primaries + backups;
        p->set_primary_chunks(primaries);
        p->set_backup_chunks(backups);
        p->set_backups_seeded(seeded);
        p->set_primaries_replicated(replicated);
        p->set_applied_step(min_applied == UINT64_MAX ? 0 : min_applied);
        p->set_max_applied_step(max_applied);
      }
      req.set_memory_used_bytes(used);
      req.set_chunks_owned(held);
    }
    if (ckpt_writer_ != nullptr) {
      for (auto& r : ckpt_writer_->Reports()) *req.add_checkpoints() = std::move(r);
    }
    v1::HeartbeatResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    auto s = FromGrpc(stub_->Heartbeat(&ctx, req, &resp));
    if (!s.ok()) return s;
    last_beat_unix_ns_.store(absl::ToUnixNanos(absl::Now()));
    if (!resp.known()) {
      // Declared dead (the lease expired, e.g. a partition): the jobs moved
      // on without this shard, so its state is stale. Retire every chunk so
      // no worker or former primary keeps using it, then join afresh.
      OPTIMUS_LOG(Warning, kLog, "coordinator no longer knows shard_id=", shard_id_.load(),
                  "; retiring its chunks and registering again");
      RetireAll(absl::StrCat("shard ", shard_id_.load(), " was declared down"));
      return Register();
    }
    for (const auto& a : resp.assignments()) {
      bool loaded;
      {
        absl::MutexLock lock(&jobs_mu_);
        auto it = jobs_.find(a.job_id());
        loaded = it != jobs_.end() && it->second->config.map_epoch >= a.map_epoch();
      }
      if (loaded) continue;
      if (auto ls = LoadJob(a.job_id()); !ls.ok()) {
        OPTIMUS_LOG(Error, kLog, "loading job ", a.job_id(), ": ", ls.ToString());
      }
    }
    std::set<std::pair<uint64_t, uint64_t>> ordered;
    for (const v1::CheckpointOrder& o : resp.checkpoints()) {
      ordered.insert({o.job_id(), o.checkpoint_id()});
      StartCheckpoint(o);
    }
    if (ckpt_writer_ != nullptr) ckpt_writer_->Retain(ordered);
    return absl::OkStatus();
  }

  // ---- Checkpoints ---------------------------------------------------------

  // Copies a chunk's master and moments for the writer. The caller holds
  // chunk->mu with no kernel running on the chunk, so the copy is exactly
  // version published_version.
  // The caller holds chunk.mu, or has set snapshot_copying (no kernel can
  // start on the chunk until it clears it).
  static ChunkSnapshot Snapshot(const Job& job, const Chunk& chunk, uint64_t checkpoint_id)
      ABSL_NO_THREAD_SAFETY_ANALYSIS {
    ChunkSnapshot snap;
    snap.job_id = job.config.job_id;
    snap.checkpoint_id = checkpoint_id;
    snap.tensor = chunk.tensor;
    snap.offset_elems = chunk.offset_elems;
    snap.num_elems = chunk.num_elems;
    snap.num_arrays = job.num_arrays;
    snap.data.resize(job.num_arrays * chunk.num_elems);
    const uint8_t* arrays[] = {chunk.master.get(), chunk.m.get(), chunk.v.get()};
    for (uint32_t a = 0; a < job.num_arrays; ++a) {
      std::memcpy(snap.data.data() + a * chunk.num_elems, arrays[a], chunk.num_elems * 4);
    }
    return snap;
  }

  // Begins this shard's part of a checkpoint order (once per order): chunks
  // already at the step are copied now, the others when they reach it.
  void StartCheckpoint(const v1::CheckpointOrder& o) {
    if (ckpt_writer_ == nullptr || ckpt_writer_->Known(o.job_id(), o.checkpoint_id())) return;
    Job* job = nullptr;
    // Only primaries write: a backup holds the same bytes.
    std::vector<Chunk*> primaries;
    {
      absl::MutexLock lock(&jobs_mu_);
      auto it = jobs_.find(o.job_id());
      if (it != jobs_.end()) {
        job = it->second.get();
        for (const auto& [key, chunk] : job->chunks) {
          absl::MutexLock clock(&chunk->mu);
          if (chunk->role == Role::kPrimary) primaries.push_back(chunk.get());
        }
      }
    }
    const std::string dir = absl::StrCat(options_.checkpoint_dir, "/", o.path());
    ckpt_writer_->Begin(o.job_id(), o.checkpoint_id(), dir,
                        static_cast<uint32_t>(primaries.size()));
    if (job == nullptr) {
      return ckpt_writer_->Fail(o.job_id(), o.checkpoint_id(),
                                absl::StrCat("shard ", shard_id_.load(), " has not loaded job ",
                                             o.job_id()));
    }
    if (absl::Status s = ckpt::MakeDirs(dir); !s.ok()) {
      return ckpt_writer_->Fail(o.job_id(), o.checkpoint_id(), std::string(s.message()));
    }
    std::vector<Chunk*> copy_now;
    std::vector<Chunk*> capture_later;
    std::string error;
    bool missed = false;
    for (Chunk* chunk : primaries) {
      absl::MutexLock lock(&chunk->mu);
      const uint64_t pv = chunk->published_version;
      if (pv == 0) {
        error = absl::StrCat("tensor ", chunk->tensor, " chunk ", chunk->chunk,
                             " has no initial values yet");
        break;
      }
      if (pv > o.step() || (pv == o.step() && (chunk->in_kernel || chunk->snapshot_copying))) {
        error = absl::StrCat("tensor ", chunk->tensor, " chunk ", chunk->chunk,
                             " already applied step ", o.step());
        missed = true;
        break;
      }
      if (pv == o.step()) {
        // Idle at the step: copy it below, without holding the chunk (pushes
        // and pulls go on; only its next step waits for the copy).
        chunk->snapshot_copying = true;
        copy_now.push_back(chunk);
      } else {
        chunk->capture_step = o.step();
        chunk->capture_checkpoint = o.checkpoint_id();
        capture_later.push_back(chunk);
      }
    }
    if (!error.empty()) {
      // Undo this order on every chunk it touched, then report.
      for (Chunk* chunk : capture_later) {
        absl::MutexLock lock(&chunk->mu);
        if (chunk->capture_checkpoint == o.checkpoint_id()) chunk->capture_step = 0;
      }
      for (Chunk* chunk : copy_now) FinishSnapshot(job, chunk, /*checkpoint_id=*/0);
      return ckpt_writer_->Fail(o.job_id(), o.checkpoint_id(), error, missed);
    }
    for (Chunk* chunk : copy_now) FinishSnapshot(job, chunk, o.checkpoint_id());
  }

  // Copies a chunk whose snapshot_copying the caller set, then lets its next
  // step run (counting how long that step waited).
  // checkpoint_id 0: no copy (the order failed), just release the chunk.
  void FinishSnapshot(Job* job, Chunk* chunk, uint64_t checkpoint_id) {
    if (checkpoint_id != 0) ckpt_writer_->Add(Snapshot(*job, *chunk, checkpoint_id));
    bool start_step = false;
    {
      absl::MutexLock lock(&chunk->mu);
      chunk->snapshot_copying = false;
      start_step = chunk->step_blocked_on_snapshot;
      chunk->step_blocked_on_snapshot = false;
      if (start_step) {
        checkpoint_stall_ns_.fetch_add(
            absl::ToInt64Nanoseconds(absl::Now() - chunk->blocked_since));
      }
    }
    if (start_step) MaybeScheduleStep(job, chunk);
  }

  // Fetches the job and allocates the chunks the map places on this shard
  // (as primary or backup); for a job already loaded, applies its newer map.
  absl::Status LoadJob(uint64_t job_id) {
    v1::GetJobRequest req;
    req.set_job_id(job_id);
    v1::GetJobResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    if (auto s = FromGrpc(stub_->GetJob(&ctx, req, &resp)); !s.ok()) return s;
    {
      Job* existing = nullptr;
      {
        absl::MutexLock lock(&jobs_mu_);
        auto it = jobs_.find(job_id);
        if (it != jobs_.end()) existing = it->second.get();
      }
      if (existing != nullptr) {
        if (auto s = ApplyMap(existing, resp); !s.ok()) return s;
        return HeartbeatOnce();
      }
    }
    const v1::JobSpec& spec = resp.spec();

    auto job = std::make_unique<Job>();
    JobConfig& c = job->config;
    c.job_id = job_id;
    c.map_epoch = resp.map().epoch();
    c.world_size = spec.world_size();
    c.replication = spec.replication();
    auto gd = DTypeFromInt(spec.grad_dtype());
    auto pd = DTypeFromInt(spec.param_dtype());
    auto kind = KindFromProto(spec.optimizer().kind());
    if (!gd.ok()) return gd.status();
    if (!pd.ok()) return pd.status();
    if (!kind.ok()) return kind.status();
    if (c.world_size == 0) return absl::InvalidArgumentError("job has world_size 0");
    if (c.replication > 1) {
      return absl::InvalidArgumentError(absl::StrCat("job has replication ", c.replication,
                                                     "; this shard supports 0 or 1"));
    }
    c.grad_dtype = *gd;
    c.param_dtype = *pd;
    const auto& o = spec.optimizer();
    c.hyper.kind = *kind;
    c.hyper.lr = o.lr();
    c.hyper.beta1 = o.beta1();
    c.hyper.beta2 = o.beta2();
    c.hyper.eps = o.eps();
    c.hyper.weight_decay = o.weight_decay();
    c.hyper.momentum = o.momentum();
    c.grad_scale = o.grad_scale() > 0 ? o.grad_scale() : 1.0f / static_cast<float>(c.world_size);
    job->has_v = c.hyper.kind != kernels::OptimizerKind::kSgd &&
                 c.hyper.kind != kernels::OptimizerKind::kLion;
    job->num_arrays = job->has_v ? 3 : 2;

    const uint64_t me = shard_id_.load();
    const std::map<uint64_t, transport::EndpointRef> backups = ConnectBackups(resp.map(), me);
    for (const auto& p : resp.map().chunks()) {
      if (p.shard_id() != me && p.backup_shard_id() != me) continue;
      auto ch = AllocateChunk(*job, p);
      if (!ch.ok()) return ch.status();
      job->memory_bytes += ChunkBytes(*job, **ch);
      const bool restored = resp.has_restore();
      if (restored) {
        if (auto rs = RestoreChunk(resp, job.get(), ch->get()); !rs.ok()) return rs;
      }
      {
        Chunk* chunk = ch->get();
        absl::MutexLock lock(&chunk->mu);
        SetPlacement(chunk, p, me, backups);
        // Primary and backup loaded the same checkpoint: already in sync.
        chunk->seeded = restored;
        chunk->backup_seeded = restored && chunk->backup_shard != 0;
      }
      job->chunks[ChunkKey(p.tensor(), p.chunk())] = std::move(*ch);
    }
    {
      absl::MutexLock lock(&jobs_mu_);
      uint64_t used = 0;
      for (const auto& [id, j] : jobs_) {
        if (id != job_id) used += j->memory_bytes;
      }
      if (used + job->memory_bytes > options_.memory_limit_bytes) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "job ", job_id, " needs ", job->memory_bytes, " bytes on this shard; ",
            options_.memory_limit_bytes - std::min(used, options_.memory_limit_bytes),
            " of ", options_.memory_limit_bytes, " free"));
      }
      if (jobs_.count(job_id) != 0) return absl::OkStatus();  // Loaded meanwhile.
      OPTIMUS_LOG(Info, kLog, "loaded job ", job_id, " (", spec.name(), ") epoch ",
                  job->config.map_epoch, ": ", job->chunks.size(), " chunks, ",
                  job->memory_bytes, " bytes, replication ", c.replication);
      jobs_[job_id] = std::move(job);
    }
    // Tell the coordinator now rather than at the next beat.
    return HeartbeatOnce();
  }

  // Allocates and registers one chunk's buffers (zeroed, no version yet).
  absl::StatusOr<std::unique_ptr<Chunk>> AllocateChunk(const Job& job,
                                                       const v1::ChunkPlacement& p) {
    const JobConfig& c = job.config;
    auto ch = std::make_unique<Chunk>();
    ch->tensor = p.tensor();
    ch->chunk = p.chunk();
    ch->num_elems = p.num_elems();
    ch->offset_elems = p.offset_elems();
    const uint64_t n = p.num_elems();
    const bool replicated = c.replication > 0;
    ch->master = AllocZeroed(n * 4);
    ch->m = AllocZeroed(n * 4);
    if (job.has_v) ch->v = AllocZeroed(n * 4);
    AlignedBytes sum;
    if (replicated) sum = AllocZeroed(n * 4);
    ch->slots = AllocZeroed(n * DTypeSize(c.grad_dtype) * c.world_size);
    ch->published[0] = AllocZeroed(n * DTypeSize(c.param_dtype));
    ch->published[1] = AllocZeroed(n * DTypeSize(c.param_dtype));
    if (!ch->master || !ch->m || (job.has_v && !ch->v) || (replicated && !sum) ||
        !ch->slots || !ch->published[0] || !ch->published[1]) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "out of memory allocating chunk of ", n, " elements for job ", c.job_id));
    }
    // Register the buffers rendezvous lands in or is read from.
    std::vector<std::pair<uint8_t*, size_t>> buffers = {
        {ch->slots.get(), n * DTypeSize(c.grad_dtype) * c.world_size},
        {ch->published[0].get(), n * DTypeSize(c.param_dtype)},
        {ch->published[1].get(), n * DTypeSize(c.param_dtype)},
        {ch->master.get(), n * 4}};
    if (replicated) buffers.push_back({sum.get(), n * 4});
    for (auto [ptr, size] : buffers) {
      auto region = worker_->RegisterMemory(ptr, size);
      if (!region.ok()) return region.status();
      ch->regions.push_back(std::move(*region));
    }
    for (uint32_t r = 0; r < c.world_size; ++r) {
      ch->grad_ptrs.push_back(ch->slots.get() + r * n * DTypeSize(c.grad_dtype));
    }
    {
      absl::MutexLock lock(&ch->mu);
      ch->slot_state.assign(c.world_size, SlotState::kEmpty);
      ch->sum = std::move(sum);
    }
    return ch;
  }

  static uint64_t ChunkBytes(const Job& job, const Chunk& ch) {
    const JobConfig& c = job.config;
    return ch.num_elems * (4 + 4 + (job.has_v ? 4 : 0) + (c.replication > 0 ? 4 : 0) +
                           DTypeSize(c.grad_dtype) * c.world_size +
                           2 * DTypeSize(c.param_dtype));
  }

  // Opens (once) an endpoint to every shard that backs up one of our chunks.
  std::map<uint64_t, transport::EndpointRef> ConnectBackups(const v1::ShardMap& map,
                                                            uint64_t me) {
    std::set<uint64_t> wanted;
    for (const auto& p : map.chunks()) {
      if (p.shard_id() == me && p.backup_shard_id() != 0) wanted.insert(p.backup_shard_id());
    }
    std::map<uint64_t, transport::EndpointRef> out;
    for (const auto& se : map.shards()) {
      if (wanted.count(se.shard_id()) == 0) continue;
      {
        absl::MutexLock lock(&peers_mu_);
        auto it = peers_.find(se.shard_id());
        if (it != peers_.end()) {
          out[se.shard_id()] = it->second;
          continue;
        }
      }
      auto ep = worker_->Connect(se.data_address());
      if (!ep.ok()) {
        // Forwards to it fail and wait for a map that replaces it.
        OPTIMUS_LOG(Warning, kLog, "cannot reach backup shard ", se.shard_id(), ": ",
                    ep.status().ToString());
        continue;
      }
      absl::MutexLock lock(&peers_mu_);
      peers_[se.shard_id()] = *ep;
      out[se.shard_id()] = *ep;
    }
    return out;
  }

  // Sets a chunk's role and backup from its placement in a (new) map.
  void SetPlacement(Chunk* ch, const v1::ChunkPlacement& p, uint64_t me,
                    const std::map<uint64_t, transport::EndpointRef>& backups)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ch->mu) {
    const Role role = p.shard_id() == me ? Role::kPrimary : Role::kBackup;
    if (ch->role == Role::kRetired) {
      // Back on this shard after leaving it: whatever it holds is stale.
      ch->published_version = 0;
      ch->first_version = 1;
      ch->seeded = false;
      ch->step_running = false;
      ch->in_kernel = false;
      std::fill(ch->slot_state.begin(), ch->slot_state.end(), SlotState::kEmpty);
      ch->full_slots = 0;
    }
    if (ch->role == Role::kBackup && role == Role::kPrimary) {
      OPTIMUS_LOG(Info, kLog, "promoted to primary of tensor ", ch->tensor, " chunk ", ch->chunk,
                  " at version ", ch->published_version);
    }
    ch->role = role;
    ch->primary_shard = p.shard_id();
    const uint64_t backup = role == Role::kPrimary ? p.backup_shard_id() : 0;
    if (backup != ch->backup_shard) {
      ch->backup_shard = backup;
      auto it = backups.find(backup);
      ch->backup_ep = it == backups.end() ? transport::EndpointRef{} : it->second;
      ++ch->backup_gen;
      ch->backup_seeded = false;
      // A publication held up by the old backup now seeds the new one (or
      // goes ahead without one).
      if (ch->pub_step != 0 && ch->forward != Forward::kNone) {
        ch->forward = backup != 0 ? Forward::kNeedsSeed : Forward::kNone;
      }
    }
  }

  // The chunk left this shard (or the shard was fenced): refuse everything,
  // and send the pulls waiting on it back to the map.
  void RetireLocked(Chunk* ch, const std::string& why, std::vector<ParkedPull>* failed)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(ch->mu) {
    if (ch->role == Role::kRetired) return;
    ch->role = Role::kRetired;
    ch->pub_step = 0;
    ch->forward = Forward::kNone;
    ++ch->backup_gen;
    ch->capture_step = 0;
    failed->insert(failed->end(), ch->parked.begin(), ch->parked.end());
    ch->parked.clear();
    OPTIMUS_LOG(Info, kLog, "tensor ", ch->tensor, " chunk ", ch->chunk, " retired: ", why);
  }

  void FailParked(const std::vector<ParkedPull>& failed, const std::string& why) {
    for (const ParkedPull& p : failed) {
      requests_rejected_.fetch_add(1);
      Reply(p.reply_ep, p.request_id, absl::FailedPreconditionError(why),
            wire::kReplyRefreshMap);
    }
  }

  // Logs the chunks with a step or pulls in flight (at shutdown).
  void DumpChunkStates() {
    absl::MutexLock lock(&jobs_mu_);
    for (auto& [id, job] : jobs_) {
      for (auto& [key, ch] : job->chunks) {
        absl::MutexLock clock(&ch->mu);
        if (ch->pub_step == 0 && ch->parked.empty() && ch->full_slots == 0) continue;
        OPTIMUS_LOG(Info, kLog, "in flight at shutdown: job ", id, " tensor ", ch->tensor, " chunk ", ch->chunk,
                    " role=", static_cast<int>(ch->role), " version=", ch->published_version,
                    " full_slots=", ch->full_slots, " step_running=", ch->step_running,
                    " pub_step=", ch->pub_step, " forward=", static_cast<int>(ch->forward),
                    " backup=", ch->backup_shard, " seeded=", ch->backup_seeded,
                    " blocked_on_sends=", ch->step_blocked_on_sends, " sends=",
                    ch->sends_inflight[0], "/", ch->sends_inflight[1], " parked=",
                    ch->parked.size());
      }
    }
  }

  void RetireAll(const std::string& why) {
    std::vector<ParkedPull> failed;
    {
      absl::MutexLock lock(&jobs_mu_);
      for (auto& [id, job] : jobs_) {
        for (auto& [key, chunk] : job->chunks) {
          absl::MutexLock clock(&chunk->mu);
          RetireLocked(chunk.get(), why, &failed);
        }
      }
    }
    FailParked(failed, absl::StrCat("stale shard map: ", why));
  }

  // A newer map of a loaded job: new chunks (this shard became a backup, or
  // a drain moves a chunk here) are allocated, roles and backups follow the
  // map, chunks no longer here are retired.
  absl::Status ApplyMap(Job* job, const v1::GetJobResponse& resp) {
    const uint64_t epoch = resp.map().epoch();
    const uint64_t me = shard_id_.load();
    const std::map<uint64_t, transport::EndpointRef> backups = ConnectBackups(resp.map(), me);
    std::map<uint64_t, const v1::ChunkPlacement*> mine;
    std::map<uint64_t, uint64_t> primaries;  // Every chunk's primary.
    for (const auto& p : resp.map().chunks()) {
      primaries[ChunkKey(p.tensor(), p.chunk())] = p.shard_id();
      if (p.shard_id() == me || p.backup_shard_id() == me) {
        mine[ChunkKey(p.tensor(), p.chunk())] = &p;
      }
    }
    std::vector<std::pair<uint64_t, std::unique_ptr<Chunk>>> fresh;
    uint64_t fresh_bytes = 0;
    for (const auto& [key, p] : mine) {
      {
        absl::MutexLock lock(&jobs_mu_);
        if (job->chunks.count(key) != 0) continue;
      }
      auto ch = AllocateChunk(*job, *p);
      if (!ch.ok()) return ch.status();
      fresh_bytes += ChunkBytes(*job, **ch);
      fresh.emplace_back(key, std::move(*ch));
    }
    std::vector<ParkedPull> failed;
    std::vector<Chunk*> to_publish;
    {
      absl::MutexLock lock(&jobs_mu_);
      if (job->config.map_epoch >= epoch) return absl::OkStatus();
      uint64_t used = 0;
      for (const auto& [id, j] : jobs_) used += j->memory_bytes;
      if (used + fresh_bytes > options_.memory_limit_bytes) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "map epoch ", epoch, " of job ", job->config.job_id, " adds ", fresh_bytes,
            " bytes to this shard; ",
            options_.memory_limit_bytes - std::min(used, options_.memory_limit_bytes),
            " of ", options_.memory_limit_bytes, " free"));
      }
      for (auto& [key, ch] : fresh) {
        job->memory_bytes += ChunkBytes(*job, *ch);
        job->chunks[key] = std::move(ch);
      }
      for (auto& [key, chunk] : job->chunks) {
        absl::MutexLock clock(&chunk->mu);
        auto it = mine.find(key);
        if (it == mine.end()) {
          RetireLocked(chunk.get(),
                       absl::StrCat("map epoch ", epoch, " places it on another shard"), &failed);
          // Whom to fence: a forward from anyone else is a deposed primary.
          chunk->primary_shard = primaries[key];
          continue;
        }
        const v1::ChunkPlacement& p = *it->second;
        if (p.backup_shard_id() != 0 && !chunk->sum) {
          // First backup of an unreplicated job's chunk (a drain moves it):
          // the step now goes through the forwarded sum.
          chunk->sum = AllocZeroed(chunk->num_elems * 4);
          if (!chunk->sum) {
            return absl::ResourceExhaustedError(absl::StrCat(
                "out of memory for the gradient buffer of tensor ", chunk->tensor, " chunk ",
                chunk->chunk));
          }
          job->memory_bytes += chunk->num_elems * 4;
        }
        SetPlacement(chunk.get(), p, me, backups);
        if (chunk->pub_step != 0) to_publish.push_back(chunk.get());
      }
      OPTIMUS_LOG(Info, kLog, "job ", job->config.job_id, ": map epoch ", job->config.map_epoch,
                  " -> ", epoch, " (", fresh.size(), " new chunks, ", failed.size(),
                  " pulls sent back)");
      job->config.map_epoch = epoch;
    }
    FailParked(failed, absl::StrCat("stale shard map: job ", job->config.job_id,
                                    " moved the chunk at map epoch ", epoch));
    for (Chunk* chunk : to_publish) TryPublish(job, chunk);
    return absl::OkStatus();
  }

  // Loads a chunk of a job restored from a checkpoint: its element range is
  // read from whichever files hold it (the checkpoint may be chunked
  // differently), checked, and published as version resume_step.
  absl::Status RestoreChunk(const v1::GetJobResponse& resp, Job* job, Chunk* ch) {
    if (options_.checkpoint_dir.empty()) {
      return absl::FailedPreconditionError(
          "the job is restored from a checkpoint but this shard has no --checkpoint_dir");
    }
    const std::string dir = absl::StrCat(options_.checkpoint_dir, "/", resp.restore().path());
    float* dst[] = {reinterpret_cast<float*>(ch->master.get()),
                    reinterpret_cast<float*>(ch->m.get()),
                    reinterpret_cast<float*>(ch->v.get())};
    if (auto s = ckpt::ReadTensorRange(dir, resp.restore().manifest(), ch->tensor,
                                       ch->offset_elems, ch->num_elems,
                                       absl::MakeSpan(dst, job->num_arrays));
        !s.ok()) {
      return s;
    }
    const uint64_t version = resp.resume_step();
    kernels::CastFromFp32(reinterpret_cast<const float*>(ch->master.get()), ch->num_elems,
                          ch->published[version % 2].get(), job->config.param_dtype);
    absl::MutexLock lock(&ch->mu);
    ch->published_version = version;
    ch->first_version = version;
    return absl::OkStatus();
  }

  // ---- Data plane (runs on the progress thread) ---------------------------

  void Reply(transport::EndpointRef ep, uint64_t request_id, const absl::Status& status,
             uint32_t flags = 0) {
    if (closing_.load()) return;  // Completions cancelled by the worker's teardown.
    const int code = static_cast<int>(status.code());
    if (code > 0 && code < kNumCodes) errors_[code].fetch_add(1);
    std::string header = wire::EncodeReply(request_id, status, 0, flags);
    worker_->Send(ep, wire::kAmReply,
                  absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(header.data()),
                                            header.size()),
                  nullptr, 0, [](absl::Status) {});
  }

  // The job and chunk a request names (null when unknown here) and the
  // job's loaded map epoch.
  uint64_t Lookup(const wire::RequestHeader& h, Job** job, Chunk** chunk) {
    absl::MutexLock lock(&jobs_mu_);
    auto it = jobs_.find(h.job_id);
    if (it == jobs_.end()) return 0;
    *job = it->second.get();
    auto c = (*job)->chunks.find(ChunkKey(h.tensor, h.chunk));
    if (c != (*job)->chunks.end()) *chunk = c->second.get();
    return (*job)->config.map_epoch;
  }

  // Finds the job and chunk a worker's request names under the request's
  // map epoch. Returns null with *error (and *flags) set on failure.
  Chunk* Resolve(const wire::RequestHeader& h, Job** job_out, absl::Status* error,
                 uint32_t* flags) {
    Job* job = nullptr;
    Chunk* chunk = nullptr;
    const uint64_t epoch = Lookup(h, &job, &chunk);
    if (job == nullptr) {
      *error = absl::NotFoundError(absl::StrCat("unknown job ", h.job_id, " on shard ",
                                                shard_id_.load()));
      return nullptr;
    }
    if (h.map_epoch < epoch) {
      *flags = wire::kReplyRefreshMap;
      *error = absl::FailedPreconditionError(
          absl::StrCat("stale shard map: request has epoch ", h.map_epoch, ", job ", h.job_id,
                       " is at epoch ", epoch));
      return nullptr;
    }
    if (h.map_epoch > epoch) {
      // The coordinator published a map this shard has not loaded yet.
      BeatNow();
      *flags = wire::kReplyRefreshMap;
      *error = absl::UnavailableError(
          absl::StrCat("shard ", shard_id_.load(), " has not loaded map epoch ", h.map_epoch,
                       " of job ", h.job_id, " yet (it has ", epoch, "); retry"));
      return nullptr;
    }
    if (chunk == nullptr) {
      *error = absl::NotFoundError(absl::StrCat("unknown chunk ", h.chunk, " of tensor ",
                                                h.tensor, " in job ", h.job_id, " on shard ",
                                                shard_id_.load()));
      return nullptr;
    }
    {
      absl::MutexLock lock(&chunk->mu);
      if (chunk->role != Role::kPrimary) {
        *flags = wire::kReplyRefreshMap;
        *error = absl::FailedPreconditionError(absl::StrCat(
            "stale shard map: shard ", shard_id_.load(), " is not the primary of tensor ",
            h.tensor, " chunk ", h.chunk, " of job ", h.job_id, " at epoch ", epoch));
        return nullptr;
      }
    }
    *job_out = job;
    return chunk;
  }

  void OnRequest(transport::IncomingMessage& msg) {
    auto parsed = wire::ParseRequestHeader(msg.header());
    if (!parsed.ok()) {
      requests_rejected_.fetch_add(1);
      // Without a valid header there is no request id to answer; the reply
      // carries id 0 so the sender still sees why.
      Reply(msg.reply_endpoint(), 0, parsed.status());
      return;
    }
    const wire::RequestHeader& h = *parsed;
    if (static_cast<wire::Op>(h.op) == wire::Op::kReplicate) return OnReplicate(msg, h);
    absl::Status error;
    uint32_t flags = 0;
    Job* job = nullptr;
    Chunk* chunk = Resolve(h, &job, &error, &flags);
    if (chunk == nullptr) {
      requests_rejected_.fetch_add(1);
      Reply(msg.reply_endpoint(), h.request_id, error, flags);
      return;
    }
    switch (static_cast<wire::Op>(h.op)) {
      case wire::Op::kPush: return OnPush(msg, h, *job, chunk);
      case wire::Op::kPull: return OnPull(msg, h, *job, chunk);
      case wire::Op::kInit: return OnInit(msg, h, *job, chunk);
      case wire::Op::kReplicate: return;  // Handled above.
    }
  }

  absl::Status CheckPayload(const transport::IncomingMessage& msg, const wire::RequestHeader& h,
                            const Chunk& chunk, DType want, absl::string_view what) {
    if (h.dtype != static_cast<uint8_t>(want)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " for tensor ", h.tensor, " chunk ", h.chunk, " has dtype ",
          DTypeName(static_cast<DType>(h.dtype)), ", the job expects ", DTypeName(want)));
    }
    const uint64_t want_bytes = chunk.num_elems * DTypeSize(want);
    if (h.num_bytes != want_bytes || msg.payload_size() != want_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, " for tensor ", h.tensor, " chunk ", h.chunk, " carries ", msg.payload_size(),
          " bytes (header says ", h.num_bytes, "), expected ", want_bytes, " (", chunk.num_elems,
          " x ", DTypeName(want), ")"));
    }
    return absl::OkStatus();
  }

  void OnPush(transport::IncomingMessage& msg, const wire::RequestHeader& h, Job& job,
              Chunk* chunk) {
    const JobConfig& c = job.config;
    const transport::EndpointRef ep = msg.reply_endpoint();
    absl::Status s = CheckPayload(msg, h, *chunk, c.grad_dtype, "push");
    if (s.ok() && h.rank >= c.world_size) {
      s = absl::InvalidArgumentError(
          absl::StrCat("push from rank ", h.rank, " but the job has world size ", c.world_size));
    }
    bool duplicate = false;
    uint8_t* dst = nullptr;
    if (s.ok()) {
      absl::MutexLock lock(&chunk->mu);
      const uint64_t expected = chunk->published_version;
      if (expected == 0) {
        s = absl::FailedPreconditionError(absl::StrCat(
            "tensor ", h.tensor, " chunk ", h.chunk, " has no initial values yet"));
      } else if (h.step < expected && (h.flags & wire::kRequestResend) != 0) {
        // A push sent again after a failover whose step is already applied.
        duplicate = true;
      } else if (h.step < expected) {
        s = absl::FailedPreconditionError(
            absl::StrCat("stale push: step ", h.step, " of tensor ", h.tensor, " chunk ",
                         h.chunk, " is already applied (next step is ", expected, ")"));
      } else if (h.step > expected) {
        s = absl::OutOfRangeError(
            absl::StrCat("push for step ", h.step, " of tensor ", h.tensor, " chunk ", h.chunk,
                         " is ahead: the chunk is waiting for step ", expected));
      } else if (chunk->slot_state[h.rank] != SlotState::kEmpty || chunk->step_running) {
        // The same (job, epoch, step, rank, chunk) again, or a step already
        // being applied (a promoted backup applying the forwarded sum):
        // pushes are idempotent.
        duplicate = true;
      } else {
        chunk->slot_state[h.rank] = SlotState::kReceiving;
        dst = chunk->slots.get() + h.rank * chunk->num_elems * DTypeSize(c.grad_dtype);
      }
    }
    if (!s.ok()) {
      requests_rejected_.fetch_add(1);
      return Reply(ep, h.request_id, s);
    }
    if (duplicate) {
      pushes_duplicate_.fetch_add(1);
      return Reply(ep, h.request_id, absl::OkStatus(), wire::kReplyDuplicate);
    }
    const uint64_t request_id = h.request_id;
    const uint32_t rank = h.rank;
    Job* jobp = &job;
    msg.ReceiveInto(dst, [this, ep, request_id, rank, jobp, chunk](absl::Status rs) {
      bool ready = false;
      {
        absl::MutexLock lock(&chunk->mu);
        if (!rs.ok()) {
          chunk->slot_state[rank] = SlotState::kEmpty;
        } else {
          chunk->slot_state[rank] = SlotState::kFull;
          if (++chunk->full_slots == jobp->config.world_size) {
            chunk->step_running = true;
            ready = true;
          }
        }
      }
      if (!rs.ok()) {
        requests_rejected_.fetch_add(1);
        return Reply(ep, request_id, rs);
      }
      pushes_received_.fetch_add(1);
      pushed_bytes_.fetch_add(chunk->num_elems * DTypeSize(jobp->config.grad_dtype));
      Reply(ep, request_id, absl::OkStatus());
      if (ready) MaybeScheduleStep(jobp, chunk);
    });
  }

  // Starts the step unless a pull reply is still being sent out of the buffer
  // the step will write; then the last such send starts it.
  void MaybeScheduleStep(Job* job, Chunk* chunk) {
    {
      absl::MutexLock lock(&chunk->mu);
      const int out = static_cast<int>((chunk->published_version + 1) % 2);
      if (chunk->snapshot_copying) {
        chunk->step_blocked_on_snapshot = true;
        chunk->blocked_since = absl::Now();
        return;
      }
      if (chunk->sends_inflight[out] > 0) {
        chunk->step_blocked_on_sends = true;
        return;
      }
      chunk->step_blocked_on_sends = false;
    }
    absl::MutexLock lock(&exec_mu_);
    if (executor_ != nullptr) executor_->Schedule([this, job, chunk] { RunStep(job, chunk); });
  }

  void RunStep(Job* job, Chunk* chunk) {
    const JobConfig& c = job->config;
    uint64_t step;
    bool forward_sum = false;
    transport::EndpointRef backup_ep;
    uint64_t gen = 0;
    float* sum = nullptr;
    {
      absl::MutexLock lock(&chunk->mu);
      sum = reinterpret_cast<float*>(chunk->sum.get());
      step = chunk->published_version;
      chunk->in_kernel = true;
      chunk->pub_step = step;
      chunk->pub_kernel_done = false;
      chunk->forward = Forward::kNone;
      if (chunk->backup_shard != 0) {
        if (chunk->backup_seeded && chunk->backup_ep.valid() && sum != nullptr) {
          forward_sum = true;
          chunk->forward = Forward::kInFlight;
          backup_ep = chunk->backup_ep;
          gen = chunk->backup_gen;
        } else {
          // A new backup: once the kernel is done, send it the whole state.
          chunk->forward = chunk->backup_ep.valid() ? Forward::kNeedsSeed : Forward::kWaitMap;
        }
      }
    }
    const size_t n = chunk->num_elems;
    kernels::StepInputs in;
    in.grads = absl::MakeConstSpan(chunk->grad_ptrs);
    in.grad_dtype = c.grad_dtype;
    in.grad_scale = c.grad_scale;
    in.step = static_cast<int64_t>(step);
    const void* sum_ptr[1] = {sum};
    const absl::Time start = absl::Now();
    absl::Status s;
    if (forward_sum) {
      // To a seeded backup: sum once (in rank order, scaled, exactly as
      // FusedStep sums), forward the sum, and step from it on both sides, so
      // primary and backup stay bitwise equal (and equal to the fused step,
      // which every other step uses: no extra pass without a backup to feed).
      s = kernels::SumGradsToFp32(in, n, sum, kernel_pool_.get());
      in.grads = absl::MakeConstSpan(sum_ptr, 1);
      in.grad_dtype = DType::kFp32;
      in.grad_scale = 1.0f;
      if (s.ok()) {
        SendForward(job, chunk, backup_ep, gen, step, /*seed=*/nullptr);
      } else {
        absl::MutexLock lock(&chunk->mu);
        chunk->forward = Forward::kNeedsSeed;  // Not sent: seed after the step.
      }
    }
    if (s.ok()) s = StepKernel(*job, chunk, in);
    step_latency_.Observe(absl::ToDoubleSeconds(absl::Now() - start));
    params_stepped_.fetch_add(n);
    if (!s.ok()) {
      // Our own invariant (the job config was validated at load): say so loudly.
      OPTIMUS_LOG(Error, kLog, "optimizer step failed for job ", c.job_id, " tensor ",
                  chunk->tensor, " chunk ", chunk->chunk, ": ", s.ToString());
    }
    {
      absl::MutexLock lock(&chunk->mu);
      if (chunk->pub_step == step) chunk->pub_kernel_done = true;
    }
    TryPublish(job, chunk);
  }

  absl::Status StepKernel(const Job& job, Chunk* chunk, const kernels::StepInputs& in) {
    const uint64_t step = static_cast<uint64_t>(in.step);
    kernels::ChunkState state{reinterpret_cast<float*>(chunk->master.get()),
                              reinterpret_cast<float*>(chunk->m.get()),
                              reinterpret_cast<float*>(chunk->v.get())};
    return kernels::FusedStep(job.config.hyper, in, chunk->num_elems, state,
                              chunk->published[(step + 1) % 2].get(), job.config.param_dtype,
                              kernel_pool_.get());
  }

  // Publishes the pending step once its kernel is done and the backup (if
  // any) has it; seeds a backup that needs the state first.
  void TryPublish(Job* job, Chunk* chunk) {
    uint64_t step = 0;
    std::shared_ptr<std::vector<float>> seed;
    transport::EndpointRef ep;
    uint64_t gen = 0;
    {
      absl::MutexLock lock(&chunk->mu);
      if (chunk->pub_step == 0 || !chunk->pub_kernel_done) return;
      switch (chunk->forward) {
        case Forward::kInFlight:
        case Forward::kRetryLater:
        case Forward::kWaitMap:
          return;
        case Forward::kNeedsSeed: {
          if (!chunk->backup_ep.valid()) {
            chunk->forward = Forward::kWaitMap;
            return;
          }
          // The state after the kernel is version pub_step + 1: the backup
          // takes it whole, whatever it held.
          const size_t n = chunk->num_elems;
          seed = std::make_shared<std::vector<float>>(job->num_arrays * n);
          const uint8_t* arrays[] = {chunk->master.get(), chunk->m.get(), chunk->v.get()};
          for (uint32_t a = 0; a < job->num_arrays; ++a) {
            std::memcpy(seed->data() + a * n, arrays[a], n * 4);
          }
          chunk->forward = Forward::kInFlight;
          step = chunk->pub_step + 1;
          ep = chunk->backup_ep;
          gen = chunk->backup_gen;
          break;
        }
        case Forward::kNone:
          break;
      }
    }
    if (seed != nullptr) return SendForward(job, chunk, ep, gen, step, std::move(seed));
    Publish(job, chunk);
  }

  void Publish(Job* job, Chunk* chunk) {
    std::vector<ParkedPull> ready;
    uint64_t version;
    uint64_t snapshot_checkpoint = 0;
    {
      absl::MutexLock lock(&chunk->mu);
      if (chunk->pub_step == 0) return;
      const uint64_t step = chunk->pub_step;
      chunk->pub_step = 0;
      version = step + 1;
      chunk->published_version = version;
      chunk->in_kernel = false;
      if (chunk->capture_step == version) {
        // The state is exactly version `version` until the next step, which
        // needs every worker's next push: copy it after the pulls are
        // answered, not before (the disk write happens elsewhere).
        snapshot_checkpoint = chunk->capture_checkpoint;
        chunk->snapshot_copying = true;
        chunk->capture_step = 0;
      }
      std::fill(chunk->slot_state.begin(), chunk->slot_state.end(), SlotState::kEmpty);
      chunk->full_slots = 0;
      chunk->step_running = false;
      TakeParked(chunk, version, &ready);
    }
    steps_applied_.fetch_add(1);
    for (const ParkedPull& p : ready) SendParams(job, chunk, p.reply_ep, p.request_id, p.version);
    if (snapshot_checkpoint != 0) FinishSnapshot(job, chunk, snapshot_checkpoint);
  }

  // Sends the backup the step's sum (seed null; `step` is the version the
  // step starts from) or the whole state at version `step` (a seed).
  void SendForward(Job* job, Chunk* chunk, transport::EndpointRef ep, uint64_t gen,
                   uint64_t step, std::shared_ptr<std::vector<float>> seed) {
    if (closing_.load()) return;
    wire::RequestHeader h;
    h.op = static_cast<uint16_t>(wire::Op::kReplicate);
    {
      absl::MutexLock lock(&jobs_mu_);
      h.map_epoch = job->config.map_epoch;
    }
    h.job_id = job->config.job_id;
    h.tensor = chunk->tensor;
    h.chunk = chunk->chunk;
    h.step = step;
    h.rank = static_cast<uint32_t>(shard_id_.load());
    h.dtype = static_cast<uint8_t>(DType::kFp32);
    h.flags = seed != nullptr ? wire::kReplicateState : wire::kReplicateSum;
    const void* sum;
    {
      absl::MutexLock lock(&chunk->mu);
      sum = chunk->sum.get();
    }
    const void* payload = seed != nullptr ? static_cast<const void*>(seed->data()) : sum;
    const size_t bytes = seed != nullptr ? seed->size() * 4 : chunk->num_elems * 4;
    h.num_bytes = bytes;
    const uint64_t id = next_forward_id_.fetch_add(1);
    h.request_id = id;
    {
      absl::MutexLock lock(&fwd_mu_);
      forwards_[id] = PendingForward{job, chunk, gen, seed != nullptr, ep, seed};
    }
    forwards_sent_.fetch_add(1);
    worker_->Send(ep, wire::kAmRequest, wire::AsBytes(h), payload, bytes,
                  [this, id](absl::Status st) {
                    if (!st.ok()) ForwardDone(id, st, 0);
                  });
  }

  void OnForwardReply(transport::IncomingMessage& msg) {
    auto reply = wire::ParseReply(msg.header());
    if (!reply.ok()) {
      OPTIMUS_LOG(Warning, kLog, "dropping malformed reply: ", reply.status().ToString());
      return;
    }
    ForwardDone(reply->header.request_id, reply->status, reply->header.flags);
  }

  void FailForwardsTo(transport::EndpointRef ep, const absl::Status& why) {
    std::vector<uint64_t> ids;
    {
      absl::MutexLock lock(&fwd_mu_);
      for (const auto& [id, f] : forwards_) {
        if (f.ep.ep == ep.ep) ids.push_back(id);
      }
    }
    {
      absl::MutexLock lock(&peers_mu_);
      for (auto it = peers_.begin(); it != peers_.end();) {
        it = it->second.ep == ep.ep ? peers_.erase(it) : std::next(it);
      }
    }
    for (uint64_t id : ids) ForwardDone(id, absl::UnavailableError(why.message()), 0);
  }

  // The backup's answer to a forward (or its failure).
  void ForwardDone(uint64_t id, const absl::Status& st, uint32_t flags) {
    PendingForward f;
    {
      absl::MutexLock lock(&fwd_mu_);
      auto it = forwards_.find(id);
      if (it == forwards_.end()) return;  // Already answered (send error + reply).
      f = std::move(it->second);
      forwards_.erase(it);
    }
    Chunk* chunk = f.chunk;
    std::vector<ParkedPull> fenced;
    bool retry_later = false;
    {
      absl::MutexLock lock(&chunk->mu);
      if (f.gen != chunk->backup_gen || chunk->forward != Forward::kInFlight) return;
      if (st.ok()) {
        chunk->forward = Forward::kNone;
        if (f.seed) chunk->backup_seeded = true;
      } else if ((flags & wire::kReplyFenced) != 0) {
        // Our backup serves a newer map in which we are not the primary:
        // stop at once so no worker builds on a step it will never see.
        RetireLocked(chunk, absl::StrCat("fenced by shard ", chunk->backup_shard, ": ",
                                         st.message()),
                     &fenced);
      } else if ((flags & wire::kReplyNeedSeed) != 0) {
        chunk->backup_seeded = false;
        chunk->forward = Forward::kNeedsSeed;
      } else if ((flags & wire::kReplyRetry) != 0) {
        chunk->forward = Forward::kRetryLater;
        retry_later = true;
        BeatNow();  // Our map may be the one behind.
      } else {
        // Unreachable or failed backup. Publishing without it would let
        // workers run ahead of the only other copy; hold the step until the
        // coordinator names a new backup (or none).
        chunk->forward = Forward::kWaitMap;
        OPTIMUS_LOG(Warning, kLog, "forward of tensor ", chunk->tensor, " chunk ",
                    chunk->chunk, " to backup shard ", chunk->backup_shard, " failed (",
                    st.ToString(), "); the step waits for a new map");
      }
    }
    if (!fenced.empty()) FailParked(fenced, "stale shard map: this shard was fenced");
    if (retry_later) {
      // The backup loads our map within a heartbeat; ask again shortly, as a
      // seed (the kernel may be done, so the sum alone may be too late).
      Job* job = f.job;
      absl::MutexLock lock(&exec_mu_);
      if (executor_ != nullptr) {
        executor_->Schedule([this, job, chunk, gen = f.gen] {
          absl::SleepFor(absl::Milliseconds(10));
          {
            absl::MutexLock clock(&chunk->mu);
            if (chunk->backup_gen != gen || chunk->forward != Forward::kRetryLater) return;
            chunk->forward = Forward::kNeedsSeed;
          }
          TryPublish(job, chunk);
        });
      }
      return;
    }
    TryPublish(f.job, chunk);
  }

  // ---- Backup side ----------------------------------------------------------

  void OnReplicate(transport::IncomingMessage& msg, const wire::RequestHeader& h) {
    const transport::EndpointRef ep = msg.reply_endpoint();
    Job* job = nullptr;
    Chunk* chunk = nullptr;
    const uint64_t epoch = Lookup(h, &job, &chunk);
    auto refuse = [&](const absl::Status& s, uint32_t flags) {
      requests_rejected_.fetch_add(1);
      Reply(ep, h.request_id, s, flags);
    };
    const std::string what = absl::StrCat("forward of tensor ", h.tensor, " chunk ", h.chunk,
                                          " of job ", h.job_id, " from shard ", h.rank);
    bool is_backup = false;
    bool sender_deposed = false;
    if (chunk != nullptr) {
      absl::MutexLock lock(&chunk->mu);
      is_backup = chunk->role == Role::kBackup && chunk->primary_shard == h.rank;
      // Under our map the chunk has another primary (us, promoted, or a
      // shard it moved to): the sender must stop.
      sender_deposed = chunk->primary_shard != h.rank;
    }
    if (!is_backup) {
      if (job == nullptr || h.map_epoch > epoch || !sender_deposed) {
        // Either we lag behind the sender's map, or only the backup moved
        // (the sender is still the primary and learns its new backup from
        // its next map): not a reason to fence.
        BeatNow();
        return refuse(absl::UnavailableError(absl::StrCat(what, ": map epoch ", h.map_epoch,
                                                          " not loaded here yet")),
                      wire::kReplyRetry);
      }
      const absl::Status fenced = absl::FailedPreconditionError(
          absl::StrCat(what, ": shard ", shard_id_.load(), " is not its backup under map epoch ",
                       epoch, " (the sender's is ", h.map_epoch, ")"));
      OPTIMUS_LOG(Info, kLog, "fencing: ", fenced.message());
      return refuse(fenced, wire::kReplyFenced);
    }
    const bool state = (h.flags & wire::kReplicateState) != 0;
    const size_t n = chunk->num_elems;
    const uint64_t want = state ? job->num_arrays * n * 4 : n * 4;
    if (h.dtype != static_cast<uint8_t>(DType::kFp32) || h.num_bytes != want ||
        msg.payload_size() != want || state == ((h.flags & wire::kReplicateSum) != 0)) {
      return refuse(absl::InvalidArgumentError(absl::StrCat(
                        what, ": carries ", msg.payload_size(), " bytes (flags ",
                        static_cast<int>(h.flags), "), expected ", want)),
                    0);
    }
    if (state) {
      auto staging = std::make_shared<std::vector<float>>(job->num_arrays * n);
      msg.ReceiveInto(staging->data(), [this, ep, h, job, chunk, staging](absl::Status rs) {
        if (rs.ok()) InstallSeed(*job, chunk, h.step, *staging);
        Reply(ep, h.request_id, rs);
      });
      return;
    }
    void* sum = nullptr;
    {
      absl::MutexLock lock(&chunk->mu);
      sum = chunk->sum.get();
      if (sum == nullptr) {
        return refuse(absl::InternalError(absl::StrCat(what, ": no gradient buffer")), 0);
      }
      if (!chunk->seeded || chunk->published_version != h.step || chunk->step_running) {
        const std::string why = absl::StrCat(what, ": backup is at version ",
                                             chunk->published_version, " (seeded ",
                                             chunk->seeded, "), the step starts from ", h.step);
        return refuse(absl::FailedPreconditionError(why), wire::kReplyNeedSeed);
      }
      chunk->step_running = true;
      chunk->in_kernel = true;
    }
    msg.ReceiveInto(sum, [this, ep, h, job, chunk](absl::Status rs) {
      if (!rs.ok()) {
        {
          absl::MutexLock lock(&chunk->mu);
          chunk->step_running = false;
          chunk->in_kernel = false;
        }
        return Reply(ep, h.request_id, rs);
      }
      absl::MutexLock lock(&exec_mu_);
      if (executor_ == nullptr) return;
      executor_->Schedule([this, ep, h, job, chunk] { ApplyForwardedStep(job, chunk, ep, h); });
    });
  }

  void InstallSeed(const Job& job, Chunk* chunk, uint64_t version,
                   const std::vector<float>& staging) {
    const size_t n = chunk->num_elems;
    absl::MutexLock lock(&chunk->mu);
    uint8_t* arrays[] = {chunk->master.get(), chunk->m.get(), chunk->v.get()};
    for (uint32_t a = 0; a < job.num_arrays; ++a) {
      std::memcpy(arrays[a], staging.data() + a * n, n * 4);
    }
    kernels::CastFromFp32(reinterpret_cast<const float*>(chunk->master.get()), n,
                          chunk->published[version % 2].get(), job.config.param_dtype);
    chunk->published_version = version;
    chunk->first_version = version;
    chunk->seeded = true;
    seeds_received_.fetch_add(1);
  }

  void ApplyForwardedStep(Job* job, Chunk* chunk, transport::EndpointRef ep,
                          wire::RequestHeader h) {
    const void* sum_ptr[1] = {nullptr};
    {
      absl::MutexLock lock(&chunk->mu);
      sum_ptr[0] = chunk->sum.get();
    }
    kernels::StepInputs in;
    in.grads = absl::MakeConstSpan(sum_ptr, 1);
    in.grad_dtype = DType::kFp32;
    in.grad_scale = 1.0f;
    in.step = static_cast<int64_t>(h.step);
    const absl::Status s = StepKernel(*job, chunk, in);
    std::vector<ParkedPull> ready;
    {
      absl::MutexLock lock(&chunk->mu);
      if (s.ok()) chunk->published_version = h.step + 1;
      chunk->in_kernel = false;
      chunk->step_running = false;
      std::fill(chunk->slot_state.begin(), chunk->slot_state.end(), SlotState::kEmpty);
      chunk->full_slots = 0;
      // Promoted meanwhile: workers may already wait for this version.
      if (s.ok()) TakeParked(chunk, h.step + 1, &ready);
    }
    if (s.ok()) forwarded_steps_applied_.fetch_add(1);
    Reply(ep, h.request_id, s);
    for (const ParkedPull& p : ready) SendParams(job, chunk, p.reply_ep, p.request_id, p.version);
  }

  static void TakeParked(Chunk* chunk, uint64_t version, std::vector<ParkedPull>* out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(chunk->mu) {
    auto& parked = chunk->parked;
    for (auto it = parked.begin(); it != parked.end();) {
      if (it->version == version) {
        out->push_back(*it);
        it = parked.erase(it);
      } else {
        ++it;
      }
    }
    // Count the sends now so no step can start overwriting the buffer first.
    chunk->sends_inflight[version % 2] += static_cast<int>(out->size());
  }

  // Sends version `version` (already counted in sends_inflight) to a worker.
  void SendParams(Job* job, Chunk* chunk, transport::EndpointRef ep, uint64_t request_id,
                  uint64_t version) {
    if (closing_.load()) return;
    const int idx = static_cast<int>(version % 2);
    std::string header = wire::EncodeReply(request_id, absl::OkStatus(), version, 0);
    const size_t bytes = chunk->num_elems * DTypeSize(job->config.param_dtype);
    worker_->Send(ep, wire::kAmReply,
                  absl::Span<const uint8_t>(reinterpret_cast<const uint8_t*>(header.data()),
                                            header.size()),
                  chunk->published[idx].get(), bytes,
                  [this, job, chunk, idx, bytes](absl::Status s) {
                    if (!s.ok()) {
                      OPTIMUS_LOG(Warning, kLog, "pull reply failed: ", s.ToString());
                    } else {
                      pulls_served_.fetch_add(1);
                      pulled_bytes_.fetch_add(bytes);
                    }
                    bool start_step = false;
                    {
                      absl::MutexLock lock(&chunk->mu);
                      --chunk->sends_inflight[idx];
                      start_step = chunk->step_blocked_on_sends &&
                                   chunk->sends_inflight[idx] == 0 &&
                                   static_cast<int>((chunk->published_version + 1) % 2) == idx;
                    }
                    if (start_step) MaybeScheduleStep(job, chunk);
                  });
  }

  void OnPull(transport::IncomingMessage& msg, const wire::RequestHeader& h, Job& job,
              Chunk* chunk) {
    const transport::EndpointRef ep = msg.reply_endpoint();
    const DType want = job.config.param_dtype;
    absl::Status s;
    if (h.dtype != static_cast<uint8_t>(want)) {
      s = absl::InvalidArgumentError(absl::StrCat(
          "pull for tensor ", h.tensor, " chunk ", h.chunk, " asks for ",
          DTypeName(static_cast<DType>(h.dtype)), ", the job publishes ", DTypeName(want)));
    } else if (h.num_bytes != chunk->num_elems * DTypeSize(want) || msg.payload_size() != 0) {
      s = absl::InvalidArgumentError(absl::StrCat(
          "pull for tensor ", h.tensor, " chunk ", h.chunk, " expects ", h.num_bytes,
          " bytes; the chunk has ", chunk->num_elems * DTypeSize(want)));
    } else if (h.step == 0) {
      s = absl::InvalidArgumentError("version 0 does not exist; initial values are version 1");
    }
    bool serve = false;
    if (s.ok()) {
      absl::MutexLock lock(&chunk->mu);
      const uint64_t pv = chunk->published_version;
      if (pv > 0 && (h.step == pv || (h.step + 1 == pv && h.step >= chunk->first_version &&
                                      !chunk->step_running))) {
        serve = true;
        ++chunk->sends_inflight[h.step % 2];
      } else if (h.step == pv + 1) {
        chunk->parked.push_back(ParkedPull{ep, h.request_id, h.step});
      } else if (h.step > pv + 1) {
        s = absl::OutOfRangeError(absl::StrCat(
            "pull of version ", h.step, " of tensor ", h.tensor, " chunk ", h.chunk,
            " is more than one step ahead (latest published is ", pv, ")"));
      } else {
        s = absl::FailedPreconditionError(absl::StrCat(
            "version ", h.step, " of tensor ", h.tensor, " chunk ", h.chunk,
            " is no longer held (latest published is ", pv, ")"));
      }
    }
    if (!s.ok()) {
      requests_rejected_.fetch_add(1);
      return Reply(ep, h.request_id, s);
    }
    if (serve) SendParams(&job, chunk, ep, h.request_id, h.step);
  }

  void OnInit(transport::IncomingMessage& msg, const wire::RequestHeader& h, Job& job,
              Chunk* chunk) {
    const transport::EndpointRef ep = msg.reply_endpoint();
    absl::Status s = CheckPayload(msg, h, *chunk, DType::kFp32, "init");
    if (s.ok()) {
      absl::MutexLock lock(&chunk->mu);
      if (chunk->published_version != 0 || chunk->init_receiving) {
        s = absl::AlreadyExistsError(absl::StrCat("tensor ", h.tensor, " chunk ", h.chunk,
                                                  " already has initial values"));
      } else {
        chunk->init_receiving = true;
      }
    }
    if (!s.ok()) {
      requests_rejected_.fetch_add(1);
      return Reply(ep, h.request_id, s);
    }
    const uint64_t request_id = h.request_id;
    Job* jobp = &job;
    msg.ReceiveInto(chunk->master.get(), [this, ep, request_id, jobp, chunk](absl::Status rs) {
      std::vector<ParkedPull> ready;
      if (rs.ok()) {
        kernels::CastFromFp32(reinterpret_cast<const float*>(chunk->master.get()),
                              chunk->num_elems, chunk->published[1].get(),
                              jobp->config.param_dtype);
      }
      {
        absl::MutexLock lock(&chunk->mu);
        chunk->init_receiving = false;
        if (rs.ok()) {
          chunk->published_version = 1;
          TakeParked(chunk, 1, &ready);
        }
      }
      Reply(ep, request_id, rs);
      for (const ParkedPull& p : ready) SendParams(jobp, chunk, p.reply_ep, p.request_id, 1);
    });
  }

  const ShardServerOptions options_;
  // Borrowed by every step; outlives executor_ (declared before it, so the
  // step threads are joined first).
  std::unique_ptr<kernels::ThreadPool> kernel_pool_;
  absl::Mutex exec_mu_;
  // Null once shutting down.
  std::unique_ptr<StepExecutor> executor_ ABSL_GUARDED_BY(exec_mu_);
  // Null without options.checkpoint_dir.
  std::unique_ptr<CheckpointWriter> ckpt_writer_;
  std::unique_ptr<transport::Worker> worker_;
  std::atomic<bool> closing_{false};  // Set just before worker_ is destroyed.
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Coordinator::Stub> stub_;
  std::atomic<uint64_t> shard_id_{0};
  std::atomic<int64_t> lease_ms_{2000};  // Granted by the coordinator.

  std::atomic<uint64_t> steps_applied_{0};
  std::atomic<uint64_t> pushes_received_{0};
  std::atomic<uint64_t> requests_rejected_{0};
  std::atomic<uint64_t> pushes_duplicate_{0};
  std::atomic<uint64_t> pushed_bytes_{0};
  std::atomic<uint64_t> pulled_bytes_{0};
  std::atomic<uint64_t> params_stepped_{0};
  std::atomic<int64_t> last_beat_unix_ns_{0};
  static constexpr int kNumCodes = 17;  // absl::StatusCode values 0..16.
  std::array<std::atomic<uint64_t>, kNumCodes> errors_{};
  Histogram step_latency_;
  std::unique_ptr<HttpServer> http_;
  std::atomic<uint64_t> pulls_served_{0};
  std::atomic<uint64_t> checkpoint_stall_ns_{0};

  mutable absl::Mutex jobs_mu_;
  std::map<uint64_t, std::unique_ptr<Job>> jobs_ ABSL_GUARDED_BY(jobs_mu_);

  // Replication: endpoints to backup shards, and forwards in flight.
  absl::Mutex peers_mu_;
  std::map<uint64_t, transport::EndpointRef> peers_ ABSL_GUARDED_BY(peers_mu_);
  absl::Mutex fwd_mu_;
  absl::flat_hash_map<uint64_t, PendingForward> forwards_ ABSL_GUARDED_BY(fwd_mu_);
  std::atomic<uint64_t> next_forward_id_{1};
  std::atomic<uint64_t> forwards_sent_{0};
  std::atomic<uint64_t> forwarded_steps_applied_{0};
  std::atomic<uint64_t> seeds_received_{0};

  absl::Mutex stop_mu_;
  bool stopped_ ABSL_GUARDED_BY(stop_mu_) = false;
  bool beat_now_ ABSL_GUARDED_BY(stop_mu_) = false;
  std::thread heartbeat_thread_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<ShardServer>> ShardServer::Start(
    const ShardServerOptions& options) {
  if (options.coordinator_address.empty()) {
    return absl::InvalidArgumentError("ShardServerOptions.coordinator_address is required");
  }
  auto server = std::make_unique<ShardServerImpl>(options);
  if (auto s = server->Init(); !s.ok()) return s;
  return std::unique_ptr<ShardServer>(std::move(server));
}

}  // namespace server
}  // namespace optimus
