// Failure detection never waits behind planning, and the gRPC server does
// not spend its threads on what nobody waits for:
//
//   - while another thread holds the tables as a long placement does
//     (Coordinator::RunWithTablesLockedForTest), heartbeats are answered
//     and renew their leases, and the lease sweep marks a silent shard
//     DOWN; its chunks fail over once the tables are free (core, fake
//     clock; then a real server with its own lease thread);
//   - sweeps that found nothing to fail over are skipped while nothing
//     changed, and a shard lost after them is still failed over;
//   - a call whose client gave up while it waited for the tables is not
//     executed;
//   - with the server's threads capped, watchers that block a thread each
//     cannot take them all: registrations, heartbeats and status are still
//     answered (real gRPC server).
#include <atomic>
#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "coordinator/coordinator.h"
#include "coordinator/test_fixtures.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "proto/optimus.grpc.pb.h"

namespace optimus {
namespace {

using coord_test::OneTensorJob;
using coord_test::DpuRegistration;
using coord_test::TablesHeld;

constexpr absl::Duration kLease = absl::Seconds(2);



// What `shard` reports for the job after loading `map`: all loaded and
// its backups seeded.
v1::ShardJobProgress Loaded(const v1::ShardMap& map, uint64_t shard) {
  v1::ShardJobProgress p;
  p.set_job_id(map.job_id());
  p.set_map_epoch(map.epoch());
  uint32_t primary = 0, backup = 0;
  for (const auto& c : map.chunks()) {
    primary += c.shard_id() == shard;
    backup += c.backup_shard_id() == shard;
  }
  p.set_primary_chunks(primary);
  p.set_backup_chunks(backup);
  p.set_chunks_loaded(primary + backup);
  p.set_backups_seeded(backup);
  p.set_primaries_replicated(primary);
  return p;
}

v1::ShardStatus ShardIn(const v1::StatusResponse& st, uint64_t id) {
  for (const auto& s : st.shards()) {
    if (s.shard_id() == id) return s;
  }
  ADD_FAILURE() << "no shard " << id;
  return v1::ShardStatus();
}

// A core whose clock is `*now`, with `n` DPU shards registered (their ids
// in `ids`, in order).
void StartOnFakeClock(absl::Time* now, int n, std::unique_ptr<Coordinator>* core,
                      std::vector<uint64_t>* ids) {
  CoordinatorOptions options;
  options.lease = kLease;
  options.clock = [now] { return *now; };
  *core = std::make_unique<Coordinator>(options);
  ASSERT_TRUE((*core)->Recover().ok());
  for (int i = 0; i < n; ++i) {
    auto r = (*core)->RegisterShard(DpuRegistration(i));
    ASSERT_TRUE(r.ok()) << r.status();
    ids->push_back(r->shard_id());
  }
}

// Sweeps that find no job holding chunks on a DOWN shard are remembered
// and later ones skipped while nothing changed; a shard that goes silent
// after many of them is still failed over at the next sweep, and so is one
// that goes silent right after a new job was created.
TEST(FailureDetectionTest, ShardsLostAfterIdleSweepsAreStillFailedOver) {
  absl::Time now = absl::FromUnixSeconds(1700000000);
  std::unique_ptr<Coordinator> owned;
  std::vector<uint64_t> ids;
  ASSERT_NO_FATAL_FAILURE(StartOnFakeClock(&now, 4, &owned, &ids));
  Coordinator& core = *owned;
  std::vector<uint64_t> jobs;
  // The live shards beat, each reporting every job's current map loaded
  // and its backups in sync.
  auto beat_all_but = [&](const std::set<uint64_t>& silent) {
    for (uint64_t s : ids) {
      if (silent.count(s) != 0) continue;
      v1::HeartbeatRequest req;
      req.set_shard_id(s);
      for (uint64_t job : jobs) *req.add_jobs() = Loaded(*core.GetShardMap(job), s);
      ASSERT_TRUE(core.Heartbeat(req).known()) << "shard " << s;
    }
  };
  auto epoch_of = [&](uint64_t job_id) { return core.GetShardMap(job_id)->epoch(); };
  auto first = core.CreateJob(OneTensorJob("first", 8, /*replication=*/1));
  ASSERT_TRUE(first.ok()) << first.status();
  jobs.push_back(first->job_id());
  // Many sweeps with every shard alive: nothing to fail over.
  for (int i = 0; i < 10; ++i) {
    now += kLease / 4;
    beat_all_but({});
    EXPECT_EQ(core.SweepExpiredLeases(now), 0);
  }
  EXPECT_EQ(epoch_of(first->job_id()), 1u);
  // One shard holding chunks of the job goes silent.
  const uint64_t lost = first->map().chunks(0).shard_id();
  now += kLease / 2;
  beat_all_but({lost});
  now += kLease / 2 + absl::Milliseconds(1);
  beat_all_but({lost});
  EXPECT_EQ(core.SweepExpiredLeases(now), 1);
  EXPECT_EQ(epoch_of(first->job_id()), 2u) << "the lost shard's chunks were not failed over";

  // Idle sweeps again, then a new job, then one of its holders is lost.
  for (int i = 0; i < 4; ++i) {
    now += kLease / 4;
    beat_all_but({lost});
    core.SweepExpiredLeases(now);
  }
  auto second = core.CreateJob(OneTensorJob("second", 8, /*replication=*/1));
  ASSERT_TRUE(second.ok()) << second.status();
  jobs.push_back(second->job_id());
  const uint64_t lost2 = second->map().chunks(0).shard_id();
  beat_all_but({lost});
  now += kLease / 2;
  beat_all_but({lost, lost2});
  now += kLease / 2 + absl::Milliseconds(1);
  beat_all_but({lost, lost2});
  EXPECT_EQ(core.SweepExpiredLeases(now), 1);
  EXPECT_EQ(epoch_of(second->job_id()), 2u) << "the second lost shard's chunks were not failed over";
}

TEST(FailureDetectionTest, LeasesAreRenewedAndExpireWhilePlanningHoldsTheTables) {
  absl::Time now = absl::FromUnixSeconds(1700000000);
  std::unique_ptr<Coordinator> owned;
  std::vector<uint64_t> ids;
  ASSERT_NO_FATAL_FAILURE(StartOnFakeClock(&now, 3, &owned, &ids));
  Coordinator& core = *owned;
  auto created = core.CreateJob(OneTensorJob("j", 8, /*replication=*/1));
  ASSERT_TRUE(created.ok()) << created.status();
  const v1::ShardMap map = created->map();
  auto beat = [&](uint64_t shard, bool report) {
    v1::HeartbeatRequest req;
    req.set_shard_id(shard);
    if (report) *req.add_jobs() = Loaded(map, shard);
    return core.Heartbeat(req);
  };
  for (uint64_t s : ids) {
    const v1::HeartbeatResponse r = beat(s, true);
    ASSERT_TRUE(r.known());
    ASSERT_EQ(r.assignments_size(), 1);
  }
  ASSERT_EQ(core.GetJob(created->job_id())->state(), v1::JOB_STATE_READY);
  const uint64_t silent = ids[0];
  const std::vector<uint64_t> alive = {ids[1], ids[2]};

  // Planning holds the tables until released.
  TablesHeld tables(&core);
  // Two half-leases: the live shards beat in each, the silent one never.
  // Each beat is answered (with the last reply: the job at epoch 1).
  for (int half = 0; half < 2; ++half) {
    now += kLease / 2 + absl::Milliseconds(half);
    for (uint64_t s : alive) {
      const v1::HeartbeatResponse r = beat(s, true);
      EXPECT_TRUE(r.known()) << "shard " << s;
      ASSERT_EQ(r.assignments_size(), 1);
      EXPECT_EQ(r.assignments(0).job_id(), created->job_id());
      EXPECT_EQ(r.assignments(0).map_epoch(), 1u);
    }
  }
  // The lease sweep needs no table: the silent shard alone is DOWN, and
  // its heartbeat (now) is told so.
  EXPECT_EQ(core.SweepLeases(now), 1);
  EXPECT_FALSE(beat(silent, false).known());
  for (uint64_t s : alive) EXPECT_TRUE(beat(s, false).known());
  tables.Release();

  // The tables take the DOWN shard and fail its chunks over.
  EXPECT_EQ(core.SweepExpiredLeases(now), 1);
  const v1::StatusResponse st = core.Status();
  EXPECT_EQ(ShardIn(st, silent).state(), v1::SHARD_STATE_DOWN);
  for (uint64_t s : alive) EXPECT_EQ(ShardIn(st, s).state(), v1::SHARD_STATE_UP);
  const v1::ShardMap after = *core.GetShardMap(created->job_id());
  EXPECT_EQ(after.epoch(), 2u);
  for (const auto& c : after.chunks()) {
    EXPECT_NE(c.shard_id(), silent);
    EXPECT_NE(c.shard_id(), 0u);
  }
  EXPECT_NE(core.GetJob(created->job_id())->state(), v1::JOB_STATE_FAILED);
  // The six beats of the live shards while the tables were held.
  EXPECT_EQ(core.counters().heartbeats_deferred, 6u);
}

std::unique_ptr<grpc::ClientContext> Ctx(absl::Duration timeout = absl::Seconds(30)) {
  auto ctx = std::make_unique<grpc::ClientContext>();
  ctx->set_deadline(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout)));
  return ctx;
}

