// Durable small files: write-then-rename with fsync, read back, and a CRC-32C
// over the contents, for state that must survive a crash (the coordinator's
// state, manifests). Stateless functions; safe from any thread as long as two
// callers do not write the same path at once.
#ifndef OPTIMUS_COMMON_DURABLE_FILE_H_
#define OPTIMUS_COMMON_DURABLE_FILE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace optimus {

// Converts an errno value from a file operation into a Status whose message
// is "<what> <path>: <strerror>". ENOSPC and EDQUOT become RESOURCE_EXHAUSTED,
// ENOENT NOT_FOUND, EACCES/EPERM PERMISSION_DENIED, others INTERNAL or
// FAILED_PRECONDITION. The one place errno crosses into optimus code.
absl::Status ErrnoToStatus(int err, absl::string_view what, absl::string_view path);

// Replaces `path` with `contents` atomically: writes "<path>.tmp", fsyncs it,
// renames it over `path` and fsyncs the folder. After a crash `path` holds
// either the old or the new contents, never a mix. On failure (a full disk,
// say) `path` is untouched, the temporary file is removed, and the error
// names the file.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);

// Whole file. NOT_FOUND when it does not exist.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path);

// CRC-32C (Castagnoli) of `data`, continuing from `crc` (0 to start).
uint32_t Crc32c(absl::string_view data, uint32_t crc = 0);

// A file with a header line "<magic> <crc32c hex> <size>\n" before the
// payload, so a torn or corrupted file is detected on read.
absl::Status WriteChecksummedFile(const std::string& path, absl::string_view magic,
                                  absl::string_view payload);
// DATA_LOSS naming the file when the magic, size or checksum do not match;
// NOT_FOUND when it does not exist.
absl::StatusOr<std::string> ReadChecksummedFile(const std::string& path,
                                                absl::string_view magic);

}  // namespace optimus

#endif  // OPTIMUS_COMMON_DURABLE_FILE_H_
