#include "coordinator/etcd_leader.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"

namespace optimus {
namespace {
constexpr char kLog[] = "coord";
// After a failed keep-alive, the next try comes this soon.
constexpr absl::Duration kRetry = absl::Milliseconds(200);
}  // namespace

EtcdLeadership::EtcdLeadership(EtcdClient* client, EtcdLeadershipOptions options,
                               std::function<void(const absl::Status&)> on_lost)
    : client_(client), options_(std::move(options)), on_lost_(std::move(on_lost)) {}

EtcdLeadership::~EtcdLeadership() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  campaign_cancel_.Cancel();
  if (keepalive_.joinable()) keepalive_.join();
}

int64_t EtcdLeadership::lease_id() const {
  absl::MutexLock lock(&mu_);
  return lease_id_;
}

int64_t EtcdLeadership::granted_ttl() const {
  absl::MutexLock lock(&mu_);
  return ttl_;
}

absl::Status EtcdLeadership::Start() {
  absl::StatusOr<etcdserverpb::LeaseGrantResponse> lease = client_->LeaseGrant(options_.ttl_seconds);
  if (!lease.ok()) return lease.status();
  {
    absl::MutexLock lock(&mu_);
    lease_id_ = lease->id();
    ttl_ = lease->ttl();
  }
  OPTIMUS_LOG(Info, kLog, "etcd lease ", absl::Hex(lease->id()), " granted, TTL ", lease->ttl(),
              " s (asked ", options_.ttl_seconds, " s)");
  keepalive_ = std::thread([this] { KeepAliveLoop(); });
  return absl::OkStatus();
}

void EtcdLeadership::Lost(const absl::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    if (lost_ || stop_) return;
    lost_ = true;
  }
  if (on_lost_) on_lost_(why);
}

void EtcdLeadership::KeepAliveLoop() {
  // Until a renewal says otherwise, the lease runs out a TTL after it was
  // granted (counted from now, a little after: on the safe side it would be
  // earlier, but the first renewal comes a third of a TTL from now).
  absl::Time expiry;
  absl::Duration interval;
  {
    absl::MutexLock lock(&mu_);
    expiry = absl::Now() + absl::Seconds(ttl_);
    interval = absl::Seconds(std::max<int64_t>(ttl_, 1)) / 3;
  }
  absl::Duration wait = interval;
  while (true) {
    int64_t id;
    std::optional<v3electionpb::LeaderKey> leader;
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), wait)) return;
      if (lost_) return;
      id = lease_id_;
      leader = leader_;
    }
    const absl::Time sent = absl::Now();
    absl::StatusOr<int64_t> ttl = client_->LeaseKeepAliveOnce(id);
    if (ttl.ok()) {
      expiry = sent + absl::Seconds(*ttl);
      wait = interval;
      if (leader.has_value()) {
        // Leading: the key must still be ours (an operator may have deleted
        // it, or etcd's history been restored from a backup).
        etcdserverpb::RangeRequest req;
        req.set_key(leader->key());
        absl::StatusOr<etcdserverpb::RangeResponse> r = client_->Range(req);
        if (r.ok() && (r->kvs_size() == 0 || r->kvs(0).create_revision() != leader->rev())) {
          Lost(absl::FailedPreconditionError(absl::StrCat(
              "election key ", leader->key(), " (create revision ", leader->rev(),
              ") is gone: another coordinator may lead")));
          return;
        }
      }
      continue;
    }
    if (ttl.status().code() == absl::StatusCode::kNotFound) {
      Lost(ttl.status());
      return;
    }
    OPTIMUS_LOG(Warning, kLog, "etcd lease keep-alive failed: ", ttl.status().ToString());
    wait = kRetry;
    if (absl::Now() >= expiry) {
      Lost(absl::UnavailableError(absl::StrCat(
          "etcd lease ", absl::Hex(id), " not renewed before its TTL ran out (last error: ",
          ttl.status().ToString(), ")")));
      return;
    }
  }
}

absl::StatusOr<v3electionpb::LeaderKey> EtcdLeadership::Campaign() {
  while (true) {
    const int64_t id = lease_id();
    absl::StatusOr<v3electionpb::LeaderKey> key = client_->Campaign(
        election(), id, options_.value, options_.campaign_timeout, &campaign_cancel_);
    if (key.ok()) {
      if (key->lease() != id) {
        return absl::InternalError(absl::StrCat("etcd Campaign answered with lease ",
                                                absl::Hex(key->lease()), ", not ours (",
                                                absl::Hex(id), ")"));
      }
      absl::MutexLock lock(&mu_);
      if (lost_) return absl::FailedPreconditionError("etcd lease lost while campaigning");
      leader_ = *key;
      return *key;
    }
    if (campaign_cancel_.cancelled()) return absl::CancelledError("campaign cancelled");
    switch (key.status().code()) {
      case absl::StatusCode::kDeadlineExceeded:
        // etcd withdrew the candidacy; campaign again.
        continue;
      case absl::StatusCode::kUnknown:
        // etcd's own transient errors come as UNKNOWN with its message
        // (while it elects a raft leader after a member died): campaign
        // again. Any other UNKNOWN ends the campaign.
        if (!absl::StrContains(key.status().message(), "request timed out") &&
            !absl::StrContains(key.status().message(), "leader changed") &&
            !absl::StrContains(key.status().message(), "no leader")) {
          return key.status();
        }
        OPTIMUS_LOG(Warning, kLog, "campaigning: ", key.status().ToString());
        absl::SleepFor(absl::Milliseconds(500));
        continue;
      case absl::StatusCode::kUnavailable:
        // No member answered: the keep-alive thread gives up when the lease
        // would have run out; until then, try again.
        OPTIMUS_LOG(Warning, kLog, "campaigning: ", key.status().ToString());
        absl::SleepFor(absl::Milliseconds(500));
        continue;
      default:
        return key.status();
    }
  }
}

void EtcdLeadership::CancelCampaign() { campaign_cancel_.Cancel(); }

absl::Status EtcdLeadership::Resign() {
  std::optional<v3electionpb::LeaderKey> leader;
  int64_t id;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    leader = leader_;
    id = lease_id_;
  }
  if (keepalive_.joinable()) keepalive_.join();
  absl::Status status;
  if (leader.has_value()) {
    status = client_->Resign(*leader);
    if (!status.ok()) OPTIMUS_LOG(Warning, kLog, "resigning: ", status.ToString());
  }
  if (id != 0) {
    // Revoking deletes the key too (and a standby's candidacy).
    absl::Status r = client_->LeaseRevoke(id);
    if (!r.ok() && r.code() != absl::StatusCode::kNotFound) {
      OPTIMUS_LOG(Warning, kLog, "revoking etcd lease: ", r.ToString());
      if (status.ok()) status = r;
    }
  }
  return status;
}

}  // namespace optimus
