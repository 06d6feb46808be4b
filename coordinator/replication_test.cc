// Replication, failover and drain in the coordinator core, driven by fake
// shard heartbeats and a fake clock (no servers, no real shards): where
// backups go, when a lost shard's chunks fail over and when the job fails,
// how a drain empties a shard, and what status says about it.
// (Over 600 lines: one fixture and its scenarios, which read best together;
// the planning rules themselves are tested case by case in
// map_planner_test.cc.)
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "common/checkpoint_files.h"
#include "client/map_delta.h"
#include "coordinator/coordinator.h"
#include "coordinator/test_fixtures.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/optimizer_spec.h"
#include "proto/optimus.pb.h"

namespace optimus {
namespace {

using coord_test::OneTensorJob;

using ::testing::HasSubstr;

constexpr absl::Duration kLease = absl::Seconds(2);

// world 1, bf16 grads and params, AdamW: 12 + 2 + 2*2 = 18 bytes per element.
constexpr uint64_t kBytesPerElem = 18;
// Chunks of 64 elements (256 bytes of fp32): 1152 bytes of shard state each,
// and the chunk's bookkeeping (kernels::ChunkOverheadBytes of world 1).
constexpr uint64_t kChunkOverhead =
    kernels::kChunkOverheadBytes + kernels::kChunkRankOverheadBytes;
constexpr uint64_t kChunkBytes = 64 * kBytesPerElem + kChunkOverhead;
// A replicated chunk also holds the fp32 gradient sum: 4 more per element.
constexpr uint64_t kRepChunkBytes = 64 * (kBytesPerElem + 4) + kChunkOverhead;


class ReplicationTest : public ::testing::Test {
 protected:
  ReplicationTest() {
    options_.lease = kLease;
    options_.clock = [this] { return now_; };
  }
  void SetUp() override { Start(); }

  void Start() {
    coord_ = std::make_unique<Coordinator>(options_);
    ASSERT_TRUE(coord_->Recover().ok());
  }

  uint64_t AddShard(v1::ShardKind kind = v1::SHARD_KIND_DPU,
                    uint64_t memory_limit_bytes = uint64_t{1} << 30, bool checkpoints = false) {
    v1::RegisterShardRequest req = coord_test::DpuRegistration(next_name_++, memory_limit_bytes);
    v1::ShardCapabilities* c = req.mutable_capabilities();
    c->set_kind(kind);
    c->set_checkpoints(checkpoints);
    auto resp = coord_->RegisterShard(req);
    EXPECT_TRUE(resp.ok()) << resp.status();
    return resp->shard_id();
  }

  v1::ShardMap Map(uint64_t job_id) {
    auto map = coord_->GetShardMap(job_id);
    EXPECT_TRUE(map.ok()) << map.status();
    return *map;
  }

  // What a shard reports for `job_id` after loading the current map: every
  // chunk it is primary or backup of loaded, and its backups seeded or not.
  v1::ShardJobProgress Progress(uint64_t shard, uint64_t job_id, bool seeded,
                                uint64_t applied_step = 0) {
    const v1::ShardMap map = Map(job_id);
    v1::ShardJobProgress p;
    p.set_job_id(job_id);
    p.set_map_epoch(map.epoch());
    uint32_t primary = 0, backup = 0;
    for (const auto& c : map.chunks()) {
      primary += c.shard_id() == shard ? 1 : 0;
      backup += c.backup_shard_id() == shard ? 1 : 0;
    }
    p.set_primary_chunks(primary);
    p.set_backup_chunks(backup);
    p.set_chunks_loaded(primary + backup);
    p.set_backups_seeded(seeded ? backup : 0);
    p.set_primaries_replicated(primary);
    p.set_applied_step(applied_step);
    p.set_max_applied_step(applied_step);
    return p;
  }

  // A heartbeat from `shard` reporting every job it has an assignment for
  // (the assignments come from a first, empty beat, as a real shard learns
  // them).
  v1::HeartbeatResponse Beat(uint64_t shard, bool seeded = true) {
    v1::HeartbeatRequest req;
    req.set_shard_id(shard);
    v1::HeartbeatResponse first = coord_->Heartbeat(req);
    for (const auto& a : first.assignments()) *req.add_jobs() = Progress(shard, a.job_id(), seeded);
    return coord_->Heartbeat(req);
  }

  // Every shard in `shards` loads the current maps (backups seeded or not).
  void BeatAll(const std::set<uint64_t>& shards, bool seeded = true) {
    for (uint64_t s : shards) Beat(s, seeded);
  }

  // `dead` stops beating: the clock passes its lease while the others renew
  // theirs (without any job report), then the sweeper runs.
  int Kill(const std::set<uint64_t>& dead, const std::set<uint64_t>& alive) {
    now_ += kLease / 2;
    for (uint64_t s : alive) KeepAlive(s);
    now_ += kLease / 2 + absl::Milliseconds(1);
    for (uint64_t s : alive) KeepAlive(s);
    return coord_->SweepExpiredLeases(now_);
  }

  void KeepAlive(uint64_t shard) {
    v1::HeartbeatRequest req;
    req.set_shard_id(shard);
    EXPECT_TRUE(coord_->Heartbeat(req).known()) << "shard " << shard;
  }

  v1::JobStatus JobStatusOf(uint64_t job_id) {
    const v1::StatusResponse st = coord_->Status();
    for (const auto& j : st.jobs()) {
      if (j.job_id() == job_id) return j;
    }
    ADD_FAILURE() << "no job " << job_id;
    return v1::JobStatus();
  }

  v1::ShardStatus ShardStatusOf(uint64_t shard_id) {
    const v1::StatusResponse st = coord_->Status();
    for (const auto& s : st.shards()) {
      if (s.shard_id() == shard_id) return s;
    }
    ADD_FAILURE() << "no shard " << shard_id;
    return v1::ShardStatus();
  }

