#include "coordinator/grpc_service.h"

#include <optional>
#include <utility>

#include "absl/time/time.h"
#include "common/grpc_status.h"

namespace optimus {

std::vector<uint64_t> CoordinatorService::errors() const {
  std::vector<uint64_t> out(kNumCodes);
  for (int c = 0; c < kNumCodes; ++c) out[c] = errors_[c].load();
  return out;
}

template <typename T>
grpc::Status CoordinatorService::Reply(absl::StatusOr<T> result, T* resp) {
  if (!result.ok()) {
    const int code = static_cast<int>(result.status().code());
    if (code > 0 && code < kNumCodes) errors_[code].fetch_add(1);
    return ToGrpc(result.status());
  }
  *resp = *std::move(result);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::RegisterShard(grpc::ServerContext*,
                                               const v1::RegisterShardRequest* req,
                                               v1::RegisterShardResponse* resp) {
  return Reply(core_->RegisterShard(*req), resp);
}

grpc::Status CoordinatorService::Heartbeat(grpc::ServerContext*, const v1::HeartbeatRequest* req,
                                           v1::HeartbeatResponse* resp) {
  *resp = core_->Heartbeat(*req);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::CreateJob(grpc::ServerContext*, const v1::CreateJobRequest* req,
                                           v1::CreateJobResponse* resp) {
  return Reply(core_->CreateJob(*req), resp);
}

grpc::Status CoordinatorService::JoinJob(grpc::ServerContext*, const v1::JoinJobRequest* req,
                                         v1::JoinJobResponse* resp) {
  return Reply(core_->JoinJob(*req), resp);
}

grpc::Status CoordinatorService::LeaveJob(grpc::ServerContext*, const v1::LeaveJobRequest* req,
                                          v1::LeaveJobResponse* resp) {
  return Reply(core_->LeaveJob(*req), resp);
}

grpc::Status CoordinatorService::DeleteJob(grpc::ServerContext*, const v1::DeleteJobRequest* req,
                                           v1::DeleteJobResponse* resp) {
  return Reply(core_->DeleteJob(*req), resp);
}

grpc::Status CoordinatorService::GetJob(grpc::ServerContext*, const v1::GetJobRequest* req,
                                        v1::GetJobResponse* resp) {
  return Reply(core_->GetJob(req->job_id()), resp);
}

grpc::Status CoordinatorService::GetShardMap(grpc::ServerContext*,
                                             const v1::GetShardMapRequest* req,
                                             v1::ShardMap* resp) {
  return Reply(core_->GetShardMap(req->job_id()), resp);
}

grpc::Status CoordinatorService::WatchShardMap(grpc::ServerContext* ctx,
                                               const v1::WatchShardMapRequest* req,
                                               grpc::ServerWriter<v1::ShardMap>* writer) {
  // The sync API has no cancellation callback: wait in short slices and
  // poll IsCancelled() between them.
  constexpr absl::Duration kPollInterval = absl::Milliseconds(100);
  uint64_t after_epoch = req->after_epoch();
  while (!ctx->IsCancelled()) {
    absl::StatusOr<std::optional<v1::ShardMap>> map =
        core_->WaitForShardMap(req->job_id(), after_epoch, kPollInterval);
    if (!map.ok()) return ToGrpc(map.status());
    if (!map->has_value()) continue;
    if (!writer->Write(**map)) return grpc::Status::OK;  // Client went away.
    after_epoch = (*map)->epoch();
  }
  return grpc::Status(grpc::StatusCode::CANCELLED, "watch cancelled by the client");
}

grpc::Status CoordinatorService::Status(grpc::ServerContext*, const v1::StatusRequest*,
                                        v1::StatusResponse* resp) {
  *resp = core_->Status();
  core_->FillLastCheckpoints(resp);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::CreateCheckpoint(grpc::ServerContext*,
                                                  const v1::CreateCheckpointRequest* req,
                                                  v1::CreateCheckpointResponse* resp) {
  return Reply(core_->CreateCheckpoint(*req), resp);
}

grpc::Status CoordinatorService::ListCheckpoints(grpc::ServerContext*,
                                                 const v1::ListCheckpointsRequest* req,
                                                 v1::ListCheckpointsResponse* resp) {
  *resp = core_->ListCheckpoints(*req);
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::RestoreCheckpoint(grpc::ServerContext*,
                                                   const v1::RestoreCheckpointRequest* req,
                                                   v1::RestoreCheckpointResponse* resp) {
  return Reply(core_->RestoreCheckpoint(*req), resp);
}

grpc::Status CoordinatorService::DrainShard(grpc::ServerContext*,
                                            const v1::DrainShardRequest* req,
                                            v1::DrainShardResponse* resp) {
  return Reply(core_->DrainShard(*req), resp);
}

grpc::Status CoordinatorService::ForgetShard(grpc::ServerContext*,
                                             const v1::ForgetShardRequest* req,
                                             v1::ForgetShardResponse* resp) {
  return Reply(core_->ForgetShard(*req), resp);
}

}  // namespace optimus
