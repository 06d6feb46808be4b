#include "common/checkpoint_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/durable_file.h"
#include "google/protobuf/text_format.h"

namespace optimus {
namespace ckpt {
namespace {

constexpr char kMagic[8] = {'O', 'P', 'T', 'C', 'K', 'P', 'T', '1'};
constexpr char kCrcLinePrefix[] = "# crc32c=";

std::string Errno(const std::string& what, const std::string& path, int err) {
  return absl::StrCat(what, " ", path, ": ", std::strerror(err));
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

absl::Status CheckFileName(absl::string_view name) {
  if (name.empty() || name.size() > 128) {
    return absl::InvalidArgumentError(
        absl::StrCat("data file name of ", name.size(), " characters (1 to 128 allowed)"));
  }
  if (name == "." || name == "..") {
    return absl::InvalidArgumentError(absl::StrCat("data file name '", name, "'"));
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat(
          "data file name '", absl::CHexEscape(name),
          "' holds a character other than letters, digits, '.', '_' and '-'"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckFileRecord(const v1::CheckpointFile& file) {
  if (absl::Status s = CheckFileName(file.name()); !s.ok()) return s;
  // kHeaderBytes + num_arrays * num_elems * 4 + 4, each step checked.
  uint64_t floats = 0, bytes = 0;
  if (__builtin_mul_overflow(uint64_t{file.num_arrays()}, file.num_elems(), &floats) ||
      __builtin_mul_overflow(floats, uint64_t{4}, &bytes) ||
      __builtin_add_overflow(bytes, uint64_t{kHeaderBytes + 4}, &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat("data file ", file.name(), " claims ",
                                                   file.num_arrays(), " arrays of ",
                                                   file.num_elems(), " elements: too large"));
  }
  if (bytes != file.size_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "data file ", file.name(), " claims ", file.size_bytes(), " bytes; ", file.num_arrays(),
        " arrays of ", file.num_elems(), " elements make ", bytes));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<float>> ReadDataFile(const std::string& dir,
                                                const v1::CheckpointFile& file) {
  if (absl::Status s = CheckFileRecord(file); !s.ok()) {
    return absl::DataLossError(absl::StrCat("checkpoint ", dir, " lists a bad file: ", s.message()));
  }
  const std::string path = absl::StrCat(dir, "/", file.name());
  absl::StatusOr<std::string> raw = ReadWholeFile(path, file.size_bytes());
  if (absl::IsOutOfRange(raw.status()) || absl::IsFailedPrecondition(raw.status())) {
    return Corrupt(path, raw.status().message());
  }
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
  // CheckFileRecord bounded these (their product fits and matches the size).
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
  uint64_t end = 0;
  if (__builtin_add_overflow(offset_elems, num_elems, &end)) {
    return absl::InvalidArgumentError(absl::StrCat("elements [", offset_elems, ", +", num_elems,
                                                   ") of tensor ", tensor, " overflow"));
  }
  // The files holding part of the range, in element order. They must tile
  // it: a gap leaves elements unrestored, an overlap means the manifest
  // contradicts itself (found by //tests/fuzz:checkpoint: counting covered
  // elements let an overlap hide a gap).
  struct Piece {
    uint64_t lo, hi;
    const v1::CheckpointFile* file;
  };
  std::vector<Piece> pieces;
  for (const v1::CheckpointFile& f : manifest.files()) {
    if (f.tensor() != tensor) continue;
    uint64_t f_end = 0;
    if (__builtin_add_overflow(f.offset_elems(), f.num_elems(), &f_end)) f_end = UINT64_MAX;
    const uint64_t lo = std::max(offset_elems, f.offset_elems());
    const uint64_t hi = std::min(end, f_end);
    if (lo < hi) pieces.push_back(Piece{lo, hi, &f});
  }
  std::sort(pieces.begin(), pieces.end(),
            [](const Piece& a, const Piece& b) { return a.lo < b.lo; });
  uint64_t covered_to = offset_elems;
  for (const Piece& p : pieces) {
    if (p.lo < covered_to) {
      return absl::DataLossError(absl::StrCat("checkpoint ", dir, ": files of tensor ", tensor,
                                              " overlap at element ", p.lo, " (", p.file->name(),
                                              ")"));
    }
    if (p.lo > covered_to) break;  // A gap: reported below.
    covered_to = p.hi;
  }
  if (covered_to != end) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", dir, " covers elements [", offset_elems, ", ", covered_to, ") of [",
        offset_elems, ", ", end, ") of tensor ", tensor));
  }
  for (const Piece& p : pieces) {
    const v1::CheckpointFile& f = *p.file;
    if (f.num_arrays() != dst.size()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint file ", dir, "/", f.name(), " holds ", f.num_arrays(),
          " arrays; the job's optimizer keeps ", dst.size()));
    }
    absl::StatusOr<std::vector<float>> data = ReadDataFile(dir, f);
    if (!data.ok()) return data.status();
    for (size_t a = 0; a < dst.size(); ++a) {
      std::memcpy(dst[a] + (p.lo - offset_elems),
                  data->data() + a * f.num_elems() + (p.lo - f.offset_elems()),
                  (p.hi - p.lo) * sizeof(float));
    }
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
  // A manifest lists files and a job spec: far below 256 MiB.
  absl::StatusOr<std::string> raw = ReadWholeFile(path, uint64_t{256} << 20);
  if (absl::IsOutOfRange(raw.status()) || absl::IsFailedPrecondition(raw.status())) {
    return Corrupt(path, raw.status().message());
  }
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
  for (const v1::CheckpointFile& f : m.files()) {
    if (absl::Status s = CheckFileRecord(f); !s.ok()) return Corrupt(path, s.message());
  }
  return m;
}

absl::Status MakeDirs(const std::string& path) {
  namespace fs = std::filesystem;
  if (path.empty()) return absl::InvalidArgumentError("empty folder path");
  // Component by component (not fs::create_directories) so that each new
  // folder gets mkdir's 0755 under the umask: create_directory uses 0777.
  fs::path so_far;
  for (const fs::path& part : fs::path(path)) {
    so_far /= part;
    if (part.empty() || so_far == so_far.root_path()) continue;
    std::error_code ec;
    if (fs::create_directory(so_far, ec)) {
      fs::permissions(so_far, fs::perms::group_write | fs::perms::others_write,
                      fs::perm_options::remove, ec);
    }
    // A file in the way (EEXIST) is reported below as "not a folder".
    if (ec && ec.value() != EEXIST) {
      const std::string msg = Errno("cannot create folder", so_far.string(), ec.value());
      return ec.value() == ENOSPC ? absl::ResourceExhaustedError(msg) : absl::InternalError(msg);
    }
  }
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    return absl::InternalError(absl::StrCat(path, " is not a folder"));
  }
  return absl::OkStatus();
}

std::vector<std::string> ListDir(const std::string& path) {
  namespace fs = std::filesystem;
  std::vector<std::string> out;
  std::error_code ec;
  for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    out.push_back(it->path().filename().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

absl::Status RemoveTree(const std::string& path) {
  // Symbolic links are removed, never followed; a missing path removes
  // nothing and is no error.
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return absl::InternalError(Errno("cannot remove", path, ec.value()));
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint64_t>> OptimizerStepsOf(const std::string& dir,
                                                       const v1::CheckpointManifest& m) {
  const int n = m.spec().tensors_size();
  std::vector<uint64_t> steps(n, 0);
  std::vector<const v1::CheckpointFile*> first(n, nullptr);
  bool any = false;
  for (const v1::CheckpointFile& f : m.files()) {
    if (f.tensor() >= static_cast<uint32_t>(n)) {
      return absl::DataLossError(absl::StrCat(dir, ": file ", f.name(), " names tensor ",
                                              f.tensor(), " of ", n));
    }
    any = any || f.optimizer_steps() > 0;
    const v1::CheckpointFile*& seen = first[f.tensor()];
    if (seen == nullptr) {
      seen = &f;
      steps[f.tensor()] = f.optimizer_steps();
    } else if (seen->optimizer_steps() != f.optimizer_steps()) {
      return absl::DataLossError(absl::StrCat(
          dir, ": tensor \"", m.spec().tensors(f.tensor()).name(), "\" has files with ",
          seen->optimizer_steps(), " optimizer steps (", seen->name(), ") and ",
          f.optimizer_steps(), " (", f.name(), ")"));
    }
  }
  // Written before shards recorded optimizer_steps: every tensor took every
  // step, as the export counted them then.
  if (!any && m.step() > 1) {
    for (int t = 0; t < n; ++t) steps[t] = m.spec().tensors(t).frozen() ? 0 : m.step() - 1;
  }
  return steps;
}

}  // namespace ckpt
}  // namespace optimus
