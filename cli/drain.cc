#include "cli/drain.h"

#include "absl/strings/str_cat.h"
#include "cli/status.h"
#include "common/grpc_limits.h"
#include "grpcpp/grpcpp.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {

absl::StatusOr<v1::DrainShardResponse> DrainShardRpc(const std::string& address,
                                                     absl::Duration timeout, uint64_t shard_id) {
  auto stub = v1::Coordinator::NewStub(CoordinatorChannel(address));
  grpc::ClientContext ctx;
  SetCliDeadline(&ctx, timeout);
  v1::DrainShardRequest req;
  req.set_shard_id(shard_id);
  v1::DrainShardResponse resp;
  if (absl::Status s = CoordinatorCallStatus(stub->DrainShard(&ctx, req, &resp), address);
      !s.ok()) {
    return s;
  }
  return resp;
}

DrainProgress FindDrainProgress(const v1::StatusResponse& status, uint64_t shard_id) {
  DrainProgress p;
  for (const v1::ShardStatus& s : status.shards()) {
    if (s.shard_id() != shard_id) continue;
    p.found = true;
    p.state = s.state();
    p.chunks_left = s.chunks_owned();
    p.backups_left = s.backup_chunks();
  }
  return p;
}

std::string RenderDrainProgress(uint64_t shard_id, const DrainProgress& p) {
  if (!p.found) return absl::StrCat("shard ", shard_id, ": unknown to the coordinator");
  return absl::StrCat("shard ", shard_id, ": ", ShardStateName(p.state), ", ", p.chunks_left,
                      " chunks left (", p.backups_left, " of them backups)");
}

}  // namespace optimus
