// bench/control_plane: how many shards one optimus-coord holds (issue 16
// item 6). A real optimus-coord runs as a child process, pinned to CPU 0
// where the machine has more than one (taskset), and this process plays N
// shards on the other CPUs, each doing on the control plane exactly what
// optimus-shard does (server/control.cc, server/coordinator_link.cc):
//
//   - RegisterShard (deadline 5 s; again 1 s after a failure), with a
//     data_address of --address_bytes (a UCX worker address is a few
//     hundred bytes) and a memory budget big enough for the jobs below;
//   - Heartbeat every lease/3 after the previous one was sent (at once
//     after it returned, when it took longer; deadline 2 s), reporting per job the map epoch loaded and its chunk counts, at
//     once again after a map was loaded; registering again when the
//     coordinator no longer knows the shard (it was declared DOWN);
//   - GetJob (deadline 5 s, off the heartbeat: optimus-shard fetches on its
//     loader thread) when a heartbeat assigns a job at a newer epoch than
//     the one loaded, asking only for its own part of the map
//     (for_shard_id, as optimus-shard does; --per_shard_maps=false asks for
//     the whole map, as it did before) and counting the chunks the map
//     gives it as primary or backup; a fetch refused as busy
//     (RESOURCE_EXHAUSTED) is tried again after a jittered, growing wait,
//     as optimus-shard's loader does (common/busy_retry.h); freeing the
//     jobs the coordinator released.
//
// A few completion-queue threads and one scheduler thread drive every
// shard with gRPC's async API; the shards share --channels connections.
// Backups report themselves seeded as soon as their map is loaded (there
// is no data plane here).
//
// Per N (--shards=100,1000,...) a fresh coordinator goes through: N
// registrations; --steady_s of heartbeats only; CreateJob of an
// 8.75e9-parameter job (the per-GPU part of LLaMA-70B under TP 2 x PP 4:
// layers 0-19 and the embedding, halved) with replication 0, until READY,
// then deleted; CreateJob of LLaMA-70B itself (70e9 parameters) with
// replication 1, until READY; 1% of the shards stop heartbeating (by
// default all in one failure domain: the shards register in racks of
// --shards_per_domain; --kill=spread picks them evenly instead), until the
// coordinator shows them all DOWN and the job's map moved on; one full
// Status call. Every wait has a deadline: what did not happen in time is
// named in the line's "error" field and the next phase runs.
//
// One JSON line per N: heartbeats/s needed (N x 3 / lease) and served,
// heartbeat latency p50/p99/max and errors, shards wrongly declared DOWN
// (shards this process kept alive that the coordinator's Status shows DOWN,
// and how many times a live shard was told to register again), map
// fetches, each job's CreateJob and READY times, the time to mark the
// killed shards DOWN and to move the job's map, the Status call's time and
// size, and the coordinator's CPU seconds, RSS and threads (/proc).
//
// Usage: bazel run -c opt //bench:control_plane -- [--shards=100,1000]
//        [--steady_s=10] [--lease_ms=2000] [--jobs=small,large]
//        [--ready_timeout_s=120] [--channels=64] [--threads=2]
//        [--per_shard_maps=true] [--state_dir]
//        [--coord_flags=--max_concurrent_map_reads=8,...]
#include <sched.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <queue>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/wire_format_lite.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/support/proto_buffer_reader.h>

#include "absl/base/thread_annotations.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/proc_cluster.h"
#include "common/busy_retry.h"
#include "common/grpc_limits.h"
#include "common/json.h"
#include "common/model_presets.h"
#include "proto/optimus.grpc.pb.h"

ABSL_FLAG(std::string, shards, "100,1000", "numbers of simulated shards N, one line each");
ABSL_FLAG(int, lease_ms, 2000, "the coordinator's --lease_ms (shards beat every third)");
ABSL_FLAG(double, steady_s, 10, "seconds of heartbeats alone after registration, per N");
ABSL_FLAG(std::string, jobs, "small,large",
          "jobs to create in turn: small (8.75e9 parameters, replication 0, deleted once "
          "READY), large (LLaMA-70B, 70e9 parameters, replication 1, kept for the kill)");
ABSL_FLAG(double, ready_timeout_s, 120, "how long a job may take to become READY");
ABSL_FLAG(double, kill_fraction, 0.01, "share of the shards that stop heartbeating");
ABSL_FLAG(int, shards_per_domain, 256,
          "simulated shards per failure domain (a rack: 32 servers of 8 DPUs); 0: none, each "
          "shard its own host");
ABSL_FLAG(std::string, kill, "domain",
          "which shards stop: domain (the first ones, filling one failure domain before the "
          "next: a rack's power or switch), or spread (evenly over all shards: independent "
          "failures)");
ABSL_FLAG(int, channels, 64, "gRPC connections the simulated shards share");
ABSL_FLAG(int, threads, 2, "the simulator's completion-queue threads");
ABSL_FLAG(int, address_bytes, 300, "size of each simulated shard's data_address");
ABSL_FLAG(bool, per_shard_maps, true,
          "shards fetch only their part of a map (GetJob for_shard_id), as optimus-shard "
          "does; false: the whole map");
ABSL_FLAG(bool, pin, true,
          "coordinator on CPU 0 (taskset), this process on the others (when there are 2+)");
ABSL_FLAG(std::string, bin_dir, "", "folder holding coordinator/optimus-coord (default: runfiles)");
ABSL_FLAG(std::string, work_dir, "", "folder for the coordinator's logs (default: a new temp dir)");
ABSL_FLAG(std::string, coord_flags, "",
          "more flags for optimus-coord, comma-separated (e.g. --max_concurrent_map_reads=8)");
ABSL_FLAG(bool, state_dir, false,
          "give the coordinator a --state_dir in the work folder: every registration and job "
          "change is answered once it is on disk (fsync)");

