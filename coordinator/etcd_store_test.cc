// EtcdStateStore against a real etcd (one member): the state saved key by
// key comes back equal; a change writes only the keys it changed, in one
// Txn; a large job is split across keys and a save over etcd's limits is
// split across Txns, and still comes back equal; a save by a coordinator
// whose election key is gone is refused and writes nothing; bad bytes are
// refused and write nothing; a member whose connection takes seconds to
// set up is still reached.
#include "coordinator/etcd_state_store.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "coordinator/etcd_client.h"
#include "coordinator/etcd_leader.h"
#include "coordinator/etcd_test_cluster.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"
#include "proto/optimus.pb.h"
#include "tests/harness/tcp_relay.h"

namespace optimus {
namespace {

using google::protobuf::util::MessageDifferencer;

v1::PersistedShard Shard(uint64_t id, v1::ShardState state = v1::SHARD_STATE_UP) {
  v1::PersistedShard s;
  s.set_shard_id(id);
  s.mutable_capabilities()->set_kind(v1::SHARD_KIND_DPU);
  s.mutable_capabilities()->set_hostname(absl::StrCat("node", id));
  s.mutable_capabilities()->set_data_address(absl::StrCat("ucx-", id));
  s.mutable_capabilities()->set_memory_limit_bytes(uint64_t{1} << 30);
  s.set_state(state);
  return s;
}

// A job whose map has `chunks` chunks spread over shards 1..3.
v1::PersistedJob Job(uint64_t id, int chunks, uint64_t epoch = 1) {
  v1::PersistedJob j;
  j.set_job_id(id);
  j.mutable_spec()->set_name(absl::StrCat("job", id));
  j.mutable_spec()->set_world_size(2);
  j.set_state(v1::JOB_STATE_READY);
  j.set_num_params(64 * chunks);
  j.set_token(absl::StrCat("token-of-job-", id, "-0123456789abcdef0123456789"));
  v1::ShardMap* m = j.mutable_map();
  m->set_job_id(id);
  m->set_epoch(epoch);
  for (int c = 0; c < chunks; ++c) {
    v1::ChunkPlacement* p = m->add_chunks();
    p->set_chunk(c);
    p->set_offset_elems(64 * c);
    p->set_num_elems(64);
    p->set_shard_id(1 + c % 3);
    p->set_backup_shard_id(1 + (c + 1) % 3);
  }
  for (uint64_t s = 1; s <= 3; ++s) {
    v1::ShardEndpoint* e = m->add_shards();
    e->set_shard_id(s);
    e->set_data_address(absl::StrCat("ucx-", s));
  }
  return j;
}

std::string Bytes(const v1::CoordinatorState& s) { return s.SerializeAsString(); }

v1::CoordinatorState Parse(const std::string& bytes) {
  v1::CoordinatorState s;
  EXPECT_TRUE(s.ParseFromString(bytes));
  return s;
}

// key -> mod revision of every key under the store's prefix.
std::map<std::string, int64_t> ModRevisions(EtcdClient* client, const std::string& prefix) {
  etcdserverpb::RangeRequest req;
  req.set_key(prefix);
  req.set_range_end(EtcdPrefixEnd(prefix));
  absl::StatusOr<etcdserverpb::RangeResponse> r = client->Range(req);
  EXPECT_TRUE(r.ok()) << r.status();
  std::map<std::string, int64_t> out;
  if (!r.ok()) return out;
  for (const mvccpb::KeyValue& kv : r->kvs()) out[kv.key()] = kv.mod_revision();
  return out;
}

class EtcdStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (EtcdTestCluster::Binary().empty()) GTEST_SKIP() << EtcdTestCluster::kMissing;
    auto cluster = EtcdTestCluster::Start(1, "etcd_store_test");
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    EtcdClientOptions o;
    o.endpoints = cluster_->endpoints();
    auto client = EtcdClient::Create(o);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = std::move(*client);
    EtcdLeadershipOptions lo;
    lo.value = "127.0.0.1:7070";
    leadership_ = std::make_unique<EtcdLeadership>(
        client_.get(), lo, [this](const absl::Status&) {
          if (!lost_.HasBeenNotified()) lost_.Notify();
        });
    ASSERT_TRUE(leadership_->Start().ok());
    auto key = leadership_->Campaign();
    ASSERT_TRUE(key.ok()) << key.status();
    fence_ = EtcdFence{key->key(), key->rev()};
  }

