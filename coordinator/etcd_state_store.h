// The coordinator's durable state in etcd (optimus-coord --etcd_endpoints),
// one key per entry rather than one blob, so that a change costs what
// changed: registering a shard writes one small key, not every job's map.
// Under `<prefix>/state/`:
//
//   meta                     the counters (next shard and job ids) and the
//                            data-plane key: a CoordinatorState without
//                            shards or jobs
//   shard/<id, 20 digits>    one PersistedShard
//   job/<id, 20 digits>      one PersistedJob with its map: "i" + its bytes,
//                            or, when larger than max_value_bytes, "p" +
//                            "<hash> <parts> <bytes>" naming its parts
//   job/<id>/part/<hash>/<n> the parts of a large job, each at most
//                            max_value_bytes, under the 16-hex-digit FNV-1a
//                            hash of the whole (so an unchanged job keeps
//                            its keys and a changed one gets new ones)
//
// Save parses the CoordinatorState it is handed, writes the keys whose
// bytes differ from what the last successful Save (or Load) left and
// deletes the keys no longer there, in one Txn whose compare requires this
// coordinator's election key to still exist with its create revision: a
// coordinator that lost its leadership (its lease expired, a standby now
// leads) cannot write, its Save fails with FAILED_PRECONDITION and changes
// nothing, and on_fenced is called (optimus-coord exits).
//
// etcd caps a request (--max-request-bytes, 1.5 MiB by default) and the
// operations of one Txn (--max-txn-ops, 128 by default). A Save over either
// is split into several Txns, each fenced, in an order such that a crash
// between two leaves a state Load can use: the counters first, then
// shards, then large jobs' parts, then jobs, then deletions (jobs before
// their parts, then shards). Most Saves (a shard registered, a job's map
// changed) are one Txn.
//
// Load reads every key under the prefix in pages at one revision and
// reassembles the CoordinatorState (shards and jobs in id order).
// Thread-safe; Save is called from the coordinator's writer thread.
#ifndef OPTIMUS_COORDINATOR_ETCD_STATE_STORE_H_
#define OPTIMUS_COORDINATOR_ETCD_STATE_STORE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/etcd_client.h"
#include "coordinator/state_store.h"

namespace optimus {

// Which election key a writer must still hold (v3electionpb::LeaderKey's
// key and rev). An empty key writes unfenced (benchmarks and tools only).
struct EtcdFence {
  std::string key;
  int64_t create_revision = 0;
};

struct EtcdStateStoreOptions {
  // Keys go under prefix + "/state/". Default "/optimus".
  std::string prefix = "/optimus";
  // etcd's --max-request-bytes: a Txn stays 64 KiB below it. Default etcd's
  // default, 1.5 MiB.
  int64_t max_request_bytes = 1536 * 1024;
  // etcd's --max-txn-ops: most puts and deletes in one Txn. Default etcd's
  // default, 128.
  int max_txn_ops = 128;
  // A job larger than this is split into parts of this size. Default
  // 512 KiB; lowered to a third of a Txn when max_request_bytes is small.
  int64_t max_value_bytes = 512 * 1024;
  // Called (on the saving thread) when a Save was fenced off: another
  // coordinator leads. optimus-coord logs and exits there.
  std::function<void(const absl::Status&)> on_fenced;
};

class EtcdStateStore : public StateStore {
 public:
  // Borrows `client`, which must outlive it.
  EtcdStateStore(EtcdClient* client, EtcdFence fence, EtcdStateStoreOptions options);

  absl::Status Save(absl::string_view bytes) override;
  absl::StatusOr<std::optional<std::string>> Load() override;
  std::string Describe() const override;

  // Puts and deletes of the last Save, and the Txns they took (tests).
  struct SaveStats {
    int puts = 0;
    int deletes = 0;
    int txns = 0;
  };
  SaveStats last_save() const;

  // The key prefix everything lives under: prefix + "/state/".
  const std::string& state_prefix() const { return state_prefix_; }

 private:
  struct Op {
    int phase = 0;
    std::string key;
    std::optional<std::string> value;  // nullopt: delete
  };

  // The keys and values a CoordinatorState is kept as.
  absl::StatusOr<std::map<std::string, std::string>> Encode(absl::string_view bytes) const;
  // Reads every key under the prefix; fills *kvs. At one revision.
  absl::Status ReadAll(std::map<std::string, std::string>* kvs) const;
  int PhaseOf(const std::string& key, bool is_delete) const;

  EtcdClient* const client_;
  const EtcdFence fence_;
  const EtcdStateStoreOptions options_;
  const std::string state_prefix_;
  int64_t value_bytes_ = 0;

  mutable absl::Mutex mu_;
  // What etcd holds under the prefix as far as this store knows: the value
  // of each key after the last successful write or read, std::nullopt for
  // a key whose write may or may not have happened (it is written again,
  // or deleted, at the next Save). Unset until the first Load or Save.
  std::optional<std::map<std::string, std::optional<std::string>>> known_ ABSL_GUARDED_BY(mu_);
  SaveStats last_save_ ABSL_GUARDED_BY(mu_);
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_ETCD_STATE_STORE_H_
