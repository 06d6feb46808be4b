// Durable small files: write-then-rename with fsync, read back, and a CRC-32C
// over the contents, for state that must survive a crash (the coordinator's
// state, manifests). Stateless functions; safe from any thread as long as two
// callers do not write the same path at once.
#ifndef OPTIMUS_COMMON_DURABLE_FILE_H_
#define OPTIMUS_COMMON_DURABLE_FILE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace optimus {

// Converts an errno value from a file operation into a Status whose message
// is "<what> <path>: <strerror>". ENOSPC and EDQUOT become RESOURCE_EXHAUSTED,
// ENOENT NOT_FOUND, EACCES/EPERM PERMISSION_DENIED, others INTERNAL or
// FAILED_PRECONDITION. The one place errno crosses into optimus code.
absl::Status ErrnoToStatus(int err, absl::string_view what, absl::string_view path);

// Replaces `path` with `contents` atomically: writes "<path>.tmp", fsyncs it,
// renames it over `path` and fsyncs the folder. After a crash `path` holds
// either the old or the new contents, never a mix. On failure (a full disk,
// say: RESOURCE_EXHAUSTED) `path` is untouched, the temporary file is
// removed, and the error names the file. max_bytes_per_second > 0 paces the
// writes (a background writer that must not starve others of the disk);
// 0 writes at full speed. `mode`: the file's permission bits (0600 for
// files that hold secrets).
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents,
                                 uint64_t max_bytes_per_second = 0, unsigned mode = 0644);

// Same, for a file made of `pieces` written one after another (no copy into
// one buffer).
absl::Status WritePiecesAtomically(const std::string& path,
                                   absl::Span<const absl::string_view> pieces,
                                   uint64_t max_bytes_per_second = 0, unsigned mode = 0644);

// Whole file. NOT_FOUND when it does not exist. A path that is not a
// regular file (a device such as /dev/zero, a FIFO, a folder) or one larger
// than max_bytes is refused (FAILED_PRECONDITION / OUT_OF_RANGE) before
// anything is read, so a hostile name or a huge file cannot exhaust memory.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path,
                                          uint64_t max_bytes = uint64_t{1} << 36);

// CRC-32C (Castagnoli; the value of iSCSI, ext4 and leveldb's crc32c before
// masking) of size_bytes bytes, continuing from `crc` (0 to start).
// Slicing-by-8: about 1-2 GB/s on one core.
uint32_t Crc32c(uint32_t crc, const void* data, size_t size_bytes);
// The same with the portable table code, and whether Crc32c uses the CPU's
// CRC instruction instead (tests compare the two).
uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t size_bytes);
bool Crc32cIsHardware();
inline uint32_t Crc32c(absl::string_view data, uint32_t crc = 0) {
  return Crc32c(crc, data.data(), data.size());
}

// A file with a header line "<magic> <crc32c hex> <size>\n" before the
// payload, so a torn or corrupted file is detected on read.
absl::Status WriteChecksummedFile(const std::string& path, absl::string_view magic,
                                  absl::string_view payload, unsigned mode = 0644);
// DATA_LOSS naming the file when the magic, size or checksum do not match;
// NOT_FOUND when it does not exist.
absl::StatusOr<std::string> ReadChecksummedFile(const std::string& path,
                                                absl::string_view magic);

}  // namespace optimus

#endif  // OPTIMUS_COMMON_DURABLE_FILE_H_
