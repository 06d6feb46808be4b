// Writes snapshots of the coordinator's state to a StateStore on a thread of
// its own, so that no lock is held while a snapshot reaches the disk. Two
// ways in, both numbering changes 1, 2, ...:
//
//   - push: the caller serializes a snapshot under its lock and Submits it
//     (which never waits for I/O). The writer always writes the newest
//     snapshot queued and skips older ones, so an older snapshot never
//     overwrites a newer one and a burst of changes costs one write;
//   - pull (group commit; what the coordinator uses): the caller only
//     marks the state changed (MarkChanged, O(1)) under its lock, and the
//     writer, when it is ready to write, asks the Source for the state as
//     it is then. One serialization and one write cover every change marked
//     before it: 4,000 shards registering at once cost a few writes, not
//     4,000 serializations of a growing state.
//
// A caller that must answer only once its change is durable waits with
// WaitDurable(seq); others (heartbeats, the sweeper) do not wait.
//
// Owns its thread; borrows the store, which must outlive it. Thread-safe.
#ifndef OPTIMUS_COORDINATOR_STATE_WRITER_H_
#define OPTIMUS_COORDINATOR_STATE_WRITER_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "coordinator/state_store.h"

namespace optimus {

class StateWriter {
 public:
  // What a pull returns: the state's bytes and the number of the newest
  // change they hold.
  struct Pulled {
    std::string bytes;
    uint64_t seq = 0;
  };
  // Called on the writer's thread, with none of its locks held. It must
  // take the lock under which MarkChanged is called, serialize the state
  // and read submitted_seq() under it, so that every change marked before
  // is in the bytes.
  using Source = std::function<absl::StatusOr<Pulled>()>;

  // `source` is needed for MarkChanged only.
  explicit StateWriter(StateStore* store, Source source = nullptr);
  // Close()s it.
  ~StateWriter();
  // Writes the newest snapshot still queued (pulling it if a change was
  // marked since the last write), then stops the thread; nothing is
  // written after. The source must still work until it returns: its owner
  // closes the writer before it goes. Call once, from one thread.
  void Close();
  StateWriter(const StateWriter&) = delete;
  StateWriter& operator=(const StateWriter&) = delete;

  // Queues a snapshot and returns its sequence number (1, 2, ...). Callers
  // submit snapshots in the order they took them (under the lock that
  // guards the state), so a larger number is a newer state. Never blocks on
  // I/O.
  uint64_t Submit(std::string bytes);

  // Pull mode: the state changed; returns the change's sequence number.
  // Never blocks on I/O and copies nothing.
  uint64_t MarkChanged();
  // The newest sequence number given out (by Submit or MarkChanged).
  uint64_t submitted_seq() const;

  // Waits until snapshot `seq`, or a newer one, has been written. OK when
  // one at least as new is durable; otherwise the store's error from the
  // attempt that covered `seq` (the store keeps an older state then).
  absl::Status WaitDurable(uint64_t seq);

  // Sequence number of the newest durable snapshot (0: none yet).
  uint64_t durable_seq() const;

 private:
  void Run();

  StateStore* const store_;
  const Source source_;
  mutable absl::Mutex mu_;
  uint64_t submitted_seq_ ABSL_GUARDED_BY(mu_) = 0;
  // A change was marked since the last pull.
  bool pull_wanted_ ABSL_GUARDED_BY(mu_) = false;
  // The newest snapshot not yet taken by the thread, and its number.
  std::optional<std::string> pending_ ABSL_GUARDED_BY(mu_);
  uint64_t pending_seq_ ABSL_GUARDED_BY(mu_) = 0;
  // The newest snapshot the thread tried to write, the newest it wrote,
  // and the error of the last failed attempt.
  uint64_t attempted_seq_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t durable_seq_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status last_error_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_STATE_WRITER_H_
