#include "common/durable_file.h"

#if defined(__aarch64__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace optimus {
namespace {

// Closes a descriptor on scope exit.
class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  // Closes now and reports close's error (NFS reports write errors there).
  int Close() {
    const int r = ::close(fd_);
    fd_ = -1;
    return r;
  }

 private:
  int fd_;
};

std::string DirOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

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

}  // namespace

absl::Status ErrnoToStatus(int err, absl::string_view what, absl::string_view path) {
  const std::string msg = absl::StrCat(what, " ", path, ": ", ::strerror(err));
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return absl::ResourceExhaustedError(msg);
    case ENOENT:
      return absl::NotFoundError(msg);
    case EACCES:
    case EPERM:
    case EROFS:
      return absl::PermissionDeniedError(msg);
    case EISDIR:
    case ENOTDIR:
    case EEXIST:
      return absl::FailedPreconditionError(msg);
    default:
      return absl::InternalError(msg);
  }
}

absl::Status WritePiecesAtomically(const std::string& path,
                                   absl::Span<const absl::string_view> pieces,
                                   uint64_t max_bytes_per_second, unsigned mode) {
  const std::string tmp = path + ".tmp";
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode));
  if (fd.get() < 0) return ErrnoToStatus(errno, "creating", tmp);
  // A leftover temporary file keeps its old bits through O_TRUNC.
  if (::fchmod(fd.get(), mode) != 0) return ErrnoToStatus(errno, "setting the mode of", tmp);
  auto fail = [&](int err, absl::string_view what) {
    ::unlink(tmp.c_str());
    return ErrnoToStatus(err, what, tmp);
  };
  const absl::Time start = absl::Now();
  uint64_t written = 0;
  for (absl::string_view piece : pieces) {
    size_t done = 0;
    while (done < piece.size()) {
      const size_t want = std::min(kWritePieceBytes, piece.size() - done);
      const ssize_t n = ::write(fd.get(), piece.data() + done, want);
      if (n < 0) {
        if (errno == EINTR) continue;
        return fail(errno, "writing");
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
  if (::fsync(fd.get()) != 0) return fail(errno, "syncing");
  if (fd.Close() != 0) return fail(errno, "closing");
  if (::rename(tmp.c_str(), path.c_str()) != 0) return fail(errno, "renaming");
  // The rename itself is durable only once the folder is synced.
  const std::string dir = DirOf(path);
  Fd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.get() < 0) return ErrnoToStatus(errno, "opening folder", dir);
  if (::fsync(dfd.get()) != 0) return ErrnoToStatus(errno, "syncing folder", dir);
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents,
                                 uint64_t max_bytes_per_second, unsigned mode) {
  const absl::string_view pieces[] = {contents};
  return WritePiecesAtomically(path, pieces, max_bytes_per_second, mode);
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, uint64_t max_bytes) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer.
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) return ErrnoToStatus(errno, "opening", path);
  struct stat st;
  if (::fstat(fd.get(), &st) != 0) return ErrnoToStatus(errno, "inspecting", path);
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(path, " is not a regular file"));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return absl::OutOfRangeError(absl::StrCat(path, " has ", st.st_size,
                                              " bytes, more than the ", max_bytes, " expected"));
  }
  std::string out;
  out.reserve(static_cast<size_t>(st.st_size));
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, "reading", path);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > max_bytes) {
      return absl::OutOfRangeError(absl::StrCat(path, " grew past ", max_bytes, " bytes"));
    }
  }
  return out;
}

uint32_t Crc32cPortable(uint32_t crc, const void* data, size_t size_bytes) {
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

namespace {

// The CPU's own CRC-32C instruction (SSE4.2 on x86-64, the ARMv8 CRC
// extension that BlueField's Cortex-A72/A78 cores have): several times the
// table's speed, which is most of a checkpoint's CPU cost.
#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(uint32_t crc, const void* data,
                                                           size_t size_bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t c = ~crc;
  while (size_bytes >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
    p += 8;
    size_bytes -= 8;
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  while (size_bytes-- > 0) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return ~c32;
}
bool HasHardwareCrc32c() { return __builtin_cpu_supports("sse4.2"); }
#elif defined(__aarch64__)
__attribute__((target("+crc"))) uint32_t Crc32cHardware(uint32_t crc, const void* data,
                                                         size_t size_bytes) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (size_bytes >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_aarch64_crc32cx(c, v);
    p += 8;
    size_bytes -= 8;
  }
  while (size_bytes-- > 0) c = __builtin_aarch64_crc32cb(c, *p++);
  return ~c;
}
bool HasHardwareCrc32c() { return (getauxval(AT_HWCAP) & HWCAP_CRC32) != 0; }
#else
uint32_t Crc32cHardware(uint32_t crc, const void* data, size_t size_bytes) {
  return Crc32cPortable(crc, data, size_bytes);
}
bool HasHardwareCrc32c() { return false; }
#endif

}  // namespace

bool Crc32cIsHardware() {
  static const bool hw = HasHardwareCrc32c();
  return hw;
}

uint32_t Crc32c(uint32_t crc, const void* data, size_t size_bytes) {
  return Crc32cIsHardware() ? Crc32cHardware(crc, data, size_bytes)
                            : Crc32cPortable(crc, data, size_bytes);
}

absl::Status WriteChecksummedFile(const std::string& path, absl::string_view magic,
                                  absl::string_view payload, unsigned mode) {
  std::string contents =
      absl::StrFormat("%s %08x %d\n", magic, Crc32c(payload), payload.size());
  contents.append(payload.data(), payload.size());
  return WriteFileAtomically(path, contents, 0, mode);
}

absl::StatusOr<std::string> ReadChecksummedFile(const std::string& path,
                                                absl::string_view magic) {
  absl::StatusOr<std::string> contents = ReadWholeFile(path);
  if (!contents.ok()) return contents.status();
  const size_t eol = contents->find('\n');
  auto corrupt = [&](absl::string_view why) {
    return absl::DataLossError(absl::StrCat(path, " is corrupted: ", why));
  };
  if (eol == std::string::npos) return corrupt("no header line");
  const std::vector<std::string> fields =
      absl::StrSplit(absl::string_view(*contents).substr(0, eol), ' ');
  if (fields.size() != 3 || fields[0] != magic) {
    return corrupt(absl::StrCat("header is not \"", magic, " <crc> <size>\""));
  }
  uint32_t crc = 0;
  uint64_t size = 0;
  if (!absl::SimpleHexAtoi(fields[1], &crc) || !absl::SimpleAtoi(fields[2], &size)) {
    return corrupt("unreadable header numbers");
  }
  std::string payload = contents->substr(eol + 1);
  if (payload.size() != size) {
    return corrupt(absl::StrCat("payload is ", payload.size(), " bytes, header says ", size));
  }
  if (Crc32c(payload) != crc) return corrupt("checksum mismatch");
  return payload;
}

}  // namespace optimus