  uint64_t CreateOk(const v1::CreateJobRequest& req) {
    auto created = coord_->CreateJob(req);
    EXPECT_TRUE(created.ok()) << created.status();
    return created.ok() ? created->job_id() : 0;
  }

  absl::Time now_ = absl::FromUnixSeconds(1700000000);
  CoordinatorOptions options_;
  std::unique_ptr<Coordinator> coord_;
  int next_name_ = 0;
};

// Shards named as primary or backup anywhere in the map.
std::set<uint64_t> Holders(const v1::ShardMap& map) {
  std::set<uint64_t> out;
  for (const auto& c : map.chunks()) {
    out.insert(c.shard_id());
    if (c.backup_shard_id() != 0) out.insert(c.backup_shard_id());
  }
  return out;
}

std::set<uint64_t> Endpoints(const v1::ShardMap& map) {
  std::set<uint64_t> out;
  for (const auto& e : map.shards()) out.insert(e.shard_id());
  return out;
}

uint32_t Count(const v1::ShardMap& map, uint64_t shard, bool as_backup) {
  uint32_t n = 0;
  for (const auto& c : map.chunks()) {
    n += (as_backup ? c.backup_shard_id() : c.shard_id()) == shard ? 1 : 0;
  }
  return n;
}

TEST_F(ReplicationTest, BackupsGoToAnotherShardAndCountInLoadMemoryAndReadiness) {
  const uint64_t a = AddShard(), b = AddShard(), c = AddShard();
  const uint64_t job = CreateOk(OneTensorJob("llm", 6, 1));
  const v1::ShardMap map = Map(job);
  ASSERT_EQ(map.chunks_size(), 6);
  for (const auto& ch : map.chunks()) {
    EXPECT_NE(ch.backup_shard_id(), 0u);
    EXPECT_NE(ch.backup_shard_id(), ch.shard_id());
  }
  // Every holder is an endpoint, and each shard holds 2 primaries and 2
  // backups: 4 chunks' worth of memory.
  EXPECT_EQ(Endpoints(map), Holders(map));
  EXPECT_EQ(Holders(map), (std::set<uint64_t>{a, b, c}));
  for (uint64_t s : {a, b, c}) {
    const v1::ShardStatus st = ShardStatusOf(s);
    EXPECT_EQ(st.chunks_owned(), 4u) << s;
    EXPECT_EQ(st.backup_chunks(), 2u) << s;
    EXPECT_EQ(st.memory_planned_bytes(), 4 * kRepChunkBytes) << s;
  }
  v1::JobStatus js = JobStatusOf(job);
  EXPECT_EQ(js.replication(), 1u);
  EXPECT_EQ(js.num_chunks(), 6u);
  EXPECT_EQ(js.chunks_with_backup(), 6u);
  EXPECT_EQ(js.backups_in_sync(), 0u);

  // Backups are loaded like primaries: READY waits for every holder.
  BeatAll({a, b}, /*seeded=*/false);
  EXPECT_EQ(JobStatusOf(job).state(), v1::JOB_STATE_PENDING);
  Beat(c, /*seeded=*/false);
  js = JobStatusOf(job);
  EXPECT_EQ(js.state(), v1::JOB_STATE_READY);
  EXPECT_EQ(js.backups_in_sync(), 0u);
  // In sync only once a shard says all its backups of the job are seeded.
  BeatAll({a, b});
  EXPECT_EQ(JobStatusOf(job).backups_in_sync(), 4u);
  Beat(c);
  EXPECT_EQ(JobStatusOf(job).backups_in_sync(), 6u);
}

TEST_F(ReplicationTest, ReplicationIsZeroOrOneAndOneNeedsTwoShardsAndRoomForBackups) {
  const uint64_t a = AddShard(v1::SHARD_KIND_DPU, 4 * kChunkBytes);
  auto r = coord_->CreateJob(OneTensorJob("two", 2, 2));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("replication must be 0 or 1"));

  r = coord_->CreateJob(OneTensorJob("one-shard", 2, 1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("at least 2 live shards"));
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("1 live"));

