// What the benchmarks' smoke tests share: running a benchmark from the
// test's runfiles and reading its JSON lines.
#ifndef OPTIMUS_BENCH_SMOKE_TEST_UTIL_H_
#define OPTIMUS_BENCH_SMOKE_TEST_UTIL_H_

#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_split.h"
#include "common/json.h"

namespace optimus {
namespace bench {

// The workspace's root in the test's runfiles.
inline std::string RunfilesRoot() { return std::string(std::getenv("TEST_SRCDIR")) + "/optimus"; }

// Runs `cmd` through the shell; its stdout, and in *status what pclose
// says (-1 when it could not start).
inline std::string CommandOutput(const std::string& cmd, int* status) {
  *status = -1;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return "";
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  *status = pclose(p);
  return out;
}

// A benchmark's stdout (its JSON lines; its log goes to the test's
// stderr). A nonzero exit fails the test.
inline std::string RunBenchCommand(const std::string& cmd) {
  int status = 0;
  std::string out = CommandOutput(cmd, &status);
  EXPECT_EQ(status, 0) << cmd;
  return out;
}

// A benchmark's JSON lines; a line that is not a JSON object fails the test
// and is left out.
inline std::vector<nlohmann::json> JsonLines(const std::string& out) {
  std::vector<nlohmann::json> lines;
  for (absl::string_view l : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
    nlohmann::json j = nlohmann::json::parse(l, nullptr, /*allow_exceptions=*/false);
    EXPECT_TRUE(j.is_object()) << l;
    if (j.is_object()) lines.push_back(std::move(j));
  }
  return lines;
}

}  // namespace bench
}  // namespace optimus

#endif  // OPTIMUS_BENCH_SMOKE_TEST_UTIL_H_