  std::unique_ptr<EtcdStateStore> Store(EtcdStateStoreOptions o = {}) {
    o.on_fenced = [this](const absl::Status&) { ++fenced_calls_; };
    return std::make_unique<EtcdStateStore>(client_.get(), fence_, o);
  }

  v1::CoordinatorState ThreeShardsTwoJobs() {
    v1::CoordinatorState s;
    s.set_next_shard_id(4);
    s.set_next_job_id(3);
    s.set_data_plane_key("0123456789abcdef0123456789abcdef");
    for (uint64_t id = 1; id <= 3; ++id) *s.add_shards() = Shard(id);
    *s.add_jobs() = Job(1, 40);
    *s.add_jobs() = Job(2, 10);
    return s;
  }

  // In this order: the leadership's thread (destroyed first) calls back
  // into lost_ and uses the client, which uses the cluster.
  std::unique_ptr<EtcdTestCluster> cluster_;
  std::unique_ptr<EtcdClient> client_;
  absl::Notification lost_;
  int fenced_calls_ = 0;
  std::unique_ptr<EtcdLeadership> leadership_;
  EtcdFence fence_;
};

TEST_F(EtcdStoreTest, EmptyPrefixLoadsNothing) {
  auto loaded = Store()->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_FALSE(loaded->has_value());
}

TEST_F(EtcdStoreTest, RoundTripAndAChangeWritesOnlyTheChangedKeysInOneTxn) {
  auto store = Store();
  v1::CoordinatorState state = ThreeShardsTwoJobs();
  ASSERT_TRUE(store->Save(Bytes(state)).ok());
  // meta, three shards, two jobs.
  EXPECT_EQ(store->last_save().puts, 6);
  EXPECT_EQ(store->last_save().txns, 1);
  const std::map<std::string, int64_t> before = ModRevisions(client_.get(), store->state_prefix());
  ASSERT_EQ(before.size(), 6u);

  // A new store (a new leader) reads back what was saved.
  auto loaded = Store()->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_TRUE(loaded->has_value());
  EXPECT_TRUE(MessageDifferencer::Equals(Parse(**loaded), state));

  // Saving the same state again writes nothing.
  ASSERT_TRUE(store->Save(Bytes(state)).ok());
  EXPECT_EQ(store->last_save().puts + store->last_save().deletes, 0);
  EXPECT_EQ(ModRevisions(client_.get(), store->state_prefix()), before);

  // Shard 2 goes DOWN, shard 3 leaves, shard 4 registers, job 1's map moves.
  v1::CoordinatorState changed;
  changed.set_next_shard_id(5);
  changed.set_next_job_id(3);
  changed.set_data_plane_key(state.data_plane_key());
  *changed.add_shards() = Shard(1);
  *changed.add_shards() = Shard(2, v1::SHARD_STATE_DOWN);
  *changed.add_shards() = Shard(4);
  *changed.add_jobs() = Job(1, 40, /*epoch=*/2);
  *changed.add_jobs() = Job(2, 10);
  ASSERT_TRUE(store->Save(Bytes(changed)).ok());
  EXPECT_EQ(store->last_save().puts, 4);
  EXPECT_EQ(store->last_save().deletes, 1);
  EXPECT_EQ(store->last_save().txns, 1);

  const std::string p = store->state_prefix();
  const std::map<std::string, int64_t> after = ModRevisions(client_.get(), p);
  std::map<std::string, int64_t> touched;
  for (const auto& [key, rev] : after) {
    auto old = before.find(key);
    if (old == before.end() || old->second != rev) touched[key] = rev;
  }
  const std::string id = "0000000000000000000";
  ASSERT_EQ(touched.size(), 4u);
  EXPECT_TRUE(touched.count(p + "meta"));
  EXPECT_TRUE(touched.count(p + "shard/" + id + "2"));
  EXPECT_TRUE(touched.count(p + "shard/" + id + "4"));
  EXPECT_TRUE(touched.count(p + "job/" + id + "1"));
  EXPECT_FALSE(after.count(p + "shard/" + id + "3"));
  // One Txn: one revision for every key it wrote.
  for (const auto& [key, rev] : touched) EXPECT_EQ(rev, touched.begin()->second) << key;

  loaded = Store()->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_TRUE(loaded->has_value());
  EXPECT_TRUE(MessageDifferencer::Equals(Parse(**loaded), changed));
}

