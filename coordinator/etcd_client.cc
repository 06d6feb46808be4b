#include "coordinator/etcd_client.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"

namespace optimus {

struct EtcdClient::Endpoint {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<etcdserverpb::KV::Stub> kv;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease;
  std::unique_ptr<v3electionpb::Election::Stub> election;
};

namespace {

absl::Status FromGrpc(const char* what, const std::string& address, const grpc::Status& s) {
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("etcd ", what, " at ", address, ": ", s.error_message()));
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseEtcdEndpoints(absl::string_view list) {
  std::vector<std::string> out;
  for (absl::string_view e : absl::StrSplit(list, ',', absl::SkipWhitespace())) {
    e = absl::StripAsciiWhitespace(e);
    if (absl::StartsWith(e, "https://")) {
      return absl::InvalidArgumentError(absl::StrCat(
          "etcd endpoint \"", e, "\": TLS to etcd is not supported yet (use http:// or host:port)"));
    }
    absl::ConsumePrefix(&e, "http://");
    absl::ConsumeSuffix(&e, "/");
    const size_t colon = e.rfind(':');
    int port = 0;
    if (colon == absl::string_view::npos || colon == 0 ||
        !absl::SimpleAtoi(e.substr(colon + 1), &port) || port <= 0 || port > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("etcd endpoint \"", e, "\" is not HOST:PORT"));
    }
    out.emplace_back(e);
  }
  if (out.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("no etcd endpoint in \"", list, "\""));
  }
  return out;
}

std::string EtcdPrefixEnd(absl::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    unsigned char last = static_cast<unsigned char>(end.back());
    if (last < 0xff) {
      end.back() = static_cast<char>(last + 1);
      return end;
    }
    end.pop_back();
  }
  // Every byte 0xff (or empty): to the end of the key space.
  return std::string(1, '\0');
}

void EtcdCancel::Cancel() {
  absl::MutexLock lock(&mu_);
  cancelled_ = true;
  if (ctx_ != nullptr) ctx_->TryCancel();
}

bool EtcdCancel::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

bool EtcdCancel::Attach(grpc::ClientContext* ctx) {
  absl::MutexLock lock(&mu_);
  if (cancelled_) return false;
  ctx_ = ctx;
  return true;
}

void EtcdCancel::Detach() {
  absl::MutexLock lock(&mu_);
  ctx_ = nullptr;
}

absl::StatusOr<std::unique_ptr<EtcdClient>> EtcdClient::Create(EtcdClientOptions options) {
  if (options.endpoints.empty()) return absl::InvalidArgumentError("etcd client: no endpoints");
  if (options.call_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("etcd client: call_timeout must be > 0");
  }
  return std::unique_ptr<EtcdClient>(new EtcdClient(std::move(options)));
}

EtcdClient::EtcdClient(EtcdClientOptions options) : options_(std::move(options)) {
  for (const std::string& address : options_.endpoints) {
    auto e = std::make_unique<Endpoint>();
    e->address = address;
    grpc::ChannelArguments args;
    // A whole state Range page and etcd's largest request fit (etcd's own
    // default --max-request-bytes is 1.5 MiB).
    args.SetMaxReceiveMessageSize(64 << 20);
    args.SetMaxSendMessageSize(64 << 20);
    // A member that comes back is used again within a second, not after
    // gRPC's default backoff of up to two minutes. Only the pause between
    // attempts is shortened: gRPC reads GRPC_ARG_MIN_RECONNECT_BACKOFF_MS
    // as the least time one connection attempt (TCP connect and the HTTP/2
    // SETTINGS exchange) is given, and at 100 ms every attempt on a loaded
    // machine was cut short ("tcp handshaker shutdown"), so no member was
    // ever reached. That stays at gRPC's 20 s (etcd_store_test's
    // AMemberWhoseConnectionIsSlowToSetUpIsStillReached).
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
    e->channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
    e->kv = etcdserverpb::KV::NewStub(e->channel);
    e->lease = etcdserverpb::Lease::NewStub(e->channel);
    e->election = v3electionpb::Election::NewStub(e->channel);
    endpoints_.push_back(std::move(e));
  }
  connector_ = std::thread([this] { KeepConnecting(); });
}

EtcdClient::~EtcdClient() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  connector_.join();
}

