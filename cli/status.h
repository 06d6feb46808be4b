// `optimusctl status`: fetches the coordinator's StatusResponse and renders
// it as aligned tables for people or as one JSON object for scripts.
// Rendering functions are pure and thread-safe; FetchStatus makes one
// blocking RPC and owns its channel for the duration of the call.
#ifndef OPTIMUS_CLI_STATUS_H_
#define OPTIMUS_CLI_STATUS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cli/output.h"
#include "common/security.h"
#include "grpcpp/grpcpp.h"
#include "absl/time/time.h"
#include "proto/optimus.pb.h"

namespace optimus {

// TLS for every call optimusctl makes: loads `options` (see
// common/security.h) once; optimusctl's main calls it before any command.
// An admin certificate ("admin:<who>") is what most commands need.
absl::Status SetCliTls(const security::TlsOptions& options);
// A channel to the coordinator at `address` under that TLS setting (loaded
// from the environment if SetCliTls was not called; if that fails, a TLS
// channel that trusts no CA: calls fail, nothing is sent in clear).
// Several addresses ("HOST:PORT,HOST:PORT": a leader and its standbys):
// the channel of the one that accepts a connection within the connect wait
// (SetCliConnectWait; default 3 s), asked again at every call, so a
// command that polls (drain --wait) follows a takeover.
std::shared_ptr<grpc::Channel> CoordinatorChannel(const std::string& address);
// How long CoordinatorChannel waits for one of several addresses to connect.
void SetCliConnectWait(absl::Duration wait);
// Drops the channels CoordinatorChannel kept for several addresses (their
// connecting thread stops, gRPC closes them). optimusctl's main calls it
// before returning, while gRPC is still whole: left to the static
// destructors, the channels went after gRPC's own teardown had begun, and
// their TLS connections' OpenSSL state was never freed (LeakSanitizer in
// --config=fuzz, coordinator_takeover_test).
void ReleaseCliChannels();
// What every optimusctl call to the coordinator does around its RPC: the
// deadline `timeout` from now on `ctx`, and the RPC's status for the
// operator. A coordinator that cannot be reached or did not answer in time
// (UNAVAILABLE, DEADLINE_EXCEEDED) is UNAVAILABLE "cannot reach coordinator
// at ADDRESS: ..."; any other error is the coordinator's own (FromGrpc).
void SetCliDeadline(grpc::ClientContext* ctx, absl::Duration timeout);
absl::Status CoordinatorCallStatus(const grpc::Status& s, const std::string& address);

inline constexpr uint32_t kDefaultStatusPageSize = 1000;

// Which shards a status fetch asks for, and how many per message.
struct StatusQuery {
  // Only shards in these states; empty: every state.
  std::vector<v1::ShardState> shard_states;
  // Shards per Status call (each one message); 0: all in one call. Small
  // pages keep every message far below the gRPC limit at any cluster size.
  uint32_t page_size = kDefaultStatusPageSize;
};

// Asks the coordinator at `address` ("HOST:PORT") for its status, waiting at
// most `timeout` per call: the pages of shards of `query` in id order, put
// together, and the jobs. The state filter is applied here too, so a
// coordinator that predates filters and pages (it answers everything at
// once) gives the same result. UNAVAILABLE with "cannot reach coordinator
// at ADDRESS: ..." when it cannot be reached in time; other errors carry
// the server's status.
absl::StatusOr<v1::StatusResponse> FetchStatus(const std::string& address,
                                               absl::Duration timeout,
                                               const StatusQuery& query = StatusQuery());

// "up", "down", "draining" (any case) as a state; INVALID_ARGUMENT naming
// the three for anything else.
absl::StatusOr<v1::ShardState> ParseShardState(const std::string& name);

// Two tables, SHARDS then JOBS, with a header row each; memory in binary
// units ("1.5 GiB"), lease age as "250ms" / "3.2s" / "5m07s". A shard's
// STATE is UP, DRAINING or DOWN, CHUNKS counts primaries and backups,
// BACKUPS the latter, and TRANSPORTS names the UCX transports its data plane
// uses ("sysv,cma", "rc_mlx5", "tcp"; "-" before any); a job's REPL is its replication and REPLICAS its
// ReplicaHealth; CHUNKS its chunks. Then OPTIMIZERS: a row per parameter group (a job without
// param_groups has one, the implicit group "0"), the job's optimizer, lr,
// CLIP (max_grad_norm, "-" for none), NON-FINITE ("skip" or "keep") and
// FROZEN (tensors) on its first row; each group's TENSORS and PARAMS (frozen
// ones included), and the LR MULT, WEIGHT DECAY and BETAS (or SGD's
// momentum) it steps with: its own where it sets them, else the optimizer's.
// Left out when no job reports an optimizer (an older coordinator).
std::string RenderStatusTable(const v1::StatusResponse& status);

// The status as one document {"shards":[...],"jobs":[...]} (what
// `status -o json|yaml` prints). Fields are snake_case; counts and byte
// sizes are numbers; enums are lower-case strings ("dpu", "up", "ready").
// Shard fields (ShardToJson): shard_id, kind, arch, cores, hostname, state
// ("up", "draining", "down"), memory_used_bytes, memory_planned_bytes,
// memory_limit_bytes, staging_bytes, chunks_owned, backup_chunks,
// transports ("" before any), lease_age_ms. Job fields (JobToJson): job_id,
// name, state, world_size, workers_joined, current_step, num_tensors,
// num_params, state_bytes, map_epoch, replication, num_chunks,
// chunks_with_backup, backups_in_sync, replicas (ReplicaHealthWord),
// last_checkpoint ({checkpoint_id, step, state, error} or null),
// rollback_error, optimizer ({kind, lr, beta1, beta2, eps, weight_decay,
// momentum}), param_groups ([{index, name, num_tensors, num_elems,
// lr_mult, weight_decay, beta1, beta2, momentum, overrides}]: the values it
// steps with, overrides naming those the group sets itself),
// frozen_tensors, max_grad_norm (0: no clipping) and skip_nonfinite (bool).
// Floats are numbers in their shortest form (null if not finite).
Json StatusToJson(const v1::StatusResponse& status);
Json ShardToJson(const v1::ShardStatus& shard);
Json JobToJson(const v1::JobStatus& job);
// StatusToJson as one line of JSON and a newline.
std::string RenderStatusJson(const v1::StatusResponse& status);

// The SHARDS and JOBS tables of RenderStatusTable alone, with their header
// rows (`shard list`, `job list`).
std::string RenderShardsTable(const v1::StatusResponse& status);
std::string RenderJobsTable(const v1::StatusResponse& status);
// One job or shard as "Field:  value" lines (`job describe`, `shard
// describe`); a job's parameter groups follow as the OPTIMIZERS table.
std::string RenderJobDetail(const v1::JobStatus& job);
std::string RenderShardDetail(const v1::ShardStatus& shard);

// The job named `name` / the shard with id `shard_id` in `status`; null
// when there is none.
const v1::JobStatus* FindJob(const v1::StatusResponse& status, const std::string& name);
const v1::ShardStatus* FindShard(const v1::StatusResponse& status, uint64_t shard_id);

// A job's replica health for people, K being backups_in_sync and N
// num_chunks: "-" (replication 0), "moving K" (replication 0 with temporary
// backups while a drain moves its chunks), "N/N in sync" (every chunk has a
// backup in sync: a lost shard costs no step), "syncing K/N" (every chunk
// has a backup, some not yet seeded) or "degraded K/N" (some chunk has no
// backup: no shard has room for it).
std::string ReplicaHealth(const v1::JobStatus& job);
// The same as one word for scripts: "none", "moving", "in_sync", "syncing",
// "degraded".
const char* ReplicaHealthWord(const v1::JobStatus& job);

// "up", "draining", "down".
const char* ShardStateName(v1::ShardState state);

// "0 B", "512 B", "1.5 KiB", "16.0 GiB".
std::string HumanBytes(uint64_t size_bytes);

}  // namespace optimus

#endif  // OPTIMUS_CLI_STATUS_H_
