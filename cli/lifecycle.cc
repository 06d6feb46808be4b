#include "cli/lifecycle.h"


#include "absl/strings/str_cat.h"
#include "cli/status.h"
#include "common/grpc_limits.h"
#include "grpcpp/grpcpp.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {
namespace {

std::unique_ptr<v1::Coordinator::Stub> Stub(const std::string& address) {
  return v1::Coordinator::NewStub(CoordinatorChannel(address));
}


const char* JobStateWord(v1::JobState s) {
  switch (s) {
    case v1::JOB_STATE_PENDING: return "PENDING";
    case v1::JOB_STATE_READY: return "READY";
    case v1::JOB_STATE_FAILED: return "FAILED";
    default: return "UNKNOWN";
  }
}

}  // namespace

absl::StatusOr<v1::CreateJobResponse> CreateJobRpc(const std::string& address,
                                                   absl::Duration timeout,
                                                   const v1::JobSpec& spec,
                                                   const std::string& job_token) {
  grpc::ClientContext ctx;
  SetCliDeadline(&ctx, timeout);
  v1::CreateJobRequest req;
  *req.mutable_spec() = spec;
  req.set_job_token(job_token);
  v1::CreateJobResponse resp;
  const grpc::Status s = Stub(address)->CreateJob(&ctx, req, &resp);
  if (!s.ok()) return CoordinatorCallStatus(s, address);
  return resp;
}

absl::StatusOr<v1::DeleteJobResponse> DeleteJobRpc(const std::string& address,
                                                   absl::Duration timeout,
                                                   const std::string& job_name, bool force) {
  grpc::ClientContext ctx;
  SetCliDeadline(&ctx, timeout);
  v1::DeleteJobRequest req;
  req.set_job_name(job_name);
  req.set_force(force);
  v1::DeleteJobResponse resp;
  const grpc::Status s = Stub(address)->DeleteJob(&ctx, req, &resp);
  if (!s.ok()) return CoordinatorCallStatus(s, address);
  return resp;
}

std::string RenderJobDeleted(const std::string& job_name, const v1::DeleteJobResponse& resp) {
  std::string out = absl::StrCat("job ", job_name, " (id ", resp.job_id(), ", ",
                                 JobStateWord(resp.state()), ") deleted: ",
                                 HumanBytes(resp.state_bytes()),
                                 " of shard memory freed; its checkpoints stay in the checkpoint "
                                 "folder\n");
  if (resp.workers_joined() > 0) {
    absl::StrAppend(&out, resp.workers_joined(),
                    " workers were still joined: their requests now fail\n");
  }
  return out;
}

absl::StatusOr<v1::ForgetShardResponse> ForgetShardRpc(const std::string& address,
                                                       absl::Duration timeout,
                                                       uint64_t shard_id) {
  grpc::ClientContext ctx;
  SetCliDeadline(&ctx, timeout);
  v1::ForgetShardRequest req;
  req.set_shard_id(shard_id);
  v1::ForgetShardResponse resp;
  const grpc::Status s = Stub(address)->ForgetShard(&ctx, req, &resp);
  if (!s.ok()) return CoordinatorCallStatus(s, address);
  return resp;
}

std::string RenderShardForgotten(const v1::ForgetShardResponse& resp) {
  const v1::ShardStatus& s = resp.shard();
  return absl::StrCat("shard ", s.shard_id(),
                      s.capabilities().hostname().empty()
                          ? std::string()
                          : absl::StrCat(" (host ", s.capabilities().hostname(), ")"),
                      " forgotten: it was DOWN; if it comes back it registers under a new id\n");
}

}  // namespace optimus
