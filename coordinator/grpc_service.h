// The Coordinator gRPC service (proto/optimus.proto): converts each call
// to the core's method and its absl::Status to a grpc::Status, counts the
// errors it answers, and does nothing else. Heartbeat is served on gRPC's
// callback API (it never blocks for long: see Coordinator::Heartbeat), so
// it needs none of the server's capped threads. GetJob and GetShardMap
// (the map reads) are callback methods too: a read is admitted on the
// callback thread when fewer than max_map_reads + max_queued_map_reads are
// admitted already (else refused at once with RESOURCE_EXHAUSTED), waits
// in arrival order, and runs on one of the service's own map-reader
// threads (min(max_map_reads, 32), at low priority), so that a storm of
// fetches takes none of the server's synchronous threads from Status,
// CreateJob and the other methods, which are synchronous, and costs one
// call per fetch instead of a refusal and retries for most of them. A call
// whose client already gave up (cancelled, or past its
// deadline) is dropped, answered CANCELLED, before the core does its work
// (and, for RegisterShard and CreateJob, once more after they got the
// tables). At most `max_watchers` WatchShardMap streams run at a time.
//
// Borrows the core, which must outlive it. Thread-safe (gRPC calls it from
// its threads).
#ifndef OPTIMUS_COORDINATOR_GRPC_SERVICE_H_
#define OPTIMUS_COORDINATOR_GRPC_SERVICE_H_

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "common/security.h"
#include "coordinator/coordinator_core.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {

class CoordinatorService final
    : public v1::Coordinator::WithCallbackMethod_Heartbeat<
          v1::Coordinator::WithCallbackMethod_GetJob<
              v1::Coordinator::WithCallbackMethod_GetShardMap<v1::Coordinator::Service>>> {
 public:
  // `plaintext`: the server runs without TLS, and so without authorization
  // (every caller is an admin). Otherwise each call is checked against the
  // caller's role and job token (common/security.h). `max_watchers`: most
  // WatchShardMap streams at a time (each holds a server thread); beyond,
  // a watch is refused with RESOURCE_EXHAUSTED. `max_map_reads`: most
  // GetJob / GetShardMap calls served at once; `max_queued_map_reads`: how
  // many more may wait for a reader; past both a read is refused at once
  // with RESOURCE_EXHAUSTED, saying when to retry.
  // `while_reading_map`: CoordinatorOptions::while_reading_map (tests).
  CoordinatorService(Coordinator* core, bool plaintext, int max_watchers = 1 << 20,
                     int max_map_reads = 1 << 20,
                     std::function<void()> while_reading_map = nullptr,
                     int max_queued_map_reads = 0)
      : core_(core),
        plaintext_(plaintext),
        max_watchers_(max_watchers),
        max_map_reads_(max_map_reads),
        max_queued_map_reads_(max_queued_map_reads),
        while_reading_map_(std::move(while_reading_map)),
        map_readers_(std::min(max_map_reads, kMaxMapReaderThreads)) {}

  // Errors answered so far, by absl::StatusCode value (index 0 unused).
  std::vector<uint64_t> errors() const;
  // Calls dropped because their client had given up (also counted in
  // errors() as CANCELLED).
  uint64_t dropped() const { return dropped_.load(); }
  // WatchShardMap streams open now.
  int watchers() const { return watchers_.load(); }
  // Control calls on gRPC's synchronous threads being served now, those
  // waiting for the tables included (map watches are watchers()).
  int calls_in_progress() const { return calls_in_progress_.load(); }
  // Map reads refused for being past max_map_reads (also counted in
  // errors() as RESOURCE_EXHAUSTED).
  uint64_t map_reads_refused() const { return map_reads_refused_.load(); }
  // What a refused map read tells its caller to wait, at least, before it
  // retries (its message, and trailing metadata kRetryAfterKey in ms).
  static constexpr int kMapReadRetryAfterMs = 100;
  static constexpr char kRetryAfterKey[] = "optimus-retry-after-ms";

  grpc::Status RegisterShard(grpc::ServerContext*, const v1::RegisterShardRequest* req,
                             v1::RegisterShardResponse* resp) override;
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx,
                                      const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse* resp) override;
  grpc::Status CreateJob(grpc::ServerContext*, const v1::CreateJobRequest* req,
                         v1::CreateJobResponse* resp) override;
  grpc::Status JoinJob(grpc::ServerContext*, const v1::JoinJobRequest* req,
                       v1::JoinJobResponse* resp) override;
  grpc::Status LeaveJob(grpc::ServerContext*, const v1::LeaveJobRequest* req,
                        v1::LeaveJobResponse* resp) override;
  grpc::Status DeleteJob(grpc::ServerContext*, const v1::DeleteJobRequest* req,
                         v1::DeleteJobResponse* resp) override;
  grpc::ServerUnaryReactor* GetJob(grpc::CallbackServerContext* ctx,
                                   const v1::GetJobRequest* req,
                                   v1::GetJobResponse* resp) override;
  grpc::ServerUnaryReactor* GetShardMap(grpc::CallbackServerContext* ctx,
                                        const v1::GetShardMapRequest* req,
                                        v1::ShardMap* resp) override;
  // Streams the job's map each time its epoch goes up, until the client
  // cancels, the job fails or is deleted, or the coordinator shuts down.
  grpc::Status WatchShardMap(grpc::ServerContext* ctx, const v1::WatchShardMapRequest* req,
                             grpc::ServerWriter<v1::ShardMap>* writer) override;
  grpc::Status Status(grpc::ServerContext*, const v1::StatusRequest*,
                      v1::StatusResponse* resp) override;
  grpc::Status CreateCheckpoint(grpc::ServerContext*, const v1::CreateCheckpointRequest* req,
                                v1::CreateCheckpointResponse* resp) override;
  grpc::Status ListCheckpoints(grpc::ServerContext*, const v1::ListCheckpointsRequest* req,
                               v1::ListCheckpointsResponse* resp) override;
  grpc::Status RestoreCheckpoint(grpc::ServerContext*, const v1::RestoreCheckpointRequest* req,
                                 v1::RestoreCheckpointResponse* resp) override;
  grpc::Status DrainShard(grpc::ServerContext*, const v1::DrainShardRequest* req,
                          v1::DrainShardResponse* resp) override;
  grpc::Status ForgetShard(grpc::ServerContext*, const v1::ForgetShardRequest* req,
                           v1::ForgetShardResponse* resp) override;

 private:
  // absl::StatusCode values 0..16.
  static constexpr int kNumCodes = 17;

  template <typename T>
  grpc::Status Reply(absl::StatusOr<T> result, T* resp);

  security::Caller Identify(grpc::ServerContextBase* ctx) const;
  grpc::Status HeartbeatCall(grpc::ServerContextBase* ctx, const v1::HeartbeatRequest& req,
                             v1::HeartbeatResponse* resp);
  // GetJob and GetShardMap once admitted, on a map-reader thread.
  grpc::Status GetJobCall(grpc::ServerContextBase* ctx, const v1::GetJobRequest* req,
                          v1::GetJobResponse* resp);
  grpc::Status GetShardMapCall(grpc::ServerContextBase* ctx, const v1::GetShardMapRequest* req,
                               v1::ShardMap* resp);
  // Admits a map read (`rpc`) and has a map-reader thread run `serve` and
  // finish the call with its status, or refuses it at once (past the
  // admitted bound) or drops it (its client gave up before or while it
  // waited). Returns the call's reactor.
  grpc::ServerUnaryReactor* ReadMap(grpc::CallbackServerContext* ctx, absl::string_view rpc,
                                    std::function<grpc::Status()> serve);
  // Lowers the calling (synchronous) thread's priority to kSyncCallNice,
  // once: hundreds of threads serializing big maps for a storm of fetches
  // would otherwise take the coordinator's core from the few callback
  // threads that renew leases, and live shards would be declared DOWN.
  static void RunBelowHeartbeats();
  static constexpr int kSyncCallNice = 19;
  // Counts a map read refused for being past the admitted bound and
  // answers it RESOURCE_EXHAUSTED with when to retry.
  grpc::Status MapReadsBusy(grpc::ServerContextBase* ctx, absl::string_view rpc);
  // Threads that run admitted map reads, in arrival order, at low priority
  // (kSyncCallNice); started at construction, joined (after the queue ran
  // dry) at destruction.
  static constexpr int kMaxMapReaderThreads = 32;
  class Workers {
   public:
    explicit Workers(int n);
    ~Workers();
    Workers(const Workers&) = delete;
    Workers& operator=(const Workers&) = delete;
    void Run(std::function<void()> task) ABSL_LOCKS_EXCLUDED(mu_);

   private:
    bool HasWork() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !tasks_.empty(); }
    void Loop() ABSL_LOCKS_EXCLUDED(mu_);
    absl::Mutex mu_;
    std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
    bool stop_ ABSL_GUARDED_BY(mu_) = false;
    std::vector<std::thread> threads_;
  };
  // Held by each synchronous control call while it runs: lowers its
  // thread below heartbeats (RunBelowHeartbeats) and counts it in
  // calls_in_progress().
  class InProgress {
   public:
    explicit InProgress(CoordinatorService* s) : n_(&s->calls_in_progress_) {
      RunBelowHeartbeats();
      n_->fetch_add(1);
    }
    ~InProgress() { n_->fetch_sub(1); }
    InProgress(const InProgress&) = delete;
    InProgress& operator=(const InProgress&) = delete;

   private:
    std::atomic<int>* const n_;
  };
  // The client cancelled the call or its deadline passed.
  static bool Abandoned(const grpc::ServerContextBase& ctx);
  // Counts a call dropped for that and answers it CANCELLED.
  grpc::Status Dropped(absl::string_view rpc);
  // PERMISSION_DENIED (UNAUTHENTICATED for a caller with no certificate and
  // no token), counted and logged.
  grpc::Status Refuse(const security::Caller& c, absl::string_view rpc, absl::string_view needs);
  bool MayReadJob(const security::Caller& c, uint64_t job_id);
  // `unknown_ok`: a caller with a token may ask about a name no job has.
  bool MayUseJobNamed(const security::Caller& c, const std::string& name, bool unknown_ok);

  Coordinator* const core_;
  const bool plaintext_;
  const int max_watchers_;
  const int max_map_reads_;
  const int max_queued_map_reads_;
  const std::function<void()> while_reading_map_;
  std::array<std::atomic<uint64_t>, kNumCodes> errors_{};
  std::atomic<uint64_t> dropped_{0};
  std::atomic<int> watchers_{0};
  std::atomic<int> calls_in_progress_{0};
  std::atomic<int> map_reads_{0};  // Admitted: being served or waiting.
  std::atomic<uint64_t> map_reads_refused_{0};
  // Last member: its threads stop before the rest goes.
  Workers map_readers_;
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_GRPC_SERVICE_H_