// A clock tests move by hand, readable from the server's threads.
class ManualClock {
 public:
  absl::Time Now() const { return absl::FromUnixNanos(ns_.load()); }
  void Advance(absl::Duration d) { ns_.fetch_add(absl::ToInt64Nanoseconds(d)); }

 private:
  std::atomic<int64_t> ns_{absl::ToUnixNanos(absl::FromUnixSeconds(1700000000))};
};

TEST(FailureDetectionTest, TheServersLeaseThreadMarksASilentShardDownWhilePlanningIsBlocked) {
  ManualClock clock;
  CoordinatorOptions options;
  options.tls.plaintext = true;
  options.lease = kLease;
  options.sweep_interval = absl::Milliseconds(20);
  options.clock = [&clock] { return clock.Now(); };
  auto server = CoordinatorServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Coordinator::NewStub(
      grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials()));
  std::vector<uint64_t> ids;
  for (int i = 0; i < 2; ++i) {
    v1::RegisterShardResponse resp;
    ASSERT_TRUE(stub->RegisterShard(Ctx().get(), DpuRegistration(i), &resp).ok());
    ids.push_back(resp.shard_id());
  }
  const uint64_t silent = ids[0], alive = ids[1];
  auto beat = [&](uint64_t shard) {
    v1::HeartbeatRequest req;
    req.set_shard_id(shard);
    v1::HeartbeatResponse resp;
    const grpc::Status s = stub->Heartbeat(Ctx().get(), req, &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return resp.known();
  };
  Coordinator* core = (*server)->core();
  TablesHeld tables(core);
  // As in the core test: two half-leases, the live shard beating in each.
  clock.Advance(kLease / 2);
  EXPECT_TRUE(beat(alive));
  clock.Advance(kLease / 2 + absl::Milliseconds(1));
  EXPECT_TRUE(beat(alive));
  // The lease thread marks the silent shard DOWN with the tables held (the
  // hang guard is the only deadline).
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (!core->LeaseExpired(silent) && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(core->LeaseExpired(silent));
  EXPECT_FALSE(core->LeaseExpired(alive));
  EXPECT_TRUE(beat(alive));
  EXPECT_FALSE(beat(silent));  // Told to register again, tables still held.
  tables.Release();
  // The planning thread, woken by the lease thread, takes it into the
  // tables once they are free.
  v1::StatusResponse st;
  const absl::Time guard = absl::Now() + absl::Seconds(30);
  do {
    absl::SleepFor(absl::Milliseconds(10));
    ASSERT_TRUE(stub->Status(Ctx().get(), v1::StatusRequest(), &st).ok());
  } while (ShardIn(st, silent).state() != v1::SHARD_STATE_DOWN && absl::Now() < guard);
  EXPECT_EQ(ShardIn(st, silent).state(), v1::SHARD_STATE_DOWN);
  EXPECT_EQ(ShardIn(st, alive).state(), v1::SHARD_STATE_UP);
}

uint64_t MetricValue(const std::string& text, const std::string& name) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (!absl::StartsWith(line, name + " ")) continue;
    double v = 0;
    if (absl::SimpleAtod(line.substr(name.size() + 1), &v)) return static_cast<uint64_t>(v);
  }
  return 0;
}

