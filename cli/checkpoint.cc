#include "cli/checkpoint.h"


#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cli/status.h"
#include "common/grpc_limits.h"
#include "grpcpp/grpcpp.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {
namespace {

std::unique_ptr<v1::Coordinator::Stub> Stub(const std::string& address) {
  return v1::Coordinator::NewStub(CoordinatorChannel(address));
}



}  // namespace

absl::StatusOr<v1::CheckpointInfo> CreateCheckpointRpc(const std::string& address,
                                                       absl::Duration timeout,
                                                       const std::string& job_name) {
  v1::CreateCheckpointRequest req;
  req.set_job_name(job_name);
  v1::CreateCheckpointResponse resp;
  grpc::ClientContext ctx;
  SetCliDeadline(&ctx, timeout);
  if (auto s = CoordinatorCallStatus(Stub(address)->CreateCheckpoint(&ctx, req, &resp), address); !s.ok()) {
    return s;
  }
  return resp.checkpoint();
}

absl::StatusOr<std::vector<v1::CheckpointInfo>> ListCheckpointsRpc(const std::string& address,
                                                                   absl::Duration timeout,
                                                                   const std::string& job_name) {
  v1::ListCheckpointsRequest req;
  req.set_job_name(job_name);
  v1::ListCheckpointsResponse resp;
  grpc::ClientContext ctx;
  SetCliDeadline(&ctx, timeout);
  if (auto s = CoordinatorCallStatus(Stub(address)->ListCheckpoints(&ctx, req, &resp), address); !s.ok()) {
    return s;
  }
  return std::vector<v1::CheckpointInfo>(resp.checkpoints().begin(), resp.checkpoints().end());
}

absl::StatusOr<v1::RestoreCheckpointResponse> RestoreCheckpointRpc(
    const std::string& address, absl::Duration timeout, const v1::RestoreCheckpointRequest& req) {
  v1::RestoreCheckpointResponse resp;
  grpc::ClientContext ctx;
  SetCliDeadline(&ctx, timeout);
  if (auto s = CoordinatorCallStatus(Stub(address)->RestoreCheckpoint(&ctx, req, &resp), address); !s.ok()) {
    return s;
  }
  return resp;
}

const char* CheckpointStateName(v1::CheckpointState state) {
  switch (state) {
    case v1::CHECKPOINT_STATE_IN_PROGRESS: return "in_progress";
    case v1::CHECKPOINT_STATE_COMPLETE: return "complete";
    case v1::CHECKPOINT_STATE_FAILED: return "failed";
    default: return "unspecified";
  }
}

std::string RenderCheckpointsTable(const std::vector<v1::CheckpointInfo>& checkpoints) {
  std::vector<std::vector<std::string>> rows = {
      {"ID", "STEP", "STATE", "CREATED (UTC)", "SIZE", "PATH / ERROR"}};
  for (const auto& c : checkpoints) {
    std::string state = CheckpointStateName(c.state());
    for (char& ch : state) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
    rows.push_back({absl::StrCat(c.checkpoint_id()), absl::StrCat(c.step()), state,
                    c.created_unix_ms() > 0
                        ? absl::FormatTime("%Y-%m-%d %H:%M:%S",
                                           absl::FromUnixMillis(c.created_unix_ms()),
                                           absl::UTCTimeZone())
                        : "-",
                    c.size_bytes() > 0 ? HumanBytes(c.size_bytes()) : "-",
                    c.state() == v1::CHECKPOINT_STATE_FAILED ? c.error() : c.path()});
  }
  std::vector<size_t> width(rows[0].size(), 0);
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) width[i] = std::max(width[i], r[i].size());
  }
  std::string out;
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) {
      if (i > 0) line += "  ";
      const std::string pad(width[i] - r[i].size(), ' ');
      // Numbers right-aligned; the last column is not padded.
      if (i <= 1) {
        line += pad + r[i];
      } else {
        line += i + 1 == r.size() ? r[i] : r[i] + pad;
      }
    }
    absl::StrAppend(&out, line, "\n");
  }
  return out;
}

Json CheckpointToJson(const v1::CheckpointInfo& c) {
  return Json{{"checkpoint_id", c.checkpoint_id()},
              {"job_name", c.job_name()},
              {"step", c.step()},
              {"state", CheckpointStateName(c.state())},
              {"created_unix_ms", c.created_unix_ms()},
              {"size_bytes", c.size_bytes()},
              {"path", c.path()},
              {"error", c.error()}};
}

Json CheckpointsToJson(const std::vector<v1::CheckpointInfo>& checkpoints) {
  Json items = Json::array();
  for (const auto& c : checkpoints) items.push_back(CheckpointToJson(c));
  return Json{{"checkpoints", std::move(items)}};
}

std::string RenderCheckpointsJson(const std::vector<v1::CheckpointInfo>& checkpoints) {
  return ToJsonText(CheckpointsToJson(checkpoints));
}

}  // namespace optimus