namespace optimus {
namespace bench {
namespace {

constexpr char kWho[] = "control_plane";

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

std::chrono::system_clock::time_point DeadlineIn(absl::Duration d) {
  return std::chrono::system_clock::now() +
         std::chrono::microseconds(absl::ToInt64Microseconds(d));
}

double Percentile(std::vector<float> v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())));
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

// ---- The jobs ----

struct BenchJob {
  std::string key;   // "small", "large".
  std::string name;  // The job's name.
  uint32_t replication = 0;
  std::vector<PresetTensor> tensors;
  uint64_t num_params() const {
    uint64_t n = 0;
    for (const PresetTensor& t : tensors) n += t.num_elems();
    return n;
  }
};

// LLaMA-70B, whole (key "large"), or the part one GPU holds under tensor
// parallelism 2 and pipeline parallelism 4 (key "small"): the first
// pipeline stage's 20 layers and the embedding, each matrix halved.
absl::StatusOr<BenchJob> MakeJob(const std::string& key) {
  absl::StatusOr<ModelPreset> m = FindModelPreset("llama-70b");
  if (!m.ok()) return m.status();
  BenchJob j;
  j.key = key;
  if (key == "large") {
    j.name = "llama-70b";
    j.replication = 1;
    j.tensors = m->tensors;
    return j;
  }
  if (key != "small") {
    return absl::InvalidArgumentError(absl::StrCat("--jobs: unknown job \"", key,
                                                   "\" (small or large)"));
  }
  j.name = "llama-70b-tp2-pp4-stage0";
  for (const PresetTensor& t : m->tensors) {
    int layer = -1;
    std::vector<std::string> parts = absl::StrSplit(t.name, '.');
    if (parts.size() > 2 && parts[1] == "layers") (void)absl::SimpleAtoi(parts[2], &layer);
    const bool stage0 = t.name == "model.embed_tokens.weight" || (layer >= 0 && layer < 20);
    if (!stage0) continue;
    PresetTensor half = t;
    if (half.shape.size() == 2) half.shape[0] /= 2;
    j.tensors.push_back(half);
  }
  return j;
}

v1::CreateJobRequest JobRequest(const BenchJob& j) {
  v1::CreateJobRequest req;
  v1::JobSpec* spec = req.mutable_spec();
  spec->set_name(j.name);
  spec->set_world_size(1);
  spec->set_grad_dtype(v1::DTYPE_BF16);
  spec->set_param_dtype(v1::DTYPE_BF16);
  spec->set_replication(j.replication);
  spec->mutable_optimizer()->set_kind(v1::OPTIMIZER_ADAMW);
  spec->mutable_optimizer()->set_lr(1e-4f);
  for (const PresetTensor& t : j.tensors) {
    v1::TensorSpec* ts = spec->add_tensors();
    ts->set_name(t.name);
    for (int64_t d : t.shape) ts->add_shape(d);
  }
  return req;
}

// ---- The simulated shards ----

struct Counters {
  uint64_t heartbeats_ok = 0;
  uint64_t heartbeat_errors = 0;
  uint64_t told_to_register = 0;  // known=false to a live shard.
  uint64_t registrations = 0;
  uint64_t register_errors = 0;
  uint64_t fetches_ok = 0;
  uint64_t fetch_errors = 0;  // Failed, not counting the busy refusals.
  // Refused as busy (RESOURCE_EXHAUSTED: past --max_concurrent_map_reads,
  // or no server thread free), then tried again after a jittered wait.
  uint64_t fetches_refused = 0;
  uint64_t fetch_bytes = 0;  // GetJobResponse bytes received.
  // Chunks a per-shard answer carried that the shard holds neither as
  // primary nor as backup (0 unless the coordinator cuts maps wrong).
  uint64_t foreign_chunks = 0;
  // New map epochs taken without a fetch (Assignment.part_epoch said the
  // shard's part was unchanged), as optimus-shard does.
  uint64_t epochs_unchanged = 0;
  // Fetches the coordinator gave a later slot (Assignment.fetch_after_ms).
  uint64_t fetches_delayed = 0;
  std::vector<float> heartbeat_ms;
  std::vector<float> fetch_ms;
  // From a shard's first try at fetching a (job, epoch) to its answer,
  // busy refusals and waits included.
  std::vector<float> fetch_load_ms;
  std::string last_error;
};

class Simulator {
 public:
  struct Options {
    int num_shards = 0;
    int threads = 2;
    int address_bytes = 300;
    uint64_t memory_limit_bytes = 0;
    bool per_shard_maps = true;
    int shards_per_domain = 0;  // 0: no failure_domain (the hostname is one per shard).
  };

  Simulator(const Options& o, const std::vector<std::shared_ptr<grpc::Channel>>& channels)
      : options_(o), shards_(static_cast<size_t>(o.num_shards)) {
    for (const auto& ch : channels) {
      stubs_.push_back(v1::Coordinator::NewStub(ch));
      generic_.push_back(std::make_unique<JobStub>(ch));
    }
  }

  ~Simulator() { Stop(); }