TEST_F(EtcdStoreTest, LargeJobsAndLargeSavesAreSplitAndComeBackEqual) {
  // A Txn of at most 128 KiB and 8 operations: a job of ~100 KB takes
  // several parts, 40 shards several Txns.
  EtcdStateStoreOptions o;
  o.max_request_bytes = 128 * 1024;
  o.max_txn_ops = 8;
  auto store = Store(o);
  v1::CoordinatorState state;
  state.set_next_shard_id(41);
  state.set_next_job_id(2);
  for (uint64_t id = 1; id <= 40; ++id) *state.add_shards() = Shard(id);
  *state.add_jobs() = Job(1, 7000);  // ~15 bytes a chunk: ~104 KB.
  ASSERT_GT(state.jobs(0).ByteSizeLong(), 60u * 1024);
  ASSERT_TRUE(store->Save(Bytes(state)).ok());
  EXPECT_GT(store->last_save().txns, 1);
  const size_t keys = ModRevisions(client_.get(), store->state_prefix()).size();
  EXPECT_GT(keys, 1u + 40u + 1u);  // Parts besides meta, shards and the job's head.

  auto loaded = Store()->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_TRUE(loaded->has_value());
  EXPECT_TRUE(MessageDifferencer::Equals(Parse(**loaded), state));

  // The job changes: new parts replace the old ones (none left behind).
  *state.mutable_jobs(0) = Job(1, 7000, /*epoch=*/9);
  ASSERT_TRUE(store->Save(Bytes(state)).ok());
  EXPECT_EQ(ModRevisions(client_.get(), store->state_prefix()).size(), keys);
  loaded = Store()->Load();
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE(MessageDifferencer::Equals(Parse(**loaded), state));
}

TEST_F(EtcdStoreTest, FencedSaveFailsAndWritesNothing) {
  auto store = Store();
  v1::CoordinatorState state = ThreeShardsTwoJobs();
  ASSERT_TRUE(store->Save(Bytes(state)).ok());
  const std::map<std::string, int64_t> before = ModRevisions(client_.get(), store->state_prefix());

  // The election key goes (as when the lease expired and a standby leads).
  etcdserverpb::DeleteRangeRequest del;
  del.set_key(fence_.key);
  auto deleted = client_->DeleteRange(del);
  ASSERT_TRUE(deleted.ok()) << deleted.status();
  ASSERT_EQ(deleted->deleted(), 1);

  *state.add_shards() = Shard(9);
  state.set_next_shard_id(10);
  absl::Status s = store->Save(Bytes(state));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), fence_.key)) << s;
  EXPECT_EQ(fenced_calls_, 1);
  EXPECT_EQ(ModRevisions(client_.get(), store->state_prefix()), before);
  // The keep-alive thread notices too (what makes an idle leader exit).
  EXPECT_TRUE(lost_.WaitForNotificationWithTimeout(absl::Seconds(60)));
}

TEST_F(EtcdStoreTest, BytesThatDoNotParseAreRefusedAndWriteNothing) {
  auto store = Store();
  ASSERT_TRUE(store->Save(Bytes(ThreeShardsTwoJobs())).ok());
  const std::map<std::string, int64_t> before = ModRevisions(client_.get(), store->state_prefix());
  absl::Status s = store->Save("\xff\xff\xff not a state");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(ModRevisions(client_.get(), store->state_prefix()), before);
}

TEST_F(EtcdStoreTest, AnEndpointThatIsDownIsSkippedAndNamedWhenAllAre) {
  const std::string dead = absl::StrCat("127.0.0.1:", PickFreePort());
  EtcdClientOptions o;
  o.endpoints = {dead, cluster_->endpoints()[0]};
  auto client = EtcdClient::Create(o);
  ASSERT_TRUE(client.ok());
  etcdserverpb::PutRequest put;
  put.set_key("/endpoint-test");
  put.set_value("v");
  auto r = (*client)->Put(put);
  EXPECT_TRUE(r.ok()) << r.status();

  o.endpoints = {dead};
  auto lone = EtcdClient::Create(o);
  ASSERT_TRUE(lone.ok());
  auto failed = (*lone)->Put(put);
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kUnavailable) << failed.status();
  EXPECT_TRUE(absl::StrContains(failed.status().message(), dead)) << failed.status();
}

