#include "common/checkpoint_files.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/text_format.h"

namespace optimus {
namespace ckpt {
namespace {

constexpr char kMagic[8] = {'O', 'P', 'T', 'C', 'K', 'P', 'T', '1'};
constexpr char kCrcLinePrefix[] = "# crc32c=";
// Writes go out in pieces this large so a rate limit can pace them.
constexpr size_t kWritePieceBytes = 256 << 10;

// Slicing-by-8 tables for the reflected Castagnoli polynomial 0x82F63B78.
struct Crc32cTables {
  uint32_t t[8][256];
  Crc32cTables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    }
  }
};

const Crc32cTables& Tables() {
  static const Crc32cTables* tables = new Crc32cTables();
  return *tables;
}

std::string Errno(const std::string& what, const std::string& path, int err) {
  return absl::StrCat(what, " ", path, ": ", std::strerror(err));
}

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

absl::Status FsyncDir(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return absl::InternalError(Errno("cannot open folder", dir, errno));
  const int rc = fsync(fd);
  const int err = errno;
  close(fd);
  if (rc != 0) return absl::InternalError(Errno("cannot fsync folder", dir, err));
  return absl::OkStatus();
}

// Writes pieces in order to a new temporary file and publishes it at `path`.
absl::Status WritePiecesAtomically(const std::string& path,
                                   absl::Span<const absl::string_view> pieces,
                                   uint64_t max_bytes_per_second) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InternalError(Errno("cannot create", tmp, errno));
  auto fail = [&](const std::string& what, int err) {
    close(fd);
    unlink(tmp.c_str());
    // ENOSPC and EDQUOT are the operator's to fix, not a bug: say so by code.
    const std::string msg = Errno(what, path, err);
    return err == ENOSPC || err == EDQUOT ? absl::ResourceExhaustedError(msg)
                                          : absl::InternalError(msg);
  };
  const absl::Time start = absl::Now();
  uint64_t written = 0;
  for (absl::string_view piece : pieces) {
    size_t done = 0;
    while (done < piece.size()) {
      const size_t want = std::min(kWritePieceBytes, piece.size() - done);
      const ssize_t n = write(fd, piece.data() + done, want);
      if (n < 0) {
        if (errno == EINTR) continue;
        return fail("cannot write", errno);
      }
      done += static_cast<size_t>(n);
      written += static_cast<uint64_t>(n);
      if (max_bytes_per_second > 0) {
        const absl::Time due =
            start + absl::Seconds(static_cast<double>(written) / max_bytes_per_second);
        const absl::Duration wait = due - absl::Now();
        if (wait > absl::ZeroDuration()) absl::SleepFor(wait);
      }
    }
  }
  // Delayed allocation can report a full disk only here.
  if (fsync(fd) != 0) return fail("cannot fsync", errno);
  if (close(fd) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return absl::InternalError(Errno("cannot close", path, err));
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    unlink(tmp.c_str());
    return absl::InternalError(Errno("cannot rename into", path, err));
  }
  return FsyncDir(DirOf(path));
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return absl::NotFoundError(absl::StrCat("checkpoint file ", path, " is missing"));
    return absl::InternalError(Errno("cannot open", path, err));
  }
  std::string out;
  struct stat st;
  if (fstat(fd, &st) == 0 && st.st_size > 0) out.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      close(fd);
      return absl::InternalError(Errno("cannot read", path, err));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return out;
}

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

template <typename T>
T Get(const std::string& in, size_t at) {
  T v;
  std::memcpy(&v, in.data() + at, sizeof(v));
  return v;
}

absl::Status Corrupt(const std::string& path, absl::string_view why) {
  return absl::DataLossError(absl::StrCat("checkpoint file ", path, " is corrupt: ", why));
}

}  // namespace

uint32_t Crc32c(uint32_t crc, const void* data, size_t size_bytes) {
  const Crc32cTables& tb = Tables();
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (size_bytes >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = tb.t[7][lo & 0xff] ^ tb.t[6][(lo >> 8) & 0xff] ^ tb.t[5][(lo >> 16) & 0xff] ^
        tb.t[4][lo >> 24] ^ tb.t[3][hi & 0xff] ^ tb.t[2][(hi >> 8) & 0xff] ^
        tb.t[1][(hi >> 16) & 0xff] ^ tb.t[0][hi >> 24];
    p += 8;
    size_bytes -= 8;
  }
  while (size_bytes-- > 0) c = (c >> 8) ^ tb.t[0][(c ^ *p++) & 0xff];
  return ~c;
}

std::string FolderName(uint64_t checkpoint_id) {
  return absl::StrFormat("ckpt-%06d", checkpoint_id);
}