  // Starts the threads; the shards register 50 us apart (as machines
  // coming up within a second or so), at most 256 at a time.
  void Start() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      const absl::Time now = absl::Now();
      for (size_t i = 0; i < shards_.size(); ++i) {
        ScheduleLocked(i, now + absl::Microseconds(50) * static_cast<int64_t>(i));
      }
    }
    for (int t = 0; t < options_.threads; ++t) {
      cq_threads_.emplace_back([this] { CompletionLoop(); });
    }
    scheduler_ = std::thread([this] { SchedulerLoop(); });
  }

  void Stop() ABSL_LOCKS_EXCLUDED(mu_) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    if (scheduler_.joinable()) scheduler_.join();
    // No call starts from now on; those in flight end by their deadlines
    // (at most 5 s).
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(this, &Simulator::NoneInFlight), absl::Seconds(30));
    }
    cq_.Shutdown();
    for (auto& t : cq_threads_) t.join();
    cq_threads_.clear();
  }

  int Registered() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    int n = 0;
    for (const Shard& s : shards_) n += s.id != 0;
    return n;
  }

  // Stops heartbeating the shards at `indices`; returns their ids.
  std::vector<uint64_t> Kill(const std::vector<size_t>& indices) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    std::vector<uint64_t> ids;
    for (size_t i : indices) {
      shards_[i].alive = false;
      ids.push_back(shards_[i].id);
    }
    return ids;
  }

  // Heartbeats answered so far (the length of counters().heartbeat_ms).
  size_t HeartbeatsAnswered() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return counters_.heartbeat_ms.size();
  }
  Counters counters() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return counters_;
  }

  void set_lease(absl::Duration lease) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    interval_ = std::max(lease / 3, absl::Milliseconds(50));
  }

 private:
  struct Held {
    uint64_t epoch = 0;
    uint32_t primary = 0, backup = 0, replicated = 0;
  };
  struct Shard {
    uint64_t id = 0;
    bool alive = true;
    bool registering = false;
    bool beating = false;  // A heartbeat in flight.
    bool beat_again = false;
    absl::Time next = absl::InfiniteFuture();
    std::map<uint64_t, Held> jobs;
    std::set<uint64_t> fetching;
    // By job: busy refusals of its fetch in a row, and when the first try
    // of the fetch now in progress started.
    std::map<uint64_t, int> busy_in_a_row;
    std::map<uint64_t, absl::Time> fetch_since;
  };
  // A fetch refused as busy, to be tried again at `when`.
  struct Refetch {
    absl::Time when;
    size_t shard;
    uint64_t shard_id, job_id;
    bool operator>(const Refetch& o) const { return when > o.when; }
  };
  enum class Kind { kRegister, kHeartbeat, kGetJob };
  struct Call {
    Kind kind = Kind::kHeartbeat;
    size_t shard = 0;
    uint64_t shard_id = 0;
    uint64_t job_id = 0;
    absl::Time start;
    grpc::ClientContext ctx;
    grpc::Status status;
    v1::RegisterShardResponse reg;
    v1::HeartbeatResponse beat;
    grpc::ByteBuffer job;  // GetJobResponse, as it came.
    std::unique_ptr<grpc::ClientAsyncResponseReader<v1::RegisterShardResponse>> reg_reader;
    std::unique_ptr<grpc::ClientAsyncResponseReader<v1::HeartbeatResponse>> beat_reader;
    std::unique_ptr<grpc::ClientAsyncResponseReader<grpc::ByteBuffer>> job_reader;
  };
  struct Due {
    absl::Time when;
    size_t shard;
    bool operator>(const Due& o) const { return when > o.when; }
  };

  bool NoneInFlight() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; }

  void ScheduleLocked(size_t i, absl::Time when) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    shards_[i].next = when;
    due_.push(Due{when, i});
  }

  // Heartbeat now: after the one in flight, if any (optimus-shard's BeatNow).
  void BeatNowLocked(size_t i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Shard& s = shards_[i];
    if (s.beating) {
      s.beat_again = true;
    } else if (s.id != 0 && s.alive) {
      ScheduleLocked(i, absl::Now());
    }
  }

  v1::HeartbeatRequest ReportLocked(const Shard& s) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    v1::HeartbeatRequest req;
    req.set_shard_id(s.id);
    req.set_transports("tcp");
    uint32_t owned = 0;
    for (const auto& [job_id, h] : s.jobs) {
      v1::ShardJobProgress* p = req.add_jobs();
      p->set_job_id(job_id);
      p->set_map_epoch(h.epoch);
      p->set_chunks_loaded(h.primary + h.backup);
      p->set_primary_chunks(h.primary);
      p->set_backup_chunks(h.backup);
      p->set_backups_seeded(h.backup);
      p->set_primaries_replicated(h.replicated);
      owned += h.primary + h.backup;
    }
    req.set_chunks_owned(owned);
    return req;
  }

  void SchedulerLoop() ABSL_LOCKS_EXCLUDED(mu_) {
    constexpr int kMaxRegistering = 256;
    for (;;) {
      std::vector<std::unique_ptr<Call>> calls;
      std::vector<v1::HeartbeatRequest> beats;
      std::vector<v1::RegisterShardRequest> regs;
      std::vector<Refetch> refetches;
      {
        absl::MutexLock lock(&mu_);
        if (stopping_) return;
        const absl::Time now = absl::Now();
        while (!refetch_.empty() && refetch_.top().when <= now) {
          const Refetch r = refetch_.top();
          refetch_.pop();
          Shard& s = shards_[r.shard];
          if (!s.alive || s.id != r.shard_id) {  // Dead, or registered anew.
            s.fetching.erase(r.job_id);
            s.busy_in_a_row.erase(r.job_id);
            s.fetch_since.erase(r.job_id);
            continue;
          }
          ++in_flight_;
          refetches.push_back(r);
        }
        while (!due_.empty() && due_.top().when <= now) {
          const Due d = due_.top();
          due_.pop();
          Shard& s = shards_[d.shard];
          if (d.when != s.next || !s.alive || s.beating || s.registering) continue;
          s.next = absl::InfiniteFuture();
          auto call = std::make_unique<Call>();
          call->shard = d.shard;
          call->shard_id = s.id;
          call->start = now;
          if (s.id == 0) {
            if (registering_ >= kMaxRegistering) {
              ScheduleLocked(d.shard, now + absl::Milliseconds(20));
              continue;
            }
            ++registering_;
            s.registering = true;
            call->kind = Kind::kRegister;
            call->ctx.set_deadline(DeadlineIn(absl::Seconds(5)));
            regs.push_back(RegistrationLocked(d.shard));
          } else {
            s.beating = true;
            call->kind = Kind::kHeartbeat;
            call->ctx.set_deadline(DeadlineIn(absl::Seconds(2)));
            beats.push_back(ReportLocked(s));
          }
          ++in_flight_;
          calls.push_back(std::move(call));
        }
      }
      for (const Refetch& f : refetches) StartGetJob(f.shard, f.shard_id, f.job_id);
      size_t b = 0, r = 0;
      for (auto& call : calls) {
        v1::Coordinator::Stub* stub = StubOf(call->shard);
        Call* c = call.release();
        if (c->kind == Kind::kRegister) {
          c->reg_reader = stub->PrepareAsyncRegisterShard(&c->ctx, regs[r++], &cq_);
          c->reg_reader->StartCall();
          c->reg_reader->Finish(&c->reg, &c->status, c);
        } else {
          c->beat_reader = stub->PrepareAsyncHeartbeat(&c->ctx, beats[b++], &cq_);
          c->beat_reader->StartCall();
          c->beat_reader->Finish(&c->beat, &c->status, c);
        }
      }
      absl::SleepFor(absl::Milliseconds(2));
    }
  }

  // Shard i's connection.
  v1::Coordinator::Stub* StubOf(size_t i) const { return stubs_[i % stubs_.size()].get(); }

  v1::RegisterShardRequest RegistrationLocked(size_t i) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    v1::RegisterShardRequest req;
    v1::ShardCapabilities* caps = req.mutable_capabilities();
    caps->set_kind(v1::SHARD_KIND_DPU);
    caps->set_arch("aarch64");
    caps->set_cores(16);
    caps->set_memory_limit_bytes(options_.memory_limit_bytes);
    caps->set_staging_bytes(uint64_t{1} << 30);
    std::string address(static_cast<size_t>(std::max(1, options_.address_bytes)), 'a');
    const std::string tag = absl::StrCat("sim-", i, "-", ++registrations_made_);
    address.replace(0, std::min(address.size(), tag.size()), tag.substr(0, address.size()));
    caps->set_data_address(address);
    caps->set_hostname(absl::StrCat("dpu-", i));
    if (options_.shards_per_domain > 0) {
      caps->set_failure_domain(absl::StrCat("rack-", i / static_cast<size_t>(options_.shards_per_domain)));
    }
    return req;
  }

  void StartGetJob(size_t i, uint64_t shard_id, uint64_t job_id) ABSL_LOCKS_EXCLUDED(mu_) {
    auto* c = new Call();
    c->kind = Kind::kGetJob;
    c->shard = i;
    c->shard_id = shard_id;
    c->job_id = job_id;
    c->start = absl::Now();
    c->ctx.set_deadline(DeadlineIn(absl::Seconds(5)));
    v1::GetJobRequest req;
    req.set_job_id(job_id);
    if (options_.per_shard_maps) req.set_for_shard_id(shard_id);
    c->job_reader = generic_[i % generic_.size()]->PrepareUnaryCall(
        &c->ctx, "/optimus.v1.Coordinator/GetJob", req, &cq_);
    c->job_reader->StartCall();
    c->job_reader->Finish(&c->job, &c->status, c);
  }

  void CompletionLoop() ABSL_LOCKS_EXCLUDED(mu_) {
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
      std::unique_ptr<Call> c(static_cast<Call*>(tag));
      const absl::Time now = absl::Now();
      const float ms = static_cast<float>(absl::ToDoubleMilliseconds(now - c->start));
      std::vector<std::pair<uint64_t, uint64_t>> fetch;  // (shard id, job id)
      Held held;
      size_t fetched_bytes = 0;
      uint64_t foreign = 0;
      if (c->kind == Kind::kGetJob && c->status.ok()) {
        // Outside the lock: the map can be large.
        fetched_bytes = c->job.Length();
        held = options_.per_shard_maps ? HeldInPart(c->shard_id, &c->job, &foreign)
                                       : HeldIn(c->job_id, c->shard_id, &c->job);
      }
      {
        absl::MutexLock lock(&mu_);
        --in_flight_;
        Shard& s = shards_[c->shard];
        switch (c->kind) {
          case Kind::kRegister:
            --registering_;
            s.registering = false;
            if (c->status.ok()) {
              ++counters_.registrations;
              s.id = c->reg.shard_id();
              s.jobs.clear();
              interval_ = std::max(absl::Milliseconds(c->reg.lease_ms()) / 3,
                                   absl::Milliseconds(50));
              if (s.alive) ScheduleLocked(c->shard, now + interval_);
            } else {
              ++counters_.register_errors;
              counters_.last_error = absl::StrCat("RegisterShard: ", c->status.error_message());
              if (s.alive) ScheduleLocked(c->shard, now + absl::Seconds(1));
            }
            break;
          case Kind::kHeartbeat:
            s.beating = false;
            if (!c->status.ok()) {
              ++counters_.heartbeat_errors;
              counters_.last_error = absl::StrCat("Heartbeat: ", c->status.error_message());
            } else if (!c->beat.known()) {
              // Declared DOWN (or forgotten): drop everything and register
              // again, as optimus-shard does.
              if (s.alive) ++counters_.told_to_register;
              s.id = 0;
              s.jobs.clear();
              s.beat_again = false;
              if (s.alive) ScheduleLocked(c->shard, now);
              break;
            } else {
              ++counters_.heartbeats_ok;
              counters_.heartbeat_ms.push_back(ms);
              for (uint64_t job : c->beat.released_jobs()) s.jobs.erase(job);
              for (const v1::Assignment& a : c->beat.assignments()) {
                auto h = s.jobs.find(a.job_id());
                const uint64_t have = h == s.jobs.end() ? 0 : h->second.epoch;
                if (have >= a.map_epoch() || s.fetching.count(a.job_id()) != 0 || stopping_) {
                  continue;
                }
                if (h != s.jobs.end() && a.part_epoch() != 0 && have >= a.part_epoch()) {
                  // As optimus-shard: the new epoch left this shard's
                  // part as it was; take it, tell at once, fetch nothing.
                  h->second.epoch = a.map_epoch();
                  ++counters_.epochs_unchanged;
                  s.beat_again = true;
                  continue;
                }
                s.fetching.insert(a.job_id());
                s.fetch_since[a.job_id()] = now;
                if (a.fetch_after_ms() > 0) {
                  // The coordinator's slot for this fetch (its pacing).
                  ++counters_.fetches_delayed;
                  refetch_.push(Refetch{now + absl::Milliseconds(a.fetch_after_ms()), c->shard,
                                        s.id, a.job_id()});
                  continue;
                }
                ++in_flight_;
                fetch.emplace_back(s.id, a.job_id());
              }
            }
            if (s.alive && s.id != 0) {
              // Due an interval after this one was sent, as optimus-shard's
              // heartbeats are (server/control.cc).
              ScheduleLocked(c->shard,
                             s.beat_again ? now : std::max(now, c->start + interval_));
              s.beat_again = false;
            }
            break;
          case Kind::kGetJob:
            if (c->status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
              // As optimus-shard's loader: again after a random wait that
              // grows while the coordinator stays busy (still "fetching",
              // so that heartbeats start no second fetch meanwhile).
              ++counters_.fetches_refused;
              refetch_.push(Refetch{
                  now + JitteredBusyBackoff(BusyBackoff(), s.busy_in_a_row[c->job_id]++),
                  c->shard, c->shard_id, c->job_id});
              break;
            }
            s.fetching.erase(c->job_id);
            s.busy_in_a_row.erase(c->job_id);
            if (auto since = s.fetch_since.find(c->job_id); since != s.fetch_since.end()) {
              if (c->status.ok()) {
                counters_.fetch_load_ms.push_back(
                    static_cast<float>(absl::ToDoubleMilliseconds(now - since->second)));
              }
              s.fetch_since.erase(since);
            }
            if (!c->status.ok()) {
              ++counters_.fetch_errors;
              counters_.last_error = absl::StrCat("GetJob: ", c->status.error_message());
            } else {
              ++counters_.fetches_ok;
              counters_.fetch_ms.push_back(ms);
              counters_.fetch_bytes += fetched_bytes;
              counters_.foreign_chunks += foreign;
              if (s.id == c->shard_id) {
                Held& h = s.jobs[c->job_id];
                if (held.epoch > h.epoch) h = held;
                BeatNowLocked(c->shard);
              }
            }
            break;
        }
      }
      for (const auto& [shard_id, job_id] : fetch) StartGetJob(c->shard, shard_id, job_id);
    }
  }

  using JobStub = grpc::TemplatedGenericStub<v1::GetJobRequest, grpc::ByteBuffer>;
  // What every shard holds of one map (by shard id), and the size of the
  // GetJobResponse it came in.
  struct ParsedMap {
    size_t bytes = 0;
    std::map<uint64_t, Held> held;
  };

  // The map epoch in a GetJobResponse (field 3, ShardMap; its field 2),
  // read without parsing the rest; 0 if it has none.
  static uint64_t EpochOf(grpc::ByteBuffer* buffer) {
    namespace wfl = google::protobuf::internal;
    grpc::ProtoBufferReader reader(buffer);
    google::protobuf::io::CodedInputStream in(&reader);
    for (uint32_t tag = in.ReadTag(); tag != 0; tag = in.ReadTag()) {
      if (tag >> 3 == 3 && (tag & 7) == wfl::WireFormatLite::WIRETYPE_LENGTH_DELIMITED) {
        uint32_t len = 0;
        if (!in.ReadVarint32(&len)) return 0;
        in.PushLimit(static_cast<int>(len));
        for (uint32_t t = in.ReadTag(); t != 0; t = in.ReadTag()) {
          uint64_t epoch = 0;
          if (t >> 3 == 2 && (t & 7) == wfl::WireFormatLite::WIRETYPE_VARINT) {
            return in.ReadVarint64(&epoch) ? epoch : 0;
          }
          if (!wfl::WireFormatLite::SkipField(&in, t)) return 0;
        }
        return 0;
      }
      if (!wfl::WireFormatLite::SkipField(&in, tag)) return 0;
    }
    return 0;
  }

  // What shard `shard_id` holds of the map in `buffer`. Every shard is
  // sent the same whole map today: the first copy of each (job, epoch) is
  // parsed and counted for every shard, and a copy of the same size only
  // has its epoch read, so that the simulator's CPU goes to the
  // coordinator's answers rather than to parsing them N times. A copy of
  // another size (a map made per shard) is parsed on its own.
  Held HeldIn(uint64_t job_id, uint64_t shard_id, grpc::ByteBuffer* buffer)
      ABSL_LOCKS_EXCLUDED(cache_mu_) {
    const size_t bytes = buffer->Length();
    const uint64_t epoch = EpochOf(buffer);
    {
      absl::MutexLock lock(&cache_mu_);
      auto it = maps_.find({job_id, epoch});
      if (it != maps_.end() && it->second->bytes == bytes) {
        auto h = it->second->held.find(shard_id);
        Held out = h == it->second->held.end() ? Held() : h->second;
        out.epoch = epoch;
        return out;
      }
    }
    v1::GetJobResponse resp;
    grpc::ProtoBufferReader reader(buffer);
    if (!resp.ParseFromZeroCopyStream(&reader)) return Held();
    auto parsed = std::make_shared<ParsedMap>();
    parsed->bytes = bytes;
    for (const v1::ChunkPlacement& p : resp.map().chunks()) {
      Held& primary = parsed->held[p.shard_id()];
      ++primary.primary;
      if (p.backup_shard_id() != 0) {
        ++primary.replicated;
        ++parsed->held[p.backup_shard_id()].backup;
      }
    }
    auto h = parsed->held.find(shard_id);
    Held out = h == parsed->held.end() ? Held() : h->second;
    out.epoch = resp.map().epoch();
    absl::MutexLock lock(&cache_mu_);
    maps_[{job_id, out.epoch}] = std::move(parsed);
    return out;
  }

  // What shard `shard_id` holds of its own part of a map (a GetJobResponse
  // for its for_shard_id: small, parsed whole); chunks in it that are not
  // the shard's are counted in `foreign`.
  static Held HeldInPart(uint64_t shard_id, grpc::ByteBuffer* buffer, uint64_t* foreign) {
    v1::GetJobResponse resp;
    grpc::ProtoBufferReader reader(buffer);
    if (!resp.ParseFromZeroCopyStream(&reader)) return Held();
    Held out;
    out.epoch = resp.map().epoch();
    for (const v1::ChunkPlacement& p : resp.map().chunks()) {
      if (p.shard_id() == shard_id) {
        ++out.primary;
        if (p.backup_shard_id() != 0) ++out.replicated;
      } else if (p.backup_shard_id() == shard_id) {
        ++out.backup;
      } else {
        ++*foreign;
      }
    }
    return out;
  }

  const Options options_;
  std::vector<std::unique_ptr<v1::Coordinator::Stub>> stubs_;
  std::vector<std::unique_ptr<JobStub>> generic_;
  absl::Mutex cache_mu_;
  std::map<std::pair<uint64_t, uint64_t>, std::shared_ptr<const ParsedMap>> maps_
      ABSL_GUARDED_BY(cache_mu_);
  grpc::CompletionQueue cq_;
  std::vector<std::thread> cq_threads_;
  std::thread scheduler_;

  mutable absl::Mutex mu_;
  std::vector<Shard> shards_ ABSL_GUARDED_BY(mu_);
  std::priority_queue<Due, std::vector<Due>, std::greater<Due>> due_ ABSL_GUARDED_BY(mu_);
  std::priority_queue<Refetch, std::vector<Refetch>, std::greater<Refetch>> refetch_
      ABSL_GUARDED_BY(mu_);
  absl::Duration interval_ ABSL_GUARDED_BY(mu_) = absl::Milliseconds(667);
  int registering_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t registrations_made_ ABSL_GUARDED_BY(mu_) = 0;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  Counters counters_ ABSL_GUARDED_BY(mu_);
};

