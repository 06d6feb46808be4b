// The shard's side of the control plane, behind an interface: register,
// heartbeat (report progress; get assignments, checkpoint orders and
// released jobs), and fetch a job's description. The gRPC implementation is
// the only place in server/ that converts proto messages; tests substitute
// their own. Implementations must be safe to call from any thread.
#ifndef OPTIMUS_SERVER_COORDINATOR_LINK_H_
#define OPTIMUS_SERVER_COORDINATOR_LINK_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/security.h"
#include "server/domain.h"

namespace optimus {
namespace server {

class CoordinatorLink {
 public:
  virtual ~CoordinatorLink() = default;
  virtual absl::StatusOr<Registered> Register(const ShardRegistration& registration) = 0;
  virtual absl::StatusOr<HeartbeatReply> Heartbeat(const HeartbeatReport& report) = 0;
  // The job as shard `shard_id` needs it: its map holds only the chunks
  // this shard holds as primary or backup, and the addresses of the shards
  // it exchanges with (its chunks' other holders); a chunk it does not hold
  // is not in it (GetJobRequest.for_shard_id).
  // INVALID_ARGUMENT when the job's spec is one this shard cannot run
  // (unknown dtype or optimizer, world size 0, replication > 1).
  virtual absl::StatusOr<JobDescription> GetJob(uint64_t job_id, uint64_t shard_id) = 0;
};

// Talks to optimus-coord at "HOST:PORT" over gRPC, or to whichever of
// several ("HOST:PORT,HOST:PORT": a leader and its standbys) answers,
// following a takeover (common/coordinator_channels.h); reconnects quickly
// after a coordinator restart. INVALID_ARGUMENT for a bad address list. Each call has a deadline (register and get 5 s,
// heartbeat 2 s). With TLS the shard's certificate ("shard:<who>") is its
// identity: the coordinator lets only it heartbeat as the shard it
// registers (common/security.h).
absl::StatusOr<std::unique_ptr<CoordinatorLink>> NewGrpcCoordinatorLink(
    const std::string& address, const security::TlsOptions& tls);

}  // namespace server
}  // namespace optimus

#endif  // OPTIMUS_SERVER_COORDINATOR_LINK_H_
