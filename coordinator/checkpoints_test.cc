// CheckpointManager on its own: orders, reports, manifest, retries,
// failures and pruning, with a real folder and no servers. File work
// (folders, manifests, removals) runs on the manager's file thread: the
// tests wait for it with WaitForFileWork where they look at its outcome.
#include "coordinator/checkpoints.h"

#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/checkpoint_files.h"
#include "gtest/gtest.h"

namespace optimus {
namespace {

std::string TempDir() {
  std::string tmpl = absl::StrCat(std::getenv("TEST_TMPDIR"), "/mgrXXXXXX");
  EXPECT_NE(mkdtemp(tmpl.data()), nullptr);
  return tmpl;
}

CheckpointJobView View(uint64_t max_applied) {
  CheckpointJobView v;
  v.job_id = 7;
  v.spec.set_name("j");
  v.spec.add_tensors()->set_name("w");
  v.spec.mutable_tensors(0)->add_shape(4);
  v.spec.mutable_optimizer()->set_kind(v1::OPTIMIZER_SGD);
  v.state = v1::JOB_STATE_READY;
  v.owners = {1, 2};
  v.min_applied_step = max_applied;
  v.max_applied_step = max_applied;
  return v;
}

google::protobuf::RepeatedPtrField<v1::ShardCheckpointReport> Reports(
    std::vector<v1::ShardCheckpointReport> rs) {
  google::protobuf::RepeatedPtrField<v1::ShardCheckpointReport> out;
  for (auto& r : rs) *out.Add() = r;
  return out;
}

// Shard `shard` writes its half of tensor "w" and reports it done.
v1::ShardCheckpointReport Done(const v1::CheckpointOrder& o, const std::string& root,
                               uint64_t offset) {
  const float master[2] = {1.f + offset, 2.f + offset}, mom[2] = {0.5f, 0.25f};
  const float* arrays[] = {master, mom};
  auto f = ckpt::WriteDataFile(absl::StrCat(root, "/", o.path()), absl::StrCat("o", offset), 0,
                               offset, 2, arrays);
  EXPECT_TRUE(f.ok()) << f.status();
  v1::ShardCheckpointReport r;
  r.set_job_id(o.job_id());
  r.set_checkpoint_id(o.checkpoint_id());
  r.set_done(true);
  *r.add_files() = *f;
  return r;
}

TEST(CheckpointManagerTest, OffWithoutAFolderAndRefusesWhatItCannotDo) {
  CheckpointManager off("");
  EXPECT_EQ(off.Create(View(3)).status().code(), absl::StatusCode::kFailedPrecondition);
  CheckpointManager m(TempDir());
  CheckpointJobView pending = View(3);
  pending.state = v1::JOB_STATE_PENDING;
  EXPECT_EQ(m.Create(pending).status().code(), absl::StatusCode::kFailedPrecondition);
  CheckpointJobView no_dir = View(3);
  no_dir.owners_without_checkpoint_dir = {2};
  auto s = m.Create(no_dir).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("shard 2"), absl::string_view::npos) << s;
  CheckpointJobView escape = View(3);
  escape.spec.set_name("../../etc");
  EXPECT_EQ(m.Create(escape).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(m.List("../../etc").empty());
  ASSERT_TRUE(m.Create(View(3)).ok());
  EXPECT_EQ(m.Create(View(3)).status().code(), absl::StatusCode::kFailedPrecondition);
}

// A shard (or anything speaking as one) reporting a file named outside the
// checkpoint folder fails the checkpoint: no manifest lists it, so no
// restore ever opens it.
TEST(CheckpointManagerTest, AReportNamingAFileOutsideTheFolderFailsTheCheckpoint) {
  const std::string root = TempDir();
  CheckpointManager m(root);
  auto info = m.Create(View(10));
  ASSERT_TRUE(info.ok()) << info.status();
  auto orders = m.OnHeartbeat(1, Reports({}), {});
  ASSERT_EQ(orders.size(), 1u);
  m.OnHeartbeat(1, Reports({Done(orders[0], root, 0)}), {});
  v1::ShardCheckpointReport forged = Done(orders[0], root, 2);
  forged.mutable_files(0)->set_name("../../../../dev/zero");
  m.OnHeartbeat(2, Reports({forged}), {});
  m.WaitForFileWork();
  EXPECT_EQ(ckpt::ReadManifest(info->path()).status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(m.Last("j").has_value());
  EXPECT_EQ(m.Last("j")->state(), v1::CHECKPOINT_STATE_FAILED);
  EXPECT_NE(m.Last("j")->error().find("invalid file"), std::string::npos) << m.Last("j")->error();
}

TEST(CheckpointManagerTest, ManifestOnlyWhenEveryShardIsDoneThenKeepsTheLastK) {
  const std::string root = TempDir();
  CheckpointManager m(root);
  v1::JobSpec spec = View(0).spec;
  for (uint64_t round = 1; round <= 4; ++round) {
    CheckpointJobView view = View(round * 10);
    view.spec.mutable_checkpoint_policy()->set_keep_last(2);
    auto info = m.Create(view);
    ASSERT_TRUE(info.ok()) << info.status();
    EXPECT_EQ(info->step(), round * 10 + 1);
    auto orders = m.OnHeartbeat(1, Reports({}), {});
    ASSERT_EQ(orders.size(), 1u);
    EXPECT_EQ(orders[0].step(), round * 10 + 1);
    // Shard 1 done: no manifest yet.
    EXPECT_TRUE(m.OnHeartbeat(1, Reports({Done(orders[0], root, 0)}), {}).empty());
    EXPECT_EQ(ckpt::ReadManifest(info->path()).status().code(), absl::StatusCode::kNotFound);
    EXPECT_EQ(m.Last("j")->state(), v1::CHECKPOINT_STATE_IN_PROGRESS);
    // Shard 2 done: the manifest is written and the checkpoint is complete.
    m.OnHeartbeat(2, Reports({Done(orders[0], root, 2)}), {});
    m.WaitForFileWork();
    auto manifest = ckpt::ReadManifest(info->path());
    ASSERT_TRUE(manifest.ok()) << manifest.status();
    EXPECT_EQ(manifest->files_size(), 2);
    EXPECT_EQ(manifest->arrays_size(), 2);  // SGD: master, momentum_buffer.
    EXPECT_TRUE(ckpt::VerifyCheckpoint(info->path(), *manifest).ok());
    EXPECT_EQ(m.Last("j")->state(), v1::CHECKPOINT_STATE_COMPLETE);
  }
  std::vector<uint64_t> steps;
  for (const auto& c : m.List("j")) steps.push_back(c.step());
  EXPECT_EQ(steps, (std::vector<uint64_t>{31, 41}));
  EXPECT_EQ(ckpt::ListDir(root + "/j").size(), 2u);
  v1::CheckpointInfo info;
  auto src = m.PrepareRestore("j", 0, &info);
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_EQ(src->manifest().step(), 41u);
  EXPECT_EQ(m.PrepareRestore("j", 1, &info).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(m.PrepareRestore("../etc", 0, &info).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The shards record per file the optimizer steps its range took and the lr
// of its last one; the manifest keeps them, and its last_lr is the largest
// (a range that skipped the last step, e.g. no gradient, has an older one),
// which a restore hands to the workers.
TEST(CheckpointManagerTest, ManifestKeepsOptimizerStepsAndTakesTheLargestLastLr) {
  const std::string root = TempDir();
  CheckpointManager m(root);
  auto info = m.Create(View(10));
  ASSERT_TRUE(info.ok()) << info.status();
  auto orders = m.OnHeartbeat(1, Reports({}), {});
  ASSERT_EQ(orders.size(), 1u);
  v1::ShardCheckpointReport r1 = Done(orders[0], root, 0);
  r1.mutable_files(0)->set_optimizer_steps(10);
  r1.mutable_files(0)->set_last_lr(2.5e-4f);
  v1::ShardCheckpointReport r2 = Done(orders[0], root, 2);
  r2.mutable_files(0)->set_optimizer_steps(9);
  r2.mutable_files(0)->set_last_lr(3e-4f);
  m.OnHeartbeat(1, Reports({r1}), {});
  m.OnHeartbeat(2, Reports({r2}), {});
  m.WaitForFileWork();
  auto manifest = ckpt::ReadManifest(info->path());
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  ASSERT_EQ(manifest->files_size(), 2);
  EXPECT_EQ(manifest->files(0).optimizer_steps(), 10u);
  EXPECT_EQ(manifest->files(1).optimizer_steps(), 9u);
  EXPECT_FLOAT_EQ(manifest->last_lr(), 3e-4f);
  v1::CheckpointInfo restored;
  auto src = m.PrepareRestore("j", 0, &restored);
  ASSERT_TRUE(src.ok()) << src.status();
  EXPECT_FLOAT_EQ(src->manifest().last_lr(), 3e-4f);
}

TEST(CheckpointManagerTest, MissedStepRetriesLaterAndErrorsFailAndCleanUp) {
  const std::string root = TempDir();
  CheckpointManager m(root);
  auto first = m.Create(View(5));
  ASSERT_TRUE(first.ok());
  auto orders = m.OnHeartbeat(1, Reports({}), {});
  ASSERT_EQ(orders.size(), 1u);
  v1::ShardCheckpointReport missed;
  missed.set_job_id(7);
  missed.set_checkpoint_id(orders[0].checkpoint_id());
  missed.set_error("already applied");
  missed.set_missed_step(true);
  EXPECT_TRUE(m.OnHeartbeat(1, Reports({missed}), {}).empty());  // No orders while waiting.
  // The next tick orders the step training is at now, under a new id.
  m.Tick({View(9)}, absl::Now());
  m.WaitForFileWork();  // The new folder.
  auto retry = m.OnHeartbeat(2, Reports({}), {});
  ASSERT_EQ(retry.size(), 1u);
  EXPECT_EQ(retry[0].step(), 10u);
  EXPECT_GT(retry[0].checkpoint_id(), orders[0].checkpoint_id());
  // A real error fails it: the reason is kept, its folder removed.
  Done(retry[0], root, 0);
  v1::ShardCheckpointReport bad;
  bad.set_job_id(7);
  bad.set_checkpoint_id(retry[0].checkpoint_id());
  bad.set_error("cannot write x: No space left on device");
  m.OnHeartbeat(1, Reports({bad}), {});
  m.WaitForFileWork();  // Its folder's removal.
  const auto last = m.Last("j");
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->state(), v1::CHECKPOINT_STATE_FAILED);
  EXPECT_NE(last->error().find("shard 1: cannot write x"), std::string::npos) << last->error();
  EXPECT_TRUE(ckpt::ListDir(root + "/j").empty());
  // A new one may start.
  EXPECT_TRUE(m.Create(View(12)).ok());
}

TEST(CheckpointManagerTest, ChunksMovingToOtherShardsRetryTheCheckpointOverTheNewOwners) {
  const std::string root = TempDir();
  CheckpointManager m(root);
  auto first = m.Create(View(5));
  ASSERT_TRUE(first.ok());
  auto orders = m.OnHeartbeat(1, Reports({}), {});
  ASSERT_EQ(orders.size(), 1u);
  m.OnHeartbeat(1, Reports({Done(orders[0], root, 0)}), {});
  // Same owners (only backups moved): nothing changes.
  m.OnOwnersChanged(7, {1, 2});
  EXPECT_EQ(m.OnHeartbeat(2, Reports({}), {}).size(), 1u);
  // Shard 2 is lost and its chunks fail over to shard 3: shard 2 will never
  // report, so the checkpoint is ordered again, from shards 1 and 3.
  m.OnOwnersChanged(7, {1, 3});
  EXPECT_TRUE(m.OnHeartbeat(3, Reports({}), {}).empty());  // Nothing until the tick.
  CheckpointJobView moved = View(8);
  moved.owners = {1, 3};
  m.Tick({moved}, absl::Now());
  m.WaitForFileWork();
  auto again = m.OnHeartbeat(3, Reports({}), {});
  ASSERT_EQ(again.size(), 1u);
  EXPECT_GT(again[0].checkpoint_id(), orders[0].checkpoint_id());
  EXPECT_TRUE(m.OnHeartbeat(2, Reports({}), {}).empty());
  ASSERT_EQ(m.OnHeartbeat(1, Reports({}), {}).size(), 1u);
  m.OnHeartbeat(1, Reports({Done(again[0], root, 0)}), {});
  m.OnHeartbeat(3, Reports({Done(again[0], root, 2)}), {});
  m.WaitForFileWork();
  EXPECT_EQ(m.Last("j")->state(), v1::CHECKPOINT_STATE_COMPLETE);
  EXPECT_EQ(m.Last("j")->checkpoint_id(), again[0].checkpoint_id());
}

// A checkpoint's id is its step.
TEST(CheckpointManagerTest, IdsAreSteps) {
  const std::string root = TempDir();
  CheckpointManager m(root);
  auto info = m.Create(View(29));
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->checkpoint_id(), 30u);
  EXPECT_EQ(info->path(), root + "/j/" + ckpt::FolderName(30));
}

// every_steps: the shards take the checkpoint at each boundary on their
// own; the coordinator orders nothing and takes up the first report.
TEST(CheckpointManagerTest, PolicyCheckpointsAreTakenUpFromTheShardsReports) {
  const std::string root = TempDir();
  CheckpointManager m(root);
  CheckpointJobView v = View(12);
  v.spec.mutable_checkpoint_policy()->set_every_steps(5);
  v.resume_step = 1;
  const std::map<uint64_t, CheckpointJobView> views = {{7, v}};
  m.Tick({v}, absl::Now());
  m.WaitForFileWork();
  EXPECT_FALSE(m.Last("j").has_value()) << "no order for a step policy";
  EXPECT_TRUE(m.OnHeartbeat(2, Reports({}), views).empty());

  auto Part = [&](uint64_t step, uint64_t shard_offset, bool write) {
    v1::CheckpointOrder o;
    o.set_job_id(7);
    o.set_checkpoint_id(step);
    o.set_path(absl::StrCat("j/", ckpt::FolderName(step)));
    if (write) {
      // The shard makes a policy checkpoint's folder.
      EXPECT_TRUE(ckpt::MakeDirs(absl::StrCat(root, "/", o.path())).ok());
      return Done(o, root, shard_offset);
    }
    v1::ShardCheckpointReport r;  // Still writing.
    r.set_job_id(7);
    r.set_checkpoint_id(step);
    return r;
  };
  // Not a boundary, or not after the resume step: ignored.
  EXPECT_TRUE(m.OnHeartbeat(1, Reports({Part(12, 0, false)}), views).empty());
  CheckpointJobView restored = v;
  restored.resume_step = 10;
  EXPECT_TRUE(m.OnHeartbeat(1, Reports({Part(10, 0, false)}), {{7, restored}}).empty());
  EXPECT_FALSE(m.Last("j").has_value());

  // Shard 1 reports boundary 10 first: it is in progress over shards 1, 2;
  // shard 2 is told to keep reporting it (a policy order starts nothing).
  EXPECT_TRUE(m.OnHeartbeat(1, Reports({Part(10, 0, false)}), views).size() == 1u);
  ASSERT_TRUE(m.Last("j").has_value());
  EXPECT_EQ(m.Last("j")->checkpoint_id(), 10u);
  EXPECT_EQ(m.Last("j")->state(), v1::CHECKPOINT_STATE_IN_PROGRESS);
  auto orders = m.OnHeartbeat(2, Reports({}), views);
  ASSERT_EQ(orders.size(), 1u);
  EXPECT_TRUE(orders[0].policy());
  EXPECT_EQ(orders[0].step(), 10u);
  // Boundary 15 while 10 is in progress: skipped.
  m.OnHeartbeat(2, Reports({Part(15, 2, false)}), views);
  EXPECT_EQ(m.Last("j")->checkpoint_id(), 10u);
  // Both parts of 10 written: complete, with a manifest.
  m.OnHeartbeat(1, Reports({Part(10, 0, true)}), views);
  m.OnHeartbeat(2, Reports({Part(10, 2, true)}), views);
  m.WaitForFileWork();
  ASSERT_EQ(m.Last("j")->state(), v1::CHECKPOINT_STATE_COMPLETE);
  auto manifest = ckpt::ReadManifest(root + "/j/" + ckpt::FolderName(10));
  ASSERT_TRUE(manifest.ok()) << manifest.status();
  EXPECT_EQ(manifest->step(), 10u);
  EXPECT_EQ(manifest->files_size(), 2);
  // Nothing ordered any more: the shards forget it.
  EXPECT_TRUE(m.OnHeartbeat(1, Reports({}), views).empty());
  // A failed policy checkpoint is listed as such, and its folder is left
  // to the shards (another attempt at that step, e.g. after a rollback,
  // writes it again) and to pruning once a later one completes.
  v1::ShardCheckpointReport bad = Part(20, 0, true);
  bad.set_done(false);
  bad.set_error("cannot write: No space left on device");
  m.OnHeartbeat(1, Reports({bad}), views);
  m.WaitForFileWork();
  EXPECT_EQ(m.Last("j")->state(), v1::CHECKPOINT_STATE_FAILED);
  EXPECT_EQ(m.Last("j")->checkpoint_id(), 20u);
  EXPECT_FALSE(ckpt::ListDir(root + "/j/" + ckpt::FolderName(20)).empty());
}

TEST(CheckpointManagerTest, PolicyEverySeconds) {
  const absl::Time t0 = absl::Now();
  CheckpointManager timed(TempDir());
  CheckpointJobView w = View(3);
  w.spec.mutable_checkpoint_policy()->set_every_seconds(60);
  timed.Tick({w}, t0);
  timed.Tick({w}, t0 + absl::Seconds(59));
  EXPECT_FALSE(timed.Last("j").has_value());
  timed.Tick({w}, t0 + absl::Seconds(61));
  timed.WaitForFileWork();
  EXPECT_TRUE(timed.Last("j").has_value());
}

TEST(CheckpointManagerTest, DeletingAJobEndsItsCheckpointAndForgetsItButKeepsCompleteOnes) {
  const std::string root = TempDir();
  CheckpointManager m(root);
  // One complete checkpoint, then one in progress with shard 1's part done.
  auto first = m.Create(View(5));
  ASSERT_TRUE(first.ok()) << first.status();
  auto orders = m.OnHeartbeat(1, Reports({}), {});
  ASSERT_EQ(orders.size(), 1u);
  m.OnHeartbeat(1, Reports({Done(orders[0], root, 0)}), {});
  m.OnHeartbeat(2, Reports({Done(orders[0], root, 2)}), {});
  m.WaitForFileWork();
  ASSERT_EQ(m.Last("j")->state(), v1::CHECKPOINT_STATE_COMPLETE);
  CheckpointJobView policy = View(6);
  policy.spec.mutable_checkpoint_policy()->set_every_steps(100);
  auto second = m.Create(policy);
  ASSERT_TRUE(second.ok()) << second.status();
  orders = m.OnHeartbeat(1, Reports({}), {});
  ASSERT_EQ(orders.size(), 1u);
  m.OnHeartbeat(1, Reports({Done(orders[0], root, 0)}), {});
  m.Tick({policy}, absl::Now());  // Keeps a pace and a policy for the job.
  EXPECT_GT(m.table_sizes().in_progress, 0u);

  // Shard 2 writes its part while the job is being deleted.
  const v1::ShardCheckpointReport late = Done(orders[0], root, 2);
  m.OnJobDeleted(7);
  m.ForgetJobName("j");
  m.WaitForFileWork();
  // No order any more, the partial folder is gone, the complete one stays.
  EXPECT_TRUE(m.OnHeartbeat(2, Reports({}), {}).empty());
  EXPECT_EQ(ckpt::ListDir(root + "/j"),
            std::vector<std::string>{ckpt::FolderName(first->checkpoint_id())});
  const std::vector<v1::CheckpointInfo> list = m.List("j");
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].state(), v1::CHECKPOINT_STATE_COMPLETE);
  // A late report of the ended checkpoint changes nothing.
  m.OnHeartbeat(2, Reports({late}), {});
  m.WaitForFileWork();
  EXPECT_EQ(m.List("j").size(), 1u);
  const CheckpointManager::TableSizes t = m.table_sizes();
  EXPECT_EQ(t.in_progress, 0u);
  EXPECT_EQ(t.policies, 0u);
  EXPECT_EQ(t.paces, 0u);
  EXPECT_EQ(t.names, 0u);
}

TEST(CheckpointManagerTest, DeletingAJobBeforeItsFolderIsMadeAbortsTheCreate) {
  CheckpointManager m(TempDir());
  auto ticket = m.Start(View(3));
  ASSERT_TRUE(ticket.ok()) << ticket.status();
  m.OnJobDeleted(7);
  auto info = m.AwaitStart(*ticket);
  // The folder may have been made just before the delete: either way the
  // caller hears how it ended and nothing is left in progress.
  if (info.ok()) {
    EXPECT_EQ(info->state(), v1::CHECKPOINT_STATE_IN_PROGRESS);
  } else {
    EXPECT_EQ(info.status().code(), absl::StatusCode::kAborted) << info.status();
  }
  m.WaitForFileWork();
  EXPECT_EQ(m.table_sizes().in_progress, 0u);
  EXPECT_TRUE(m.OnHeartbeat(1, Reports({}), {}).empty());
}

}  // namespace
}  // namespace optimus
