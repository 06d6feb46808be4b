// Leadership of the coordinators that share an etcd prefix (optimus-coord
// --etcd_endpoints): each holds an etcd lease, kept alive by a thread of
// its own, and campaigns in etcd's election `<prefix>/election` with its
// advertise address as the value. The one whose key is oldest leads; the
// others wait in Campaign (standby). When the leader dies its lease
// expires after its TTL, etcd deletes its key and the next candidate's
// Campaign returns.
//
// A leader that cannot renew its lease before the lease would have expired
// (as far as it can tell: the last renewal's send time + its TTL), whose
// lease etcd no longer knows, or whose election key is gone, is told so
// through on_lost, once: optimus-coord logs and exits, to be restarted as a
// standby. Its state writes are fenced off anyway (EtcdStateStore).
#ifndef OPTIMUS_COORDINATOR_ETCD_LEADER_H_
#define OPTIMUS_COORDINATOR_ETCD_LEADER_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "coordinator/etcd_client.h"

namespace optimus {

struct EtcdLeadershipOptions {
  // The election is prefix + "/election". Default "/optimus".
  std::string prefix = "/optimus";
  // What the leader's key holds: where clients reach it.
  std::string value;
  // The lease's TTL asked for; etcd raises it to its minimum (2 s with its
  // default timings). Default 2.
  int64_t ttl_seconds = 2;
  // One Campaign call waits this long, then campaigns again. Default 60 s.
  absl::Duration campaign_timeout = absl::Seconds(60);
};

class EtcdLeadership {
 public:
  // Borrows `client`, which must outlive it.
  EtcdLeadership(EtcdClient* client, EtcdLeadershipOptions options,
                 std::function<void(const absl::Status&)> on_lost);
  // Stops the keep-alive thread (does not resign: see Resign).
  ~EtcdLeadership();
  EtcdLeadership(const EtcdLeadership&) = delete;
  EtcdLeadership& operator=(const EtcdLeadership&) = delete;

  // Grants the lease and starts keeping it alive. Call once.
  absl::Status Start();
  // Waits until this process leads; CANCELLED after CancelCampaign().
  absl::StatusOr<v3electionpb::LeaderKey> Campaign();
  // Ends a Campaign waiting in another thread (shutdown).
  void CancelCampaign();
  // Gives leadership (or candidacy) up at once: resigns, stops the
  // keep-alive and revokes the lease, so that the next candidate leads now
  // rather than after a TTL. on_lost is not called after this.
  absl::Status Resign();

  std::string election() const { return options_.prefix + "/election"; }
  int64_t lease_id() const;
  // The TTL etcd granted, in seconds.
  int64_t granted_ttl() const;

 private:
  void KeepAliveLoop();
  void Lost(const absl::Status& why);

  EtcdClient* const client_;
  const EtcdLeadershipOptions options_;
  const std::function<void(const absl::Status&)> on_lost_;
  EtcdCancel campaign_cancel_;

  mutable absl::Mutex mu_;
  int64_t lease_id_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t ttl_ ABSL_GUARDED_BY(mu_) = 0;
  std::optional<v3electionpb::LeaderKey> leader_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool lost_ ABSL_GUARDED_BY(mu_) = false;
  std::thread keepalive_;
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_ETCD_LEADER_H_
