// The Coordinator gRPC service (proto/optimus.proto): converts each call
// to the core's method and its absl::Status to a grpc::Status, counts the
// errors it answers, and does nothing else. Heartbeat is served on gRPC's
// callback API (it never blocks for long: see Coordinator::Heartbeat), so
// it needs none of the server's capped threads; the other methods are
// synchronous. A call whose client already gave up (cancelled, or past its
// deadline) is dropped, answered CANCELLED, before the core does its work
// (and, for RegisterShard and CreateJob, once more after they got the
// tables). At most `max_watchers` WatchShardMap streams run at a time.
//
// Borrows the core, which must outlive it. Thread-safe (gRPC calls it from
// its threads).
#ifndef OPTIMUS_COORDINATOR_GRPC_SERVICE_H_
#define OPTIMUS_COORDINATOR_GRPC_SERVICE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/security.h"
#include "coordinator/coordinator_core.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {

class CoordinatorService final
    : public v1::Coordinator::WithCallbackMethod_Heartbeat<v1::Coordinator::Service> {
 public:
  // `plaintext`: the server runs without TLS, and so without authorization
  // (every caller is an admin). Otherwise each call is checked against the
  // caller's role and job token (common/security.h). `max_watchers`: most
  // WatchShardMap streams at a time (each holds a server thread); beyond,
  // a watch is refused with RESOURCE_EXHAUSTED. `max_map_reads`: most
  // GetJob / GetShardMap calls served at once; beyond, one is refused at
  // once with RESOURCE_EXHAUSTED, saying when to retry.
  // `while_reading_map`: CoordinatorOptions::while_reading_map (tests).
  CoordinatorService(Coordinator* core, bool plaintext, int max_watchers = 1 << 20,
                     int max_map_reads = 1 << 20,
                     std::function<void()> while_reading_map = nullptr)
      : core_(core),
        plaintext_(plaintext),
        max_watchers_(max_watchers),
        max_map_reads_(max_map_reads),
        while_reading_map_(std::move(while_reading_map)) {}

  // Errors answered so far, by absl::StatusCode value (index 0 unused).
  std::vector<uint64_t> errors() const;
  // Calls dropped because their client had given up (also counted in
  // errors() as CANCELLED).
  uint64_t dropped() const { return dropped_.load(); }
  // WatchShardMap streams open now.
  int watchers() const { return watchers_.load(); }
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
  grpc::Status GetJob(grpc::ServerContext*, const v1::GetJobRequest* req,
                      v1::GetJobResponse* resp) override;
  grpc::Status GetShardMap(grpc::ServerContext*, const v1::GetShardMapRequest* req,
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
  // Lowers the calling (synchronous) thread's priority to kSyncCallNice,
  // once: hundreds of threads serializing big maps for a storm of fetches
  // would otherwise take the coordinator's core from the few callback
  // threads that renew leases, and live shards would be declared DOWN.
  static void RunBelowHeartbeats();
  static constexpr int kSyncCallNice = 19;
  // A slot among the max_map_reads map reads served at once, held for its
  // scope; held() is false when none was free (nothing is held then).
  class MapReadSlot {
   public:
    explicit MapReadSlot(CoordinatorService* s)
        : n_(&s->map_reads_), held_(n_->fetch_add(1) < s->max_map_reads_) {
      if (!held_) n_->fetch_sub(1);
    }
    ~MapReadSlot() {
      if (held_) n_->fetch_sub(1);
    }
    MapReadSlot(const MapReadSlot&) = delete;
    MapReadSlot& operator=(const MapReadSlot&) = delete;
    bool held() const { return held_; }

   private:
    std::atomic<int>* const n_;
    const bool held_;
  };
  // Counts a map read refused for want of a slot and answers it
  // RESOURCE_EXHAUSTED with when to retry.
  grpc::Status MapReadsBusy(grpc::ServerContext* ctx, absl::string_view rpc);
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
  const std::function<void()> while_reading_map_;
  std::array<std::atomic<uint64_t>, kNumCodes> errors_{};
  std::atomic<uint64_t> dropped_{0};
  std::atomic<int> watchers_{0};
  std::atomic<int> map_reads_{0};
  std::atomic<uint64_t> map_reads_refused_{0};
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_GRPC_SERVICE_H_
