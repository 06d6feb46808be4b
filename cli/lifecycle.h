// `optimusctl job create -f FILE`, `optimusctl job delete NAME [--force]`
// and `optimusctl shard forget ID`: creating and ending a job, and removing
// a DOWN shard from the coordinator's tables. The
// RPC functions make one blocking call each on their own channel; the
// Render functions are pure. All are thread-safe.
#ifndef OPTIMUS_CLI_LIFECYCLE_H_
#define OPTIMUS_CLI_LIFECYCLE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "proto/optimus.pb.h"

namespace optimus {

// Creates the job `spec` describes, waiting at most `timeout`. `job_token`:
// the token its workers will prove (32 to 256 characters), or empty for one
// the coordinator makes; the response carries it either way. UNAVAILABLE
// "cannot reach coordinator at ADDRESS: ..." when it cannot be reached;
// otherwise the coordinator's error (ALREADY_EXISTS, INVALID_ARGUMENT for a
// bad spec, RESOURCE_EXHAUSTED when it does not fit on the live shards).
absl::StatusOr<v1::CreateJobResponse> CreateJobRpc(const std::string& address,
                                                   absl::Duration timeout,
                                                   const v1::JobSpec& spec,
                                                   const std::string& job_token);

// Deletes job `job_name`, waiting at most `timeout`. UNAVAILABLE "cannot
// reach coordinator at ADDRESS: ..." when it cannot be reached; otherwise
// the coordinator's error (NOT_FOUND for an unknown job,
// FAILED_PRECONDITION while workers are joined and `force` is off).
absl::StatusOr<v1::DeleteJobResponse> DeleteJobRpc(const std::string& address,
                                                   absl::Duration timeout,
                                                   const std::string& job_name, bool force);

// "job llm (id 3, READY) deleted: 1.5 GiB of shard memory freed; checkpoints
// stay in the checkpoint folder", plus a line naming the workers still
// joined when it was forced.
std::string RenderJobDeleted(const std::string& job_name, const v1::DeleteJobResponse& resp);

// Removes DOWN shard `shard_id`. Errors as DeleteJobRpc (NOT_FOUND for an
// unknown shard, FAILED_PRECONDITION for one that is UP or DRAINING).
absl::StatusOr<v1::ForgetShardResponse> ForgetShardRpc(const std::string& address,
                                                       absl::Duration timeout, uint64_t shard_id);

// "shard 3 (host bf-2) forgotten: it was DOWN; if it comes back it
// registers under a new id".
std::string RenderShardForgotten(const v1::ForgetShardResponse& resp);

}  // namespace optimus

#endif  // OPTIMUS_CLI_LIFECYCLE_H_