// ---- The coordinator process ----

struct ProcStats {
  double cpu_s = 0;
  double rss_mb = 0;
  double peak_rss_mb = 0;
  int threads = 0;
};

ProcStats ReadProcStats(pid_t pid) {
  ProcStats p;
  const std::string stat = ReadFile(absl::StrCat("/proc/", pid, "/stat"));
  // Fields after the command's closing parenthesis: state is field 3;
  // utime and stime are fields 14 and 15.
  const size_t close = stat.rfind(')');
  if (close != std::string::npos) {
    std::vector<std::string> f = absl::StrSplit(stat.substr(close + 2), ' ');
    uint64_t ut = 0, st = 0;
    if (f.size() > 13 && absl::SimpleAtoi(f[11], &ut) && absl::SimpleAtoi(f[12], &st)) {
      p.cpu_s = static_cast<double>(ut + st) / static_cast<double>(sysconf(_SC_CLK_TCK));
    }
  }
  for (absl::string_view line : absl::StrSplit(ReadFile(absl::StrCat("/proc/", pid, "/status")),
                                               '\n')) {
    auto value = [&](absl::string_view key) -> int64_t {
      if (!absl::ConsumePrefix(&line, key)) return -1;
      int64_t v = 0;
      std::vector<absl::string_view> w = absl::StrSplit(line, ' ', absl::SkipWhitespace());
      if (w.empty() || !absl::SimpleAtoi(w[0], &v)) return -1;
      return v;
    };
    if (int64_t v = value("VmRSS:"); v >= 0) p.rss_mb = static_cast<double>(v) / 1024;
    if (int64_t v = value("VmHWM:"); v >= 0) p.peak_rss_mb = static_cast<double>(v) / 1024;
    if (int64_t v = value("Threads:"); v >= 0) p.threads = static_cast<int>(v);
  }
  return p;
}

