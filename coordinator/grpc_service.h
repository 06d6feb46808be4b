// The Coordinator gRPC service (proto/optimus.proto): converts each call
// to the core's method and its absl::Status to a grpc::Status, counts the
// errors it answers, and does nothing else.
//
// Borrows the core, which must outlive it. Thread-safe (gRPC calls it from
// its threads).
#ifndef OPTIMUS_COORDINATOR_GRPC_SERVICE_H_
#define OPTIMUS_COORDINATOR_GRPC_SERVICE_H_

#include <array>
#include <atomic>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "common/security.h"
#include "coordinator/coordinator_core.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {

class CoordinatorService final : public v1::Coordinator::Service {
 public:
  // `plaintext`: the server runs without TLS, and so without authorization
  // (every caller is an admin). Otherwise each call is checked against the
  // caller's role and job token (common/security.h).
  CoordinatorService(Coordinator* core, bool plaintext) : core_(core), plaintext_(plaintext) {}

  // Errors answered so far, by absl::StatusCode value (index 0 unused).
  std::vector<uint64_t> errors() const;

  grpc::Status RegisterShard(grpc::ServerContext*, const v1::RegisterShardRequest* req,
                             v1::RegisterShardResponse* resp) override;
  grpc::Status Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
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

  security::Caller Identify(grpc::ServerContext* ctx) const;
  // PERMISSION_DENIED (UNAUTHENTICATED for a caller with no certificate and
  // no token), counted and logged.
  grpc::Status Refuse(const security::Caller& c, absl::string_view rpc, absl::string_view needs);
  bool MayReadJob(const security::Caller& c, uint64_t job_id);
  // `unknown_ok`: a caller with a token may ask about a name no job has.
  bool MayUseJobNamed(const security::Caller& c, const std::string& name, bool unknown_ok);

  Coordinator* const core_;
  const bool plaintext_;
  std::array<std::atomic<uint64_t>, kNumCodes> errors_{};
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_GRPC_SERVICE_H_
