// Fuzz target: reading a checkpoint back (common/checkpoint_files.h) as the
// coordinator does before a restore (CheckpointManager::List, Last and
// PrepareRestore: find the folder, read the manifest, verify every data
// file), then what the restore does with it: check the manifest's job spec
// (CheckAndFillSpec), count the optimizer steps per tensor, and read every
// tensor's range back as a shard would (ReadTensorRange). A checkpoint
// folder is a shared filesystem anyone with write access can change: every
// read must end in an error, never a crash, a huge allocation or a read out
// of bounds.
//
// Input layout (tests/fuzz/corpus/checkpoint/ is made by make_seeds):
//   byte 0           flags: kSealManifest, kSealFiles
//   then segments separated by kSeparator:
//     segment 0      MANIFEST's text (protobuf text format)
//     segment i >= 1 the data file the manifest's files[i-1] names
// kSealManifest appends the checksum line the manifest needs; kSealFiles
// also sets each file record's size and checksum (and the file's trailer)
// to match its segment, so that inputs reach the checks behind them.
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/checkpoint_files.h"
#include "common/durable_file.h"
#include "coordinator/checkpoints.h"
#include "coordinator/job_spec.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/text_format.h"
#include "proto/optimus.pb.h"

namespace {

constexpr char kSeparator[] = "\n=FILE=\n";
constexpr uint8_t kSealManifest = 1;
constexpr uint8_t kSealFiles = 2;
constexpr char kJob[] = "fuzzjob";
constexpr uint64_t kCheckpointId = 7;
// Tensors bigger than this are not read back (the fuzzer would spend its
// time allocating); their manifests and files are still checked.
constexpr uint64_t kMaxReadElems = uint64_t{1} << 16;

void Require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "checkpoint_fuzzer: invariant broken: %s\n", what);
    std::abort();
  }
}

// The harness's own rule for names it writes (it must never write outside
// its folder, whatever the code under test thinks of a name).
bool SafeName(const std::string& n) {
  if (n.empty() || n.size() > 128 || n == "." || n == ".." || n == "MANIFEST") return false;
  for (char c : n) {
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
          c == '.' || c == '_' || c == '-')) {
      return false;
    }
  }
  return true;
}

void WriteFile(const std::string& path, absl::string_view bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  Require(f != nullptr, "the harness can write its folder");
  if (!bytes.empty()) std::fwrite(bytes.data(), 1, bytes.size(), f);
  std::fclose(f);
}

std::string WithChecksum(std::string text) {
  absl::StrAppend(&text, "# crc32c=",
                  absl::StrFormat("%08x", optimus::Crc32c(0, text.data(), text.size())), "\n");
  return text;
}

struct Folder {
  std::string root;  // The coordinator's --checkpoint_dir.
  std::string dir;   // root/kJob/ckpt-000007
  optimus::CheckpointManager* manager = nullptr;
};

const Folder& TheFolder() {
  static const Folder* folder = [] {
    auto* f = new Folder;
    // The text-format parser's complaints about malformed manifests would
    // flood the log; ReadManifest's status says what matters.
    google::protobuf::SetLogHandler(nullptr);
    const char* base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : std::getenv("TMPDIR");
    std::string tmpl = absl::StrCat(base != nullptr ? base : "/tmp", "/ckpt_fuzz.XXXXXX");
    Require(mkdtemp(&tmpl[0]) != nullptr, "mkdtemp");
    f->root = tmpl;
    f->dir = absl::StrCat(f->root, "/", kJob, "/", optimus::ckpt::FolderName(kCheckpointId));
    f->manager = new optimus::CheckpointManager(f->root);
    std::atexit([] { (void)optimus::ckpt::RemoveTree(TheFolder().root); });
    return f;
  }();
  return *folder;
}

// Whether the files of `tensor` tile [lo, lo + n) exactly: every element
// in exactly one file (the harness's own reckoning, to check
// ReadTensorRange's).
bool TiledExactly(const optimus::v1::CheckpointManifest& m, uint32_t tensor, uint64_t lo,
                  uint64_t n) {
  std::vector<std::pair<uint64_t, uint64_t>> parts;  // [begin, end) within the range.
  for (const optimus::v1::CheckpointFile& f : m.files()) {
    if (f.tensor() != tensor) continue;
    const uint64_t fb = f.offset_elems();
    uint64_t fe = 0;
    if (__builtin_add_overflow(fb, f.num_elems(), &fe)) fe = UINT64_MAX;
    const uint64_t b = std::max(lo, fb), e = std::min(lo + n, fe);
    if (b < e) parts.emplace_back(b, e);
  }
  std::sort(parts.begin(), parts.end());
  uint64_t at = lo;
  for (const auto& [b, e] : parts) {
    if (b != at) return false;  // A gap or an overlap.
    at = e;
  }
  return at == lo + n;
}