// The most threads the coordinator had, sampled every 100 ms.
class ThreadSampler {
 public:
  explicit ThreadSampler(pid_t pid) : pid_(pid), thread_([this] { Loop(); }) {}
  ~ThreadSampler() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }
  int peak() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return peak_;
  }

 private:
  bool Stopped() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; }
  void Loop() ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      peak_ = std::max(peak_, ReadProcStats(pid_).threads);
      mu_.AwaitWithTimeout(absl::Condition(this, &ThreadSampler::Stopped),
                           absl::Milliseconds(100));
    }
  }

  const pid_t pid_;
  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int peak_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

// Calls Status (admin, plain text) with a deadline.
absl::StatusOr<v1::StatusResponse> GetStatus(v1::Coordinator::Stub* stub,
                                             const v1::StatusRequest& req, absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(DeadlineIn(timeout));
  v1::StatusResponse resp;
  grpc::Status s = stub->Status(&ctx, req, &resp);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("Status: ", s.error_message()));
  return resp;
}

// Polls `done` on the coordinator's status every `every` until it says
// true or `timeout` passes; the time it took, or an error saying why not.
absl::StatusOr<absl::Duration> WaitFor(
    v1::Coordinator::Stub* stub, const v1::StatusRequest& req, absl::Time since,
    absl::Duration timeout, absl::Duration every,
    const std::function<bool(const v1::StatusResponse&, std::string* why)>& done) {
  const absl::Time give_up = absl::Now() + timeout;
  std::string why = "no answer";
  for (;;) {
    const absl::Time asked = absl::Now();
    absl::StatusOr<v1::StatusResponse> st =
        GetStatus(stub, req, std::max(absl::Seconds(1), give_up - asked));
    if (st.ok()) {
      if (done(*st, &why)) return asked - since;
    } else {
      why = std::string(st.status().message());
    }
    if (absl::Now() >= give_up) {
      return absl::DeadlineExceededError(
          absl::StrCat("not after ", Seconds(absl::Now() - since), " s (", why, ")"));
    }
    absl::SleepFor(every);
  }
}

// Status of the DOWN shards only (the coordinator filters).
v1::StatusRequest DownShards() {
  v1::StatusRequest req;
  req.add_shard_states(v1::SHARD_STATE_DOWN);
  return req;
}

// The jobs, with at most one shard: a small answer at any N.
v1::StatusRequest JobsOnly() {
  v1::StatusRequest req = DownShards();
  req.set_page_size(1);
  return req;
}

const v1::JobStatus* FindJob(const v1::StatusResponse& st, uint64_t job_id) {
  for (const v1::JobStatus& j : st.jobs()) {
    if (j.job_id() == job_id) return &j;
  }
  return nullptr;
}

struct RunOptions {
  std::string coord_path;
  std::string work_dir;
  bool pin = true;
  absl::Duration lease;
  absl::Duration steady;
  absl::Duration ready_timeout;
  double kill_fraction = 0.01;
  int shards_per_domain = 256;
  bool kill_spread = false;
  int channels = 64;
  int threads = 2;
  int address_bytes = 300;
  bool per_shard_maps = true;
  bool state_dir = false;
  std::vector<std::string> coord_flags;
  std::vector<BenchJob> jobs;
};

