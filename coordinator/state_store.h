// Where the coordinator keeps its durable state (shards, jobs, maps; see
// CoordinatorState in proto/optimus.proto): an interface, so that the
// coordinator's tests can keep it in memory or make it slow, with the file
// implementation the service runs on and an in-memory one.
// The coordinator serializes the state and hands the bytes over; a store
// knows nothing of what they mean. Implementations must be safe to call
// from any thread (the coordinator saves from its writer thread and loads
// once at start).
#ifndef OPTIMUS_COORDINATOR_STATE_STORE_H_
#define OPTIMUS_COORDINATOR_STATE_STORE_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace optimus {

class StateStore {
 public:
  virtual ~StateStore() = default;

  // Replaces the stored state with `bytes`, durably: once this returns OK,
  // Load (after a crash too) returns these bytes or newer ones. On error
  // (a full disk: RESOURCE_EXHAUSTED) the previous state stays as it was and
  // the message names what failed. May take as long as the medium needs
  // (an fsync): the coordinator never calls it under its lock.
  virtual absl::Status Save(absl::string_view bytes) = 0;

  // The stored state; std::nullopt when nothing was ever saved. DATA_LOSS
  // naming the file when it is corrupted.
  virtual absl::StatusOr<std::optional<std::string>> Load() = 0;

  // What to name in logs, e.g. "/var/lib/optimus/coordinator.state".
  virtual std::string Describe() const = 0;
};

// The state in `dir`/coordinator.state, written with a checksummed header,
// fsync and an atomic rename (common/durable_file.h): after a crash the file
// holds the old or the new state, never a mix. The folder is created by
// Load when missing.
class FileStateStore : public StateStore {
 public:
  explicit FileStateStore(std::string dir);

  absl::Status Save(absl::string_view bytes) override;
  absl::StatusOr<std::optional<std::string>> Load() override;
  std::string Describe() const override { return path_; }

 private:
  const std::string dir_;
  const std::string path_;
};

// The state in memory: outlives a Coordinator (a test restarts one over the
// same store) but not the process.
class MemoryStateStore : public StateStore {
 public:
  absl::Status Save(absl::string_view bytes) override;
  absl::StatusOr<std::optional<std::string>> Load() override;
  std::string Describe() const override { return "memory"; }

  // Saves so far.
  int saves() const;

 private:
  mutable absl::Mutex mu_;
  std::optional<std::string> bytes_ ABSL_GUARDED_BY(mu_);
  int saves_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace optimus

#endif  // OPTIMUS_COORDINATOR_STATE_STORE_H_
