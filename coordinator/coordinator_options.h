// What an optimus-coord is configured with: addresses, lease timing, the
// folders for checkpoints and durable state, and how long a DOWN shard is
// remembered. A plain struct; optimus-coord's flags fill it (main.cc), tests
// and in-process clusters set it directly.
#ifndef OPTIMUS_COORDINATOR_COORDINATOR_OPTIONS_H_
#define OPTIMUS_COORDINATOR_COORDINATOR_OPTIONS_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/security.h"
#include "coordinator/job_spec.h"
#include "coordinator/state_store.h"

namespace optimus {

struct CoordinatorOptions {
  // gRPC listen address, "HOST:PORT". Port 0 picks a free port (read it back
  // with CoordinatorServer::port()). Default: loopback only.
  std::string listen_address = "127.0.0.1:0";
  // TLS for the gRPC server (its certificate, and the CA that client
  // certificates are verified against), or plain text when asked for (no
  // authorization). Left empty: $OPTIMUS_TLS_DIR or
  // $OPTIMUS_INSECURE_PLAINTEXT, else the server refuses to start.
  security::TlsOptions tls;
  // A shard with no heartbeat for this long is marked DOWN; the jobs that
  // hold chunks on it fail over to their backups (replication 1) or fail.
  // Shorter detects failures sooner but costs more
  // heartbeats (shards are told to beat every lease/3). Default 2 s.
  absl::Duration lease = absl::Seconds(2);
  // How often the lease thread checks leases; a dead shard is noticed
  // within lease + sweep_interval, whatever planning holds the tables (its
  // chunks fail over as soon as they are free). Also how often the
  // planning thread moves chunks (drain, replication), runs checkpoint
  // policies and forgets long-DOWN shards. Default 200 ms.
  absl::Duration sweep_interval = absl::Milliseconds(200);
  // Most threads the gRPC server runs calls on (a grpc::ResourceQuota):
  // a call that finds them all busy is refused at once with
  // RESOURCE_EXHAUSTED ("Server Threadpool Exhausted"; clients retry)
  // rather than start one more thread. Heartbeats do not need one (they
  // are served on gRPC's callback API); map watches (WatchShardMap, one
  // thread each for their whole life) may take half of them, beyond which
  // a watch is refused, so that they cannot starve other calls.
  // Default 256; at least 4.
  int max_rpc_threads = 256;
  // Most map reads (GetJob, GetShardMap) served at once, on the service's
  // own low-priority reader threads (at most 32 of them). When every shard
  // of a cluster fetches its part of a new job's map at once (thousands of
  // calls in a second), the ones past this bound wait their turn (see
  // max_queued_map_reads); past that too they are answered
  // RESOURCE_EXHAUSTED at once ("retry after about N ms", also in trailing
  // metadata "optimus-retry-after-ms"), without touching the tables;
  // optimus-shard and the client library retry them with jittered
  // backoff (common/busy_retry.h). A read served from the epoch's bytes
  // takes microseconds of CPU and a first cut of a big map a few
  // milliseconds, so a few dozen at once keep a coordinator's cores busy;
  // more only queue on the same cores and hold server threads that
  // registrations, joins and job changes need. Default 32 (an eighth of
  // max_rpc_threads' default); at least 1.
  int max_concurrent_map_reads = 32;
  // Map reads that may wait, in arrival order, for one of those; past
  // max_concurrent_map_reads + max_queued_map_reads a read is refused at
  // once with RESOURCE_EXHAUSTED. A waiting read costs the coordinator a
  // few KB and no thread; one that waits is served with one call, where a
  // refused one comes back several times. Default 16384 (every shard of a
  // 16k-DPU cluster fetching a new job's map at once); at least 0.
  int max_queued_map_reads = 16384;
  // How many shards a second may fetch a new map part (a new job's, or a
  // part a new epoch changed); half a second's worth may fetch at once.
  // Past that, a heartbeat reply still names the new epoch but gives the
  // shard a later slot (Assignment.fetch_after_ms), one every 1/rate s. A
  // new job on a 16k-shard cluster otherwise sends every shard to fetch
  // within one heartbeat interval, and the fetches' receive and send work
  // queues the heartbeats behind it; paced, they spread over 16384 / rate
  // seconds. A failover that changes a few hundred shards' parts is not
  // slowed. Counted in optimus_coord_map_fetches_delayed_total. Default
  // 4096; 0: no pacing.
  double map_fetches_per_s = 4096;
  // A shard DOWN for longer than this leaves the coordinator's tables (and
  // status) on its own; `optimusctl shard forget` removes one at once. A
  // shard that comes back after that registers anew under a new id, as it
  // does after any DOWN. Until then it stays visible, so that an operator
  // sees what was lost. absl::InfiniteDuration() keeps DOWN shards forever.
  // Default 10 minutes.
  absl::Duration down_shard_grace = absl::Minutes(10);
  // "HOST:PORT" for the HTTP /metrics (Prometheus) and /healthz endpoints;
  // port 0 picks one; empty turns them off. Default off.
  std::string metrics_address;
  // Folder for checkpoints (dir/<job name>/ckpt-<id>/), on a filesystem the
  // shards share (their --checkpoint_dir). The coordinator writes each
  // manifest there, prunes old checkpoints and verifies one before a
  // restore. Empty: checkpoints are off. Default empty.
  std::string checkpoint_dir;
  // When a shard holding chunks of a job is lost (no replica), restore the
  // job from its newest complete checkpoint onto the live shards, under the
  // same name: its workers re-join and resume at the checkpoint's step (the
  // steps since are redone). Needs checkpoint_dir. Default on.
  bool rollback_on_shard_loss = true;
  // Folder for the durable state (shards, jobs, maps), rewritten with fsync
  // and an atomic rename after every membership or job change (not on
  // heartbeats; the write happens on a thread of its own, never under the
  // coordinator's lock), and loaded at start, so a restarted coordinator
  // loses nothing. Empty: state lives in memory only. Default empty.
  std::string state_dir;
  // Where the durable state goes instead of state_dir's file, when set:
  // tests use an in-memory store, or one whose writes are slow. Shared with
  // the caller, who may keep it to start another coordinator over the same
  // state. Default none.
  std::shared_ptr<StateStore> state_store;
  // What one job may cost (chunks, tensors, shard bytes): a CreateJob or
  // restore over a limit is refused with RESOURCE_EXHAUSTED and counted
  // (optimus_coord_jobs_refused_total). Defaults: job_spec.h.
  JobLimits job_limits;
  // The clock for leases, lease ages and the DOWN grace period; empty means
  // absl::Now. Tests set a fake one to expire one shard's lease and not
  // another's.
  std::function<absl::Time()> clock;
  // For tests: called by CreateJob (and restores) with no lock held after
  // each placement planned off the lock (attempt 0, 1, ...), before it is
  // checked and committed; a test changes the shards there to make it stale.
  std::function<void(int attempt)> after_off_lock_placement;
  // For tests: called by GetJob and GetShardMap on a map-reader thread
  // (one of max_concurrent_map_reads), before they read; a test blocks in
  // it to keep the readers taken.
  std::function<void()> while_reading_map;
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_COORDINATOR_OPTIONS_H_
