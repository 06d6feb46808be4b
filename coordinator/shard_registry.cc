#include "coordinator/shard_registry.h"

#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace optimus {
namespace {
constexpr char kLog[] = "coord";

const char* StateName(v1::ShardState s) {
  switch (s) {
    case v1::SHARD_STATE_UP: return "UP";
    case v1::SHARD_STATE_DRAINING: return "DRAINING";
    case v1::SHARD_STATE_DOWN: return "DOWN";
    default: return "UNSPECIFIED";
  }
}
}  // namespace

void ShardRegistry::AddShardDownListener(ShardDownListener listener) {
  listeners_.push_back(std::move(listener));
}

const ShardRecord& ShardRegistry::Register(const v1::ShardCapabilities& caps) {
  ShardRecord shard;
  shard.id = next_id_++;
  shard.capabilities = caps;
  ++generation_;
  return shards_[shard.id] = std::move(shard);
}

void ShardRegistry::Unregister(uint64_t id) {
  shards_.erase(id);
  ++generation_;
  if (id + 1 == next_id_) --next_id_;
}

ShardRecord* ShardRegistry::Report(uint64_t id, uint64_t memory_used_bytes,
                                   uint32_t chunks_reported) {
  auto it = shards_.find(id);
  // A DRAINING shard still holds chunks and keeps reporting.
  if (it == shards_.end() || it->second.state == v1::SHARD_STATE_DOWN) return nullptr;
  ShardRecord& shard = it->second;
  shard.memory_used_bytes = memory_used_bytes;
  shard.chunks_reported = chunks_reported;
  return &shard;
}

int ShardRegistry::MarkDown(const std::vector<uint64_t>& ids, absl::Time now) {
  std::vector<uint64_t> down;
  for (uint64_t id : ids) {
    auto it = shards_.find(id);
    if (it == shards_.end() || it->second.state == v1::SHARD_STATE_DOWN) continue;
    ShardRecord& shard = it->second;
    if (shard.state == v1::SHARD_STATE_DRAINING) {
      OPTIMUS_LOG(Info, kLog, "shard ", id, " was draining when it went down");
    }
    shard.state = v1::SHARD_STATE_DOWN;
    shard.down_since = now;
    down.push_back(id);
  }
  if (!down.empty()) {
    ++generation_;
    for (const ShardDownListener& l : listeners_) l(down);
  }
  return static_cast<int>(down.size());
}

absl::StatusOr<ShardRecord> ShardRegistry::Forget(uint64_t id) {
  auto it = shards_.find(id);
  if (it == shards_.end()) return absl::NotFoundError(absl::StrCat("no shard with id ", id));
  if (it->second.state != v1::SHARD_STATE_DOWN) {
    return absl::FailedPreconditionError(absl::StrCat(
        "shard ", id, " is ", StateName(it->second.state),
        ": only a DOWN shard can be forgotten (drain it, stop it, and wait for its lease to "
        "expire)"));
  }
  ShardRecord out = std::move(it->second);
  shards_.erase(it);
  ++generation_;
  return out;
}

std::vector<ShardRecord> ShardRegistry::ForgetDownLongerThan(absl::Duration grace,
                                                             absl::Time now) {
  std::vector<ShardRecord> out;
  for (auto it = shards_.begin(); it != shards_.end();) {
    if (it->second.state == v1::SHARD_STATE_DOWN && now - it->second.down_since > grace) {
      out.push_back(std::move(it->second));
      it = shards_.erase(it);
      ++generation_;
    } else {
      ++it;
    }
  }
  return out;
}

void ShardRegistry::Restore(ShardRecord record) {
  const uint64_t id = record.id;
  shards_[id] = std::move(record);
  ++generation_;
}

ShardRecord* ShardRegistry::Find(uint64_t id) {
  auto it = shards_.find(id);
  return it == shards_.end() ? nullptr : &it->second;
}

const ShardRecord* ShardRegistry::Find(uint64_t id) const {
  auto it = shards_.find(id);
  return it == shards_.end() ? nullptr : &it->second;
}

ShardHealthMap ShardRegistry::Health() const {
  ShardHealthMap health;
  for (const auto& [id, shard] : shards_) {
    health[id] = shard.state == v1::SHARD_STATE_UP         ? ShardHealth::kUp
                 : shard.state == v1::SHARD_STATE_DRAINING ? ShardHealth::kDraining
                                                           : ShardHealth::kDown;
  }
  return health;
}

}  // namespace optimus
