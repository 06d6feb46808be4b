// Talking to "the coordinator" when there may be several: with state in etcd
// (docs/operations.md "Two coordinators"), one optimus-coord leads and the
// others stand by without listening on their gRPC port; when the leader dies
// a standby takes over and starts listening. Everything that takes a
// coordinator address (optimus-shard, the client library and its Python
// binding, optimusctl, the local cluster, the test harness) takes a list,
// "host:port,host:port", and follows whichever of them answers.
//
// How it follows: one gRPC channel per address (so that each address is
// resolved by DNS as usual, and TLS checks each coordinator's certificate
// against the name it was dialled by). Calls go to the current one; a call
// that ends UNAVAILABLE (nothing listens there: a standby, or a dead
// leader) or DEADLINE_EXCEEDED while not connected moves the next call to
// another address that is connected, else to the next one in the list, and
// starts a connection attempt on every other address. Callers keep the
// retries they already have (heartbeats every lease/3, joins with backoff):
// they are what carries a caller across the gap between the leader's death
// and the standby's election. A list of one address is exactly one channel
// with the caller's settings, as before lists existed.
//
// Thread-safe.
#ifndef OPTIMUS_COMMON_COORDINATOR_CHANNELS_H_
#define OPTIMUS_COMMON_COORDINATOR_CHANNELS_H_

#include <cstddef>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/security.h"
#include "grpcpp/grpcpp.h"

namespace optimus {

// Splits a --coordinator value into addresses. Accepted:
//   "host:port"                      one address (DNS name, IPv4 literal)
//   "[v6]:port"                      an IPv6 literal
//   "a:7070,b:7071, c:7072"          several, comma-separated (spaces trimmed)
//   "dns:///h:p", "ipv4:a:p,b:p",    a gRPC target with its scheme: one
//   "unix:/path", ...                entry, given to gRPC as is (gRPC's own
//                                    ipv4:/ipv6: lists included)
// INVALID_ARGUMENT, naming the entry and what is wrong, for an empty value,
// an empty entry, a missing or bad port (1-65535), a malformed host, or an
// address listed twice.
absl::StatusOr<std::vector<std::string>> ParseCoordinatorAddresses(absl::string_view value);

class CoordinatorChannels {
 public:
  // One channel per address of `addresses` (ParseCoordinatorAddresses) with
  // `credentials` and `args`. With several addresses the reconnect backoff
  // is capped at kMaxBackoffWithStandbys, so that a standby that was tried
  // while it did not listen is tried again soon after it starts to.
  static absl::StatusOr<std::shared_ptr<CoordinatorChannels>> Create(
      absl::string_view addresses, std::shared_ptr<grpc::ChannelCredentials> credentials,
      grpc::ChannelArguments args);
  // The same under `tls` (security::LoadTls; `who` names the program in its
  // messages), with the one message limit (common/grpc_limits.h) added to
  // `args`, as security::Dial does for one address.
  static absl::StatusOr<std::shared_ptr<CoordinatorChannels>> Dial(
      absl::string_view addresses, const security::TlsOptions& tls, absl::string_view who,
      grpc::ChannelArguments args = {});

  static constexpr absl::Duration kMaxBackoffWithStandbys = absl::Milliseconds(500);

  size_t size() const { return addresses_.size(); }
  const std::string& address(size_t i) const { return addresses_[i]; }
  const std::shared_ptr<grpc::Channel>& channel(size_t i) const { return channels_[i]; }
  // All the addresses, comma-separated, for messages.
  const std::string& addresses() const { return joined_; }

  // The index the next call should use.
  size_t current() const ABSL_LOCKS_EXCLUDED(mu_);
  // A call on channel `used` ended with `status` (see the top of the file).
  void Report(size_t used, const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  // Starts a connection attempt on every address and waits until one is
  // connected (the leader: standbys do not listen), at most until
  // `deadline`; that one becomes current. False when none connected in
  // time (current() is then unchanged). For one-shot callers (optimusctl)
  // that would rather ask the leader first than learn from a failed call.
  bool WaitForConnected(absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

  ~CoordinatorChannels();
  CoordinatorChannels(const CoordinatorChannels&) = delete;
  CoordinatorChannels& operator=(const CoordinatorChannels&) = delete;

 private:
  CoordinatorChannels(std::vector<std::string> addresses,
                      std::vector<std::shared_ptr<grpc::Channel>> channels);
  void MoveToLocked(size_t to, absl::string_view why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // With several addresses: keeps every channel that is not READY
  // connecting (see the .cc), until the destructor.
  void KeepConnecting() ABSL_LOCKS_EXCLUDED(stop_mu_);

  const std::vector<std::string> addresses_;
  const std::vector<std::shared_ptr<grpc::Channel>> channels_;
  const std::string joined_;
  mutable absl::Mutex mu_;
  size_t current_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Mutex stop_mu_;
  bool stop_ ABSL_GUARDED_BY(stop_mu_) = false;
  std::thread connector_;
};

// A generated gRPC stub per address of a CoordinatorChannels, calling
// through the current one and reporting every outcome:
//   LeaderStub<v1::Coordinator> stub(channels);
//   grpc::Status s = stub.Call(&v1::Coordinator::Stub::Heartbeat, &ctx, req, &resp);
// A ClientContext serves one call, so Call tries once; the caller's retry
// (with a new context) goes where Report moved.
template <class Service>
class LeaderStub {
 public:
  using Stub = typename Service::Stub;
  explicit LeaderStub(std::shared_ptr<CoordinatorChannels> channels)
      : channels_(std::move(channels)) {
    for (size_t i = 0; i < channels_->size(); ++i) {
      stubs_.push_back(Service::NewStub(channels_->channel(i)));
    }
  }

  template <class Request, class Response>
  grpc::Status Call(grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
                    grpc::ClientContext* ctx, const Request& request, Response* response) {
    const size_t i = channels_->current();
    grpc::Status s = (stubs_[i].get()->*method)(ctx, request, response);
    channels_->Report(i, s);
    return s;
  }

  // Call, and with several addresses an UNAVAILABLE answer is tried again
  // at once where Report moved (at most once per address), each try with a
  // new context from `make_context` (a callable returning
  // std::unique_ptr<grpc::ClientContext>, with its deadline and metadata).
  // Refused connections, the usual UNAVAILABLE, never reached a
  // coordinator; a call broken mid-flight may have, so use it for calls
  // that may be repeated. One address: one try, as Call.
  template <class Request, class Response, class MakeContext>
  grpc::Status CallAround(
      grpc::Status (Stub::*method)(grpc::ClientContext*, const Request&, Response*),
      const MakeContext& make_context, const Request& request, Response* response) {
    grpc::Status s;
    for (size_t tries = 0; tries < channels_->size(); ++tries) {
      std::unique_ptr<grpc::ClientContext> ctx = make_context();
      s = Call(method, ctx.get(), request, response);
      if (s.error_code() != grpc::StatusCode::UNAVAILABLE) break;
    }
    return s;
  }

  // The stub the next call should use and its index, for calls Call does
  // not fit (streams); report their outcome with Report.
  std::pair<size_t, Stub*> Pick() const {
    const size_t i = channels_->current();
    return {i, stubs_[i].get()};
  }
  void Report(size_t used, const grpc::Status& status) { channels_->Report(used, status); }

  CoordinatorChannels& channels() const { return *channels_; }

 private:
  std::shared_ptr<CoordinatorChannels> channels_;
  std::vector<std::unique_ptr<Stub>> stubs_;
};

}  // namespace optimus

#endif  // OPTIMUS_COMMON_COORDINATOR_CHANNELS_H_