uint64_t ParseFolderName(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, "ckpt-") || name.empty()) return 0;
  for (char c : name) {
    if (c < '0' || c > '9') return 0;
  }
  uint64_t id = 0;
  return absl::SimpleAtoi(name, &id) ? id : 0;
}

std::vector<std::string> ArrayNames(v1::OptimizerKind kind) {
  switch (kind) {
    case v1::OPTIMIZER_ADAM:
    case v1::OPTIMIZER_ADAMW: return {"master", "exp_avg", "exp_avg_sq"};
    case v1::OPTIMIZER_SGD: return {"master", "momentum_buffer"};
    case v1::OPTIMIZER_LION: return {"master", "exp_avg"};
    default: return {"master"};
  }
}

absl::StatusOr<v1::CheckpointFile> WriteDataFile(const std::string& dir, const std::string& name,
                                                 uint32_t tensor, uint64_t offset_elems,
                                                 uint64_t num_elems,
                                                 absl::Span<const float* const> arrays,
                                                 uint64_t max_bytes_per_second) {
  std::string header;
  header.append(kMagic, sizeof(kMagic));
  Put<uint32_t>(&header, kFormatVersion);
  Put<uint32_t>(&header, tensor);
  Put<uint64_t>(&header, offset_elems);
  Put<uint64_t>(&header, num_elems);
  Put<uint32_t>(&header, static_cast<uint32_t>(arrays.size()));
  Put<uint32_t>(&header, 0);
  uint32_t crc = Crc32c(0, header.data(), header.size());
  std::vector<absl::string_view> pieces = {header};
  for (const float* a : arrays) {
    pieces.emplace_back(reinterpret_cast<const char*>(a), num_elems * sizeof(float));
    crc = Crc32c(crc, a, num_elems * sizeof(float));
  }
  std::string trailer;
  Put<uint32_t>(&trailer, crc);
  pieces.push_back(trailer);
  const std::string path = absl::StrCat(dir, "/", name);
  if (auto s = WritePiecesAtomically(path, pieces, max_bytes_per_second); !s.ok()) return s;
  v1::CheckpointFile f;
  f.set_name(name);
  f.set_tensor(tensor);
  f.set_offset_elems(offset_elems);
  f.set_num_elems(num_elems);
  f.set_num_arrays(static_cast<uint32_t>(arrays.size()));
  f.set_size_bytes(kHeaderBytes + arrays.size() * num_elems * sizeof(float) + 4);
  f.set_crc32c(crc);
  return f;
}

absl::StatusOr<std::vector<float>> ReadDataFile(const std::string& dir,
                                                const v1::CheckpointFile& file) {
  const std::string path = absl::StrCat(dir, "/", file.name());
  absl::StatusOr<std::string> raw = ReadWholeFile(path);
  if (!raw.ok()) return raw.status();
  const std::string& b = *raw;
  if (b.size() != file.size_bytes()) {
    return Corrupt(path, absl::StrCat("it has ", b.size(), " bytes, the manifest says ",
                                      file.size_bytes()));
  }
  if (b.size() < kHeaderBytes + 4) return Corrupt(path, "shorter than its header");
  const uint32_t stored = Get<uint32_t>(b, b.size() - 4);
  const uint32_t actual = Crc32c(0, b.data(), b.size() - 4);
  if (stored != actual || actual != file.crc32c()) {
    return Corrupt(path, absl::StrFormat("checksum mismatch (computed crc32c %08x, file says "
                                         "%08x, manifest says %08x)",
                                         actual, stored, file.crc32c()));
  }
  if (std::memcmp(b.data(), kMagic, sizeof(kMagic)) != 0) return Corrupt(path, "bad magic");
  if (Get<uint32_t>(b, 8) != kFormatVersion) {
    return Corrupt(path, absl::StrCat("format version ", Get<uint32_t>(b, 8)));
  }
  if (Get<uint32_t>(b, 12) != file.tensor() || Get<uint64_t>(b, 16) != file.offset_elems() ||
      Get<uint64_t>(b, 24) != file.num_elems() || Get<uint32_t>(b, 32) != file.num_arrays()) {
    return Corrupt(path, "its header does not match the manifest");
  }
  const uint64_t floats = uint64_t{file.num_arrays()} * file.num_elems();
  if (kHeaderBytes + floats * 4 + 4 != b.size()) return Corrupt(path, "wrong length for its header");
  std::vector<float> out(floats);
  std::memcpy(out.data(), b.data() + kHeaderBytes, floats * 4);
  return out;
}

absl::Status VerifyCheckpoint(const std::string& dir, const v1::CheckpointManifest& manifest) {
  for (const v1::CheckpointFile& f : manifest.files()) {
    absl::StatusOr<std::vector<float>> data = ReadDataFile(dir, f);
    if (!data.ok()) return data.status();
  }
  return absl::OkStatus();
}

