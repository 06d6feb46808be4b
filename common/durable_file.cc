#include "common/durable_file.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"

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

std::array<uint32_t, 256> MakeCrcTable() {
  std::array<uint32_t, 256> table{};
  constexpr uint32_t kPoly = 0x82F63B78u;  // CRC-32C, reflected
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    table[i] = c;
  }
  return table;
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

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  const std::string tmp = path + ".tmp";
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return ErrnoToStatus(errno, "creating", tmp);
  auto fail = [&](int err, absl::string_view what) {
    ::unlink(tmp.c_str());
    return ErrnoToStatus(err, what, tmp);
  };
  const char* p = contents.data();
  size_t left = contents.size();
  while (left > 0) {
    const ssize_t n = ::write(fd.get(), p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail(errno, "writing");
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
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

absl::StatusOr<std::string> ReadWholeFile(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return ErrnoToStatus(errno, "opening", path);
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, "reading", path);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

uint32_t Crc32c(absl::string_view data, uint32_t crc) {
  static const std::array<uint32_t, 256> kTable = MakeCrcTable();
  crc = ~crc;
  for (unsigned char c : data) crc = kTable[(crc ^ c) & 0xff] ^ (crc >> 8);
  return ~crc;
}

absl::Status WriteChecksummedFile(const std::string& path, absl::string_view magic,
                                  absl::string_view payload) {
  std::string contents =
      absl::StrFormat("%s %08x %d\n", magic, Crc32c(payload), payload.size());
  contents.append(payload.data(), payload.size());
  return WriteFileAtomically(path, contents);
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
