#include "coordinator/state_store.h"

#include <cerrno>
#include <filesystem>
#include <system_error>
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
  // One level, as mkdir(2) with 0755: the folder's parent must exist.
  std::error_code ec;
  if (std::filesystem::create_directory(dir_, ec)) {
    std::filesystem::permissions(
        dir_, std::filesystem::perms::group_write | std::filesystem::perms::others_write,
        std::filesystem::perm_options::remove, ec);
  }
  if (ec && ec.value() != EEXIST) return ErrnoToStatus(ec.value(), "creating state folder", dir_);
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