TEST(FailureDetectionTest, ACallWhoseClientGaveUpWhileItWaitedIsNotExecuted) {
  CoordinatorOptions options;
  options.tls.plaintext = true;
  auto server = CoordinatorServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = v1::Coordinator::NewStub(
      grpc::CreateChannel((*server)->address(), grpc::InsecureChannelCredentials()));
  Coordinator* core = (*server)->core();
  TablesHeld tables(core);
  // The registration waits for the tables; its client gives up.
  constexpr absl::Duration kDeadline = absl::Milliseconds(300);
  v1::RegisterShardResponse resp;
  const grpc::Status s = stub->RegisterShard(Ctx(kDeadline).get(), DpuRegistration(0), &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
  // The server knows its client gave up once its copy of the deadline has
  // passed (or the cancellation reached it). That copy starts when the
  // call reaches the server, which a loaded machine may delay past the
  // client's own deadline: wait for the call to be seen there (waiting for
  // the tables, or dropped at once), then for its deadline, before freeing
  // the tables. Otherwise the call may rightly be served.
  const absl::Time guard = absl::Now() + absl::Seconds(30);
  // (The server's counters: its metrics page needs the tables.)
  while ((*server)->calls_in_progress() == 0 && (*server)->calls_dropped() == 0 &&
         absl::Now() < guard) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_LT(absl::Now(), guard) << "the registration never reached the server";
  // gRPC rounds the timeout it sends up by well under this margin.
  absl::SleepFor(kDeadline + absl::Milliseconds(500));
  tables.Release();
  // The server gets the tables, sees nobody waits, and drops it.
  while ((*server)->calls_dropped() == 0 && absl::Now() < guard) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ((*server)->calls_dropped(), 1u);
  EXPECT_EQ(MetricValue((*server)->RenderMetrics(), "optimus_coord_calls_dropped_total"), 1u);
  v1::StatusResponse st;
  ASSERT_TRUE(stub->Status(Ctx().get(), v1::StatusRequest(), &st).ok());
  EXPECT_EQ(st.shards_size(), 0);
  // Its id was never used up.
  ASSERT_TRUE(stub->RegisterShard(Ctx().get(), DpuRegistration(1), &resp).ok());
  EXPECT_EQ(resp.shard_id(), 1u);
}

TEST(FailureDetectionTest, WatchersCannotTakeEveryThreadOfTheCappedServer) {
  CoordinatorOptions options;
  options.tls.plaintext = true;
  options.max_rpc_threads = 8;  // So at most 4 watches.
  auto server = CoordinatorServer::Start(options);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = (*server)->address();
  auto stub = v1::Coordinator::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  std::vector<uint64_t> ids;
  for (int i = 0; i < 2; ++i) {
    v1::RegisterShardResponse resp;
    ASSERT_TRUE(stub->RegisterShard(Ctx().get(), DpuRegistration(i), &resp).ok());
    ids.push_back(resp.shard_id());
  }
  v1::CreateJobResponse job;
  ASSERT_TRUE(stub->CreateJob(Ctx().get(), OneTensorJob("watched", 8, 0), &job).ok());

  // 12 watchers, each on its own connection; an accepted one gets the map
  // and then blocks its server thread waiting for the next epoch.
  constexpr int kWatchers = 12;
  std::atomic<int> accepted{0}, refused{0}, other{0};
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::thread> watchers;
  absl::Mutex mu;
  int settled = 0;
  for (int i = 0; i < kWatchers; ++i) {
    contexts.push_back(Ctx(absl::Seconds(120)));
    grpc::ClientContext* ctx = contexts.back().get();
    watchers.emplace_back([&, ctx, i] {
      grpc::ChannelArguments args;
      args.SetInt("watcher", i);  // A connection of its own.
      auto own = v1::Coordinator::NewStub(
          grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
      v1::WatchShardMapRequest req;
      req.set_job_id(job.job_id());
      auto reader = own->WatchShardMap(ctx, req);
      v1::ShardMap map;
      const bool got = reader->Read(&map);
      // Counted before it says it settled.
      if (got) {
        accepted.fetch_add(1);
      } else {
        const grpc::Status s = reader->Finish();
        if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
          refused.fetch_add(1);
        } else {
          other.fetch_add(1);
          ADD_FAILURE() << "watch " << i << ": " << s.error_code() << " " << s.error_message();
        }
      }
      {
        absl::MutexLock lock(&mu);
        ++settled;
      }
      if (!got) return;
      while (reader->Read(&map)) {
      }
      reader->Finish();
    });
  }
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](int* n) { return *n == kWatchers; }, &settled));
  }
  // At most half the threads; a watch beyond is refused (by the service,
  // or by gRPC while every thread was busy).
  EXPECT_GE(accepted.load(), 1);
  EXPECT_LE(accepted.load(), 4);
  EXPECT_EQ(accepted.load() + refused.load(), kWatchers);
  EXPECT_EQ(other.load(), 0);

  // The refused watches' server threads go back to the quota a moment
  // after their callers got the answer: wait for that (a call served),
  // with a deadline. Were the watches holding every thread, none would be.
  {
    const absl::Time guard = absl::Now() + absl::Seconds(30);
    grpc::Status s;
    do {
      v1::StatusResponse st;
      s = stub->Status(Ctx().get(), v1::StatusRequest(), &st);
      if (!s.ok()) absl::SleepFor(absl::Milliseconds(10));
    } while (!s.ok() && absl::Now() < guard);
    ASSERT_TRUE(s.ok()) << "no call served while 4 watches held their threads: "
                        << s.error_message();
  }
  // With four threads held by watches, every other call is still served.
  for (int round = 0; round < 20; ++round) {
    for (uint64_t id : ids) {
      v1::HeartbeatRequest req;
      req.set_shard_id(id);
      v1::HeartbeatResponse resp;
      const grpc::Status s = stub->Heartbeat(Ctx().get(), req, &resp);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_TRUE(resp.known());
    }
    v1::RegisterShardResponse reg;
    const grpc::Status r = stub->RegisterShard(Ctx().get(), DpuRegistration(100 + round), &reg);
    ASSERT_TRUE(r.ok()) << r.error_message();
    v1::StatusResponse st;
    const grpc::Status s = stub->Status(Ctx().get(), v1::StatusRequest(), &st);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  for (auto& ctx : contexts) ctx->TryCancel();
  for (std::thread& t : watchers) t.join();
}

}  // namespace
}  // namespace optimus
