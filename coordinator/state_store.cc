#include "coordinator/state_store.h"

#include <errno.h>
#include <sys/stat.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/durable_file.h"

namespace optimus {
namespace {

// First word of the state file's header: names the format and its version.
constexpr absl::string_view kStateMagic = "OPTIMUS-COORD-STATE-1";

}  // namespace

FileStateStore::FileStateStore(std::string dir)
    : dir_(std::move(dir)), path_(absl::StrCat(dir_, "/coordinator.state")) {}

absl::Status FileStateStore::Save(absl::string_view bytes) {
  absl::Status s = WriteChecksummedFile(path_, kStateMagic, bytes, 0600);  // Holds job tokens.
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat("saving coordinator state: ", s.message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<std::string>> FileStateStore::Load() {
  if (::mkdir(dir_.c_str(), 0755) != 0 && errno != EEXIST) {
    return ErrnoToStatus(errno, "creating state folder", dir_);
  }
  absl::StatusOr<std::string> bytes = ReadChecksummedFile(path_, kStateMagic);
  if (absl::IsNotFound(bytes.status())) return std::optional<std::string>();
  if (!bytes.ok()) return bytes.status();
  return std::optional<std::string>(*std::move(bytes));
}

absl::Status MemoryStateStore::Save(absl::string_view bytes) {
  absl::MutexLock lock(&mu_);
  bytes_ = std::string(bytes);
  ++saves_;
  return absl::OkStatus();
}

absl::StatusOr<std::optional<std::string>> MemoryStateStore::Load() {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

int MemoryStateStore::saves() const {
  absl::MutexLock lock(&mu_);
  return saves_;
}

}  // namespace optimus
