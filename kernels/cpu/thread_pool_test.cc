#include "kernels/cpu/thread_pool.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <mutex>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace optimus {
namespace kernels {
namespace {

// Runs ParallelFor and returns the ranges it produced, sorted.
std::vector<std::pair<size_t, size_t>> Ranges(ThreadPool* pool, size_t n,
                                              size_t grain) {
  std::mutex mu;
  std::vector<std::pair<size_t, size_t>> ranges;
  pool->ParallelFor(n, grain, [&](size_t begin, size_t end) {
    std::lock_guard<std::mutex> lock(mu);
    ranges.emplace_back(begin, end);
  });
  std::sort(ranges.begin(), ranges.end());
  return ranges;
}

TEST(ThreadPoolTest, RangesCoverEverythingOnceOnGrainBoundaries) {
  for (int threads : {1, 2, 3, 7}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.num_threads(), threads);
    for (size_t n : {0, 1, 15, 16, 17, 100, 1000, 12345}) {
      for (size_t grain : {0, 1, 16, 64}) {
        const auto ranges = Ranges(&pool, n, grain);
        SCOPED_TRACE(testing::Message() << "threads=" << threads << " n=" << n
                                        << " grain=" << grain);
        if (n == 0) {
          EXPECT_TRUE(ranges.empty());
          continue;
        }
        ASSERT_FALSE(ranges.empty());
        EXPECT_LE(ranges.size(), static_cast<size_t>(threads));
        size_t next = 0;
        for (const auto& [begin, end] : ranges) {
          EXPECT_EQ(begin, next);
          EXPECT_LT(begin, end);
          if (grain > 1) {
            EXPECT_EQ(begin % grain, 0u);
          }
          next = end;
        }
        EXPECT_EQ(next, n);
      }
    }
  }
}

TEST(ThreadPoolTest, UsesSeveralThreads) {
  ThreadPool pool(3);
  std::mutex mu;
  std::set<std::thread::id> ids;
  std::atomic<int> arrived{0};
  pool.ParallelFor(3, 1, [&](size_t, size_t) {
    {
      std::lock_guard<std::mutex> lock(mu);
      ids.insert(std::this_thread::get_id());
    }
    // Every range waits for the others: only possible if they run at once.
    arrived.fetch_add(1);
    while (arrived.load() < 3) std::this_thread::yield();
  });
  EXPECT_EQ(ids.size(), 3u);
}

TEST(ThreadPoolTest, ConcurrentCallersShareThePool) {
  ThreadPool pool(2);
  std::vector<std::atomic<int>> hits(4 * 10000);
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&, c] {
      for (int rep = 0; rep < 50; ++rep) {
        pool.ParallelFor(10000, 8, [&](size_t begin, size_t end) {
          for (size_t i = begin; i < end; ++i) hits[c * 10000 + i].fetch_add(1);
        });
      }
    });
  }
  for (std::thread& t : callers) t.join();
  for (const auto& h : hits) ASSERT_EQ(h.load(), 50);
}

// The start hook runs once on each background thread, before it takes any
// range, and not on the caller (which runs one range itself).
TEST(ThreadPoolTest, StartHookRunsOnEachBackgroundThreadBeforeItsRanges) {
  thread_local int hooks_here = 0;
  std::atomic<int> hooks{0};
  ThreadPool pool(4, [&] {
    ++hooks_here;
    hooks.fetch_add(1);
  });
  const std::thread::id caller = std::this_thread::get_id();
  std::mutex mu;
  std::set<std::thread::id> ids;
  std::atomic<int> wrong{0};
  std::atomic<int> arrived{0};
  // Every range waits for the others, so the four run on four threads: the
  // caller and each background thread.
  pool.ParallelFor(4, 1, [&](size_t, size_t) {
    const bool is_caller = std::this_thread::get_id() == caller;
    if (hooks_here != (is_caller ? 0 : 1)) wrong.fetch_add(1);
    {
      std::lock_guard<std::mutex> lock(mu);
      ids.insert(std::this_thread::get_id());
    }
    arrived.fetch_add(1);
    while (arrived.load() < 4) std::this_thread::yield();
  });
  EXPECT_EQ(ids.size(), 4u);
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(hooks.load(), 3);
}

}  // namespace
}  // namespace kernels
}  // namespace optimus
