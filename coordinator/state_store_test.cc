// The state stores and the writer thread on their own: the file store keeps
// the old state when a save fails and names a corrupted file; the writer
// writes the newest snapshot and never an older one after it, reports a
// failed save to whoever waits for it, and writes what is pending when it
// is destroyed.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "coordinator/state_store.h"
#include "coordinator/state_writer.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace optimus {
namespace {

using ::testing::HasSubstr;

std::string FreshDir(const std::string& name) {
  const char* t = std::getenv("TEST_TMPDIR");
  std::string dir = absl::StrCat(t != nullptr ? t : "/tmp", "/", name, "XXXXXX");
  EXPECT_NE(mkdtemp(dir.data()), nullptr);
  return dir;
}

TEST(FileStateStoreTest, RoundTripKeepsTheOldStateOnAFailedSaveAndNamesACorruptFile) {
  const std::string dir = FreshDir("store");
  FileStateStore store(dir);
  auto empty = store.Load();
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_FALSE(empty->has_value());
  ASSERT_TRUE(store.Save("one").ok());
  EXPECT_EQ(**store.Load(), "one");

  // A folder where the temporary file goes makes the save fail.
  const std::string blocker = dir + "/coordinator.state.tmp";
  ASSERT_EQ(::mkdir(blocker.c_str(), 0755), 0);
  EXPECT_FALSE(store.Save("two").ok());
  EXPECT_EQ(**store.Load(), "one");
  ASSERT_EQ(::rmdir(blocker.c_str()), 0);

  // A flipped byte is refused, naming the file.
  const std::string path = dir + "/coordinator.state";
  FILE* f = std::fopen(path.c_str(), "r+");
  ASSERT_NE(f, nullptr);
  std::fseek(f, -1, SEEK_END);
  std::fputc('X', f);
  std::fclose(f);
  auto bad = store.Load();
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr(path));
}

// A store whose saves wait for the test to let them through, and that
// records what it was given.
class GatedStore : public StateStore {
 public:
  absl::Status Save(absl::string_view bytes) override {
    absl::MutexLock lock(&mu_);
    ++entered_;
    mu_.Await(absl::Condition(&open_));
    saved_.emplace_back(bytes);
    if (fail_) return absl::ResourceExhaustedError("disk full");
    return absl::OkStatus();
  }
  absl::StatusOr<std::optional<std::string>> Load() override {
    absl::MutexLock lock(&mu_);
    if (saved_.empty()) return std::optional<std::string>();
    return std::optional<std::string>(saved_.back());
  }
  std::string Describe() const override { return "gated"; }

  void Open(bool open) {
    absl::MutexLock lock(&mu_);
    open_ = open;
  }
  void Fail(bool fail) {
    absl::MutexLock lock(&mu_);
    fail_ = fail;
  }
  void WaitEntered(int n) {
    absl::MutexLock lock(&mu_);
    auto entered = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return entered_ >= n; };
    mu_.Await(absl::Condition(&entered));
  }
  std::vector<std::string> saved() {
    absl::MutexLock lock(&mu_);
    return saved_;
  }

 private:
  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = false;
  bool fail_ ABSL_GUARDED_BY(mu_) = false;
  int entered_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::string> saved_ ABSL_GUARDED_BY(mu_);
};

TEST(StateWriterTest, WritesTheNewestSnapshotAndNeverAnOlderOneAfterIt) {
  GatedStore store;
  StateWriter writer(&store);
  const uint64_t s1 = writer.Submit("v1");
  store.WaitEntered(1);  // v1 is being written (slowly).
  // Submitting never waits for the disk.
  const uint64_t s2 = writer.Submit("v2");
  const uint64_t s3 = writer.Submit("v3");
  EXPECT_LT(s1, s2);
  EXPECT_LT(s2, s3);
  EXPECT_EQ(writer.durable_seq(), 0u);
  store.Open(true);
  // v2 was superseded by v3 before the thread got to it: it is skipped,
  // and waiting for it ends once v3 is durable.
  EXPECT_TRUE(writer.WaitDurable(s2).ok());
  EXPECT_TRUE(writer.WaitDurable(s3).ok());
  EXPECT_EQ(store.saved(), (std::vector<std::string>{"v1", "v3"}));
  EXPECT_EQ(writer.durable_seq(), s3);
}

TEST(StateWriterTest, AFailedSaveIsReportedToItsWaiterAndALaterOneSucceeds) {
  GatedStore store;
  store.Open(true);
  StateWriter writer(&store);
  store.Fail(true);
  const uint64_t s1 = writer.Submit("v1");
  const absl::Status failed = writer.WaitDurable(s1);
  EXPECT_EQ(failed.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(failed.message()), HasSubstr("disk full"));
  store.Fail(false);
  const uint64_t s2 = writer.Submit("v2");
  EXPECT_TRUE(writer.WaitDurable(s2).ok());
  EXPECT_EQ(**store.Load(), "v2");
}

TEST(StateWriterTest, DestructionWritesWhatIsPending) {
  MemoryStateStore store;
  {
    StateWriter writer(&store);
    writer.Submit("a");
    writer.Submit("b");
  }
  EXPECT_EQ(**store.Load(), "b");
}

}  // namespace
}  // namespace optimus