void EtcdClient::KeepConnecting() {
  // gRPC advances a connection attempt only while some thread polls for the
  // channel: a call, or the backup poller every 5 s. A call on a channel in
  // TRANSIENT_FAILURE fails at once without waiting (it is not
  // wait_for_ready: the next endpoint is tried instead), so after a failed
  // attempt nothing polled, and a member that had come up (or the first
  // contact with one still starting) was reached only 5 to 10 s later.
  // This thread waits on every channel that is not READY, so it connects as
  // soon as gRPC's backoff (100 ms up to 1 s) allows.
  constexpr absl::Duration kPoll = absl::Milliseconds(200);
  while (true) {
    bool all_ready = true;
    for (const std::unique_ptr<Endpoint>& e : endpoints_) {
      {
        absl::MutexLock lock(&mu_);
        if (stop_) return;
      }
      const grpc_connectivity_state s = e->channel->GetState(/*try_to_connect=*/true);
      if (s == GRPC_CHANNEL_READY) continue;
      all_ready = false;
      e->channel->WaitForStateChange(s, absl::ToChronoTime(absl::Now() + kPoll));
    }
    if (all_ready) {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stop_), kPoll)) return;
    }
  }
}

std::string EtcdClient::Describe() const { return absl::StrJoin(options_.endpoints, ","); }

absl::Status EtcdClient::Call(
    const char* what, absl::Duration timeout, EtcdCancel* cancel,
    const std::function<grpc::Status(Endpoint&, grpc::ClientContext*)>& call) {
  const size_t n = endpoints_.size();
  const size_t start = current_.load() % n;
  absl::Status last;
  for (size_t i = 0; i < n; ++i) {
    const size_t idx = (start + i) % n;
    Endpoint& e = *endpoints_[idx];
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    if (cancel != nullptr && !cancel->Attach(&ctx)) {
      return absl::CancelledError(absl::StrCat("etcd ", what, ": cancelled"));
    }
    const grpc::Status s = call(e, &ctx);
    if (cancel != nullptr) cancel->Detach();
    if (s.ok()) {
      current_.store(idx);
      return absl::OkStatus();
    }
    last = FromGrpc(what, e.address, s);
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE) continue;
    // A member that lets calls run out of time: the next call tries
    // another (this one may have been applied, so it is not repeated).
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) current_.store((idx + 1) % n);
    return last;
  }
  // Every member UNAVAILABLE: the next call starts past the first.
  current_.store((start + 1) % n);
  return last;
}

