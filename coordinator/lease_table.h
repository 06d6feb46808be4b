// The coordinator's leases, under a small lock of their own, so that
// failure detection never waits behind planning: a heartbeat renews its
// shard's lease here before (and whether or not) it gets the coordinator's
// tables, and the lease sweep marks a silent shard DOWN here while a long
// placement or failover plan holds the tables. The tables learn of the
// shards marked DOWN when they can (TakeDown) and fail their chunks over
// then; until they do, a heartbeat from such a shard is already answered
// known=false (IsDown).
//
// It also keeps, per shard, the last reply the tables gave its heartbeat
// (its job assignments and checkpoint orders): a heartbeat that finds the
// tables busy is answered with it, its lease renewed, its report left for
// the next heartbeat (every report carries the shard's whole state).
//
// Thread-safe. Its lock is taken after every coordinator lock and it calls
// nothing outside itself while holding it.
#ifndef OPTIMUS_COORDINATOR_LEASE_TABLE_H_
#define OPTIMUS_COORDINATOR_LEASE_TABLE_H_

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/optimus.pb.h"

namespace optimus {

class LeaseTable {
 public:
  explicit LeaseTable(absl::Duration lease) : lease_(lease) {}
  LeaseTable(const LeaseTable&) = delete;
  LeaseTable& operator=(const LeaseTable&) = delete;

  // A live shard whose lease runs from `renewed` (registration: now;
  // recovery: later, to give it time to reconnect). `host` names it in
  // the log line that reports it DOWN; `identity` is the certificate name
  // it registered with (IdentityMatches). Replaces what was kept for `id`.
  void AddLive(uint64_t id, absl::Time renewed, std::string host, std::string identity);
  // A shard that is DOWN already (recovery): heartbeats for it are
  // refused; the tables know it is DOWN. Its lease age counts from `since`.
  void AddDown(uint64_t id, absl::Time since, std::string host, std::string identity);
  // Forgets the shard (a registration undone, a shard forgotten).
  void Remove(uint64_t id);
  void Clear();

  enum class Renewal {
    kRenewed,  // Live: its lease now runs from `now`.
    kDown,     // Its lease expired: it must register again.
    kUnknown,  // Never registered, or forgotten.
  };
  Renewal Renew(uint64_t id, absl::Time now);

  // Marks DOWN every live shard whose last renewal is older than the lease
  // at `now` (logging each), and queues them for TakeDown. Returns how
  // many.
  int SweepExpired(absl::Time now);
  // The shards marked DOWN by SweepExpired that the tables have not taken
  // yet, in id order; each is returned once.
  std::vector<uint64_t> TakeDown();

  bool IsDown(uint64_t id) const;
  // Whether `identity` registered shard `id` (true for an unknown id: its
  // heartbeat is told to register again).
  bool IdentityMatches(uint64_t id, const std::string& identity) const;
  // When the shard last renewed its lease (registration and recovery
  // count), or nullopt for an unknown one.
  std::optional<absl::Time> LastRenewal(uint64_t id) const;

  // What the tables last answered the shard's heartbeat (assignments and
  // checkpoint orders; released_jobs are not kept: a shard is told those
  // by the next full reply). Ignored for an unknown shard.
  void SetLastReply(uint64_t id, const v1::HeartbeatResponse& reply);
  // The last reply kept (a bare known=true one before the first), or
  // known=false for a shard that is unknown or DOWN.
  v1::HeartbeatResponse LastReply(uint64_t id) const;

  size_t size() const;
  absl::Duration lease() const { return lease_; }

 private:
  struct Lease {
    absl::Time renewed;
    bool down = false;
    std::string host;
    std::string identity;
    v1::HeartbeatResponse last_reply;
  };

  // The entry for `id`, emptied and set to these values.
  Lease& ResetLocked(uint64_t id, absl::Time renewed, std::string host, std::string identity)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration lease_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Lease> leases_ ABSL_GUARDED_BY(mu_);
  // Marked DOWN by SweepExpired, not yet taken by the tables.
  std::vector<uint64_t> down_untaken_ ABSL_GUARDED_BY(mu_);
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_LEASE_TABLE_H_