Json RunOne(const RunOptions& o, int n) {
  Json line{{"bench", "control_plane"}, {"shards", n}};
  std::vector<std::string> errors;
  const std::string port_file = absl::StrCat(o.work_dir, "/coord-", n, ".port");
  unlink(port_file.c_str());
  std::vector<std::string> args = {
      o.coord_path, "--listen=127.0.0.1:0", "--port_file=" + port_file,
      absl::StrCat("--lease_ms=", absl::ToInt64Milliseconds(o.lease)), "--insecure_plaintext",
      "--down_shard_grace=inf"};
  if (o.state_dir) args.push_back(absl::StrCat("--state_dir=", o.work_dir, "/state-", n));
  for (const std::string& f : o.coord_flags) args.push_back(f);
  args = PinnedTo(o.pin ? "0" : "", std::move(args));
  line["state_dir"] = o.state_dir;
  const std::string log = absl::StrCat(o.work_dir, "/coord-", n, ".log");
  line["coordinator"] = ShellLine({}, args);
  line["coordinator_pinned"] = o.pin;
  line["lease_ms"] = absl::ToInt64Milliseconds(o.lease);
  const pid_t coord = Spawn({}, args, log);
  if (coord < 0) Die(kWho, "cannot start optimus-coord");
  std::string port;
  for (int i = 0; i < 500 && port.empty(); ++i) {
    port = ReadFile(port_file);
    while (!port.empty() && (port.back() == '\n' || port.back() == ' ')) port.pop_back();
    if (port.empty()) absl::SleepFor(absl::Milliseconds(20));
  }
  if (port.empty()) Die(kWho, "optimus-coord did not start:\n" + Tail(log));
  const std::string addr = "127.0.0.1:" + port;
  ThreadSampler sampler(coord);

  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < std::max(1, o.channels); ++i) {
    grpc::ChannelArguments ca = LimitedChannelArgs();
    ca.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // A connection of its own.
    ca.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    ca.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
    channels.push_back(grpc::CreateCustomChannel(addr, grpc::InsecureChannelCredentials(), ca));
  }
  auto admin = v1::Coordinator::NewStub(
      CreateLimitedChannel(addr, grpc::InsecureChannelCredentials()));

  // Enough memory for the largest job (with its backups) over the shards
  // twice over: placement is what is measured, not a shortage.
  uint64_t most = 0;
  for (const BenchJob& j : o.jobs) most = std::max(most, j.num_params() * (j.replication + 1));
  Simulator::Options so;
  so.num_shards = n;
  so.threads = o.threads;
  so.address_bytes = o.address_bytes;
  so.per_shard_maps = o.per_shard_maps;
  so.shards_per_domain = o.shards_per_domain;
  line["shards_per_domain"] = o.shards_per_domain;
  line["kill"] = o.kill_spread ? "spread" : "domain";
  so.memory_limit_bytes =
      std::max<uint64_t>(uint64_t{64} << 30, most * 48 * 2 / static_cast<uint64_t>(n));
  Simulator sim(so, channels);
  sim.set_lease(o.lease);
  const absl::Time t0 = absl::Now();
  sim.Start();

  // Registration.
  const absl::Duration reg_timeout = absl::Seconds(60) + absl::Milliseconds(5) * n;
  while (sim.Registered() < n && absl::Now() - t0 < reg_timeout) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  const absl::Time registered_at = absl::Now();
  if (sim.Registered() < n) {
    errors.push_back(absl::StrCat("registration: ", sim.Registered(), " of ", n,
                                  " shards registered in ", Seconds(reg_timeout), " s (",
                                  sim.counters().last_error, ")"));
  } else {
    line["register_s"] = JsonRound(Seconds(registered_at - t0), 3);
  }

  // Heartbeats alone.
  const size_t steady_from = sim.HeartbeatsAnswered();
  absl::SleepFor(o.steady);
  const size_t jobs_from = sim.HeartbeatsAnswered();
  std::set<uint64_t> killed;
  auto false_down = [&](const v1::StatusResponse& st) {
    int n_down = 0;
    for (const v1::ShardStatus& s : st.shards()) {
      n_down += s.state() == v1::SHARD_STATE_DOWN && killed.count(s.shard_id()) == 0;
    }
    return n_down;
  };
  if (absl::StatusOr<v1::StatusResponse> st =
          GetStatus(admin.get(), DownShards(), absl::Seconds(30));
      st.ok()) {
    line["false_down_steady"] = false_down(*st);
  } else {
    errors.push_back(absl::StrCat("status after the steady phase: ", st.status().message()));
  }

  // Jobs.
  Json jobs = Json::array();
  uint64_t kept_job = 0;
  v1::ShardMap kept_map;  // The kept job's map when it was created.
  for (const BenchJob& j : o.jobs) {
    Json jl{{"name", j.name}, {"params", j.num_params()}, {"replication", j.replication}};
    const absl::Time start = absl::Now();
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineIn(o.ready_timeout));
    v1::CreateJobResponse created;
    const grpc::Status s = admin->CreateJob(&ctx, JobRequest(j), &created);
    const absl::Time create_done = absl::Now();
    if (!s.ok()) {
      errors.push_back(absl::StrCat("job ", j.key, ": CreateJob failed after ",
                                    Seconds(create_done - start), " s: ", s.error_message()));
      jl["state"] = "not_created";
      jobs.push_back(jl);
      continue;
    }
    const uint64_t job_id = created.job_id();
    jl["chunks"] = created.map().chunks_size();
    jl["create_s"] = JsonRound(Seconds(create_done - start), 3);
    std::string final_state = "unknown";
    absl::StatusOr<absl::Duration> ready = WaitFor(
        admin.get(), JobsOnly(), start,
        std::max(absl::Seconds(1), o.ready_timeout - (create_done - start)),
        absl::Milliseconds(200), [&](const v1::StatusResponse& st, std::string* why) {
          const v1::JobStatus* js = FindJob(st, job_id);
          if (js == nullptr) {
            *why = "the job is gone";
            final_state = "gone";
            return false;
          }
          final_state = v1::JobState_Name(js->state());
          *why = absl::StrCat("state ", final_state);
          return js->state() == v1::JOB_STATE_READY || js->state() == v1::JOB_STATE_FAILED;
        });
    jl["state"] = final_state;
    if (ready.ok() && final_state == "JOB_STATE_READY") {
      jl["ready_s"] = JsonRound(Seconds(*ready), 3);
    } else {
      errors.push_back(absl::StrCat("job ", j.key, ": not READY: ",
                                    ready.ok() ? final_state : std::string(ready.status().message())));
    }
    jobs.push_back(jl);
    if (j.key == "large" && ready.ok() && final_state == "JOB_STATE_READY") {
      kept_job = job_id;
      kept_map = created.map();
      continue;
    }
    grpc::ClientContext dctx;
    dctx.set_deadline(DeadlineIn(absl::Seconds(30)));
    v1::DeleteJobRequest del;
    del.set_job_name(j.name);
    del.set_force(true);
    v1::DeleteJobResponse deleted;
    if (grpc::Status ds = admin->DeleteJob(&dctx, del, &deleted); !ds.ok()) {
      errors.push_back(absl::StrCat("job ", j.key, ": DeleteJob: ", ds.error_message()));
    }
  }
  line["jobs"] = jobs;

  const size_t jobs_to = sim.HeartbeatsAnswered();
  std::optional<Counters> at_kill;  // Taken as the shards are killed.
  size_t kill_to = jobs_to;         // Heartbeats answered once the map moved.

  // Kill 1%.
  {
    const size_t k = std::max<size_t>(1, static_cast<size_t>(o.kill_fraction * n + 0.5));
    std::vector<size_t> idx;
    // Spread: independent failures, evenly over the shards. Domain: the
    // first k shards, which fill failure domain 0 (then 1, ...): what a
    // rack losing power or its switch does; replication 1 places every
    // backup outside its primary's domain, so no chunk loses both copies
    // while k is at most a domain.
    for (size_t i = 0; i < k; ++i) idx.push_back(o.kill_spread ? i * static_cast<size_t>(n) / k : i);
    uint64_t epoch_before = 0;
    if (kept_job != 0) {
      if (auto st = GetStatus(admin.get(), JobsOnly(), absl::Seconds(30)); st.ok()) {
        if (const v1::JobStatus* js = FindJob(*st, kept_job)) epoch_before = js->map_epoch();
      }
    }
    const absl::Time kill_at = absl::Now();
    at_kill = sim.counters();
    for (uint64_t id : sim.Kill(idx)) {
      if (id != 0) killed.insert(id);
    }
    line["killed"] = k;
    // Chunks of the kept job whose primary and backup were both killed:
    // replication 1 cannot fail those over (the job rolls back or fails,
    // as it must), so a FAILED job with this above 0 is the placement's
    // odds, not the coordinator's doing.
    if (kept_job != 0) {
      int both = 0;
      for (const v1::ChunkPlacement& c : kept_map.chunks()) {
        both += killed.count(c.shard_id()) != 0 && killed.count(c.backup_shard_id()) != 0;
      }
      line["chunks_with_both_holders_killed"] = both;
    }
    // Shards the coordinator had declared DOWN already (wrongly) before
    // they were killed: their time to DOWN says nothing.
    if (auto st = GetStatus(admin.get(), DownShards(), absl::Seconds(30)); st.ok()) {
      int already = 0;
      for (const v1::ShardStatus& s : st->shards()) already += killed.count(s.shard_id()) != 0;
      line["killed_already_down"] = already;
    }
    absl::StatusOr<absl::Duration> down = WaitFor(
        admin.get(), DownShards(), kill_at, o.lease + absl::Seconds(30),
        absl::Milliseconds(100), [&](const v1::StatusResponse& st, std::string* why) {
          size_t n_down = 0;
          for (const v1::ShardStatus& s : st.shards()) {
            n_down += killed.count(s.shard_id()) != 0 && s.state() == v1::SHARD_STATE_DOWN;
          }
          *why = absl::StrCat(n_down, " of ", killed.size(), " DOWN");
          return n_down == killed.size();
        });
    if (down.ok()) {
      line["killed_down_s"] = JsonRound(Seconds(*down), 3);
    } else {
      errors.push_back(absl::StrCat("killed shards DOWN: ", down.status().message()));
    }
    if (kept_job != 0) {
      std::string state;
      absl::StatusOr<absl::Duration> moved = WaitFor(
          admin.get(), JobsOnly(), kill_at, o.lease + absl::Seconds(30),
          absl::Milliseconds(100), [&](const v1::StatusResponse& st, std::string* why) {
            const v1::JobStatus* js = FindJob(st, kept_job);
            if (js == nullptr) return false;
            state = v1::JobState_Name(js->state());
            *why = absl::StrCat("epoch ", js->map_epoch(), ", ", state);
            return js->map_epoch() > epoch_before || js->state() == v1::JOB_STATE_FAILED;
          });
      line["failover_job_state"] = state;
      // Until the holders of the new epoch had a beat to take it.
      absl::SleepFor(o.lease);
      // What each worker of the job reads once the map moved: the whole
      // map, or (GetJobRequest.known_epoch) the delta from the epoch it
      // held, without the spec.
      if (moved.ok()) {
        for (const uint64_t known : {uint64_t{0}, epoch_before}) {
          grpc::ClientContext gctx;
          gctx.set_deadline(DeadlineIn(absl::Seconds(30)));
          v1::GetJobRequest req;
          req.set_job_id(kept_job);
          req.set_known_epoch(known);
          v1::GetJobResponse got;
          if (grpc::Status gs = admin->GetJob(&gctx, req, &got); !gs.ok()) {
            errors.push_back(absl::StrCat("worker GetJob (known_epoch ", known,
                                          "): ", gs.error_message()));
            continue;
          }
          const double kb = JsonRound(static_cast<double>(got.ByteSizeLong()) / 1024.0, 1);
          if (known == 0) {
            line["worker_map_kb"] = kb;
          } else {
            line["worker_delta_kb"] = kb;
            line["worker_delta_chunks"] = got.map().chunks_size();
            line["worker_delta_from"] = got.map_delta_from();
          }
        }
      }
      if (moved.ok()) {
        line["failover_s"] = JsonRound(Seconds(*moved), 3);
      } else {
        errors.push_back(absl::StrCat("failover: ", moved.status().message()));
      }
    }
  }

  kill_to = sim.HeartbeatsAnswered();

  // Status in pages of 1000 (what optimusctl does), and the DOWN shards
  // alone (shard list --state=down).
  {
    const absl::Time start = absl::Now();
    v1::StatusRequest req;
    req.set_page_size(1000);
    int pages = 0;
    std::string why;
    for (;;) {
      absl::StatusOr<v1::StatusResponse> st = GetStatus(admin.get(), req, absl::Seconds(60));
      if (!st.ok()) {
        why = std::string(st.status().message());
        break;
      }
      ++pages;
      if (st->next_page_token().empty()) break;
      req.set_page_token(st->next_page_token());
    }
    if (why.empty()) {
      line["status_paged_s"] = JsonRound(Seconds(absl::Now() - start), 4);
      line["status_pages"] = pages;
    } else {
      errors.push_back(absl::StrCat("status in pages: ", why));
    }
    const absl::Time down_start = absl::Now();
    if (auto st = GetStatus(admin.get(), DownShards(), absl::Seconds(60)); st.ok()) {
      line["status_down_s"] = JsonRound(Seconds(absl::Now() - down_start), 4);
    } else {
      errors.push_back(absl::StrCat("status of the DOWN shards: ", st.status().message()));
    }
  }

  // One full Status call.
  {
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::StatusResponse> st =
        GetStatus(admin.get(), v1::StatusRequest(), absl::Seconds(60));
    if (st.ok()) {
      line["status_s"] = JsonRound(Seconds(absl::Now() - start), 4);
      line["status_bytes"] = st->ByteSizeLong();
      line["false_down"] = false_down(*st);
    } else {
      errors.push_back(absl::StrCat("status: ", st.status().message()));
    }
  }

  const absl::Time end = absl::Now();
  const Counters c = sim.counters();
  const double measured_s = Seconds(end - registered_at);
  line["heartbeats_per_s_needed"] =
      JsonRound(static_cast<double>(n) * 3.0 / Seconds(o.lease), 1);
  line["heartbeats_per_s_served"] =
      JsonRound(static_cast<double>(c.heartbeats_ok) / std::max(measured_s, 1e-9), 1);
  line["heartbeat_p50_ms"] = JsonRound(Percentile(c.heartbeat_ms, 0.5), 2);
  line["heartbeat_p99_ms"] = JsonRound(Percentile(c.heartbeat_ms, 0.99), 2);
  line["heartbeat_max_ms"] =
      JsonRound(c.heartbeat_ms.empty()
                    ? 0.0
                    : *std::max_element(c.heartbeat_ms.begin(), c.heartbeat_ms.end()),
                2);
  // The same over the steady phase alone, and over the jobs' creation and
  // loading (map fetches compete with heartbeats for the coordinator).
  const auto slice = [&](size_t from, size_t to) {
    to = std::min(to, c.heartbeat_ms.size());
    return std::vector<float>(c.heartbeat_ms.begin() + static_cast<std::ptrdiff_t>(std::min(from, to)),
                              c.heartbeat_ms.begin() + static_cast<std::ptrdiff_t>(to));
  };
  const std::vector<float> steady_ms = slice(steady_from, jobs_from);
  line["steady_heartbeat_p99_ms"] = JsonRound(Percentile(steady_ms, 0.99), 2);
  const std::vector<float> jobs_ms = slice(jobs_from, jobs_to);
  line["jobs_heartbeat_p99_ms"] = JsonRound(Percentile(jobs_ms, 0.99), 2);
  // From the kill to a lease after the map moved: the failover's epoch.
  const std::vector<float> kill_ms = slice(jobs_to, kill_to);
  line["kill_heartbeat_p99_ms"] = JsonRound(Percentile(kill_ms, 0.99), 2);
  line["heartbeat_errors"] = c.heartbeat_errors;
  line["told_to_register"] = c.told_to_register;
  line["map_fetches"] = c.fetches_ok;
  line["map_fetch_errors"] = c.fetch_errors;
  line["map_fetches_refused_busy"] = c.fetches_refused;
  line["map_load_p50_ms"] = JsonRound(Percentile(c.fetch_load_ms, 0.5), 2);
  line["map_load_p99_ms"] = JsonRound(Percentile(c.fetch_load_ms, 0.99), 2);
  line["map_fetch_p50_ms"] = JsonRound(Percentile(c.fetch_ms, 0.5), 2);
  line["map_fetch_p99_ms"] = JsonRound(Percentile(c.fetch_ms, 0.99), 2);
  line["per_shard_maps"] = o.per_shard_maps;
  line["map_fetch_mb"] = JsonRound(static_cast<double>(c.fetch_bytes) / (1 << 20), 2);
  line["map_fetch_kb_mean"] =
      JsonRound(c.fetches_ok == 0 ? 0.0
                                  : static_cast<double>(c.fetch_bytes) / 1024.0 /
                                        static_cast<double>(c.fetches_ok),
                2);
  line["map_fetch_foreign_chunks"] = c.foreign_chunks;
  line["map_epochs_taken_unchanged"] = c.epochs_unchanged;
  line["map_fetches_given_a_later_slot"] = c.fetches_delayed;
  if (at_kill.has_value()) {
    // What the failover's new epoch cost: only the shards whose part it
    // changed should fetch.
    line["map_fetches_since_kill"] = c.fetches_ok - at_kill->fetches_ok;
    line["map_epochs_unchanged_since_kill"] = c.epochs_unchanged - at_kill->epochs_unchanged;
  }
  int wstatus = 0;
  const bool exited = waitpid(coord, &wstatus, WNOHANG) == coord;
  if (exited) {
    errors.push_back(absl::StrCat("optimus-coord exited (",
                                  WIFSIGNALED(wstatus) ? absl::StrCat("signal ", WTERMSIG(wstatus))
                                                       : absl::StrCat("status ", WEXITSTATUS(wstatus)),
                                  "): ", Tail(log)));
  } else {
    const ProcStats p = ReadProcStats(coord);
    line["coord_cpu_s"] = JsonRound(p.cpu_s, 2);
    line["coord_cpu_share"] = JsonRound(p.cpu_s / std::max(Seconds(end - t0), 1e-9), 3);
    line["coord_rss_mb"] = JsonRound(p.rss_mb, 1);
    line["coord_peak_rss_mb"] = JsonRound(p.peak_rss_mb, 1);
    line["coord_threads"] = p.threads;
  }
  line["coord_peak_threads"] = sampler.peak();
  line["duration_s"] = JsonRound(Seconds(end - t0), 1);
  if (!errors.empty()) line["error"] = absl::StrJoin(errors, "; ");
  sim.Stop();
  if (!exited) Stop(coord);
  return line;
}

}  // namespace
}  // namespace bench
}  // namespace optimus