absl::Status ReadTensorRange(const std::string& dir, const v1::CheckpointManifest& manifest,
                             uint32_t tensor, uint64_t offset_elems, uint64_t num_elems,
                             absl::Span<float* const> dst) {
  const uint64_t end = offset_elems + num_elems;
  uint64_t covered = 0;
  for (const v1::CheckpointFile& f : manifest.files()) {
    if (f.tensor() != tensor) continue;
    const uint64_t lo = std::max(offset_elems, f.offset_elems());
    const uint64_t hi = std::min(end, f.offset_elems() + f.num_elems());
    if (lo >= hi) continue;
    if (f.num_arrays() != dst.size()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint file ", dir, "/", f.name(), " holds ", f.num_arrays(),
          " arrays; the job's optimizer keeps ", dst.size()));
    }
    absl::StatusOr<std::vector<float>> data = ReadDataFile(dir, f);
    if (!data.ok()) return data.status();
    for (size_t a = 0; a < dst.size(); ++a) {
      std::memcpy(dst[a] + (lo - offset_elems),
                  data->data() + a * f.num_elems() + (lo - f.offset_elems()),
                  (hi - lo) * sizeof(float));
    }
    covered += hi - lo;
  }
  if (covered != num_elems) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", dir, " covers ", covered, " of elements [", offset_elems, ", ", end,
        ") of tensor ", tensor));
  }
  return absl::OkStatus();
}

absl::Status WriteManifest(const std::string& dir, const v1::CheckpointManifest& manifest) {
  std::string text;
  if (!google::protobuf::TextFormat::PrintToString(manifest, &text)) {
    return absl::InternalError("cannot print the checkpoint manifest");
  }
  text = absl::StrCat("# optimus checkpoint manifest (protobuf text, optimus.v1.CheckpointManifest)\n",
                      text);
  absl::StrAppend(&text, kCrcLinePrefix,
                  absl::StrFormat("%08x", Crc32c(0, text.data(), text.size())), "\n");
  return WriteFileAtomically(absl::StrCat(dir, "/", kManifestName), text);
}

absl::StatusOr<v1::CheckpointManifest> ReadManifest(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kManifestName);
  absl::StatusOr<std::string> raw = ReadWholeFile(path);
  if (!raw.ok()) return raw.status();
  const size_t at = raw->rfind(kCrcLinePrefix);
  if (at == std::string::npos) return Corrupt(path, "no checksum line");
  uint32_t stored = 0;
  const std::string hex = raw->substr(at + sizeof(kCrcLinePrefix) - 1, 8);
  if (hex.size() != 8 || !absl::SimpleHexAtoi(hex, &stored)) {
    return Corrupt(path, "unreadable checksum line");
  }
  if (Crc32c(0, raw->data(), at) != stored) return Corrupt(path, "checksum mismatch");
  v1::CheckpointManifest m;
  if (!google::protobuf::TextFormat::ParseFromString(raw->substr(0, at), &m)) {
    return Corrupt(path, "not a valid manifest");
  }
  return m;
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents,
                                 uint64_t max_bytes_per_second) {
  const absl::string_view pieces[] = {contents};
  return WritePiecesAtomically(path, pieces, max_bytes_per_second);
}

absl::Status MakeDirs(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("empty folder path");
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = path.find('/', pos + 1);
    const std::string part = path.substr(0, pos);
    if (part.empty()) continue;
    if (mkdir(part.c_str(), 0755) != 0 && errno != EEXIST) {
      const int err = errno;
      const std::string msg = Errno("cannot create folder", part, err);
      return err == ENOSPC ? absl::ResourceExhaustedError(msg) : absl::InternalError(msg);
    }
  }
  struct stat st;
  if (stat(path.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InternalError(absl::StrCat(path, " is not a folder"));
  }
  return absl::OkStatus();
}

std::vector<std::string> ListDir(const std::string& path) {
  std::vector<std::string> out;
  DIR* d = opendir(path.c_str());
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") out.push_back(name);
  }
  closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

absl::Status RemoveTree(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return absl::InternalError(Errno("cannot stat", path, errno));
  }
  if (S_ISDIR(st.st_mode)) {
    for (const std::string& name : ListDir(path)) {
      if (auto s = RemoveTree(absl::StrCat(path, "/", name)); !s.ok()) return s;
    }
    if (rmdir(path.c_str()) != 0) return absl::InternalError(Errno("cannot remove", path, errno));
  } else if (unlink(path.c_str()) != 0) {
    return absl::InternalError(Errno("cannot remove", path, errno));
  }
  return absl::OkStatus();
}

}  // namespace ckpt
}  // namespace optimus
