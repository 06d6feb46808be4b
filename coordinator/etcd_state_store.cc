#include "coordinator/etcd_state_store.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/logging.h"
#include "proto/optimus.pb.h"

namespace optimus {
namespace {

constexpr char kLog[] = "coord";
// Room left in a Txn for its compare and framing.
constexpr int64_t kTxnSlackBytes = 64 * 1024;
// Keys per Range page on Load: at most 100 large-job parts (50 MiB) per
// answer, under the client's 64 MiB receive limit.
constexpr int64_t kRangePage = 100;

std::string Id20(uint64_t id) { return absl::StrFormat("%020d", id); }

// FNV-1a, 64 bits: stable across processes (names a large job's parts).
std::string Fnv1a64Hex(absl::string_view bytes) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return absl::StrFormat("%016x", h);
}

std::string PartKey(const std::string& head, const std::string& hash, int64_t i) {
  return absl::StrCat(head, "/part/", hash, "/", absl::StrFormat("%06d", i));
}

}  // namespace

EtcdStateStore::EtcdStateStore(EtcdClient* client, EtcdFence fence, EtcdStateStoreOptions options)
    : client_(client),
      fence_(std::move(fence)),
      options_(std::move(options)),
      state_prefix_(absl::StrCat(options_.prefix, "/state/")) {
  const int64_t budget = std::max<int64_t>(options_.max_request_bytes - kTxnSlackBytes, 16 * 1024);
  value_bytes_ = std::max<int64_t>(std::min(options_.max_value_bytes, budget / 3), 1024);
}

std::string EtcdStateStore::Describe() const {
  return absl::StrCat("etcd ", client_->Describe(), " ", state_prefix_);
}

EtcdStateStore::SaveStats EtcdStateStore::last_save() const {
  absl::MutexLock lock(&mu_);
  return last_save_;
}

int EtcdStateStore::PhaseOf(const std::string& key, bool is_delete) const {
  absl::string_view rel(key);
  rel.remove_prefix(std::min(rel.size(), state_prefix_.size()));
  const bool meta = rel == "meta";
  const bool shard = absl::StartsWith(rel, "shard/");
  const bool job = absl::StartsWith(rel, "job/");
  const bool part = job && absl::StrContains(rel, "/part/");
  // Any prefix of the phases leaves a state Load accepts: ids never go
  // back, a job's map never names a shard not yet written, a job's head
  // never names parts not yet written.
  if (!is_delete) {
    if (meta) return 0;
    if (shard) return 1;
    if (part) return 2;
    if (job) return 3;
    return 4;
  }
  if (job && !part) return 5;
  if (part) return 6;
  if (shard) return 7;
  return 8;
}

absl::StatusOr<std::map<std::string, std::string>> EtcdStateStore::Encode(
    absl::string_view bytes) const {
  v1::CoordinatorState state;
  if (!state.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::InvalidArgumentError("state handed to the etcd store does not parse");
  }
  std::map<std::string, std::string> out;
  v1::CoordinatorState meta;
  meta.set_next_shard_id(state.next_shard_id());
  meta.set_next_job_id(state.next_job_id());
  meta.set_data_plane_key(state.data_plane_key());
  out[state_prefix_ + "meta"] = meta.SerializeAsString();
  for (const v1::PersistedShard& s : state.shards()) {
    out[absl::StrCat(state_prefix_, "shard/", Id20(s.shard_id()))] = s.SerializeAsString();
  }
  for (const v1::PersistedJob& j : state.jobs()) {
    const std::string head = absl::StrCat(state_prefix_, "job/", Id20(j.job_id()));
    const std::string job_bytes = j.SerializeAsString();
    const int64_t size = static_cast<int64_t>(job_bytes.size());
    if (size <= value_bytes_) {
      out[head] = absl::StrCat("i", job_bytes);
      continue;
    }
    const std::string hash = Fnv1a64Hex(job_bytes);
    const int64_t parts = (size + value_bytes_ - 1) / value_bytes_;
    out[head] = absl::StrCat("p", hash, " ", parts, " ", size);
    for (int64_t i = 0; i < parts; ++i) {
      out[PartKey(head, hash, i)] = job_bytes.substr(i * value_bytes_, value_bytes_);
    }
  }
  return out;
}