absl::StatusOr<etcdserverpb::RangeResponse> EtcdClient::Range(
    const etcdserverpb::RangeRequest& req) {
  etcdserverpb::RangeResponse resp;
  absl::Status s = Call("Range", options_.call_timeout, nullptr,
                        [&](Endpoint& e, grpc::ClientContext* ctx) {
                          resp.Clear();
                          return e.kv->Range(ctx, req, &resp);
                        });
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<etcdserverpb::TxnResponse> EtcdClient::Txn(const etcdserverpb::TxnRequest& req) {
  etcdserverpb::TxnResponse resp;
  absl::Status s = Call("Txn", options_.call_timeout, nullptr,
                        [&](Endpoint& e, grpc::ClientContext* ctx) {
                          resp.Clear();
                          return e.kv->Txn(ctx, req, &resp);
                        });
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<etcdserverpb::PutResponse> EtcdClient::Put(const etcdserverpb::PutRequest& req) {
  etcdserverpb::PutResponse resp;
  absl::Status s = Call("Put", options_.call_timeout, nullptr,
                        [&](Endpoint& e, grpc::ClientContext* ctx) {
                          resp.Clear();
                          return e.kv->Put(ctx, req, &resp);
                        });
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<etcdserverpb::DeleteRangeResponse> EtcdClient::DeleteRange(
    const etcdserverpb::DeleteRangeRequest& req) {
  etcdserverpb::DeleteRangeResponse resp;
  absl::Status s = Call("DeleteRange", options_.call_timeout, nullptr,
                        [&](Endpoint& e, grpc::ClientContext* ctx) {
                          resp.Clear();
                          return e.kv->DeleteRange(ctx, req, &resp);
                        });
  if (!s.ok()) return s;
  return resp;
}

absl::StatusOr<etcdserverpb::LeaseGrantResponse> EtcdClient::LeaseGrant(int64_t ttl_seconds) {
  etcdserverpb::LeaseGrantRequest req;
  req.set_ttl(ttl_seconds);
  etcdserverpb::LeaseGrantResponse resp;
  absl::Status s = Call("LeaseGrant", options_.call_timeout, nullptr,
                        [&](Endpoint& e, grpc::ClientContext* ctx) {
                          resp.Clear();
                          return e.lease->LeaseGrant(ctx, req, &resp);
                        });
  if (!s.ok()) return s;
  if (!resp.error().empty()) {
    return absl::UnavailableError(absl::StrCat("etcd LeaseGrant: ", resp.error()));
  }
  return resp;
}

absl::StatusOr<int64_t> EtcdClient::LeaseKeepAliveOnce(int64_t lease_id) {
  int64_t ttl = 0;
  // A stream per round trip: simple, and each round may go to another
  // member. It costs a stream setup per keep-alive (every TTL/3).
  absl::Status s = Call(
      "LeaseKeepAlive", options_.call_timeout, nullptr,
      [&](Endpoint& e, grpc::ClientContext* ctx) {
        auto stream = e.lease->LeaseKeepAlive(ctx);
        etcdserverpb::LeaseKeepAliveRequest req;
        req.set_id(lease_id);
        etcdserverpb::LeaseKeepAliveResponse resp;
        const bool ok = stream->Write(req) && stream->Read(&resp);
        stream->WritesDone();
        grpc::Status st = stream->Finish();
        if (!st.ok()) return st;
        if (!ok) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "keep-alive stream closed");
        ttl = resp.ttl();
        return grpc::Status::OK;
      });
  if (!s.ok()) return s;
  if (ttl <= 0) {
    return absl::NotFoundError(
        absl::StrCat("etcd lease ", absl::Hex(lease_id), " expired or was revoked"));
  }
  return ttl;
}

absl::Status EtcdClient::LeaseRevoke(int64_t lease_id) {
  etcdserverpb::LeaseRevokeRequest req;
  req.set_id(lease_id);
  etcdserverpb::LeaseRevokeResponse resp;
  return Call("LeaseRevoke", options_.call_timeout, nullptr,
              [&](Endpoint& e, grpc::ClientContext* ctx) {
                return e.lease->LeaseRevoke(ctx, req, &resp);
              });
}

absl::StatusOr<v3electionpb::LeaderKey> EtcdClient::Campaign(absl::string_view name,
                                                             int64_t lease_id,
                                                             absl::string_view value,
                                                             absl::Duration timeout,
                                                             EtcdCancel* cancel) {
  v3electionpb::CampaignRequest req;
  req.set_name(std::string(name));
  req.set_lease(lease_id);
  req.set_value(std::string(value));
  v3electionpb::CampaignResponse resp;
  // Repeating a campaign with the same lease is harmless (etcd finds the
  // candidate's key and goes on waiting), so UNAVAILABLE moves on.
  absl::Status s = Call("Campaign", timeout, cancel, [&](Endpoint& e, grpc::ClientContext* ctx) {
    resp.Clear();
    return e.election->Campaign(ctx, req, &resp);
  });
  if (!s.ok()) return s;
  return resp.leader();
}

absl::StatusOr<std::optional<mvccpb::KeyValue>> EtcdClient::Leader(absl::string_view name) {
  v3electionpb::LeaderRequest req;
  req.set_name(std::string(name));
  v3electionpb::LeaderResponse resp;
  absl::Status s = Call("Leader", options_.call_timeout, nullptr,
                        [&](Endpoint& e, grpc::ClientContext* ctx) {
                          resp.Clear();
                          return e.election->Leader(ctx, req, &resp);
                        });
  // etcd answers "election: no leader" with gRPC's UNKNOWN.
  if (!s.ok() && absl::StrContains(s.message(), "election: no leader")) return std::nullopt;
  if (!s.ok()) return s;
  if (!resp.has_kv()) return std::nullopt;
  return resp.kv();
}

absl::Status EtcdClient::Observe(absl::string_view name,
                                 const std::function<bool(const mvccpb::KeyValue&)>& on_leader,
                                 absl::Duration timeout, EtcdCancel* cancel) {
  v3electionpb::LeaderRequest req;
  req.set_name(std::string(name));
  bool done = false;
  absl::Status s = Call("Observe", timeout, cancel, [&](Endpoint& e, grpc::ClientContext* ctx) {
    auto stream = e.election->Observe(ctx, req);
    v3electionpb::LeaderResponse resp;
    while (stream->Read(&resp)) {
      if (!on_leader(resp.kv())) {
        done = true;
        ctx->TryCancel();
        break;
      }
    }
    grpc::Status st = stream->Finish();
    if (done) return grpc::Status::OK;
    if (st.ok()) return grpc::Status(grpc::StatusCode::UNAVAILABLE, "observe stream ended");
    return st;
  });
  return s;
}

absl::Status EtcdClient::Resign(const v3electionpb::LeaderKey& leader) {
  v3electionpb::ResignRequest req;
  *req.mutable_leader() = leader;
  v3electionpb::ResignResponse resp;
  return Call("Resign", options_.call_timeout, nullptr,
              [&](Endpoint& e, grpc::ClientContext* ctx) {
                return e.election->Resign(ctx, req, &resp);
              });
}

}  // namespace optimus