int main(int argc, char** argv) {
  using namespace optimus::bench;  // NOLINT
  absl::ParseCommandLine(argc, argv);
  // As optimus-coord: without absl::Mutex's deadlock detector, whose lock
  // graph would cost the simulated shards' core a tenth of its time.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  KillChildrenOnSignals();
  FILE* json = TakeStdoutForJson();
  if (json == nullptr) Die(kWho, "cannot duplicate stdout");

  RunOptions o;
  const std::string root =
      FindBinRoot(argv[0], absl::GetFlag(FLAGS_bin_dir), {"coordinator/optimus-coord"});
  o.coord_path = root.empty() ? "" : root + "/coordinator/optimus-coord";
  if (o.coord_path.empty()) {
    Die(kWho, "coordinator/optimus-coord not found (bazel run //bench:control_plane, or "
              "--bin_dir=bazel-bin)");
  }
  absl::StatusOr<std::string> wd = MakeWorkDir(absl::GetFlag(FLAGS_work_dir), "control-plane");
  if (!wd.ok()) Die(kWho, std::string(wd.status().message()));
  o.work_dir = *wd;
  std::vector<int> ns;
  for (absl::string_view s : absl::StrSplit(absl::GetFlag(FLAGS_shards), ',', absl::SkipEmpty())) {
    int n = 0;
    if (!absl::SimpleAtoi(s, &n) || n < 1) {
      Die(kWho, absl::StrCat("--shards: \"", s, "\" is not a positive number of shards"));
    }
    ns.push_back(n);
  }
  if (ns.empty()) Die(kWho, "--shards names no number of shards");
  for (absl::string_view k : absl::StrSplit(absl::GetFlag(FLAGS_jobs), ',', absl::SkipEmpty())) {
    absl::StatusOr<BenchJob> j = optimus::bench::MakeJob(std::string(k));
    if (!j.ok()) Die(kWho, std::string(j.status().message()));
    o.jobs.push_back(*std::move(j));
  }
  const int lease_ms = absl::GetFlag(FLAGS_lease_ms);
  if (lease_ms < 100) Die(kWho, "--lease_ms must be at least 100");
  o.lease = absl::Milliseconds(lease_ms);
  for (absl::string_view f : absl::StrSplit(absl::GetFlag(FLAGS_coord_flags), ',', absl::SkipEmpty())) {
    o.coord_flags.emplace_back(f);
  }
  o.steady = absl::Seconds(std::max(0.0, absl::GetFlag(FLAGS_steady_s)));
  o.ready_timeout = absl::Seconds(std::max(1.0, absl::GetFlag(FLAGS_ready_timeout_s)));
  o.kill_fraction = absl::GetFlag(FLAGS_kill_fraction);
  o.shards_per_domain = absl::GetFlag(FLAGS_shards_per_domain);
  if (o.shards_per_domain < 0) Die(kWho, "--shards_per_domain must be 0 or more");
  const std::string kill = absl::GetFlag(FLAGS_kill);
  if (kill != "domain" && kill != "spread") Die(kWho, "--kill must be domain or spread");
  o.kill_spread = kill == "spread";
  if (!(o.kill_fraction > 0 && o.kill_fraction < 1)) Die(kWho, "--kill_fraction must be in (0, 1)");
  o.channels = std::max(1, absl::GetFlag(FLAGS_channels));
  o.threads = std::max(1, absl::GetFlag(FLAGS_threads));
  o.address_bytes = std::max(1, absl::GetFlag(FLAGS_address_bytes));
  o.per_shard_maps = absl::GetFlag(FLAGS_per_shard_maps);
  o.state_dir = absl::GetFlag(FLAGS_state_dir);

  // The coordinator on CPU 0, this process on the others.
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  o.pin = absl::GetFlag(FLAGS_pin) && cpus >= 2 && (Exists("/usr/bin/taskset") ||
                                                   Exists("/bin/taskset"));
  if (o.pin) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (long c = 1; c < cpus && c < CPU_SETSIZE; ++c) CPU_SET(c, &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) o.pin = false;
  }
  for (int n : ns) {
    const optimus::Json line = RunOne(o, n);
    std::fprintf(json, "%s\n", optimus::JsonDump(line).c_str());
    std::fflush(json);
  }
  return 0;
}
