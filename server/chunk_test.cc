// Walks every transition of the chunk state machine, table-driven: each row
// builds a machine in one phase, sends it one event, and checks the phase it
// lands in and the actions it asks for. A last check proves that the rows
// cover every transition of the phase enum listed in kTransitions (and
// nothing outside it happens), then the replication protocol (seed, need
// seed, retry, fence) and a checkpoint order at every phase.
// (Over 600 lines: the transition table, its builders and its coverage
// check belong in one file; splitting them would hide which rows prove
// which transitions.)
#include "server/chunk.h"

#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace optimus {
namespace server {
namespace {

// What every push of these tests carries (the learning rate agreement has
// its own tests).
const StepParams kParams{1e-3f, 1.0f};

constexpr uint64_t kSelf = 1;   // This shard.
constexpr uint64_t kOther = 2;  // Another shard.
constexpr uint64_t kThird = 3;
constexpr uint32_t kWorld = 2;
constexpr uint64_t kCkpt = 42;  // A checkpoint id.
const ChunkName kName{7, 3, 1};

Requester Req(uint64_t id) { return Requester{0xbeef, id}; }

// ---- Builders: a machine in each phase -------------------------------------------

ChunkMachine NewPrimaryWith(uint64_t backup) {
  ChunkMachine m(kName, kWorld, Role::kPrimary);
  m.ApplyPlacement(kSelf, kSelf, backup, /*has_sum_buffer=*/backup != 0);
  return m;
}

ChunkMachine NewPrimary() { return NewPrimaryWith(0); }

ChunkMachine NewBackup() {
  ChunkMachine m(kName, kWorld, Role::kBackup);
  m.ApplyPlacement(kSelf, kOther, 0, /*has_sum_buffer=*/true);
  return m;
}

Actions FillSlots(ChunkMachine& m, uint64_t step) {
  Actions last;
  for (uint32_t r = 0; r < kWorld; ++r) {
    EXPECT_EQ(m.PushRequested(step, r, false, kParams, true, Requester{}).verdict, PushVerdict::kAccept);
    last = m.PushLanded(r, true);
  }
  return last;
}

ChunkMachine AtReceivingInit() {
  ChunkMachine m = NewPrimary();
  m.InitRequested();
  return m;
}

// Version 1, no backup.
ChunkMachine AtCollecting() {
  ChunkMachine m = AtReceivingInit();
  m.InitLanded(true);
  return m;
}

// Version 1 with a seeded backup on kOther (both loaded a checkpoint).
ChunkMachine AtCollectingReplicated() {
  ChunkMachine m = NewPrimaryWith(kOther);
  m.Restored(1, 0, 0.0f);
  return m;
}

ChunkMachine AtScheduled() {
  ChunkMachine m = AtCollecting();
  FillSlots(m, 1);
  return m;
}

ChunkMachine AtRunning() {
  ChunkMachine m = AtScheduled();
  m.BeginKernel();
  return m;
}

// Kernel running, the sum forwarded to the backup (generation backup_gen).
ChunkMachine AtRunningReplicated() {
  ChunkMachine m = AtCollectingReplicated();
  FillSlots(m, 1);
  m.BeginKernel();
  return m;
}

// Kernel done, the forwarded sum not acknowledged yet.
ChunkMachine AtAwaiting() {
  ChunkMachine m = AtRunningReplicated();
  m.KernelDone();
  return m;
}

// Version 2, a pull of version 1 still being sent out of the buffer that
// step 2 writes, all pushes of step 2 in.
ChunkMachine AtBlockedBySends() {
  ChunkMachine m = AtRunning();
  m.KernelDone();  // Version 2.
  EXPECT_EQ(m.PullRequested(1, Req(1)).verdict, PullVerdict::kServe);
  FillSlots(m, 2);
  return m;
}

// Version 1 being copied for a checkpoint, all pushes of step 1 in.
ChunkMachine AtBlockedBySnapshot() {
  ChunkMachine m = AtCollecting();
  EXPECT_EQ(m.CaptureOrdered(1, kCkpt).verdict, CaptureVerdict::kCopyNow);
  FillSlots(m, 1);
  return m;
}

ChunkMachine AtBackupReady() {
  ChunkMachine m = NewBackup();
  m.Restored(5, 0, 0.0f);
  return m;
}

ChunkMachine AtBackupSeedingFresh() {
  ChunkMachine m = NewBackup();
  m.SeedOffered(3);
  return m;
}

ChunkMachine AtBackupSeedingSeeded() {
  ChunkMachine m = AtBackupReady();
  m.SeedOffered(9);
  return m;
}

ChunkMachine AtBackupStepping() {
  ChunkMachine m = AtBackupReady();
  m.SumOffered(5, true, ForwardedStep{});
  return m;
}

// The clipping round: version 1 of a job that clips or skips non-finite
// steps, waiting for step 1's pushes.
ChunkMachine AtCollectingRound() {
  ChunkMachine m = NewPrimary();
  m.SetStepRules(/*commit_round=*/true, /*frozen=*/false);
  m.InitRequested();
  m.InitLanded(true);
  return m;
}

// All W pushes of step 1 in (ranks' requests 100 + rank); the partial is
// being computed.
ChunkMachine AtReducing() {
  ChunkMachine m = AtCollectingRound();
  for (uint32_t r = 0; r < kWorld; ++r) {
    EXPECT_EQ(m.PushRequested(1, r, false, kParams, true, Req(100 + r)).verdict,
              PushVerdict::kAccept);
    m.PushLanded(r, true);
  }
  return m;
}

// The partial (2.25) sent back with the pushes' answers; no commit yet.
ChunkMachine AtAwaitingCommit() {
  ChunkMachine m = AtReducing();
  m.ReduceDone(2.25);
  return m;
}

ChunkMachine AtRetired() {
  ChunkMachine m = AtCollecting();
  m.Retire(absl::CancelledError("gone"), {});
  return m;
}

// ---- The table -----------------------------------------------------------------------

struct Outcome {
  Actions actions;
  PushDecision push;
  PullDecision pull;
  StepPlan plan;
};

struct Row {
  std::string name;
  std::function<ChunkMachine()> build;
  std::function<Outcome(ChunkMachine&)> event;
  Phase want;
  std::function<void(const ChunkMachine&, const Outcome&)> check;
};

Outcome A(Actions a) {
  Outcome o;
  o.actions = std::move(a);
  return o;
}

const absl::Status kGone = absl::FailedPreconditionError("stale shard map: moved");

std::vector<Row> Rows() {
  ReplyHint refresh;
  refresh.refresh_map = true;
  return {
      // kEmpty.
      {"empty: init requested", NewPrimary,
       [](ChunkMachine& m) {
         Outcome o;
         o.push = m.InitRequested();
         return o;
       },
       Phase::kReceivingInit,
       [](const ChunkMachine&, const Outcome& o) {
         EXPECT_EQ(o.push.verdict, PushVerdict::kAccept);
       }},
      {"empty: restored as primary", NewPrimary,
       [](ChunkMachine& m) {
         m.Restored(50, 0, 0.0f);
         return Outcome{};
       },
       Phase::kCollecting,
       [](const ChunkMachine& m, const Outcome&) {
         EXPECT_EQ(m.version(), 50u);
         EXPECT_EQ(m.first_version(), 50u);
       }},
      {"empty: restored as backup", NewBackup,
       [](ChunkMachine& m) {
         m.Restored(50, 0, 0.0f);
         return Outcome{};
       },
       Phase::kBackupReady,
       [](const ChunkMachine& m, const Outcome&) { EXPECT_TRUE(m.seeded()); }},
      {"empty backup: seed offered", NewBackup,
       [](ChunkMachine& m) {
         Outcome o;
         o.push = m.SeedOffered(4);
         return o;
       },
       Phase::kBackupSeeding,
       [](const ChunkMachine&, const Outcome& o) {
         EXPECT_EQ(o.push.verdict, PushVerdict::kAccept);
       }},
      {"empty: retired", NewPrimary,
       [](ChunkMachine& m) { return A(m.Retire(kGone, {})); }, Phase::kRetired,
       [](const ChunkMachine&, const Outcome& o) { EXPECT_TRUE(o.actions.retired); }},
      // kReceivingInit.
      {"receiving init: landed", AtReceivingInit,
       [](ChunkMachine& m) { return A(m.InitLanded(true)); }, Phase::kCollecting,
       [](const ChunkMachine& m, const Outcome&) { EXPECT_EQ(m.version(), 1u); }},
      {"receiving init: failed", AtReceivingInit,
       [](ChunkMachine& m) { return A(m.InitLanded(false)); }, Phase::kEmpty,
       [](const ChunkMachine& m, const Outcome&) { EXPECT_EQ(m.version(), 0u); }},
      {"receiving init: retired", AtReceivingInit,
       [](ChunkMachine& m) { return A(m.Retire(kGone, {})); }, Phase::kRetired, nullptr},
      // kCollecting.
      {"collecting: last push lands", AtCollecting,
       [](ChunkMachine& m) { return A(FillSlots(m, 1)); }, Phase::kStepScheduled,
       [](const ChunkMachine&, const Outcome& o) { EXPECT_TRUE(o.actions.schedule_step); }},
      {"collecting: last push lands while the out buffer is being sent",
       [] {
         ChunkMachine m = AtRunning();
         m.KernelDone();  // Version 2.
         EXPECT_EQ(m.PullRequested(1, Req(1)).verdict, PullVerdict::kServe);
         return m;
       },
       [](ChunkMachine& m) { return A(FillSlots(m, 2)); }, Phase::kStepBlocked,
       [](const ChunkMachine&, const Outcome& o) { EXPECT_FALSE(o.actions.schedule_step); }},
      {"collecting: last push lands during a checkpoint copy",
       [] {
         ChunkMachine m = AtCollecting();
         m.CaptureOrdered(1, kCkpt);
         return m;
       },
       [](ChunkMachine& m) { return A(FillSlots(m, 1)); }, Phase::kStepBlocked,
       [](const ChunkMachine&, const Outcome& o) {
         EXPECT_FALSE(o.actions.schedule_step);
         EXPECT_TRUE(o.actions.step_waits_for_snapshot);
       }},
      {"collecting: retired sends parked pulls back",
       [] {
         ChunkMachine m = AtCollecting();
         EXPECT_EQ(m.PullRequested(2, Req(9)).verdict, PullVerdict::kParked);
         return m;
       },
       [refresh](ChunkMachine& m) { return A(m.Retire(kGone, refresh)); }, Phase::kRetired,
       [](const ChunkMachine&, const Outcome& o) {
         ASSERT_EQ(o.actions.refusals.size(), 1u);
         EXPECT_EQ(o.actions.refusals[0].to.request_id, 9u);
         EXPECT_TRUE(o.actions.refusals[0].hint.refresh_map);
       }},
      {"collecting: a map demotes the primary", AtCollecting,
       [](ChunkMachine& m) { return A(m.ApplyPlacement(kSelf, kOther, kSelf, true)); },
       Phase::kRetired,
       [](const ChunkMachine&, const Outcome& o) { EXPECT_TRUE(o.actions.retired); }},
      // kStepBlocked.
      {"blocked: the pull reply completes", AtBlockedBySends,
       [](ChunkMachine& m) { return A(m.SendDone(1)); }, Phase::kStepScheduled,
       [](const ChunkMachine&, const Outcome& o) { EXPECT_TRUE(o.actions.schedule_step); }},
      {"blocked: the checkpoint copy is done", AtBlockedBySnapshot,
       [](ChunkMachine& m) { return A(m.SnapshotDone()); }, Phase::kStepScheduled,
       [](const ChunkMachine&, const Outcome& o) {
         EXPECT_TRUE(o.actions.schedule_step);
         EXPECT_TRUE(o.actions.step_released_by_snapshot);
       }},
      {"blocked: retired", AtBlockedBySends,
       [](ChunkMachine& m) { return A(m.Retire(kGone, {})); }, Phase::kRetired, nullptr},
      // kStepScheduled.
      {"scheduled: kernel begins", AtScheduled,
       [](ChunkMachine& m) {
         Outcome o;
         o.plan = m.BeginKernel();
         return o;
       },
       Phase::kStepRunning,
       [](const ChunkMachine&, const Outcome& o) {
         EXPECT_TRUE(o.plan.run);
         EXPECT_EQ(o.plan.step, 1u);
         EXPECT_FALSE(o.plan.forward_sum);
       }},
      {"scheduled: a checkpoint copy began first",
       [] {
         ChunkMachine m = AtScheduled();
         EXPECT_EQ(m.CaptureOrdered(1, kCkpt).verdict, CaptureVerdict::kCopyNow);
         return m;
       },
       [](ChunkMachine& m) {
         Outcome o;
         o.plan = m.BeginKernel();
         return o;
       },
       Phase::kStepBlocked,
       [](const ChunkMachine&, const Outcome& o) {
         EXPECT_FALSE(o.plan.run);
         EXPECT_TRUE(o.plan.blocked_by_snapshot);
       }},
      {"scheduled: retired", AtScheduled,
       [](ChunkMachine& m) { return A(m.Retire(kGone, {})); }, Phase::kRetired, nullptr},
      // kStepRunning.
      {"running: kernel done, no backup: published", AtRunning,
       [](ChunkMachine& m) { return A(m.KernelDone()); }, Phase::kCollecting,
       [](const ChunkMachine& m, const Outcome& o) {
         EXPECT_EQ(o.actions.published, 2u);
         EXPECT_EQ(m.version(), 2u);
         EXPECT_EQ(m.full_slots(), 0u);
       }},
      {"running: kernel done, forward in flight", AtRunningReplicated,
       [](ChunkMachine& m) { return A(m.KernelDone()); }, Phase::kAwaitingBackup,
       [](const ChunkMachine& m, const Outcome& o) {
         EXPECT_EQ(o.actions.published, 0u);
         EXPECT_EQ(m.version(), 1u);
       }},
      {"running: retired", AtRunning,
       [](ChunkMachine& m) { return A(m.Retire(kGone, {})); }, Phase::kRetired, nullptr},
      // kAwaitingBackup.
      {"awaiting: backup acks: published", AtAwaiting,
       [](ChunkMachine& m) {
         return A(m.ForwardDone(m.backup_gen(), false, ForwardAnswer::kAcked));
       },
       Phase::kCollecting,
       [](const ChunkMachine& m, const Outcome& o) {
         EXPECT_EQ(o.actions.published, 2u);
         EXPECT_EQ(m.version(), 2u);
       }},
      {"awaiting: backup needs a seed: the state is sent", AtAwaiting,
       [](ChunkMachine& m) {
         return A(m.ForwardDone(m.backup_gen(), false, ForwardAnswer::kNeedSeed));
       },
       Phase::kAwaitingBackup,
       [](const ChunkMachine& m, const Outcome& o) {
         EXPECT_TRUE(o.actions.send_seed);
         EXPECT_EQ(o.actions.seed_version, 2u);  // The state after the kernel.
         EXPECT_EQ(o.actions.seed_gen, m.backup_gen());
         EXPECT_FALSE(m.backup_seeded());
       }},
      {"awaiting: backup fences us", AtAwaiting,
       [](ChunkMachine& m) {
         return A(m.ForwardDone(m.backup_gen(), false, ForwardAnswer::kFenced));
       },
       Phase::kRetired,
       [](const ChunkMachine& m, const Outcome& o) {
         EXPECT_TRUE(o.actions.retired);
         EXPECT_EQ(o.actions.published, 0u);
         EXPECT_EQ(m.version(), 1u);  // Never published what the backup refused.
       }},
      {"awaiting: a map removes the backup: published", AtAwaiting,
       [](ChunkMachine& m) { return A(m.ApplyPlacement(kSelf, kSelf, 0, true)); },
       Phase::kCollecting,
       [](const ChunkMachine&, const Outcome& o) { EXPECT_EQ(o.actions.published, 2u); }},
      // kBackupReady.
      {"backup ready: sum offered", AtBackupReady,
       [](ChunkMachine& m) {
         Outcome o;
         o.push = m.SumOffered(5, true, ForwardedStep{});
         return o;
       },
       Phase::kBackupStepping,
       [](const ChunkMachine&, const Outcome& o) {
         EXPECT_EQ(o.push.verdict, PushVerdict::kAccept);
       }},
      {"backup ready: seed offered", AtBackupReady,
       [](ChunkMachine& m) {
         Outcome o;
         o.push = m.SeedOffered(9);
         return o;
       },
       Phase::kBackupSeeding, nullptr},
      {"backup ready: promoted", AtBackupReady,
       [](ChunkMachine& m) { return A(m.ApplyPlacement(kSelf, kSelf, kThird, true)); },
       Phase::kCollecting,
       [](const ChunkMachine& m, const Outcome&) {
         EXPECT_EQ(m.role(), Role::kPrimary);
         EXPECT_EQ(m.version(), 5u);
         EXPECT_EQ(m.backup_shard(), kThird);
         EXPECT_FALSE(m.backup_seeded());  // The new backup gets a seed first.
       }},
      {"backup ready: retired", AtBackupReady,
       [](ChunkMachine& m) { return A(m.Retire(kGone, {})); }, Phase::kRetired, nullptr},
      // kBackupSeeding.
      {"seeding: landed", AtBackupSeedingFresh,
       [](ChunkMachine& m) { return A(m.SeedLanded(true, 3)); }, Phase::kBackupReady,
       [](const ChunkMachine& m, const Outcome&) {
         EXPECT_EQ(m.version(), 3u);
         EXPECT_TRUE(m.seeded());
       }},
      {"seeding: failed, never seeded before", AtBackupSeedingFresh,
       [](ChunkMachine& m) { return A(m.SeedLanded(false, 3)); }, Phase::kEmpty,
       [](const ChunkMachine& m, const Outcome&) { EXPECT_FALSE(m.seeded()); }},
      {"seeding: failed, keeps the state it had", AtBackupSeedingSeeded,
       [](ChunkMachine& m) { return A(m.SeedLanded(false, 9)); }, Phase::kBackupReady,
       [](const ChunkMachine& m, const Outcome&) { EXPECT_EQ(m.version(), 5u); }},
      {"seeding: promoted meanwhile, then landed",
       [] {
         ChunkMachine m = AtBackupSeedingFresh();
         m.ApplyPlacement(kSelf, kSelf, 0, true);
         EXPECT_EQ(m.PullRequested(3, Req(4)).verdict, PullVerdict::kParked);
         return m;
       },
       [](ChunkMachine& m) { return A(m.SeedLanded(true, 3)); }, Phase::kCollecting,
       [](const ChunkMachine&, const Outcome& o) {
         ASSERT_EQ(o.actions.sends.size(), 1u);  // The parked pull is answered.
         EXPECT_EQ(o.actions.sends[0].version, 3u);
       }},
      {"seeding: retired", AtBackupSeedingFresh,
       [](ChunkMachine& m) { return A(m.Retire(kGone, {})); }, Phase::kRetired, nullptr},
      // kBackupStepping.
      {"stepping: the sum landed: apply it", AtBackupStepping,
       [](ChunkMachine& m) { return A(m.SumLanded(true)); }, Phase::kBackupStepping,
       [](const ChunkMachine&, const Outcome& o) { EXPECT_TRUE(o.actions.apply_forwarded); }},
      {"stepping: the sum failed to land", AtBackupStepping,
       [](ChunkMachine& m) { return A(m.SumLanded(false)); }, Phase::kBackupReady,
       [](const ChunkMachine& m, const Outcome&) { EXPECT_EQ(m.version(), 5u); }},
      {"stepping: applied", AtBackupStepping,
       [](ChunkMachine& m) { return A(m.ForwardedStepDone(true)); }, Phase::kBackupReady,
       [](const ChunkMachine& m, const Outcome&) { EXPECT_EQ(m.version(), 6u); }},
      {"stepping: promoted meanwhile, then applied",
       [] {
         ChunkMachine m = AtBackupStepping();
         m.ApplyPlacement(kSelf, kSelf, 0, true);
         EXPECT_EQ(m.PullRequested(6, Req(8)).verdict, PullVerdict::kParked);
         return m;
       },
       [](ChunkMachine& m) { return A(m.ForwardedStepDone(true)); }, Phase::kCollecting,
       [](const ChunkMachine& m, const Outcome& o) {
         EXPECT_EQ(m.version(), 6u);
         ASSERT_EQ(o.actions.sends.size(), 1u);
         EXPECT_EQ(o.actions.sends[0].to.request_id, 8u);
       }},
      {"stepping: retired", AtBackupStepping,
       [](ChunkMachine& m) { return A(m.Retire(kGone, {})); }, Phase::kRetired, nullptr},

      // The clipping round.
      {"collecting (round): last push lands", AtCollectingRound,
       [](ChunkMachine& m) {
         for (uint32_t r = 0; r + 1 < kWorld; ++r) {
           m.PushRequested(1, r, false, kParams, true, Req(100 + r));
           m.PushLanded(r, true);
         }
         m.PushRequested(1, kWorld - 1, false, kParams, true, Req(100 + kWorld - 1));
         return A(m.PushLanded(kWorld - 1, true));
       },
       Phase::kReducing,
       [](const ChunkMachine&, const Outcome& o) {
         EXPECT_TRUE(o.actions.reduce);
         EXPECT_FALSE(o.actions.schedule_step);
         EXPECT_TRUE(o.actions.acks.empty());  // Answered with the partial.
       }},
      {"collecting (round): no rank has a gradient", AtCollectingRound,
       [](ChunkMachine& m) {
         Actions a;
         for (uint32_t r = 0; r < kWorld; ++r) {
           m.PushRequested(1, r, false, kParams, /*has_grad=*/false, Req(100 + r));
           Actions x = m.PushLanded(r, true);
           a.acks.insert(a.acks.end(), x.acks.begin(), x.acks.end());
           a.schedule_step = a.schedule_step || x.schedule_step;
         }
         return A(a);
       },
       Phase::kStepScheduled,
       [](const ChunkMachine&, const Outcome& o) {
         // Nothing to clip: partial 0 and no commit needed.
         EXPECT_TRUE(o.actions.schedule_step);
         ASSERT_EQ(o.actions.acks.size(), kWorld);
         EXPECT_TRUE(o.actions.acks[0].has_partial);
         EXPECT_EQ(o.actions.acks[0].partial, 0.0);
       }},
      {"reducing: partial computed", AtReducing,
       [](ChunkMachine& m) { return A(m.ReduceDone(2.25)); }, Phase::kAwaitingCommit,
       [](const ChunkMachine&, const Outcome& o) {
         ASSERT_EQ(o.actions.acks.size(), kWorld);
         for (uint32_t r = 0; r < kWorld; ++r) {
           EXPECT_EQ(o.actions.acks[r].to.request_id, 100 + r);
           EXPECT_TRUE(o.actions.acks[r].has_partial);
           EXPECT_EQ(o.actions.acks[r].partial, 2.25);
         }
       }},
      {"reducing: a commit came first", AtReducing,
       [](ChunkMachine& m) {
         m.CommitRequested(1, 0.5f, false, Req(9));
         return A(m.ReduceDone(2.25));
       },
       Phase::kStepScheduled,
       [](const ChunkMachine&, const Outcome& o) { EXPECT_TRUE(o.actions.schedule_step); }},
      {"reducing: commit in, a checkpoint copy under way", AtReducing,
       [](ChunkMachine& m) {
         EXPECT_EQ(m.CaptureOrdered(1, kCkpt).verdict, CaptureVerdict::kCopyNow);
         m.CommitRequested(1, 0.5f, false, Req(9));
         return A(m.ReduceDone(2.25));
       },
       Phase::kStepBlocked,
       [](const ChunkMachine&, const Outcome& o) {
         EXPECT_TRUE(o.actions.step_waits_for_snapshot);
       }},
      {"reducing: retired", AtReducing,
       [](ChunkMachine& m) { return A(m.Retire(kGone, {})); }, Phase::kRetired,
       [](const ChunkMachine&, const Outcome& o) {
         EXPECT_EQ(o.actions.refusals.size(), kWorld);  // The held pushes.
       }},
      {"awaiting commit: commit", AtAwaitingCommit,
       [](ChunkMachine& m) { return A(m.CommitRequested(1, 0.5f, false, Req(9))); },
       Phase::kStepScheduled,
       [](const ChunkMachine&, const Outcome& o) {
         EXPECT_TRUE(o.actions.schedule_step);
         ASSERT_EQ(o.actions.acks.size(), 1u);
         EXPECT_EQ(o.actions.acks[0].to.request_id, 9u);
       }},
      {"awaiting commit: commit while a checkpoint copy runs", AtAwaitingCommit,
       [](ChunkMachine& m) {
         EXPECT_EQ(m.CaptureOrdered(1, kCkpt).verdict, CaptureVerdict::kCopyNow);
         return A(m.CommitRequested(1, 1.0f, false, Req(9)));
       },
       Phase::kStepBlocked,
       [](const ChunkMachine&, const Outcome& o) {
         EXPECT_TRUE(o.actions.step_waits_for_snapshot);
       }},
      {"awaiting commit: retired", AtAwaitingCommit,
       [](ChunkMachine& m) { return A(m.Retire(kGone, {})); }, Phase::kRetired, nullptr},
  };
}

// Every transition the machine makes, and no other.
const std::set<std::pair<Phase, Phase>>& kTransitions() {
  static const auto* t = new std::set<std::pair<Phase, Phase>>{
      {Phase::kEmpty, Phase::kReceivingInit},
      {Phase::kEmpty, Phase::kCollecting},
      {Phase::kEmpty, Phase::kBackupReady},
      {Phase::kEmpty, Phase::kBackupSeeding},
      {Phase::kEmpty, Phase::kRetired},
      {Phase::kReceivingInit, Phase::kCollecting},
      {Phase::kReceivingInit, Phase::kEmpty},
      {Phase::kReceivingInit, Phase::kRetired},
      {Phase::kCollecting, Phase::kStepScheduled},
      {Phase::kCollecting, Phase::kStepBlocked},
      {Phase::kCollecting, Phase::kRetired},
      {Phase::kStepBlocked, Phase::kStepScheduled},
      {Phase::kStepBlocked, Phase::kRetired},
      {Phase::kStepScheduled, Phase::kStepRunning},
      {Phase::kStepScheduled, Phase::kStepBlocked},
      {Phase::kStepScheduled, Phase::kRetired},
      {Phase::kStepRunning, Phase::kCollecting},
      {Phase::kStepRunning, Phase::kAwaitingBackup},
      {Phase::kStepRunning, Phase::kRetired},
      {Phase::kAwaitingBackup, Phase::kCollecting},
      {Phase::kAwaitingBackup, Phase::kAwaitingBackup},
      {Phase::kAwaitingBackup, Phase::kRetired},
      {Phase::kBackupReady, Phase::kBackupStepping},
      {Phase::kBackupReady, Phase::kBackupSeeding},
      {Phase::kBackupReady, Phase::kCollecting},
      {Phase::kBackupReady, Phase::kRetired},
      {Phase::kBackupSeeding, Phase::kBackupReady},
      {Phase::kBackupSeeding, Phase::kEmpty},
      {Phase::kBackupSeeding, Phase::kCollecting},
      {Phase::kBackupSeeding, Phase::kRetired},
      {Phase::kBackupStepping, Phase::kBackupStepping},
      {Phase::kBackupStepping, Phase::kBackupReady},
      {Phase::kBackupStepping, Phase::kCollecting},
      {Phase::kBackupStepping, Phase::kRetired},
      {Phase::kCollecting, Phase::kReducing},
      {Phase::kReducing, Phase::kAwaitingCommit},
      {Phase::kReducing, Phase::kStepScheduled},
      {Phase::kReducing, Phase::kStepBlocked},
      {Phase::kReducing, Phase::kRetired},
      {Phase::kAwaitingCommit, Phase::kStepScheduled},
      {Phase::kAwaitingCommit, Phase::kStepBlocked},
      {Phase::kAwaitingCommit, Phase::kRetired},
  };
  return *t;
}

TEST(ChunkMachineTest, EveryTransitionOfThePhaseEnum) {
  std::set<std::pair<Phase, Phase>> seen;
  std::set<Phase> from_phases;
  for (const Row& row : Rows()) {
    SCOPED_TRACE(row.name);
    ChunkMachine m = row.build();
    const Phase from = m.phase();
    Outcome o = row.event(m);
    EXPECT_EQ(m.phase(), row.want) << PhaseName(m.phase()) << " instead of "
                                   << PhaseName(row.want) << ": " << m.DebugString();
    if (row.check) row.check(m, o);
    seen.insert({from, m.phase()});
    from_phases.insert(from);
    EXPECT_EQ(kTransitions().count({from, m.phase()}), 1u)
        << "unlisted transition " << PhaseName(from) << " -> " << PhaseName(m.phase());
  }
  for (const auto& [from, to] : kTransitions()) {
    EXPECT_EQ(seen.count({from, to}), 1u)
        << "no row walks " << PhaseName(from) << " -> " << PhaseName(to);
  }
  // Every phase but the terminal one is left by some row.
  EXPECT_EQ(from_phases.size(), static_cast<size_t>(kNumPhases - 1));
}

// A retired chunk ignores everything: late completions of work it started
// (a kernel, a send, a forward's answer) change nothing and ask for nothing.
TEST(ChunkMachineTest, RetiredIgnoresEveryEvent) {
  ChunkMachine m = AtRunningReplicated();
  const uint64_t gen = m.backup_gen();
  ASSERT_TRUE(m.Retire(kGone, {}).retired);
  EXPECT_TRUE(m.KernelDone().empty());
  EXPECT_TRUE(m.ForwardDone(gen, false, ForwardAnswer::kAcked).empty());
  EXPECT_TRUE(m.ForwardDone(gen + 1, false, ForwardAnswer::kAcked).empty());
  EXPECT_TRUE(m.RetryTimer(gen + 1).empty());
  EXPECT_TRUE(m.PushLanded(0, true).empty());
  EXPECT_TRUE(m.Retire(kGone, {}).empty());
  EXPECT_EQ(m.PushRequested(1, 0, false, kParams, true, Requester{}).verdict, PushVerdict::kRefuse);
  EXPECT_EQ(m.PullRequested(1, Req(1)).verdict, PullVerdict::kRefuse);
  EXPECT_EQ(m.InitRequested().verdict, PushVerdict::kRefuse);
  EXPECT_EQ(m.CaptureOrdered(5, kCkpt).verdict, CaptureVerdict::kRefuse);
  EXPECT_EQ(m.phase(), Phase::kRetired);
}

// ---- Requests ----------------------------------------------------------------------------

TEST(ChunkMachineTest, PushesAreCheckedAgainstTheStepAndDeduplicated) {
  ChunkMachine m = NewPrimary();
  EXPECT_EQ(m.PushRequested(1, 0, false, kParams, true, Requester{}).error.code(), absl::StatusCode::kFailedPrecondition)
      << "no initial values yet";
  m = AtCollecting();
  EXPECT_EQ(m.PushRequested(2, 0, false, kParams, true, Requester{}).error.code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(m.PushRequested(1, kWorld, false, kParams, true, Requester{}).error.code(), absl::StatusCode::kInvalidArgument);
  ASSERT_EQ(m.PushRequested(1, 0, false, kParams, true, Requester{}).verdict, PushVerdict::kAccept);
  // The same rank again while its payload lands, and after.
  EXPECT_EQ(m.PushRequested(1, 0, false, kParams, true, Requester{}).verdict, PushVerdict::kDuplicate);
  m.PushLanded(0, true);
  EXPECT_EQ(m.PushRequested(1, 0, false, kParams, true, Requester{}).verdict, PushVerdict::kDuplicate);
  EXPECT_EQ(m.full_slots(), 1u);
  // A failed receive frees the slot for a resend.
  ASSERT_EQ(m.PushRequested(1, 1, false, kParams, true, Requester{}).verdict, PushVerdict::kAccept);
  EXPECT_TRUE(m.PushLanded(1, false).empty());
  ASSERT_EQ(m.PushRequested(1, 1, false, kParams, true, Requester{}).verdict, PushVerdict::kAccept);
  EXPECT_TRUE(m.PushLanded(1, true).schedule_step);
  // During the step a push for it is a duplicate; after, it is stale unless resent.
  EXPECT_EQ(m.PushRequested(1, 1, false, kParams, true, Requester{}).verdict, PushVerdict::kDuplicate);
  m.BeginKernel();
  m.KernelDone();
  PushDecision stale = m.PushRequested(1, 0, false, kParams, true, Requester{});
  EXPECT_EQ(stale.error.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(stale.error.message()).find("stale push"), std::string::npos);
  EXPECT_EQ(m.PushRequested(1, 0, /*resend=*/true, kParams, true, Requester{}).verdict, PushVerdict::kDuplicate);
}

TEST(ChunkMachineTest, WorkerRequestsToABackupAskForTheMap) {
  ChunkMachine m = AtBackupReady();
  EXPECT_TRUE(m.PushRequested(5, 0, false, kParams, true, Requester{}).hint.refresh_map);
  EXPECT_TRUE(m.PullRequested(5, Req(1)).hint.refresh_map);
  EXPECT_TRUE(m.InitRequested().hint.refresh_map);
}

TEST(ChunkMachineTest, PullsServeParkOrRefuseByVersion) {
  ChunkMachine m = AtCollecting();
  EXPECT_EQ(m.PullRequested(0, Req(1)).error.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(m.PullRequested(1, Req(1)).verdict, PullVerdict::kServe);
  EXPECT_EQ(m.sends_in_flight(1), 1);
  EXPECT_EQ(m.PullRequested(2, Req(2)).verdict, PullVerdict::kParked);
  EXPECT_EQ(m.PullRequested(3, Req(3)).error.code(), absl::StatusCode::kOutOfRange);
  m.SendDone(1);
  FillSlots(m, 1);
  m.BeginKernel();
  Actions published = m.KernelDone();
  ASSERT_EQ(published.sends.size(), 1u);  // The parked pull of version 2.
  EXPECT_EQ(published.sends[0].to.request_id, 2u);
  EXPECT_EQ(m.sends_in_flight(0), 1);  // Counted before the caller sends.
  // Version 1 is still readable until step 2 starts, then it is gone.
  EXPECT_EQ(m.PullRequested(1, Req(4)).verdict, PullVerdict::kServe);
  m.SendDone(1);
  FillSlots(m, 2);
  EXPECT_EQ(m.PullRequested(1, Req(5)).error.code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ChunkMachineTest, InitOnlyOnce) {
  ChunkMachine m = AtCollecting();
  EXPECT_EQ(m.InitRequested().error.code(), absl::StatusCode::kAlreadyExists);
  ChunkMachine r = AtReceivingInit();
  EXPECT_EQ(r.InitRequested().error.code(), absl::StatusCode::kAlreadyExists);
}

// ---- Replication -------------------------------------------------------------------------

TEST(ChunkMachineTest, NewBackupIsSeededBeforeTheStepIsPublished) {
  ChunkMachine m = AtCollecting();
  // A map gives the chunk its first backup.
  EXPECT_TRUE(m.ApplyPlacement(kSelf, kSelf, kOther, true).empty());
  const uint64_t gen = m.backup_gen();
  FillSlots(m, 1);
  StepPlan plan = m.BeginKernel();
  EXPECT_FALSE(plan.forward_sum) << "an unseeded backup cannot take a sum";
  Actions a = m.KernelDone();
  EXPECT_TRUE(a.send_seed);
  EXPECT_EQ(a.seed_version, 2u);
  EXPECT_EQ(a.published, 0u);
  EXPECT_EQ(m.forward(), Forward::kInFlight);
  a = m.ForwardDone(gen, /*seed=*/true, ForwardAnswer::kAcked);
  EXPECT_EQ(a.published, 2u);
  EXPECT_TRUE(m.backup_seeded());
  // The next step forwards the sum.
  FillSlots(m, 2);
  plan = m.BeginKernel();
  EXPECT_TRUE(plan.forward_sum);
  EXPECT_EQ(plan.gen, gen);
}

TEST(ChunkMachineTest, RetryAnswerWaitsThenSeeds) {
  ChunkMachine m = AtAwaiting();
  const uint64_t gen = m.backup_gen();
  Actions a = m.ForwardDone(gen, false, ForwardAnswer::kRetry);
  EXPECT_TRUE(a.retry_later);
  EXPECT_TRUE(a.beat_now);
  EXPECT_EQ(a.retry_gen, gen);
  EXPECT_EQ(m.forward(), Forward::kRetryLater);
  EXPECT_TRUE(m.RetryTimer(gen + 1).empty()) << "a timer of an older backup does nothing";
  a = m.RetryTimer(gen);
  EXPECT_TRUE(a.send_seed) << "the sum may be too late by now: the state goes";
  EXPECT_EQ(a.published, 0u);
}

TEST(ChunkMachineTest, FailedBackupHoldsPublicationUntilAMapReplacesIt) {
  ChunkMachine m = AtAwaiting();
  const uint64_t gen = m.backup_gen();
  EXPECT_TRUE(m.ForwardDone(gen, false, ForwardAnswer::kFailed).empty());
  EXPECT_EQ(m.forward(), Forward::kWaitMap);
  EXPECT_EQ(m.phase(), Phase::kAwaitingBackup);
  EXPECT_EQ(m.version(), 1u) << "never run ahead of the only other copy";
  // The coordinator names a new backup: it is seeded, then the step publishes.
  Actions a = m.ApplyPlacement(kSelf, kSelf, kThird, true);
  EXPECT_TRUE(a.send_seed);
  EXPECT_EQ(a.seed_gen, gen + 1);
  EXPECT_TRUE(m.ForwardDone(gen, false, ForwardAnswer::kAcked).empty()) << "stale generation";
  a = m.ForwardDone(gen + 1, true, ForwardAnswer::kAcked);
  EXPECT_EQ(a.published, 2u);
}

TEST(ChunkMachineTest, BackupRefusesSumsItCannotApply) {
  ChunkMachine fresh = NewBackup();
  PushDecision d = fresh.SumOffered(1, true, ForwardedStep{});
  EXPECT_TRUE(d.hint.need_seed) << "not seeded";
  ChunkMachine m = AtBackupReady();  // Version 5.
  d = m.SumOffered(4, true, ForwardedStep{});
  EXPECT_TRUE(d.hint.need_seed) << "wrong version";
  d = m.SumOffered(5, false, ForwardedStep{});
  EXPECT_EQ(d.error.code(), absl::StatusCode::kInternal) << "no sum buffer";
  ASSERT_EQ(m.SumOffered(5, true, ForwardedStep{}).verdict, PushVerdict::kAccept);
  d = m.SumOffered(5, true, ForwardedStep{});
  EXPECT_TRUE(d.hint.retry) << "busy with a step";
  EXPECT_TRUE(m.SeedOffered(6).hint.retry) << "no seed over a running step";
  ChunkMachine primary = AtCollecting();
  EXPECT_EQ(primary.SumOffered(1, true, ForwardedStep{}).verdict, PushVerdict::kRefuse);
  EXPECT_EQ(primary.SeedOffered(1).verdict, PushVerdict::kRefuse);
}

TEST(ChunkMachineTest, ReplicatedStepsKeepBothCopiesInStep) {
  // A primary and its backup, driven as the shards drive them.
  ChunkMachine p = AtCollectingReplicated();  // Version 1, backup seeded.
  ChunkMachine b = NewBackup();
  b.Restored(1, 0, 0.0f);
  for (uint64_t step = 1; step <= 3; ++step) {
    FillSlots(p, step);
    StepPlan plan = p.BeginKernel();
    ASSERT_TRUE(plan.forward_sum);
    ASSERT_EQ(b.SumOffered(plan.step, true, ForwardedStep{}).verdict, PushVerdict::kAccept);
    EXPECT_TRUE(b.SumLanded(true).apply_forwarded);
    EXPECT_EQ(b.ForwardedStepDone(true).published, step + 1);
    EXPECT_EQ(p.KernelDone().published, 0u) << "not before the backup has it";
    EXPECT_EQ(p.ForwardDone(plan.gen, false, ForwardAnswer::kAcked).published, step + 1);
    EXPECT_EQ(p.version(), b.version());
  }
}

// ---- Checkpoints -------------------------------------------------------------------------

TEST(ChunkMachineTest, CaptureOrderAtEveryPhase) {
  struct Case {
    const char* name;
    std::function<ChunkMachine()> build;
    uint64_t step;  // Relative: 0 = the chunk's version, 1 = the next.
    CaptureVerdict want;
  };
  const std::vector<Case> cases = {
      {"empty", NewPrimary, 0, CaptureVerdict::kRefuse},
      {"receiving init", AtReceivingInit, 0, CaptureVerdict::kRefuse},
      {"collecting, at the step", AtCollecting, 0, CaptureVerdict::kCopyNow},
      {"collecting, a later step", AtCollecting, 1, CaptureVerdict::kLater},
      {"blocked by sends, at the step", AtBlockedBySends, 0, CaptureVerdict::kCopyNow},
      {"blocked by a copy, at the step", AtBlockedBySnapshot, 0, CaptureVerdict::kMissed},
      {"scheduled, at the step", AtScheduled, 0, CaptureVerdict::kCopyNow},
      {"running, at the step", AtRunning, 0, CaptureVerdict::kMissed},
      {"running, the next step", AtRunning, 1, CaptureVerdict::kLater},
      {"awaiting the backup, at the step", AtAwaiting, 0, CaptureVerdict::kMissed},
      {"awaiting the backup, the next step", AtAwaiting, 1, CaptureVerdict::kLater},
      {"backup ready", AtBackupReady, 0, CaptureVerdict::kRefuse},
      {"backup seeding", AtBackupSeedingFresh, 0, CaptureVerdict::kRefuse},
      {"backup stepping", AtBackupStepping, 0, CaptureVerdict::kRefuse},
      {"retired", AtRetired, 0, CaptureVerdict::kRefuse},
      {"reducing, at the step", AtReducing, 0, CaptureVerdict::kCopyNow},
      {"awaiting a commit, at the step", AtAwaitingCommit, 0, CaptureVerdict::kCopyNow},
  };
  std::set<Phase> covered;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    ChunkMachine m = c.build();
    covered.insert(m.phase());
    const uint64_t step = m.version() + c.step;
    EXPECT_EQ(m.CaptureOrdered(step, kCkpt).verdict, c.want) << m.DebugString();
    if (c.want == CaptureVerdict::kCopyNow) {
      EXPECT_TRUE(m.snapshot_copying());
      // The copy holds the next kernel back until it is done.
      if (m.phase() == Phase::kStepScheduled) {
        EXPECT_FALSE(m.BeginKernel().run);
        EXPECT_TRUE(m.SnapshotDone().schedule_step);
      }
    }
    // A past step is missed everywhere it has values.
    if (m.version() > 1 && m.role() == Role::kPrimary && !m.retired()) {
      EXPECT_EQ(m.CaptureOrdered(m.version() - 1, kCkpt + 1).verdict, CaptureVerdict::kMissed);
    }
  }
  EXPECT_EQ(covered.size(), static_cast<size_t>(kNumPhases));
}

TEST(ChunkMachineTest, LaterCaptureIsTakenWhenTheStepPublishes) {
  ChunkMachine m = AtCollecting();
  ASSERT_EQ(m.CaptureOrdered(3, kCkpt).verdict, CaptureVerdict::kLater);
  for (uint64_t step = 1; step <= 2; ++step) {
    EXPECT_EQ(m.PullRequested(step + 1, Req(step)).verdict, PullVerdict::kParked);
    FillSlots(m, step);
    m.BeginKernel();
    Actions a = m.KernelDone();
    if (step == 1) {
      EXPECT_EQ(a.snapshot_checkpoint, 0u);
      m.SendDone(2);
      continue;
    }
    // Version 3: copied after the pulls are answered (sends come first in
    // the actions), and the next step waits for the copy.
    EXPECT_EQ(a.snapshot_checkpoint, kCkpt);
    EXPECT_EQ(a.sends.size(), 1u);
    EXPECT_TRUE(m.snapshot_copying());
    m.SendDone(3);
    Actions full = FillSlots(m, 3);
    EXPECT_FALSE(full.schedule_step);
    EXPECT_TRUE(full.step_waits_for_snapshot);
    EXPECT_TRUE(m.SnapshotDone().schedule_step);
  }
}

TEST(ChunkMachineTest, CancelledCaptureIsForgotten) {
  ChunkMachine m = AtCollecting();
  ASSERT_EQ(m.CaptureOrdered(2, kCkpt).verdict, CaptureVerdict::kLater);
  m.CaptureCancelled(kCkpt + 1);
  EXPECT_EQ(m.capture_step(), 2u) << "another checkpoint's cancel";
  m.CaptureCancelled(kCkpt);
  FillSlots(m, 1);
  m.BeginKernel();
  EXPECT_EQ(m.KernelDone().snapshot_checkpoint, 0u);
}

}  // namespace
}  // namespace server
}  // namespace optimus

namespace optimus {
namespace server {
namespace {

// ---- The clipping round and the training rules, event by event ------------------

TEST(ChunkRoundTest, PushesOfOneStepMustAgreeOnLrAndMultiplier) {
  ChunkMachine m = AtCollectingRound();
  ASSERT_EQ(m.PushRequested(1, 0, false, kParams, true, Req(1)).verdict, PushVerdict::kAccept);
  m.PushLanded(0, true);
  const StepParams other_lr{2e-3f, 1.0f};
  const StepParams other_scale{1e-3f, 0.5f};
  for (const StepParams& p : {other_lr, other_scale}) {
    PushDecision d = m.PushRequested(1, 1, false, p, true, Req(2));
    EXPECT_EQ(d.verdict, PushVerdict::kRefuse);
    EXPECT_EQ(d.error.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(d.error.message().find("same learning rate"), absl::string_view::npos) << d.error;
  }
  // Nothing changed: the agreeing push still completes the step.
  EXPECT_EQ(m.full_slots(), 1u);
  ASSERT_EQ(m.PushRequested(1, 1, false, kParams, true, Req(3)).verdict, PushVerdict::kAccept);
  EXPECT_TRUE(m.PushLanded(1, true).reduce);
}

TEST(ChunkRoundTest, CommitsMustAgreeAndStepOnlyOnce) {
  ChunkMachine m = AtAwaitingCommit();
  Actions a = m.CommitRequested(1, 0.5f, false, Req(1));
  EXPECT_TRUE(a.schedule_step);
  // Another rank's identical commit: OK, nothing more to do.
  a = m.CommitRequested(1, 0.5f, false, Req(2));
  EXPECT_FALSE(a.schedule_step);
  ASSERT_EQ(a.acks.size(), 1u);
  // A disagreeing one is refused.
  a = m.CommitRequested(1, 0.25f, false, Req(3));
  ASSERT_EQ(a.refusals.size(), 1u);
  EXPECT_EQ(a.refusals[0].status.code(), absl::StatusCode::kInvalidArgument);
  // Out-of-range coefficients and future steps are refused.
  EXPECT_EQ(m.CommitRequested(1, 1.5f, false, Req(4)).refusals.size(), 1u);
  EXPECT_EQ(m.CommitRequested(1, 0.0f, false, Req(5)).refusals.size(), 1u);
  EXPECT_EQ(m.CommitRequested(3, 0.5f, false, Req(6)).refusals[0].status.code(),
            absl::StatusCode::kOutOfRange);
  StepPlan plan = m.BeginKernel();
  ASSERT_TRUE(plan.run);
  EXPECT_EQ(plan.clip_coef, 0.5f);
  EXPECT_FALSE(plan.skip);
  EXPECT_EQ(plan.optimizer_step, 1u);
  m.KernelDone();
  EXPECT_EQ(m.version(), 2u);
  EXPECT_EQ(m.optimizer_steps(), 1u);
  EXPECT_EQ(m.last_lr(), kParams.lr);
  // A commit for the step just applied, sent again: OK if it agrees.
  EXPECT_EQ(m.CommitRequested(1, 0.5f, false, Req(7)).acks.size(), 1u);
  EXPECT_EQ(m.CommitRequested(1, 0.75f, false, Req(8)).refusals.size(), 1u);
}

TEST(ChunkRoundTest, SkippedStepAdvancesTheVersionButNotTheOptimizerStep) {
  ChunkMachine m = AtAwaitingCommit();
  m.CommitRequested(1, 1.0f, /*skip=*/true, Req(1));
  StepPlan plan = m.BeginKernel();
  ASSERT_TRUE(plan.run);
  EXPECT_TRUE(plan.skip);
  m.KernelDone();
  EXPECT_EQ(m.version(), 2u);
  EXPECT_EQ(m.optimizer_steps(), 0u);
  // The next real step is the optimizer's first.
  for (uint32_t r = 0; r < kWorld; ++r) {
    m.PushRequested(2, r, false, kParams, true, Req(10 + r));
    m.PushLanded(r, true);
  }
  m.ReduceDone(1.0);
  m.CommitRequested(2, 1.0f, false, Req(20));
  EXPECT_EQ(m.BeginKernel().optimizer_step, 1u);
}

TEST(ChunkRoundTest, DuplicatePushIsAnsweredWithThePartial) {
  ChunkMachine m = AtReducing();
  // While reducing: held, answered with the others.
  EXPECT_EQ(m.PushRequested(1, 0, false, kParams, true, Req(50)).verdict, PushVerdict::kHeld);
  Actions a = m.ReduceDone(4.0);
  EXPECT_EQ(a.acks.size(), kWorld + 1);  // Every push, and the copy.
  // After: answered at once.
  PushDecision d = m.PushRequested(1, 1, false, kParams, true, Req(51));
  EXPECT_EQ(d.verdict, PushVerdict::kDuplicate);
  EXPECT_TRUE(d.ack.has_partial);
  EXPECT_EQ(d.ack.partial, 4.0);
}

TEST(ChunkRoundTest, FrozenTensorRefusesGradientsAndNeverSteps) {
  ChunkMachine m = NewPrimary();
  m.SetStepRules(/*commit_round=*/true, /*frozen=*/true);
  m.InitRequested();
  m.InitLanded(true);
  PushDecision d = m.PushRequested(1, 0, false, kParams, /*has_grad=*/true, Req(1));
  EXPECT_EQ(d.verdict, PushVerdict::kRefuse);
  EXPECT_EQ(d.error.code(), absl::StatusCode::kInvalidArgument);
  Actions last;
  for (uint32_t r = 0; r < kWorld; ++r) {
    ASSERT_EQ(m.PushRequested(1, r, false, kParams, false, Req(2 + r)).verdict,
              PushVerdict::kAccept);
    last = m.PushLanded(r, true);
  }
  EXPECT_TRUE(last.schedule_step);  // No reduce, no commit.
  StepPlan plan = m.BeginKernel();
  EXPECT_TRUE(plan.skip);
  m.KernelDone();
  EXPECT_EQ(m.version(), 2u);
  EXPECT_EQ(m.optimizer_steps(), 0u);
}

TEST(ChunkRoundTest, StepCountsTravelWithSeedsAndRestores) {
  ChunkMachine backup = NewBackup();
  ASSERT_EQ(backup.SeedOffered(7).verdict, PushVerdict::kAccept);
  backup.SeedLanded(true, 7, /*optimizer_steps=*/4, /*last_lr=*/0.25f);
  EXPECT_EQ(backup.optimizer_steps(), 4u);
  EXPECT_EQ(backup.last_lr(), 0.25f);
  // A forwarded skip keeps the count; a forwarded step adds one.
  ForwardedStep skip;
  skip.skip = true;
  skip.lr = 0.5f;
  ASSERT_EQ(backup.SumOffered(7, true, skip).verdict, PushVerdict::kAccept);
  backup.SumLanded(true);
  backup.ForwardedStepDone(true);
  EXPECT_EQ(backup.optimizer_steps(), 4u);
  EXPECT_EQ(backup.last_lr(), 0.5f);
  ASSERT_EQ(backup.SumOffered(8, true, ForwardedStep{false, 0.75f, 1.0}).verdict,
            PushVerdict::kAccept);
  backup.SumLanded(true);
  backup.ForwardedStepDone(true);
  EXPECT_EQ(backup.optimizer_steps(), 5u);
  ChunkMachine restored = NewPrimary();
  restored.Restored(30, 12, 0.125f);
  EXPECT_EQ(restored.optimizer_steps(), 12u);
  EXPECT_EQ(restored.last_lr(), 0.125f);
}

}  // namespace
}  // namespace server
}  // namespace optimus
