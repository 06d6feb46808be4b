// `optimusctl checkpoint ...`: the coordinator's checkpoint RPCs (create,
// list, restore) and rendering of their answers as tables or JSON. Each
// RPC function makes one blocking call on its own channel; rendering
// functions are pure. All are thread-safe.
#ifndef OPTIMUS_CLI_CHECKPOINT_H_
#define OPTIMUS_CLI_CHECKPOINT_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cli/output.h"
#include "proto/optimus.pb.h"

namespace optimus {

// Each waits at most `timeout`; UNAVAILABLE "cannot reach coordinator at
// ADDRESS: ..." when the coordinator cannot be reached; otherwise the
// coordinator's error (e.g. NOT_FOUND for an unknown job, DATA_LOSS naming
// a corrupted file).
absl::StatusOr<v1::CheckpointInfo> CreateCheckpointRpc(const std::string& address,
                                                       absl::Duration timeout,
                                                       const std::string& job_name);
absl::StatusOr<std::vector<v1::CheckpointInfo>> ListCheckpointsRpc(const std::string& address,
                                                                   absl::Duration timeout,
                                                                   const std::string& job_name);
absl::StatusOr<v1::RestoreCheckpointResponse> RestoreCheckpointRpc(
    const std::string& address, absl::Duration timeout, const v1::RestoreCheckpointRequest& req);

// "complete", "in_progress", "failed".
const char* CheckpointStateName(v1::CheckpointState state);

// Table: ID, STEP, STATE, CREATED (UTC), SIZE, PATH or ERROR.
std::string RenderCheckpointsTable(const std::vector<v1::CheckpointInfo>& checkpoints);
// One checkpoint: {"checkpoint_id", "job_name", "step", "state",
// "created_unix_ms", "size_bytes", "path", "error"}.
Json CheckpointToJson(const v1::CheckpointInfo& c);
// {"checkpoints": [CheckpointToJson...]}.
Json CheckpointsToJson(const std::vector<v1::CheckpointInfo>& checkpoints);
// CheckpointsToJson as one line of JSON and a newline.
std::string RenderCheckpointsJson(const std::vector<v1::CheckpointInfo>& checkpoints);

}  // namespace optimus

#endif  // OPTIMUS_CLI_CHECKPOINT_H_