  // Room for 4 chunks on a and 1 on b: 3 chunks fit without backups, not with.
  const uint64_t b = AddShard(v1::SHARD_KIND_DPU, kChunkBytes);
  r = coord_->CreateJob(OneTensorJob("big", 3, 1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("for their backups"));
  EXPECT_TRUE(coord_->Status().jobs().empty());
  const uint64_t job = CreateOk(OneTensorJob("big", 3, 0));
  EXPECT_EQ(JobStatusOf(job).replication(), 0u);
  EXPECT_EQ(JobStatusOf(job).chunks_with_backup(), 0u);
  (void)a;
  (void)b;
}

TEST_F(ReplicationTest, LostPrimaryFailsOverToSeededBackupsWithOneEpochBump) {
  const uint64_t a = AddShard(), b = AddShard(), c = AddShard();
  const uint64_t job = CreateOk(OneTensorJob("llm", 6, 1));
  const v1::ShardMap before = Map(job);
  BeatAll({a, b, c});
  ASSERT_EQ(JobStatusOf(job).state(), v1::JOB_STATE_READY);
  ASSERT_EQ(JobStatusOf(job).backups_in_sync(), 6u);

  EXPECT_EQ(Kill({a}, {b, c}), 1);
  EXPECT_EQ(ShardStatusOf(a).state(), v1::SHARD_STATE_DOWN);
  const v1::ShardMap after = Map(job);
  EXPECT_EQ(after.epoch(), before.epoch() + 1);
  EXPECT_EQ(JobStatusOf(job).state(), v1::JOB_STATE_READY);  // Not back to PENDING.
  for (int i = 0; i < after.chunks_size(); ++i) {
    const auto& was = before.chunks(i);
    const auto& now = after.chunks(i);
    // a's primaries are now served by their old backups.
    EXPECT_EQ(now.shard_id(), was.shard_id() == a ? was.backup_shard_id() : was.shard_id());
    // Every chunk has a backup again, on the other survivor.
    EXPECT_NE(now.backup_shard_id(), 0u);
    EXPECT_NE(now.backup_shard_id(), now.shard_id());
    EXPECT_NE(now.backup_shard_id(), a);
    // Chunks that kept both copies keep them where they were.
    if (was.shard_id() != a && was.backup_shard_id() != a) {
      EXPECT_EQ(now.backup_shard_id(), was.backup_shard_id());
    }
  }
  EXPECT_EQ(Endpoints(after), (std::set<uint64_t>{b, c}));
  // The new backups are not in sync until their shards say so; the ones
  // that did not move still are.
  v1::JobStatus js = JobStatusOf(job);
  EXPECT_EQ(js.chunks_with_backup(), 6u);
  EXPECT_EQ(js.backups_in_sync(), 2u);  // b's and c's backup of each other's primary.

  // Nothing more happens on later sweeps and ticks.
  EXPECT_EQ(coord_->SweepExpiredLeases(now_), 0);
  EXPECT_EQ(coord_->TickReplication(now_), 0);
  EXPECT_EQ(Map(job).epoch(), after.epoch());
  BeatAll({b, c});
  EXPECT_EQ(JobStatusOf(job).backups_in_sync(), 6u);
  // The dead shard is told to register again.
  v1::HeartbeatRequest hb;
  hb.set_shard_id(a);
  EXPECT_FALSE(coord_->Heartbeat(hb).known());
}

// A shard's part of the map (GetJob for_shard_id) is cut from the current
// epoch's snapshot: read before and after a failover, it follows the map.
TEST_F(ReplicationTest, AShardsPartOfTheMapFollowsAFailover) {
  const uint64_t a = AddShard(), b = AddShard(), c = AddShard();
  const uint64_t job = CreateOk(OneTensorJob("llm", 6, 1));
  // Chunks (as serialized) of `map` that `shard` holds.
  auto held_in = [](const v1::ShardMap& map, uint64_t shard) {
    std::vector<std::string> out;
    for (const auto& ch : map.chunks()) {
      if (ch.shard_id() == shard || ch.backup_shard_id() == shard) {
        out.push_back(ch.SerializeAsString());
      }
    }
    return out;
  };
  auto part = [&](uint64_t shard) {
    auto got = coord_->GetJob(job, shard);
    EXPECT_TRUE(got.ok()) << got.status();
    return got->map();
  };
  for (uint64_t s : {a, b, c}) {
    const v1::ShardMap p = part(s);
    EXPECT_EQ(p.epoch(), 1u);
    EXPECT_EQ(held_in(p, s), held_in(Map(job), s));
    EXPECT_EQ(held_in(p, s).size(), static_cast<size_t>(p.chunks_size()));
  }
  BeatAll({a, b, c});
  ASSERT_EQ(Kill({a}, {b, c}), 1);
  const v1::ShardMap after = Map(job);
  ASSERT_EQ(after.epoch(), 2u);
  for (uint64_t s : {b, c}) {
    const v1::ShardMap p = part(s);
    EXPECT_EQ(p.epoch(), 2u) << s;
    EXPECT_EQ(held_in(p, s), held_in(after, s)) << s;
    EXPECT_EQ(static_cast<size_t>(p.chunks_size()), held_in(after, s).size()) << s;
    // Its peers now: itself and the other survivor, never the dead shard.
    EXPECT_EQ(Endpoints(p), (std::set<uint64_t>{b, c})) << s;
  }
  // The dead shard holds nothing under the new map.
  EXPECT_EQ(part(a).chunks_size(), 0);
  EXPECT_EQ(part(a).epoch(), 2u);
}

// A failover's new epoch changes the parts of the shards that held the
// lost shard's chunks or take them over, not the others'. Heartbeats say
// which epoch last changed each shard's part (Assignment.part_epoch): a
// shard whose part the failover left as it was takes the new epoch
// without fetching it, the others fetch. A coordinator that restarts
// knows no history: every part counts as changed at the epoch it loaded.
TEST_F(ReplicationTest, HeartbeatsTellWhichShardsPartsAFailoverChanged) {
  options_.state_store = std::make_shared<MemoryStateStore>();
  Start();
  std::vector<uint64_t> shards;
  for (int i = 0; i < 8; ++i) shards.push_back(AddShard());
  const uint64_t job = CreateOk(OneTensorJob("llm", 8, 1));
  // What a shard loads: its chunks and its endpoints, without the epoch.
  auto part = [&](uint64_t shard) {
    auto got = coord_->GetJob(job, shard);
    EXPECT_TRUE(got.ok()) << got.status();
    v1::ShardMap m = got->map();
    m.clear_epoch();
    return m.SerializeAsString();
  };
  auto part_epoch = [&](uint64_t shard) -> uint64_t {
    const v1::HeartbeatResponse r = Beat(shard);
    for (const auto& a : r.assignments()) {
      if (a.job_id() == job) return a.part_epoch();
    }
    ADD_FAILURE() << "no assignment for shard " << shard;
    return 0;
  };
  std::map<uint64_t, std::string> before;
  for (uint64_t s : shards) {
    before[s] = part(s);
    EXPECT_EQ(part_epoch(s), 1u) << "shard " << s;
  }
  ASSERT_EQ(JobStatusOf(job).state(), v1::JOB_STATE_READY);
  const uint64_t lost = shards[0];
  std::set<uint64_t> alive(shards.begin() + 1, shards.end());
  ASSERT_EQ(Kill({lost}, alive), 1);
  ASSERT_EQ(Map(job).epoch(), 2u);
  int changed = 0, unchanged = 0;
  for (uint64_t s : alive) {
    const bool moved = part(s) != before[s];
    (moved ? changed : unchanged)++;
    EXPECT_EQ(part_epoch(s), moved ? 2u : 1u) << "shard " << s;
  }
  // Both kinds occur, or the test says nothing.
  ASSERT_GT(changed, 0);
  ASSERT_GT(unchanged, 0);

  Start();  // Over the same state: the part history is gone.
  ASSERT_EQ(Map(job).epoch(), 2u);
  for (uint64_t s : alive) EXPECT_EQ(part_epoch(s), 2u) << "shard " << s;
}

// A worker that holds the map of an older epoch (GetJobRequest.known_epoch)
// gets the chunks moved since, as they are now, with their holders'
// endpoints, and no spec; applied to its map they give the whole new map.
// An epoch older than what the coordinator remembers (here: it restarted)
// gets the whole map, still without the spec.
TEST_F(ReplicationTest, WorkersGetWhatAFailoverMovedAsADelta) {
  options_.state_store = std::make_shared<MemoryStateStore>();
  Start();
  std::vector<uint64_t> shards;
  for (int i = 0; i < 8; ++i) shards.push_back(AddShard());
  const uint64_t job = CreateOk(OneTensorJob("llm", 16, 1));
  const v1::ShardMap before = Map(job);
  // A shard that joins after the job holds nothing of it yet: the
  // failover's new backups go to it first (the least loaded).
  const uint64_t fresh = AddShard();
  shards.push_back(fresh);
  BeatAll(std::set<uint64_t>(shards.begin(), shards.end()));
  std::set<uint64_t> alive(shards.begin() + 1, shards.end());
  ASSERT_EQ(Kill({shards[0]}, alive), 1);
  const v1::ShardMap after = Map(job);
  ASSERT_EQ(after.epoch(), 2u);

  auto read = [&](uint64_t known_epoch, v1::ShardMap* map) {
    absl::StatusOr<Coordinator::SerializedJob> got = coord_->GetJobSerialized(job, 0, known_epoch);
    EXPECT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->spec, nullptr) << "the worker has the spec";
    EXPECT_TRUE(map->ParseFromString(*got->map));
    return got->head.map_delta_from();
  };
  v1::ShardMap delta;
  ASSERT_EQ(read(1, &delta), 1u);
  EXPECT_EQ(delta.epoch(), 2u);
  std::set<std::pair<uint32_t, uint32_t>> in_delta;
  for (const auto& c : delta.chunks()) {
    in_delta.insert({c.tensor(), c.chunk()});
    EXPECT_NE(c.shard_id(), shards[0]);
    EXPECT_NE(c.backup_shard_id(), shards[0]);
  }
  int moved = 0;
  for (int i = 0; i < after.chunks_size(); ++i) {
    const bool changed =
        after.chunks(i).SerializeAsString() != before.chunks(i).SerializeAsString();
    moved += changed;
    EXPECT_EQ(in_delta.count({after.chunks(i).tensor(), after.chunks(i).chunk()}) != 0, changed)
        << "chunk " << i;
  }
  ASSERT_GT(moved, 0);
  ASSERT_LT(moved, after.chunks_size()) << "the test needs chunks that stayed";
  // Only shards that were not holders before come with their endpoints
  // (the worker has the others'), and the delta applied to the worker's
  // map is the new map.
  for (const auto& e : delta.shards()) EXPECT_EQ(Holders(before).count(e.shard_id()), 0u);
  ASSERT_EQ(Holders(after).count(fresh), 1u);
  EXPECT_EQ(Endpoints(delta), (std::set<uint64_t>{fresh}));
  absl::StatusOr<v1::ShardMap> applied = ApplyMapDelta(before, delta);
  ASSERT_TRUE(applied.ok()) << applied.status();
  ASSERT_EQ(applied->chunks_size(), after.chunks_size());
  for (int i = 0; i < after.chunks_size(); ++i) {
    EXPECT_EQ(applied->chunks(i).SerializeAsString(), after.chunks(i).SerializeAsString()) << i;
  }
  EXPECT_EQ(Endpoints(*applied), Endpoints(after));
  // At the current epoch: an empty delta.
  v1::ShardMap none;
  EXPECT_EQ(read(2, &none), 2u);
  EXPECT_EQ(none.chunks_size(), 0);