// A TCP relay to the member on `target_port` that holds every connection
// `delay` before it passes any byte: a member behind a slow network or on
// a loaded machine, where the TCP connect and the HTTP/2 SETTINGS exchange
// take that long. On `listen_port` (0: any free one).
std::unique_ptr<harness::TcpRelay> SlowRelay(int target_port, absl::Duration delay,
                                             int listen_port = 0) {
  harness::TcpRelayOptions o;
  o.target_port = target_port;
  o.listen_port = listen_port;
  o.connect_delay = delay;
  auto relay = harness::TcpRelay::Start(o);
  EXPECT_TRUE(relay.ok()) << relay.status();
  return relay.ok() ? *std::move(relay) : nullptr;
}

// Puts every 100 ms until one succeeds or `guard` has passed; the last
// status.
absl::Status PutUntilOk(EtcdClient& client, const etcdserverpb::PutRequest& put,
                        absl::Duration guard) {
  const absl::Time give_up = absl::Now() + guard;
  absl::Status last;
  while (absl::Now() < give_up) {
    last = client.Put(put).status();
    if (last.ok()) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return last;
}

TEST_F(EtcdStoreTest, AMemberWhoseConnectionIsSlowToSetUpIsStillReached) {
  // gRPC gives a connection attempt as long as GRPC_ARG_MIN_RECONNECT_BACKOFF_MS
  // (else 20 s). The client once set it to 100 ms for quick reconnects, and
  // then no attempt that took longer (here: 3 s) ever finished, so the
  // member was never reached; on a loaded machine that was every member.
  const std::string& member = cluster_->endpoints()[0];
  int port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(member.substr(member.rfind(':') + 1), &port)) << member;
  auto relay = SlowRelay(port, absl::Seconds(3));
  ASSERT_NE(relay, nullptr);
  EtcdClientOptions o;
  o.endpoints = {relay->address()};
  o.call_timeout = absl::Seconds(2);
  auto client = EtcdClient::Create(o);
  ASSERT_TRUE(client.ok());
  etcdserverpb::PutRequest put;
  put.set_key("/slow-member");
  put.set_value("v");
  // A hang guard only: with the fix the first connection is up after 3 s.
  const absl::Status last = PutUntilOk(**client, put, absl::Seconds(60));
  EXPECT_TRUE(last.ok()) << "never reached " << member << " through a 3 s handshake: " << last;
}

// A member that was down when the client first tried it (connection
// refused, the channel backing off) and comes up later is reached by the
// next calls, within gRPC's backoff (here at most 1 s), although calls on
// a failed channel fail at once and poll nothing: the client's own thread
// keeps the channel connecting. The test's BUILD rule switches gRPC's
// backup poller off, which would otherwise connect it 5 to 10 s later.
TEST_F(EtcdStoreTest, AMemberThatComesUpAfterFailedCallsIsReached) {
  const std::string& member = cluster_->endpoints()[0];
  int member_port = 0;
  ASSERT_TRUE(absl::SimpleAtoi(member.substr(member.rfind(':') + 1), &member_port)) << member;
  const int port = PickFreePort();
  EtcdClientOptions o;
  o.endpoints = {absl::StrCat("127.0.0.1:", port)};
  o.call_timeout = absl::Seconds(2);
  auto client = EtcdClient::Create(o);
  ASSERT_TRUE(client.ok());
  etcdserverpb::PutRequest put;
  put.set_key("/late-member");
  put.set_value("v");
  for (int i = 0; i < 3; ++i) {
    auto r = (*client)->Put(put);
    ASSERT_EQ(r.status().code(), absl::StatusCode::kUnavailable) << r.status();
    absl::SleepFor(absl::Milliseconds(300));
  }
  // The member comes up at that address.
  auto up = SlowRelay(member_port, absl::ZeroDuration(), port);
  ASSERT_NE(up, nullptr) << "the test could not listen on its port";
  ASSERT_EQ(up->address(), o.endpoints[0]);
  // A hang guard only.
  const absl::Status last = PutUntilOk(**client, put, absl::Seconds(30));
  EXPECT_TRUE(last.ok()) << "a member that came up at " << o.endpoints[0]
                         << " was never reached: " << last;
}

TEST(EtcdEndpointsTest, ParsesListsAndRefusesBadEntries) {
  auto ok = ParseEtcdEndpoints("127.0.0.1:2379, http://etcd-1:2379/,etcd-2:22379");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*ok, (std::vector<std::string>{"127.0.0.1:2379", "etcd-1:2379", "etcd-2:22379"}));
  EXPECT_EQ(ParseEtcdEndpoints("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseEtcdEndpoints("etcd-1").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseEtcdEndpoints("https://etcd-1:2379").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(EtcdPrefixEnd("/optimus/state/"), "/optimus/state0");
}

}  // namespace
}  // namespace optimus