// What a restore does with an accepted manifest, after the coordinator
// verified it.
void ReadBack(const std::string& dir, const optimus::v1::CheckpointManifest& m) {
  auto steps = optimus::ckpt::OptimizerStepsOf(dir, m);
  if (steps.ok()) Require(steps->size() == static_cast<size_t>(m.spec().tensors_size()), "steps per tensor");
  optimus::v1::JobSpec spec = m.spec();
  absl::StatusOr<optimus::CheckedSpec> checked = optimus::CheckAndFillSpec(spec);
  if (!checked.ok()) return;
  const uint64_t arrays = checked->state_bytes_per_elem / 4;
  for (size_t t = 0; t < checked->tensor_num_elems.size() && t < 8; ++t) {
    const uint64_t n = checked->tensor_num_elems[t];
    if (n > kMaxReadElems) continue;
    std::vector<std::vector<float>> bufs(arrays, std::vector<float>(n));
    std::vector<float*> dst;
    for (auto& b : bufs) dst.push_back(b.data());
    // The whole tensor, and a shard's chunk: its second half.
    for (const uint64_t lo : {uint64_t{0}, n / 2}) {
      if (lo == n) continue;
      const uint32_t tensor = static_cast<uint32_t>(t);
      if (optimus::ckpt::ReadTensorRange(dir, m, tensor, lo, n - lo, dst).ok()) {
        Require(TiledExactly(m, tensor, lo, n - lo),
                "ReadTensorRange accepts only files that cover the range exactly once");
      }
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t flags = data[0];
  const absl::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  std::vector<std::string> segments = absl::StrSplit(body, kSeparator);
  const Folder& folder = TheFolder();
  (void)optimus::ckpt::RemoveTree(folder.dir);
  Require(optimus::ckpt::MakeDirs(folder.dir).ok(), "the harness can make its folder");

  std::string manifest_text = segments[0];
  optimus::v1::CheckpointManifest parsed;
  const bool parses = google::protobuf::TextFormat::ParseFromString(manifest_text, &parsed);
  if (parses && (flags & kSealFiles) != 0) {
    for (int i = 0; i < parsed.files_size() && i + 1 < static_cast<int>(segments.size()); ++i) {
      std::string& file = segments[i + 1];
      optimus::v1::CheckpointFile* rec = parsed.mutable_files(i);
      rec->set_size_bytes(file.size());
      if (file.size() >= 4) {
        const uint32_t crc = optimus::Crc32c(0, file.data(), file.size() - 4);
        std::memcpy(&file[file.size() - 4], &crc, 4);
        rec->set_crc32c(crc);
      }
    }
    manifest_text.clear();
    google::protobuf::TextFormat::PrintToString(parsed, &manifest_text);
  }
  if ((flags & (kSealManifest | kSealFiles)) != 0) manifest_text = WithChecksum(manifest_text);
  WriteFile(absl::StrCat(folder.dir, "/", optimus::ckpt::kManifestName), manifest_text);
  if (parses) {
    for (int i = 0; i < parsed.files_size() && i + 1 < static_cast<int>(segments.size()); ++i) {
      if (SafeName(parsed.files(i).name())) {
        WriteFile(absl::StrCat(folder.dir, "/", parsed.files(i).name()), segments[i + 1]);
      }
    }
  }

  // The library's readers on their own.
  absl::StatusOr<optimus::v1::CheckpointManifest> m = optimus::ckpt::ReadManifest(folder.dir);
  if (m.ok()) {
    for (const optimus::v1::CheckpointFile& f : m->files()) {
      Require(optimus::ckpt::CheckFileRecord(f).ok(), "ReadManifest checks every record");
      auto file = optimus::ckpt::ReadDataFile(folder.dir, f);
      if (file.ok()) {
        Require(file->size() == uint64_t{f.num_arrays()} * f.num_elems(),
                "a data file holds what its record says");
      }
    }
    (void)optimus::ckpt::VerifyCheckpoint(folder.dir, *m);
  } else {
    const absl::StatusCode c = m.status().code();
    Require(c == absl::StatusCode::kDataLoss || c == absl::StatusCode::kNotFound,
            "a bad manifest is DATA_LOSS");
  }

  // The coordinator's reads, as a restore makes them.
  optimus::CheckpointManager& manager = *folder.manager;
  (void)manager.List(kJob);
  (void)manager.Last(kJob);
  optimus::v1::CheckpointInfo info;
  absl::StatusOr<optimus::v1::RestoreSource> src = manager.PrepareRestore(kJob, 0, &info);
  Require(!src.ok() || m.ok(), "PrepareRestore accepts only a readable manifest");
  if (src.ok()) ReadBack(folder.dir, src->manifest());
  return 0;
}
