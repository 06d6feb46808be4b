#include "coordinator/lease_table.h"

#include <algorithm>
#include <utility>

#include "common/logging.h"

namespace optimus {
namespace {
constexpr char kLog[] = "coord";
}  // namespace

LeaseTable::Lease& LeaseTable::ResetLocked(uint64_t id, absl::Time renewed, std::string host,
                                           std::string identity) {
  Lease& l = leases_[id];
  l = Lease();
  l.renewed = renewed;
  l.host = std::move(host);
  l.identity = std::move(identity);
  return l;
}

void LeaseTable::AddLive(uint64_t id, absl::Time renewed, std::string host,
                         std::string identity) {
  absl::MutexLock lock(&mu_);
  ResetLocked(id, renewed, std::move(host), std::move(identity)).last_reply.set_known(true);
}

void LeaseTable::AddDown(uint64_t id, absl::Time since, std::string host,
                         std::string identity) {
  absl::MutexLock lock(&mu_);
  ResetLocked(id, since, std::move(host), std::move(identity)).down = true;
}

void LeaseTable::Remove(uint64_t id) {
  absl::MutexLock lock(&mu_);
  leases_.erase(id);
  down_untaken_.erase(std::remove(down_untaken_.begin(), down_untaken_.end(), id),
                      down_untaken_.end());
}

void LeaseTable::Clear() {
  absl::MutexLock lock(&mu_);
  leases_.clear();
  down_untaken_.clear();
}

LeaseTable::Renewal LeaseTable::Renew(uint64_t id, absl::Time now) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(id);
  if (it == leases_.end()) return Renewal::kUnknown;
  if (it->second.down) return Renewal::kDown;
  it->second.renewed = std::max(it->second.renewed, now);
  return Renewal::kRenewed;
}

int LeaseTable::SweepExpired(absl::Time now) {
  absl::MutexLock lock(&mu_);
  int marked = 0;
  for (auto& [id, l] : leases_) {
    if (l.down || now - l.renewed <= lease_) continue;
    l.down = true;
    l.last_reply.Clear();
    down_untaken_.push_back(id);
    ++marked;
    OPTIMUS_LOG(Warning, kLog, "shard down id=", id, " host=", l.host, ": no heartbeat for ",
                absl::FormatDuration(now - l.renewed), " (lease ", absl::FormatDuration(lease_),
                ")");
  }
  return marked;
}

std::vector<uint64_t> LeaseTable::TakeDown() {
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t> out;
  out.swap(down_untaken_);
  std::sort(out.begin(), out.end());
  return out;
}

bool LeaseTable::IsDown(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(id);
  return it != leases_.end() && it->second.down;
}

bool LeaseTable::IdentityMatches(uint64_t id, const std::string& identity) const {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(id);
  return it == leases_.end() || it->second.identity == identity;
}

std::optional<absl::Time> LeaseTable::LastRenewal(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(id);
  if (it == leases_.end()) return std::nullopt;
  return it->second.renewed;
}

void LeaseTable::SetLastReply(uint64_t id, const v1::HeartbeatResponse& reply) {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(id);
  if (it == leases_.end() || it->second.down) return;
  v1::HeartbeatResponse& kept = it->second.last_reply;
  kept.Clear();
  kept.set_known(true);
  *kept.mutable_assignments() = reply.assignments();
  *kept.mutable_checkpoints() = reply.checkpoints();
}

v1::HeartbeatResponse LeaseTable::LastReply(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = leases_.find(id);
  if (it == leases_.end() || it->second.down) {
    v1::HeartbeatResponse unknown;
    unknown.set_known(false);
    return unknown;
  }
  return it->second.last_reply;
}

size_t LeaseTable::size() const {
  absl::MutexLock lock(&mu_);
  return leases_.size();
}

}  // namespace optimus