  Start();  // The change history is gone.
  v1::ShardMap whole;
  EXPECT_EQ(read(1, &whole), 0u);
  EXPECT_EQ(whole.SerializeAsString(), after.SerializeAsString());
}

// A new job's shards fetch their parts at most options.map_fetches_per_s a
// second, half a second's worth at once: every heartbeat reply names the
// new epoch, and past the rate it gives the shard a later slot
// (Assignment.fetch_after_ms). A shard told again keeps its slot; one that
// has the current epoch gets none.
TEST_F(ReplicationTest, ShardsFetchNewPartsInSlotsAtTheConfiguredRate) {
  options_.map_fetches_per_s = 4;  // One slot every 250 ms.
  Start();
  std::vector<uint64_t> shards;
  for (int i = 0; i < 6; ++i) shards.push_back(AddShard());
  const uint64_t job = CreateOk(OneTensorJob("llm", 12, 0));
  ASSERT_EQ(Holders(Map(job)).size(), 6u);
  // The fetch_after_ms of the job's assignment (-1: none).
  auto slot = [&](uint64_t shard, bool loaded = false) -> int64_t {
    v1::HeartbeatRequest req;
    req.set_shard_id(shard);
    if (loaded) *req.add_jobs() = Progress(shard, job, true);
    const v1::HeartbeatResponse r = coord_->Heartbeat(req);
    EXPECT_TRUE(r.known());
    if (r.assignments_size() != 1 || r.assignments(0).job_id() != job) return -1;
    return r.assignments(0).fetch_after_ms();
  };
  // Half a second's worth of slots (and the current one) are free.
  EXPECT_EQ(slot(shards[0]), 0);
  EXPECT_EQ(slot(shards[1]), 0);
  EXPECT_EQ(slot(shards[2]), 0);
  EXPECT_EQ(slot(shards[3]), 250);
  EXPECT_EQ(slot(shards[4]), 500);
  EXPECT_EQ(coord_->counters().map_fetches_delayed, 2u);
  now_ += absl::Milliseconds(100);
  EXPECT_EQ(slot(shards[4]), 400) << "a shard told again keeps its slot";
  EXPECT_EQ(slot(shards[0]), 0);
  // Loaded (it reports the current epoch): nothing to fetch, no slot taken.
  EXPECT_EQ(slot(shards[5], /*loaded=*/true), 0);
  EXPECT_EQ(slot(shards[5]), 650) << "the next free slot";
  EXPECT_EQ(coord_->counters().map_fetches_delayed, 3u);
  // After a quiet spell, half a second's worth is free at once again.
  now_ += absl::Seconds(10);
  const uint64_t second = CreateOk(OneTensorJob("second", 12, 0));
  int at_once = 0;
  for (uint64_t s : shards) {
    v1::HeartbeatRequest req;
    req.set_shard_id(s);
    const v1::HeartbeatResponse r = coord_->Heartbeat(req);
    for (const auto& a : r.assignments()) {
      if (a.job_id() == second && a.fetch_after_ms() == 0) ++at_once;
    }
  }
  EXPECT_EQ(at_once, 3);
}

TEST_F(ReplicationTest, LostPrimaryWithBackupsNotYetSeededFailsTheJob) {
  const uint64_t a = AddShard(), b = AddShard(), c = AddShard();
  const uint64_t job = CreateOk(OneTensorJob("llm", 6, 1));
  BeatAll({a, b, c}, /*seeded=*/false);
  ASSERT_EQ(JobStatusOf(job).state(), v1::JOB_STATE_READY);
  const uint64_t epoch = Map(job).epoch();
  Kill({a}, {b, c});
  EXPECT_EQ(JobStatusOf(job).state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(Map(job).epoch(), epoch);
  // Its memory is planned nowhere any more.
  for (uint64_t s : {b, c}) EXPECT_EQ(ShardStatusOf(s).memory_planned_bytes(), 0u);
}

TEST_F(ReplicationTest, LosingAPrimaryAndItsBackupTogetherFailsTheJob) {
  const uint64_t a = AddShard(), b = AddShard(), c = AddShard();
  const uint64_t job = CreateOk(OneTensorJob("llm", 6, 1));
  BeatAll({a, b, c});
  Kill({a, b}, {c});
  EXPECT_EQ(JobStatusOf(job).state(), v1::JOB_STATE_FAILED);
}

TEST_F(ReplicationTest, ReplicationZeroStillFailsOnALostShard) {
  const uint64_t a = AddShard(), b = AddShard();
  const uint64_t job = CreateOk(OneTensorJob("llm", 4, 0));
  BeatAll({a, b});
  Kill({a}, {b});
  EXPECT_EQ(JobStatusOf(job).state(), v1::JOB_STATE_FAILED);
}

TEST_F(ReplicationTest, LostBackupShardLeavesTheJobReadyAndAReplacementGetsTheBackups) {
  // Two DPUs with room for the primaries only; the host holds every backup.
  const uint64_t a = AddShard(v1::SHARD_KIND_DPU, 2 * kRepChunkBytes);
  const uint64_t b = AddShard(v1::SHARD_KIND_DPU, 2 * kRepChunkBytes);
  const uint64_t h = AddShard(v1::SHARD_KIND_HOST);
  const uint64_t job = CreateOk(OneTensorJob("llm", 4, 1));
  ASSERT_EQ(Count(Map(job), h, /*as_backup=*/true), 4u);
  ASSERT_EQ(Count(Map(job), h, /*as_backup=*/false), 0u);
  // Backups never seeded: losing them must not matter.
  BeatAll({a, b, h}, /*seeded=*/false);
  Kill({h}, {a, b});
  v1::ShardMap map = Map(job);
  EXPECT_EQ(map.epoch(), 2u);
  EXPECT_EQ(JobStatusOf(job).state(), v1::JOB_STATE_READY);
  // No room anywhere else: degraded, not failed.
  for (const auto& ch : map.chunks()) EXPECT_EQ(ch.backup_shard_id(), 0u);
  EXPECT_EQ(JobStatusOf(job).chunks_with_backup(), 0u);
  EXPECT_EQ(Endpoints(map), (std::set<uint64_t>{a, b}));
  EXPECT_EQ(coord_->TickReplication(now_), 0);  // Still no room: nothing changes.
  EXPECT_EQ(Map(job).epoch(), 2u);

  // A replacement shard registers: the next tick gives every chunk a backup
  // there, in one epoch bump, and the one after changes nothing.
  const uint64_t h2 = AddShard(v1::SHARD_KIND_HOST);
  EXPECT_EQ(coord_->TickReplication(now_), 1);
  map = Map(job);
  EXPECT_EQ(map.epoch(), 3u);
  for (const auto& ch : map.chunks()) EXPECT_EQ(ch.backup_shard_id(), h2);
  EXPECT_EQ(coord_->TickReplication(now_), 0);
  EXPECT_EQ(Map(job).epoch(), 3u);
  EXPECT_EQ(JobStatusOf(job).chunks_with_backup(), 4u);
  EXPECT_EQ(JobStatusOf(job).backups_in_sync(), 0u);
  EXPECT_EQ(ShardStatusOf(h2).backup_chunks(), 4u);
  Beat(h2);
  EXPECT_EQ(JobStatusOf(job).backups_in_sync(), 4u);
}

TEST_F(ReplicationTest, SeededReportsCountOnlyForTheCurrentMap) {
  const uint64_t a = AddShard(), b = AddShard();
  const uint64_t job = CreateOk(OneTensorJob("llm", 2, 1));
  // A report about another epoch says nothing about the current backups.
  v1::HeartbeatRequest req;
  req.set_shard_id(b);
  v1::ShardJobProgress stale = Progress(b, job, /*seeded=*/true);
  stale.set_map_epoch(stale.map_epoch() + 5);
  *req.add_jobs() = stale;
  coord_->Heartbeat(req);
  EXPECT_EQ(JobStatusOf(job).backups_in_sync(), 0u);
  // Nor does one where only some of the shard's backups are seeded.
  v1::ShardJobProgress partial = Progress(a, job, /*seeded=*/true);
  ASSERT_EQ(partial.backup_chunks(), 1u);
  partial.set_backup_chunks(2);
  req.clear_jobs();
  req.set_shard_id(a);
  *req.add_jobs() = partial;
  coord_->Heartbeat(req);
  EXPECT_EQ(JobStatusOf(job).backups_in_sync(), 0u);
  Beat(a);
  EXPECT_EQ(JobStatusOf(job).backups_in_sync(), 1u);
}

TEST_F(ReplicationTest, DrainOfAReplicatedShardPromotesAndReplacesInOneEpoch) {
  const uint64_t a = AddShard(), b = AddShard(), c = AddShard();
  const uint64_t job = CreateOk(OneTensorJob("llm", 6, 1));
  const v1::ShardMap before = Map(job);
  BeatAll({a, b, c});
  ASSERT_EQ(JobStatusOf(job).backups_in_sync(), 6u);

  v1::DrainShardRequest drain;
  drain.set_shard_id(a);
  auto resp = coord_->DrainShard(drain);
  ASSERT_TRUE(resp.ok()) << resp.status();
  EXPECT_EQ(resp->shard().state(), v1::SHARD_STATE_DRAINING);
  EXPECT_EQ(resp->chunks_to_move(), 4u);
  EXPECT_EQ(ShardStatusOf(a).state(), v1::SHARD_STATE_DRAINING);
  // Idempotent.
  resp = coord_->DrainShard(drain);
  ASSERT_TRUE(resp.ok()) << resp.status();
  EXPECT_EQ(resp->chunks_to_move(), 4u);
  // A draining shard keeps its lease and its assignment until moved off.
  EXPECT_EQ(Beat(a).assignments_size(), 1);

  EXPECT_EQ(coord_->TickReplication(now_), 1);
  const v1::ShardMap after = Map(job);
  EXPECT_EQ(after.epoch(), before.epoch() + 1);
  EXPECT_EQ(JobStatusOf(job).state(), v1::JOB_STATE_READY);
  for (int i = 0; i < after.chunks_size(); ++i) {
    const auto& was = before.chunks(i);
    const auto& now = after.chunks(i);
    EXPECT_EQ(now.shard_id(), was.shard_id() == a ? was.backup_shard_id() : was.shard_id());
    EXPECT_NE(now.backup_shard_id(), a);
    EXPECT_NE(now.backup_shard_id(), 0u);
    EXPECT_NE(now.backup_shard_id(), now.shard_id());
  }
  EXPECT_EQ(Holders(after).count(a), 0u);
  EXPECT_EQ(Endpoints(after).count(a), 0u);
  v1::ShardStatus st = ShardStatusOf(a);
  EXPECT_EQ(st.state(), v1::SHARD_STATE_DRAINING);
  EXPECT_EQ(st.memory_planned_bytes(), 0u);
  EXPECT_EQ(st.backup_chunks(), 0u);
  // a still holds its 4 chunks until it applies the map that moved them
  // (it must not be stopped before): it is told the job's new epoch until
  // it reports having loaded it.
  EXPECT_EQ(st.chunks_owned(), 4u);
  v1::HeartbeatRequest empty;
  empty.set_shard_id(a);
  // Not before b and c, which forward to a under the old map, have the new
  // one.
  EXPECT_EQ(coord_->Heartbeat(empty).assignments_size(), 0);
  Beat(b);
  EXPECT_EQ(coord_->Heartbeat(empty).assignments_size(), 0);
  Beat(c);
  v1::HeartbeatResponse hb = coord_->Heartbeat(empty);
  ASSERT_EQ(hb.assignments_size(), 1);
  EXPECT_EQ(hb.assignments(0).map_epoch(), after.epoch());
  EXPECT_EQ(coord_->Heartbeat(empty).assignments_size(), 1);
  Beat(a);  // Reports the job at the current epoch, with nothing loaded.
  EXPECT_EQ(coord_->Heartbeat(empty).assignments_size(), 0);
  EXPECT_EQ(ShardStatusOf(a).chunks_owned(), 0u);  // Drained: it can be stopped.
  EXPECT_EQ(coord_->TickReplication(now_), 0);

  // The operator stops it: its lease runs out and nothing fails or moves.
  Kill({a}, {b, c});
  EXPECT_EQ(ShardStatusOf(a).state(), v1::SHARD_STATE_DOWN);
  EXPECT_EQ(JobStatusOf(job).state(), v1::JOB_STATE_READY);
  EXPECT_EQ(Map(job).epoch(), after.epoch());
}

TEST_F(ReplicationTest, DrainWithoutReplicationSeedsATemporaryBackupThenPromotesIt) {
  const uint64_t a = AddShard(), b = AddShard();
  const uint64_t job = CreateOk(OneTensorJob("llm", 4, 0));
  const v1::ShardMap before = Map(job);
  const uint32_t on_a = Count(before, a, false);
  ASSERT_GT(on_a, 0u);
  BeatAll({a, b});
  v1::DrainShardRequest drain;
  drain.set_shard_id(a);
  auto resp = coord_->DrainShard(drain);
  ASSERT_TRUE(resp.ok()) << resp.status();
  EXPECT_EQ(resp->chunks_to_move(), on_a);

  // Phase 1: a stays primary; b gets a temporary backup of a's chunks.
  EXPECT_EQ(coord_->TickReplication(now_), 1);
  v1::ShardMap map = Map(job);
  EXPECT_EQ(map.epoch(), 2u);
  EXPECT_EQ(Count(map, a, false), on_a);
  EXPECT_EQ(Count(map, b, true), on_a);
  EXPECT_EQ(JobStatusOf(job).chunks_with_backup(), on_a);
  EXPECT_EQ(JobStatusOf(job).state(), v1::JOB_STATE_READY);

  // Not seeded yet (a has not stepped): nothing is promoted, however often
  // the tick runs; a seeded report about the old map does not count either.
  BeatAll({a, b}, /*seeded=*/false);
  EXPECT_EQ(coord_->TickReplication(now_), 0);
  v1::HeartbeatRequest old;
  old.set_shard_id(b);
  v1::ShardJobProgress p = Progress(b, job, /*seeded=*/true);
  p.set_map_epoch(1);
  *old.add_jobs() = p;
  coord_->Heartbeat(old);
  EXPECT_EQ(coord_->TickReplication(now_), 0);
  EXPECT_EQ(Map(job).epoch(), 2u);
  EXPECT_EQ(Count(Map(job), a, false), on_a);

  // Phase 2: b reports them seeded; the next tick promotes them and drops
  // the backups (replication 0).
  Beat(b);
  EXPECT_EQ(JobStatusOf(job).backups_in_sync(), on_a);
  EXPECT_EQ(coord_->TickReplication(now_), 1);
  map = Map(job);
  EXPECT_EQ(map.epoch(), 3u);
  EXPECT_EQ(Holders(map), (std::set<uint64_t>{b}));
  EXPECT_EQ(JobStatusOf(job).chunks_with_backup(), 0u);
  EXPECT_EQ(ShardStatusOf(b).chunks_owned(), 4u);
  EXPECT_EQ(ShardStatusOf(a).chunks_owned(), on_a);  // Until a applies epoch 3.
  Beat(b);  // b loads epoch 3; then a is told.
  Beat(a);
  EXPECT_EQ(ShardStatusOf(a).chunks_owned(), 0u);
  EXPECT_EQ(coord_->TickReplication(now_), 0);
}

TEST_F(ReplicationTest, DrainingShardLostAfterItsTemporaryBackupsAreSeededFailsOver) {
  const uint64_t a = AddShard(), b = AddShard();
  const uint64_t job = CreateOk(OneTensorJob("llm", 4, 0));
  BeatAll({a, b});
  v1::DrainShardRequest drain;
  drain.set_shard_id(a);
  ASSERT_TRUE(coord_->DrainShard(drain).ok());
  ASSERT_EQ(coord_->TickReplication(now_), 1);
  Beat(b);  // The temporary backups are seeded.
  // a dies before the tick that would have promoted them.
  Kill({a}, {b});
  EXPECT_EQ(JobStatusOf(job).state(), v1::JOB_STATE_READY);
  EXPECT_EQ(Holders(Map(job)), (std::set<uint64_t>{b}));
  EXPECT_EQ(Map(job).epoch(), 3u);
}

TEST_F(ReplicationTest, DrainIsRefusedWhenTheChunksFitNowhereElseAndChangesNothing) {
  const uint64_t a = AddShard(v1::SHARD_KIND_DPU, 3 * kChunkBytes);
  const uint64_t b = AddShard(v1::SHARD_KIND_DPU, 3 * kChunkBytes);
  const uint64_t job = CreateOk(OneTensorJob("llm", 4, 0));  // 2 chunks each; room for 1 more each.
  BeatAll({a, b});
  v1::DrainShardRequest drain;
  drain.set_shard_id(a);
  auto resp = coord_->DrainShard(drain);
  EXPECT_EQ(resp.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string msg(resp.status().message());
  EXPECT_THAT(msg, HasSubstr("cannot drain shard 1"));
  EXPECT_THAT(msg, HasSubstr(absl::StrCat("(", kChunkBytes, " bytes)")));
  EXPECT_THAT(msg, HasSubstr(absl::StrCat(kChunkBytes, " bytes free over 1 live shards")));
  EXPECT_EQ(ShardStatusOf(a).state(), v1::SHARD_STATE_UP);
  EXPECT_EQ(coord_->TickReplication(now_), 0);
  EXPECT_EQ(Map(job).epoch(), 1u);

  // Unknown and DOWN shards.
  drain.set_shard_id(99);
  EXPECT_EQ(coord_->DrainShard(drain).status().code(), absl::StatusCode::kNotFound);
  const uint64_t c = AddShard();
  Kill({c}, {a, b});
  drain.set_shard_id(c);
  EXPECT_EQ(coord_->DrainShard(drain).status().code(), absl::StatusCode::kFailedPrecondition);
  // With a shard that has room, the drain is accepted.
  AddShard();
  drain.set_shard_id(a);
  EXPECT_TRUE(coord_->DrainShard(drain).ok());
}

TEST_F(ReplicationTest, DrainingShardsGetNoNewChunks) {
  const uint64_t a = AddShard(), b = AddShard();
  v1::DrainShardRequest drain;
  drain.set_shard_id(a);
  ASSERT_TRUE(coord_->DrainShard(drain).ok());
  coord_->TickReplication(now_);
  EXPECT_EQ(ShardStatusOf(a).state(), v1::SHARD_STATE_DRAINING);
  const uint64_t job = CreateOk(OneTensorJob("llm", 4, 0));
  EXPECT_EQ(Holders(Map(job)), (std::set<uint64_t>{b}));
  // Only one shard takes chunks: no room for replication.
  auto r = coord_->CreateJob(OneTensorJob("replicated", 4, 1));
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
  // A backup lost on b's partner is not re-placed on the draining shard.
  const uint64_t c = AddShard();
  const uint64_t rep = CreateOk(OneTensorJob("replicated", 4, 1));
  EXPECT_EQ(Holders(Map(rep)), (std::set<uint64_t>{b, c}));
  BeatAll({b, c});
  Kill({c}, {a, b});
  EXPECT_EQ(JobStatusOf(rep).state(), v1::JOB_STATE_READY);
  EXPECT_EQ(Holders(Map(rep)), (std::set<uint64_t>{b}));
  EXPECT_EQ(coord_->TickReplication(now_), 0);
  EXPECT_EQ(JobStatusOf(rep).chunks_with_backup(), 0u);
}

TEST_F(ReplicationTest, CheckpointsAreOrderedFromPrimariesOnly) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  options_.checkpoint_dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/repl_ckpt");
  Start();
  // The host shard holds only backups, and has no checkpoint dir: it is not
  // asked for a part and does not block a checkpoint.
  const uint64_t a = AddShard(v1::SHARD_KIND_DPU, 2 * kRepChunkBytes, /*checkpoints=*/true);
  const uint64_t b = AddShard(v1::SHARD_KIND_DPU, 2 * kRepChunkBytes, /*checkpoints=*/true);
  const uint64_t h = AddShard(v1::SHARD_KIND_HOST, uint64_t{1} << 30, /*checkpoints=*/false);
  const uint64_t job = CreateOk(OneTensorJob("llm", 4, 1));
  ASSERT_EQ(Count(Map(job), h, true), 4u);
  BeatAll({a, b, h});
  ASSERT_EQ(JobStatusOf(job).state(), v1::JOB_STATE_READY);
  v1::CreateCheckpointRequest req;
  req.set_job_name("llm");
  auto ck = coord_->CreateCheckpoint(req);
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ(Beat(a).checkpoints_size(), 1);
  EXPECT_EQ(Beat(b).checkpoints_size(), 1);
  EXPECT_EQ(Beat(h).checkpoints_size(), 0);
}

TEST_F(ReplicationTest, RestoredJobKeepsItsReplicationAndGetsBackups) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  options_.checkpoint_dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/repl_restore");
  Start();
  const uint64_t a = AddShard(v1::SHARD_KIND_DPU, uint64_t{1} << 30, true);
  const uint64_t b = AddShard(v1::SHARD_KIND_DPU, uint64_t{1} << 30, true);
  const uint64_t c = AddShard(v1::SHARD_KIND_DPU, uint64_t{1} << 30, true);
  const uint64_t job = CreateOk(OneTensorJob("llm", 6, 1));
  BeatAll({a, b, c});
  v1::CreateCheckpointRequest req;
  req.set_job_name("llm");
  auto ck = coord_->CreateCheckpoint(req);
  ASSERT_TRUE(ck.ok()) << ck.status();
  // Each primary writes its chunks (AdamW: master, m, v) and reports them.
  const v1::ShardMap map = Map(job);
  for (uint64_t shard : {a, b, c}) {
    v1::HeartbeatRequest hb;
    hb.set_shard_id(shard);
    v1::HeartbeatResponse orders = coord_->Heartbeat(hb);
    ASSERT_EQ(orders.checkpoints_size(), 1) << shard;
    v1::ShardCheckpointReport* r = hb.add_checkpoints();
    r->set_job_id(job);
    r->set_checkpoint_id(orders.checkpoints(0).checkpoint_id());
    r->set_done(true);
    const std::vector<float> zeros(64, 0.5f);
    const float* arrays[] = {zeros.data(), zeros.data(), zeros.data()};
    for (const auto& ch : map.chunks()) {
      if (ch.shard_id() != shard) continue;
      auto f = ckpt::WriteDataFile(
          absl::StrCat(options_.checkpoint_dir, "/", orders.checkpoints(0).path()),
          absl::StrCat("t", ch.tensor(), "-", ch.offset_elems()), ch.tensor(), ch.offset_elems(),
          ch.num_elems(), arrays);
      ASSERT_TRUE(f.ok()) << f.status();
      *r->add_files() = *f;
    }
    coord_->Heartbeat(hb);
  }
  v1::ListCheckpointsRequest list;
  list.set_job_name("llm");
  ASSERT_EQ(coord_->ListCheckpoints(list).checkpoints(0).state(),
            v1::CHECKPOINT_STATE_COMPLETE);

  v1::RestoreCheckpointRequest restore;
  restore.set_job_name("llm");
  restore.set_new_job_name("llm-again");
  auto restored = coord_->RestoreCheckpoint(restore);
  ASSERT_TRUE(restored.ok()) << restored.status();
  const v1::ShardMap again = Map(restored->job_id());
  ASSERT_EQ(again.chunks_size(), 6);
  for (const auto& ch : again.chunks()) {
    EXPECT_NE(ch.backup_shard_id(), 0u);
    EXPECT_NE(ch.backup_shard_id(), ch.shard_id());
  }
  EXPECT_EQ(JobStatusOf(restored->job_id()).replication(), 1u);
  EXPECT_EQ(JobStatusOf(restored->job_id()).chunks_with_backup(), 6u);
}

}  // namespace
}  // namespace optimus
