// optimus-shard: an optimizer shard server. It registers with the coordinator
// and heartbeats to keep its lease, loads the chunks the shard map places on
// it, receives gradient chunks over UCX active messages into one slot per
// worker, runs the fused optimizer step when all W workers' pushes for
// (chunk, step) are in, and serves pulls of the published parameters.
//
// A ShardServer is a handle: Start() either returns a running server or an
// error; the destructor stops it. Public methods are thread-safe.
#ifndef OPTIMUS_SERVER_SHARD_SERVER_H_
#define OPTIMUS_SERVER_SHARD_SERVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/security.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace optimus {
namespace server {

struct ShardServerOptions {
  // gRPC address of optimus-coord, "host:port". Required.
  std::string coordinator_address;
  // TLS to the coordinator, with this shard's client certificate, or plain
  // text when asked for. Left empty: $OPTIMUS_TLS_DIR or
  // $OPTIMUS_INSECURE_PLAINTEXT, else the shard refuses to start.
  security::TlsOptions tls;
  // True on a DPU (BlueField Arm cores); false on the host CPU fallback.
  bool is_dpu = false;
  // Budget for all jobs' state on this shard. Default 1 GiB.
  uint64_t memory_limit_bytes = uint64_t{1} << 30;
  // Bytes of the budget kept for gradients in flight (server/staging.h):
  // pushes land and are summed there; the rest of the budget is offered to
  // the coordinator for jobs' state. 0: an eighth of memory_limit_bytes.
  uint64_t staging_bytes = 0;
  // Fold pushed gradients into a running sum as they land (staging.h).
  // false: every chunk-step holds W slots, as before the staging pool (a
  // benchmark baseline; jobs with the commit round then need more memory
  // than the coordinator plans). Default true.
  bool fold_gradients = true;
  // Threads that run optimizer steps and fold landed gradients, one chunk
  // each (the progress thread is extra). 0: one per core the process may
  // use (UsableCores: its affinity under its cgroup's CPU quota).
  int step_threads = 0;
  // Threads that split one chunk's fused step into ranges (a pool the server
  // owns, shared by all step threads; results are bitwise the same for any
  // count), so the last chunk of a step is not left to one core. 0: one per
  // core the process may use.
  int kernel_threads = 0;
  // How much nicer (Linux nice, per thread; the result at most 19) the step
  // and kernel threads run than the rest of the shard: the UCX progress
  // thread, heartbeats and gRPC keep the process's priority. Above 0 the
  // cores go to landing pushes and serving pulls first where the steps
  // compete with them (a host CPU, or a DPU with fewer cores than busy
  // threads): a worker waits for its push to land, while a chunk's step only
  // has to be done before that chunk's next pull. 0: the same priority as
  // the rest. Below 0 the other way round: the UCX progress thread runs
  // -step_nice nicer than the rest (a thread cannot raise its own priority
  // without CAP_SYS_NICE), so a chunk whose pushes have all landed is
  // stepped before more landings take the core; on a shard with fewer cores
  // than busy threads that trades push goodput for the time from a chunk's
  // last push to its version (docs/benchmarks.md, "Steps first"). Default 0.
  int step_nice = 0;
  // Whether the shard's buffers of 2 MiB or more (state, published copies,
  // gradient staging) are advised for transparent huge pages
  // (common/huge_pages.h): shared-memory transfers and kernel passes over
  // 4 KiB pages walk and pin a page table entry per 4 KiB. Where the
  // kernel's transparent_hugepage mode is "never" this changes nothing.
  // Off by default: the first touch of huge pages that a VM's balloon or
  // free-page reporting gave back to its host faults them in from the host
  // and can stall the VM for seconds (measured: 1 GiB took 3.7-7.4 s
  // instead of 0.6 s), long enough to miss heartbeats. The Helm chart turns
  // it on (dpu.hugePages, host.hugePages).
  bool huge_pages = false;
  // How often to heartbeat; 0 means a third of the lease the coordinator grants.
  absl::Duration heartbeat_interval = absl::ZeroDuration();
  // UCX settings for the data plane.
  transport::WorkerOptions transport;
  // "HOST:PORT" for the HTTP /metrics (Prometheus) and /healthz endpoints;
  // port 0 picks one; empty turns them off. Default off.
  std::string metrics_address;
  // Shards that fail together (the server a DPU sits in, a rack): the
  // coordinator puts a chunk's backup in another domain than its primary
  // when one has room. Empty (default): the hostname.
  std::string failure_domain;
  // Folder checkpoints are written to and restored from (the same shared
  // filesystem as the coordinator's --checkpoint_dir). Empty: the shard
  // cannot checkpoint or restore, and the coordinator refuses a checkpoint
  // of a job with chunks on it. Default empty.
  std::string checkpoint_dir;
  // Most bytes per second the background checkpoint writer puts on disk
  // (0: no limit). Limits how much memory and disk bandwidth persisting
  // takes from the optimizer; a checkpoint of B bytes per shard takes at
  // least B / this. Default 0.
  uint64_t checkpoint_max_bytes_per_second = 0;
  // Log one line per chunk version this shard makes, with the CRC-32C of its
  // published copy: "audit: made job=J tensor=T chunk=C version=V
  // role=primary|backup crc32c=X" (a primary publishes it, a backup holds it
  // to be promoted). Lets a drill check that no two shards ever hold the same
  // version with different bytes (tests/fault/partition_test.sh). Costs a
  // pass over each published copy. Default off.
  bool audit_versions = false;
  // Most pulls one peer may have waiting for their version or being sent,
  // over all chunks and jobs on this shard, and most of all peers
  // together; a pull over either is refused with RESOURCE_EXHAUSTED. Each
  // costs a small record and, when answered, a send of the chunk's
  // published copy. Defaults 65536 and 262144 (a worker pulls each of its
  // chunks on this shard once per step).
  uint64_t max_parked_pulls_per_peer = 65536;
  uint64_t max_parked_pulls = 262144;
  // Most bytes of temporary buffers for requests being received (batches
  // of small requests, inits with optimizer state, backups' seeds), on top of
  // memory_limit_bytes; a request over it is refused with
  // RESOURCE_EXHAUSTED (a seed from a primary: asked again later). Default
  // 256 MiB.
  uint64_t max_inflight_bytes = uint64_t{256} << 20;
  // How long a step thread may hold the acks it makes (a commit round's,
  // to workers that take reply batches) to send several in one message:
  // they leave when its queue runs dry or when the oldest is this old.
  // Default 200 us (a 4 MiB chunk's step takes a millisecond or more).
  absl::Duration step_reply_hold = absl::Microseconds(200);
};

struct ShardServerStats {
  uint64_t shard_id = 0;
  uint64_t memory_used_bytes = 0;   // State, published copies and staging buffers.
  uint64_t staging_limit_bytes = 0;
  uint64_t staging_in_use_bytes = 0;
  uint64_t staging_waits = 0;  // Pushes and steps that waited for room.
  uint64_t batches_received = 0;  // Messages of several requests (wire::Op::kBatch).
  // Messages of several replies (wire::kAmReplyBatch), and the replies in them.
  uint64_t reply_batches = 0;
  uint64_t replies_batched = 0;
  // Batch receive buffers allocated because no kept one was free (or the
  // batch was larger than wire::kBatchBytes).
  uint64_t batch_buffer_allocations = 0;
  uint32_t chunks_owned = 0;
  uint64_t steps_applied = 0;       // Chunk steps, summed over chunks.
  uint64_t pushes_received = 0;
  uint64_t requests_rejected = 0;  // Pushes, pulls and inits refused with an error.
  // Of those, refused because the sender proved another identity.
  uint64_t requests_refused_identity = 0;
  // Data-plane handshakes refused and messages dropped from unproved peers.
  uint64_t unproved_refused = 0;
  uint64_t pushes_duplicate = 0;   // Repeated pushes acknowledged and dropped.
  uint64_t pulls_served = 0;
  uint32_t jobs = 0;  // Jobs with state on this shard.
  // Time a step that was ready waited for a checkpoint's copy of its chunk,
  // plus copies made while holding the chunk (requests to it wait then):
  // the stall checkpoints cause on the workers' path, summed over chunks.
  uint64_t checkpoint_stall_ns = 0;
  // Bounded resources (peer_limits.h): pulls waiting or being sent now,
  // the peers they are from, requests refused for being over a limit.
  uint64_t parked_pulls = 0;
  uint64_t peers_with_parked_pulls = 0;
  uint64_t parked_pull_refusals = 0;
  uint64_t inflight_bytes = 0;
  uint64_t inflight_refusals = 0;
  // The data plane's peers known now, and hellos dropped at
  // transport.max_peers (transport::Worker::peer_count, hellos_refused).
  uint64_t transport_peers = 0;
  uint64_t hellos_refused = 0;
};

class CoordinatorLink;  // server/coordinator_link.h

class ShardServer {
 public:
  // Starts the data plane, registers with the coordinator and begins
  // heartbeating. Fails if the coordinator cannot be reached.
  static absl::StatusOr<std::unique_ptr<ShardServer>> Start(const ShardServerOptions& options);
  // Same, reaching the coordinator through `link` instead of gRPC to
  // options.coordinator_address (tests of the shard alone).
  static absl::StatusOr<std::unique_ptr<ShardServer>> StartWithLink(
      const ShardServerOptions& options, std::unique_ptr<CoordinatorLink> link);
  virtual ~ShardServer() = default;

  virtual uint64_t shard_id() const = 0;
  // The data-plane address workers and other shards connect to.
  virtual std::string data_address() const = 0;
  virtual ShardServerStats stats() const = 0;
  // The /metrics and /healthz port, or 0 when they are off.
  virtual int metrics_port() const = 0;
  // Stops heartbeating and the data plane. Idempotent; the destructor calls it.
  virtual void Shutdown() = 0;
  // Tests: occupies every step thread (nothing queued runs) until the
  // returned function is called; returns once they all are.
  virtual std::function<void()> HoldStepThreadsForTest() = 0;
};

}  // namespace server
}  // namespace optimus

#endif  // OPTIMUS_SERVER_SHARD_SERVER_H_
