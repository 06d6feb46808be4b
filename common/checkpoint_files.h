// Checkpoint files on disk: CRC32C, the chunk data file format, atomic
// publication (temp name, fsync, rename, fsync of the folder) and the
// manifest. Shared by the shard (writes data files, reads them on restore),
// the coordinator (writes the manifest, verifies before a restore) and
// optimusctl (export). The manifest's schema is the CheckpointManifest
// message of proto/optimus.proto, so this library takes that type: it *is*
// the file format, not an RPC. Every function is thread-safe (no shared
// state); files are owned by the caller's folder.
//
// A data file holds the fp32 state of one range of one tensor:
//   offset 0   8 bytes  magic "OPTCKPT1"
//          8   u32      format version (1)
//         12   u32      tensor index (into the manifest's spec.tensors)
//         16   u64      offset_elems
//         24   u64      num_elems
//         32   u32      num_arrays (master, then the optimizer's moments, in
//                       the order and with the names of kernels::LayoutOf)
//         36   u32      reserved (0)
//         40   num_arrays x num_elems fp32, array after array
//        end-4 u32      CRC32C (Castagnoli) of every byte before it
// All integers and floats little-endian (the only byte order we run on).
#ifndef OPTIMUS_COMMON_CHECKPOINT_FILES_H_
#define OPTIMUS_COMMON_CHECKPOINT_FILES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/durable_file.h"
#include "proto/optimus.pb.h"

namespace optimus {
namespace ckpt {

inline constexpr uint32_t kFormatVersion = 1;
inline constexpr size_t kHeaderBytes = 40;
inline constexpr char kManifestName[] = "MANIFEST";

// CRC-32C, atomic file writes and whole-file reads come from
// common/durable_file.h; these names keep callers in ckpt:: short.
using ::optimus::Crc32c;
using ::optimus::ReadWholeFile;
using ::optimus::WriteFileAtomically;

// "ckpt-000042": the folder of checkpoint 42 of a job. Zero-padded so that
// names sort by id.
std::string FolderName(uint64_t checkpoint_id);
// Parses FolderName's output; 0 for anything else.
uint64_t ParseFolderName(absl::string_view name);

// Writes one data file into `dir` as `name`: under a temporary name, fsynced,
// then renamed and the folder fsynced, so the file is either absent or
// whole. Each of `arrays` points at num_elems floats. At most
// `max_bytes_per_second` are written per second (0: no limit). Errors carry
// the path and the OS's reason (e.g. "No space left on device"); the
// temporary file is removed. Returns the manifest's record of the file.
absl::StatusOr<v1::CheckpointFile> WriteDataFile(const std::string& dir, const std::string& name,
                                                 uint32_t tensor, uint64_t offset_elems,
                                                 uint64_t num_elems,
                                                 absl::Span<const float* const> arrays,
                                                 uint64_t max_bytes_per_second = 0);

// A data file's name as a manifest or a shard's report may carry it: 1-128
// characters of [A-Za-z0-9._-], not "." or ".." (no path separators: a
// name never leaves its checkpoint folder). INVALID_ARGUMENT saying why.
absl::Status CheckFileName(absl::string_view name);

// Checks a data file's record for itself: a valid name, and size_bytes equal
// to the header, num_arrays x num_elems floats and the trailer, computed
// without overflow. INVALID_ARGUMENT naming the file and the mismatch.
absl::Status CheckFileRecord(const v1::CheckpointFile& file);

// Reads `dir`/`file.name()` whole and checks it against its own trailer and
// against the manifest's record (size, checksum, header fields). DATA_LOSS
// naming the file when anything differs (a record failing CheckFileRecord
// included: nothing is opened then); NOT_FOUND when it is missing. Never
// reads more than the record's size_bytes.
// Returns the arrays back to back (file.num_arrays() x file.num_elems()).
absl::StatusOr<std::vector<float>> ReadDataFile(const std::string& dir,
                                                const v1::CheckpointFile& file);

// Reads and checks every data file the manifest lists (DATA_LOSS naming the
// first bad one).
absl::Status VerifyCheckpoint(const std::string& dir, const v1::CheckpointManifest& manifest);

// Fills elements [offset_elems, offset_elems + num_elems) of tensor `tensor`
// from the checkpoint's files: dst[a] receives array a (dst.size() must
// equal the files' num_arrays). The range may span several files and need
// not match how the checkpoint was chunked (resharding). Each file read is
// verified; FAILED_PRECONDITION when the files do not cover the range.
absl::Status ReadTensorRange(const std::string& dir, const v1::CheckpointManifest& manifest,
                             uint32_t tensor, uint64_t offset_elems, uint64_t num_elems,
                             absl::Span<float* const> dst);

// The optimizer steps each tensor's values have seen (torch's per-parameter
// 'step'), from the files' optimizer_steps, in spec order: DATA_LOSS when
// two files of a tensor disagree or a file names no tensor of the spec. A
// checkpoint written before files recorded them (all 0, step > 1) had every
// tensor but frozen ones take every step: step - 1. `dir` names the
// checkpoint in errors.
absl::StatusOr<std::vector<uint64_t>> OptimizerStepsOf(const std::string& dir,
                                                       const v1::CheckpointManifest& manifest);

// Writes `dir`/MANIFEST atomically (text format + checksum line).
absl::Status WriteManifest(const std::string& dir, const v1::CheckpointManifest& manifest);
// NOT_FOUND when there is none (an incomplete checkpoint); DATA_LOSS naming
// the file when its checksum or syntax is wrong.
absl::StatusOr<v1::CheckpointManifest> ReadManifest(const std::string& dir);

// mkdir -p. INTERNAL with the path and reason on failure.
absl::Status MakeDirs(const std::string& path);
// rm -r; a missing path is fine.
absl::Status RemoveTree(const std::string& path);
// Names of the entries of a folder (not "." or ".."); empty when missing.
std::vector<std::string> ListDir(const std::string& path);

}  // namespace ckpt
}  // namespace optimus

#endif  // OPTIMUS_COMMON_CHECKPOINT_FILES_H_