absl::Status EtcdStateStore::ReadAll(std::map<std::string, std::string>* kvs) const {
  etcdserverpb::RangeRequest req;
  req.set_key(state_prefix_);
  req.set_range_end(EtcdPrefixEnd(state_prefix_));
  req.set_limit(kRangePage);
  int64_t revision = 0;
  while (true) {
    if (revision != 0) req.set_revision(revision);
    absl::StatusOr<etcdserverpb::RangeResponse> r = client_->Range(req);
    if (!r.ok()) {
      return absl::Status(r.status().code(),
                          absl::StrCat("reading state from etcd: ", r.status().message()));
    }
    if (revision == 0) revision = r->header().revision();
    for (const mvccpb::KeyValue& kv : r->kvs()) (*kvs)[kv.key()] = kv.value();
    if (!r->more() || r->kvs_size() == 0) return absl::OkStatus();
    // The next page starts just after the last key.
    req.set_key(r->kvs(r->kvs_size() - 1).key() + std::string(1, '\0'));
  }
}

absl::Status EtcdStateStore::Save(absl::string_view bytes) {
  absl::StatusOr<std::map<std::string, std::string>> desired = Encode(bytes);
  if (!desired.ok()) return desired.status();
  absl::Status fenced;
  {
    absl::MutexLock lock(&mu_);
    if (!known_.has_value()) {
      std::map<std::string, std::string> kvs;
      if (absl::Status s = ReadAll(&kvs); !s.ok()) return s;
      known_.emplace();
      for (auto& [k, v] : kvs) (*known_)[k] = std::move(v);
    }
    std::vector<Op> ops;
    for (const auto& [k, v] : *desired) {
      auto it = known_->find(k);
      if (it == known_->end() || !it->second.has_value() || *it->second != v) {
        ops.push_back(Op{PhaseOf(k, false), k, v});
      }
    }
    for (const auto& [k, v] : *known_) {
      if (desired->find(k) == desired->end()) ops.push_back(Op{PhaseOf(k, true), k, std::nullopt});
    }
    std::stable_sort(ops.begin(), ops.end(),
                     [](const Op& a, const Op& b) { return a.phase < b.phase; });
    last_save_ = SaveStats{};
    for (const Op& op : ops) (op.value.has_value() ? last_save_.puts : last_save_.deletes)++;
    const int64_t budget = std::max<int64_t>(options_.max_request_bytes - kTxnSlackBytes, 16 * 1024);
    size_t i = 0;
    while (i < ops.size()) {
      etcdserverpb::TxnRequest txn;
      if (!fence_.key.empty()) {
        etcdserverpb::Compare* c = txn.add_compare();
        c->set_result(etcdserverpb::Compare::EQUAL);
        c->set_target(etcdserverpb::Compare::CREATE);
        c->set_key(fence_.key);
        c->set_create_revision(fence_.create_revision);
      }
      const size_t first = i;
      int64_t txn_bytes = static_cast<int64_t>(txn.ByteSizeLong());
      while (i < ops.size() && static_cast<int>(i - first) < options_.max_txn_ops) {
        etcdserverpb::RequestOp op;
        if (ops[i].value.has_value()) {
          op.mutable_request_put()->set_key(ops[i].key);
          op.mutable_request_put()->set_value(*ops[i].value);
        } else {
          op.mutable_request_delete_range()->set_key(ops[i].key);
        }
        const int64_t op_bytes = static_cast<int64_t>(op.ByteSizeLong()) + 8;
        if (i > first && txn_bytes + op_bytes > budget) break;
        *txn.add_success() = std::move(op);
        txn_bytes += op_bytes;
        ++i;
      }
      ++last_save_.txns;
      absl::StatusOr<etcdserverpb::TxnResponse> r = client_->Txn(txn);
      if (!r.ok()) {
        // It may or may not have been applied: write those keys again next time.
        for (size_t k = first; k < i; ++k) {
          if (ops[k].value.has_value()) (*known_)[ops[k].key] = std::nullopt;
        }
        return absl::Status(r.status().code(),
                            absl::StrCat("saving state to etcd (", first, " of ", ops.size(),
                                         " changed keys written): ", r.status().message()));
      }
      if (!r->succeeded()) {
        fenced = absl::FailedPreconditionError(absl::StrCat(
            "saving state to etcd: fenced off: election key ", fence_.key, " (create revision ",
            fence_.create_revision,
            ") is gone, another coordinator leads; nothing was written by this save"
            " (", first, " of ", ops.size(), " changed keys were written before)"));
        break;
      }
      for (size_t k = first; k < i; ++k) {
        if (ops[k].value.has_value()) {
          (*known_)[ops[k].key] = *ops[k].value;
        } else {
          known_->erase(ops[k].key);
        }
      }
    }
  }
  if (!fenced.ok()) {
    OPTIMUS_LOG(Error, kLog, fenced.message());
    if (options_.on_fenced) options_.on_fenced(fenced);
    return fenced;
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<std::string>> EtcdStateStore::Load() {
  std::map<std::string, std::string> kvs;
  if (absl::Status s = ReadAll(&kvs); !s.ok()) return s;
  {
    absl::MutexLock lock(&mu_);
    known_.emplace();
    for (const auto& [k, v] : kvs) (*known_)[k] = v;
  }
  if (kvs.empty()) return std::nullopt;
  auto meta = kvs.find(state_prefix_ + "meta");
  if (meta == kvs.end()) {
    return absl::DataLossError(absl::StrCat("etcd holds keys under ", state_prefix_, " but no ",
                                            state_prefix_, "meta (the ids' counters)"));
  }
  v1::CoordinatorState state;
  if (!state.ParseFromString(meta->second)) {
    return absl::DataLossError(absl::StrCat("etcd key ", meta->first, " does not parse"));
  }
  for (const auto& [key, value] : kvs) {
    absl::string_view rel(key);
    rel.remove_prefix(state_prefix_.size());
    if (absl::StartsWith(rel, "shard/")) {
      if (!state.add_shards()->ParseFromString(value)) {
        return absl::DataLossError(absl::StrCat("etcd key ", key, " does not parse as a shard"));
      }
    } else if (absl::StartsWith(rel, "job/") && !absl::StrContains(rel, "/part/")) {
      v1::PersistedJob* job = state.add_jobs();
      bool parsed = false;
      if (absl::StartsWith(value, "i")) {
        parsed = job->ParseFromArray(value.data() + 1, static_cast<int>(value.size() - 1));
      } else if (absl::StartsWith(value, "p")) {
        std::vector<std::string> f = absl::StrSplit(value.substr(1), ' ');
        int64_t parts = 0, size = 0;
        if (f.size() != 3 || !absl::SimpleAtoi(f[1], &parts) || !absl::SimpleAtoi(f[2], &size)) {
          return absl::DataLossError(absl::StrCat("etcd key ", key, ": bad parts manifest"));
        }
        std::string whole;
        for (int64_t i = 0; i < parts; ++i) {
          auto p = kvs.find(PartKey(key, f[0], i));
          if (p == kvs.end()) {
            return absl::DataLossError(
                absl::StrCat("etcd key ", PartKey(key, f[0], i), " missing (a part of ", key, ")"));
          }
          whole += p->second;
        }
        if (static_cast<int64_t>(whole.size()) != size || Fnv1a64Hex(whole) != f[0]) {
          return absl::DataLossError(
              absl::StrCat("etcd key ", key, ": its parts do not add up to what it names"));
        }
        parsed = job->ParseFromString(whole);
      }
      if (!parsed) {
        return absl::DataLossError(absl::StrCat("etcd key ", key, " does not parse as a job"));
      }
    }
    // meta was read above; parts are read through their job; a part no job
    // names (left by a crash between Txns) is deleted by the next Save.
  }
  std::string out;
  if (!state.SerializeToString(&out)) return absl::InternalError("serializing loaded state");
  OPTIMUS_LOG(Info, kLog, "read ", kvs.size(), " keys (", out.size(), " state bytes) from ",
              Describe());
  return std::optional<std::string>(std::move(out));
}

}  // namespace optimus
