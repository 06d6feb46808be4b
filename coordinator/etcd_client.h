// A small client of etcd's v3 gRPC API (KV, Lease, Election), over the C++
// stubs generated from the .proto files of Debian's golang-etcd-server-dev
// (bazel/etcd_api.BUILD). What the coordinator's etcd mode needs, no more:
// the state's keys (EtcdStateStore), its lease and its election
// (EtcdLeadership).
//
// Several endpoints, one cluster: a call goes to the endpoint that answered
// last and, when that one is UNAVAILABLE (a member down or without a raft
// leader), to the next, each once. Every call has a deadline (the client's
// call_timeout, or one given for calls that wait: Campaign, Observe); a
// call that runs out of it is DEADLINE_EXCEEDED and the next call starts at
// the next endpoint (a member that stopped answering). Errors are
// absl::Status with the call, the endpoint and etcd's message, e.g.
// "etcd Txn at 127.0.0.1:2379: UNAVAILABLE: etcdserver: no leader".
//
// Plain-text connections only (etcd's --listen-client-urls http://...):
// TLS and etcd's authentication are not supported yet. Thread-safe.
#ifndef OPTIMUS_COORDINATOR_ETCD_CLIENT_H_
#define OPTIMUS_COORDINATOR_ETCD_CLIENT_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "etcd/etcdserver/api/v3election/v3electionpb/v3election.grpc.pb.h"
#include "etcd/etcdserver/etcdserverpb/rpc.grpc.pb.h"
#include "etcd/mvcc/mvccpb/kv.pb.h"

namespace grpc {
class ClientContext;
}  // namespace grpc

namespace optimus {

// "h:p,h:p" (an http:// in front of each is accepted and dropped) to
// "h:p" entries. INVALID_ARGUMENT naming the bad entry for an empty list,
// an https:// endpoint (TLS is not supported) or one without a port.
absl::StatusOr<std::vector<std::string>> ParseEtcdEndpoints(absl::string_view list);

// The end of the key range of every key starting with `prefix` (etcd's
// range_end for a prefix): `prefix` with its last byte below 0xff
// incremented and what follows dropped.
std::string EtcdPrefixEnd(absl::string_view prefix);

// Lets another thread end a waiting call (Campaign, Observe) at once: the
// call returns CANCELLED. Once cancelled it stays so: a call made with it
// later fails at once.
class EtcdCancel {
 public:
  void Cancel();
  bool cancelled() const;

 private:
  friend class EtcdClient;
  // False when already cancelled (the call must not start).
  bool Attach(grpc::ClientContext* ctx);
  void Detach();

  mutable absl::Mutex mu_;
  grpc::ClientContext* ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

struct EtcdClientOptions {
  // "host:port" of the cluster's members (at least one).
  std::vector<std::string> endpoints;
  // Deadline of every call that does not wait on purpose. Default 5 s.
  absl::Duration call_timeout = absl::Seconds(5);
};

class EtcdClient {
 public:
  // INVALID_ARGUMENT without endpoints or with a timeout <= 0. Connects
  // lazily: a cluster that is down makes the calls fail, not this.
  static absl::StatusOr<std::unique_ptr<EtcdClient>> Create(EtcdClientOptions options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // KV.
  absl::StatusOr<etcdserverpb::RangeResponse> Range(const etcdserverpb::RangeRequest& req);
  absl::StatusOr<etcdserverpb::TxnResponse> Txn(const etcdserverpb::TxnRequest& req);
  absl::StatusOr<etcdserverpb::PutResponse> Put(const etcdserverpb::PutRequest& req);
  absl::StatusOr<etcdserverpb::DeleteRangeResponse> DeleteRange(
      const etcdserverpb::DeleteRangeRequest& req);

  // Lease. LeaseGrant: a new lease of at least ttl_seconds (etcd raises a
  // TTL below its minimum, 2 s with its default timings; the response says
  // what it granted). LeaseKeepAliveOnce: one keep-alive round trip; the
  // lease's TTL from now, in seconds; NOT_FOUND when the lease expired or
  // was revoked. LeaseRevoke: deletes the lease and every key attached to
  // it; NOT_FOUND when it is gone already.
  absl::StatusOr<etcdserverpb::LeaseGrantResponse> LeaseGrant(int64_t ttl_seconds);
  absl::StatusOr<int64_t> LeaseKeepAliveOnce(int64_t lease_id);
  absl::Status LeaseRevoke(int64_t lease_id);

  // Election (etcd's v3election service). Campaign waits until the caller
  // leads election `name` with its key attached to `lease_id` (a key
  // name/<lease in hex>, whose create revision orders the candidates), or
  // until `timeout` (DEADLINE_EXCEEDED: etcd then withdraws the candidacy)
  // or `cancel`. Leader: the leader's key and value, std::nullopt when
  // nobody leads. Observe calls `on_leader` with the leader and with every
  // new one until it returns false (OK), `timeout` or `cancel`. Resign ends
  // the leadership `leader` names (its key is deleted; the next candidate
  // leads).
  absl::StatusOr<v3electionpb::LeaderKey> Campaign(absl::string_view name, int64_t lease_id,
                                                   absl::string_view value, absl::Duration timeout,
                                                   EtcdCancel* cancel = nullptr);
  absl::StatusOr<std::optional<mvccpb::KeyValue>> Leader(absl::string_view name);
  absl::Status Observe(absl::string_view name,
                       const std::function<bool(const mvccpb::KeyValue&)>& on_leader,
                       absl::Duration timeout, EtcdCancel* cancel = nullptr);
  absl::Status Resign(const v3electionpb::LeaderKey& leader);

  // "127.0.0.1:2379,127.0.0.1:22379" for logs.
  std::string Describe() const;

 private:
  struct Endpoint;
  explicit EtcdClient(EtcdClientOptions options);

  // Runs `call` on the current endpoint, then on the next ones while they
  // are UNAVAILABLE. `call` gets the endpoint and a context with the
  // deadline set, and returns gRPC's status.
  absl::Status Call(const char* what, absl::Duration timeout, EtcdCancel* cancel,
                    const std::function<grpc::Status(Endpoint&, grpc::ClientContext*)>& call);

  // Keeps every channel that is not READY connecting (see the .cc).
  void KeepConnecting();

  const EtcdClientOptions options_;
  std::vector<std::unique_ptr<Endpoint>> endpoints_;
  // Where the next call starts.
  std::atomic<size_t> current_{0};
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread connector_;
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_ETCD_CLIENT_H_
