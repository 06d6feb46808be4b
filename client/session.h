// One-call setup for trainers: who this process is (rank, world size,
// coordinator: from arguments or the environment torchrun and launchers
// set), the job spec (from a JobDef, or a JSON/YAML file: docs/job-spec.md),
// and join-or-create with retries, so that every rank can start in any
// order. Also the re-join after a rollback (a lost shard without a replica:
// the coordinator restores the job from its last checkpoint under the same
// name, and every rank joins the restored job).
#ifndef OPTIMUS_CLIENT_SESSION_H_
#define OPTIMUS_CLIENT_SESSION_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/client.h"

namespace optimus {
namespace client {

struct SessionOptions {
  // "host:port" of optimus-coord, or several comma-separated (a leader and
  // its standbys: ClientOptions::coordinator_address). Empty:
  // $OPTIMUS_COORDINATOR.
  std::string coordinator;
  // This worker's rank and the number of workers. < 0: $RANK and
  // $WORLD_SIZE (torchrun sets both); with neither set, the job spec's
  // world_size and rank 0 when that is 1, else an error.
  int64_t rank = -1;
  int64_t world_size = -1;
  // The job's name. Empty: $OPTIMUS_JOB, else the job spec's name.
  std::string job_name;
  // A job spec file (YAML or JSON, docs/job-spec.md). Set: its fields
  // replace everything in the JobDef given to JoinOrCreate except the
  // tensors (which come from the model), and its groups are assigned to
  // the tensors by name. Empty: $OPTIMUS_JOB_SPEC, else the JobDef as is.
  std::string job_spec_path;
  // How long to keep trying: the coordinator not up yet, the job not
  // created yet (rank 0 creates it), its shards not ready. Default 2 min.
  absl::Duration join_timeout = absl::Minutes(2);
  // The client's own settings (coordinator_address is set from the above).
  ClientOptions client;
};

struct Session {
  std::unique_ptr<Client> client;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  std::string job_name;
  // The JobDef this session asked for (after the spec file and the
  // environment were applied).
  JobDef def;
  // This rank created the job (rank 0, on a new job).
  bool created = false;
  // The job starts fresh and this rank must send the initial values
  // (Client::InitTensor): rank 0 of a job at resume step 1.
  bool needs_init = false;
};

// Resolves the options against the environment, then: rank 0 creates the
// job (an existing job of that name is joined instead), every rank joins,
// retrying while the coordinator is unreachable or the job does not exist
// yet, until options.join_timeout. The joined job must have exactly the
// tensors of `def` (names, shapes, order), else FAILED_PRECONDITION naming
// the first difference. INVALID_ARGUMENT for missing or inconsistent
// settings (no coordinator, RANK without WORLD_SIZE, rank >= world size, a
// bad spec file); DEADLINE_EXCEEDED with the last error when the retries
// run out.
absl::StatusOr<Session> JoinOrCreate(const SessionOptions& options, JobDef def);

// After a request failed because the job lost a shard without a replica:
// joins the job the coordinator restores from its last checkpoint under the
// same name (a new client; the old one is destroyed), waiting up to
// options.join_timeout for a restored job (a job of that name with another
// job id than the session's). On success the session's client is
// the new one and needs_init is false; the trainer goes on from
// client->resume_step() (its values: pull that version).
absl::Status RejoinAfterRollback(const SessionOptions& options, Session* session);

// The session options with the environment applied (what JoinOrCreate
// uses), for callers that want to log them. Same errors as JoinOrCreate's
// INVALID_ARGUMENT ones. `spec_world_size` is the job spec's (0: none).
absl::StatusOr<SessionOptions> ResolveSessionOptions(const SessionOptions& options,
                                                     uint32_t spec_world_size);

}  // namespace client
}  // namespace optimus

#endif  // OPTIMUS_CLIENT_SESSION_H_
