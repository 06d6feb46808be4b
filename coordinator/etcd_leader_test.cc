// EtcdLeadership against a scripted stand-in for etcd's Lease, KV and
// Election services (a real gRPC server on loopback): how a campaign
// reacts to each kind of error etcd answers with. The real etcd paths
// (standby, takeover, a killed member) are in leader_election_test.
#include "coordinator/etcd_leader.h"

#include <deque>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace optimus {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kLease = 0x694d;
constexpr int64_t kRevision = 42;

// Grants one lease, keeps it alive, and answers Campaign with the scripted
// errors in order, then with leadership.
class ScriptedEtcd final : public etcdserverpb::Lease::Service,
                           public etcdserverpb::KV::Service,
                           public v3electionpb::Election::Service {
 public:
  explicit ScriptedEtcd(std::deque<grpc::Status> campaign_errors)
      : errors_(std::move(campaign_errors)) {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    b.RegisterService(static_cast<etcdserverpb::Lease::Service*>(this));
    b.RegisterService(static_cast<etcdserverpb::KV::Service*>(this));
    b.RegisterService(static_cast<v3electionpb::Election::Service*>(this));
    server_ = b.BuildAndStart();
  }
  ~ScriptedEtcd() override { server_->Shutdown(std::chrono::system_clock::now()); }

  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }
  int campaigns() const {
    absl::MutexLock lock(&mu_);
    return campaigns_;
  }

  grpc::Status LeaseGrant(grpc::ServerContext*, const etcdserverpb::LeaseGrantRequest* req,
                          etcdserverpb::LeaseGrantResponse* resp) override {
    resp->set_id(kLease);
    resp->set_ttl(req->ttl());
    return grpc::Status::OK;
  }
  grpc::Status LeaseKeepAlive(
      grpc::ServerContext*,
      grpc::ServerReaderWriter<etcdserverpb::LeaseKeepAliveResponse,
                               etcdserverpb::LeaseKeepAliveRequest>* stream) override {
    etcdserverpb::LeaseKeepAliveRequest req;
    while (stream->Read(&req)) {
      etcdserverpb::LeaseKeepAliveResponse resp;
      resp.set_id(req.id());
      resp.set_ttl(2);
      if (!stream->Write(resp)) break;
    }
    return grpc::Status::OK;
  }
  grpc::Status LeaseRevoke(grpc::ServerContext*, const etcdserverpb::LeaseRevokeRequest*,
                           etcdserverpb::LeaseRevokeResponse*) override {
    return grpc::Status::OK;
  }
  // The leader's key, as long as it leads.
  grpc::Status Range(grpc::ServerContext*, const etcdserverpb::RangeRequest* req,
                     etcdserverpb::RangeResponse* resp) override {
    mvccpb::KeyValue* kv = resp->add_kvs();
    kv->set_key(req->key());
    kv->set_create_revision(kRevision);
    return grpc::Status::OK;
  }
  grpc::Status Campaign(grpc::ServerContext*, const v3electionpb::CampaignRequest* req,
                        v3electionpb::CampaignResponse* resp) override {
    absl::MutexLock lock(&mu_);
    ++campaigns_;
    if (!errors_.empty()) {
      grpc::Status s = errors_.front();
      errors_.pop_front();
      return s;
    }
    v3electionpb::LeaderKey* key = resp->mutable_leader();
    key->set_name(req->name());
    key->set_key(absl::StrCat(req->name(), "/", absl::Hex(req->lease())));
    key->set_rev(kRevision);
    key->set_lease(req->lease());
    return grpc::Status::OK;
  }

 private:
  mutable absl::Mutex mu_;
  std::deque<grpc::Status> errors_ ABSL_GUARDED_BY(mu_);
  int campaigns_ ABSL_GUARDED_BY(mu_) = 0;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

struct Candidate {
  explicit Candidate(const ScriptedEtcd& etcd) {
    EtcdClientOptions o;
    o.endpoints = {etcd.address()};
    auto c = EtcdClient::Create(o);
    EXPECT_TRUE(c.ok()) << c.status();
    client = std::move(*c);
    EtcdLeadershipOptions lo;
    lo.value = "127.0.0.1:7070";
    leadership = std::make_unique<EtcdLeadership>(client.get(), lo, [this](const absl::Status& s) {
      absl::MutexLock lock(&mu);
      lost = s;
    });
    EXPECT_TRUE(leadership->Start().ok());
  }
  absl::Mutex mu;
  absl::Status lost ABSL_GUARDED_BY(mu);
  std::unique_ptr<EtcdClient> client;
  std::unique_ptr<EtcdLeadership> leadership;
};

// What etcd answers while its members elect a raft leader (seen after one
// of three members was SIGKILLed): the candidate campaigns on and leads.
TEST(EtcdLeadershipTest, EtcdsTransientErrorsWhileCampaigningCampaignAgain) {
  ScriptedEtcd etcd({
      grpc::Status(grpc::StatusCode::UNKNOWN,
                   "etcdserver: request timed out, possibly due to previous leader failure"),
      grpc::Status(grpc::StatusCode::UNKNOWN, "etcdserver: leader changed"),
      grpc::Status(grpc::StatusCode::UNAVAILABLE, "etcdserver: no leader"),
      grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "context deadline exceeded"),
  });
  Candidate c(etcd);
  absl::StatusOr<v3electionpb::LeaderKey> key = c.leadership->Campaign();
  ASSERT_TRUE(key.ok()) << key.status();
  EXPECT_EQ(key->lease(), kLease);
  EXPECT_EQ(key->rev(), kRevision);
  EXPECT_EQ(etcd.campaigns(), 5);
  absl::MutexLock lock(&c.mu);
  EXPECT_TRUE(c.lost.ok()) << c.lost;
}

// Anything else is not going to pass by campaigning again: the campaign
// ends with etcd's message (optimus-coord exits with it).
TEST(EtcdLeadershipTest, OtherErrorsEndTheCampaignWithEtcdsMessage) {
  {
    ScriptedEtcd etcd({grpc::Status(grpc::StatusCode::UNKNOWN, "etcdserver: corrupt cluster")});
    Candidate c(etcd);
    absl::StatusOr<v3electionpb::LeaderKey> key = c.leadership->Campaign();
    EXPECT_EQ(key.status().code(), absl::StatusCode::kUnknown) << key.status();
    EXPECT_THAT(key.status().message(), HasSubstr("corrupt cluster"));
    EXPECT_EQ(etcd.campaigns(), 1);
  }
  {
    ScriptedEtcd etcd(
        {grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "etcdserver: permission denied")});
    Candidate c(etcd);
    absl::StatusOr<v3electionpb::LeaderKey> key = c.leadership->Campaign();
    EXPECT_EQ(key.status().code(), absl::StatusCode::kPermissionDenied) << key.status();
    EXPECT_THAT(key.status().message(), HasSubstr(etcd.address()));
    EXPECT_EQ(etcd.campaigns(), 1);
  }
}

// A campaign another thread cancels (shutdown) ends CANCELLED at once.
TEST(EtcdLeadershipTest, ACancelledCampaignEnds) {
  ScriptedEtcd etcd({});
  Candidate c(etcd);
  c.leadership->CancelCampaign();
  absl::StatusOr<v3electionpb::LeaderKey> key = c.leadership->Campaign();
  EXPECT_TRUE(absl::IsCancelled(key.status())) << key.status();
  EXPECT_EQ(etcd.campaigns(), 0);
}

}  // namespace
}  // namespace optimus
